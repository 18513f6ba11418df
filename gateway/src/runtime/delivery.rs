//! What happens around one call to a target: the retry policy (attempts, event age,
//! exponential backoff with jitter, `Retry-After`), the dead-letter destination, and the
//! limits a target can share between its tasks (rate limiter, circuit breaker).
//!
//! Every event ends delivered, dead-lettered, or still pending (retried on): nothing is
//! dropped. A batch that fails for good is retried one event at a time, so one poison event
//! is dead-lettered alone and its neighbours still get through.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cloudevents::event::ExtensionValue;
use serde::Deserialize;

use crate::store::BusLog;
use crate::targets::config::{DeadLetterConfig, RetryConfig, TargetConfig};
use crate::targets::{self, Envelope, Target, TargetError};
use crate::values::duration;

enum DeadLetter {
    Bus { name: String, log: Arc<dyn BusLog> },
    Target(Arc<dyn Target>),
}

/// One subscription's way of delivering: its target under its retry policy.
pub struct Delivery {
    target: Arc<dyn Target>,
    policy: Policy,
    dead_letter: Option<DeadLetter>,
    rule: String,
    subscription: String,
    /// The latest failure while a delivery is still retrying (for status reports).
    last_error: Mutex<Option<String>>,
    metrics: crate::metrics::SubscriptionMetrics,
}

#[derive(Debug, Clone)]
struct Policy {
    max_attempts: u32,
    max_event_age: Duration,
    initial_backoff: Duration,
    max_backoff: Duration,
}

impl Delivery {
    pub fn new(
        policy: &targets::TargetPolicy,
        delivery: &DeliveryConfig,
        rule: &str,
        subscription: &str,
        target_config: &TargetConfig,
        target: Arc<dyn Target>,
        resources: &targets::Resources,
    ) -> Result<Delivery, TargetError> {
        let (retry, dead_letter) = target_config.delivery();
        let dead_letter = match dead_letter {
            None => None,
            Some(DeadLetterConfig { bus: Some(bus), .. }) => {
                let log = resources.buses.get(bus).ok_or_else(|| {
                    TargetError::fatal(format!("dead_letter.bus `{bus}` is not defined"))
                })?;
                Some(DeadLetter::Bus {
                    name: bus.clone(),
                    log: log.clone(),
                })
            }
            Some(DeadLetterConfig {
                target: Some(t), ..
            }) => Some(DeadLetter::Target(targets::build(policy, t, resources)?)),
            Some(_) => {
                return Err(TargetError::fatal(
                    "dead_letter needs exactly one of `bus` or `target`",
                ))
            }
        };
        Ok(Delivery::with_policy(
            target,
            &retry,
            delivery,
            dead_letter,
            rule,
            subscription,
        ))
    }

    /// The delivery of a subscription this replica cannot run (see `Subscription::failed`):
    /// its lanes never deliver, so it has no dead-letter destination to build; it keeps
    /// the subscription's retry policy and counters.
    pub fn unbuilt(
        delivery: &DeliveryConfig,
        rule: &str,
        subscription: &str,
        target_config: &TargetConfig,
        target: Arc<dyn Target>,
    ) -> Delivery {
        let (retry, _) = target_config.delivery();
        Delivery::with_policy(target, &retry, delivery, None, rule, subscription)
    }

    fn with_policy(
        target: Arc<dyn Target>,
        retry: &RetryConfig,
        delivery: &DeliveryConfig,
        dead_letter: Option<DeadLetter>,
        rule: &str,
        subscription: &str,
    ) -> Delivery {
        Delivery {
            target,
            policy: Policy {
                max_attempts: retry.max_attempts.max(1),
                max_event_age: retry.max_event_age,
                initial_backoff: retry.initial_backoff.unwrap_or(delivery.initial_backoff),
                max_backoff: retry.max_backoff.unwrap_or(delivery.max_backoff),
            },
            dead_letter,
            rule: rule.to_string(),
            subscription: subscription.to_string(),
            last_error: Mutex::new(None),
            metrics: crate::metrics::get().subscription(subscription),
        }
    }

    /// The subscription's counters.
    pub fn metrics(&self) -> &crate::metrics::SubscriptionMetrics {
        &self.metrics
    }

    /// The latest failure of a delivery that has not succeeded (or been dead-lettered) yet.
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn settled(&self) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// A delivery with the default policy and no dead letters (tests, simple callers).
    pub fn simple(target: Arc<dyn Target>, delivery: &DeliveryConfig, subscription: &str) -> Self {
        Delivery::with_policy(
            target,
            &RetryConfig::default(),
            delivery,
            None,
            "",
            subscription,
        )
    }

