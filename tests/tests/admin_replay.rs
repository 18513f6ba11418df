//! Replays and redelivery through the admin API and `sluice ctl`, against the real binary:
//! a time range replayed into one rule while live traffic goes on (both modes), the recent
//! events with their delivery state and the redelivery of one event, a replay taken over
//! when its replica dies or resumed by a replica with a fixed worker id, and retention by
//! size keeping exactly the newest bytes a replay brings back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_tests::admin::{
    check_openapi, ctl_ok, gateway, Api, Recorder, Refusal, BUS, REPLAYS, RULE,
};
use sluice_tests::receiver::{Receiver, Reply};
use sluice_tests::{
    eventually, in_both_modes, post, post_spread, post_typed, read_jsonl, shared_redis, wait_ids,
    Sluice,
};

/// Creates the bus `archive` (2 shards, an hour's retention) with rules `main` and `other`
/// taking every event to `{data_dir}/{rule}.jsonl`, and waits until they run.
async fn archive(api: &Api<'_>) {
    let rule = |name: &str| json!({"targets": [{"type": "file", "name": "out", "path": api.sluice.data_dir().join(format!("{name}.jsonl")).to_string_lossy()}]});
    api.create(
        BUS,
        "/api/v1/buses/archive",
        json!({"shards": 2, "retention": "1h"}),
    )
    .await;
    for name in ["main", "other"] {
        api.create(
            RULE,
            &format!("/api/v1/buses/archive/rules/{name}"),
            rule(name),
        )
        .await;
        api.wait_connector(&format!("archive/{name}/out")).await;
    }
}

/// Posts the events `{prefix}-0` to `{prefix}-5` to the bus `archive`, and returns their ids.
async fn post_six(sluice: &Sluice, prefix: &str) -> Vec<String> {
    let ids: Vec<String> = (0..6).map(|i| format!("{prefix}-{i}")).collect();
    for id in &ids {
        post_typed(sluice, "archive", id, "t").await;
    }
    ids
}

