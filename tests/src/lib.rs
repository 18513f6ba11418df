//! The one end-to-end harness: starts the real `sluice` binary on a free loopback port with
//! a temporary data directory, and gives tests a client, the delivered events, and the
//! process controls (SIGTERM, SIGKILL, restart). Every test file uses it.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::fs;
use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

pub mod ledger;
pub mod receiver;
pub mod rocketmq;

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

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// How to start a gateway: the sample layout (bus `default`, every event to
/// `{data_dir}/delivered.jsonl`) plus whatever a test adds.
pub struct SluiceBuilder {
    durability: &'static str,
    distributed: Option<(String, String)>,
    strategy: &'static str,
    default_rule: bool,
    shards: u32,
    limits: String,
    ttl: &'static str,
    log: &'static str,
    commit_interval: &'static str,
    extra: String,
    admin: String,
    listen_ip: &'static str,
    env: Vec<(String, String)>,
    data_dir: Option<PathBuf>,
    file_roots: Vec<PathBuf>,
}

impl SluiceBuilder {
    /// Keeps the data directory here instead of in the test's temporary directory (a
    /// small filesystem of the test's own, say).
    pub fn data_dir(mut self, dir: &Path) -> Self {
        self.data_dir = Some(dir.to_path_buf());
        self
    }

    pub fn durability(mut self, durability: &'static str) -> Self {
        self.durability = durability;
        self
    }

    /// Distributed mode against the Redis at `url`, keys under `prefix`.
    pub fn distributed(mut self, url: &str, prefix: &str) -> Self {
        self.distributed = Some((url.to_string(), prefix.to_string()));
        self
    }

    /// Leaves out the sample rule (every event to `delivered.jsonl`): the bus `default` has
    /// only the rules the test adds.
    pub fn without_default_rule(mut self) -> Self {
        self.default_rule = false;
        self
    }

    pub fn strategy(mut self, strategy: &'static str) -> Self {
        self.strategy = strategy;
        self
    }

    pub fn shards(mut self, shards: u32) -> Self {
        self.shards = shards;
        self
    }

    /// The member and lease time to live (`[cluster]`); tests use 3 s, benchmarks that
    /// measure takeover use the gateway's default (1500ms).
    pub fn ttl(mut self, ttl: &'static str) -> Self {
        self.ttl = ttl;
        self
    }

    /// The `log` filter (tests log the gateway at debug; benchmarks measure the default,
    /// `info`).
    pub fn log(mut self, filter: &'static str) -> Self {
        self.log = filter;
        self
    }

    /// `[delivery] commit_interval` (tests commit every 50 ms; benchmarks use the default).
    pub fn commit_interval(mut self, interval: &'static str) -> Self {
        self.commit_interval = interval;
        self
    }

    /// Lines added under `[limits]`.
    pub fn limits(mut self, lines: &str) -> Self {
        self.limits = lines.to_string();
        self
    }

    /// TOML appended to the configuration (more buses, rules, tables).
    pub fn extra(mut self, toml: &str) -> Self {
        self.extra = toml.to_string();
        self
    }

    /// The lines of the `[admin]` table, instead of the default
    /// `allow_local_without_token = true` (tests talk to the admin API from loopback
    /// without a token unless they say otherwise).
    pub fn admin(mut self, lines: &str) -> Self {
        self.admin = lines.to_string();
        self
    }

