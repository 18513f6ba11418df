//! The `http` target: POSTs each event to a URL in binary mode (`ce-*` headers, data as the
//! body), structured mode (`application/cloudevents+json`), or raw (the data alone).
//!
//! Optional Standard Webhooks signatures (`webhook-id`, `webhook-timestamp`,
//! `webhook-signature`), bearer / basic / API-key auth, custom headers, timeouts, a rate
//! limit, a cap on requests in flight, and a circuit breaker. Connections are pooled by the
//! client (HTTP/1.1 keep-alive; h2 by ALPN or with `http2_prior_knowledge`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use hmac::{KeyInit, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::Semaphore;

use crate::event::header_text;
use crate::targets::config::{signing_key, AuthConfig, BodyMode, HttpConfig};
use crate::targets::limits::{CircuitBreaker, RateLimiter};
use crate::targets::policy::{secret, TargetPolicy};
use crate::targets::target::{Envelope, Target, TargetError};
use crate::values::redact_url;

/// Standard Webhooks: `v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")).
pub fn sign(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(key) else {
        return String::new();
    };
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    )
}

/// A request as the target will send it.
pub(crate) struct Request {
    pub(crate) headers: HeaderMap,
    pub(crate) body: Vec<u8>,
    pub(crate) id: String,
}

/// Builds the body and headers of one event in the given mode.
pub(crate) fn encode(envelope: &Envelope, mode: BodyMode) -> Result<Request, TargetError> {
    let event = envelope.text()?;
    let id = event.id().to_string();
    let mut headers = HeaderMap::new();
    // The W3C trace context goes on as HTTP headers in every mode, so the receiver's
    // tracing joins the producer's trace (binary mode also has it as ce- attributes).
    for name in ["traceparent", "tracestate"] {
        if let Some(value) = event.attribute(name) {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(HeaderName::from_static(name), value);
            }
        }
    }
    // A transform that produced a raw body replaces the event: it goes out as it is.
    if let Some(body) = &envelope.body {
        if let Ok(v) = HeaderValue::from_str(&body.content_type) {
            headers.insert(reqwest::header::CONTENT_TYPE, v);
        }
        return Ok(Request {
            headers,
            body: body.bytes.to_vec(),
            id,
        });
    }
    let body = match mode {
        BodyMode::Structured => {
            headers.insert(
                reqwest::header::CONTENT_TYPE,
                HeaderValue::from_static("application/cloudevents+json; charset=utf-8"),
            );
            envelope.raw.to_vec()
        }
        BodyMode::Binary | BodyMode::Raw => {
            if mode == BodyMode::Binary {
                let mut name = String::with_capacity(32);
                for (attribute, value) in &event.attributes {
                    name.clear();
                    name.push_str("ce-");
                    name.push_str(attribute);
                    let header = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                        TargetError::fatal(format!("attribute `{attribute}` cannot be a header"))
                    })?;
                    let value = HeaderValue::from_str(&header_text(value)).map_err(|_| {
                        TargetError::fatal(format!(
                            "attribute `{attribute}` cannot be a header value"
                        ))
                    })?;
                    headers.insert(header, value);
                }
            }
            // Without a `datacontenttype`, what the data is: JSON, text, or bytes (binary
            // data sent as `application/json` would be refused by a receiver that reads
            // JSON as JSON).
            if let Ok(v) = HeaderValue::from_str(event.content_type()) {
                headers.insert(reqwest::header::CONTENT_TYPE, v);
            }
            event.data_bytes().to_vec()
        }
    };
    Ok(Request { headers, body, id })
}

/// Reads `Retry-After`: seconds, or an HTTP date.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let wait = at.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(wait.to_std().unwrap_or(Duration::ZERO))
}

/// Whether an HTTP status means "try again later": 408, 429 and 5xx.
pub(crate) fn retryable_status(status: u16) -> bool {
    status == 408 || status == 429 || status >= 500
}

/// Turns a response status into the delivery result. `url` is the target's redacted URL.
///
/// Redirects are not followed (see `client`): a 3xx is a failed delivery that names its
/// `Location`, and it is not retried, since the same request would be redirected again.
/// With a dead-letter destination the event goes there; the fix is to configure the final
/// URL.
pub(crate) fn status_result(
    status: reqwest::StatusCode,
    headers: &HeaderMap,
    url: &str,
) -> Result<(), TargetError> {
    if status.is_success() {
        return Ok(());
    }
    let code = status.as_u16();
    let message = if status.is_redirection() {
        let location = headers
            .get(reqwest::header::LOCATION)
            .map(|v| redact_url(&String::from_utf8_lossy(v.as_bytes())));
        match location {
            Some(location) => format!(
                "{url} answered {status} with Location {location}; redirects are not followed: set the target's url to the final address"
            ),
            None => format!("{url} answered {status}; redirects are not followed"),
        }
    } else {
        format!("{url} answered {status}")
    };
    Err(TargetError {
        message,
        retryable: retryable_status(code),
        status: Some(code),
        retry_after: if code == 429 || code == 503 {
            retry_after(headers)
        } else {
            None
        },
    })
}

