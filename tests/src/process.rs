//! The running `sluice` process: its addresses, its log, the signals and restarts tests
//! put it through, and what it reports (deliveries, metrics, the cluster view).

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

use crate::{eventually, free_port, read_jsonl, sluice_bin, SluiceBuilder};

/// How long the cluster may take to settle (members, task states, leases).
const SETTLE: Duration = Duration::from_secs(20);

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
    /// Starts the process of a configuration the builder wrote.
    pub(crate) async fn launch(
        dir: TempDir,
        config: PathBuf,
        data_dir: PathBuf,
        listen_ip: &'static str,
        env: Vec<(String, String)>,
    ) -> Sluice {
        let mut sluice = Sluice {
            child: None,
            port: free_port(),
            dir,
            config,
            data_dir,
            listen_ip,
            env,
            starts: 0,
            started: false,
        };
        sluice.spawn().await;
        sluice
    }

    pub fn builder() -> SluiceBuilder {
        SluiceBuilder::new()
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
        crate::send_signal(child.id(), name);
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
        crate::send_signal(child.id(), "TERM");
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
        let read = || self.delivered();
        crate::wait_list(
            limit,
            Duration::from_millis(25),
            read,
            pred,
            "events delivered",
        )
        .await
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
        self.get_text("/metrics").await
    }

    /// `GET path`: the answer's text.
    async fn get_text(&self, path: &str) -> String {
        let response = reqwest::get(self.url(path))
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        response.text().await.expect("answer text")
    }

    /// `GET /admin/cluster`: members, connector and task status (any replica answers).
    pub async fn cluster_view(&self) -> Value {
        let text = self.get_text("/admin/cluster").await;
        serde_json::from_str(&text).expect("cluster view JSON")
    }

    /// Waits (20 s at most) until the cluster has `n` live members.
    pub async fn wait_members(&self, n: usize) {
        eventually(SETTLE, Duration::from_millis(100), || async {
            let view = self.cluster_view().await;
            if view["members"].as_array().map(Vec::len) == Some(n) {
                Ok(())
            } else {
                Err(format!("cluster never had {n} members: {view}"))
            }
        })
        .await;
    }

    /// Waits until exactly `count` statuses have ids starting with `prefix`, all in
    /// `state` (`PAUSED`, `RUNNING`, ...).
    pub async fn wait_states(&self, prefix: &str, state: &str, count: usize) {
        eventually(SETTLE, Duration::from_millis(50), || async {
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
                Ok(())
            } else {
                Err(format!("{prefix}*: {states:?}, not {count} {state}"))
            }
        })
        .await;
    }

    /// Waits until `tasks` leased tasks run, each on one of `members` live workers.
    pub async fn wait_tasks_settled(&self, tasks: usize, members: usize) {
        eventually(SETTLE, Duration::from_millis(100), || async {
            let running = self.running_tasks().await;
            let live: HashSet<String> = self.cluster_view().await["members"]
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
                Ok(())
            } else {
                Err(format!("tasks did not settle: {running:?} over {live:?}"))
            }
        })
        .await;
    }

    /// Task id → worker, for the leased tasks (`bus/{bus}#{shard}`, `source/{name}#{i}`)
    /// reported RUNNING.
    pub async fn running_tasks(&self) -> BTreeMap<String, String> {
        self.running(|id| id.contains('#') && id.matches('/').count() == 1)
            .await
    }

    /// Id → worker, for the subscriptions' parts of shard tasks
    /// (`{bus}/{rule}/{target}#{shard}`) reported RUNNING.
    pub async fn running_lanes(&self) -> BTreeMap<String, String> {
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

    async fn running(&self, which: impl Fn(&str) -> bool) -> BTreeMap<String, String> {
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
