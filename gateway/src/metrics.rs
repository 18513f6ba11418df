//! Prometheus metrics, served at `GET /metrics` (OpenMetrics text, which Prometheus scrapes
//! natively). One registry per process; every metric starts with `sluice_`.
//!
//! Cardinality is bounded by the configuration, never by traffic: labels are buses, shards,
//! subscriptions (`bus/rule/target`), tasks, HTTP status codes and ingress modes; nothing
//! per event. Hot paths hold pre-resolved handles (an atomic add each), not label lookups.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IngressLabels {
    pub bus: String,
    pub mode: String,
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BusModeLabels {
    pub bus: String,
    pub mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FunctionLabels {
    pub function: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabels {
    pub bus: String,
    pub shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubscriptionLabels {
    pub subscription: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubscriptionShardLabels {
    pub subscription: String,
    pub shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaskLabels {
    pub task: String,
    pub worker: String,
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub operation: String,
}

/// The labels of a set of dedup records: none for the standalone map (so its series read
/// as they always did), the store and the index's place for a Redis index. Only one kind
/// exists in a process (it is standalone or distributed).
type DedupLabels = Vec<(&'static str, String)>;

/// The gauges of one set of dedup records: how many, and their estimated bytes.
pub type DedupSeries = (Gauge, Gauge);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_buckets() -> Histogram {
    // 100 µs .. ~52 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 20))
}

/// Fewer buckets for the one histogram per subscription (thousands of rules): 1 ms .. 65 s.
fn delivery_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 4.0, 9))
}

/// The ingress series of one (bus, mode): `202`s, the commonest answer, counted by a held
/// handle; other statuses by label (they are rarer and each is a new series anyway).
pub struct IngressSeries {
    bytes: Counter,
    duration: Histogram,
    /// Made at the first `202`, so that a bus that never accepted shows no such series.
    accepted: OnceLock<Counter>,
    bus: String,
    mode: &'static str,
}

impl IngressSeries {
    /// One request: its status, its bytes and its duration.
    pub fn record(&self, status: u16, bytes: u64, elapsed: Duration) {
        self.bytes.inc_by(bytes);
        self.duration.observe(elapsed.as_secs_f64());
        if status == 202 {
            self.accepted
                .get_or_init(|| {
                    get()
                        .ingress_requests
                        .get_or_create(&IngressLabels {
                            bus: self.bus.clone(),
                            mode: self.mode.to_string(),
                            status: "202".to_string(),
                        })
                        .clone()
                })
                .inc();
        } else {
            get()
                .ingress_requests
                .get_or_create(&IngressLabels {
                    bus: self.bus.clone(),
                    mode: self.mode.to_string(),
                    status: status.to_string(),
                })
                .inc();
        }
    }
}

/// The ingress series of one bus in each CloudEvents content mode (`binary`, `structured`,
/// `batch`, `other`): each resolved by the first request in that mode and held by the
/// catalog version's ingress settings (so a new version resolves them again, once).
pub struct BusIngressSeries {
    bus: String,
    modes: [OnceLock<IngressSeries>; 4],
}

impl BusIngressSeries {
    pub const MODES: [&'static str; 4] = ["binary", "structured", "batch", "other"];

    pub fn new(bus: &str) -> BusIngressSeries {
        BusIngressSeries {
            bus: bus.to_string(),
            modes: Default::default(),
        }
    }

    /// The series of `mode` (one of [`Self::MODES`]; anything else counts as `other`).
    pub fn mode(&self, mode: &str) -> &IngressSeries {
        let i = Self::MODES.iter().position(|m| *m == mode).unwrap_or(3);
        let mode = Self::MODES[i];
        self.modes[i].get_or_init(|| get().ingress_series(&self.bus, mode))
    }
}

/// The series of requests to a bus that does not exist (`bus="unknown"`).
pub fn unknown_bus_series() -> std::sync::Arc<BusIngressSeries> {
    static UNKNOWN: OnceLock<std::sync::Arc<BusIngressSeries>> = OnceLock::new();
    UNKNOWN
        .get_or_init(|| std::sync::Arc::new(BusIngressSeries::new("unknown")))
        .clone()
}

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    pub ingress_requests: Family<IngressLabels, Counter>,
    pub ingress_bytes: Family<BusModeLabels, Counter>,
    pub ingress_duration: HistogramFamily<BusModeLabels>,
    pub appended: Family<ShardLabels, Counter>,
    pub flush_duration: Histogram,
    pub flush_errors: Counter,
    pub write_errors: Family<ShardLabels, Counter>,
    pub redis_duration: HistogramFamily<OperationLabels>,
    pub redis_errors: Family<OperationLabels, Counter>,
    pub matched: Family<SubscriptionLabels, Counter>,
    pub delivered: Family<SubscriptionLabels, Counter>,
    pub failed: Family<SubscriptionLabels, Counter>,
    pub retried: Family<SubscriptionLabels, Counter>,
    pub dead_lettered: Family<SubscriptionLabels, Counter>,
    pub expired: Family<SubscriptionLabels, Counter>,
    pub delivery_duration: HistogramFamily<SubscriptionLabels>,
    pub event_latency: HistogramFamily<SubscriptionLabels>,
    pub lag_events: Family<SubscriptionShardLabels, Gauge>,
    pub lag_seconds: Family<SubscriptionShardLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    task_state: Family<TaskLabels, Gauge>,
    task_states: Mutex<HashMap<String, TaskLabels>>,
    pub leases_held: Gauge,
    pub lease_losses: Counter,
    pub rebalances: Counter,
    /// The dedup records (webhook delivery ids and bus `source`/`id` keys): unlabelled in
    /// a standalone process (its one map), `{store="redis",bus,shard}` per Redis index in
    /// a distributed one (see [`Metrics::dedup_series`]).
    dedup_entries: Family<DedupLabels, Gauge>,
    dedup_memory: Family<DedupLabels, Gauge>,
    pub dedup_file: Gauge,
    pub dedup_compactions: Counter,
    pub dedup_evicted: Counter,
    /// Appends refused because fewer Redis replicas than `cluster.min_replicas` confirmed
    /// them in time (`cluster.redis_durability = "replicated"`).
    pub replication_shortfall: Counter,
    /// Calls of WebAssembly functions, by function and outcome (`ok`, `error`, `trap`,
    /// `timeout`, `memory`, `invalid_output`).
    pub function_calls: Family<FunctionLabels, Counter>,
}

static METRICS: OnceLock<Metrics> = OnceLock::new();

/// The process's metrics.
pub fn get() -> &'static Metrics {
    METRICS.get_or_init(Metrics::new)
}

impl Metrics {
    fn new() -> Metrics {
        let mut root = Registry::default();
        let r = root.sub_registry_with_prefix("sluice");
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_string(),
            })
            .set(1);
        r.register("build_info", "The gateway's version (always 1)", build);

        let ingress_requests = Family::default();
        r.register(
            "ingress_requests",
            "Event requests answered, by bus, mode (binary, structured, batch) and status",
            ingress_requests.clone(),
        );
        let ingress_bytes = Family::default();
        r.register_with_unit(
            "ingress_request",
            "Bytes of event request bodies received",
            Unit::Bytes,
            ingress_bytes.clone(),
        );
        let ingress_duration: HistogramFamily<BusModeLabels> =
            Family::new_with_constructor(latency_buckets);
        r.register_with_unit(
            "ingress_request_duration",
            "Time from a request's arrival to its answer (stored events are durable by then)",
            Unit::Seconds,
            ingress_duration.clone(),
        );
        let appended = Family::default();
        r.register(
            "events_appended",
            "Events appended to a bus shard's log (from ingress, sources, functions, the bus target, dead letters)",
            appended.clone(),
        );
        let flush_duration = latency_buckets();
        r.register_with_unit(
            "store_flush_duration",
            "Duration of one flush round of an embedded log's group commit (the fdatasync of every shard with appenders waiting)",
            Unit::Seconds,
            flush_duration.clone(),
        );
        let flush_errors = Counter::default();
        r.register(
            "store_flush_errors",
            "Failed fdatasync calls of the embedded log (each fences the log)",
            flush_errors.clone(),
        );
        let write_errors = Family::default();
        r.register(
            "store_write_errors",
            "Failed appends of a bus shard (no space, file too large, Redis errors)",
            write_errors.clone(),
        );
        let redis_duration: HistogramFamily<OperationLabels> =
            Family::new_with_constructor(latency_buckets);
        r.register_with_unit(
            "redis_command_duration",
            "Duration of the Redis calls of the cluster store, by operation",
            Unit::Seconds,
            redis_duration.clone(),
        );
        let redis_errors = Family::default();
        r.register(
            "redis_errors",
            "Failed Redis calls, by operation",
            redis_errors.clone(),
        );
        let matched = Family::default();
        r.register(
            "subscription_matched_events",
            "Events a subscription's rule took (queued for its target)",
            matched.clone(),
        );
        let delivered = Family::default();
        r.register(
            "subscription_delivered_events",
            "Events the target acknowledged",
            delivered.clone(),
        );
        let failed = Family::default();
        r.register(
            "subscription_failed_attempts",
            "Delivery attempts that failed (each event of a failed batch counts)",
            failed.clone(),
        );
        let retried = Family::default();
        r.register(
            "subscription_retries",
            "Delivery attempts made again after a failure",
            retried.clone(),
        );
        let dead_lettered = Family::default();
        r.register(
            "subscription_dead_lettered_events",
            "Events sent to the dead-letter destination",
            dead_lettered.clone(),
        );
        let expired = Family::default();
        r.register(
            "subscription_expired_events",
            "Events of the bus a subscription skipped undelivered because they got older than the bus's max_backlog_age (counted by sequence number: some may not have matched its rule)",
            expired.clone(),
        );
        let delivery_duration: HistogramFamily<SubscriptionLabels> =
            Family::new_with_constructor(delivery_buckets);
        r.register_with_unit(
            "subscription_delivery_duration",
            "Time from a batch's first delivery attempt to its acknowledgement (retries included)",
            Unit::Seconds,
            delivery_duration.clone(),
        );
        let event_latency: HistogramFamily<SubscriptionLabels> =
            Family::new_with_constructor(delivery_buckets);
        r.register_with_unit(
            "subscription_event_latency",
            "Time from an event's acceptance (stored, 202) to the target's acknowledgement of it",
            Unit::Seconds,
            event_latency.clone(),
        );
        let lag_seconds = Family::default();
        r.register_with_unit(
            "subscription_lag",
            "Age of the oldest event of a shard a subscription has not delivered yet (0 when caught up), on the replica running the shard",
            Unit::Seconds,
            lag_seconds.clone(),
        );
        let lag_events = Family::default();
        r.register(
            "subscription_lag_events",
            "Events of a shard not yet delivered by a subscription (log end minus position), on the replica running the shard",
            lag_events.clone(),
        );
        let task_state = Family::default();
        r.register(
            "task_state",
            "1 for each task this replica reported and its current state",
            task_state.clone(),
        );
        let leases_held = Gauge::default();
        r.register(
            "leases_held",
            "Task leases this replica holds",
            leases_held.clone(),
        );
        let lease_losses = Counter::default();
        r.register(
            "lease_losses",
            "Leases found taken by another worker on renewal",
            lease_losses.clone(),
        );
        let rebalances = Counter::default();
        r.register(
            "rebalances",
            "Rebalance rounds in which this replica stopped tasks (moved, paused, restarted or ended)",
            rebalances.clone(),
        );
        let dedup_entries = Family::<DedupLabels, Gauge>::default();
        r.register(
            "dedup_entries",
            "Deduplication records held (webhook delivery ids and events of buses with a dedup_window): standalone in memory, unlabelled; distributed per Redis index, store=\"redis\" (the index as this replica last saw it)",
            dedup_entries.clone(),
        );
        let dedup_memory = Family::<DedupLabels, Gauge>::default();
        r.register_with_unit(
            "dedup_memory",
            "Memory the deduplication records hold (estimated per record; bounded by limits.max_dedup_bytes)",
            Unit::Bytes,
            dedup_memory.clone(),
        );
        let dedup_file = Gauge::default();
        r.register_with_unit(
            "dedup_file",
            "Size of the deduplication file in the data directory (compacted as it grows)",
            Unit::Bytes,
            dedup_file.clone(),
        );
        let dedup_compactions = Counter::default();
        r.register(
            "dedup_compactions",
            "Rewrites of the deduplication file without its expired records",
            dedup_compactions.clone(),
        );
        let dedup_evicted = Counter::default();
        r.register(
            "dedup_evicted",
            "Deduplication records dropped before their window ended to stay under limits.max_dedup_bytes (a late duplicate of one is stored again)",
            dedup_evicted.clone(),
        );
        let replication_shortfall = Counter::default();
        r.register(
            "redis_replication_shortfall",
            "Appends refused with 503 because fewer Redis replicas than cluster.min_replicas confirmed them within cluster.replication_timeout",
            replication_shortfall.clone(),
        );
        let function_calls = Family::default();
        r.register(
            "function_calls",
            "Calls of WebAssembly functions, by function and outcome (ok, error, trap, timeout, memory, invalid_output)",
            function_calls.clone(),
        );
        Metrics {
            registry: root,
            ingress_requests,
            ingress_bytes,
            ingress_duration,
            appended,
            flush_duration,
            flush_errors,
            write_errors,
            redis_duration,
            redis_errors,
            matched,
            delivered,
            failed,
            retried,
            dead_lettered,
            expired,
            delivery_duration,
            event_latency,
            lag_events,
            lag_seconds,
            task_state,
            task_states: Mutex::new(HashMap::new()),
            leases_held,
            lease_losses,
            rebalances,
            dedup_entries,
            dedup_memory,
            dedup_file,
            dedup_compactions,
            dedup_evicted,
            replication_shortfall,
            function_calls,
        }
    }

    /// Counts one call of a WebAssembly function.
    /// The call counter of a function and outcome (a handle: look it up once, count often).
    pub fn function_calls(&self, function: &str, outcome: &str) -> Counter {
        self.function_calls
            .get_or_create(&FunctionLabels {
                function: function.to_string(),
                outcome: outcome.to_string(),
            })
            .clone()
    }

    /// The OpenMetrics text exposition of every metric.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// Records a task's new state: one series per task, moved when the state changes.
    pub fn task_state(&self, task: &str, worker: &str, state: &str) {
        let labels = TaskLabels {
            task: task.to_string(),
            worker: worker.to_string(),
            state: state.to_string(),
        };
        let mut states = self.task_states.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = states.insert(task.to_string(), labels.clone()) {
            if old == labels {
                return;
            }
            self.task_state.remove(&old);
        }
        self.task_state.get_or_create(&labels).set(1);
    }

    pub fn observe_redis(&self, operation: &str, took: Duration, ok: bool) {
        let labels = OperationLabels {
            operation: operation.to_string(),
        };
        self.redis_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        if !ok {
            self.redis_errors.get_or_create(&labels).inc();
        }
    }

    /// Handles of the dedup gauges (records, their bytes) of one set of records: `&[]`
    /// for the standalone map, `[("store", "redis"), ("bus", ..), ("shard", ..)]` for a
    /// Redis index. Resolved once by a caller on a hot path, not per request.
    pub fn dedup_series(&self, labels: &[(&'static str, &str)]) -> DedupSeries {
        let labels: DedupLabels = labels.iter().map(|(k, v)| (*k, (*v).to_string())).collect();
        (
            self.dedup_entries.get_or_create(&labels).clone(),
            self.dedup_memory.get_or_create(&labels).clone(),
        )
    }

    /// Pre-resolved counters of one subscription, for the delivery path.
    pub fn subscription(&self, subscription: &str) -> SubscriptionMetrics {
        let labels = SubscriptionLabels {
            subscription: subscription.to_string(),
        };
        SubscriptionMetrics {
            matched: self.matched.get_or_create(&labels).clone(),
            delivered: self.delivered.get_or_create(&labels).clone(),
            failed: self.failed.get_or_create(&labels).clone(),
            retried: self.retried.get_or_create(&labels).clone(),
            dead_lettered: self.dead_lettered.get_or_create(&labels).clone(),
            expired: self.expired.get_or_create(&labels).clone(),
            duration: self.delivery_duration.get_or_create(&labels).clone(),
            latency: self.event_latency.get_or_create(&labels).clone(),
        }
    }

    /// The ingress series of one bus in one mode, resolved once (when the catalog
    /// changes), for the request path: an atomic add per figure, no label lookup.
    pub fn ingress_series(&self, bus: &str, mode: &'static str) -> IngressSeries {
        let labels = BusModeLabels {
            bus: bus.to_string(),
            mode: mode.to_string(),
        };
        IngressSeries {
            bytes: self.ingress_bytes.get_or_create(&labels).clone(),
            duration: self.ingress_duration.get_or_create(&labels).clone(),
            accepted: OnceLock::new(),
            bus: bus.to_string(),
            mode,
        }
    }

    /// Pre-resolved counter of appends to one shard.
    /// One ingress request: counted by bus, mode and status, its bytes and its duration.
    pub fn ingress(
        &self,
        bus: String,
        mode: &str,
        status: u16,
        bytes: u64,
        elapsed: std::time::Duration,
    ) {
        let bus_mode = BusModeLabels {
            bus,
            mode: mode.to_string(),
        };
        self.ingress_bytes.get_or_create(&bus_mode).inc_by(bytes);
        self.ingress_duration
            .get_or_create(&bus_mode)
            .observe(elapsed.as_secs_f64());
        let BusModeLabels { bus, mode } = bus_mode;
        self.ingress_requests
            .get_or_create(&IngressLabels {
                bus,
                mode,
                status: status.to_string(),
            })
            .inc();
    }

    pub fn appended(&self, bus: &str, shard: u32) -> Counter {
        self.appended
            .get_or_create(&ShardLabels {
                bus: bus.to_string(),
                shard: shard.to_string(),
            })
            .clone()
    }

    pub fn write_error(&self, bus: &str, shard: u32) {
        self.write_errors
            .get_or_create(&ShardLabels {
                bus: bus.to_string(),
                shard: shard.to_string(),
            })
            .inc();
    }

    pub fn lag(&self, subscription: &str, shard: u32) -> Gauge {
        self.lag_events
            .get_or_create(&SubscriptionShardLabels {
                subscription: subscription.to_string(),
                shard: shard.to_string(),
            })
            .clone()
    }

    /// Drops every series of subscriptions and tasks that left the catalog: their ids
    /// (`bus/rule/target`) and their tasks' (`bus/rule/target#shard`). Handles the delivery
    /// path still holds count on, unexported, until it lets them go.
    pub fn forget_subscriptions(&self, ids: &[String]) {
        let mut states = self.task_states.lock().unwrap_or_else(|p| p.into_inner());
        for id in ids {
            let labels = SubscriptionLabels {
                subscription: id.clone(),
            };
            for family in [
                &self.matched,
                &self.delivered,
                &self.failed,
                &self.retried,
                &self.dead_lettered,
                &self.expired,
            ] {
                family.remove(&labels);
            }
            self.delivery_duration.remove(&labels);
            self.event_latency.remove(&labels);
            if let Some(old) = states.remove(id) {
                self.task_state.remove(&old);
            }
            if let Some((subscription, shard)) = id.rsplit_once('#') {
                if let Ok(shard) = shard.parse::<u32>() {
                    self.forget_lag(subscription, shard);
                }
            }
        }
    }

    /// Drops the lag series of a subscription's shard (the subscription was removed).
    pub fn forget_lag(&self, subscription: &str, shard: u32) {
        let labels = SubscriptionShardLabels {
            subscription: subscription.to_string(),
            shard: shard.to_string(),
        };
        self.lag_events.remove(&labels);
        self.lag_seconds.remove(&labels);
    }

    /// Age of the oldest undelivered event, in seconds.
    pub fn lag_seconds(
        &self,
        subscription: &str,
        shard: u32,
    ) -> Gauge<f64, std::sync::atomic::AtomicU64> {
        self.lag_seconds
            .get_or_create(&SubscriptionShardLabels {
                subscription: subscription.to_string(),
                shard: shard.to_string(),
            })
            .clone()
    }
}

/// One subscription's counters (clones share the series).
#[derive(Clone, Debug)]
pub struct SubscriptionMetrics {
    pub matched: Counter,
    pub delivered: Counter,
    pub failed: Counter,
    pub retried: Counter,
    pub dead_lettered: Counter,
    /// Events of the shard skipped because they got older than the bus's
    /// `max_backlog_age` before this subscription delivered them.
    pub expired: Counter,
    pub duration: Histogram,
    pub latency: Histogram,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_the_prefix_units_and_one_series_per_task() {
        let m = Metrics::new();
        m.task_state("default#0", "w1", "RUNNING");
        m.task_state("default#0", "w1", "PAUSED");
        m.subscription("default/r/t").delivered.inc_by(3);
        m.observe_redis("append", Duration::from_millis(2), false);
        let text = m.encode().unwrap();
        assert!(text.contains("sluice_build_info{version="), "{text}");
        assert!(
            text.contains(
                "sluice_subscription_delivered_events_total{subscription=\"default/r/t\"} 3"
            ),
            "{text}"
        );
        assert!(
            text.contains("sluice_redis_errors_total{operation=\"append\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sluice_redis_command_duration_seconds_bucket"),
            "{text}"
        );
        assert!(text.contains("state=\"PAUSED\"} 1"), "{text}");
        assert!(!text.contains("state=\"RUNNING\""), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn forgotten_subscriptions_leave_no_series() {
        let m = Metrics::new();
        m.subscription("b/gone/t").delivered.inc();
        m.subscription("b/kept/t").delivered.inc();
        m.task_state("b/gone/t#0", "w1", "RUNNING");
        m.task_state("b/kept/t#0", "w1", "RUNNING");
        m.lag("b/gone/t", 0).set(3);
        m.forget_subscriptions(&["b/gone/t".to_string(), "b/gone/t#0".to_string()]);
        let text = m.encode().unwrap();
        assert!(!text.contains("b/gone/t"), "{text}");
        assert!(
            text.contains(
                "sluice_subscription_delivered_events_total{subscription=\"b/kept/t\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("task=\"b/kept/t#0\""), "{text}");
    }
}