    /// The address `--listen` binds (`"::"`, say), on the same port; clients still use
    /// 127.0.0.1.
    pub fn listen_ip(mut self, ip: &'static str) -> Self {
        self.listen_ip = ip;
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// A directory file targets may write to besides the data directory
    /// (`targets.file_roots`): another replica's data directory, say. (A test that sets
    /// other `[targets]` keys writes the whole table with `extra` instead.)
    pub fn file_root(mut self, dir: &Path) -> Self {
        self.file_roots.push(dir.to_path_buf());
        self
    }

    pub async fn start(self) -> Sluice {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("sluice.toml");
        let data_dir = self
            .data_dir
            .clone()
            .unwrap_or_else(|| dir.path().join("data"));
        let mode = match &self.distributed {
            Some((url, prefix)) => format!(
                "mode = \"distributed\"\nredis_url = \"{url}\"\nredis_prefix = \"{prefix}\"\n"
            ),
            None => String::new(),
        };
        let text = format!(
            r#"log = "{log}"
durability = "{durability}"
{mode}
[cluster]
strategy = "{strategy}"
redis_timeout = "500ms"
poll_interval = "1s"
# Longer than the defaults (1.5 s): tests share two cores, and a starved heartbeat must
# not look like a dead replica.
member_ttl = "{ttl}"
lease_ttl = "{ttl}"

[limits]
{limits}

[delivery]
commit_interval = "{commit_interval}"
initial_backoff = "20ms"
max_backoff = "200ms"

[admin]
{admin}

{targets}
[[buses]]
name = "default"
shards = {shards}

{default_rule}
{extra}
"#,
            durability = self.durability,
            strategy = self.strategy,
            limits = self.limits,
            ttl = self.ttl,
            log = self.log,
            commit_interval = self.commit_interval,
            shards = self.shards,
            extra = self.extra,
            admin = self.admin,
            // Only when asked for: a test may write its own `[targets]` with `extra`.
            targets = if self.file_roots.is_empty() {
                String::new()
            } else {
                format!("[targets]\nfile_roots = {:?}\n", self.file_roots)
            },
            default_rule = if self.default_rule {
                "[[rules]]\nname = \"all-events\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"file\"\nname = \"delivered\"\npath = \"{data_dir}/delivered.jsonl\"\n"
            } else {
                ""
            },
        );
        fs::write(&config, text).expect("write config");
        let mut sluice = Sluice {
            child: None,
            port: free_port(),
            dir,
            config,
            data_dir,
            listen_ip: self.listen_ip,
            env: self.env,
            starts: 0,
            started: false,
        };
        sluice.spawn().await;
        sluice
    }
}

pub struct Sluice {
    child: Option<Child>,
    port: u16,
    dir: TempDir,
    config: PathBuf,
    data_dir: PathBuf,
    listen_ip: &'static str,
    env: Vec<(String, String)>,
    starts: u32,
    /// Whether it was ever ready (a restart must keep its port).
    started: bool,
}

impl Sluice {
    pub fn builder() -> SluiceBuilder {
        SluiceBuilder {
            durability: "fsync",
            distributed: None,
            strategy: "sorted-hash",
            default_rule: true,
            shards: 4,
            limits: String::new(),
            ttl: "3s",
            log: "info,sluice=debug",
            commit_interval: "50ms",
            extra: String::new(),
            admin: "allow_local_without_token = true".to_string(),
            listen_ip: "127.0.0.1",
            env: Vec::new(),
            data_dir: None,
            file_roots: Vec::new(),
        }
    }

    pub async fn start() -> Sluice {
        Sluice::builder().start().await
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr())
    }

    pub fn events_url(&self) -> String {
        self.url("/buses/default/events")
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn config_path(&self) -> &Path {
        &self.config
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("sluice-{}.log", self.starts))
    }

