//! What ingress needs to answer a request, and nothing else: the buses with their settings
//! (one immutable `Settings`, swapped whole when the catalog changes and read once per
//! request), the limits, the rate-limit buckets, the dedup store, and the server's state
//! (draining, memory held by requests in flight).
//!
//! The admin API, replays and the scaling signal keep their own state (`crate::admin`); the
//! application (`crate::app`) makes each `Settings` from the running plan.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::http::header;

use crate::ingress::auth::KeySet;
use crate::ingress::limits::Limits;
use crate::ingress::ratelimit::{Limiter, RateLimitConfig};
use crate::ingress::schema::BusSchemas;
use crate::ingress::webhooks::source::Webhooks;
use crate::metrics::BusIngressSeries;
use crate::problem::Problem;
use crate::store::cluster::Cluster;
use crate::store::dedup::Dedup;
use crate::store::BusLog;

/// The buses and their ingress settings as one catalog version has them: read once per
/// request, never locked.
#[derive(Clone)]
pub struct Settings {
    /// The log of every bus that runs here.
    pub buses: Arc<HashMap<String, Arc<dyn BusLog>>>,
    /// The dedup window of each bus that opted in to CloudEvents deduplication.
    pub dedup: Arc<HashMap<String, Duration>>,
    /// The accepted keys of each bus that requires one.
    pub auth: Arc<HashMap<String, Arc<KeySet>>>,
    /// The JSON Schemas of each bus that has some.
    pub schemas: Arc<HashMap<String, Arc<BusSchemas>>>,
    /// The rate limit of each bus that has one.
    pub rate: Arc<HashMap<String, RateLimitConfig>>,
    /// The webhook sources (`POST /webhooks/{name}`).
    pub webhooks: Arc<Webhooks>,
    /// The AWS PutEvents settings (`aws` table) of each bus that has one.
    pub aws: Arc<HashMap<String, Arc<crate::ingress::compat::aws::config::AwsBus>>>,
    /// The ingress metrics of each bus, resolved once per catalog version.
    pub series: Arc<HashMap<String, Arc<BusIngressSeries>>>,
}

impl Settings {
    /// No buses, no webhook sources.
    pub fn empty() -> Settings {
        Settings {
            buses: Arc::default(),
            dedup: Arc::default(),
            auth: Arc::default(),
            schemas: Arc::default(),
            rate: Arc::default(),
            webhooks: Arc::new(Webhooks::empty()),
            aws: Arc::default(),
            series: Arc::default(),
        }
    }

    /// The ingress series for each of `buses`.
    pub fn series_of<'a>(
        buses: impl IntoIterator<Item = &'a String>,
    ) -> Arc<HashMap<String, Arc<BusIngressSeries>>> {
        Arc::new(
            buses
                .into_iter()
                .map(|bus| (bus.clone(), Arc::new(BusIngressSeries::new(bus))))
                .collect(),
        )
    }

    /// The ingress metrics of a request to `bus`: its bus's, or `bus="unknown"` (labels
    /// stay bounded whatever the path says).
    pub fn series(&self, bus: &str) -> Arc<BusIngressSeries> {
        match self.series.get(bus) {
            Some(series) => series.clone(),
            None if self.buses.contains_key(bus) => Arc::new(BusIngressSeries::new(bus)),
            None => crate::metrics::unknown_bus_series(),
        }
    }
}

pub struct IngressState {
    settings: ArcSwap<Settings>,
    pub limits: Limits,
    pub cluster: Arc<dyn Cluster>,
    /// Where the rate-limit buckets live: this process, or Redis (distributed).
    limiter: Arc<dyn Limiter>,
    /// Which deduplication keys were seen (webhook deliveries, deduplicating buses).
    dedup: Arc<dyn Dedup>,
    /// Set when shutdown starts: readiness fails from then on.
    draining: AtomicBool,
    /// `limits.max_inflight_bytes`, in KiB: what requests being handled may hold.
    memory: Arc<tokio::sync::Semaphore>,
    /// `[knative] brokers`: the bus of each mapped `namespace/broker` (static config).
    knative_brokers: Arc<std::collections::BTreeMap<String, String>>,
}

