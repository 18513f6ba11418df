//! The command line: version, configuration checks and their error messages, overrides.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use sluice_tests::{check_config, repo_root, sluice_bin, Sluice};

#[test]
fn version_prints() {
    let out = Command::new(sluice_bin())
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("sluice "));
}

#[test]
fn the_example_config_is_valid() {
    sluice_tests::run_ok(
        Command::new(sluice_bin())
            .arg("check-config")
            .arg(repo_root().join("sluice.example.toml")),
    );
}

#[test]
fn config_errors_name_the_key_and_line() {
    let (ok, out) = check_config("listen = \"127.0.0.1:1\"\n\n[limits]\nmax_event_byts = 10\n");
    assert!(!ok);
    assert!(
        out.contains("line 4") && out.contains("max_event_byts"),
        "{out}"
    );

    let (ok, out) = check_config("durability = \"eventually\"\n");
    assert!(!ok);
    assert!(
        out.contains("line 1") && out.contains("eventually"),
        "{out}"
    );

    let (ok, out) = check_config(
        "[[buses]]\nname = \"a\"\n\n[[rules]]\nname = \"r\"\nbus = \"b\"\n[[rules.targets]]\ntype = \"log\"\nname = \"l\"\n",
    );
    assert!(!ok);
    assert!(out.contains(":6:") && out.contains("`b`"), "{out}");

    let (ok, out) = check_config("[[buses]]\nname = \"a\"\nshards = 0\n");
    assert!(!ok);
    assert!(out.contains("shards"), "{out}");
}

#[test]
fn bad_environment_override_is_an_error() {
    let (_dir, path) = sluice_tests::config_file("");
    let out = Command::new(sluice_bin())
        .args(["serve", "--config"])
        .arg(&path)
        .env("SLUICE_LISTEN", "not-an-address")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("SLUICE_LISTEN"));
}

#[tokio::test]
async fn environment_overrides_apply() {
    // SLUICE_DURABILITY switches the mode; the log names it.
    let sluice = Sluice::builder()
        .env("SLUICE_DURABILITY", "os")
        .start()
        .await;
    assert!(sluice.log().contains("durability=os"), "{}", sluice.log());
}

#[tokio::test]
async fn a_data_dir_in_use_is_refused() {
    let sluice = Sluice::start().await;
    let out = Command::new(sluice_bin())
        .args(["serve", "--config"])
        .arg(sluice.config_path())
        .arg("--data-dir")
        .arg(sluice.data_dir())
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("in use"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A gateway process started by hand (no harness flags), killed on drop.
struct Proc(std::process::Child, std::path::PathBuf);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn start(config: &std::path::Path, env: &[(&str, String)], args: &[String]) -> Proc {
        let log = config.with_extension(format!("{}.log", sluice_tests::free_port()));
        let mut command = Command::new(sluice_bin());
        // Only the variables under test (the test run may set others, like the harness's).
        for (var, _) in std::env::vars().filter(|(k, _)| k.starts_with("SLUICE_")) {
            command.env_remove(var);
        }
        let child = command
            .args(["serve", "--config"])
            .arg(config)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Proc(child, log)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.1).unwrap_or_default()
    }

    /// Waits until the log says it is ready and `/readyz` answers on `port`.
    async fn wait_ready(&mut self, port: u16) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            assert!(
                self.0.try_wait().unwrap().is_none(),
                "exited during start:\n{}",
                self.log()
            );
            if self.log().contains("sluice is ready") {
                if let Ok(r) = reqwest::get(format!("http://127.0.0.1:{port}/readyz")).await {
                    if r.status().is_success() {
                        return;
                    }
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "not ready on {port}:\n{}",
                self.log()
            );
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
    }
}

