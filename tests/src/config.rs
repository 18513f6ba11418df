//! Configuration snippets tests add to a gateway's file, and `sluice check-config`.

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use crate::sluice_bin;

/// TOML for a bus `name` of `shards` shards, with `settings` in its table.
pub fn bus(name: &str, shards: u32, settings: &str) -> String {
    format!("\n[[buses]]\nname = \"{name}\"\nshards = {shards}\n{settings}\n")
}

/// TOML for a rule `rule` of bus `bus` sending every event to one target `target` of type
/// `kind`; `settings` go into the target's table (and may open sub-tables after it).
pub fn rule_on(bus: &str, rule: &str, kind: &str, target: &str, settings: &str) -> String {
    format!(
        r#"
[[rules]]
name = "{rule}"
bus = "{bus}"

[[rules.targets]]
type = "{kind}"
name = "{target}"
{settings}
"#
    )
}

/// A rule of bus `default` with one target (see [`rule_on`]).
pub fn target_rule(rule: &str, kind: &str, target: &str, settings: &str) -> String {
    rule_on("default", rule, kind, target, settings)
}

/// A rule `name` of bus `default` with one HTTP target, also `name`, at `url`; `extra`
/// goes into the target's table (see [`rule_on`]).
pub fn http_rule(name: &str, url: &str, extra: &str) -> String {
    target_rule(name, "http", name, &format!("url = \"{url}\"\n{extra}"))
}

/// TOML for a bus `name` (see [`bus`]) whose events all go to `{data_dir}/{name}.jsonl`
/// (rule `{name}-to-file`, target `{name}-file`).
pub fn bus_to_file_with(name: &str, shards: u32, settings: &str) -> String {
    bus(name, shards, settings)
        + &rule_on(
            name,
            &format!("{name}-to-file"),
            "file",
            &format!("{name}-file"),
            &format!("path = \"{{data_dir}}/{name}.jsonl\""),
        )
}

/// A bus `name` of one shard whose events all go to `{data_dir}/{name}.jsonl`.
pub fn bus_to_file(name: &str) -> String {
    bus_to_file_with(name, 1, "")
}

/// A configuration file `c.toml` holding `text`, in a temporary directory of its own (gone
/// when dropped): the directory and the file's path.
pub fn config_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("c.toml");
    fs::write(&path, text).expect("write config");
    (dir, path)
}

/// `sluice check-config` on a configuration text: whether it passed, and what it printed
/// (stderr, then stdout).
pub fn check_config(text: &str) -> (bool, String) {
    let (_dir, path) = config_file(text);
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
