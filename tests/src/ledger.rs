//! The no-loss ledger of the fault suite (`tests/tests/faults.rs`): a load generator that
//! records every event a producer was told was accepted (2xx), per partition key in the
//! order they were accepted, and the reconciliation of that against what the receivers got:
//! lost (accepted, never delivered: must be 0), duplicated (delivered more than once,
//! counted), reordered (a key's event delivered for the first time after a later event of
//! the same key), and how the producers were answered meanwhile.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// One accepted event: its id, its partition key, its place in that key's sequence.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub id: String,
    pub key: String,
    pub seq: u64,
}

#[derive(Default)]
struct Shared {
    accepted: Vec<Accepted>,
    /// Answers other than 2xx (or no answer), by status (`0`: connection error/timeout).
    refused: BTreeMap<u16, usize>,
}

/// Producers posting binary-mode events to a set of replicas: one task per partition key,
/// each posting its key's events one after another (the next only once the previous was
/// accepted), round-robin over the URLs; a refused post (503, 429, no answer) is tried
/// again on the next URL after a short pause, as a producer retries. Bounded: at most
/// `max_events` in all, and it stops when told.
pub struct Load {
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(urls: Vec<String>, prefix: &str, keys: usize, max_events: usize) -> Load {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let per_key = max_events.div_ceil(keys.max(1)) as u64;
        let urls = Arc::new(urls);
        let tasks = (0..keys)
            .map(|k| {
                let (shared, stop, urls) = (shared.clone(), stop.clone(), urls.clone());
                let key = format!("{prefix}-k{k}");
                tokio::spawn(async move {
                    let client = reqwest::Client::builder()
                        .timeout(Duration::from_secs(5))
                        .build()
                        .expect("http client");
                    let mut next_url = k;
                    for seq in 0..per_key {
                        let id = format!("{key}-{seq}");
                        // One event until it is accepted or the load stops (bounded).
                        for _attempt in 0..2_000 {
                            if stop.load(Ordering::Relaxed) {
                                return;
                            }
                            let url = &urls[next_url % urls.len()];
                            next_url += 1;
                            let answer = client
                                .post(url)
                                .header("ce-specversion", "1.0")
                                .header("ce-id", &id)
                                .header("ce-source", "/faults")
                                .header("ce-type", "com.example.fault")
                                .header("ce-partitionkey", &key)
                                .header("content-type", "application/json")
                                .body(format!("{{\"key\":\"{key}\",\"seq\":{seq}}}"))
                                .send()
                                .await;
                            let status = answer.map_or(0, |r| r.status().as_u16());
                            if (200..300).contains(&status) {
                                shared.lock().unwrap().accepted.push(Accepted {
                                    id: id.clone(),
                                    key: key.clone(),
                                    seq,
                                });
                                break;
                            }
                            *shared.lock().unwrap().refused.entry(status).or_default() += 1;
                            tokio::time::sleep(Duration::from_millis(25)).await;
                        }
                    }
                })
            })
            .collect();
        Load {
            shared,
            stop,
            tasks,
        }
    }

    /// How many events were accepted so far.
    pub fn accepted_count(&self) -> usize {
        self.shared.lock().unwrap().accepted.len()
    }

