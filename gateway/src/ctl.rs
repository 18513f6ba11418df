//! `sluice ctl`: the admin API from the command line (and from CI, for GitOps).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

#[derive(Args)]
pub(crate) struct Ctl {
    /// The gateway's admin address.
    #[arg(
        long,
        env = "SLUICE_SERVER",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    server: String,
    /// The admin API's bearer token. Without one, the token a gateway generated in its
    /// data directory (`--data-dir`, or `./data` when the server is on loopback) is used.
    #[arg(
        long,
        env = "SLUICE_ADMIN_TOKEN",
        hide_env_values = true,
        global = true
    )]
    token: Option<String>,
    /// The gateway's data directory, where it keeps the token it generated
    /// (`admin-token`) when none is configured.
    #[arg(long, env = "SLUICE_DATA_DIR", global = true)]
    data_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: CtlCommand,
}

#[derive(Subcommand)]
enum CtlCommand {
    /// Make the catalog hold a file's buses, rules and sources (TOML, as in the
    /// configuration file, YAML with the same fields (`.yaml`, `.yml`), or JSON). Idempotent; prints created / updated / unchanged per
    /// resource.
    Apply {
        #[arg(long, short = 'f')]
        file: PathBuf,
        /// Also delete the resources the file does not have.
        #[arg(long)]
        prune: bool,
        /// Show what would change, change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Show resources: `buses`, `bus NAME`, `rules BUS`, `rule BUS/NAME`, `sources`,
    /// `source NAME`, `webhooks`, `webhook NAME`, `connectors`, `connector ID`, `cluster`,
    /// `catalog`.
    Get { kind: String, name: Option<String> },
    /// Like `get`, for one resource or connector, with its status.
    Describe { kind: String, name: String },
    /// Delete `bus NAME`, `rule BUS/NAME`, `source NAME` or `webhook NAME`.
    Delete { kind: String, name: String },
    /// Pause a connector (`bus/rule/target` or `source/name`), or one task of it.
    Pause {
        connector: String,
        #[arg(long)]
        task: Option<u32>,
    },
    /// Resume a connector or one of its tasks.
    Resume {
        connector: String,
        #[arg(long)]
        task: Option<u32>,
    },
    /// Restart a connector or one of its tasks.
    Restart {
        connector: String,
        #[arg(long)]
        task: Option<u32>,
    },
    /// Test an event against a pattern, a filter or an existing rule, through the gateway.
    TestRule {
        /// A structured-mode CloudEvent (JSON file).
        #[arg(long)]
        event: PathBuf,
        /// An event pattern (JSON file).
        #[arg(long)]
        pattern: Option<PathBuf>,
        #[arg(long)]
        filter: Option<String>,
        /// A transform step or chain (JSON file).
        #[arg(long)]
        transform: Option<PathBuf>,
        /// An existing rule, `bus/rule` (its condition; with --target, that target's transform).
        #[arg(long)]
        rule: Option<String>,
        #[arg(long)]
        target: Option<String>,
    },
    /// Re-deliver a bus's events accepted in a time range to one rule (or one target of it).
    Replay {
        /// The rule, `bus/rule`.
        rule: String,
        #[arg(long)]
        target: Option<String>,
        /// From this acceptance time (RFC 3339, or ms since the Unix epoch).
        #[arg(long)]
        from: Option<String>,
        /// Up to this acceptance time (exclusive).
        #[arg(long)]
        to: Option<String>,
        /// Wait until the replay ends and print its final status.
        #[arg(long)]
        wait: bool,
    },
    /// Print the SHA-256 of a token, as `admin.tokens` takes it.
    HashToken { token: String },
}

struct Client {
    http: reqwest::Client,
    server: String,
    token: Option<String>,
}

impl Client {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let body = match body {
            // The admin API reads JSON (files in TOML or YAML are converted here); only a
            // function's component goes up as is.
            Some(body) => Some(("application/json", serde_json::to_vec(body)?)),
            None => None,
        };
        self.send(method, path, body).await
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
    ) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.server.trim_end_matches('/'));
        let mut request = self.http.request(method, &url);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some((content_type, bytes)) = body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, content_type)
                .body(bytes);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("cannot reach the admin API at {url}"))?;
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        let value: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        if !status.is_success() {
            let detail = value["detail"].as_str().unwrap_or("").to_string();
            let field = value["field"]
                .as_str()
                .map(|f| format!(" (at {f})"))
                .unwrap_or_default();
            bail!("{status}: {detail}{field}");
        }
        Ok(value)
    }
}

