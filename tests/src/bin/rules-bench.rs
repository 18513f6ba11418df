//! Fan-out benchmark (run by `make bench-rules`; figures, not assertions): one bus with 4
//! shards and N rules (1, 100, 1,000, 10,000), standalone and distributed, in one run.
//! Each rule matches one event type and writes to one file target (all targets share the
//! file, appending whole batches). Variants: every event matches exactly one rule, or ten.
//!
//! Per run it prints: start-up until every shard task runs, delivered events/s end to end
//! (from the first request until the last event is in the file, watched by counting the
//! lines appended since the last look every 5 ms), duplicates counted from
//! the delivered ids, RSS after the load, idle CPU (% of one core, over 5 s) and, in
//! distributed mode, Redis commands/s while idle.
//!
//! The gateway runs with its default log level (`info`) and commit interval (200 ms), as
//! deployed. The machine is noisy, so every configuration runs `ROUNDS` times (default 3),
//! the rounds one after the other (every other round in reverse order), and each figure is
//! compared with the one-rule figure of its own round; the summary gives the medians.
//!
//! Uses the machine's Redis (127.0.0.1:6379, or SLUICE_E2E_REDIS); run it alone on the
//! machine, since idle figures count every Redis command. `EVENTS` (default 200000: runs
//! of a second or more, since a hiccup of 50 ms is a fifth of a run of a quarter second;
//! the ten-rules-per-event variant posts a fifth of them) and
//! `RULES` (default `1,100,1000,10000`) change the size; `MODES` (default
//! `standalone,distributed`) and `PER_EVENT` (default `1,10`) pick the variants.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::bench::{cpu_secs, post_batches, LineCounter};
use sluice_tests::{ids, read_jsonl, shared_redis, Sluice};

const SHARDS: u32 = 4;

fn rules_toml(rules: usize, per_event: usize) -> String {
    let mut text = String::new();
    for i in 0..rules {
        // With `per_event` = 10, rules come in groups of ten sharing one type.
        let ty = i / per_event;
        text.push_str(&format!(
            "\n[[rules]]\nname = \"r{i}\"\nbus = \"default\"\npattern = {{ type = [\"t{ty}\"] }}\n\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{{data_dir}}/out.jsonl\"\n"
        ));
    }
    text
}

