//! The one end-to-end harness: starts the real `sluice` binary on a free loopback port with
//! a temporary data directory, and gives tests a client, the delivered events, and the
//! process controls (SIGTERM, SIGKILL, restart). Every test file uses it.
//!
//! - [`builder`]: the configuration a gateway starts with ([`SluiceBuilder`]);
//! - [`process`]: the running gateway ([`Sluice`]);
//! - [`http`]: requests to the ingress (events in each mode);
//! - [`admin`]: the admin API and `sluice ctl`, with the OpenAPI check;
//! - [`config`]: configuration snippets and `sluice check-config`;
//! - [`redis`]: a Redis of the test's own or the shared one;
//! - [`receiver`], [`rocketmq`], [`ledger`]: the peers and the no-loss ledger.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::collections::HashSet;
use std::fs;
use std::future::Future;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod admin;
pub mod bench;
pub mod builder;
pub mod config;
pub mod http;
pub mod ledger;
pub mod process;
pub mod receiver;
pub mod redis;
pub mod rocketmq;
pub mod wasm;

pub use builder::SluiceBuilder;
pub use config::{
    bus, bus_to_file, bus_to_file_with, check_config, config_file, http_rule, rule_on, target_rule,
};
pub use http::{
    binary, binary_raw, client, post, post_all, post_batch, post_event, post_many, post_spread,
    post_typed, send_batch, send_expecting, structured_event,
};
pub use process::Sluice;
pub use redis::{redis_keys, shared_redis, wait_stream_len, RedisCluster, RedisServer};

/// The `sluice` binary built by cargo next to this test binary (or `SLUICE_BIN`).
pub fn sluice_bin() -> PathBuf {
    if let Ok(bin) = std::env::var("SLUICE_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("test binary path");
    // Tests live in target/<profile>/deps/, binaries (benchmarks) in target/<profile>/.
    let mut dir = exe.parent().expect("target directory");
    if dir.ends_with("deps") {
        dir = dir.parent().expect("target directory");
    }
    let bin = dir.join("sluice");
    assert!(
        bin.exists(),
        "{} does not exist: build it first (cargo build -p sluice-gateway)",
        bin.display()
    );
    bin
}

/// Sends the signal `name` (`TERM`, `STOP`, ...) to the process `pid`, which must exist.
pub fn send_signal(pid: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The sum of the samples of metric `name` whose labels contain `has`, in a `/metrics`
/// text.
pub fn metric_sum(text: &str, name: &str, has: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(has))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// The complete lines of a JSON Lines file a gateway may still be appending to: a final
/// line without its newline is still being written and is left out.
pub fn read_jsonl(path: &Path) -> Vec<Value> {
    let mut bytes = Vec::new();
    if let Ok(mut f) = fs::File::open(path) {
        f.read_to_end(&mut bytes).expect("read");
    }
    let complete = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    let text = String::from_utf8_lossy(&bytes[..complete]);
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

/// The event `id` of a set of delivered events.
pub fn find_event<'a>(events: &'a [Value], id: &str) -> &'a Value {
    events
        .iter()
        .find(|e| e["id"] == id)
        .unwrap_or_else(|| panic!("no event {id} in {events:?}"))
}

/// The ids of a set of delivered events.
pub fn ids(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| e["id"].as_str().map(str::to_string))
        .collect()
}

/// Root of the repository (for scripts and sample files).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// Records one figure of a benchmark for `tests/bench/summary.py`: a `key value` line in
/// `target/bench/{bench}.summary` (the file is started afresh by `bench_summary_start`).
pub fn bench_summary(bench: &str, key: &str, value: f64) {
    use std::io::Write as _;
    let dir = repo_root().join("target").join("bench");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{bench}.summary"));
    match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
    {
        Ok(mut file) => {
            let _ = writeln!(file, "{bench}.{key} {value:.4}");
        }
        Err(e) => eprintln!("cannot write {}: {e}", path.display()),
    }
}

/// Starts `target/bench/{bench}.summary` afresh for this run's figures.
pub fn bench_summary_start(bench: &str) {
    let path = repo_root()
        .join("target")
        .join("bench")
        .join(format!("{bench}.summary"));
    let _ = std::fs::remove_file(path);
}

/// The repository's Python (`.venv`, made by `make venv`) or `SLUICE_E2E_PYTHON`.
pub fn python() -> PathBuf {
    if let Ok(p) = std::env::var("SLUICE_E2E_PYTHON") {
        return p.into();
    }
    let venv = repo_root().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: run `make venv` (make test does it)",
        venv.display()
    );
    venv
}

/// Waits until `pred` holds for the JSON lines of a file, or panics after `limit`.
pub async fn wait_jsonl(
    path: &Path,
    limit: Duration,
    pred: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let what = format!("lines in {}", path.display());
    wait_list(
        limit,
        Duration::from_millis(25),
        || read_jsonl(path),
        pred,
        &what,
    )
    .await
}

