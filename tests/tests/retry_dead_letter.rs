//! Retry policy and dead letters, against a real receiver that fails in scripted ways.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::receiver::{Receiver, Reply};
use sluice_tests::{bus_to_file, post, wait_jsonl, Sluice};

fn hook(url: &str, target_extra: &str) -> String {
    format!(
        r#"
[[rules]]
name = "hook"
bus = "default"

[[rules.targets]]
type = "http"
name = "hook"
url = "{url}"
timeout = "500ms"
{target_extra}
"#
    )
}

#[tokio::test]
async fn retry_fails_n_times_then_succeeds() {
    let receiver = Receiver::start().await;
    receiver.fail_times(3, 500);
    let sluice = Sluice::builder()
        .extra(&hook(&receiver.url("/"), ""))
        .start()
        .await;
    post(&reqwest::Client::new(), &sluice.events_url(), "r-1", "{}").await;
    let got = receiver
        .wait_for(Duration::from_secs(10), |r| {
            r.iter().filter(|x| x.was_accepted()).count() == 1
        })
        .await;
    assert_eq!(got.len(), 4, "three failures, then the success");
    assert!(got.iter().all(|r| r.header("ce-id") == Some("r-1")));
}

#[tokio::test]
async fn retry_network_errors_close_hang_and_408() {
    let receiver = Receiver::start().await;
    receiver.script([Reply::Close, Reply::Hang, Reply::Status(408)]);
    let sluice = Sluice::builder()
        .extra(&hook(&receiver.url("/"), ""))
        .start()
        .await;
    post(&reqwest::Client::new(), &sluice.events_url(), "n-1", "{}").await;
    let got = receiver
        .wait_for(Duration::from_secs(10), |r| {
            r.iter().filter(|x| x.was_accepted()).count() == 1
        })
        .await;
    assert_eq!(got.len(), 4, "closed, timed out, 408, then delivered");
}

#[tokio::test]
async fn retry_honours_retry_after_on_429() {
    let receiver = Receiver::start().await;
    receiver.script([Reply::RetryAfter(2)]);
    let sluice = Sluice::builder()
        .extra(&hook(&receiver.url("/"), ""))
        .start()
        .await;
    post(&reqwest::Client::new(), &sluice.events_url(), "ra-1", "{}").await;
    let got = receiver
        .wait_for(Duration::from_secs(10), |r| {
            r.iter().filter(|x| x.was_accepted()).count() == 1
        })
        .await;
    assert_eq!(got.len(), 2);
    let gap = got[1].at - got[0].at;
    // The harness's backoff is 20–200 ms: only Retry-After explains a 2 s wait.
    assert!(gap >= Duration::from_millis(1900), "retried after {gap:?}");
}

#[tokio::test]
async fn dead_letter_on_4xx_without_retry() {
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Status(400));
    let extra = bus_to_file("dlq")
        + &hook(
            &receiver.url("/"),
            "[rules.targets.dead_letter]\nbus = \"dlq\"",
        );
    let sluice = Sluice::builder().extra(&extra).start().await;
    let client = reqwest::Client::new();
    post(&client, &sluice.events_url(), "bad-1", r#"{"x":1}"#).await;
    let dead = wait_jsonl(
        &sluice.data_dir().join("dlq.jsonl"),
        Duration::from_secs(10),
        |e| !e.is_empty(),
    )
    .await;
    assert_eq!(dead[0]["id"], "bad-1");
    assert_eq!(dead[0]["data"]["x"], 1);
    assert_eq!(dead[0]["deadletterstatus"], "400");
    assert_eq!(dead[0]["deadletterattempts"], 1);
    assert_eq!(dead[0]["deadletterrule"], "hook");
    assert_eq!(dead[0]["deadletterconnector"], "default/hook/hook");
    let target = dead[0]["deadlettertarget"].as_str().unwrap();
    assert!(
        target.contains(&receiver.url("/"))
            || target.contains(receiver.url("/").trim_end_matches('/')),
        "deadlettertarget names the target: {target}"
    );
    assert!(dead[0]["deadletterreason"]
        .as_str()
        .unwrap()
        .contains("400"));
    assert_eq!(receiver.received().len(), 1, "a 400 is not retried");
}