pub(crate) fn client(
    timeout: Duration,
    connect_timeout: Duration,
    http2_prior_knowledge: bool,
    ca_file: Option<&std::path::Path>,
    allow_private_egress: bool,
) -> Result<reqwest::Client, TargetError> {
    let mut builder = reqwest::Client::builder()
        // A followed 301/302 turns the POST into a GET that would count as delivered, and a
        // redirect to another host would carry the auth headers and the signature there
        // (and get around the egress policy, which checks the configured URL).
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .connect_timeout(connect_timeout)
        .pool_idle_timeout(Duration::from_secs(60))
        .tcp_nodelay(true);
    if http2_prior_knowledge {
        builder = builder.http2_prior_knowledge();
    }
    if !allow_private_egress {
        // Host names are checked against the egress policy each time they are resolved
        // (addresses written in the URL are checked when the target is built).
        builder = builder.dns_resolver(super::EgressResolver);
    }
    if let Some(path) = ca_file {
        let pem = std::fs::read(path).map_err(|e| {
            TargetError::fatal(format!("cannot read `ca_file` {}: {e}", path.display()))
        })?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
            TargetError::fatal(format!(
                "`ca_file` {}: not PEM certificates: {e}",
                path.display()
            ))
        })?;
        if certs.is_empty() {
            return Err(TargetError::fatal(format!(
                "`ca_file` {} holds no certificate",
                path.display()
            )));
        }
        builder = builder.tls_certs_merge(certs);
    }
    builder
        .build()
        .map_err(|e| TargetError::fatal(format!("cannot build the HTTP client: {e}")))
}

/// A failed request as a delivery error. `url` is the target's redacted URL; reqwest's
/// own copy of the URL (with its credentials and query) is taken out of the message.
pub(crate) fn send_error(url: &str, e: reqwest::Error) -> TargetError {
    let e = e.without_url();
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    // reqwest's own message hides the cause (refused, TLS, DNS): name the whole chain.
    let mut message = format!("{url}: {what}: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    // Network failures may heal; a request that cannot even be built will not.
    TargetError::retryable(message).with_builder(e.is_builder())
}

impl TargetError {
    fn with_builder(mut self, builder: bool) -> Self {
        if builder {
            self.retryable = false;
        }
        self
    }
}

pub struct HttpTarget {
    config: HttpConfig,
    /// The URL as logs, errors and dead letters show it.
    shown_url: String,
    client: reqwest::Client,
    headers: HeaderMap,
    signing_key: Option<Vec<u8>>,
    limiter: Option<RateLimiter>,
    in_flight: Arc<Semaphore>,
    breaker: Option<CircuitBreaker>,
}

impl HttpTarget {
    /// `ca_file` is the configured one with `{data_dir}` resolved.
    pub fn new(
        config: &HttpConfig,
        ca_file: Option<&std::path::Path>,
        policy: &TargetPolicy,
    ) -> Result<HttpTarget, TargetError> {
        config.check().map_err(TargetError::fatal)?;
        crate::targets::policy::check_url(&config.url, policy).map_err(TargetError::fatal)?;
        super::policy::check_headers(config.headers.keys(), policy)
            .map_err(|(_, m)| TargetError::fatal(m))?;
        let prefix = policy.secret_env_prefix.as_str();
        let secret = |value: &str| secret(value, prefix);
        // A user name is not a secret: it may be written as it is.
        let user = |value: &str| match value.strip_prefix("env:") {
            Some(_) => secret(value),
            None => Ok(value.to_string()),
        };
        let mut headers = HeaderMap::new();
        for (name, value) in &config.headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| TargetError::fatal(format!("header name `{name}` is not valid")))?;
            let value = HeaderValue::from_str(value)
                .map_err(|_| TargetError::fatal("header value is not valid"))?;
            headers.insert(name, value);
        }
        match &config.auth {
            None => {}
            Some(AuthConfig::Bearer { token }) => {
                headers.insert(
                    reqwest::header::AUTHORIZATION,
                    sensitive(&format!("Bearer {}", secret(token)?))?,
                );
            }
            Some(AuthConfig::Basic { username, password }) => {
                let pair = format!("{}:{}", user(username)?, secret(password)?);
                let value = format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(pair)
                );
                headers.insert(reqwest::header::AUTHORIZATION, sensitive(&value)?);
            }
            Some(AuthConfig::ApiKey { header, key }) => {
                let name = HeaderName::from_bytes(header.as_bytes()).map_err(|_| {
                    TargetError::fatal(format!("auth header `{header}` is not valid"))
                })?;
                headers.insert(name, sensitive(&secret(key)?)?);
            }
        }
        let signing_key = match &config.signing_secret {
            Some(s) => Some(signing_key(&secret(s)?).map_err(TargetError::fatal)?),
            None => None,
        };
        Ok(HttpTarget {
            client: client(
                config.timeout,
                config.connect_timeout,
                config.http2_prior_knowledge,
                ca_file,
                policy.allow_private_egress,
            )?,
            headers,
            signing_key,
            limiter: config
                .rate_limit
                .map(|r| RateLimiter::new(r, r.ceil() as u32)),
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            breaker: config
                .circuit_breaker
                .as_ref()
                .map(|b| CircuitBreaker::new(b.failures, b.open_for)),
            shown_url: redact_url(&config.url),
            config: config.clone(),
        })
    }

    async fn send_one(&self, envelope: &Envelope) -> Result<(), TargetError> {
        let request = encode(envelope, self.config.mode)?;
        if let Some(limiter) = &self.limiter {
            limiter.acquire().await;
        }
        // Held until the result is recorded: dropped early (cancelled, an early return) it
        // gives a half-open probe slot back.
        let permit = self
            .breaker
            .as_ref()
            .map(CircuitBreaker::admit)
            .transpose()?;
        let _permit = self
            .in_flight
            .acquire()
            .await
            .map_err(|_| TargetError::retryable("target is shutting down"))?;
        let mut headers = self.headers.clone();
        headers.extend(request.headers);
        if let Some(key) = &self.signing_key {
            // The id as a header can carry (any CloudEvents id may not); the signature covers
            // the header's value, so receivers verify what they read.
            let webhook_id = header_text(&request.id);
            let timestamp = chrono::Utc::now().timestamp();
            let signature = sign(key, &webhook_id, timestamp, &request.body);
            for (name, value) in [
                ("webhook-id", webhook_id),
                ("webhook-timestamp", timestamp.to_string()),
                ("webhook-signature", signature),
            ] {
                let value = HeaderValue::from_str(&value).map_err(|_| {
                    TargetError::fatal(format!("{name} is not a valid header value"))
                })?;
                headers.insert(name, value);
            }
        }
        let result = match self
            .client
            .post(&self.config.url)
            .headers(headers)
            .body(request.body)
            .send()
            .await
        {
            Ok(response) => status_result(response.status(), response.headers(), &self.shown_url),
            Err(e) => Err(send_error(&self.shown_url, e)),
        };
        if let Some(permit) = permit {
            let healthy = match &result {
                Ok(()) => true,
                Err(e) => !(e.retryable && e.status.is_none_or(retryable_status)),
            };
            permit.record(healthy);
        }
        result
    }
}