    pub fn describe(&self) -> String {
        self.target.describe()
    }

    /// Delivers the batch: returns once every event of it is delivered or dead-lettered.
    /// Cancelling it (dropping the future) is safe: the position has not moved, so the batch
    /// is delivered again later (at least once).
    pub async fn deliver(&self, events: &[Envelope]) {
        macro_rules! deliver_span {
            ($span:ident) => {
                tracing::$span!(
                    "deliver",
                    subscription = %self.subscription,
                    rule = %self.rule,
                    target = %self.target.describe(),
                    events = events.len(),
                    traceparent = tracing::field::Empty,
                    trace_links = tracing::field::Empty
                )
            };
        }
        // The span is exported at INFO while tracing export is on; otherwise it is a DEBUG
        // span for the logs: with thousands of subscriptions an event is often a delivery
        // of its own, and an INFO span per delivery (allocated and formatted for the log
        // layer) would cost more than the delivery. Failures are logged with the
        // subscription and target whatever the level.
        #[cfg(feature = "otlp")]
        let span = if crate::otlp::enabled() {
            let span = deliver_span!(info_span);
            trace_context(&span, events);
            span
        } else {
            deliver_span!(debug_span)
        };
        #[cfg(not(feature = "otlp"))]
        let span = deliver_span!(debug_span);
        if span.is_disabled() {
            self.deliver_batch(events).await;
        } else {
            tracing::Instrument::instrument(self.deliver_batch(events), span).await;
        }
        self.settled();
    }

    async fn deliver_batch(&self, events: &[Envelope]) {
        if events.is_empty() {
            return;
        }
        let first = Instant::now();
        let mut attempts = 0u32;
        let last_error = loop {
            attempts += 1;
            if attempts > 1 {
                self.metrics.retried.inc_by(events.len() as u64);
            }
            match self.target.deliver(events).await {
                Ok(()) => {
                    self.delivered(events, first);
                    return;
                }
                Err(e) => {
                    self.log_failure(&e, attempts, events.len());
                    let exhausted = self.exhausted(attempts, first, events);
                    if events.len() > 1 && (!e.retryable || exhausted) {
                        break e;
                    }
                    if !e.retryable || exhausted {
                        self.dead_letter(&events[0], &e, attempts).await;
                        return;
                    }
                    tokio::time::sleep(self.backoff(attempts, e.retry_after)).await;
                }
            }
        };
        // The batch failed for good: go one event at a time so only the events that fail
        // on their own are dead-lettered. Their attempt count continues from the batch's.
        tracing::debug!(subscription = %self.subscription, error = %last_error, "batch failed; delivering its events one by one");
        for event in events {
            self.deliver_one(event, attempts, first).await;
        }
    }

    async fn deliver_one(&self, event: &Envelope, mut attempts: u32, first: Instant) {
        let one = std::slice::from_ref(event);
        loop {
            attempts += 1;
            if attempts > 1 {
                self.metrics.retried.inc();
            }
            match self.target.deliver(one).await {
                Ok(()) => {
                    self.delivered(one, first);
                    return;
                }
                Err(e) => {
                    self.log_failure(&e, attempts, 1);
                    if !e.retryable || self.exhausted(attempts, first, one) {
                        self.dead_letter(event, &e, attempts).await;
                        return;
                    }
                    tokio::time::sleep(self.backoff(attempts, e.retry_after)).await;
                }
            }
        }
    }

    /// Out of attempts, or the oldest event is older than `max_event_age`, counted from
    /// its acceptance (from the first attempt for events stored without their time).
    fn exhausted(&self, attempts: u32, first: Instant, events: &[Envelope]) -> bool {
        if attempts >= self.policy.max_attempts {
            return true;
        }
        let oldest = events
            .iter()
            .map(|e| e.accepted_ms)
            .filter(|t| *t > 0)
            .min();
        let age = match oldest {
            Some(accepted) => {
                Duration::from_millis(crate::store::now_ms().saturating_sub(accepted))
            }
            None => first.elapsed(),
        };
        age >= self.policy.max_event_age
    }

    fn delivered(&self, events: &[Envelope], first: Instant) {
        self.metrics.delivered.inc_by(events.len() as u64);
        self.metrics.duration.observe(first.elapsed().as_secs_f64());
        let now = crate::store::now_ms();
        for e in events.iter().filter(|e| e.accepted_ms > 0) {
            self.metrics
                .latency
                .observe(now.saturating_sub(e.accepted_ms) as f64 / 1000.0);
        }
    }