#[tokio::test]
async fn dead_letter_after_max_attempts_and_neighbours_still_delivered() {
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Status(500));
    let extra = bus_to_file("dlq")
        + &hook(
            &receiver.url("/"),
            "[rules.targets.retry]\nmax_attempts = 3\n[rules.targets.dead_letter]\nbus = \"dlq\"",
        );
    let sluice = Sluice::builder().shards(1).extra(&extra).start().await;
    let client = reqwest::Client::new();
    post(&client, &sluice.events_url(), "doomed", "{}").await;
    let dead = wait_jsonl(
        &sluice.data_dir().join("dlq.jsonl"),
        Duration::from_secs(10),
        |e| !e.is_empty(),
    )
    .await;
    assert_eq!(dead[0]["id"], "doomed");
    assert_eq!(dead[0]["deadletterstatus"], "500");
    assert_eq!(dead[0]["deadletterattempts"], 3);
    assert_eq!(receiver.received().len(), 3);
    // The subscription moved on: the next event is delivered once the endpoint is back.
    receiver.default_reply(Reply::Status(200));
    post(&client, &sluice.events_url(), "after", "{}").await;
    let got = receiver
        .wait_for(Duration::from_secs(10), |r| {
            r.iter().filter(|x| x.was_accepted()).count() == 1
        })
        .await;
    assert_eq!(got.last().unwrap().header("ce-id"), Some("after"));
}

#[tokio::test]
async fn dead_letter_to_a_target_and_max_event_age() {
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Status(503));
    let dead_path = "{data_dir}/dead-target.jsonl";
    let extra = hook(
        &receiver.url("/"),
        &format!(
            "[rules.targets.retry]\nmax_event_age = \"600ms\"\n[rules.targets.dead_letter.target]\ntype = \"file\"\nname = \"dead\"\npath = \"{dead_path}\""
        ),
    );
    let sluice = Sluice::builder().extra(&extra).start().await;
    let client = reqwest::Client::new();
    // The age counts from acceptance: an event that waited behind a paused subscription
    // longer than `max_event_age` gets one attempt, then is dead-lettered.
    let pause = client
        .post(sluice.url("/admin/connectors/default/hook/hook/pause"))
        .send()
        .await
        .unwrap();
    assert_eq!(pause.status().as_u16(), 202);
    sluice.wait_states("default/hook/hook#", "PAUSED", 4).await;
    post(&client, &sluice.events_url(), "old", "{}").await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(receiver.received().is_empty(), "paused: nothing sent");
    let resume = client
        .post(sluice.url("/admin/connectors/default/hook/hook/resume"))
        .send()
        .await
        .unwrap();
    assert_eq!(resume.status().as_u16(), 202);
    let dead = wait_jsonl(
        &sluice.data_dir().join("dead-target.jsonl"),
        Duration::from_secs(10),
        |e| !e.is_empty(),
    )
    .await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["id"], "old");
    assert_eq!(dead[0]["deadletterstatus"], "503");
    assert_eq!(dead[0]["deadletterrule"], "hook");
    let reason = dead[0]["deadletterreason"].as_str().unwrap();
    assert!(reason.contains("503"), "{reason}");
    assert_eq!(
        dead[0]["deadletterattempts"], 1,
        "older than max_event_age: one attempt"
    );
    assert_eq!(
        receiver.received().len(),
        1,
        "the one attempt reached the receiver"
    );

    // A fresh event is retried for about `max_event_age` from its acceptance (each attempt
    // fails at once; the harness's backoff is at most 200 ms).
    post(&client, &sluice.events_url(), "fresh", "{}").await;
    let dead = wait_jsonl(
        &sluice.data_dir().join("dead-target.jsonl"),
        Duration::from_secs(10),
        |e| e.len() >= 2,
    )
    .await;
    assert_eq!(dead[1]["id"], "fresh");
    let attempts = dead[1]["deadletterattempts"].as_i64().unwrap();
    let tried: Vec<_> = receiver.received().into_iter().skip(1).collect();
    assert_eq!(
        attempts as usize,
        tried.len(),
        "every attempt reached the receiver"
    );
    assert!(attempts >= 2, "{attempts} attempts");
    let span = tried.last().unwrap().at - tried.first().unwrap().at;
    assert!(
        span >= Duration::from_millis(300) && span <= Duration::from_millis(1500),
        "retried for {span:?}"
    );
}