/// Checks the duplicates of a run where one replica was killed: every id delivered more
/// than once was delivered by the killed replica (it died before committing that progress;
/// nothing else may deliver twice), and there are at most `bound` of them. Returns the
/// number of duplicate deliveries.
pub fn assert_duplicates_from_kill(all: &[String], killed: &[String], bound: usize) -> usize {
    let mut copies: std::collections::HashMap<&String, usize> = std::collections::HashMap::new();
    for id in all {
        *copies.entry(id).or_default() += 1;
    }
    let killed: std::collections::HashSet<&String> = killed.iter().collect();
    let duplicates: usize = copies.values().map(|c| c - 1).sum();
    let unexplained: Vec<&&String> = copies
        .iter()
        .filter(|(id, c)| **c > 1 && !killed.contains(**id))
        .map(|(id, _)| id)
        .take(10)
        .collect();
    assert!(
        unexplained.is_empty(),
        "delivered more than once, but never by the killed replica: {unexplained:?}"
    );
    assert!(
        duplicates <= bound,
        "{duplicates} duplicate deliveries (at most {bound} expected)"
    );
    duplicates
}

/// Runs `command` and asserts it succeeds (its standard error shows if not); returns its
/// standard output.
pub fn run_ok(command: &mut std::process::Command) -> String {
    let out = command.output().expect("run the command");
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs the repository's script `script` (under `tests/scripts`) with the repository's
/// Python, `args` and `stdin`, and returns its standard output; panics if it fails.
pub fn run_python(script: &str, args: &[&str], stdin: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new(python())
        .arg(repo_root().join("tests/scripts").join(script))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin)
        .expect("write to the script");
    let out = child.wait_with_output().expect("wait for the script");
    assert!(
        out.status.success(),
        "{script} {args:?}:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Polls `probe` every `every` until it gives `Ok`, and returns that; panics with the last
/// `Err` (what was seen instead) after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, every: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(seen) => assert!(Instant::now() < deadline, "not met after {limit:?}: {seen}"),
        }
        tokio::time::sleep(every).await;
    }
}

/// Reads `read` every `every` until `pred` holds for what it gives, and returns that;
/// panics after `limit` with what `describe` says of the last reading.
pub async fn wait_until<T>(
    limit: Duration,
    every: Duration,
    read: impl Fn() -> T,
    pred: impl Fn(&T) -> bool,
    describe: impl Fn(&T) -> String,
) -> T {
    eventually(limit, every, || async {
        let value = read();
        if pred(&value) {
            Ok(value)
        } else {
            Err(describe(&value))
        }
    })
    .await
}

/// Waits (up to `limit`) until every id of `acked` is among the ids `read` gives (what the
/// replicas delivered, together); returns how many lines and how many distinct ids.
pub async fn wait_all_acked(
    limit: Duration,
    acked: &HashSet<String>,
    read: impl Fn() -> Vec<String>,
) -> (usize, usize) {
    let missing = |all: &Vec<String>| {
        let seen: HashSet<&String> = all.iter().collect();
        acked.iter().filter(|id| !seen.contains(id)).count()
    };
    let all = wait_until(
        limit,
        Duration::from_millis(100),
        read,
        |all| missing(all) == 0,
        |all| {
            let n = missing(all);
            format!("{n} of {} acknowledged events never delivered", acked.len())
        },
    )
    .await;
    let distinct = all.iter().collect::<HashSet<_>>().len();
    (all.len(), distinct)
}

/// [`wait_until`] for a list read by `read` (the list's length says what was seen).
pub async fn wait_list<T>(
    limit: Duration,
    every: Duration,
    read: impl Fn() -> Vec<T>,
    pred: impl Fn(&[T]) -> bool,
    what: &str,
) -> Vec<T> {
    wait_until(
        limit,
        every,
        read,
        |l| pred(l),
        |l| format!("{} {what}", l.len()),
    )
    .await
}

/// The events of `{data_dir}/{file}` once `pred` holds for them (waiting up to `limit`).
pub async fn wait_file(
    sluice: &Sluice,
    file: &str,
    limit: Duration,
    pred: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    wait_jsonl(&sluice.data_dir().join(file), limit, pred).await
}

/// Waits (15 s at most) until `{data_dir}/{file}` holds every one of the ids `want`.
pub async fn wait_ids(sluice: &Sluice, file: &str, want: &[&str]) {
    let path = sluice.data_dir().join(file);
    eventually(
        Duration::from_secs(15),
        Duration::from_millis(50),
        || async {
            let got = ids(&read_jsonl(&path));
            if want.iter().all(|w| got.iter().any(|g| g == w)) {
                Ok(())
            } else {
                Err(format!(
                    "{file}: want {want:?}, got {got:?}\n{}",
                    sluice.log()
                ))
            }
        },
    )
    .await;
}

/// Tests that run `in_both_modes!` scenarios in distributed mode on a Redis Cluster of
/// their own (`module => scenario`): `on_a_redis_cluster!(replay_cluster => a_replay)`.
#[macro_export]
macro_rules! on_a_redis_cluster {
    ($($module:ident => $scenario:ident),* $(,)?) => {$(
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_a_redis_cluster() {
                $crate::redis::on_cluster(super::$scenario).await;
            }
        }
    )*};
}

/// Runs each async scenario `name(distributed: bool)` of a test file in both modes, as the
/// tests `name::standalone` and `name::distributed`.
#[macro_export]
macro_rules! in_both_modes {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn standalone() {
                super::$scenario(false).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn distributed() {
                super::$scenario(true).await;
            }
        }
    )*};
}
