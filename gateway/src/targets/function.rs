//! The `function` target: POSTs each event (binary mode) to an HTTP function. A CloudEvent in
//! the answer (binary or structured) is put on `reply_bus` (Knative reply semantics), with
//! the `sluicehops` extension counting how many functions the chain has passed: past
//! `max_hops` the reply is refused, which stops loops. An answer body that is not a
//! CloudEvent is an error; an empty answer is a plain success.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cloudevents::event::ExtensionValue;

use crate::event::http::{self as cloudevent, ContentMode};
use crate::event::{self, EventError};
use crate::store::BusLog;
use crate::targets::config::BodyMode;
use crate::targets::config::FunctionConfig;
use crate::targets::http as http_target;
use crate::targets::policy::TargetPolicy;
use crate::targets::target::{append_to_bus, stored, Envelope, Resources, Target, TargetError};
use crate::values::redact_url;

pub const HOPS: &str = "sluicehops";

/// The largest answer read from a function: a reply goes onto a bus, so it is held to what
/// ingress can accept at most (`limits.max_event_bytes`' bound); a larger answer is not
/// read into memory at all.
const MAX_REPLY_BYTES: usize = crate::store::MAX_RECORD_BYTES / 2;

/// Reads an answer's body, refusing (without buffering it) one over `cap` bytes.
async fn read_capped(
    mut response: reqwest::Response,
    cap: usize,
    url: &str,
) -> Result<bytes::Bytes, TargetError> {
    let too_large = |size: String| {
        TargetError::fatal(format!(
            "{url} answered with {size} bytes, over the reply limit of {cap} bytes"
        ))
    };
    if let Some(length) = response.content_length() {
        if length > cap as u64 {
            return Err(too_large(length.to_string()));
        }
    }
    let mut body = bytes::BytesMut::new();
    loop {
        let chunk = response.chunk().await.map_err(|e| {
            TargetError::retryable(format!(
                "{url}: reading the answer failed: {}",
                e.without_url()
            ))
        })?;
        let Some(chunk) = chunk else {
            return Ok(body.freeze());
        };
        if body.len() + chunk.len() > cap {
            return Err(too_large(format!("more than {}", body.len() + chunk.len())));
        }
        body.extend_from_slice(&chunk);
    }
}

pub struct FunctionTarget {
    config: FunctionConfig,
    /// The URL as logs, errors and dead letters show it.
    shown_url: String,
    client: reqwest::Client,
    reply: Arc<dyn BusLog>,
}

impl FunctionTarget {
    pub fn new(
        config: &FunctionConfig,
        resources: &Resources,
        policy: &TargetPolicy,
    ) -> Result<FunctionTarget, TargetError> {
        config.check().map_err(TargetError::fatal)?;
        crate::targets::policy::check_url(&config.url, policy).map_err(TargetError::fatal)?;
        let reply = resources.buses.get(&config.reply_bus).ok_or_else(|| {
            TargetError::fatal(format!("reply_bus `{}` is not defined", config.reply_bus))
        })?;
        Ok(FunctionTarget {
            shown_url: redact_url(&config.url),
            config: config.clone(),
            client: http_target::client(
                config.timeout,
                Duration::from_secs(3),
                false,
                None,
                policy.allow_private_egress,
            )?,
            reply: reply.clone(),
        })
    }

    async fn call(&self, envelope: &Envelope) -> Result<(), TargetError> {
        // An integer or a string holding one (a boolean counts as none).
        let hops = (envelope.text()?.attribute(HOPS))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let request = http_target::encode(envelope, BodyMode::Binary)?;
        let url = &self.shown_url;
        let response = self
            .client
            .post(&self.config.url)
            .headers(request.headers)
            .body(request.body)
            .send()
            .await
            .map_err(|e| http_target::send_error(url, e))?;
        let status = response.status();
        let headers = response.headers().clone();
        http_target::status_result(status, &headers, url)?;
        let body = read_capped(response, MAX_REPLY_BYTES, url).await?;
        if body.is_empty() && !headers.contains_key("ce-specversion") {
            return Ok(());
        }
        let mut reply = match cloudevent::content_mode(&headers) {
            // The parsed binary event leaves its data in the stored form: read that back.
            Ok(ContentMode::Binary) => cloudevent::from_binary(&headers, &body).and_then(|p| {
                event::decode(&p.stored).map_err(|e| EventError::invalid("body", e.to_string()))
            }),
            Ok(ContentMode::Structured) => cloudevent::from_structured(&body),
            Ok(ContentMode::Batch) => Err(EventError::unsupported("a batch is not a reply")),
            Err(e) => Err(e),
        }
        .map_err(|e| TargetError {
            message: format!("{url} answered with a body that is not a CloudEvent: {e}"),
            retryable: false,
            status: Some(status.as_u16()),
            retry_after: None,
        })?;
        if hops + 1 > self.config.max_hops {
            return Err(TargetError::fatal(format!(
                "reply refused: the event has passed {hops} functions, max_hops is {}",
                self.config.max_hops
            )));
        }
        reply.set_extension(HOPS, ExtensionValue::Integer(hops + 1));
        let record = stored(&reply, self.reply.shards())?;
        append_to_bus(self.reply.as_ref(), &self.config.reply_bus, vec![record]).await
    }
}

#[async_trait]
impl Target for FunctionTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        for event in events {
            self.call(event).await?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("function {}", self.shown_url)
    }
}
