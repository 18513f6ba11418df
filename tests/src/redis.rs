//! Redis for distributed tests: a server of the test's own (killed, restarted, rolled
//! back at will) or the machine's shared one under a key prefix of the test's own.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::free_port;

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

/// The keys of the Redis at `url` that match `pattern` (`KEYS`).
pub async fn redis_keys(url: &str, pattern: &str) -> Vec<String> {
    let client = redis::Client::open(url).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis connection");
    redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut conn)
        .await
        .expect("KEYS")
}

/// Waits until the Redis stream `key` holds `len` entries, or panics after `limit`.
pub async fn wait_stream_len(url: &str, key: &str, len: u64, limit: Duration) {
    let client = redis::Client::open(url).expect("redis url");
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis connection");
    crate::eventually(limit, Duration::from_millis(200), || async {
        let now: u64 = redis::cmd("XLEN")
            .arg(key)
            .query_async(&mut conn.clone())
            .await
            .expect("XLEN");
        if now == len {
            Ok(())
        } else {
            Err(format!("{now} entries in {key}, not {len}"))
        }
    })
    .await;
}

/// A connection of the library's Redis store to `url` under `prefix` (`timeout` a call).
pub async fn connect(url: &str, prefix: &str, timeout: Duration) -> sluice::store::redis::Redis {
    sluice::store::redis::Redis::connect(url, prefix, timeout)
        .await
        .unwrap()
}

/// Cluster timing for tests of the library: `heartbeat`, and `ttl` for memberships and
/// leases alike.
pub fn cluster_options(heartbeat: Duration, ttl: Duration) -> sluice::store::redis::ClusterOptions {
    sluice::store::redis::ClusterOptions {
        heartbeat,
        member_ttl: ttl,
        lease_ttl: ttl,
    }
}

tokio::task_local! {
    /// The seed nodes distributed gateways use inside [`on_cluster`].
    pub static CLUSTER_NODES: Vec<String>;
}

/// Runs `scenario` (one written for `in_both_modes!`, given `true`) with its distributed
/// gateways on a Redis Cluster of its own instead of the shared Redis.
pub async fn on_cluster<F: std::future::Future<Output = ()>>(scenario: impl FnOnce(bool) -> F) {
    let cluster = RedisCluster::start();
    CLUSTER_NODES.scope(cluster.urls(), scenario(true)).await;
    drop(cluster);
}

/// A Redis Cluster of the test's own on loopback: six `redis-server` processes with
/// `cluster-enabled yes` (three primaries, three replicas), made one cluster by
/// `redis-cli --cluster create … --cluster-replicas 1`. Killed on drop.
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
    _dir: TempDir,
}

struct ClusterNode {
    port: u16,
    bus: u16,
    home: std::path::PathBuf,
    child: Option<Child>,
}

impl ClusterNode {
    /// Starts the node; its `nodes.conf` in `home` keeps its identity across restarts.
    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                &self.bus.to_string(),
            ])
            .args(["--cluster-node-timeout", "5000"])
            .args(["--save", "", "--appendonly", "no"])
            // Replicas sync at once (the default waits 5 s to batch them), so a failover
            // right after the start finds them in sync.
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(&self.home)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (make test installs it)");
        self.child = Some(child);
    }
}