fn print(value: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_default()
    );
}

fn read_json(what: &str, path: &Path) -> anyhow::Result<Value> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read the {what} {}", path.display()))?;
    serde_json::from_slice(&bytes)
        .with_context(|| format!("the {what} {} is not JSON", path.display()))
}

/// A file's buses, rules, sources and webhook sources as JSON. A full configuration file
/// works too: its server settings are left out.
fn resources(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let all: Value = if extension == "json" {
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?
    } else if matches!(extension, "yaml" | "yml") {
        // YAML 1.2 booleans only: a rule named `y` or `no` stays a string.
        let options = serde_saphyr::options! { strict_booleans: true };
        // Several documents (`---`): Knative Triggers as `kubectl apply -f` takes them.
        let docs: Vec<Value> = serde_saphyr::from_multiple_with_options(&text, options)
            .map_err(|e| anyhow::anyhow!("{} is not YAML: {e}", path.display()))?;
        knative_documents(docs)
    } else {
        let table: toml::Table =
            toml::from_str(&text).with_context(|| format!("{} is not TOML", path.display()))?;
        serde_json::to_value(table)?
    };
    let all = knative_documents(vec![all]);
    let mut out = serde_json::Map::new();
    // `triggers`: Knative Triggers, made rules by the gateway (it knows the brokers' buses).
    for key in [
        "buses",
        "rules",
        "sources",
        "webhooks",
        "functions",
        "triggers",
    ] {
        if let Some(v) = all.get(key) {
            out.insert(key.to_string(), v.clone());
        }
    }
    Ok(Value::Object(out))
}

/// Documents as one: Knative `Trigger` resources (alone, or the items of a `List`) are
/// gathered under `triggers`; the lists of the other documents are joined.
fn knative_documents(docs: Vec<Value>) -> Value {
    fn push(out: &mut serde_json::Map<String, Value>, key: &str, items: Vec<Value>) {
        if let Value::Array(list) = out.entry(key).or_insert_with(|| json!([])) {
            list.extend(items);
        }
    }
    let mut out = serde_json::Map::new();
    for doc in docs {
        match doc["kind"].as_str() {
            Some("Trigger") => push(&mut out, "triggers", vec![doc]),
            Some("List") => push(
                &mut out,
                "triggers",
                doc["items"].as_array().cloned().unwrap_or_default(),
            ),
            _ => {
                let Value::Object(map) = doc else { continue };
                for (key, value) in map {
                    match value {
                        Value::Array(items) => push(&mut out, &key, items),
                        other => {
                            out.insert(key, other);
                        }
                    }
                }
            }
        }
    }
    Value::Object(out)
}

/// Uploads the components of the file's functions that name a `path` (relative to the
/// file), each with its limits (`PUT /api/v1/functions/{name}`), and names them by hash in
/// the body. A dry run uploads nothing (the functions are named by the hash of the file).
async fn upload_functions(
    client: &Client,
    body: &mut Value,
    base: &Path,
    dry_run: bool,
) -> anyhow::Result<()> {
    let Some(Value::Array(functions)) = body.get_mut("functions") else {
        return Ok(());
    };
    let mut kept = Vec::new();
    for mut f in std::mem::take(functions) {
        let name = f["name"].as_str().unwrap_or("").to_string();
        let Some(path) = f.get("path").and_then(Value::as_str).map(PathBuf::from) else {
            kept.push(f);
            continue;
        };
        let full = base.join(&path);
        let bytes = std::fs::read(&full)
            .with_context(|| format!("function `{name}`: cannot read {}", full.display()))?;
        if dry_run {
            // Named by its hash, unchecked: a real apply uploads it (and checks it) first.
            println!(
                "function/{name}: {} ({} bytes) is uploaded and checked by a real apply",
                full.display(),
                bytes.len()
            );
            if let Some(obj) = f.as_object_mut() {
                obj.remove("path");
                obj.insert("sha256".into(), json!(sluice::wasm::sha256_hex(&bytes)));
                obj.insert("size".into(), json!(bytes.len()));
            }
            kept.push(f);
            continue;
        }
        // The function's settings go with the upload, so that the gateway checks the
        // component under them (the apply then stores them).
        let mut query = url::form_urlencoded::Serializer::new(String::new());
        for key in [
            "timeout",
            "max_memory_bytes",
            "max_events",
            "max_output_bytes",
            "isolation",
        ] {
            match f.get(key) {
                Some(Value::String(s)) => {
                    query.append_pair(key, s);
                }
                Some(Value::Number(n)) => {
                    query.append_pair(key, &n.to_string());
                }
                _ => {}
            }
        }
        for grant in f
            .get("grants")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(g) = grant.as_str() {
                query.append_pair("grant", g);
            }
        }
        for (k, v) in f
            .get("env")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            if let Some(v) = v.as_str() {
                query.append_pair("env", &format!("{k}={v}"));
            }
        }
        let path = format!("/api/v1/functions/{name}?{}", query.finish());
        let answer = client
            .send(
                reqwest::Method::PUT,
                &path,
                Some(("application/wasm", bytes)),
            )
            .await
            .with_context(|| format!("function `{name}`: upload of {}", full.display()))?;
        if let Some(obj) = f.as_object_mut() {
            obj.remove("path");
            obj.insert("sha256".into(), answer["sha256"].clone());
            obj.insert("size".into(), answer["size"].clone());
        }
        kept.push(f);
    }
    *functions = kept;
    Ok(())
}

