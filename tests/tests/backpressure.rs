//! Back-pressure: a slow target slows only its own subscription.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use sluice_tests::receiver::{Receiver, Reply};
use sluice_tests::{post, Sluice};

#[tokio::test]
async fn backpressure_slow_target_does_not_slow_a_fast_one() {
    let slow = Receiver::start().await;
    slow.default_reply(Reply::Sleep(Duration::from_millis(500), 200));
    let fast = Receiver::start().await;
    let rule = |name: &str, url: &str| {
        format!(
            "\n[[rules]]\nname = \"{name}\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"http\"\nname = \"{name}\"\nurl = \"{url}\"\n"
        )
    };
    let sluice = Sluice::builder()
        .shards(2)
        .extra(&(rule("slow", &slow.url("/")) + &rule("fast", &fast.url("/"))))
        .start()
        .await;
    let client = reqwest::Client::new();
    const N: usize = 200;
    let start = Instant::now();
    for i in 0..N {
        post(&client, &sluice.events_url(), &format!("bp-{i}"), "{}").await;
    }
    fast.wait_for(Duration::from_secs(20), |r| r.len() >= N)
        .await;
    let fast_done = start.elapsed();
    let slow_seen = slow.received().len();
    // The slow endpoint takes 500 ms per event on each of 2 shards: ~4 events/s.
    assert!(
        slow_seen < N / 4,
        "slow target got {slow_seen} of {N} in {fast_done:?}"
    );
    assert!(
        fast_done < Duration::from_secs(15),
        "fast target took {fast_done:?}"
    );
    // The slow one keeps making progress, in order per shard.
    slow.wait_for(Duration::from_secs(10), |r| r.len() > slow_seen)
        .await;
}
