//! WebAssembly function benchmark (run by `make bench-functions`; figures, not
//! assertions): delivered events/s through one rule whose file target's chain is
//! - `none`: no transform,
//! - `template`: a built-in TEMPLATE step (`into = "data"`) editing the data,
//! - `wasm-noop`: a WebAssembly function returning the event as it got it,
//! - `wasm-noop-event`: the same with `isolation = "event"` (a fresh instance per event
//!   instead of one per batch),
//! - `wasm-edit`: a WebAssembly function adding an attribute to the event's JSON,
//! - `wasm-js` (when `FUNCTIONS_JS` names a component built by `make functions`, e.g.
//!   `target/functions/enrich.wasm`): a JavaScript function (componentize-js), parsing
//!   and rewriting the event.
//!
//! Each round runs every variant on a fresh release gateway (`durability = "os"`, 4
//! shards, log `info`), in turn (every other round reversed), posting `EVENTS` (default
//! 100,000) ~1 KiB events as batches of 100 from 8 connections; figures are the medians
//! of `ROUNDS` (default 3) rounds. Per variant: delivered events/s end to end, its ratio
//! to `none` in the same round, the gateway's CPU per event (from `/proc`), and for the
//! function variants the CPU each call adds over `none` (µs). `VARIANTS` (comma-separated)
//! runs some only, with `none`. Writes
//! `target/bench/functions.summary`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::bench::{cpu_secs, post_batches, LineCounter};
use sluice_tests::wasm::{component, Behaviour};
use sluice_tests::Sluice;

const SHARDS: u32 = 4;

struct Run {
    per_sec: f64,
    cpu_us: f64,
}

async fn run(variant: &str, dir: &std::path::Path, events: usize) -> Run {
    let (functions, transform) = match variant {
        "none" => (String::new(), String::new()),
        "template" => (
            String::new(),
            r#"transform = [{ form = "TEMPLATE", value = { n = "$.data.n" }, template = "{\"n\": ${n}, \"edited\": true}", into = "data" }]"#.to_string(),
        ),
        "wasm-noop" | "wasm-noop-event" | "wasm-edit" | "wasm-js" => {
            let path = match variant {
                "wasm-js" => std::fs::canonicalize(std::env::var("FUNCTIONS_JS").unwrap())
                    .expect("FUNCTIONS_JS names a component built by `make functions`"),
                _ => {
                    let behaviour = if variant != "wasm-edit" {
                        Behaviour::Prefixes(vec!["{".into()])
                    } else {
                        Behaviour::map("edited")
                    };
                    let path = dir.join(format!("{variant}.wasm"));
                    std::fs::write(&path, component(&behaviour)).unwrap();
                    path
                }
            };
            (
                format!(
                    "[[functions]]\nname = \"f\"\npath = \"{}\"\ntimeout = \"1s\"\n{}",
                    path.display(),
                    if variant == "wasm-noop-event" {
                        "isolation = \"event\"\n"
                    } else {
                        ""
                    }
                ),
                r#"transform = [{ wasm = "f" }]"#.to_string(),
            )
        }
        other => panic!("unknown variant {other}"),
    };
    let extra = format!(
        "{functions}\n[[rules]]\nname = \"r\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{{data_dir}}/out.jsonl\"\n{transform}\n"
    );
    let sluice = Sluice::builder()
        .log("info")
        .commit_interval("200ms")
        .durability("os")
        .without_default_rule()
        .shards(SHARDS)
        .extra(&extra)
        .start()
        .await;
    let started = Instant::now();
    while sluice.running_tasks().await.len() < SHARDS as usize {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = sluice.pid().unwrap();
    let cpu_before = cpu_secs(pid);
    let url = sluice.events_url();
    let loaded = Instant::now();
    let expected = post_batches(&url, events, 8, 100, |n| {
        json!({
            "specversion": "1.0", "id": format!("e{n}"), "source": "/bench",
            "type": "bench", "datacontenttype": "application/json",
            "data": {"n": n, "pad": "x".repeat(900)}
        })
    })
    .await;
    let out = sluice.data_dir().join("out.jsonl");
    let mut lines = LineCounter::default();
    while lines.count(&out) < expected {
        assert!(
            loaded.elapsed() < Duration::from_secs(600),
            "{variant}: delivery stalled at {} of {expected}",
            lines.count(&out)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = loaded.elapsed().as_secs_f64();
    let cpu = cpu_secs(pid) - cpu_before;
    Run {
        per_sec: expected as f64 / elapsed,
        cpu_us: cpu / expected as f64 * 1e6,
    }
}

/// A variant's name and, per round: events/s, ratio to `none`, CPU µs added per event.
type Figures = (String, Vec<f64>, Vec<f64>, Vec<f64>);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

#[tokio::main]
async fn main() {
    let events: usize = std::env::var("EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let mut variants = vec![
        "none",
        "template",
        "wasm-noop",
        "wasm-noop-event",
        "wasm-edit",
    ];
    if std::env::var("FUNCTIONS_JS").is_ok() {
        variants.push("wasm-js");
    }
    // `VARIANTS=none,wasm-noop` runs those only (`none` first: the ratios are to it).
    if let Ok(only) = std::env::var("VARIANTS") {
        let only: Vec<&str> = only.split(',').collect();
        variants.retain(|v| *v == "none" || only.contains(v));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut figures: Vec<Figures> = variants
        .iter()
        .map(|v| (v.to_string(), Vec::new(), Vec::new(), Vec::new()))
        .collect();
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..variants.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        let mut runs: Vec<Option<Run>> = (0..variants.len()).map(|_| None).collect();
        for i in order {
            let r = run(variants[i], dir.path(), events).await;
            println!(
                "round {round} {:<10} {:>9.0} events/s  {:>6.1} µs CPU per event",
                variants[i], r.per_sec, r.cpu_us
            );
            runs[i] = Some(r);
        }
        let base = runs[0]
            .as_ref()
            .map_or((1.0, 0.0), |r| (r.per_sec, r.cpu_us));
        for (i, r) in runs.iter().enumerate() {
            let r = r.as_ref().unwrap();
            figures[i].1.push(r.per_sec);
            figures[i].2.push(r.per_sec / base.0);
            figures[i].3.push(r.cpu_us - base.1);
        }
    }
    let mut summary = String::new();
    println!("\nmedians over {rounds} rounds ({events} events each):");
    println!("variant     events/s  ratio to none  CPU added per event (µs)");
    for (name, rates, ratios, added) in figures {
        let (rate, ratio, added) = (median(rates), median(ratios), median(added));
        println!("{name:<10} {rate:>9.0}  {ratio:>12.2}  {added:>10.1}");
        let key = name.replace('-', "_");
        summary.push_str(&format!("functions_{key}_events_per_sec {rate:.0}\n"));
        summary.push_str(&format!("functions_{key}_ratio {ratio:.3}\n"));
        if name != "none" {
            summary.push_str(&format!("functions_{key}_added_cpu_us {added:.2}\n"));
        }
    }
    let out = std::path::Path::new("target/bench");
    std::fs::create_dir_all(out).unwrap();
    std::fs::write(out.join("functions.summary"), summary).unwrap();
}