    fn log_failure(&self, e: &TargetError, attempts: u32, events: usize) {
        self.metrics.failed.inc_by(events as u64);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        tracing::warn!(
            subscription = %self.subscription,
            target = %self.target.describe(),
            retryable = e.retryable,
            status = e.status,
            attempts,
            events,
            error = %e,
            "delivery failed"
        );
    }

    /// Exponential backoff with "equal jitter" (half fixed, half random), or what the peer
    /// asked for with `Retry-After` (capped at an hour so a bad header cannot park a task).
    fn backoff(&self, attempts: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(wait) = retry_after {
            return wait.min(Duration::from_secs(3600));
        }
        backoff(
            self.policy.initial_backoff,
            self.policy.max_backoff,
            attempts,
        )
    }

    /// An event its transform chain refused (a user function's error, trap, time or
    /// memory limit, or invalid output): dead-lettered with the reason, never retried
    /// (it would fail the same way). Without a dead-letter destination it is logged and
    /// skipped, as other transform failures are.
    pub async fn reject(&self, event: &Envelope, reason: &str) {
        self.metrics.failed.inc();
        if self.dead_letter.is_none() {
            tracing::error!(subscription = %self.subscription, reason, "the transform refused the event and no dead_letter is configured: skipping it");
            return;
        }
        self.dead_letter(event, &TargetError::fatal(reason), 0)
            .await;
    }

    /// Sends the event to the dead-letter destination, retrying that until it succeeds. With
    /// no destination configured the event stays pending: it is retried at the longest
    /// backoff, loudly, rather than dropped.
    async fn dead_letter(&self, event: &Envelope, error: &TargetError, attempts: u32) {
        let Some(dead_letter) = &self.dead_letter else {
            tracing::error!(
                subscription = %self.subscription,
                error = %error,
                attempts,
                "event cannot be delivered and no dead_letter is configured: it stays pending and is retried"
            );
            let mut attempts = attempts;
            loop {
                tokio::time::sleep(self.policy.max_backoff).await;
                attempts += 1;
                self.metrics.retried.inc();
                match self.target.deliver(std::slice::from_ref(event)).await {
                    Ok(()) => {
                        self.metrics.delivered.inc();
                        return;
                    }
                    Err(e) => self.log_failure(&e, attempts, 1),
                }
            }
        };
        let letter = match self.letter(event, error, attempts) {
            Ok(letter) => letter,
            Err(e) => {
                // The stored event does not even decode: keep its bytes as data of a wrapper.
                tracing::error!(subscription = %self.subscription, error = %e, "dead-lettering an undecodable event as an opaque wrapper");
                match self.opaque_letter(event, error, attempts) {
                    Ok(letter) => letter,
                    Err(e) => {
                        tracing::error!(subscription = %self.subscription, error = %e, "cannot build a dead letter; the event stays pending");
                        std::future::pending::<()>().await;
                        return;
                    }
                }
            }
        };
        let mut tries = 0u32;
        loop {
            tries += 1;
            let result = match dead_letter {
                DeadLetter::Bus { name, log } => match targets::stored(&letter, log.shards()) {
                    Ok(record) => targets::append_to_bus(log.as_ref(), name, vec![record]).await,
                    Err(e) => Err(e),
                },
                DeadLetter::Target(target) => {
                    let raw = match crate::event::encode(&letter) {
                        Ok(raw) => bytes::Bytes::from(raw),
                        Err(e) => {
                            tracing::error!(error = %e, "cannot encode a dead letter");
                            std::future::pending::<()>().await;
                            return;
                        }
                    };
                    target
                        .deliver(&[Envelope {
                            raw,
                            accepted_ms: 0,
                            event: Some(letter.clone()),
                            body: None,
                        }])
                        .await
                }
            };
            match result {
                Ok(()) => {
                    self.metrics.dead_lettered.inc();
                    tracing::warn!(subscription = %self.subscription, attempts, reason = %error, "event dead-lettered");
                    return;
                }
                Err(e) => {
                    tracing::error!(subscription = %self.subscription, error = %e, tries, "dead-letter delivery failed; retrying");
                    tokio::time::sleep(backoff(
                        self.policy.initial_backoff,
                        self.policy.max_backoff,
                        tries,
                    ))
                    .await;
                }
            }
        }
    }

    fn letter(
        &self,
        event: &Envelope,
        error: &TargetError,
        attempts: u32,
    ) -> Result<cloudevents::Event, TargetError> {
        let mut letter = event.decoded()?.into_owned();
        self.annotate(&mut letter, error, attempts);
        Ok(letter)
    }