/// Each documented `SLUICE_*` variable changes what it names, and the flags win over them.
#[tokio::test]
async fn each_environment_override_applies_and_flags_win() {
    // The file says otherwise for every key the variables set.
    let (dir, config) = sluice_tests::config_file("listen = \"127.0.0.1:1\"\ndata_dir = \"/nonexistent/sluice\"\nlog = \"warn\"\nlog_format = \"text\"\nmode = \"standalone\"\ndurability = \"fsync\"\n\n[admin]\nallow_local_without_token = true\n\n[[buses]]\nname = \"default\"\nshards = 1\n");
    let (url, prefix) = sluice_tests::shared_redis("env");
    let port = sluice_tests::free_port();
    let data = dir.path().join("env-data");
    let env = [
        ("SLUICE_LISTEN", format!("127.0.0.1:{port}")),
        ("SLUICE_DATA_DIR", data.display().to_string()),
        ("SLUICE_LOG", "warn,sluice::app=info".to_string()),
        ("SLUICE_LOG_FORMAT", "json".to_string()),
        ("SLUICE_MODE", "distributed".to_string()),
        ("SLUICE_DURABILITY", "os".to_string()),
        ("SLUICE_REDIS_URL", url.clone()),
        ("SLUICE_REDIS_PREFIX", prefix.clone()),
        ("SLUICE_WORKER_ID", "env-worker".to_string()),
    ];
    let mut p = Proc::start(&config, &env, &[]);
    p.wait_ready(port).await;
    let log = p.log();
    // SLUICE_LOG_FORMAT: every line is JSON. SLUICE_LOG: the app's info lines show (the
    // file's `warn` would hide the ready line), the runtime's do not.
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(
        lines
            .iter()
            .all(|l| l["level"] != "INFO" || l["target"] == "sluice::app"),
        "{log}"
    );
    let ready = lines
        .iter()
        .find(|l| l["fields"]["message"] == "sluice is ready")
        .unwrap_or_else(|| panic!("{log}"));
    // SLUICE_DURABILITY, SLUICE_MODE, SLUICE_WORKER_ID, SLUICE_DATA_DIR.
    assert_eq!(ready["fields"]["durability"], "os", "{ready}");
    assert!(
        ready["fields"]["mode"]
            .as_str()
            .unwrap()
            .contains("Distributed"),
        "{ready}"
    );
    assert_eq!(ready["fields"]["worker"], "env-worker", "{ready}");
    assert!(data.is_dir(), "SLUICE_DATA_DIR made the data directory");
    assert!(!log.contains("ignoring an environment variable"), "{log}");
    // SLUICE_REDIS_URL and SLUICE_REDIS_PREFIX: the member is in that Redis, under that prefix.
    let view: serde_json::Value = reqwest::get(format!("http://127.0.0.1:{port}/admin/cluster"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view["worker"], "env-worker");
    let keys = sluice_tests::redis_keys(&url, &format!("{prefix}:*")).await;
    assert!(!keys.is_empty(), "nothing under the prefix {prefix}");
    drop(p);

    // The flags win over the variables.
    let flag_port = sluice_tests::free_port();
    let flag_data = dir.path().join("flag-data");
    let mut env = env.to_vec();
    env.retain(|(k, _)| !k.starts_with("SLUICE_REDIS") && *k != "SLUICE_MODE");
    let mut p = Proc::start(
        &config,
        &env,
        &[
            "--listen".to_string(),
            format!("127.0.0.1:{flag_port}"),
            "--data-dir".to_string(),
            flag_data.display().to_string(),
        ],
    );
    p.wait_ready(flag_port).await;
    assert!(flag_data.exists(), "--data-dir won");
    assert!(
        reqwest::get(format!("http://127.0.0.1:{port}/readyz"))
            .await
            .is_err(),
        "SLUICE_LISTEN lost to --listen"
    );

    // An unknown SLUICE_* variable is named in a warning.
    drop(p);
    let other = sluice_tests::free_port();
    let mut env = env.to_vec();
    env.retain(|(k, _)| *k != "SLUICE_LISTEN");
    env.push(("SLUICE_LISTEN", format!("127.0.0.1:{other}")));
    env.push(("SLUICE_NO_SUCH_KEY", "1".to_string()));
    let mut p = Proc::start(&config, &env, &[]);
    p.wait_ready(other).await;
    assert!(
        p.log().contains("SLUICE_NO_SUCH_KEY") && p.log().contains("ignoring"),
        "{}",
        p.log()
    );
}

#[test]
fn durations_that_would_panic_the_runtime_are_refused_by_check_config() {
    for (text, key, line) in [
        (
            "[delivery]\nbatch_size = 10\ncommit_interval = \"0ms\"\n",
            "delivery.commit_interval",
            "c.toml:3:",
        ),
        (
            "[cluster]\nrebalance_interval = 0\n",
            "cluster.rebalance_interval",
            "c.toml:2:",
        ),
        (
            "[cluster]\nheartbeat_interval = \"0s\"\n",
            "cluster.heartbeat_interval",
            "c.toml:2:",
        ),
        (
            "[cluster]\nheartbeat_interval = \"99999999999999999999999h\"\n",
            "heartbeat_interval",
            "line 2",
        ),
        (
            "[delivery]\ncommit_interval = 9223372036854775807\n",
            "commit_interval",
            "line 2",
        ),
    ] {
        let (ok, out) = check_config(text);
        assert!(!ok, "{text} was accepted");
        assert!(out.contains(key) && out.contains(line), "{key}: {out}");
        assert!(!out.contains("panicked"), "{out}");
    }
}

#[test]
fn a_bad_redis_url_is_reported_without_its_password() {
    let (ok, out) = check_config(
        "mode = \"distributed\"\nredis_url = \"redis://:hunter2@127.0.0.1:6379/nodb\"\n",
    );
    assert!(!ok);
    assert!(
        out.contains("c.toml:2:") && out.contains("redis_url"),
        "{out}"
    );
    assert!(!out.contains("hunter2"), "{out}");
}

const NESTED_TARGET: &str = r#"[[buses]]
name = "b"

[[rules]]
name = "r"
bus = "b"

[[rules.targets]]
type = "http"
name = "h"
url = "http://127.0.0.1:9/hook"

[rules.targets.dead_letter.target]
type = "file"
path = "dead.jsonl"
"#;

#[test]
fn errors_in_nested_tables_point_at_the_nested_key() {
    // The dead-letter target has no `name`: line 13 opens that table, not line 8.
    let (ok, out) = check_config(NESTED_TARGET);
    assert!(!ok);
    assert!(
        out.contains("line 13") && out.contains("name"),
        "points at the dead-letter target: {out}"
    );
    // An unknown key inside it: its own line.
    let text = NESTED_TARGET.replace(
        "path = \"dead.jsonl\"",
        "name = \"d\"\npath = \"x\"\nbogus = 1",
    );
    let (ok, out) = check_config(&text);
    assert!(!ok);
    assert!(out.contains("line 17") && out.contains("bogus"), "{out}");
    // A bad value in an inline table of a target.
    let text = NESTED_TARGET.replace(
        "url = \"http://127.0.0.1:9/hook\"",
        "url = \"http://127.0.0.1:9/hook\"\ncircuit_breaker = { failures = 2, open_for = \"3 fortnights\" }",
    );
    let (ok, out) = check_config(&text);
    assert!(!ok);
    assert!(
        out.contains("line 12") && out.contains("fortnights"),
        "{out}"
    );
}