fn resource_path(kind: &str, name: Option<&str>) -> anyhow::Result<String> {
    let need = || name.context(format!("`{kind}` needs a name"));
    Ok(match kind {
        "buses" => "/api/v1/buses".to_string(),
        "bus" => format!("/api/v1/buses/{}", need()?),
        "rules" => format!("/api/v1/buses/{}/rules", need()?),
        "rule" => {
            let (bus, rule) = need()?.split_once('/').context("a rule is named `bus/rule`")?;
            format!("/api/v1/buses/{bus}/rules/{rule}")
        }
        "sources" => "/api/v1/sources".to_string(),
        "source" => format!("/api/v1/sources/{}", need()?),
        "webhooks" => "/api/v1/webhooks".to_string(),
        "webhook" => format!("/api/v1/webhooks/{}", need()?),
        "functions" => "/api/v1/functions".to_string(),
        "function" => format!("/api/v1/functions/{}", need()?),
        "connectors" => "/api/v1/connectors".to_string(),
        "connector" => format!("/api/v1/connectors/{}", need()?),
        "cluster" => "/api/v1/cluster".to_string(),
        "catalog" => "/api/v1/catalog".to_string(),
        other => bail!(
            "unknown kind `{other}` (buses, bus, rules, rule, sources, source, webhooks, webhook, functions, function, connectors, connector, cluster, catalog)"
        ),
    })
}