fn sensitive(value: &str) -> Result<HeaderValue, TargetError> {
    let mut value = HeaderValue::from_str(value)
        .map_err(|_| TargetError::fatal("auth value is not a valid header value"))?;
    value.set_sensitive(true);
    Ok(value)
}

#[async_trait]
impl Target for HttpTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        if !self.config.concurrent {
            for event in events {
                self.send_one(event).await?;
            }
            return Ok(());
        }
        // Concurrent: all of the batch at once, bounded by `max_in_flight` in `send_one`.
        let results = futures::future::join_all(events.iter().map(|e| self.send_one(e))).await;
        results
            .into_iter()
            .find_map(Result::err)
            .map_or(Ok(()), Err)
    }

    fn describe(&self) -> String {
        format!("http {}", self.shown_url)
    }
}

#[cfg(test)]
mod encode_tests {
    use super::*;

    /// Found by fuzzing (`ce_structured`): binary data without a `datacontenttype` went out
    /// as `application/json`, which a receiver reading JSON (this gateway's ingress) refuses.
    #[test]
    fn binary_mode_names_the_kind_of_data_without_a_content_type() {
        let envelope = |json: &str| Envelope {
            raw: bytes::Bytes::from(json.to_string()),
            accepted_ms: 0,
            event: None,
            body: None,
        };
        let cases = [
            (r#""data_base64":"AAE=""#, "application/octet-stream"),
            (r#""data":{"a":1}"#, "application/json"),
            (r#""data":"text""#, "application/json"),
        ];
        for (data, expected) in cases {
            let raw =
                format!(r#"{{"specversion":"1.0","id":"1","source":"/s","type":"t",{data}}}"#);
            let request = encode(&envelope(&raw), BodyMode::Binary).unwrap();
            assert_eq!(
                request.headers[reqwest::header::CONTENT_TYPE],
                expected,
                "{data}"
            );
            let back = crate::event::http::from_binary(&request.headers, &request.body);
            assert!(back.is_ok(), "{data}: {back:?}");
        }
    }
}
