//! The fan-out engine through the real binary: one reader per bus shard hands each event to
//! the subscriptions the compiled rule index picks. These tests check that the index agrees
//! with each rule's own filter on random rule sets (both modes), that a slow target among a
//! hundred rules delays no other, that one connector among many can be paused, resumed and
//! restarted, and that a replica kill with a thousand rules loses nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice::event;
use sluice_functions::{CesqlFilter, Pattern};
use sluice_tests::receiver::{Receiver, Reply};
use sluice_tests::{ids, post_batch, read_jsonl, shared_redis, Sluice};

/// A rule's condition: an EventBridge pattern or a CESQL filter.
#[derive(Debug, Clone)]
enum Condition {
    Pattern(Value),
    Filter(String),
}

impl Condition {
    /// The single-rule matcher: what the rule's own filter says of the event.
    fn matches(&self, event: &cloudevents::Event) -> bool {
        match self {
            Condition::Pattern(p) => Pattern::compile(p).unwrap().matches(event),
            Condition::Filter(f) => CesqlFilter::parse(f).unwrap().matches(event),
        }
    }

    fn toml(&self) -> String {
        match self {
            Condition::Pattern(p) => format!("pattern = {}", toml_inline(p)),
            Condition::Filter(f) => format!("filter = {}", Value::String(f.clone())),
        }
    }
}

/// JSON as a TOML inline value (strings, numbers, booleans, arrays, tables).
fn toml_inline(v: &Value) -> String {
    match v {
        Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{} = {}", Value::String(k.clone()), toml_inline(v)))
                .collect();
            format!("{{ {} }}", fields.join(", "))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(toml_inline).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

const TYPES: [&str; 5] = [
    "order.created",
    "order.paid",
    "user.signup",
    "user.deleted",
    "Ping",
];
const SOURCES: [&str; 4] = ["/shop/eu", "/shop/us", "/auth", "/ops"];
const REGIONS: [&str; 3] = ["eu", "us", "ap"];
const TAGS: [&str; 3] = ["a", "b", "c"];

fn pick<'a>(rng: &mut fastrand::Rng, items: &[&'a str]) -> &'a str {
    items[rng.usize(..items.len())]
}

/// A random condition over the fields the events carry, in the shapes users write.
fn random_condition(rng: &mut fastrand::Rng) -> Condition {
    let t = pick(rng, &TYPES);
    let r = pick(rng, &REGIONS);
    let x = rng.u32(0..200);
    match rng.u32(0..14) {
        0 => Condition::Pattern(json!({"type": [t]})),
        1 => Condition::Pattern(json!({"type": [{"prefix": &t[..3]}]})),
        2 => Condition::Pattern(json!({"source": [{"prefix": "/shop"}], "region": [r]})),
        3 => Condition::Pattern(json!({"data": {"total": [{"numeric": [">", x, "<=", x + 50]}]}})),
        4 => Condition::Pattern(json!({"type": [{"anything-but": [t]}]})),
        5 => Condition::Pattern(json!({"region": [{"exists": false}]})),
        6 => Condition::Pattern(json!({"data": {"tags": [pick(rng, &TAGS)]}})),
        7 => Condition::Pattern(json!({"$or": [{"type": [t]}, {"region": [r]}]})),
        8 => Condition::Pattern(json!({"type": [t], "data": {"total": [{"numeric": [">=", x]}]}})),
        9 => Condition::Pattern(json!({"type": [{"equals-ignore-case": t.to_uppercase()}]})),
        10 => Condition::Pattern(json!({"source": [{"suffix": "/eu"}, {"wildcard": "/a*h"}]})),
        11 => Condition::Filter(format!("type = '{t}' OR region = '{r}'")),
        12 => Condition::Filter(format!(
            "type LIKE 'user.%' AND source <> '{}'",
            pick(rng, &SOURCES)
        )),
        _ => Condition::Pattern(json!({})),
    }
}

fn random_event(rng: &mut fastrand::Rng, id: &str) -> Value {
    let mut event = json!({
        "specversion": "1.0",
        "id": id,
        "source": pick(rng, &SOURCES),
        "type": pick(rng, &TYPES),
        "partitionkey": format!("k{}", rng.u32(0..8)),
        "datacontenttype": "application/json",
        "data": {
            "total": rng.u32(0..250),
            "tags": TAGS.iter().filter(|_| rng.bool()).collect::<Vec<_>>(),
        }
    });
    if rng.u32(0..4) > 0 {
        event["region"] = json!(pick(rng, &REGIONS));
    }
    event
}