async fn redis_commands(url: &str) -> u64 {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

struct Figures {
    startup: f64,
    delivered_per_sec: f64,
    duplicates: usize,
    rss_mib: f64,
    idle_cpu: f64,
    idle_redis: Option<f64>,
    lost_leases: usize,
}

async fn run(distributed: bool, rules: usize, per_event: usize, events: usize) -> Figures {
    let mut builder = Sluice::builder()
        // The gateway's defaults: at debug every delivery is a span written for the logs,
        // and the tests' 50 ms commits would be four times the default's.
        .log("info")
        .commit_interval("200ms")
        .durability("os")
        .without_default_rule()
        .shards(SHARDS)
        .extra(&rules_toml(rules, per_event));
    let redis = shared_redis(&format!("bench-rules-{rules}"));
    if distributed {
        builder = builder.distributed(&redis.0, &redis.1);
    }
    let started = Instant::now();
    let sluice = builder.start().await;
    loop {
        if sluice.running_tasks().await.len() == SHARDS as usize {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let startup = started.elapsed().as_secs_f64();
    let types = rules.div_ceil(per_event);
    let url = sluice.events_url();
    let loaded = Instant::now();
    let accepted = post_batches(&url, events, 8, 100, move |n| {
        json!({
            "specversion": "1.0", "id": format!("e{n}"), "source": "/bench",
            "type": format!("t{}", n % types),
            "datacontenttype": "application/json",
            "data": {"n": n, "pad": "x".repeat(900)}
        })
    })
    .await;
    let expected = accepted * per_event.min(rules);
    let out = sluice.data_dir().join("out.jsonl");
    // Only the new bytes are read and only line ends counted while the load runs: parsing
    // the whole file on every look (tens to hundreds of MB) would take the CPU being
    // measured and make the end of the run a matter of when the parse finished.
    let mut lines = LineCounter::default();
    loop {
        if lines.count(&out) >= expected {
            break;
        }
        assert!(
            loaded.elapsed() < Duration::from_secs(600),
            "delivery stalled at {} of {expected}",
            lines.lines
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = loaded.elapsed().as_secs_f64();
    let delivered = read_jsonl(&out);
    let all = ids(&delivered);
    let distinct: HashSet<&String> = all.iter().collect();
    // Each event is delivered once per matching rule: duplicates are deliveries beyond that.
    let duplicates = all.len() - distinct.len() * per_event.min(rules);
    let rss_mib = sluice.rss_kib().unwrap_or(0) as f64 / 1024.0;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = sluice.pid().unwrap();
    let cpu0 = cpu_secs(pid);
    let cmd0 = if distributed {
        Some(redis_commands(&redis.0).await)
    } else {
        None
    };
    let window = 5.0;
    tokio::time::sleep(Duration::from_secs_f64(window)).await;
    let idle_cpu = (cpu_secs(pid) - cpu0) / window * 100.0;
    let idle_redis = match cmd0 {
        // Minus this benchmark's own INFO call.
        Some(c0) => Some((redis_commands(&redis.0).await - c0).saturating_sub(1) as f64 / window),
        None => None,
    };
    let lost_leases = sluice.log().matches("lease lost").count();
    Figures {
        lost_leases,
        startup,
        delivered_per_sec: expected as f64 / elapsed,
        duplicates,
        rss_mib,
        idle_cpu,
        idle_redis,
    }
}

#[tokio::main]
async fn main() {
    let events: usize = std::env::var("EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let counts: Vec<usize> = std::env::var("RULES")
        .unwrap_or_else(|_| "1,100,1000,10000".to_string())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    println!(
        "{:<12} {:>6} {:>9} {:>10} {:>14} {:>6} {:>9} {:>9} {:>12}",
        "mode",
        "rules",
        "per event",
        "start s",
        "delivered/s",
        "dups",
        "RSS MiB",
        "idle CPU%",
        "idle redis/s"
    );
    println!("(delivered/s counts deliveries: with 10 rules per event, ten per event)");
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let modes: Vec<bool> = std::env::var("MODES")
        .unwrap_or_else(|_| "standalone,distributed".to_string())
        .split(',')
        .filter_map(|m| match m.trim() {
            "standalone" => Some(false),
            "distributed" => Some(true),
            _ => None,
        })
        .collect();
    let per_events: Vec<usize> = std::env::var("PER_EVENT")
        .unwrap_or_else(|_| "1,10".to_string())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    // (mode, rules, per event) -> each round's delivered/s and ratio to that round's 1 rule.
    let mut results: Vec<(Config, Vec<(f64, f64)>)> = Vec::new();
    for round in 1..=rounds {
        println!("round {round} of {rounds}");
        for distributed in modes.iter().copied() {
            let mode = if distributed {
                "distributed"
            } else {
                "standalone"
            };
            let mut configs: Vec<(usize, usize)> = counts
                .iter()
                .flat_map(|&rules| {
                    per_events
                        .iter()
                        .filter(move |&&per_event| per_event <= rules)
                        .map(move |&per_event| (rules, per_event))
                })
                .collect();
            // Every other round runs the configurations in reverse, so that whatever builds
            // up over a round (dirty pages of the files written, allocator and page-cache
            // state) does not always weigh on the same ones.
            if round % 2 == 0 {
                configs.reverse();
            }
            let mut figures = Vec::new();
            for (rules, per_event) in configs {
                // Ten deliveries per event: a fifth of the events still makes twice the
                // deliveries (and file) of the one-rule-per-event runs.
                let posted = if per_event > 1 { events / 5 } else { events };
                let f = run(distributed, rules, per_event, posted).await;
                println!(
                    "{:<12} {:>6} {:>9} {:>10.2} {:>14.0} {:>6} {:>9.1} {:>9.2} {:>12}  ({} leases lost)",
                    mode,
                    rules,
                    per_event,
                    f.startup,
                    f.delivered_per_sec,
                    f.duplicates,
                    f.rss_mib,
                    f.idle_cpu,
                    f.idle_redis.map_or("-".to_string(), |r| format!("{r:.1}")),
                    f.lost_leases,
                );
                figures.push((rules, per_event, f.delivered_per_sec));
            }
            // Each figure against the fewest rules' one-rule-per-event figure of this round.
            let base = figures
                .iter()
                .filter(|(_, per_event, _)| *per_event == 1)
                .min_by_key(|(rules, _, _)| *rules)
                .map(|(_, _, d)| *d);
            figures.sort_by_key(|(rules, per_event, _)| (*rules, *per_event));
            for (rules, per_event, delivered) in figures {
                let ratio = delivered / base.unwrap_or(delivered);
                println!("{mode:<12} {rules:>6} {per_event:>9}  {ratio:.2}x of 1 rule");
                let key = (mode, rules, per_event);
                match results.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, runs)) => runs.push((delivered, ratio)),
                    None => results.push((key, vec![(delivered, ratio)])),
                }
            }
        }
    }
    sluice_tests::bench_summary_start("rules");
    println!("medians over {rounds} rounds (ratios within each round):");
    for ((mode, rules, per_event), runs) in &results {
        let ratios: Vec<String> = runs.iter().map(|(_, r)| format!("{r:.2}")).collect();
        println!(
            "{:<12} {:>6} {:>9} {:>14.0} delivered/s  {:.2}x of 1 rule  (rounds: {})",
            mode,
            rules,
            per_event,
            median(runs.iter().map(|(d, _)| *d)),
            median(runs.iter().map(|(_, r)| *r)),
            ratios.join(", ")
        );
        // The goal holds in every round, so the summary keeps the worst round's ratio.
        let worst = runs.iter().map(|(_, r)| *r).fold(f64::INFINITY, f64::min);
        let key = format!("{mode}.{rules}_rules.{per_event}_per_event");
        sluice_tests::bench_summary("rules", &format!("{key}.min_ratio"), worst);
        sluice_tests::bench_summary(
            "rules",
            &format!("{key}.delivered_per_sec"),
            median(runs.iter().map(|(d, _)| *d)),
        );
    }
}

/// A benchmark configuration: mode, rules, rules per event.
type Config = (&'static str, usize, usize);

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