/// The ids of the events of `file` marked as replayed by `replay` (any replay: `None`).
fn replayed_ids(sluice: &Sluice, file: &str, replay: Option<&str>) -> Vec<String> {
    read_jsonl(&sluice.data_dir().join(file))
        .iter()
        .filter(|e| match replay {
            Some(id) => e["sluicereplay"] == id,
            None => e.get("sluicereplay").is_some(),
        })
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

in_both_modes!(
    a_time_range_is_replayed_into_one_rule,
    recent_events_show_their_delivery_and_one_can_be_redelivered,
);

sluice_tests::on_a_redis_cluster!(
    a_time_range_replayed_on_a_cluster => a_time_range_is_replayed_into_one_rule,
);

/// Replay of a time range into one rule while live traffic continues: exactly the events
/// accepted in the range come again, marked `sluicereplay`, to that rule only; live events
/// are delivered once, unmarked.
async fn a_time_range_is_replayed_into_one_rule(distributed: bool) {
    let sluice = gateway(distributed, "admin-replay").await;
    let api = Api::recorded(&sluice);
    archive(&api).await;
    let pause = || tokio::time::sleep(Duration::from_millis(30));
    let before = post_six(&sluice, "before").await;
    pause().await;
    let from = now_ms();
    pause().await;
    let inside = post_six(&sluice, "inside").await;
    pause().await;
    let to = now_ms();
    pause().await;
    let after = post_six(&sluice, "after").await;
    let all: Vec<&str> = before
        .iter()
        .chain(&inside)
        .chain(&after)
        .map(String::as_str)
        .collect();
    wait_ids(&sluice, "main.jsonl", &all).await;

    // Bad requests name the field.
    let bad = |body: Value, pointer| Refusal {
        method: reqwest::Method::POST,
        template: REPLAYS,
        path: "/api/v1/buses/archive/replays",
        body,
        status: 400,
        pointer,
    };
    api.assert_refused(vec![
        bad(json!({"from": from}), "/rule"),
        bad(json!({"rule": "ghost"}), "/rule"),
        bad(json!({"rule": "main", "target": "ghost"}), "/target"),
        bad(json!({"rule": "main", "from": "yesterday"}), "/from"),
        bad(json!({"rule": "main", "from": to, "to": from}), "/to"),
        bad(
            json!({"rule": "main", "positions": {"9": [0, 1]}}),
            "/positions/9",
        ),
    ])
    .await;

    let started = api
        .start_replay("archive", json!({"rule": "main", "from": from, "to": to}))
        .await;
    let id = started["id"].as_str().unwrap().to_string();
    // Live traffic meanwhile.
    let live = post_six(&sluice, "live").await;
    let status = api
        .wait_replay_end("archive", &id, Duration::from_secs(15))
        .await;
    assert_eq!(status["state"], "COMPLETED", "{status}");
    assert_eq!(status["matched"], 6, "{status}");
    assert_eq!(status["delivered"], 6, "{status}");
    let all_live: Vec<&str> = all
        .iter()
        .copied()
        .chain(live.iter().map(String::as_str))
        .collect();
    wait_ids(&sluice, "main.jsonl", &all_live).await;
    let main = read_jsonl(&sluice.data_dir().join("main.jsonl"));
    let mut replayed = replayed_ids(&sluice, "main.jsonl", None);
    replayed.sort();
    let mut want = inside.clone();
    want.sort();
    assert_eq!(
        replayed, want,
        "exactly the events accepted in the range, once"
    );
    assert!(main
        .iter()
        .filter(|e| e.get("sluicereplay").is_some())
        .all(|e| e["sluicereplay"] == id.as_str()));
    let unmarked = main
        .iter()
        .filter(|e| e.get("sluicereplay").is_none())
        .count();
    assert_eq!(unmarked, all_live.len(), "live delivery once each");
    // The other rule got nothing replayed.
    assert!(replayed_ids(&sluice, "other.jsonl", None).is_empty());
    let list = api.get(REPLAYS, "/api/v1/buses/archive/replays").await;
    assert_eq!(list.body["items"][0]["id"], id.as_str());
    api.check_openapi("replay");

    // ctl replay by positions' worth: the whole range before `from`, waited for.
    let out = ctl_ok(
        &sluice,
        &[
            "replay",
            "archive/main",
            "--target",
            "out",
            "--to",
            &from.to_string(),
            "--wait",
        ],
    );
    assert!(
        out.contains("COMPLETED") && out.contains("\"delivered\": 6"),
        "{out}"
    );
}

/// Recent events, newest first, with their delivery state per subscription; one of them
/// redelivered (a dead letter's extensions removed) to one rule only.
async fn recent_events_show_their_delivery_and_one_can_be_redelivered(distributed: bool) {
    let sluice = gateway(distributed, "admin-redeliver").await;
    let api = Api::recorded(&sluice);
    archive(&api).await;
    post_six(&sluice, "before").await;
    post_six(&sluice, "live").await;

    // (Positions are committed every 50 ms: poll until the state shows it.)
    const EVENTS: &str = "/api/v1/buses/{bus}/events";
    let deadline = Instant::now() + Duration::from_secs(5);
    let recent = loop {
        let recent = api
            .get(EVENTS, "/api/v1/buses/archive/events?limit=5")
            .await;
        assert_eq!(recent.status, 200, "{}", recent.body);
        let all_delivered = recent.body["items"].as_array().is_some_and(|i| {
            i.iter()
                .all(|i| i["subscriptions"]["main/out"] == "delivered")
        });
        if all_delivered || Instant::now() > deadline {
            break recent;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let items = recent.body["items"].as_array().unwrap().clone();
    assert_eq!(items.len(), 5);
    assert!(
        items
            .iter()
            .all(|i| i["event"]["id"].as_str().unwrap().starts_with("live-")),
        "{}",
        recent.body
    );
    assert!(
        items
            .iter()
            .all(|i| i["subscriptions"]["main/out"] == "delivered"),
        "{}",
        recent.body
    );
    assert!(items
        .windows(2)
        .all(|w| w[0]["accepted_ms"].as_u64() >= w[1]["accepted_ms"].as_u64()));
    let bad = api
        .get(EVENTS, "/api/v1/buses/archive/events?limit=0")
        .await;
    assert_eq!(bad.status, 400);

    // Redelivery of one event (a dead letter's extensions removed) to one rule only.
    const REDELIVER: &str = "/api/v1/buses/{bus}/rules/{rule}/redeliver";
    let mut letter = items[0]["event"].clone();
    letter["deadletterreason"] = json!("503 from the receiver");
    let redeliver = |rule: &str| {
        let path = format!("/api/v1/buses/archive/rules/{rule}/redeliver");
        let (api, body) = (&api, json!({"event": letter}));
        async move { api.post(REDELIVER, &path, Some(body)).await }
    };
    let again = redeliver("main").await;
    assert_eq!(again.status, 202, "{}", again.body);
    let redelivery = again.body["id"].as_str().unwrap().to_string();
    let path = sluice.data_dir().join("main.jsonl");
    let found = eventually(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            read_jsonl(&path)
                .into_iter()
                .find(|e| e["sluicereplay"] == redelivery.as_str())
                .ok_or_else(|| "the redelivered event never arrived".to_string())
        },
    )
    .await;
    assert_eq!(found["id"], letter["id"]);
    assert!(found.get("deadletterreason").is_none(), "{found}");
    assert!(replayed_ids(&sluice, "other.jsonl", None).is_empty());
    let ghost = redeliver("ghost").await;
    assert_eq!(ghost.status, 404);
    api.check_openapi("redeliver");
}

/// A replay whose replica is killed mid-way is claimed by the other replica, which resumes
/// it from the positions recorded per shard: every event of the range is replayed, the
/// shards finished before the kill are not replayed again, and the status names the new
/// worker and counts the takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_taken_over_when_its_replica_dies() {
    replay_takeover(false).await;
}

/// A replica with a fixed `worker_id` that is killed and started again finds its own
/// replay still `RUNNING` under its id, and resumes it (no other replica needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_a_fixed_worker_id_resumes_its_replay_after_a_restart() {
    replay_takeover(true).await;
}

