//! Requests to the gateway's ingress: events in binary, structured and batch mode, posted
//! one at a time, in runs, or spread over replicas.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::Value;

use crate::Sluice;

/// A binary-mode request: `ce-*` headers and a JSON body.
pub fn binary(
    client: &reqwest::Client,
    url: &str,
    id: &str,
    body: &str,
) -> reqwest::RequestBuilder {
    client
        .post(url)
        .header("ce-specversion", "1.0")
        .header("ce-id", id)
        .header("ce-source", "/tests")
        .header("ce-type", "com.example.test")
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// Posts `events` as one batch-mode request (`application/cloudevents-batch+json`) and
/// asserts every one was accepted (202).
pub async fn post_batch(client: &reqwest::Client, url: &str, events: Vec<Value>) {
    let r = send_batch(client, url, Value::Array(events).to_string()).await;
    assert_eq!(r.status().as_u16(), 202, "batch refused");
}

/// A structured-mode event as JSON.
pub fn structured_event(id: &str) -> Value {
    serde_json::json!({
        "specversion": "1.0",
        "id": id,
        "source": "/tests",
        "type": "com.example.test",
        "datacontenttype": "application/json",
        "data": {"n": id}
    })
}

/// An HTTP client for the tests' requests to the gateway: a request that hangs fails the
/// test in 10 s instead of holding it.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http client")
}

/// Posts one binary-mode event and asserts it is accepted.
pub async fn post(client: &reqwest::Client, url: &str, id: &str, body: &str) {
    let r = binary(client, url, id, body).send().await.expect("post");
    assert_eq!(
        r.status().as_u16(),
        202,
        "{}",
        r.text().await.unwrap_or_default()
    );
}

/// Posts `count` binary-mode events with ids `{prefix}-{i}`, spread round-robin over the
/// given gateways, and returns the ids answered 202 (others got an error or 503).
pub async fn post_spread(urls: &[String], prefix: &str, count: usize) -> Vec<String> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let mut accepted = Vec::new();
    for i in 0..count {
        let id = format!("{prefix}-{i}");
        let url = &urls[i % urls.len()];
        if let Ok(r) = binary(&client, url, &id, "{}").send().await {
            if r.status() == reqwest::StatusCode::ACCEPTED {
                accepted.push(id);
            }
        }
    }
    accepted
}

/// [`post_spread`] where every event must be accepted: their ids.
pub async fn post_all(urls: &[String], prefix: &str, count: usize) -> HashSet<String> {
    let accepted: HashSet<String> = post_spread(urls, prefix, count).await.into_iter().collect();
    assert_eq!(
        accepted.len(),
        count,
        "not every `{prefix}` event was accepted"
    );
    accepted
}

/// Posts the binary-mode event `id` with `{}` as data to the bus `default` of `sluice`, and
/// asserts it is accepted.
pub async fn post_event(sluice: &Sluice, id: &str) {
    post(&client(), &sluice.events_url(), id, "{}").await;
}

/// Sends a batch-mode request (`application/cloudevents-batch+json`) with `body`.
pub async fn send_batch(client: &reqwest::Client, url: &str, body: String) -> reqwest::Response {
    client
        .post(url)
        .header("content-type", "application/cloudevents-batch+json")
        .body(body)
        .send()
        .await
        .expect("POST batch")
}

/// Sends `request` and asserts the answer's status; returns the answer.
pub async fn send_expecting(request: reqwest::RequestBuilder, status: u16) -> reqwest::Response {
    let response = request.send().await.expect("request");
    assert_eq!(response.status().as_u16(), status, "{response:?}");
    response
}

/// A binary-mode request with raw header values and body (bytes, so invalid UTF-8 can go):
/// the `ce-*` headers but the id, which `headers` gives (or leaves out).
pub fn binary_raw(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
    content_type: &str,
    body: Vec<u8>,
) -> reqwest::RequestBuilder {
    let mut request = client
        .post(url)
        .header("ce-specversion", "1.0")
        .header("ce-source", "/tests")
        .header("ce-type", "com.example.test")
        .header("content-type", content_type);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    request.body(body)
}

/// Posts events `{prefix}-{i}` for each `i` of `range` to `url`, each with `data(i)` as its
/// JSON data, and asserts each is accepted.
pub async fn post_many(
    client: &reqwest::Client,
    url: &str,
    prefix: &str,
    range: std::ops::Range<usize>,
    data: impl Fn(usize) -> String,
) {
    for i in range {
        post(client, url, &format!("{prefix}-{i}"), &data(i)).await;
    }
}

/// Posts one binary-mode event of type `ty` with `{}` as data to bus `bus`, and asserts it
/// is accepted.
pub async fn post_typed(sluice: &Sluice, bus: &str, id: &str, ty: &str) {
    let response = client()
        .post(sluice.url(&format!("/buses/{bus}/events")))
        .header("ce-specversion", "1.0")
        .header("ce-id", id)
        .header("ce-source", "/admin-test")
        .header("ce-type", ty)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .expect("post");
    assert_eq!(
        response.status(),
        202,
        "{}",
        response.text().await.unwrap_or_default()
    );
}
