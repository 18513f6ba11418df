//! Distributed mode with real processes on a real Redis: replicas that die, join, pause and
//! lose Redis, and every event answered 202 is still delivered.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use sluice::runtime::rebalance::{assign, Strategy};
use sluice::store::cluster::{Cluster, Lease};
use sluice::store::redis::{Redis, RedisCluster, RedisPositions};
use sluice::store::PositionStore;
use sluice_tests::builder::SluiceBuilder;
use sluice_tests::receiver::{event_ids, Received, Receiver, Reply};
use sluice_tests::redis::{cluster_options, connect};
use sluice_tests::{ids, post_spread, shared_redis, RedisServer, Sluice};

/// Posts `count` events `{prefix}-n` to `to`; waits until `replicas` delivered them all.
/// The ids posted.
async fn post_and_wait_delivered(
    to: &Sluice,
    prefix: &str,
    count: usize,
    replicas: &[&Sluice],
) -> HashSet<String> {
    let posted: HashSet<String> = post_spread(&[to.events_url()], prefix, count)
        .await
        .into_iter()
        .collect();
    wait_all_delivered(replicas, &posted).await;
    posted
}

/// Replicas of one cluster on the shared Redis (`name` keeps it apart from other tests'):
/// each call gives the builder of one more.
fn cluster(name: &str) -> impl Fn() -> SluiceBuilder {
    let (url, prefix) = shared_redis(name);
    move || Sluice::builder().distributed(&url, &prefix)
}

/// The ids in `file` of the data directories of `replicas`.
fn ids_in(replicas: &[&Sluice], file: &str) -> HashSet<String> {
    replicas
        .iter()
        .flat_map(|r| ids(&sluice_tests::read_jsonl(&r.data_dir().join(file))))
        .collect()
}

