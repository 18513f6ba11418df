//! `sluice ctl` against the real binary: `apply` is idempotent, dry-runs and `--prune`s,
//! takes TOML and YAML, refuses an invalid file naming where (and changes nothing); the
//! resource commands (get, describe, pause, resume, test-rule, delete); and the OpenAPI
//! document the admin API and `ctl` follow matches the routes and the configuration schema.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use sluice_tests::admin::{ctl_err, ctl_ok, openapi_script};
use sluice_tests::{post_typed, wait_ids, Sluice};

/// The file `channels.toml`: the bus `default` and a bus `gitops` with a rule `all` that
/// writes to `{data_dir}/gitops.jsonl`.
fn channels(sluice: &Sluice) -> String {
    format!(
        "[[buses]]\nname = \"default\"\nshards = 4\n\n[[buses]]\nname = \"gitops\"\nshards = 2\n\n\
         [[rules]]\nname = \"all\"\nbus = \"gitops\"\n[[rules.targets]]\ntype = \"file\"\nname = \"out\"\npath = \"{}\"\n",
        sluice.data_dir().join("gitops.jsonl").display()
    )
}

/// Writes `text` to `dir/name` and returns the path as a `ctl` argument.
fn file(dir: &Path, name: &str, text: &str) -> String {
    let path: PathBuf = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

async fn gateway() -> Sluice {
    Sluice::builder()
        .durability("os")
        .env("SLUICE_SECRET_TEST_GH", "gh-secret")
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_apply_is_idempotent_prunes_and_dry_runs() {
    let sluice = gateway().await;
    let dir = tempfile::tempdir().unwrap();
    let f = &file(dir.path(), "channels.toml", &channels(&sluice));

    let dry = ctl_ok(&sluice, &["apply", "-f", f, "--dry-run"]);
    assert!(dry.contains("bus/gitops created (dry run)"), "{dry}");
    let first = ctl_ok(&sluice, &["apply", "-f", f]);
    assert!(first.contains("bus/gitops created"), "{first}");
    assert!(first.contains("rule/gitops/all created"), "{first}");
    assert!(first.contains("bus/default unchanged"), "{first}");
    let second = ctl_ok(&sluice, &["apply", "-f", f]);
    assert!(
        !second.contains("created") && !second.contains("updated"),
        "idempotent: {second}"
    );
    // The applied rule runs.
    tokio::time::sleep(Duration::from_millis(500)).await;
    post_typed(&sluice, "gitops", "g-1", "t").await;
    wait_ids(&sluice, "gitops.jsonl", &["g-1"]).await;

    // Without --prune, what the file lacks stays; with it, it goes.
    let kept = ctl_ok(&sluice, &["apply", "-f", f]);
    assert!(!kept.contains("deleted"), "{kept}");
    let listed = ctl_ok(&sluice, &["get", "rules", "default"]);
    assert!(listed.contains("all-events"), "{listed}");
    let pruned = ctl_ok(&sluice, &["apply", "-f", f, "--prune"]);
    assert!(
        pruned.contains("rule/default/all-events deleted"),
        "{pruned}"
    );
    let listed = ctl_ok(&sluice, &["get", "rules", "default"]);
    assert!(!listed.contains("all-events"), "{listed}");
}

/// An invalid file changes nothing and says where; a webhook source must take its secret
/// from the environment; YAML has the same fields as TOML.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_apply_takes_toml_and_yaml_and_refuses_an_invalid_file_saying_where() {
    let sluice = gateway().await;
    let dir = tempfile::tempdir().unwrap();
    let bad = channels(&sluice).replace("type = \"file\"", "type = \"file\"\nretry = 3");
    let err = ctl_err(
        &sluice,
        &["apply", "-f", &file(dir.path(), "channels.toml", &bad)],
    );
    assert!(
        err.contains("400") && err.contains("/rules/0/targets/0"),
        "{err}"
    );
    let listed = ctl_ok(&sluice, &["get", "buses"]);
    assert!(!listed.contains("gitops"), "nothing applied: {listed}");

    // A webhook source applied to the catalog must take its secret from the environment.
    let hook = |secret: &str| {
        format!("[[webhooks]]\nname = \"gh\"\nbus = \"default\"\nverify = {{ preset = \"github\", secret = \"{secret}\" }}\n")
    };
    let err = ctl_err(
        &sluice,
        &[
            "apply",
            "-f",
            &file(dir.path(), "hooks.toml", &hook("literal")),
        ],
    );
    assert!(
        err.contains("400") && err.contains("/webhooks/0/verify/secret"),
        "{err}"
    );
    // With an `env:` reference to a variable the replica has, it is applied and listed
    // (one it does not have is refused: see catalog_resilience).
    let hooks = file(dir.path(), "hooks.toml", &hook("env:SLUICE_SECRET_TEST_GH"));
    let applied = ctl_ok(&sluice, &["apply", "-f", &hooks]);
    assert!(applied.contains("webhook/gh created"), "{applied}");
    let listed = ctl_ok(&sluice, &["get", "webhooks"]);
    assert!(
        listed.contains("\"gh\"") && listed.contains("SLUICE_SECRET_TEST_GH"),
        "{listed}"
    );
    let gone = ctl_ok(&sluice, &["delete", "webhook", "gh"]);
    assert!(gone.contains("webhook gh deleted"), "{gone}");

    // YAML with the same fields.
    let yaml = file(
        dir.path(),
        "more.yaml",
        "buses:\n  - name: from-yaml\n    shards: 1\n    retention: 1h\nrules:\n  - name: y\n    bus: from-yaml\n    pattern:\n      type: [a.b]\n    targets:\n      - type: log\n        name: l\n",
    );
    let applied = ctl_ok(&sluice, &["apply", "-f", &yaml]);
    assert!(
        applied.contains("bus/from-yaml created") && applied.contains("rule/from-yaml/y created"),
        "{applied}"
    );
    let yaml = file(dir.path(), "more.yaml", "buses: [{name: bad name}]\n");
    let err = ctl_err(&sluice, &["apply", "-f", &yaml]);
    assert!(err.contains("/buses/0/name"), "{err}");
    ctl_ok(&sluice, &["delete", "rule", "from-yaml/y"]);
    ctl_ok(&sluice, &["delete", "bus", "from-yaml"]);
}

/// describe, pause/resume, test-rule, delete (a bus only once its rules are gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_describes_pauses_resumes_tests_and_deletes() {
    let sluice = gateway().await;
    let dir = tempfile::tempdir().unwrap();
    let f = file(dir.path(), "channels.toml", &channels(&sluice));
    ctl_ok(&sluice, &["apply", "-f", &f]);

    let described = ctl_ok(&sluice, &["describe", "rule", "gitops/all"]);
    assert!(described.contains("gitops/all/out"), "{described}");
    ctl_ok(&sluice, &["pause", "gitops/all/out"]);
    ctl_ok(&sluice, &["resume", "gitops/all/out", "--task", "1"]);
    let event = file(
        dir.path(),
        "event.json",
        r#"{"specversion":"1.0","id":"1","source":"/s","type":"t"}"#,
    );
    let tested = ctl_ok(
        &sluice,
        &["test-rule", "--event", &event, "--rule", "gitops/all"],
    );
    assert!(tested.contains("\"matched\": true"), "{tested}");
    let refused = ctl_err(&sluice, &["delete", "bus", "gitops"]);
    assert!(refused.contains("409"), "{refused}");
    ctl_ok(&sluice, &["delete", "rule", "gitops/all"]);
    ctl_ok(&sluice, &["delete", "bus", "gitops"]);
}

/// The OpenAPI document is a valid OpenAPI 3.1 description and documents exactly the
/// admin API's routes (`gateway/src/admin/`); the shipped configurations validate against the
/// configuration's JSON Schema.
#[test]
fn the_openapi_document_matches_the_routes_and_the_config_schema_the_configs() {
    for arg in ["--routes", "--config-schema"] {
        openapi_script(&[arg.as_ref()]);
    }
}