async fn replay_takeover(restart_same_id: bool) {
    let (url, prefix) = shared_redis("replay-takeover");
    let receiver = Receiver::start().await;
    let extra = sluice_tests::bus("archive", 4, "retention = \"1h\"")
        + &sluice_tests::rule_on(
            "archive",
            "slow",
            "http",
            "hook",
            &format!("url = \"{}\"\nmax_in_flight = 1", receiver.url("/hook")),
        );
    let start = |id: Option<&str>| {
        let mut builder = Sluice::builder()
            .durability("os")
            .without_default_rule()
            .distributed(&url, &prefix)
            .extra(&extra);
        if let Some(id) = id {
            builder = builder.env("SLUICE_WORKER_ID", id);
        }
        builder.start()
    };
    let mut a = start(restart_same_id.then_some("fixed-a")).await;
    let b = if restart_same_id {
        None
    } else {
        let b = start(None).await;
        b.wait_members(2).await;
        Some(b)
    };
    let recorder = Recorder::default();
    let api_a = Api::new(&a, &recorder);
    api_a.wait_connector("archive/slow/hook").await;

    const N: usize = 120;
    let urls: Vec<String> = [Some(&a), b.as_ref()]
        .into_iter()
        .flatten()
        .map(|s| s.url("/buses/archive/events"))
        .collect();
    let posted = post_spread(&urls, "ev", N).await;
    assert_eq!(posted.len(), N);
    receiver
        .wait_for(Duration::from_secs(30), |r| {
            r.iter().filter(|r| r.was_accepted()).count() >= N
        })
        .await;

    // Each replayed event takes the receiver 40 ms, one at a time: the replay runs for
    // about 5 s, shard after shard.
    receiver.default_reply(Reply::Sleep(Duration::from_millis(40), 200));
    let started = api_a.start_replay("archive", json!({"rule": "slow"})).await;
    let id = started["id"].as_str().unwrap().to_string();
    let first_worker = started["worker"].as_str().unwrap().to_string();

    // Kill A once at least one shard is done (as recorded).
    let status = format!("/api/v1/buses/archive/replays/{id}");
    let done_at_kill = eventually(
        Duration::from_secs(20),
        Duration::from_millis(20),
        || async {
            let s = api_a
                .get("/api/v1/buses/{bus}/replays/{replay}", &status)
                .await
                .body;
            assert_eq!(
                s["state"], "RUNNING",
                "the replay ended before the kill: {s}"
            );
            let shards = s["shards"].as_object().unwrap();
            let done: u64 = shards
                .values()
                .map(|p| p["next"].as_u64().unwrap() - p["from"].as_u64().unwrap())
                .sum();
            if shards
                .values()
                .any(|p| p["next"] == p["to"] && p["to"] != p["from"])
            {
                Ok(done)
            } else {
                Err(format!("no shard finished: {s}"))
            }
        },
    )
    .await;
    drop(api_a);
    a.kill9();
    if restart_same_id {
        a.restart().await;
    }
    // The replica that ends up running the replay.
    let survivor = b.as_ref().unwrap_or(&a);
    let api_s = Api::new(survivor, &recorder);

    let end = api_s
        .wait_replay_end("archive", &id, Duration::from_secs(60))
        .await;
    assert_eq!(end["state"], "COMPLETED", "{end}\n{}", survivor.log());
    if restart_same_id {
        assert_eq!(end["worker"], "fixed-a", "{end}");
    } else {
        assert_ne!(end["worker"], first_worker.as_str(), "{end}");
    }
    assert_eq!(end["takeovers"], 1, "{end}");
    assert_eq!(end["read"].as_u64(), Some(N as u64), "{end}");
    assert!(
        survivor
            .log()
            .contains("took over a replay whose worker left the cluster"),
        "{}",
        survivor.log()
    );

    // Every event of the range replayed at least once; what came twice is at most what
    // the dead worker had not recorded as done.
    let replayed: Vec<String> = receiver
        .received()
        .iter()
        .filter(|r| r.was_accepted() && r.header("ce-sluicereplay") == Some(id.as_str()))
        .filter_map(|r| r.header("ce-id").map(str::to_string))
        .collect();
    let unique: HashSet<&String> = replayed.iter().collect();
    assert_eq!(unique.len(), N, "not every event was replayed");
    let duplicates = replayed.len() - N;
    assert!(
        duplicates as u64 <= N as u64 - done_at_kill,
        "{duplicates} replayed twice, though {done_at_kill} of {N} were recorded done at the kill"
    );
    eprintln!(
        "replay takeover: {done_at_kill} of {N} recorded done at the kill, {duplicates} replayed twice"
    );
    check_openapi(&recorder, "replay-takeover");
}

