//! The CPU cost of the metrics the gateway records per event (run by `tests/bench/ingest.sh`
//! through `make bench-ingest`; a figure, not an assertion): the calls of one ingress
//! request (family lookups by bus, mode and status; bytes; duration), one append and one
//! delivery, through the gateway's own `sluice::metrics` code. Delivery series are updated
//! here once per event, an upper bound (the gateway updates most of them once per batch).
//! Prints nanoseconds per event; `ingest.sh` divides it by the CPU time the gateway spends
//! per request under load to give the share metrics take. `N` (default 2,000,000) events.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

fn main() {
    let n: u64 = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000);
    let metrics = sluice::metrics::get();
    let subscription = metrics.subscription("default/all-events/delivered");
    let appended = metrics.appended("default", 0);
    let one = |i: u64| {
        metrics.ingress(
            "default".to_string(),
            "binary",
            202,
            1024 + (i & 7),
            Duration::from_micros(40 + (i & 15)),
        );
        appended.inc();
        subscription.matched.inc();
        subscription.delivered.inc();
        subscription.duration.observe(0.0005);
        subscription.latency.observe(0.002);
    };
    for i in 0..n / 10 {
        one(i);
    }
    let started = Instant::now();
    for i in 0..n {
        one(i);
    }
    let ns = started.elapsed().as_nanos() as f64 / n as f64;
    // What the scrape endpoint would show, so the work above cannot be optimised away.
    let text = metrics.encode().unwrap_or_default();
    assert!(text.contains("sluice_ingress_requests_total"));
    println!("{ns:.0}");
}
