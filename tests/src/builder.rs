//! How a test starts a gateway: the configuration it writes (the sample layout plus what
//! the test adds) and the shortcuts for the layouts many tests share.

use std::fs;
use std::path::{Path, PathBuf};

use crate::Sluice;

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
    /// Seed nodes of a Redis Cluster, instead of `redis_url`.
    cluster_nodes: Option<Vec<String>>,
    /// More `[cluster]` settings (`redis_durability = "replicated"`, …).
    cluster_extra: String,
}

impl SluiceBuilder {
    pub(crate) fn new() -> SluiceBuilder {
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
            cluster_nodes: None,
            cluster_extra: String::new(),
        }
    }

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

    /// Distributed mode on a Redis Cluster (its seed nodes) under `prefix`.
    pub fn on_cluster(mut self, nodes: &[String], prefix: &str) -> Self {
        self.distributed = Some((String::new(), prefix.to_string()));
        self.cluster_nodes = Some(nodes.to_vec());
        self
    }

    /// More lines of the `[cluster]` table.
    pub fn cluster_settings(mut self, lines: &str) -> Self {
        self.cluster_extra.push_str(lines);
        self.cluster_extra.push('\n');
        self
    }

    /// Distributed mode on the shared Redis under a prefix of `test`'s own
    /// ([`crate::shared_redis`]) when `distributed`, else standalone. Inside
    /// [`crate::redis::on_cluster`], distributed mode is on that Redis Cluster instead.
    pub fn mode(self, distributed: bool, test: &str) -> Self {
        if !distributed {
            return self;
        }
        let (url, prefix) = crate::shared_redis(test);
        match crate::redis::CLUSTER_NODES.try_with(Clone::clone) {
            Ok(nodes) => self.on_cluster(&nodes, &prefix),
            Err(_) => self.distributed(&url, &prefix),
        }
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

    /// TOML appended to the configuration (more buses, rules, tables); each call adds to
    /// what the earlier ones gave.
    pub fn extra(mut self, toml: &str) -> Self {
        self.extra.push_str(toml);
        self
    }

    /// A rule `name` of bus `default` sending every event to an HTTP target at `url`
    /// (see [`crate::http_rule`]).
    pub fn http_target(self, name: &str, url: &str, extra: &str) -> Self {
        self.extra(&crate::http_rule(name, url, extra))
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
        let mode = match (&self.distributed, &self.cluster_nodes) {
            (Some((_, prefix)), Some(nodes)) => format!(
                "mode = \"distributed\"\nredis_cluster_nodes = {nodes:?}\nredis_prefix = \"{prefix}\"\n"
            ),
            (Some((url, prefix)), None) => format!(
                "mode = \"distributed\"\nredis_url = \"{url}\"\nredis_prefix = \"{prefix}\"\n"
            ),
            (None, _) => String::new(),
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
{cluster_extra}

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
            cluster_extra = self.cluster_extra,
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
        Sluice::launch(dir, config, data_dir, self.listen_ip, self.env).await
    }
}
