//! Retry policy and dead letters, against a real receiver that fails in scripted ways.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::receiver::{Received, Receiver, Reply};
use sluice_tests::{bus_to_file, http_rule, post, post_event, read_jsonl, wait_jsonl, Sluice};

/// A rule `hook` of bus `default` to an HTTP target at `url` with a 500 ms timeout, plus
/// `target_extra` in the target's table.
fn hook(url: &str, target_extra: &str) -> String {
    http_rule("hook", url, &format!("timeout = \"500ms\"\n{target_extra}"))
}

/// The hook to the receiver (with `retry` in its table) whose dead letters go to the bus
/// `dlq`, stored in `dlq.jsonl`.
fn to_dead_letter_bus(receiver: &Receiver, retry: &str) -> String {
    bus_to_file("dlq")
        + &hook(
            &receiver.url("/"),
            &format!("{retry}[rules.targets.dead_letter]\nbus = \"dlq\""),
        )
}

/// Posts the event `id` to a gateway whose one target is the receiver, and returns what
/// the receiver got once it accepted it (10 s at most).
async fn retried_until_accepted(receiver: &Receiver, id: &str) -> Vec<Received> {
    let sluice = Sluice::builder()
        .extra(&hook(&receiver.url("/"), ""))
        .start()
        .await;
    post_event(&sluice, id).await;
    receiver
        .wait_for(Duration::from_secs(10), |r| {
            r.iter().filter(|x| x.was_accepted()).count() == 1
        })
        .await
}

#[tokio::test]
async fn retry_fails_n_times_then_succeeds() {
    let receiver = Receiver::start().await;
    receiver.fail_times(3, 500);
    let got = retried_until_accepted(&receiver, "r-1").await;
    assert_eq!(got.len(), 4, "three failures, then the success");
    assert!(got.iter().all(|r| r.header("ce-id") == Some("r-1")));
}

#[tokio::test]
async fn retry_network_errors_close_hang_and_408() {
    let receiver = Receiver::start().await;
    receiver.script([Reply::Close, Reply::Hang, Reply::Status(408)]);
    let got = retried_until_accepted(&receiver, "n-1").await;
    assert_eq!(got.len(), 4, "closed, timed out, 408, then delivered");
}

#[tokio::test]
async fn retry_honours_retry_after_on_429() {
    let receiver = Receiver::start().await;
    receiver.script([Reply::RetryAfter(2)]);
    let got = retried_until_accepted(&receiver, "ra-1").await;
    assert_eq!(got.len(), 2);
    let gap = got[1].at - got[0].at;
    // The harness's backoff is 20–200 ms: only Retry-After explains a 2 s wait.
    assert!(gap >= Duration::from_millis(1900), "retried after {gap:?}");
}

#[tokio::test]
async fn dead_letter_on_4xx_without_retry() {
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Status(400));
    let extra = to_dead_letter_bus(&receiver, "");
    let sluice = Sluice::builder().extra(&extra).start().await;
    let client = reqwest::Client::new();
    post(&client, &sluice.events_url(), "bad-1", r#"{"x":1}"#).await;
    let dead = sluice_tests::wait_file(&sluice, "dlq.jsonl", Duration::from_secs(10), |e| {
        !e.is_empty()
    })
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
    let extra = to_dead_letter_bus(&receiver, "[rules.targets.retry]\nmax_attempts = 3\n");
    let sluice = Sluice::builder().shards(1).extra(&extra).start().await;
    let client = reqwest::Client::new();
    post(&client, &sluice.events_url(), "doomed", "{}").await;
    let dead = sluice_tests::wait_file(&sluice, "dlq.jsonl", Duration::from_secs(10), |e| {
        !e.is_empty()
    })
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
    sluice_tests::admin::act(&sluice, "/admin/connectors/default/hook/hook/pause").await;
    sluice.wait_states("default/hook/hook#", "PAUSED", 4).await;
    post(&client, &sluice.events_url(), "old", "{}").await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(receiver.received().is_empty(), "paused: nothing sent");
    sluice_tests::admin::act(&sluice, "/admin/connectors/default/hook/hook/resume").await;
    let dead =
        sluice_tests::wait_file(&sluice, "dead-target.jsonl", Duration::from_secs(10), |e| {
            !e.is_empty()
        })
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
    let dead =
        sluice_tests::wait_file(&sluice, "dead-target.jsonl", Duration::from_secs(10), |e| {
            e.len() >= 2
        })
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

/// Redirects are failed deliveries, never followed.
#[tokio::test]
async fn redirects_are_not_followed_and_dead_letter_with_their_location() {
    let receiver = Receiver::start().await;
    let elsewhere = Receiver::start().await;
    // Another host name for the same loopback: a followed redirect would cross hosts.
    let location = elsewhere
        .url("/stolen?key=k3y")
        .replace("127.0.0.1", "localhost");
    let sluice = Sluice::builder()
        .http_target(
        "hook",
        &receiver.url("/hook"),
        "timeout = \"2s\"\nsigning_secret = \"env:SLUICE_SECRET_SIGNING\"\nauth = { type = \"api-key\", header = \"x-api-key\", key = \"env:SLUICE_SECRET_API_KEY\" }\n[rules.targets.dead_letter.target]\ntype = \"file\"\nname = \"dead\"\npath = \"{data_dir}/dead.jsonl\"",
    )
    .env("SLUICE_SECRET_SIGNING", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    .env("SLUICE_SECRET_API_KEY", "s3cret")
    .start()
    .await;
    let client = reqwest::Client::new();
    let dead_path = sluice.data_dir().join("dead.jsonl");
    let statuses = [301u16, 302, 307, 308];
    for (i, status) in statuses.iter().enumerate() {
        receiver.default_reply(Reply::Full(
            *status,
            vec![("location".to_string(), location.clone())],
            vec![],
        ));
        post(&client, &sluice.events_url(), &format!("r-{status}"), "{}").await;
        wait_jsonl(&dead_path, Duration::from_secs(10), |e| e.len() > i).await;
    }
    let dead = read_jsonl(&dead_path);
    for (letter, status) in dead.iter().zip(statuses) {
        assert_eq!(letter["id"], format!("r-{status}"));
        assert_eq!(letter["deadletterstatus"], status.to_string(), "{letter}");
        assert_eq!(letter["deadletterattempts"], 1, "not retried: {letter}");
        let reason = letter["deadletterreason"].as_str().unwrap();
        assert!(
            reason.contains("Location") && reason.contains("/stolen?***"),
            "{reason}"
        );
        assert!(!reason.contains("k3y"), "{reason}");
    }
    let got = receiver.received();
    assert_eq!(got.len(), 4, "one POST per event");
    assert!(got.iter().all(|r| r.method == "POST"));
    assert!(
        elsewhere.received().is_empty(),
        "nothing reached the redirect's host: {:?}",
        elsewhere.received()
    );
}
