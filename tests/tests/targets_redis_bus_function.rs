//! The Redis stream target (the harness's Redis), the bus target, and the function
//! target with its reply bus, hop limit and non-CloudEvent replies.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::receiver::{Receiver, Reply};
use sluice_tests::{bus_to_file, post, target_rule, Sluice};

#[tokio::test]
async fn redis_stream_target_xadds_with_maxlen() {
    let stream = format!(
        "sluice-test-{}-{}",
        std::process::id(),
        sluice_tests::free_port()
    );
    let url = sluice_tests::shared_redis("redis-stream").0;
    let extra = target_rule(
        "to-redis",
        "redis-stream",
        "stream",
        &format!("url = \"{url}\"\nstream = \"{stream}\"\nmaxlen = 50"),
    );
    let sluice = Sluice::builder().extra(&extra).start().await;
    let client = reqwest::Client::new();
    sluice_tests::post_many(&client, &sluice.events_url(), "rs", 0..5, |i| {
        format!(r#"{{"i":{i}}}"#)
    })
    .await;
    let redis = redis::Client::open(url.as_str()).unwrap();
    let mut conn = redis.get_multiplexed_async_connection().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let entries: Vec<(String, Vec<(String, String)>)> = loop {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        if reply.ids.len() >= 5 || std::time::Instant::now() > deadline {
            break reply
                .ids
                .into_iter()
                .map(|e| {
                    let fields = e
                        .map
                        .iter()
                        .map(|(k, v)| {
                            (k.clone(), redis::from_redis_value_ref::<String>(v).unwrap())
                        })
                        .collect();
                    (e.id, fields)
                })
                .collect();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(entries.len(), 5);
    let mut ids: Vec<String> = entries
        .iter()
        .map(|(_, f)| f.iter().find(|(k, _)| k == "id").unwrap().1.clone())
        .collect();
    ids.sort();
    assert_eq!(ids, ["rs-0", "rs-1", "rs-2", "rs-3", "rs-4"]);
    let event: serde_json::Value =
        serde_json::from_str(&entries[0].1.iter().find(|(k, _)| k == "event").unwrap().1).unwrap();
    assert_eq!(event["source"], "/tests");

    // Trimming: 400 more entries on a stream capped at about 50. `MAXLEN ~` trims whole
    // stream nodes (100 entries each by default), never below the cap.
    let client = reqwest::Client::new();
    for chunk in 0..4 {
        let events = (0..100)
            .map(|i| sluice_tests::structured_event(&format!("trim-{chunk}-{i}")))
            .collect();
        sluice_tests::post_batch(&client, &sluice.events_url(), events).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (added, len) = loop {
        let info: redis::Value = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .unwrap();
        let map: std::collections::HashMap<String, redis::Value> =
            redis::from_redis_value(info).unwrap();
        let added: u64 = redis::from_redis_value_ref(&map["entries-added"]).unwrap();
        let len: u64 = redis::from_redis_value_ref(&map["length"]).unwrap();
        if added >= 405 {
            break (added, len);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{added} of 405 entries added"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(added, 405, "each event added once");
    assert!(
        (50..=150).contains(&len),
        "the stream was trimmed to about 50 entries: {len}"
    );
}

#[tokio::test]
async fn bus_target_puts_events_on_another_bus() {
    let extra = bus_to_file("audit") + &target_rule("copy", "bus", "to-audit", "bus = \"audit\"");
    let sluice = Sluice::builder().extra(&extra).start().await;
    post(
        &reqwest::Client::new(),
        &sluice.events_url(),
        "copy-1",
        r#"{"a":1}"#,
    )
    .await;
    let copied = first_events(&sluice, "audit.jsonl", 10).await;
    assert_eq!(copied[0]["id"], "copy-1");
    assert_eq!(copied[0]["data"]["a"], 1);
}

fn function_rule(url: &str, reply_bus: &str, extra: &str) -> String {
    target_rule(
        "fn",
        "function",
        "fn",
        &format!("url = \"{url}\"\nreply_bus = \"{reply_bus}\"\n{extra}"),
    )
}

/// A gateway whose function target (`function`) replies onto the bus `replies` and
/// dead-letters onto `dlq`, both written to files.
async fn with_function_and_dlq(function: &Receiver) -> Sluice {
    let extra = bus_to_file("dlq")
        + &bus_to_file("replies")
        + &function_rule(
            &function.url("/fn"),
            "replies",
            "[rules.targets.dead_letter]\nbus = \"dlq\"",
        );
    Sluice::builder().extra(&extra).start().await
}

/// The events of `{data_dir}/{file}` once there are any (waiting `secs` at most).
async fn first_events(sluice: &Sluice, file: &str, secs: u64) -> Vec<serde_json::Value> {
    sluice_tests::wait_file(sluice, file, Duration::from_secs(secs), |e| !e.is_empty()).await
}

fn ce_reply(id: &str) -> Reply {
    Reply::Full(
        200,
        vec![
            ("ce-specversion".into(), "1.0".into()),
            ("ce-id".into(), id.into()),
            ("ce-source".into(), "/function".into()),
            ("ce-type".into(), "com.example.reply".into()),
            ("content-type".into(), "application/json".into()),
        ],
        br#"{"enriched":true}"#.to_vec(),
    )
}

#[tokio::test]
async fn function_target_reply_goes_to_the_reply_bus() {
    let function = Receiver::start().await;
    function.default_reply(ce_reply("reply-1"));
    let extra = bus_to_file("replies") + &function_rule(&function.url("/fn"), "replies", "");
    let sluice = Sluice::builder().extra(&extra).start().await;
    post(
        &reqwest::Client::new(),
        &sluice.events_url(),
        "in-1",
        r#"{"x":1}"#,
    )
    .await;
    let replies = first_events(&sluice, "replies.jsonl", 10).await;
    assert_eq!(replies[0]["id"], "reply-1");
    assert_eq!(replies[0]["type"], "com.example.reply");
    assert_eq!(replies[0]["data"]["enriched"], true);
    assert_eq!(replies[0]["sluicehops"], 1);
    let got = function.received();
    assert_eq!(got[0].header("ce-id"), Some("in-1"));
}

#[tokio::test]
async fn function_target_hop_counter_stops_a_loop() {
    // The function replies onto the bus it listens to: without the hop limit this never ends.
    let function = Receiver::start().await;
    function.default_reply(ce_reply("loop"));
    let extra = bus_to_file("dlq")
        + &function_rule(
            &function.url("/fn"),
            "default",
            "max_hops = 3\n[rules.targets.dead_letter]\nbus = \"dlq\"",
        );
    let sluice = Sluice::builder().extra(&extra).start().await;
    sluice_tests::post_event(&sluice, "seed").await;
    let dead = first_events(&sluice, "dlq.jsonl", 10).await;
    assert!(
        dead[0]["deadletterreason"]
            .as_str()
            .unwrap()
            .contains("max_hops"),
        "{}",
        dead[0]
    );
    // seed + 3 replies reached the function, then the chain stopped: an event posted after
    // the dead letter is the fifth and last request (nothing of the loop came after it).
    function.default_reply(Reply::Status(204));
    sluice_tests::post_event(&sluice, "after").await;
    let got = function
        .wait_for(Duration::from_secs(10), |r| {
            r.iter().any(|x| x.header("ce-id") == Some("after"))
        })
        .await;
    assert_eq!(
        got.len(),
        5,
        "{:?}",
        got.iter().map(|r| r.header("ce-id")).collect::<Vec<_>>()
    );
    assert_eq!(got[4].header("ce-id"), Some("after"));
}

#[tokio::test]
async fn function_target_non_cloudevent_reply_is_an_error() {
    let function = Receiver::start().await;
    function.default_reply(Reply::Full(
        200,
        vec![("content-type".into(), "text/plain".into())],
        b"not an event".to_vec(),
    ));
    let sluice = with_function_and_dlq(&function).await;
    sluice_tests::post_event(&sluice, "plain").await;
    let dead = first_events(&sluice, "dlq.jsonl", 10).await;
    assert_eq!(dead[0]["id"], "plain");
    assert!(dead[0]["deadletterreason"]
        .as_str()
        .unwrap()
        .contains("not a CloudEvent"));
    assert!(sluice_tests::read_jsonl(&sluice.data_dir().join("replies.jsonl")).is_empty());
}

/// An empty 2xx answer is a plain success: the event counts as delivered (not retried,
/// not dead-lettered) and nothing goes onto the reply bus.
#[tokio::test]
async fn function_target_empty_answer_is_a_plain_success() {
    let function = Receiver::start().await;
    function.default_reply(Reply::Status(204));
    let sluice = with_function_and_dlq(&function).await;
    let client = reqwest::Client::new();
    post(&client, &sluice.events_url(), "quiet", "{}").await;
    let got = function
        .wait_for(Duration::from_secs(10), |r| !r.is_empty())
        .await;
    assert_eq!(got[0].header("ce-id"), Some("quiet"));
    // A second event whose reply is a CloudEvent: once its reply is on the reply bus, the
    // first one had every chance to be retried, dead-lettered or replied.
    function.script([ce_reply("loud-reply")]);
    post(&client, &sluice.events_url(), "loud", "{}").await;
    let replies = first_events(&sluice, "replies.jsonl", 10).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0]["id"], "loud-reply");
    let received = function.received();
    let ids: Vec<Option<&str>> = received.iter().map(|r| r.header("ce-id")).collect();
    assert_eq!(
        ids,
        vec![Some("quiet"), Some("loud")],
        "the empty answer was not retried"
    );
    assert!(sluice_tests::read_jsonl(&sluice.data_dir().join("dlq.jsonl")).is_empty());
}

/// A function answering with more than the reply limit (8 MiB, the bound of what ingress can
/// accept) is a failed delivery with the reason, dead-lettered, and never put on a bus.
#[tokio::test]
async fn function_target_oversized_reply_is_dead_lettered_not_stored() {
    let function = Receiver::start().await;
    let Reply::Full(status, headers, _) = ce_reply("huge") else {
        unreachable!()
    };
    let mut body = b"{\"pad\":\"".to_vec();
    body.extend(std::iter::repeat_n(b'x', 9 * 1024 * 1024));
    body.extend(b"\"}");
    function.default_reply(Reply::Full(status, headers, body));
    let sluice = with_function_and_dlq(&function).await;
    sluice_tests::post_event(&sluice, "big-answer").await;
    let dead = first_events(&sluice, "dlq.jsonl", 20).await;
    assert_eq!(dead[0]["id"], "big-answer");
    let reason = dead[0]["deadletterreason"].as_str().unwrap();
    assert!(reason.contains("over the reply limit"), "{reason}");
    assert_eq!(
        function.received().len(),
        1,
        "a reply over the limit is not retried"
    );
    assert!(sluice_tests::read_jsonl(&sluice.data_dir().join("replies.jsonl")).is_empty());
}