    /// Waits until `n` more events than now were accepted (fails after `limit`).
    pub async fn wait_progress(&self, n: usize, limit: Duration) {
        let target = self.accepted_count() + n;
        let deadline = Instant::now() + limit;
        while self.accepted_count() < target {
            assert!(
                Instant::now() < deadline,
                "the load stalled at {} accepted events; refused so far (status: count): {:?}",
                self.accepted_count(),
                self.shared.lock().unwrap().refused
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the producers and returns what was accepted and how they were refused.
    pub async fn stop(self) -> (Vec<Accepted>, BTreeMap<u16, usize>) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            let _ = task.await;
        }
        let shared = self.shared.lock().unwrap();
        (shared.accepted.clone(), shared.refused.clone())
    }
}

/// What a fault run came to.
#[derive(Debug, Clone)]
pub struct Report {
    pub scenario: String,
    /// Events accepted (2xx) by the gateway.
    pub events: usize,
    /// Faults injected.
    pub faults: usize,
    /// Accepted and never delivered.
    pub lost: Vec<String>,
    /// Deliveries beyond the first of an event.
    pub duplicated: usize,
    /// Events first delivered after a later event of the same partition key.
    pub reordered: usize,
    pub refused: BTreeMap<u16, usize>,
    /// The highest resident memory of any gateway process of the run, in KiB.
    pub peak_rss_kib: u64,
    pub seconds: f64,
}

impl Report {
    /// Reconciles the accepted events with the delivered ids (in arrival order).
    pub fn of(
        scenario: &str,
        accepted: &[Accepted],
        refused: BTreeMap<u16, usize>,
        delivered: &[String],
    ) -> Report {
        let mut copies: HashMap<&str, usize> = HashMap::new();
        for id in delivered {
            *copies.entry(id.as_str()).or_default() += 1;
        }
        let lost: Vec<String> = accepted
            .iter()
            .filter(|a| !copies.contains_key(a.id.as_str()))
            .map(|a| a.id.clone())
            .collect();
        let duplicated = copies.values().map(|c| c - 1).sum();
        // Per key, the sequence numbers in the order of their first delivery.
        let place: HashMap<&str, (&str, u64)> = accepted
            .iter()
            .map(|a| (a.id.as_str(), (a.key.as_str(), a.seq)))
            .collect();
        let mut seen = HashSet::new();
        let mut highest: HashMap<&str, u64> = HashMap::new();
        let mut reordered = 0;
        for id in delivered {
            if !seen.insert(id.as_str()) {
                continue;
            }
            let Some((key, seq)) = place.get(id.as_str()) else {
                continue;
            };
            match highest.get(key) {
                Some(top) if seq < top => reordered += 1,
                _ => {
                    highest.insert(key, *seq);
                }
            }
        }
        Report {
            scenario: scenario.to_string(),
            events: accepted.len(),
            faults: 0,
            lost,
            duplicated,
            reordered,
            refused,
            peak_rss_kib: 0,
            seconds: 0.0,
        }
    }

    pub fn json(&self) -> Value {
        json!({
            "scenario": self.scenario,
            "events": self.events,
            "faults": self.faults,
            "lost": self.lost.len(),
            "duplicated": self.duplicated,
            "reordered": self.reordered,
            "refused": self.refused.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
            "peak_rss_mib": (self.peak_rss_kib as f64 / 1024.0 * 10.0).round() / 10.0,
            "seconds": (self.seconds * 10.0).round() / 10.0,
        })
    }

    /// Prints the report as one line (`make chaos` collects them) and appends it to the
    /// file named by `SLUICE_FAULT_REPORT`, if set.
    pub fn publish(&self) {
        let line = format!("FAULT-REPORT {}", self.json());
        eprintln!("{line}");
        if let Ok(path) = std::env::var("SLUICE_FAULT_REPORT") {
            use std::io::Write as _;
            if let Ok(mut file) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
                let _ = writeln!(file, "{line}");
            }
        }
    }

    /// Nothing accepted may be lost; the run must have had events and faults.
    pub fn assert_no_loss(&self) {
        assert!(self.events > 0, "{}: no event was accepted", self.scenario);
        assert!(
            self.lost.is_empty(),
            "{}: {} of {} accepted events were never delivered: {:?}",
            self.scenario,
            self.lost.len(),
            self.events,
            &self.lost[..self.lost.len().min(20)]
        );
    }
}

/// How long the fault suite's phases last: short in `make test`, `SLUICE_CHAOS` times longer
/// in `make chaos` (e.g. `SLUICE_CHAOS=6`).
pub fn chaos_scale() -> u32 {
    std::env::var("SLUICE_CHAOS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|s: &u32| *s >= 1)
        .unwrap_or(1)
}

/// The peak resident memory (VmHWM) of a process, in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