    fn opaque_letter(
        &self,
        event: &Envelope,
        error: &TargetError,
        attempts: u32,
    ) -> Result<cloudevents::Event, TargetError> {
        use cloudevents::EventBuilder;
        let mut letter = cloudevents::EventBuilderV10::new()
            .id(format!("{}-{}", self.subscription, fastrand::u64(..)))
            .source("/sluice/dead-letter")
            .ty("io.sluice.deadletter.undecodable")
            .data(
                "application/octet-stream",
                cloudevents::Data::Binary(event.raw.to_vec()),
            )
            .build()
            .map_err(|e| TargetError::fatal(e.to_string()))?;
        self.annotate(&mut letter, error, attempts);
        Ok(letter)
    }

    fn annotate(&self, letter: &mut cloudevents::Event, error: &TargetError, attempts: u32) {
        letter.set_extension("deadletterreason", error.message.clone());
        letter.set_extension(
            "deadletterstatus",
            error
                .status
                .map_or_else(|| "none".to_string(), |s| s.to_string()),
        );
        letter.set_extension(
            "deadletterattempts",
            ExtensionValue::Integer(i64::from(attempts)),
        );
        letter.set_extension("deadletterrule", self.rule.clone());
        letter.set_extension("deadlettertarget", self.target.describe());
        // `bus/rule/target`: where to redeliver it (POST .../rules/{rule}/redeliver).
        letter.set_extension("deadletterconnector", self.subscription.clone());
    }
}

/// `initial * 2^(attempt-1)` capped at `max`, half of it fixed and half random.
pub fn backoff(initial: Duration, max: Duration, attempt: u32) -> Duration {
    let exp = attempt.saturating_sub(1).min(30);
    let base = initial.saturating_mul(1u32 << exp).min(max);
    let half = base / 2;
    half + Duration::from_nanos(fastrand::u64(
        ..=half.as_nanos().min(u128::from(u64::MAX)) as u64,
    ))
}

/// The exported `deliver` span continues the trace of the event it delivers (one event),
/// or links to the traces of the events of its batch.
#[cfg(feature = "otlp")]
fn trace_context(span: &tracing::Span, events: &[Envelope]) {
    /// Only the extension, when the event was not decoded on the way (no filter or
    /// transform needed it): the rest of the stored JSON is skipped.
    #[derive(serde::Deserialize)]
    struct Traced {
        traceparent: Option<String>,
    }
    let mut parents = events.iter().filter_map(|e| match &e.event {
        Some(event) => match event.extension("traceparent")? {
            ExtensionValue::String(s) => Some(s.clone()),
            _ => None,
        },
        None => serde_json::from_slice::<Traced>(&e.raw).ok()?.traceparent,
    });
    if events.len() == 1 {
        if let Some(parent) = parents.next() {
            span.record("traceparent", parent.as_str());
        }
        return;
    }
    let links: Vec<String> = parents.take(crate::otlp::MAX_LINKS).collect();
    if !links.is_empty() {
        span.record("trace_links", links.join(" ").as_str());
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeliveryConfig {
    /// Most events a task reads and hands to its target at once.
    pub batch_size: usize,
    /// Most bytes of stored events one read of the log takes and one delivery hands to its
    /// target (the last event may go past it; a larger event goes alone), so memory is
    /// bounded by bytes whatever the events' size.
    pub batch_bytes: usize,
    /// How long a task lets new events gather after being woken, so that under load it
    /// delivers batches instead of single events (costs this much delivery latency).
    #[serde(deserialize_with = "duration")]
    pub linger: Duration,
    /// How often delivered positions are committed to the store.
    #[serde(deserialize_with = "duration")]
    pub commit_interval: Duration,
    /// First wait after a failed delivery; doubles up to `max_backoff`.
    #[serde(deserialize_with = "duration")]
    pub initial_backoff: Duration,
    #[serde(deserialize_with = "duration")]
    pub max_backoff: Duration,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            batch_size: 256,
            batch_bytes: 1024 * 1024,
            linger: Duration::from_millis(2),
            commit_interval: Duration::from_millis(200),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(30),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let ms = Duration::from_millis;
        for attempt in 1..40 {
            let b = backoff(ms(100), ms(5000), attempt);
            let base = ms(100)
                .saturating_mul(1 << (attempt - 1).min(30))
                .min(ms(5000));
            assert!(b >= base / 2 && b <= base, "{attempt}: {b:?}");
        }
    }
}
