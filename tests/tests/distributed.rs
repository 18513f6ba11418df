//! Distributed mode with real processes on a real Redis: replicas that die, join, pause and
//! lose Redis, and every event answered 202 is still delivered.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use sluice::runtime::cluster::Cluster;
use sluice::runtime::rebalance::{assign, Strategy};
use sluice::store::redis::{ClusterOptions, Redis, RedisCluster, RedisPositions};
use sluice::store::PositionStore;
use sluice_tests::{ids, post_spread, shared_redis, RedisServer, Sluice};

/// Waits until every acknowledged id shows up in some replica's delivered file, then
/// returns (delivered lines, distinct ids).
async fn wait_all_delivered(replicas: &[&Sluice], acked: &HashSet<String>) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let all: Vec<String> = replicas.iter().flat_map(|r| ids(&r.delivered())).collect();
        let distinct: HashSet<&String> = all.iter().collect();
        let missing = acked.iter().filter(|id| !distinct.contains(id)).count();
        if missing == 0 {
            return (all.len(), distinct.len());
        }
        assert!(
            Instant::now() < deadline,
            "{missing} of {} acknowledged events were never delivered",
            acked.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_deliver_every_event_through_a_kill_and_a_join() {
    let (url, prefix) = shared_redis("kill-join");
    let start = || Sluice::builder().distributed(&url, &prefix).start();
    let a = start().await;
    let mut b = start().await;
    let c = start().await;
    a.wait_members(3).await;

    let urls: Vec<String> = [&a, &b, &c].iter().map(|s| s.events_url()).collect();
    let mut acked: HashSet<String> = post_spread(&urls, "before", 300)
        .await
        .into_iter()
        .collect();
    assert_eq!(acked.len(), 300);

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
    // Once converged, every task runs on exactly one live worker.
    a.wait_members(3).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let running = a.running_tasks().await;
        let live: HashSet<String> = a.cluster_view().await["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap().to_string())
            .collect();
        if running.len() == 4 && running.values().all(|w| live.contains(w)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "tasks did not settle: {running:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_does_not_deliver_once_its_tasks_moved() {
    let (url, prefix) = shared_redis("pause");
    let a = Sluice::builder().distributed(&url, &prefix).start().await;
    let b = Sluice::builder().distributed(&url, &prefix).start().await;
    a.wait_members(2).await;
    let warmup: HashSet<String> = post_spread(&[a.events_url(), b.events_url()], "warm", 40)
        .await
        .into_iter()
        .collect();
    wait_all_delivered(&[&a, &b], &warmup).await;

    // Freeze b: it can neither renew nor notice anything. Its tasks move to a once its
    // membership and leases lapse.
    b.signal("STOP");
    let during: HashSet<String> = post_spread(&[a.events_url()], "during", 200)
        .await
        .into_iter()
        .collect();
    assert_eq!(during.len(), 200);
    wait_all_delivered(&[&a, &b], &during).await;
    b.signal("CONT");
    // b wakes up with batches it may have read before it froze: it must not deliver them.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let from_b: HashSet<String> = ids(&b.delivered()).into_iter().collect();
    let stale: Vec<&String> = during.iter().filter(|id| from_b.contains(*id)).collect();
    assert!(
        stale.is_empty(),
        "b delivered {} events after its tasks moved",
        stale.len()
    );

    // And the cluster goes on with both.
    a.wait_members(2).await;
    let later: HashSet<String> = post_spread(&[a.events_url(), b.events_url()], "later", 40)
        .await
        .into_iter()
        .collect();
    wait_all_delivered(&[&a, &b], &later).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_answers_503_then_resumes_without_loss() {
    let mut redis = RedisServer::start();
    let sluice = Sluice::builder()
        .distributed(&redis.url(), "restart")
        .start()
        .await;
    let mut acked: HashSet<String> = post_spread(&[sluice.events_url()], "up", 100)
        .await
        .into_iter()
        .collect();
    assert_eq!(acked.len(), 100);

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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consistent_hash_moves_about_one_in_four_tasks_when_a_fourth_worker_joins() {
    let (url, prefix) = shared_redis("ring");
    let start = || {
        Sluice::builder()
            .distributed(&url, &prefix)
            .strategy("consistent-hash")
            .shards(48)
            .start()
    };
    let a = start().await;
    let _b = start().await;
    let _c = start().await;
    a.wait_members(3).await;
    let before = converged(&a, 48).await;
    let _d = start().await;
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

#[tokio::test]
async fn fenced_commit_is_refused_after_the_lease_moved() {
    let (url, prefix) = shared_redis("fence");
    let redis = Redis::connect(&url, &prefix, Duration::from_secs(1))
        .await
        .unwrap();
    let options = ClusterOptions {
        heartbeat: Duration::from_millis(100),
        member_ttl: Duration::from_millis(300),
        lease_ttl: Duration::from_millis(300),
    };
    let a = RedisCluster::join(redis.clone(), "worker-a", options.clone());
    let b = RedisCluster::join(redis.clone(), "worker-b", options);
    let lease_a = a.acquire("sub#0").await.unwrap().expect("free lease");
    assert!(b.acquire("sub#0").await.unwrap().is_none(), "held by a");

    let positions_a = RedisPositions::new(redis.clone(), "worker-a");
    positions_a.own("sub", 0, &lease_a);
    positions_a.set("sub", 0, 5);
    assert!(positions_a.flush().await.unwrap().is_empty());
    assert_eq!(positions_a.committed("sub", 0).await.unwrap(), Some(5));

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

    let positions_b = RedisPositions::new(redis, "worker-b");
    positions_b.own("sub", 0, &lease_b);
    positions_b.set("sub", 0, 7);
    assert!(positions_b.flush().await.unwrap().is_empty());
    assert_eq!(positions_b.committed("sub", 0).await.unwrap(), Some(7));
    a.leave().await;
    b.leave().await;
}

#[tokio::test]
async fn positions_not_committed_when_redis_fails_are_kept_for_the_next_flush() {
    let mut server = RedisServer::start();
    let redis = Redis::connect(&server.url(), "flush", Duration::from_millis(500))
        .await
        .unwrap();
    let options = ClusterOptions {
        heartbeat: Duration::from_secs(1),
        member_ttl: Duration::from_secs(60),
        lease_ttl: Duration::from_secs(60),
    };
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
    let (url, prefix) = shared_redis("control");
    let a = Sluice::builder()
        .distributed(&url, &prefix)
        .shards(2)
        .start()
        .await;
    let b = Sluice::builder()
        .distributed(&url, &prefix)
        .shards(2)
        .start()
        .await;
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
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let view = a.cluster_view().await;
        let paused = view["statuses"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["id"].as_str().unwrap().starts_with(connector) && s["state"] == "PAUSED")
            .count();
        if paused == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "not paused: {view}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let held: HashSet<String> = post_spread(&[a.events_url(), b.events_url()], "held", 30)
        .await
        .into_iter()
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        a.delivered().is_empty() && b.delivered().is_empty(),
        "paused: nothing delivered"
    );

    assert_eq!(
        act(&a, "resume").await.unwrap().status(),
        StatusCode::ACCEPTED
    );
    wait_all_delivered(&[&a, &b], &held).await;
    assert_eq!(
        act(&a, "restart").await.unwrap().status(),
        StatusCode::ACCEPTED
    );
    let more: HashSet<String> = post_spread(&[a.events_url()], "more", 10)
        .await
        .into_iter()
        .collect();
    wait_all_delivered(&[&a, &b], &more).await;
    let r = act(&a, "explode").await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_trimmed_once_every_subscription_passed() {
    let (url, prefix) = shared_redis("trim");
    let sluice = Sluice::builder()
        .distributed(&url, &prefix)
        .shards(1)
        .start()
        .await;
    let acked: HashSet<String> = post_spread(&[sluice.events_url()], "trim", 200)
        .await
        .into_iter()
        .collect();
    wait_all_delivered(&[&sluice], &acked).await;
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let stream = format!("{prefix}:bus:default:0");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let len: u64 = redis::cmd("XLEN")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .unwrap();
        if len == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{len} entries left in {stream}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
