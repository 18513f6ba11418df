//! The scaling signal (the "resource manager" of RocketMQ EventBridge's runtime plan):
//! `GET /api/v1/scaling` tells an autoscaler how far behind the cluster is and how many
//! replicas it wants.
//!
//! Every replica asked for it samples the whole cluster's backlog every few seconds (for ten
//! minutes after the last request: nobody asking, nothing is read) from the stores
//! (each bus shard's end and the committed positions of its subscriptions; in distributed
//! mode that is Redis, so any replica answers for all). From the samples of the last minute
//! it derives the trend of the backlog and the rate at which subscriptions move through
//! their shards. The desired replica count follows the convention of KEDA's lag scalers:
//! one replica per `target_lag` events of backlog (the backlog a minute from now if it is
//! growing), at least one, and never more than there are tasks to run.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::error_handling::HandleErrorLayer;
use axum::extract::{RawQuery, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::watch;

use crate::problem::Problem;
use crate::store::cluster::Cluster;
use crate::store::StoreError;
use crate::store::{BusLog, PositionStore};

/// How often each replica samples the backlog.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// The span the trend and the rate are measured over.
const WINDOW: Duration = Duration::from_secs(60);
/// How far ahead a growing backlog is projected.
const HORIZON_SECS: f64 = 60.0;
const DEFAULT_TARGET_LAG: u64 = 1000;

#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    lag: u64,
    /// The sum of every subscription's position: how far they all went.
    progress: u64,
    /// Each subscription's position in each shard.
    by_subscription: Arc<std::collections::HashMap<String, Vec<u64>>>,
}

/// A subscription's delivery rate (events per second): in all, and per shard (its tasks).
#[derive(Debug, Clone, PartialEq)]
pub struct Rate {
    pub total: f64,
    pub shards: Vec<f64>,
}

/// Recent samples, oldest first.
#[derive(Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
    /// When the signal was last asked for: nobody asking, nothing is sampled (it costs
    /// reads of every shard's positions).
    asked: Mutex<Option<Instant>>,
    /// The latest reading of the stores, shared by every request (whatever its query) for
    /// `CACHE_FOR`: a flood of requests reads the stores once a second. An async lock, so
    /// that concurrent requests wait for the one reading instead of each making its own.
    latest: tokio::sync::Mutex<Option<Arc<Reading>>>,
    /// How many readings were made (the cache's effect, for tests).
    readings: std::sync::atomic::AtomicU64,
}

/// How long a reading of the stores answers requests.
const CACHE_FOR: Duration = Duration::from_secs(1);

/// The cluster's backlog and membership, read at `at`.
struct Reading {
    at: Instant,
    snap: Snapshot,
    replicas: u64,
}

/// How long after the last request the backlog is still sampled.
const KEEP_SAMPLING: Duration = Duration::from_secs(600);

impl History {
    /// Delivered events per second of each subscription over the sampled window (the
    /// newest sample against the oldest within the window), cluster-wide; empty until
    /// there are two samples. Asking starts the sampling.
    pub fn rates(&self) -> std::collections::HashMap<String, Rate> {
        self.asked_now();
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let Some(newest) = samples.back() else {
            return std::collections::HashMap::new();
        };
        // Each subscription from the oldest sample in the window that has it (one created
        // meanwhile is measured from its first sample).
        let window: Vec<&Sample> = samples
            .iter()
            .filter(|s| {
                let age = newest.at.duration_since(s.at);
                age <= WINDOW && age >= SAMPLE_EVERY / 2
            })
            .collect();
        newest
            .by_subscription
            .iter()
            .filter_map(|(id, now)| {
                let base = window.iter().find(|s| s.by_subscription.contains_key(id))?;
                let from = base.by_subscription.get(id)?;
                let secs = newest.at.duration_since(base.at).as_secs_f64();
                let shards: Vec<f64> = now
                    .iter()
                    .enumerate()
                    .map(|(i, at)| {
                        at.saturating_sub(from.get(i).copied().unwrap_or(*at)) as f64 / secs
                    })
                    .collect();
                let total = shards.iter().sum();
                Some((id.clone(), Rate { total, shards }))
            })
            .collect()
    }