/// Waits until the tasks are spread over two workers.
async fn wait_both_run_tasks(a: &Sluice) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while a
        .running_tasks()
        .await
        .values()
        .collect::<HashSet<_>>()
        .len()
        != 2
    {
        assert!(Instant::now() < deadline, "both workers never ran tasks");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every acknowledged id shows up in some replica's delivered file, then
/// returns (delivered lines, distinct ids).
async fn wait_all_delivered(replicas: &[&Sluice], acked: &HashSet<String>) -> (usize, usize) {
    sluice_tests::wait_all_acked(Duration::from_secs(60), acked, || {
        replicas.iter().flat_map(|r| ids(&r.delivered())).collect()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_deliver_every_event_through_a_kill_and_a_join() {
    let member = cluster("kill-join");
    let start = || member().start();
    let a = start().await;
    let mut b = start().await;
    let c = start().await;
    a.wait_members(3).await;

    let urls: Vec<String> = [&a, &b, &c].iter().map(|s| s.events_url()).collect();
    let mut acked = sluice_tests::post_all(&urls, "before", 300).await;

    b.kill9();
    let d = start().await;
    let urls: Vec<String> = [&a, &c, &d].iter().map(|s| s.events_url()).collect();
    let after = post_spread(&urls, "after", 300).await;
    assert_eq!(after.len(), 300, "the live replicas accept everything");
    acked.extend(after);

    let (lines, distinct) = wait_all_delivered(&[&a, &b, &c, &d], &acked).await;
    eprintln!(
        "acked {}, delivered {lines} lines, {distinct} distinct, {} duplicates",
        acked.len(),
        lines - distinct
    );
    // Only what b delivered before it died and had not committed comes twice (d's join
    // hands tasks over after a commit): at most the 300 events posted before the kill on
    // b's share of the 4 shards (2 at most).
    let all: Vec<String> = [&a, &b, &c, &d]
        .iter()
        .flat_map(|r| ids(&r.delivered()))
        .collect();
    sluice_tests::assert_duplicates_from_kill(&all, &ids(&b.delivered()), 150);
    // Once converged, every task runs on exactly one live worker.
    a.wait_members(3).await;
    a.wait_tasks_settled(4, 3).await;
}

/// A worker frozen (SIGSTOP) with requests in flight loses its tasks; when it wakes it must
/// neither commit those batches nor send anything more. Only the events that were in
/// flight at the freeze may reach the receiver twice (the new owner sends them again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_does_not_deliver_once_its_tasks_moved() {
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Sleep(Duration::from_millis(100), 200));
    let (a, b) = two_hook_replicas("pause", &receiver).await;
    let during = post_spread(&[a.events_url(), b.events_url()], "during", 120).await;
    assert_eq!(during.len(), 120);
    // Every lane has a request in flight (100 ms each, 120 events over 4 shards): freeze b.
    receiver
        .wait_for(Duration::from_secs(20), |r| r.len() >= 8)
        .await;
    b.signal("STOP");
    // b can send nothing once stopped; what it sent just before still arrives.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let in_flight: HashSet<String> = event_ids(&receiver.received()).into_iter().collect();
    assert!(
        in_flight.len() < 120,
        "the freeze came too late to catch batches in flight"
    );
    // a takes b's tasks over once b's membership and leases lapse, and delivers the rest.
    wait_received(&receiver, &during, 60).await;
    b.signal("CONT");
    // b wakes up with answers to its requests and batches it read before it froze; more
    // events make sure it had the time to (wrongly) act on them before the check.
    a.wait_members(2).await;
    let later = post_spread(&[a.events_url(), b.events_url()], "later", 40).await;
    assert_eq!(later.len(), 40);
    let seen = wait_received(&receiver, &later, 30).await;
    let mut copies: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for id in event_ids(&seen) {
        *copies.entry(id).or_default() += 1;
    }
    let twice: Vec<&String> = copies
        .iter()
        .filter(|(id, c)| **c > 1 && !in_flight.contains(*id))
        .map(|(id, _)| id)
        .collect();
    assert!(
        twice.is_empty(),
        "sent twice though not in flight at the freeze (the stale worker delivered): {twice:?}"
    );
    assert!(!b.log().contains("panicked"), "{}", b.log());
}

/// Two replicas of one cluster whose only rule sends the default bus to `receiver`, both
/// running tasks.
async fn two_hook_replicas(name: &str, receiver: &Receiver) -> (Sluice, Sluice) {
    let member = cluster(name);
    let rule = format!(
        "\n[[rules]]\nname = \"hook\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"http\"\nname = \"hook\"\nurl = \"{}\"\n",
        receiver.url("/")
    );
    let start = || member().without_default_rule().extra(&rule).start();
    let a = start().await;
    let b = start().await;
    a.wait_members(2).await;
    wait_both_run_tasks(&a).await;
    (a, b)
}

/// Waits until `receiver` got each of `ids` (within `secs`); what it received by then.
async fn wait_received(receiver: &Receiver, ids: &[String], secs: u64) -> Vec<Received> {
    let want: HashSet<String> = ids.iter().cloned().collect();
    receiver
        .wait_for(Duration::from_secs(secs), |r| {
            let got: HashSet<String> = event_ids(r).into_iter().collect();
            want.is_subset(&got)
        })
        .await
}

/// Checks that the first delivery of each event comes in posting order within its shard
/// (`ids` are `{prefix}-{n}`, posted in increasing `n`); re-sent events repeat a stretch
/// that was already in order and are skipped.
fn assert_in_order_per_shard(delivered: &[String], shards: u32) {
    let mut last: std::collections::HashMap<u32, u64> = std::collections::HashMap::new();
    let mut seen = HashSet::new();
    for id in delivered {
        if !seen.insert(id) {
            continue;
        }
        let n: u64 = id.rsplit('-').next().unwrap().parse().unwrap();
        let shard = sluice::event::shard_of(id, shards);
        if let Some(previous) = last.insert(shard, n) {
            assert!(
                n > previous,
                "{id} first delivered after event {previous} of shard {shard}: out of order"
            );
        }
    }
}

/// Posts `{prefix}-{n}` for `n` in `range`, one after another to `url` (so their order is
/// the posting order); every one must be accepted.
async fn post_in_order(url: &str, range: std::ops::Range<u32>) -> Vec<String> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut accepted = Vec::new();
    for id in range.map(|n| format!("ord-{n}")) {
        let r = sluice_tests::binary(&client, url, &id, "{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::ACCEPTED, "{id}");
        accepted.push(id);
    }
    accepted
}

/// The HTTP target keeps each shard's order through a replica killed with requests in
/// flight (its shards are taken over), and through its restart (they are handed back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_target_keeps_order_per_shard_across_a_kill_a_takeover_and_a_rejoin() {
    let receiver = Receiver::start().await;
    // Slow enough that every lane has a request in flight when the kill comes.
    receiver.default_reply(Reply::Sleep(Duration::from_millis(15), 200));
    let (a, mut b) = two_hook_replicas("http-order", &receiver).await;

    let mut accepted = post_in_order(&a.events_url(), 0..100).await;
    // b has requests in flight (15 ms each, a hundred events just posted over 4 lanes).
    b.kill9();
    accepted.extend(post_in_order(&a.events_url(), 100..200).await);
    wait_received(&receiver, &accepted, 60).await;

    b.restart().await;
    a.wait_members(2).await;
    let accepted = post_in_order(&a.events_url(), 200..400).await;
    let received = wait_received(&receiver, &accepted, 60).await;
    let ok: Vec<_> = received.into_iter().filter(|r| r.was_accepted()).collect();
    let delivered = event_ids(&ok);
    assert_in_order_per_shard(&delivered, 4);
    let distinct: HashSet<&String> = delivered.iter().collect();
    assert_eq!(distinct.len(), 400, "every accepted event was delivered");
    eprintln!(
        "delivered {} requests' events, {} duplicates (re-sent after the kill)",
        delivered.len(),
        delivered.len() - distinct.len()
    );
    assert!(b.log().contains("sluice is ready"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_answers_503_then_resumes_without_loss() {
    let mut redis = RedisServer::start();
    let sluice = Sluice::builder()
        .distributed(&redis.url(), "restart")
        .start()
        .await;
    let mut acked = sluice_tests::post_all(&[sluice.events_url()], "up", 100).await;

    redis.kill();
    let client = reqwest::Client::new();
    let mut unavailable = 0;
    for i in 0..10 {
        let r = sluice_tests::binary(&client, &sluice.events_url(), &format!("down-{i}"), "{}")
            .send()
            .await
            .unwrap();
        assert_ne!(
            r.status(),
            StatusCode::ACCEPTED,
            "no 202 while Redis is down"
        );
        if r.status() == StatusCode::SERVICE_UNAVAILABLE {
            assert!(r.headers().contains_key("retry-after"));
            unavailable += 1;
        }
    }
    assert_eq!(unavailable, 10);
    let deadline = Instant::now() + Duration::from_secs(10);
    while reqwest::get(sluice.url("/readyz")).await.unwrap().status()
        != StatusCode::SERVICE_UNAVAILABLE
    {
        assert!(
            Instant::now() < deadline,
            "readyz never reported the outage"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(30);
    while reqwest::get(sluice.url("/readyz")).await.unwrap().status() != StatusCode::OK {
        assert!(
            Instant::now() < deadline,
            "never ready again after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    acked.extend(post_spread(&[sluice.events_url()], "back", 100).await);
    assert_eq!(acked.len(), 200);
    let (lines, distinct) = wait_all_delivered(&[&sluice], &acked).await;
    eprintln!("delivered {lines} lines, {distinct} distinct");
    // Only progress made before the outage and not yet committed can be delivered again:
    // never an event accepted after it.
    let mut copies: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for id in ids(&sluice.delivered()) {
        *copies.entry(id).or_default() += 1;
    }
    let again: Vec<&String> = copies
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(id, _)| id)
        .collect();
    assert!(
        again.iter().all(|id| id.starts_with("up-")) && copies.values().all(|c| *c <= 2),
        "delivered again: {again:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consistent_hash_moves_about_one_in_four_tasks_when_a_fourth_worker_joins() {
    let member = cluster("ring");
    // Fixed worker ids: the ring, and so the share that moves, is the same on every run.
    let start = |id: &str| {
        member()
            .strategy("consistent-hash")
            .shards(48)
            .env("SLUICE_WORKER_ID", id)
            .start()
    };
    let a = start("ring-a").await;
    let _b = start("ring-b").await;
    let _c = start("ring-c").await;
    a.wait_members(3).await;
    let before = converged(&a, 48).await;
    let _d = start("ring-d").await;
    a.wait_members(4).await;
    let after = converged(&a, 48).await;
    let moved: Vec<&String> = before
        .iter()
        .filter(|(task, worker)| after.get(*task) != Some(worker))
        .map(|(task, _)| task)
        .collect();
    let newcomer: HashSet<&String> = after
        .values()
        .filter(|w| !before.values().any(|b| b == *w))
        .collect();
    eprintln!("{} of 48 tasks moved (ideal 12)", moved.len());
    assert!(
        moved.iter().all(|t| newcomer.contains(&after[*t])),
        "only moves to the new worker"
    );
    assert!((4..=20).contains(&moved.len()), "moved {}", moved.len());
}

/// Waits until the running tasks match the assignment the strategy computes for the
/// current members, and returns it.
async fn converged(sluice: &Sluice, tasks: u32) -> BTreeMap<String, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let view = sluice.cluster_view().await;
        let members: Vec<String> = view["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap().to_string())
            .collect();
        let ids: Vec<String> = (0..tasks).map(|s| format!("bus/default#{s}")).collect();
        let expected: BTreeMap<String, String> = assign(Strategy::ConsistentHash, &members, &ids)
            .into_iter()
            .map(|(t, w)| (t.to_string(), w))
            .collect();
        let running = sluice.running_tasks().await;
        if running == expected {
            return running;
        }
        assert!(
            Instant::now() < deadline,
            "no convergence: {running:?} vs {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Two workers of a cluster on the shared Redis, with leases that lapse in 300 ms.
async fn two_workers(name: &str) -> (Redis, Arc<RedisCluster>, Arc<RedisCluster>) {
    let (url, prefix) = shared_redis(name);
    let redis = connect(&url, &prefix, Duration::from_secs(1)).await;
    let options = cluster_options(Duration::from_millis(100), Duration::from_millis(300));
    let a = RedisCluster::join(redis.clone(), "worker-a", options.clone());
    let b = RedisCluster::join(redis.clone(), "worker-b", options);
    (redis, a, b)
}

/// `worker`'s positions, with `(key, shard)` owned under `lease`, set to `at` and flushed:
/// the commit must be accepted.
async fn committed_by(
    redis: &Redis,
    worker: &str,
    (key, shard): (&str, u32),
    lease: &Lease,
    at: u64,
) -> RedisPositions {
    let positions = RedisPositions::new(redis.clone(), worker);
    positions.own(key, shard, lease);
    positions.set(key, shard, at);
    assert!(positions.flush().await.unwrap().is_empty());
    assert_eq!(positions.committed(key, shard).await.unwrap(), Some(at));
    positions
}

/// Through the library, not the binary: the fence must be seen refusing a commit made
/// exactly after the lease lapsed and moved, an interleaving a process cannot be steered
/// into (the binary path of the same guarantee is
/// `a_paused_worker_does_not_deliver_once_its_tasks_moved`).
#[tokio::test]
async fn fenced_commit_is_refused_after_the_lease_moved() {
    let (redis, a, b) = two_workers("fence").await;
    let lease_a = a.acquire("sub#0").await.unwrap().expect("free lease");
    assert!(b.acquire("sub#0").await.unwrap().is_none(), "held by a");

    let positions_a = committed_by(&redis, "worker-a", ("sub", 0), &lease_a, 5).await;

    // a stops renewing (paused, partitioned): the lease lapses and b takes the task.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let lease_b = b.acquire("sub#0").await.unwrap().expect("lapsed lease");
    assert!(lease_b.epoch > lease_a.epoch);

    positions_a.set("sub", 0, 9);
    let fenced = positions_a.flush().await.unwrap();
    assert_eq!(fenced, vec![lease_a.task.clone()]);
    assert_eq!(
        positions_a.committed("sub", 0).await.unwrap(),
        Some(5),
        "a's commit was refused"
    );
    assert!(
        !a.renew(&lease_a).await.unwrap(),
        "a cannot renew a lease it lost"
    );

    committed_by(&redis, "worker-b", ("sub", 0), &lease_b, 7).await;
    a.leave().await;
    b.leave().await;
}

/// A RocketMQ source task's queue positions (`{source}@{broker}`, one per queue) are
/// fenced by its lease like every other position: once the task moved to another worker,
/// the old one cannot commit what it read. Through the library because the lease must
/// lapse between a `set` and its `flush` (the binary-level counterparts are
/// `a_paused_worker_does_not_deliver_once_its_tasks_moved` and the source takeover test
/// in rocketmq_source.rs, which checks no queue resumes below its committed position).
#[tokio::test]
async fn a_source_task_that_moved_away_cannot_commit_its_queue_positions() {
    let (redis, a, b) = two_workers("source-fence").await;
    let task = "source/mq-in#0";
    let key = "source/mq-in@broker-a";
    let lease_a = a.acquire(task).await.unwrap().expect("free lease");
    let positions_a = committed_by(&redis, "worker-a", (key, 3), &lease_a, 40).await;

    tokio::time::sleep(Duration::from_millis(400)).await;
    let lease_b = b.acquire(task).await.unwrap().expect("lapsed lease");
    // a read on while it was away: its commit is refused and names the task to stop.
    positions_a.set(key, 3, 55);
    assert_eq!(positions_a.flush().await.unwrap(), vec![task.to_string()]);
    assert_eq!(positions_a.committed(key, 3).await.unwrap(), Some(40));

    committed_by(&redis, "worker-b", (key, 3), &lease_b, 45).await;
    a.leave().await;
    b.leave().await;
}

/// Through the library, not the binary: a flush must fail at a chosen moment (Redis gone
/// between `set` and `flush`) and the next one must carry the kept positions; the binary
/// path is `redis_restart_answers_503_then_resumes_without_loss`.
#[tokio::test]
async fn positions_not_committed_when_redis_fails_are_kept_for_the_next_flush() {
    let mut server = RedisServer::start();
    let redis = connect(&server.url(), "flush", Duration::from_millis(500)).await;
    let options = cluster_options(Duration::from_secs(1), Duration::from_secs(60));
    let cluster = RedisCluster::join(redis.clone(), "worker-a", options);
    let positions = RedisPositions::new(redis, "worker-a");
    for shard in 0..3 {
        let lease = cluster
            .acquire(&format!("sub#{shard}"))
            .await
            .unwrap()
            .expect("free lease");
        positions.own("sub", shard, &lease);
        positions.set("sub", shard, 10 + u64::from(shard));
    }
    // The flush fails on its first commit: none of the three may be forgotten.
    server.kill();
    assert!(positions.flush().await.is_err());
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while positions.flush().await.is_err() {
        assert!(Instant::now() < deadline, "Redis never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for shard in 0..3 {
        assert_eq!(
            positions.committed("sub", shard).await.unwrap(),
            Some(10 + u64::from(shard)),
            "shard {shard}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_resume_and_restart_a_connector_from_any_replica() {
    let member = cluster("control");
    // A second rule that is never paused: once it has an event, the paused one had the
    // chance to (wrongly) deliver it too.
    let marker = "\n[[rules]]\nname = \"marker\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"file\"\nname = \"m\"\npath = \"{data_dir}/marker.jsonl\"\n";
    let a = member().shards(2).extra(marker).start().await;
    let b = member().shards(2).extra(marker).start().await;
    a.wait_members(2).await;
    let client = reqwest::Client::new();
    let connector = "default/all-events/delivered";
    let act = |sluice: &Sluice, action: &str| {
        client
            .post(sluice.url(&format!("/admin/connectors/{connector}/{action}")))
            .send()
    };
    // Paused through b, seen by a: the status says so and nothing is delivered.
    assert_eq!(
        act(&b, "pause").await.unwrap().status(),
        StatusCode::ACCEPTED
    );
    a.wait_states(connector, "PAUSED", 3).await;
    let held: HashSet<String> = post_spread(&[a.events_url(), b.events_url()], "held", 30)
        .await
        .into_iter()
        .collect();
    sluice_tests::wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || ids_in(&[&a, &b], "marker.jsonl"),
        |marked| held.is_subset(marked),
        |_| "the marker rule never got the events".to_string(),
    )
    .await;
    assert!(
        a.delivered().is_empty() && b.delivered().is_empty(),
        "paused: nothing delivered"
    );

    assert_eq!(
        act(&a, "resume").await.unwrap().status(),
        StatusCode::ACCEPTED
    );
    wait_all_delivered(&[&a, &b], &held).await;
    // A restart really restarts each of the connector's lanes (wherever they run): each
    // logs that it reads again from its position, and nothing is delivered twice.
    let restarted = |shard: u32| {
        let lane = format!("{connector}#{shard}");
        [&a, &b]
            .iter()
            .map(|r| {
                r.log()
                    .lines()
                    .filter(|l| l.contains(&lane) && l.contains("restarted"))
                    .count()
            })
            .sum::<usize>()
    };
    assert_eq!((restarted(0), restarted(1)), (0, 0));
    assert_eq!(
        act(&a, "restart").await.unwrap().status(),
        StatusCode::ACCEPTED
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while (restarted(0), restarted(1)) != (1, 1) {
        assert!(
            Instant::now() < deadline,
            "lanes restarted: {:?}",
            (restarted(0), restarted(1))
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let more = post_and_wait_delivered(&a, "more", 10, &[&a, &b]).await;
    // One task of the connector: only that lane restarts.
    sluice_tests::admin::act(&a, &format!("/admin/tasks/{connector}/1/restart")).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while restarted(1) != 2 {
        assert!(Instant::now() < deadline, "task 1 not restarted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = post_and_wait_delivered(&b, "last", 10, &[&a, &b]).await;
    assert_eq!(restarted(0), 1, "the other task kept running");
    let delivered: Vec<String> = [&a, &b].iter().flat_map(|r| ids(&r.delivered())).collect();
    let distinct: HashSet<&String> = delivered.iter().collect();
    assert_eq!(
        delivered.len(),
        distinct.len(),
        "a restart re-reads from the position: nothing twice"
    );
    assert_eq!(distinct.len(), held.len() + more.len() + last.len());
    let r = act(&a, "explode").await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
}

/// Records are released only once every subscription of the shard passed them: a paused
/// subscription holds them for as long as it is paused, and gets all of them on resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_trimmed_once_every_subscription_passed() {
    let (url, prefix) = shared_redis("trim");
    let sluice = Sluice::builder().distributed(&url, &prefix)
        .shards(1)
        .extra("\n[[rules]]\nname = \"copy\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{data_dir}/copy.jsonl\"\n")
        .start()
        .await;
    sluice_tests::admin::act(&sluice, "/admin/connectors/default/copy/f/pause").await;
    sluice.wait_states("default/copy/f#", "PAUSED", 1).await;
    let posted = post_spread(&[sluice.events_url()], "trim", 200).await;
    assert_eq!(posted.len(), 200);
    let acked: HashSet<String> = posted.iter().cloned().collect();
    wait_all_delivered(&[&sluice], &acked).await;
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let stream = sluice_tests::redis::shard_key(&prefix, "default", 0, "log");
    // While `copy` is paused at the start, nothing may be released: watch for longer than
    // one round of releasing passed records (every 5 s).
    let watch_until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < watch_until {
        let len: u64 = redis::cmd("XLEN")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            len, 200,
            "records released while a subscription still needs them"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sluice_tests::admin::act(&sluice, "/admin/connectors/default/copy/f/resume").await;
    let copied = sluice_tests::wait_file(&sluice, "copy.jsonl", Duration::from_secs(20), |e| {
        e.len() >= 200
    })
    .await;
    assert_eq!(
        ids(&copied),
        posted,
        "the paused subscription got every record, in order"
    );

    sluice_tests::wait_stream_len(&url, &stream, 0, Duration::from_secs(20)).await;
}

/// Two clusters on one Redis under different `redis_prefix`es share nothing: members,
/// tasks, positions and events stay in their own cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_with_different_prefixes_on_one_redis_are_isolated() {
    let (url, prefix) = shared_redis("iso");
    let one = Sluice::builder()
        .distributed(&url, &format!("{prefix}-one"))
        .start()
        .await;
    let two = Sluice::builder()
        .distributed(&url, &format!("{prefix}-two"))
        .start()
        .await;
    for (sluice, other) in [(&one, &two), (&two, &one)] {
        let view = sluice.cluster_view().await;
        let members = view["members"].as_array().unwrap();
        assert_eq!(members.len(), 1, "{view}");
        assert_eq!(members[0], view["worker"]);
        assert_ne!(view["worker"], other.cluster_view().await["worker"]);
    }
    let a: HashSet<String> = post_spread(&[one.events_url()], "one", 50)
        .await
        .into_iter()
        .collect();
    let b: HashSet<String> = post_spread(&[two.events_url()], "two", 50)
        .await
        .into_iter()
        .collect();
    assert_eq!((a.len(), b.len()), (50, 50));
    wait_all_delivered(&[&one], &a).await;
    wait_all_delivered(&[&two], &b).await;
    // Each delivered exactly its own events (checked once both are complete).
    let got_one: HashSet<String> = ids(&one.delivered()).into_iter().collect();
    let got_two: HashSet<String> = ids(&two.delivered()).into_iter().collect();
    assert_eq!(got_one, a);
    assert_eq!(got_two, b);
    // Both run every task of their own cluster.
    assert_eq!(one.running_tasks().await.len(), 4);
    assert_eq!(two.running_tasks().await.len(), 4);
}

/// SIGTERM hands the replica's tasks over: it finishes and commits what is in flight, so
/// the replica that takes over sends nothing twice, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_tasks_over_without_sending_anything_twice() {
    let member = cluster("handover");
    let a = member().start().await;
    let mut b = member().start().await;
    a.wait_members(2).await;
    wait_both_run_tasks(&a).await;
    let before = sluice_tests::post_all(&[a.events_url(), b.events_url()], "before", 200).await;
    let status = b.terminate();
    assert!(status.success(), "{status}");
    let after = sluice_tests::post_all(&[a.events_url()], "after", 100).await;
    let all: HashSet<String> = before.union(&after).cloned().collect();
    let (lines, distinct) = wait_all_delivered(&[&a, &b], &all).await;
    assert_eq!(distinct, 300);
    assert_eq!(lines, 300, "a graceful hand-over sends nothing twice");
    assert_eq!(a.running_tasks().await.len(), 4);
}

/// The admin actions know the running configuration: an unknown connector or task is a
/// 404 problem naming it, not a control entry remembered for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_actions_on_unknown_connectors_and_tasks_are_404() {
    let (url, prefix) = shared_redis("admin-404");
    let sluice = Sluice::builder()
        .distributed(&url, &prefix)
        .shards(2)
        .start()
        .await;
    let client = reqwest::Client::new();
    for (path, names) in [
        (
            "/admin/connectors/default/nope/delivered/pause",
            "default/nope/delivered",
        ),
        (
            "/admin/connectors/nobus/all-events/delivered/restart",
            "nobus/all-events/delivered",
        ),
        (
            "/admin/tasks/default/all-events/delivered/2/restart",
            "there is no task 2",
        ),
        ("/admin/sources/ghost/pause", "source/ghost"),
        ("/admin/sources/ghost/tasks/0/resume", "source/ghost"),
    ] {
        let r = client.post(sluice.url(path)).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND, "{path}");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        let body = r.text().await.unwrap();
        assert!(body.contains(names), "{path}: {body}");
    }
    // The real ones still work.
    sluice_tests::admin::act(
        &sluice,
        "/admin/tasks/default/all-events/delivered/1/restart",
    )
    .await;
    // Nothing was stored for the unknown ids.
    let keys = sluice_tests::redis_keys(&url, &format!("{prefix}:*")).await;
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for key in &keys {
        let kind: String = redis::cmd("TYPE")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
        if kind == "hash" {
            let fields: Vec<String> = redis::cmd("HKEYS")
                .arg(key)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!(
                !fields
                    .iter()
                    .any(|f| f.contains("nope") || f.contains("ghost") || f.contains("nobus")),
                "{key}: {fields:?}"
            );
        }
    }
}

/// The catalog, not the last file, is what the cluster runs: a replica started with a
/// different file (another rule, another shard count) runs the catalog and says its file
/// differs; a change through the admin API on one replica reaches the other, which resyncs
/// in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_run_the_catalog_not_their_files_and_resync_to_its_changes() {
    let member = cluster("resync");
    let rule = |name: &str| {
        format!("\n[[rules]]\nname = \"{name}\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{{data_dir}}/{name}.jsonl\"\n")
    };
    let a = member()
        .without_default_rule()
        .extra(&rule("first"))
        .start()
        .await;
    let b = member()
        .without_default_rule()
        .shards(8)
        .extra(&rule("second"))
        .start()
        .await;
    a.wait_members(2).await;
    assert!(b.log().contains("differ from the catalog"), "{}", b.log());
    let client = reqwest::Client::new();
    let bus =
        sluice_tests::admin::expect(&b, reqwest::Method::GET, "/api/v1/buses/default", 200).await;
    assert_eq!(bus["shards"], 4, "the catalog's shard count: {bus}");

    // Through b's admin API: add `second`, delete `first`. a resyncs.
    let second = serde_json::json!({"targets": [{"type": "file", "name": "f", "path": "{data_dir}/second.jsonl"}]});
    let put = client
        .put(b.url("/api/v1/buses/default/rules/second"))
        .json(&second)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 201, "{}", put.text().await.unwrap());
    sluice_tests::admin::expect(
        &b,
        reqwest::Method::DELETE,
        "/api/v1/buses/default/rules/first",
        204,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !a.log().contains("catalog changed; applied") {
        assert!(Instant::now() < deadline, "a never resynced:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The new rule starts at the end of each shard once its lane exists there: post only
    // after every shard runs it.
    a.wait_states("default/second/f#", "RUNNING", 4).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while a.cluster_view().await["statuses"]
        .as_array()
        .is_some_and(|s| {
            s.iter().any(|s| {
                s["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("default/first/"))
                    && s["state"] == "RUNNING"
            })
        })
    {
        assert!(Instant::now() < deadline, "`first` still runs");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let posted = sluice_tests::post_all(&[a.events_url(), b.events_url()], "r", 40).await;
    sluice_tests::wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || ids_in(&[&a, &b], "second.jsonl"),
        |got| *got == posted,
        |got| format!("{} of 40 through `second`", got.len()),
    )
    .await;
    for r in [&a, &b] {
        let first = ids(&sluice_tests::read_jsonl(&r.data_dir().join("first.jsonl")));
        assert!(
            first.iter().all(|id| !posted.contains(id)),
            "the deleted rule delivered"
        );
    }
}

/// Zero-downtime rolling restart: three replicas under steady load, each in turn gets
/// SIGTERM and is started again. Readiness fails as soon as draining starts, requests in
/// flight finish, clients see nothing but 202 or 503 with Retry-After (and retry those on
/// another replica), and every event answered 202 is delivered (the ledger).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_under_load_loses_nothing_and_answers_only_202_or_503() {
    rolling_restart(cluster("rolling")).await;
}

/// The same on a Redis Cluster (three primaries, three replicas).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_on_a_redis_cluster_loses_nothing() {
    let redis = sluice_tests::RedisCluster::start();
    let (_, prefix) = shared_redis("rolling-cluster");
    let nodes = redis.urls();
    rolling_restart(move || Sluice::builder().on_cluster(&nodes, &prefix)).await;
}

async fn rolling_restart(member: impl Fn() -> SluiceBuilder) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let start = || member().limits("shutdown_delay = \"1s\"").start();
    let mut replicas = [start().await, start().await, start().await];
    replicas[0].wait_members(3).await;
    replicas[0].wait_tasks_settled(4, 3).await;
    let urls: Vec<String> = replicas.iter().map(|r| r.events_url()).collect();

    // A load balancer: it sends only to replicas whose /readyz said 200 at its last probe
    // (every 50 ms), one id after another, round-robin; a 503 is tried again elsewhere.
    // Bounded: at most 50,000 ids (it stops when told).
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let unexpected = Arc::new(Mutex::new(Vec::<String>::new()));
    let done = Arc::new(AtomicBool::new(false));
    let ready: Arc<Vec<AtomicBool>> = Arc::new((0..3).map(|_| AtomicBool::new(true)).collect());
    let probes: Vec<_> = replicas
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (ready, done, url) = (ready.clone(), done.clone(), r.url("/readyz"));
            tokio::spawn(async move {
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(1))
                    .build()
                    .unwrap();
                while !done.load(Ordering::Relaxed) {
                    let ok = client
                        .get(&url)
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == StatusCode::OK);
                    ready[i].store(ok, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        })
        .collect();
    let load = {
        let (acked, unexpected, done, urls, ready) = (
            acked.clone(),
            unexpected.clone(),
            done.clone(),
            urls.clone(),
            ready.clone(),
        );
        tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap();
            let mut next = 0usize;
            for i in 0..50_000 {
                if done.load(Ordering::Relaxed) {
                    break;
                }
                let id = format!("roll-{i}");
                for _attempt in 0..200 {
                    next += 1;
                    if !ready[next % urls.len()].load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    let url = &urls[next % urls.len()];
                    match sluice_tests::binary(&client, url, &id, "{}").send().await {
                        Ok(r) if r.status() == StatusCode::ACCEPTED => {
                            acked.lock().unwrap().push(id.clone());
                            break;
                        }
                        Ok(r) if r.status() == StatusCode::SERVICE_UNAVAILABLE => {
                            if !r.headers().contains_key("retry-after") {
                                unexpected
                                    .lock()
                                    .unwrap()
                                    .push(format!("{id}: 503 without Retry-After"));
                            }
                        }
                        Ok(r) => unexpected
                            .lock()
                            .unwrap()
                            .push(format!("{id}: {}", r.status())),
                        Err(e) => unexpected.lock().unwrap().push(format!("{id}: {e:?}")),
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
    };

    let client = reqwest::Client::new();
    for i in 0..replicas.len() {
        let before = acked.lock().unwrap().len();
        let deadline = Instant::now() + Duration::from_secs(20);
        while acked.lock().unwrap().len() < before + 50 {
            assert!(Instant::now() < deadline, "the load stalled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        replicas[i].signal("TERM");
        // Readiness fails at once while requests are still served (shutdown_delay).
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let r = client.get(replicas[i].url("/readyz")).send().await.unwrap();
            if r.status() == StatusCode::SERVICE_UNAVAILABLE {
                let body: serde_json::Value = r.json().await.unwrap();
                assert!(
                    body["detail"].as_str().unwrap().contains("shutting down"),
                    "{body}"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "/readyz never turned 503 while draining"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            replicas[i].terminate().success(),
            "clean exit after SIGTERM"
        );
        replicas[i].restart().await;
        replicas[(i + 1) % 3].wait_members(3).await;
    }
    let before = acked.lock().unwrap().len();
    let deadline = Instant::now() + Duration::from_secs(20);
    while acked.lock().unwrap().len() < before + 50 {
        assert!(
            Instant::now() < deadline,
            "the load stalled after the restarts"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done.store(true, Ordering::Relaxed);
    load.await.unwrap();
    for probe in probes {
        probe.await.unwrap();
    }

    let unexpected = unexpected.lock().unwrap().clone();
    assert!(unexpected.is_empty(), "clients saw: {unexpected:?}");
    let acked: HashSet<String> = acked.lock().unwrap().iter().cloned().collect();
    let refs: Vec<&Sluice> = replicas.iter().collect();
    let (lines, distinct) = wait_all_delivered(&refs, &acked).await;
    eprintln!(
        "rolling restart: {} acknowledged, {lines} delivered lines, {distinct} distinct, {} duplicates",
        acked.len(),
        lines - distinct
    );
    assert!(acked.len() >= 200, "the load ran: {}", acked.len());
}