    /// What the process wrote to stderr in its latest run.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    async fn spawn(&mut self) {
        loop {
            self.starts += 1;
            let stderr = fs::File::create(self.log_path()).expect("log file");
            let child = Command::new(sluice_bin())
                .arg("serve")
                .arg("--config")
                .arg(&self.config)
                .arg("--listen")
                .arg(SocketAddr::new(self.listen_ip.parse().unwrap(), self.port).to_string())
                .arg("--data-dir")
                .arg(&self.data_dir)
                .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn()
                .expect("start sluice");
            self.child = Some(child);
            if self.wait_ready(Duration::from_secs(30)).await {
                self.started = true;
                return;
            }
            // The free port was taken by another test between our check and the bind; a
            // first start may move (a restart keeps its port: clients know it).
            assert!(!self.started, "port {} taken on restart", self.port);
            self.port = free_port();
        }
    }

    /// Waits for *this* process to be ready (its own log says so, and `/readyz` answers):
    /// another process on the same port cannot pass for it. `false` when it could not
    /// bind its port.
    async fn wait_ready(&mut self, limit: Duration) -> bool {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                let log = self.log();
                if log.contains("in use") && log.contains("listen") {
                    return false;
                }
                panic!("sluice exited during start ({status}):\n{log}");
            }
            if self.log().contains("sluice is ready") {
                if let Ok(r) = client.get(self.url("/readyz")).send().await {
                    if r.status().is_success() {
                        return true;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "sluice not ready after {limit:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Whether the process is running.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Whether the process is alive (not only started: it may have died on its own).
    pub fn is_alive(&self) -> bool {
        self.child.as_ref().is_some_and(|child| {
            Command::new("kill")
                .args(["-0", &child.id().to_string()])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
    }

    /// Sends a signal by name (`STOP`, `CONT`, ...) to the running process.
    pub fn signal(&self, name: &str) {
        let child = self.child.as_ref().expect("sluice is running");
        let status = Command::new("kill")
            .args([&format!("-{name}"), &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// SIGKILL: no chance to flush anything.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("sluice is running");
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "sluice did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the process again on the same port, configuration and data.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "stop it first");
        self.spawn().await;
    }

    /// Every line of `delivered.jsonl`, parsed.
    pub fn delivered(&self) -> Vec<Value> {
        read_jsonl(&self.data_dir.join("delivered.jsonl"))
    }

    /// Waits until `pred` holds for the delivered events, or fails after `limit`.
    pub async fn wait_delivered(
        &self,
        limit: Duration,
        pred: impl Fn(&[Value]) -> bool,
    ) -> Vec<Value> {
        let deadline = Instant::now() + limit;
        loop {
            let events = self.delivered();
            if pred(&events) {
                return events;
            }
            assert!(
                Instant::now() < deadline,
                "delivery condition not met after {limit:?}; {} events delivered",
                events.len()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The process's resident memory in KiB (Linux `/proc`), if it is running.
    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn rss_kib(&self) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// `GET /metrics`: the Prometheus text.
    pub async fn metrics(&self) -> String {
        reqwest::get(self.url("/metrics"))
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics text")
    }

    /// `GET /admin/cluster`: members, connector and task status (any replica answers).
    pub async fn cluster_view(&self) -> Value {
        reqwest::get(self.url("/admin/cluster"))
            .await
            .expect("GET /admin/cluster")
            .json()
            .await
            .expect("cluster view JSON")
    }

    /// Waits (20 s at most) until the cluster has `n` live members.
    pub async fn wait_members(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let view = self.cluster_view().await;
            if view["members"].as_array().map(Vec::len) == Some(n) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster never had {n} members: {view}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until exactly `count` statuses have ids starting with `prefix`, all in
    /// `state` (`PAUSED`, `RUNNING`, ...).
    pub async fn wait_states(&self, prefix: &str, state: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let view = self.cluster_view().await;
            let states: Vec<&str> = view["statuses"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .filter(|s| s["id"].as_str().is_some_and(|id| id.starts_with(prefix)))
                .filter_map(|s| s["state"].as_str())
                .collect();
            if states.len() == count && states.iter().all(|s| *s == state) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{prefix}*: {states:?}, not {count} {state}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `tasks` leased tasks run, each on one of `members` live workers.
    pub async fn wait_tasks_settled(&self, tasks: usize, members: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let running = self.running_tasks().await;
            let live: std::collections::HashSet<String> = self.cluster_view().await["members"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .filter_map(|m| m.as_str().map(str::to_string))
                .collect();
            if live.len() == members
                && running.len() == tasks
                && running.values().all(|w| live.contains(w))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "tasks did not settle: {running:?} over {live:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Task id → worker, for the leased tasks (`bus/{bus}#{shard}`, `source/{name}#{i}`)
    /// reported RUNNING.
    pub async fn running_tasks(&self) -> std::collections::BTreeMap<String, String> {
        self.running(|id| id.contains('#') && id.matches('/').count() == 1)
            .await
    }

    /// Id → worker, for the subscriptions' parts of shard tasks
    /// (`{bus}/{rule}/{target}#{shard}`) reported RUNNING.
    pub async fn running_lanes(&self) -> std::collections::BTreeMap<String, String> {
        self.running(|id| id.contains('#') && id.matches('/').count() == 2)
            .await
    }

    /// The ids of the connectors this replica's running catalog has
    /// (`GET /api/v1/connectors`), sorted; `None` while it does not answer.
    pub async fn connectors(&self) -> Option<Vec<String>> {
        let view: Value = reqwest::get(self.url("/api/v1/connectors"))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let mut ids: Vec<String> = view["items"]
            .as_array()?
            .iter()
            .filter_map(|c| c["id"].as_str().map(str::to_string))
            .collect();
        ids.sort();
        Some(ids)
    }

    async fn running(
        &self,
        which: impl Fn(&str) -> bool,
    ) -> std::collections::BTreeMap<String, String> {
        let view = self.cluster_view().await;
        view["statuses"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .filter(|s| s["id"].as_str().is_some_and(&which) && s["state"] == "RUNNING")
            .filter_map(|s| {
                Some((
                    s["id"].as_str()?.to_string(),
                    s["worker"].as_str()?.to_string(),
                ))
            })
            .collect()
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        self.kill9();
        // A failing test shows the end of the gateway's log (its directory goes with it).
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines.len().saturating_sub(80);
            eprintln!(
                "--- the last {} lines of {} ---\n{}",
                lines.len() - tail,
                self.log_path().display(),
                lines[tail..].join("\n")
            );
        }
    }
}

/// A `redis-server` of the test's own on a free loopback port, with an append-only file
/// fsynced on every write, so a restart keeps everything it acknowledged.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: TempDir,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let mut server = RedisServer {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
        };
        server.spawn();
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (make test installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: Redis is gone until `restart`.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        assert!(self.child.is_none());
        self.spawn();
    }

    /// A copy of what Redis keeps on disk (it must be stopped): an older snapshot to come
    /// back to with `restore`.
    pub fn snapshot(&self) -> TempDir {
        assert!(self.child.is_none(), "snapshot a stopped redis-server");
        let copy = tempfile::tempdir().expect("temp dir");
        let status = Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", self.dir.path().display()))
            .arg(copy.path())
            .status()
            .expect("cp");
        assert!(status.success());
        copy
    }

    /// Replaces what Redis keeps on disk with a snapshot (it must be stopped): started
    /// again, it has lost everything written since, as a restore from an old backup or a
    /// failover to a lagging replica does.
    pub fn restore(&mut self, snapshot: &Path) {
        assert!(self.child.is_none(), "restore into a stopped redis-server");
        for entry in fs::read_dir(self.dir.path()).expect("redis dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                fs::remove_dir_all(&path).expect("remove");
            } else {
                fs::remove_file(&path).expect("remove");
            }
        }
        let status = Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", snapshot.display()))
            .arg(self.dir.path())
            .status()
            .expect("cp");
        assert!(status.success());
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The machine's Redis (a service of the test machines), with a key prefix unique to the
/// calling test so tests never see each other's keys.
pub fn shared_redis(test: &str) -> (String, String) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    (
        std::env::var("SLUICE_E2E_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_string()),
        format!("e2e-{test}-{nanos}"),
    )
}

/// Waits until the Redis stream `key` holds `len` entries, or panics after `limit`.
pub async fn wait_stream_len(url: &str, key: &str, len: u64, limit: Duration) {
    let client = redis::Client::open(url).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis connection");
    let deadline = Instant::now() + limit;
    loop {
        let now: u64 = redis::cmd("XLEN")
            .arg(key)
            .query_async(&mut conn)
            .await
            .expect("XLEN");
        if now == len {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{now} entries in {key}, not {len}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The sum of the samples of metric `name` whose labels contain `has`, in a `/metrics`
/// text.
pub fn metric_sum(text: &str, name: &str, has: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(has))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// Posts `count` binary-mode events with ids `{prefix}-{i}`, spread round-robin over the
/// given gateways, and returns the ids answered 202 (others got an error or 503).
pub async fn post_spread(urls: &[String], prefix: &str, count: usize) -> Vec<String> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let mut accepted = Vec::new();
    for i in 0..count {
        let id = format!("{prefix}-{i}");
        let url = &urls[i % urls.len()];
        if let Ok(r) = binary(&client, url, &id, "{}").send().await {
            if r.status() == reqwest::StatusCode::ACCEPTED {
                accepted.push(id);
            }
        }
    }
    accepted
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

/// The ids of a set of delivered events.
pub fn ids(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| e["id"].as_str().map(str::to_string))
        .collect()
}

/// A binary-mode request: `ce-*` headers and a JSON body.
pub fn binary(
    client: &reqwest::Client,
    url: &str,
    id: &str,
    body: &str,
) -> reqwest::RequestBuilder {
    client
        .post(url)
        .header("ce-specversion", "1.0")
        .header("ce-id", id)
        .header("ce-source", "/tests")
        .header("ce-type", "com.example.test")
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// Posts `events` as one batch-mode request (`application/cloudevents-batch+json`) and
/// asserts every one was accepted (202).
pub async fn post_batch(client: &reqwest::Client, url: &str, events: Vec<Value>) {
    let r = client
        .post(url)
        .header("content-type", "application/cloudevents-batch+json")
        .body(Value::Array(events).to_string())
        .send()
        .await
        .expect("POST batch");
    assert_eq!(r.status().as_u16(), 202, "batch refused");
}

/// A structured-mode event as JSON.
pub fn structured_event(id: &str) -> Value {
    serde_json::json!({
        "specversion": "1.0",
        "id": id,
        "source": "/tests",
        "type": "com.example.test",
        "datacontenttype": "application/json",
        "data": {"n": id}
    })
}

/// `sluice check-config` on a configuration text: whether it passed, and what it printed
/// (stderr, then stdout).
pub fn check_config(text: &str) -> (bool, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("c.toml");
    fs::write(&path, text).expect("write config");
    let out = Command::new(sluice_bin())
        .arg("check-config")
        .arg(&path)
        .output()
        .expect("run sluice check-config");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout),
    )
}

/// An HTTP client for the tests' requests to the gateway: a request that hangs fails the
/// test in 10 s instead of holding it.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http client")
}

/// Root of the repository (for scripts and sample files).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
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
    let deadline = Instant::now() + limit;
    loop {
        let events = read_jsonl(path);
        if pred(&events) {
            return events;
        }
        assert!(
            Instant::now() < deadline,
            "condition on {} not met after {limit:?}; {} lines",
            path.display(),
            events.len()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Posts one binary-mode event and asserts it is accepted.
pub async fn post(client: &reqwest::Client, url: &str, id: &str, body: &str) {
    let r = binary(client, url, id, body).send().await.expect("post");
    assert_eq!(
        r.status().as_u16(),
        202,
        "{}",
        r.text().await.unwrap_or_default()
    );
}

/// TOML for a bus `name` whose events all go to `{data_dir}/{name}.jsonl`.
pub fn bus_to_file(name: &str) -> String {
    format!(
        r#"
[[buses]]
name = "{name}"
shards = 1

[[rules]]
name = "{name}-to-file"
bus = "{name}"

[[rules.targets]]
type = "file"
name = "{name}-file"
path = "{{data_dir}}/{name}.jsonl"
"#
    )
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