    /// The latest reading if it is younger than `CACHE_FOR`, else a new one from `read`
    /// (one at a time: concurrent callers share it).
    async fn reading<F, Fut>(&self, read: F) -> Result<Arc<Reading>, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Reading, StoreError>>,
    {
        let mut latest = self.latest.lock().await;
        if let Some(reading) = latest.as_ref().filter(|r| r.at.elapsed() < CACHE_FOR) {
            return Ok(reading.clone());
        }
        self.readings
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reading = Arc::new(read().await?);
        *latest = Some(reading.clone());
        Ok(reading)
    }

    pub(crate) fn asked_now(&self) {
        *self.asked.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    fn wanted(&self) -> bool {
        self.asked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|at| at.elapsed() < KEEP_SAMPLING)
    }

    fn push(&self, sample: Sample) {
        let at = sample.at;
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples.push_back(sample);
        while samples
            .front()
            .is_some_and(|s| at.duration_since(s.at) > WINDOW * 2)
        {
            samples.pop_front();
        }
    }

    /// The oldest sample within the window before `now`.
    fn baseline(&self, now: Instant) -> Option<Sample> {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples
            .iter()
            .find(|s| now.duration_since(s.at) <= WINDOW)
            .cloned()
    }
}

struct Snapshot {
    lag: u64,
    progress: u64,
    /// (subscription, lag), largest first.
    by_subscription: Vec<(String, u64)>,
    /// Each subscription's position in each shard.
    progress_by_subscription: std::collections::HashMap<String, Vec<u64>>,
    tasks: u64,
}

/// The cluster's backlog now, read from the stores.
/// What the scaling signal reads of a running gateway (the admin state has it all).
pub trait Observed: Send + Sync + 'static {
    /// The samples taken and the reading served last.
    fn history(&self) -> &History;
    fn positions(&self) -> &Arc<dyn PositionStore>;
    fn buses(&self) -> Arc<std::collections::HashMap<String, Arc<dyn BusLog>>>;
    /// The connectors of the running plan and their number of tasks.
    fn connectors(&self) -> Arc<std::collections::HashMap<String, u32>>;
    fn cluster(&self) -> &Arc<dyn Cluster>;
}

async fn snapshot(state: &impl Observed) -> Result<Snapshot, StoreError> {
    let positions = state.positions();
    let buses = state.buses();
    let connectors = state.connectors();
    let mut lag = 0u64;
    let mut progress = 0u64;
    let mut by_subscription = Vec::new();
    let mut progress_by_subscription = std::collections::HashMap::new();
    let mut tasks = 0u64;
    let mut names: Vec<&String> = connectors.keys().collect();
    names.sort();
    for (id, count) in connectors.iter() {
        // Sources (`source/{name}`) are tasks too, with no backlog of their own here.
        if id.splitn(3, '/').count() < 3 {
            tasks += u64::from(*count);
        }
    }
    let mut bus_names: Vec<&String> = buses.keys().collect();
    bus_names.sort();
    for bus in bus_names {
        let Some(log) = buses.get(bus) else { continue };
        let prefix = format!("{bus}/");
        let subscriptions: Vec<&String> = names
            .iter()
            .copied()
            .filter(|id| id.starts_with(&prefix) && id.splitn(3, '/').count() == 3)
            .collect();
        tasks += u64::from(log.shards());
        let mut sub_lag = vec![0u64; subscriptions.len()];
        let mut sub_progress = vec![Vec::with_capacity(log.shards() as usize); subscriptions.len()];
        for shard in 0..log.shards() {
            let end = log.end(shard).await?;
            let group = positions.peek_group(bus, shard).await?;
            for (i, id) in subscriptions.iter().enumerate() {
                // A subscription with no position yet starts at the end of the shard.
                let at = group.of(&id[prefix.len()..]).unwrap_or(end).min(end);
                sub_lag[i] += end - at;
                sub_progress[i].push(at);
                progress += at;
            }
        }
        for ((id, l), p) in subscriptions.into_iter().zip(sub_lag).zip(sub_progress) {
            lag += l;
            by_subscription.push((id.clone(), l));
            progress_by_subscription.insert(id.clone(), p);
        }
    }
    by_subscription.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(Snapshot {
        lag,
        progress,
        by_subscription,
        progress_by_subscription,
        tasks,
    })
}