/// What `CLUSTER NODES` says of one node.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    pub failed: bool,
    /// The primary's id (replicas only).
    pub replica_of: Option<String>,
    /// Slot ranges (primaries only).
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut nodes = Vec::new();
        for i in 0..6 {
            let home = dir.path().join(format!("node-{i}"));
            fs::create_dir_all(&home).expect("node dir");
            let mut node = ClusterNode {
                port: free_port(),
                // The cluster bus port is given, not port + 10000 (past 65535 for high ports).
                bus: free_port(),
                home,
                child: None,
            };
            node.spawn();
            nodes.push(node);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for node in &nodes {
            while std::net::TcpStream::connect(("127.0.0.1", node.port)).is_err() {
                assert!(Instant::now() < deadline, "redis-server did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli is installed (make test installs it)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster { nodes, _dir: dir };
        cluster.pair_replicas(Duration::from_secs(30));
        cluster.wait_healthy(Duration::from_secs(30));
        cluster
    }

    /// Makes sure every primary has its replica: `--cluster create` sometimes leaves a
    /// node a primary without slots (its `CLUSTER REPLICATE` came before it knew the
    /// primary), and a primary without a replica would answer every `WAIT` with 0.
    pub fn pair_replicas(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let view = self.view();
            let primaries: Vec<&NodeView> = view
                .iter()
                .filter(|n| n.primary && !n.slots.is_empty())
                .collect();
            let lonely: Vec<&&NodeView> = primaries
                .iter()
                .filter(|p| {
                    !view
                        .iter()
                        .any(|r| r.replica_of.as_deref() == Some(p.id.as_str()))
                })
                .collect();
            if primaries.len() == 3 && lonely.is_empty() {
                return;
            }
            // A node left a primary without slots, or the second replica of a primary.
            let spare = view
                .iter()
                .find(|n| n.primary && n.slots.is_empty())
                .or_else(|| {
                    view.iter().find(|r| {
                        r.replica_of.is_some()
                            && view.iter().filter(|o| o.replica_of == r.replica_of).count() > 1
                    })
                });
            if let (Some(spare), Some(primary)) = (spare, lonely.first()) {
                self.cli(spare.port, &["CLUSTER", "REPLICATE", &primary.id]);
            }
            assert!(Instant::now() < deadline, "replicas never paired: {view:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Seed addresses, `redis://127.0.0.1:{port}/`, of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}/", n.port))
            .collect()
    }

    fn live_port(&self) -> u16 {
        self.nodes
            .iter()
            .find(|n| n.child.is_some())
            .map(|n| n.port)
            .expect("a live node")
    }

    /// `redis-cli -p {port} args…` on a node, its output.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `redis-cli -c` (following redirects) from any live node.
    pub fn cli_any(&self, args: &[&str]) -> String {
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        self.cli(self.live_port(), &all)
    }

    /// The cluster as a live node sees it.
    pub fn view(&self) -> Vec<NodeView> {
        self.cli(self.live_port(), &["CLUSTER", "NODES"])
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let port = fields.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
                let flags = fields.get(2)?;
                let slots = fields
                    .iter()
                    .skip(8)
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| {
                        let (a, b) = s.split_once('-').unwrap_or((s, s));
                        Some((a.parse().ok()?, b.parse().ok()?))
                    })
                    .collect();
                Some(NodeView {
                    id: fields.first()?.to_string(),
                    port,
                    primary: flags.contains("master"),
                    failed: flags.contains("fail"),
                    replica_of: fields.get(3).filter(|m| **m != "-").map(|m| m.to_string()),
                    slots,
                })
            })
            .collect()
    }

    /// The port of the primary serving `slot`.
    pub fn primary_of_slot(&self, slot: u16) -> u16 {
        self.view()
            .into_iter()
            .find(|n| {
                n.primary && !n.failed && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
            })
            .map(|n| n.port)
            .expect("a primary serves every slot")
    }

    /// Moves `slot` to another primary while it is in use, as `redis-cli --cluster reshard`
    /// does: `SETSLOT … IMPORTING` on the target, `MIGRATING` on the source, `MIGRATE` of
    /// its keys in steps, then `SETSLOT … NODE` everywhere. Returns the new owner's port.
    pub fn migrate_slot(&self, slot: u16) -> u16 {
        let view = self.view();
        let source = self.primary_of_slot(slot);
        let id = |port: u16| {
            view.iter()
                .find(|n| n.port == port)
                .map(|n| n.id.clone())
                .expect("node id")
        };
        let target = view
            .iter()
            .find(|n| n.primary && !n.failed && n.port != source && !n.slots.is_empty())
            .map(|n| n.port)
            .expect("another primary");
        let slot_text = slot.to_string();
        let ok = |out: String| assert!(out.trim() == "OK", "{out}");
        ok(self.cli(
            target,
            &["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &id(source)],
        ));
        ok(self.cli(
            source,
            &["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", &id(target)],
        ));
        let target_port = target.to_string();
        for _ in 0..10_000 {
            let keys = self.cli(source, &["CLUSTER", "GETKEYSINSLOT", &slot_text, "20"]);
            let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let mut args = vec![
                "MIGRATE",
                "127.0.0.1",
                &target_port,
                "",
                "0",
                "5000",
                "KEYS",
            ];
            args.extend(keys.iter().copied());
            let out = self.cli(source, &args);
            assert!(
                out.contains("OK") || out.contains("NOKEY"),
                "MIGRATE: {out}"
            );
        }
        ok(self.cli(
            target,
            &["CLUSTER", "SETSLOT", &slot_text, "NODE", &id(target)],
        ));
        ok(self.cli(
            source,
            &["CLUSTER", "SETSLOT", &slot_text, "NODE", &id(target)],
        ));
        for node in view
            .iter()
            .filter(|n| n.port != source && n.port != target && !n.failed)
        {
            self.cli(
                node.port,
                &["CLUSTER", "SETSLOT", &slot_text, "NODE", &id(target)],
            );
        }
        target
    }

    /// Starts a killed node again: it rejoins the cluster (as a replica of whichever node
    /// took its slots over) and syncs.
    pub fn restart(&mut self, port: u16) {
        if let Some(node) = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port && n.child.is_none())
        {
            node.spawn();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL one node.
    pub fn kill(&mut self, port: u16) {
        if let Some(node) = self.nodes.iter_mut().find(|n| n.port == port) {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// Waits until every live node says the cluster is `ok` and every slot has a live
    /// primary (after a failover: the replica was promoted).
    pub fn wait_healthy(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let ok = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                self.cli(n.port, &["CLUSTER", "INFO"])
                    .contains("cluster_state:ok")
            });
            let covered: u32 = self
                .view()
                .iter()
                .filter(|n| n.primary && !n.failed)
                .flat_map(|n| n.slots.iter().map(|(a, b)| u32::from(b - a) + 1))
                .sum();
            // Every live replica is in sync with its primary.
            let synced = self
                .view()
                .iter()
                .filter(|n| !n.primary && !n.failed)
                .all(|n| {
                    self.cli(n.port, &["INFO", "replication"])
                        .contains("master_link_status:up")
                });
            if ok && covered == 16384 && synced {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never became healthy: {:?}",
                self.view()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl RedisCluster {
    /// Waits until the killed primary `dead` serves no slot (its replica was promoted)
    /// and the cluster is healthy again.
    pub fn wait_failover(&self, dead: u16, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let serving = self
                .view()
                .iter()
                .any(|n| n.port == dead && n.primary && !n.failed && !n.slots.is_empty());
            if !serving {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no failover of {dead}: {:?}",
                self.view()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        self.wait_healthy(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1)),
        );
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The name of a bus shard's key (`log`, `next`, `pos`, `dedup-index`, `dedup:{hash}`) under
/// `prefix`: `{prefix}:{shard tag}:{part}` (see `sluice::store::redis::shard_tag`).
pub fn shard_key(prefix: &str, bus: &str, shard: u32, part: &str) -> String {
    format!(
        "{prefix}:{{{}}}:{part}",
        sluice::store::redis::shard_tag(bus, shard)
    )
}