impl IngressState {
    pub fn new(
        settings: Settings,
        limits: Limits,
        cluster: Arc<dyn Cluster>,
        limiter: Arc<dyn Limiter>,
        dedup: Arc<dyn Dedup>,
    ) -> IngressState {
        IngressState {
            settings: ArcSwap::from_pointee(settings),
            memory: Arc::new(tokio::sync::Semaphore::new(
                limits.max_inflight_bytes.div_ceil(1024),
            )),
            limits,
            cluster,
            limiter,
            dedup,
            draining: AtomicBool::new(false),
            knative_brokers: Arc::default(),
        }
    }

    /// With the `[knative] brokers` mapping (see `crate::ingress::compat::knative`).
    pub fn with_knative_brokers(
        mut self,
        brokers: std::collections::BTreeMap<String, String>,
    ) -> IngressState {
        self.knative_brokers = Arc::new(brokers);
        self
    }

    /// The `[knative] brokers` mapping: `namespace/broker` to bus.
    pub fn knative_brokers(&self) -> &std::collections::BTreeMap<String, String> {
        &self.knative_brokers
    }

    /// The buses and their settings, as of now.
    pub fn settings(&self) -> Arc<Settings> {
        self.settings.load_full()
    }

    /// Takes the settings of a new catalog version.
    pub fn set_settings(&self, settings: Settings) {
        self.settings.store(Arc::new(settings));
    }

    pub fn dedup(&self) -> &Arc<dyn Dedup> {
        &self.dedup
    }

    /// Reserves what a request with this body may take while it is read, parsed and
    /// stored (see `limits.max_inflight_bytes`): twice the body, plus 16 times the largest
    /// event's text when the body is parsed into a JSON tree. A body of unknown length is
    /// counted at its limit. `None` when it does not fit: the request is to be shed
    /// ([`Problem::memory_full`]).
    pub(crate) fn reserve_memory(
        &self,
        headers: &http::HeaderMap,
        limit: usize,
        json_tree: bool,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let body = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(limit, |len| len.min(limit));
        let tree = if json_tree {
            body.min(self.limits.max_event_bytes).saturating_mul(16)
        } else {
            0
        };
        let total = self.limits.max_inflight_bytes.div_ceil(1024);
        // One request alone always fits, whatever the limits.
        let kib = (body.saturating_mul(2).saturating_add(tree))
            .div_ceil(1024)
            .clamp(1, total.max(1));
        let kib = u32::try_from(kib).unwrap_or(u32::MAX);
        self.memory.clone().try_acquire_many_owned(kib).ok()
    }

    /// Shutdown started: `/readyz` answers 503 from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Whether a request to `bus` may in: one of the bus's keys when it requires one (with
    /// that key's rate limit), then the bus's rate limit. The key the request came with (a
    /// name made of its digest, "" when the bus needs none): dedup records are kept per
    /// producer, so one cannot make another's event a duplicate.
    pub async fn admit(
        &self,
        settings: &Settings,
        bus: &str,
        headers: &http::HeaderMap,
    ) -> Result<String, Problem> {
        let mut producer = String::new();
        if let Some(keys) = settings.auth.get(bus) {
            let key = keys.check(headers).map_err(|refused| refused.problem())?;
            if let Some(limit) = &keys.per_key {
                self.rate_limit(&format!("key/{bus}/{}", key.0), "auth.rate_limit", limit)
                    .await?;
            }
            producer = key.0;
        }
        self.bus_rate_limit(settings, bus).await?;
        Ok(producer)
    }

    /// Takes a token from the bus's rate limit, when it has one.
    pub async fn bus_rate_limit(&self, settings: &Settings, bus: &str) -> Result<(), Problem> {
        match settings.rate.get(bus) {
            Some(limit) => {
                self.rate_limit(&format!("bus/{bus}"), "rate_limit", limit)
                    .await
            }
            None => Ok(()),
        }
    }

    /// Takes a token from the bucket `scope`; the problem to answer when refused.
    pub async fn rate_limit(
        &self,
        scope: &str,
        field: &str,
        limit: &RateLimitConfig,
    ) -> Result<(), Problem> {
        match self.limiter.take(scope, limit).await {
            Ok(None) => Ok(()),
            Ok(Some(wait)) => Err(Problem::rate_limited(field, wait)),
            Err(e) => Err(Problem::unavailable(e.to_string(), 2)),
        }
    }
}