/// Samples the backlog until `stop`.
pub async fn sample(state: Arc<impl Observed>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if !state.history().wanted() {
            continue;
        }
        match snapshot(state.as_ref()).await {
            Ok(s) => state.history().push(Sample {
                at: Instant::now(),
                lag: s.lag,
                progress: s.progress,
                by_subscription: Arc::new(s.progress_by_subscription),
            }),
            Err(e) => tracing::debug!(error = %e, "cannot sample the backlog"),
        }
    }
}

/// One replica per `target_lag` events of (projected) backlog, within `[1, max]`.
fn desired(lag: u64, trend: Option<f64>, target_lag: u64, max: u64) -> u64 {
    let projected = match trend {
        Some(t) if t > 0.0 => lag as f64 + t * HORIZON_SECS,
        _ => lag as f64,
    };
    let wanted = (projected / target_lag.max(1) as f64).ceil() as u64;
    wanted.clamp(1, max.max(1))
}

/// The parameters, or (the parameter at fault, why).
fn parse_query(query: Option<&str>) -> Result<(u64, Option<u64>), (String, String)> {
    let mut target_lag = DEFAULT_TARGET_LAG;
    let mut max = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let number = || {
            value.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                (
                    key.to_string(),
                    format!("`{key}` must be a positive integer"),
                )
            })
        };
        match key {
            "target_lag" => target_lag = number()?,
            "max_replicas" => max = Some(number()?),
            other => {
                return Err((
                    other.to_string(),
                    format!("unknown parameter `{other}` (known: target_lag, max_replicas)"),
                ))
            }
        }
    }
    Ok((target_lag, max))
}

/// The router of `GET /api/v1/scaling` (open like `/metrics`) within `[limits]`: at most
/// `max_concurrent_requests` at once (more are shed with 503) and each within
/// `request_timeout`.
pub fn within_limits(router: Router, limits: &crate::ingress::limits::Limits) -> Router {
    router.layer(
        tower::ServiceBuilder::new()
            .layer(HandleErrorLayer::new(|e: tower::BoxError| async move {
                if e.is::<tower::timeout::error::Elapsed>() {
                    Problem::request_timeout("limits.request_timeout")
                } else {
                    Problem::overloaded()
                }
            }))
            .load_shed()
            .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                limits.max_concurrent_requests,
            ))
            .timeout(limits.request_timeout),
    )
}