/// Rules `r{i}`, each to its own file `{data_dir}/r{i}.jsonl`.
fn rules_toml(conditions: &[Condition]) -> String {
    let mut text = String::new();
    for (i, c) in conditions.iter().enumerate() {
        text.push_str(&format!(
            "\n[[rules]]\nname = \"r{i}\"\nbus = \"default\"\n{}\n\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{{data_dir}}/r{i}.jsonl\"\n",
            c.toml()
        ));
    }
    text
}

/// Committed positions of every lane of bus `default`, per shard: (shared, own).
type ShardPositions = BTreeMap<u32, (u64, BTreeMap<String, u64>)>;

/// Reads the committed positions of bus `default` (the embedded store's `groups.json`).
fn embedded_positions(data_dir: &Path) -> ShardPositions {
    let text = std::fs::read_to_string(data_dir.join("groups.json")).unwrap_or_default();
    let groups: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let mut out = ShardPositions::new();
    for (key, g) in groups.as_object().into_iter().flatten() {
        let Some(shard) = key.strip_prefix("default#") else {
            continue;
        };
        let own = g["own"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect();
        out.insert(
            shard.parse().unwrap(),
            (g["shared"].as_u64().unwrap_or(0), own),
        );
    }
    out
}

/// The same from Redis (each shard's `pos` hash).
async fn redis_positions(url: &str, prefix: &str, shards: u32) -> ShardPositions {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut out = ShardPositions::new();
    for shard in 0..shards {
        let fields: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(sluice_tests::redis::shard_key(
                prefix, "default", shard, "pos",
            ))
            .query_async(&mut conn)
            .await
            .unwrap();
        let shared = fields
            .get("~shared")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let own = fields
            .iter()
            .filter(|(k, _)| !k.starts_with('~'))
            .map(|(k, v)| (k.clone(), v.parse().unwrap()))
            .collect();
        out.insert(shard, (shared, own));
    }
    out
}

/// Runs random rule sets through a gateway and checks that every rule received exactly the
/// events its own filter accepts, each once, in the order posted per partition key.
async fn index_agrees_with_each_rule(distributed: Option<(String, String)>, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let conditions: Vec<Condition> = (0..60).map(|_| random_condition(&mut rng)).collect();
    let mut builder = Sluice::builder()
        .durability("os")
        .extra(&rules_toml(&conditions));
    if let Some((url, prefix)) = &distributed {
        builder = builder.distributed(url, prefix);
    }
    let sluice = builder.start().await;
    let client = reqwest::Client::new();
    let mut events = Vec::new();
    for batch in 0..6 {
        let chunk: Vec<Value> = (0..50)
            .map(|i| random_event(&mut rng, &format!("e{}", batch * 50 + i)))
            .collect();
        post_batch(&client, &sluice.events_url(), chunk.clone()).await;
        events.extend(chunk);
    }
    // Positive marker: every subscription's committed position is at the end of its shard,
    // so nothing more will be delivered.
    let total = events.len() as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let positions = match &distributed {
            None => embedded_positions(sluice.data_dir()),
            Some((url, prefix)) => redis_positions(url, prefix, 4).await,
        };
        let at_end: u64 = positions.values().map(|(s, _)| *s).sum();
        let lagging: usize = positions.values().map(|(_, own)| own.len()).sum();
        if at_end == total && lagging == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "positions never reached the end: {positions:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let decoded: Vec<cloudevents::Event> = events
        .iter()
        .map(|e| event::decode(e.to_string().as_bytes()).unwrap())
        .collect();
    for (i, condition) in conditions.iter().enumerate() {
        let expected: Vec<String> = events
            .iter()
            .zip(&decoded)
            .filter(|(_, d)| condition.matches(d))
            .map(|(e, _)| e["id"].as_str().unwrap().to_string())
            .collect();
        let delivered = read_jsonl(&sluice.data_dir().join(format!("r{i}.jsonl")));
        let got = ids(&delivered);
        let distinct: HashSet<&String> = got.iter().collect();
        assert_eq!(distinct.len(), got.len(), "rule r{i} got duplicates");
        let mut want_sorted = expected.clone();
        want_sorted.sort();
        let mut got_sorted = got.clone();
        got_sorted.sort();
        assert_eq!(
            got_sorted, want_sorted,
            "rule r{i} ({condition:?}) disagrees with its own filter"
        );
        // Order per partition key (a key's events share a shard).
        let key_of: HashMap<&str, &str> = events
            .iter()
            .map(|e| {
                (
                    e["id"].as_str().unwrap(),
                    e["partitionkey"].as_str().unwrap(),
                )
            })
            .collect();
        let mut per_key: HashMap<&str, Vec<&str>> = HashMap::new();
        for id in &got {
            per_key.entry(key_of[id.as_str()]).or_default().push(id);
        }
        for (key, got_ids) in per_key {
            let want: Vec<&str> = expected
                .iter()
                .map(String::as_str)
                .filter(|id| key_of[id] == key)
                .collect();
            assert_eq!(got_ids, want, "rule r{i}: key {key} out of order");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_and_each_rules_own_filter_agree_through_the_gateway_standalone() {
    for seed in [7, 1234] {
        index_agrees_with_each_rule(None, seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_and_each_rules_own_filter_agree_through_the_gateway_distributed() {
    let (url, prefix) = shared_redis("fanout-agree");
    index_agrees_with_each_rule(Some((url, prefix)), 99).await;
}

/// Rules `r1`..`r{n-1}` take type `t{i}` into `{data_dir}/r{i}.jsonl`.
fn typed_rules(n: usize) -> String {
    (1..n)
        .map(|i| {
            format!(
                "\n[[rules]]\nname = \"r{i}\"\nbus = \"default\"\npattern = {{ type = [\"t{i}\"] }}\n\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{{data_dir}}/r{i}.jsonl\"\n"
            )
        })
        .collect()
}

fn typed_event(id: &str, ty: &str) -> Value {
    json!({
        "specversion": "1.0", "id": id, "source": "/tests", "type": ty,
        "datacontenttype": "application/json", "data": {"id": id}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_target_on_one_rule_of_a_hundred_does_not_delay_the_others() {
    let slow = Receiver::start().await;
    slow.default_reply(Reply::Hang);
    let extra = format!(
        "{}\n[[rules]]\nname = \"slow\"\nbus = \"default\"\npattern = {{ type = [{{ prefix = \"t\" }}] }}\n\n[[rules.targets]]\ntype = \"http\"\nname = \"hangs\"\nurl = \"{}\"\ntimeout = \"2s\"\n",
        typed_rules(100),
        slow.url("/hook")
    );
    let sluice = Sluice::builder()
        .durability("os")
        .extra(&extra)
        .start()
        .await;
    let client = reqwest::Client::new();
    let total = 3000;
    for batch in 0..(total / 100) {
        let chunk: Vec<Value> = (0..100)
            .map(|i| {
                let n = batch * 100 + i;
                typed_event(&format!("e{n}"), &format!("t{}", n % 99 + 1))
            })
            .collect();
        post_batch(&client, &sluice.events_url(), chunk).await;
    }
    // Every fast rule gets all of its events while the slow target has not answered once.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let delivered: usize = (1..100)
            .map(|i| read_jsonl(&sluice.data_dir().join(format!("r{i}.jsonl"))).len())
            .sum();
        if delivered == total {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the fast rules delivered {delivered} of {total} while one target hangs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(slow.accepted(), 0, "the slow target never answered");
    // The slow subscription fell behind and catches up on its own once its target answers.
    slow.default_reply(Reply::Status(200));
    let received = slow
        .wait_for(Duration::from_secs(120), |r| {
            r.iter()
                .filter_map(|r| r.header("ce-id"))
                .collect::<HashSet<_>>()
                .len()
                == total
        })
        .await;
    eprintln!(
        "slow target: {} requests for {total} events",
        received.len()
    );
}

async fn admin(sluice: &Sluice, path: &str) {
    let r = reqwest::Client::new()
        .post(sluice.url(path))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202, "{path}");
}

/// Waits until every lane (4 shards) of the connector has the state.
async fn wait_lane_state(sluice: &Sluice, connector: &str, state: &str) {
    sluice.wait_states(&format!("{connector}#"), state, 4).await;
}

/// `got` holds exactly `want`'s ids, and in `want`'s order within each shard (events
/// without a partition key are spread over the 4 shards by id).
fn assert_in_shard_order(got: &[String], want: &[String], what: &str) {
    let mut a = got.to_vec();
    a.sort();
    let mut b = want.to_vec();
    b.sort();
    assert_eq!(a, b, "{what}");
    for shard in 0..4 {
        let of = |ids: &[String]| -> Vec<String> {
            ids.iter()
                .filter(|id| sluice::event::shard_of(id, 4) == shard)
                .cloned()
                .collect()
        };
        assert_eq!(of(got), of(want), "{what}: shard {shard} out of order");
    }
}

fn rule_ids(sluice: &Sluice, i: usize) -> Vec<String> {
    ids(&read_jsonl(&sluice.data_dir().join(format!("r{i}.jsonl"))))
}

async fn post_typed(sluice: &Sluice, prefix: &str, rules: usize, count: usize) {
    let client = reqwest::Client::new();
    let events: Vec<Value> = (0..count)
        .map(|n| {
            typed_event(
                &format!("{prefix}{n}"),
                &format!("t{}", n % (rules - 1) + 1),
            )
        })
        .collect();
    for chunk in events.chunks(100) {
        post_batch(&client, &sluice.events_url(), chunk.to_vec()).await;
    }
}

async fn wait_rules(sluice: &Sluice, rules: usize, expect: impl Fn(usize) -> usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let short: Vec<(usize, usize)> = (1..rules)
            .map(|i| (i, rule_ids(sluice, i).len()))
            .filter(|(i, n)| *n != expect(*i))
            .collect();
        if short.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "rules not at their expected counts: {short:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connector_among_many_pauses_resumes_and_restarts() {
    let rules = 21;
    let sluice = Sluice::builder()
        .durability("os")
        .extra(&typed_rules(rules))
        .start()
        .await;
    post_typed(&sluice, "a", rules, 200).await;
    wait_rules(&sluice, rules, |_| 10).await;

    admin(&sluice, "/admin/connectors/default/r5/f/pause").await;
    wait_lane_state(&sluice, "default/r5/f", "PAUSED").await;
    post_typed(&sluice, "b", rules, 200).await;
    // Everyone else gets the new events; r5 keeps what it had.
    wait_rules(&sluice, rules, |i| if i == 5 { 10 } else { 20 }).await;
    assert_eq!(rule_ids(&sluice, 5).len(), 10);

    admin(&sluice, "/admin/connectors/default/r5/f/resume").await;
    wait_lane_state(&sluice, "default/r5/f", "RUNNING").await;
    wait_rules(&sluice, rules, |_| 20).await;
    let r5 = rule_ids(&sluice, 5);
    let want: Vec<String> = (0..200)
        .filter(|n| n % (rules - 1) + 1 == 5)
        .map(|n| format!("a{n}"))
        .chain(
            (0..200)
                .filter(|n| n % (rules - 1) + 1 == 5)
                .map(|n| format!("b{n}")),
        )
        .collect();
    assert_in_shard_order(&r5, &want, "r5 resumed where it stopped, once each");

    admin(&sluice, "/admin/connectors/default/r7/f/restart").await;
    admin(&sluice, "/admin/tasks/default/r8/f/2/restart").await;
    post_typed(&sluice, "c", rules, 200).await;
    wait_rules(&sluice, rules, |_| 30).await;
    for i in 1..rules {
        let got = rule_ids(&sluice, i);
        let distinct: HashSet<&String> = got.iter().collect();
        assert_eq!(distinct.len(), got.len(), "r{i} got duplicates");
    }
    let log = sluice.log();
    assert!(
        log.contains("default/r7/f#0") && log.contains("restarted"),
        "the restart is logged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_kill_with_a_thousand_rules_loses_nothing() {
    let (url, prefix) = shared_redis("fanout-kill");
    kill_with_a_thousand_rules(|| Sluice::builder().distributed(&url, &prefix)).await;
}

/// The same on a Redis Cluster (three primaries, three replicas).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_kill_with_a_thousand_rules_loses_nothing_on_a_redis_cluster() {
    let redis = sluice_tests::RedisCluster::start();
    let (_, prefix) = shared_redis("fanout-kill-cluster");
    let nodes = redis.urls();
    kill_with_a_thousand_rules(|| Sluice::builder().on_cluster(&nodes, &prefix)).await;
}

async fn kill_with_a_thousand_rules(member: impl Fn() -> sluice_tests::SluiceBuilder) {
    let rules: String = (0..1000)
        .map(|i| {
            format!(
                "\n[[rules]]\nname = \"r{i}\"\nbus = \"default\"\npattern = {{ type = [\"t{i}\"] }}\n\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{{data_dir}}/rules.jsonl\"\n"
            )
        })
        .collect();
    let start = || member().durability("os").extra(&rules).start();
    let a = start().await;
    let mut b = start().await;
    a.wait_members(2).await;
    let client = reqwest::Client::new();
    let mut acked = HashSet::new();
    // Round r: 250 events with ids `e{r}-{n}`, each for one rule, in batches of 100.
    let post_round = |round: usize, target: &Sluice, acked: &mut HashSet<String>| {
        let events: Vec<Value> = (0..250)
            .map(|n| {
                let id = format!("e{round}-{n}");
                acked.insert(id.clone());
                typed_event(&id, &format!("t{}", (round * 250 + n) % 1000))
            })
            .collect();
        let url = target.events_url();
        let client = client.clone();
        async move {
            for chunk in events.chunks(100) {
                post_batch(&client, &url, chunk.to_vec()).await;
            }
        }
    };
    for (round, target) in [(0, &a), (1, &b), (2, &a), (3, &b)] {
        post_round(round, target, &mut acked).await;
    }
    b.kill9();
    let c = start().await;
    for round in 4..8 {
        let target = if round % 2 == 0 { &a } else { &c };
        post_round(round, target, &mut acked).await;
    }
    let (lines, distinct) = sluice_tests::wait_all_acked(Duration::from_secs(90), &acked, || {
        [&a, &b, &c]
            .iter()
            .flat_map(|r| ids(&read_jsonl(&r.data_dir().join("rules.jsonl"))))
            .collect()
    })
    .await;
    eprintln!(
        "acked {}, delivered {lines} lines, {distinct} distinct, {} duplicates",
        acked.len(),
        lines - distinct
    );
    // Only what b delivered before it died and had not committed comes twice: at most the
    // 1,000 events posted before the kill on b's half of the shards.
    let all: Vec<String> = [&a, &b, &c]
        .iter()
        .flat_map(|r| ids(&read_jsonl(&r.data_dir().join("rules.jsonl"))))
        .collect();
    let from_b = ids(&read_jsonl(&b.data_dir().join("rules.jsonl")));
    sluice_tests::assert_duplicates_from_kill(&all, &from_b, 500);
    // Every shard task runs on exactly one live worker.
    a.wait_tasks_settled(4, 2).await;
}

/// Stores `toml` as the cluster's configuration the way a replica publishes its own: a new
/// version and a notice to every worker.
async fn publish_config(url: &str, prefix: &str, toml: &str) {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("{prefix}:config");
    let version: u64 = redis::cmd("HINCRBY")
        .arg(&key)
        .arg("version")
        .arg(1)
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("digest")
        .arg(format!("test-{version}"))
        .arg("toml")
        .arg(toml)
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("PUBLISH")
        .arg(format!("{prefix}:notices"))
        .arg(format!("config:{version}"))
        .query_async(&mut conn)
        .await
        .unwrap();
}

fn file_rule(name: &str, bus: &str, condition: &str) -> String {
    format!(
        "\n[[rules]]\nname = \"{name}\"\nbus = \"{bus}\"\n{condition}\n\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{{data_dir}}/{name}.jsonl\"\n"
    )
}

fn file_ids(sluice: &Sluice, name: &str) -> Vec<String> {
    ids(&read_jsonl(
        &sluice.data_dir().join(format!("{name}.jsonl")),
    ))
}

/// Posts `count` events to `bus` with ids `{prefix}{n}` and types from `types` in turn;
/// returns the ids of each type in the order posted.
async fn post_types(
    sluice: &Sluice,
    bus: &str,
    prefix: &str,
    types: &[&str],
    count: usize,
) -> HashMap<String, Vec<String>> {
    let client = reqwest::Client::new();
    let mut by_type: HashMap<String, Vec<String>> = HashMap::new();
    let events: Vec<Value> = (0..count)
        .map(|n| {
            let id = format!("{prefix}{n}");
            let ty = types[n % types.len()];
            by_type.entry(ty.to_string()).or_default().push(id.clone());
            typed_event(&id, ty)
        })
        .collect();
    for chunk in events.chunks(50) {
        post_batch(
            &client,
            &sluice.url(&format!("/buses/{bus}/events")),
            chunk.to_vec(),
        )
        .await;
    }
    by_type
}

async fn wait_files(sluice: &Sluice, want: &[(&str, usize)]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got: Vec<(&str, usize)> = want
            .iter()
            .map(|(name, _)| (*name, file_ids(sluice, name).len()))
            .collect();
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "got {got:?}, want {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn count_lines(log: &str, needles: &[&str]) -> usize {
    log.lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .count()
}

/// A rule change published to the cluster rebuilds the changed bus's index in its running
/// shard tasks: nothing restarts (neither that bus's readers nor another bus's), a changed
/// rule continues from its position, a removed one stops and a new one starts at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_change_applies_in_place_without_restarting_shard_readers() {
    let (url, prefix) = shared_redis("fanout-change");
    let buses = "\n[[buses]]\nname = \"a\"\nshards = 4\n\n[[buses]]\nname = \"b\"\nshards = 2\n";
    let before = format!(
        "{buses}{}{}{}",
        file_rule("keep", "a", "pattern = { type = [\"x\"] }"),
        file_rule("gone", "a", "pattern = { type = [\"y\"] }"),
        file_rule("other", "b", "")
    );
    let sluice = Sluice::builder()
        .durability("os")
        .distributed(&url, &prefix)
        .without_default_rule()
        .extra(&before)
        .start()
        .await;
    let first = post_types(&sluice, "a", "p", &["x", "y", "z"], 60).await;
    let first_b = post_types(&sluice, "b", "q", &["x"], 20).await;
    wait_files(&sluice, &[("keep", 20), ("gone", 20), ("other", 20)]).await;
    let log = sluice.log();
    let started = |log: &str, bus: &str| count_lines(log, &["shard task started", bus]);
    assert_eq!(started(&log, "bus/a#"), 4, "{log}");
    assert_eq!(started(&log, "bus/b#"), 2);

    // Change bus `a` only, published as a replica publishes its file's channels.
    let channels = |text: &str| {
        sluice::config::Config::parse(sluice.config_path(), text)
            .unwrap()
            .channels()
            .to_toml()
            .unwrap()
    };
    let file = std::fs::read_to_string(sluice.config_path()).unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let stored: String = redis::cmd("HGET")
        .arg(format!("{prefix}:config"))
        .arg("toml")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        stored,
        channels(&file),
        "the stored configuration is the file's"
    );
    let changed = format!(
        "{buses}{}{}{}",
        file_rule("keep", "a", "pattern = { type = [\"x\", \"z\"] }"),
        file_rule("new", "a", "pattern = { type = [\"y\"] }"),
        file_rule("other", "b", "")
    );
    assert!(file.contains(&before));
    let after = channels(&file.replace(&before, &changed));
    publish_config(&url, &prefix, &after).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while count_lines(&sluice.log(), &["the bus's rules changed", "bus/a#"]) < 4 {
        assert!(Instant::now() < deadline, "{}", sluice.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let second = post_types(&sluice, "a", "s", &["x", "y", "z"], 60).await;
    let second_b = post_types(&sluice, "b", "t", &["x"], 20).await;
    // keep: its x from before, then x and z; new: only what came after; gone: nothing more.
    wait_files(
        &sluice,
        &[("keep", 20 + 40), ("new", 20), ("other", 40), ("gone", 20)],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ordered = |lists: &[&Vec<String>]| -> Vec<String> {
        let mut all: Vec<String> = lists.iter().flat_map(|l| l.iter().cloned()).collect();
        // Posted order: prefix, then n.
        all.sort_by_key(|id| (id.as_bytes()[0], id[1..].parse::<usize>().unwrap()));
        all
    };
    assert_in_shard_order(
        &file_ids(&sluice, "keep"),
        &ordered(&[&first["x"], &second["x"], &second["z"]]),
        "the changed rule continued from its position",
    );
    assert_in_shard_order(
        &file_ids(&sluice, "new"),
        &second["y"],
        "the new rule started at the end",
    );
    assert_eq!(
        file_ids(&sluice, "gone").len(),
        20,
        "the removed rule stopped"
    );
    let other = file_ids(&sluice, "other");
    let want_other: Vec<String> = first_b["x"].iter().chain(&second_b["x"]).cloned().collect();
    let mut sorted = other.clone();
    sorted.sort();
    let mut want_sorted = want_other.clone();
    want_sorted.sort();
    assert_eq!(sorted, want_sorted, "bus b delivered each event once");

    let log = sluice.log();
    assert_eq!(
        started(&log, "bus/a#"),
        4,
        "bus a's readers were not restarted"
    );
    assert_eq!(
        started(&log, "bus/b#"),
        2,
        "bus b's readers were not restarted"
    );
    assert_eq!(
        count_lines(&log, &["the bus's rules changed", "bus/b#"]),
        0,
        "bus b was not touched"
    );
    assert!(!log.contains("lease lost"), "{log}");
}