/// One stream entry as XRANGE returns it: id and fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// `retention_bytes` keeps the newest bytes of what every subscription passed, and no
/// more: after a burst is delivered, the stream holds just under the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_by_size_keeps_the_newest_bytes_of_passed_events() {
    const BOUND: usize = 20_000;
    let (url, prefix) = shared_redis("retention-size");
    let sluice = Sluice::builder()
        .durability("os")
        .distributed(&url, &prefix)
        .start()
        .await;
    let api = Api::recorded(&sluice);
    let bad = |body: Value, pointer| Refusal {
        method: reqwest::Method::PUT,
        template: BUS,
        path: "/api/v1/buses/sized",
        body,
        status: 400,
        pointer,
    };
    api.assert_refused(vec![
        bad(
            json!({"shards": 1, "retention_bytes": 0}),
            "/retention_bytes",
        ),
        // The backlog bound: at least a second, and shown as set.
        bad(
            json!({"shards": 1, "max_backlog_age": "500ms"}),
            "/max_backlog_age",
        ),
    ])
    .await;
    api.create(
        BUS,
        "/api/v1/buses/sized",
        json!({"shards": 1, "retention_bytes": BOUND, "max_backlog_age": "72h"}),
    )
    .await;
    api.create(RULE, "/api/v1/buses/sized/rules/all", json!({"targets": [{"type": "file", "name": "out", "path": sluice.data_dir().join("sized.jsonl").to_string_lossy()}]}))
        .await;
    api.wait_connector("sized/all/out").await;
    let body = format!("{{\"pad\":\"{}\"}}", "x".repeat(300));
    let client = sluice_tests::client();
    let ids: Vec<String> = (0..200).map(|i| format!("sz-{i:03}")).collect();
    for id in &ids {
        post(&client, &sluice.url("/buses/sized/events"), id, &body).await;
    }
    let want: Vec<&str> = ids.iter().map(String::as_str).collect();
    wait_ids(&sluice, "sized.jsonl", &want).await;

    let client = redis::Client::open(url.as_str()).unwrap();
    let conn = client.get_multiplexed_async_connection().await.unwrap();
    let stream = sluice_tests::redis::shard_key(&prefix, "sized", 0, "log");
    // Released every 5 s: wait for a round to have passed everything.
    let (kept, bytes, largest) = eventually(
        Duration::from_secs(20),
        Duration::from_millis(200),
        || async {
            let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
                .arg(&stream)
                .arg("-")
                .arg("+")
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            // The payload is an entry's largest field.
            let sizes: Vec<usize> = entries
                .iter()
                .map(|(_, fields)| fields.iter().map(|(_, v)| v.len()).max().unwrap_or(0))
                .collect();
            let bytes: usize = sizes.iter().sum();
            if bytes <= BOUND {
                Ok((entries.len(), bytes, sizes.into_iter().max().unwrap_or(0)))
            } else {
                Err(format!(
                    "the stream still holds {bytes} bytes in {} events\n{}",
                    entries.len(),
                    sluice.log()
                ))
            }
        },
    )
    .await;
    // Kept: the newest that fit, to within one chunk (1/64 of the bound) and one event.
    assert!(
        bytes + BOUND / 64 + largest >= BOUND,
        "only {bytes} bytes kept in {kept} events"
    );
    assert!(kept < ids.len(), "nothing was released");
    // What is kept is the newest: a replay of everything brings exactly those back.
    let started = api.start_replay("sized", json!({"rule": "all"})).await;
    let id = started["id"].as_str().unwrap().to_string();
    let end = api
        .wait_replay_end("sized", &id, Duration::from_secs(20))
        .await;
    assert_eq!(end["state"], "COMPLETED", "{end}");
    assert_eq!(end["read"].as_u64(), Some(kept as u64), "{end}");
    let newest: Vec<&str> = want[want.len() - kept..].to_vec();
    let mut replayed = replayed_ids(&sluice, "sized.jsonl", Some(&id));
    let deadline = Instant::now() + Duration::from_secs(10);
    while replayed.len() < kept && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        replayed = replayed_ids(&sluice, "sized.jsonl", Some(&id));
    }
    assert_eq!(replayed, newest);
    eprintln!(
        "retention_bytes {BOUND}: {kept} events ({bytes} bytes) kept of {}",
        ids.len()
    );
    api.check_openapi("retention-size");
}
