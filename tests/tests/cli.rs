//! The command line: version, configuration checks and their error messages, overrides.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use sluice_tests::{repo_root, sluice_bin, Sluice};

fn check_config(text: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(sluice_bin())
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout),
    )
}

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
    let out = Command::new(sluice_bin())
        .arg("check-config")
        .arg(repo_root().join("sluice.example.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
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
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, "").unwrap();
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