pub(crate) fn run(ctl: Ctl) -> anyhow::Result<()> {
    if let CtlCommand::HashToken { token } = &ctl.command {
        println!("{}", sluice::admin::hash_token(token));
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(run_async(ctl))
}

async fn run_async(ctl: Ctl) -> anyhow::Result<()> {
    let client = Client {
        http: reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .build()?,
        token: ctl
            .token
            .filter(|t| !t.is_empty())
            .or_else(|| generated_token(&ctl.server, ctl.data_dir.as_deref())),
        server: ctl.server,
    };
    use reqwest::Method;
    match ctl.command {
        CtlCommand::HashToken { .. } => {}
        CtlCommand::Apply {
            file,
            prune,
            dry_run,
        } => {
            let mut body = resources(&file)?;
            let base = file.parent().unwrap_or(Path::new("."));
            upload_functions(&client, &mut body, base, dry_run).await?;
            let path = format!("/api/v1/catalog/apply?prune={prune}&dry_run={dry_run}");
            let answer = client.call(Method::POST, &path, Some(&body)).await?;
            for r in answer["resources"].as_array().into_iter().flatten() {
                let result = r["result"].as_str().unwrap_or("?");
                let result = if dry_run && result != "unchanged" {
                    format!("{result} (dry run)")
                } else {
                    result.to_string()
                };
                println!("{} {result}", r["resource"].as_str().unwrap_or("?"));
            }
            println!("catalog version {}", answer["version"]);
        }
        CtlCommand::Get { kind, name } => {
            print(
                &client
                    .call(Method::GET, &resource_path(&kind, name.as_deref())?, None)
                    .await?,
            );
        }
        CtlCommand::Describe { kind, name } => {
            let resource = client
                .call(Method::GET, &resource_path(&kind, Some(&name))?, None)
                .await?;
            if kind == "rule" {
                // The rule and the status of each of its targets' connectors.
                let mut connectors = Vec::new();
                for target in resource["targets"].as_array().into_iter().flatten() {
                    let id = format!("{name}/{}", target["name"].as_str().unwrap_or(""));
                    connectors.push(
                        client
                            .call(Method::GET, &format!("/api/v1/connectors/{id}"), None)
                            .await
                            .unwrap_or_else(|e| json!({"id": id, "error": e.to_string()})),
                    );
                }
                print(&json!({"rule": resource, "connectors": connectors}));
            } else {
                print(&resource);
            }
        }
        CtlCommand::Delete { kind, name } => {
            if !matches!(
                kind.as_str(),
                "bus" | "rule" | "source" | "webhook" | "function"
            ) {
                bail!("delete takes `bus NAME`, `rule BUS/NAME`, `source NAME`, `webhook NAME` or `function NAME`");
            }
            client
                .call(Method::DELETE, &resource_path(&kind, Some(&name))?, None)
                .await?;
            println!("{kind} {name} deleted");
        }
        CtlCommand::Pause { connector, task } => {
            control(&client, &connector, task, "pause").await?
        }
        CtlCommand::Resume { connector, task } => {
            control(&client, &connector, task, "resume").await?
        }
        CtlCommand::Restart { connector, task } => {
            control(&client, &connector, task, "restart").await?
        }
        CtlCommand::Replay {
            rule,
            target,
            from,
            to,
            wait,
        } => {
            let (bus, rule) = rule.split_once('/').context("a rule is named `bus/rule`")?;
            let time =
                |t: &str| -> Value { t.parse::<u64>().map_or_else(|_| json!(t), |ms| json!(ms)) };
            let mut body = json!({"rule": rule});
            if let Some(t) = target {
                body["target"] = json!(t);
            }
            if let Some(f) = from {
                body["from"] = time(&f);
            }
            if let Some(t) = to {
                body["to"] = time(&t);
            }
            let path = format!("/api/v1/buses/{bus}/replays");
            let started = client.call(Method::POST, &path, Some(&body)).await?;
            let id = started["id"].as_str().unwrap_or("").to_string();
            if !wait {
                print(&started);
                return Ok(());
            }
            loop {
                let status = client
                    .call(
                        Method::GET,
                        &format!("/api/v1/buses/{bus}/replays/{id}"),
                        None,
                    )
                    .await?;
                if status["state"] != "RUNNING" {
                    print(&status);
                    if status["state"] != "COMPLETED" {
                        bail!("replay {id} ended {}", status["state"]);
                    }
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
        CtlCommand::TestRule {
            event,
            pattern,
            filter,
            transform,
            rule,
            target,
        } => {
            let mut body = json!({"event": read_json("event", &event)?});
            if let Some(p) = pattern {
                body["pattern"] = read_json("pattern", &p)?;
            }
            if let Some(f) = filter {
                body["filter"] = json!(f);
            }
            if let Some(t) = transform {
                body["transform"] = read_json("transform", &t)?;
            }
            if let Some(r) = rule {
                body["rule"] = json!(r);
            }
            if let Some(t) = target {
                body["target"] = json!(t);
            }
            print(
                &client
                    .call(Method::POST, "/api/v1/rules/test", Some(&body))
                    .await?,
            );
        }
    }
    Ok(())
}

/// The token a gateway generated (`{data_dir}/admin-token`): from `--data-dir`, or from
/// `./data` (the default data directory) when the server is on this machine's loopback,
/// so a token of this machine is never sent elsewhere unasked.
fn generated_token(server: &str, data_dir: Option<&Path>) -> Option<String> {
    let dir = match data_dir {
        Some(dir) => dir.to_path_buf(),
        None => {
            let host = reqwest::Url::parse(server).ok()?.host_str()?.to_string();
            let local = host == "localhost"
                || host
                    .trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !local {
                return None;
            }
            PathBuf::from("./data")
        }
    };
    let text = std::fs::read_to_string(dir.join(sluice::admin::TOKEN_FILE)).ok()?;
    Some(text.trim().to_string()).filter(|t| !t.is_empty())
}

async fn control(
    client: &Client,
    connector: &str,
    task: Option<u32>,
    action: &str,
) -> anyhow::Result<()> {
    let path = match (connector.strip_prefix("source/"), task) {
        (Some(name), None) => format!("/api/v1/sources/{name}/{action}"),
        (Some(name), Some(t)) => format!("/api/v1/sources/{name}/tasks/{t}/{action}"),
        (None, None) => format!("/api/v1/connectors/{connector}/{action}"),
        (None, Some(t)) => format!("/api/v1/connectors/{connector}/tasks/{t}/{action}"),
    };
    client.call(reqwest::Method::POST, &path, None).await?;
    match task {
        Some(t) => println!("{connector} task {t}: {action} requested"),
        None => println!("{connector}: {action} requested"),
    }
    Ok(())
}