/// `GET /api/v1/scaling[?target_lag=N&max_replicas=M]`.
pub async fn handler<S: Observed>(
    State(state): State<Arc<S>>,
    RawQuery(query): RawQuery,
) -> Response {
    let (target_lag, max_replicas) = match parse_query(query.as_deref()) {
        Ok(q) => q,
        Err((field, detail)) => return Problem::bad_request(field, detail).into_response(),
    };
    state.history().asked_now();
    let reading = state
        .history()
        .reading(|| async {
            let snap = snapshot(state.as_ref()).await?;
            let replicas = state.cluster().members().await?.len() as u64;
            Ok(Reading {
                at: Instant::now(),
                snap,
                replicas,
            })
        })
        .await;
    let reading = match reading {
        Ok(r) => r,
        Err(e) => return Problem::unavailable(e.to_string(), 2).into_response(),
    };
    let (now, snap, replicas) = (reading.at, &reading.snap, reading.replicas);
    let (trend, rate, window) = match state.history().baseline(now) {
        Some(base) if now.duration_since(base.at) >= SAMPLE_EVERY => {
            let secs = now.duration_since(base.at).as_secs_f64();
            (
                Some((snap.lag as f64 - base.lag as f64) / secs),
                Some(snap.progress.saturating_sub(base.progress) as f64 / secs),
                Some(secs),
            )
        }
        _ => (None, None, None),
    };
    let cap = max_replicas.unwrap_or(snap.tasks).min(snap.tasks.max(1));
    let top: Vec<_> = snap
        .by_subscription
        .iter()
        .filter(|(_, l)| *l > 0)
        .take(10)
        .map(|(id, l)| json!({"subscription": id, "lag_events": l}))
        .collect();
    (
        [(header::CACHE_CONTROL, "no-store")],
        Json(json!({
            "lag_events": snap.lag,
            "lag_trend_events_per_second": trend,
            "processed_events_per_second": rate,
            "processed_events_per_second_per_replica": rate.map(|r| r / replicas.max(1) as f64),
            "window_seconds": window,
            "replicas": replicas,
            "tasks": snap.tasks,
            "target_lag": target_lag,
            "desired_replicas": desired(snap.lag, trend, target_lag, cap),
            "most_behind": top,
        })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn desired_follows_the_backlog_and_its_growth_within_bounds() {
        assert_eq!(desired(0, None, 1000, 8), 1);
        assert_eq!(desired(2500, None, 1000, 8), 3);
        // Growing by 50 events/s: a minute later it is 5500.
        assert_eq!(desired(2500, Some(50.0), 1000, 8), 6);
        // Shrinking: the backlog as it is.
        assert_eq!(desired(2500, Some(-50.0), 1000, 8), 3);
        assert_eq!(
            desired(1_000_000, None, 1000, 8),
            8,
            "never more than the tasks"
        );
    }

    #[test]
    fn rates_measure_each_subscription_from_its_first_sample_in_the_window() {
        let history = History::default();
        let t0 = Instant::now();
        let sample = |secs: u64, pairs: &[(&str, u64)]| Sample {
            at: t0 + Duration::from_secs(secs),
            lag: 0,
            progress: 0,
            by_subscription: Arc::new(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), vec![*v, 2 * *v]))
                    .collect(),
            ),
        };
        assert!(history.rates().is_empty(), "no samples, no rates");
        history.push(sample(0, &[("a", 0)]));
        history.push(sample(5, &[("a", 50), ("b", 0)]));
        history.push(sample(10, &[("a", 100), ("b", 40)]));
        let rates = history.rates();
        assert_eq!(rates["a"].shards, [10.0, 20.0]);
        assert_eq!(rates["a"].total, 30.0);
        assert_eq!(rates["b"].total, 24.0, "measured from its own first sample");
    }

    fn reading(at: Instant) -> Reading {
        Reading {
            at,
            snap: Snapshot {
                lag: 0,
                progress: 0,
                by_subscription: Vec::new(),
                progress_by_subscription: std::collections::HashMap::new(),
                tasks: 0,
            },
            replicas: 1,
        }
    }

    /// A flood of requests reads the stores once a second, concurrent ones included.
    #[tokio::test]
    async fn readings_are_shared_for_a_second() {
        let history = Arc::new(History::default());
        let reads = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut calls = Vec::new();
        for _ in 0..50 {
            let (history, reads) = (history.clone(), reads.clone());
            calls.push(tokio::spawn(async move {
                history
                    .reading(|| async move {
                        reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok(reading(Instant::now()))
                    })
                    .await
                    .unwrap();
            }));
        }
        for call in calls {
            call.await.unwrap();
        }
        assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(
            history.readings.load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        // An old reading is read again.
        *history.latest.lock().await = Some(Arc::new(reading(Instant::now() - CACHE_FOR * 2)));
        history
            .reading(|| async { Ok(reading(Instant::now())) })
            .await
            .unwrap();
        assert_eq!(
            history.readings.load(std::sync::atomic::Ordering::Relaxed),
            2
        );
        // A failed reading is not kept.
        let failed = history.latest.lock().await.take();
        assert!(failed.is_some());
        assert!(history
            .reading(|| async { Err(StoreError::Unavailable("down".to_string())) })
            .await
            .is_err());
        assert!(history.latest.lock().await.is_none());
    }

    #[test]
    fn query_parameters_are_checked() {
        assert_eq!(parse_query(None).unwrap(), (1000, None));
        assert_eq!(
            parse_query(Some("target_lag=50&max_replicas=4")).unwrap(),
            (50, Some(4))
        );
        assert!(parse_query(Some("target_lag=0")).is_err());
        assert!(parse_query(Some("targetlag=5")).is_err());
    }
}
