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
