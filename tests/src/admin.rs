//! The admin API (`/api/v1`) and `sluice ctl` as tests use them: an [`Api`] client that
//! records every exchange for the OpenAPI check ([`check_openapi`]), plain calls for tests
//! that only want the status and body ([`call`], [`get`], [`put`]), table-driven refusals
//! ([`Refusal`]), and `ctl` runs.

use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};

use crate::{eventually, python, repo_root, sluice_bin, Sluice};

/// The documented path of a bus.
pub const BUS: &str = "/api/v1/buses/{bus}";
/// The documented path of a rule.
pub const RULE: &str = "/api/v1/buses/{bus}/rules/{rule}";
/// The documented path of a bus's replays.
pub const REPLAYS: &str = "/api/v1/buses/{bus}/replays";
/// The documented path of a webhook source.
pub const HOOK: &str = "/api/v1/webhooks/{name}";

/// Every exchange of a test, recorded for the OpenAPI check (clones share the record).
#[derive(Clone, Default)]
pub struct Recorder {
    exchanges: Arc<Mutex<Vec<Value>>>,
}

/// An admin API client of one replica; what it sends and gets is recorded when it has a
/// [`Recorder`].
pub struct Api<'a> {
    pub sluice: &'a Sluice,
    pub client: Client,
    /// The bearer token it sends, if any.
    pub token: Option<String>,
    recorder: Option<Recorder>,
}

/// An answer of the admin API: the body parsed as JSON (a string when it is not JSON,
/// `null` when empty).
pub struct Answer {
    pub status: StatusCode,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Answer {
    /// Asserts a problem (`application/problem+json`) with `status` whose `pointer` is
    /// `pointer` (`"/targets/0*"`: starts with `/targets/0`; `""`: any).
    #[track_caller]
    pub fn assert_problem(&self, status: u16, pointer: &str, what: &str) {
        assert_eq!(self.status, status, "{what}: {}", self.body);
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{what}"
        );
        let got = self.body["pointer"].as_str().unwrap_or_default();
        let ok = match pointer.strip_suffix('*') {
            Some(prefix) => got.starts_with(prefix),
            None => pointer.is_empty() || got == pointer,
        };
        assert!(ok, "{what}: pointer {got}, want {pointer}: {}", self.body);
    }
}

/// A request expected to be refused: method, documented and real path, body (`null`:
/// none), and the status and JSON pointer of the problem (see [`Answer::assert_problem`]).
pub struct Refusal<'a> {
    pub method: Method,
    pub template: &'a str,
    pub path: &'a str,
    pub body: Value,
    pub status: u16,
    pub pointer: &'a str,
}

impl<'a> Api<'a> {
    /// A client whose exchanges go to `recorder`.
    pub fn new(sluice: &'a Sluice, recorder: &Recorder) -> Api<'a> {
        Api {
            recorder: Some(recorder.clone()),
            ..Api::unrecorded(sluice)
        }
    }

    /// A client with a record of its own (see [`Api::check_openapi`]).
    pub fn recorded(sluice: &'a Sluice) -> Api<'a> {
        Api::new(sluice, &Recorder::default())
    }

    /// Checks what this client recorded against the OpenAPI document ([`check_openapi`]).
    pub fn check_openapi(&self, name: &str) {
        check_openapi(self.recorder.as_ref().expect("a recorded client"), name);
    }

    /// A client that records nothing.
    pub fn unrecorded(sluice: &'a Sluice) -> Api<'a> {
        Api {
            sluice,
            client: crate::client(),
            token: None,
            recorder: None,
        }
    }

    /// `template` is the documented path (`/api/v1/buses/{bus}`), `path` the real one.
    pub async fn call(
        &self,
        method: Method,
        template: &str,
        path: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut request = self.client.request(method.clone(), self.sluice.url(path));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("admin request");
        let status = response.status();
        let headers = response.headers().clone();
        let text = response.text().await.expect("admin answer");
        let body: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        if let Some(recorder) = &self.recorder {
            let content_type = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            recorder.exchanges.lock().unwrap().push(json!({
                "method": method.as_str(),
                "path": template,
                "status": status.as_u16(),
                "content_type": content_type,
                "body": body,
            }));
        }
        Answer {
            status,
            headers,
            body,
        }
    }

    pub async fn get(&self, template: &str, path: &str) -> Answer {
        self.call(Method::GET, template, path, None, &[]).await
    }

    pub async fn put(&self, template: &str, path: &str, body: Value) -> Answer {
        self.call(Method::PUT, template, path, Some(body), &[])
            .await
    }

    pub async fn delete(&self, template: &str, path: &str) -> Answer {
        self.call(Method::DELETE, template, path, None, &[]).await
    }

    pub async fn post(&self, template: &str, path: &str, body: Option<Value>) -> Answer {
        self.call(Method::POST, template, path, body, &[]).await
    }

    /// PUTs a resource that must be created (201) and returns the answer.
    pub async fn create(&self, template: &str, path: &str, body: Value) -> Answer {
        let created = self.put(template, path, body).await;
        assert_eq!(created.status, 201, "PUT {path}: {}", created.body);
        created
    }

    /// Sends each refusal and checks its problem.
    pub async fn assert_refused(&self, refusals: Vec<Refusal<'_>>) {
        for r in refusals {
            let what = format!("{} {} {}", r.method, r.path, r.body);
            let body = (!r.body.is_null()).then_some(r.body);
            self.call(r.method, r.template, r.path, body, &[])
                .await
                .assert_problem(r.status, r.pointer, &what);
        }
    }

    /// Starts a replay on `bus` (it must be accepted) and returns its first status.
    pub async fn start_replay(&self, bus: &str, body: Value) -> Value {
        let started = self
            .post(REPLAYS, &format!("/api/v1/buses/{bus}/replays"), Some(body))
            .await;
        assert_eq!(started.status, 202, "{}", started.body);
        started.body
    }

    /// Waits until the replay `id` of `bus` is no longer `RUNNING`, and returns its status.
    pub async fn wait_replay_end(&self, bus: &str, id: &str, limit: Duration) -> Value {
        let path = format!("/api/v1/buses/{bus}/replays/{id}");
        eventually(limit, Duration::from_millis(100), || async {
            let answer = self
                .get("/api/v1/buses/{bus}/replays/{replay}", &path)
                .await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            if answer.body["state"] != "RUNNING" {
                Ok(answer.body)
            } else {
                Err(format!(
                    "the replay did not end: {}\n{}",
                    answer.body,
                    self.sluice.log()
                ))
            }
        })
        .await
    }

    /// Unrecorded GET (polling): the status and the body.
    pub async fn peek(&self, path: &str) -> (u16, Value) {
        let mut request = self.client.get(self.sluice.url(path));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.expect("admin request");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// Waits (5 s at most) until every task of the connector `id` runs.
    pub async fn wait_connector(&self, id: &str) {
        wait_connector_view(self.sluice, id, Duration::from_secs(5), all_running).await;
    }
}

/// A gateway with `os` durability, standalone or (`distributed`) on the shared Redis
/// under a prefix of `test`'s own.
pub async fn gateway(distributed: bool, test: &str) -> Sluice {
    Sluice::builder()
        .durability("os")
        .mode(distributed, test)
        .start()
        .await
}

/// Whether a connector view has tasks and all of them run.
pub fn all_running(view: &Value) -> bool {
    let tasks = view["tasks"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    !tasks.is_empty() && tasks.iter().all(|t| t["state"] == "RUNNING")
}

/// Waits until `pred` holds for the connector's view (`/api/v1/connectors/{id}`), and
/// returns it.
pub async fn wait_connector_view(
    sluice: &Sluice,
    id: &str,
    limit: Duration,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let api = Api::unrecorded(sluice);
    let path = format!("/api/v1/connectors/{id}");
    eventually(limit, Duration::from_millis(50), || async {
        match api.peek(&path).await {
            (200, view) if pred(&view) => Ok(view),
            (status, view) => Err(format!("{id}: {status} {view}")),
        }
    })
    .await
}

/// `method` `path` with a JSON body (or none), unrecorded: the status and the body; an
/// error answer must be a problem (`application/problem+json`).
pub async fn call(
    sluice: &Sluice,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let answer = Api::unrecorded(sluice)
        .call(method, path, path, body, &[])
        .await;
    let status = answer.status.as_u16();
    if status >= 400 {
        assert_eq!(
            answer.headers["content-type"], "application/problem+json",
            "{status}: {}",
            answer.body
        );
    }
    (status, answer.body)
}

pub async fn put(sluice: &Sluice, path: &str, body: Value) -> (u16, Value) {
    call(sluice, Method::PUT, path, Some(body)).await
}

pub async fn get(sluice: &Sluice, path: &str) -> (u16, Value) {
    call(sluice, Method::GET, path, None).await
}

/// `method` `path` without a body, asserting the answer's status; returns the body.
pub async fn expect(sluice: &Sluice, method: Method, path: &str, status: u16) -> Value {
    let (got, body) = call(sluice, method.clone(), path, None).await;
    assert_eq!(got, status, "{method} {path}: {body}");
    body
}

/// POSTs an action (`/api/v1/connectors/{id}/pause`, say) and asserts it is accepted (202).
pub async fn act(sluice: &Sluice, path: &str) {
    expect(sluice, Method::POST, path, 202).await;
}

/// The catalog's version (`GET /api/v1/catalog`).
pub async fn catalog_version(sluice: &Sluice) -> Value {
    let (status, body) = get(sluice, "/api/v1/catalog").await;
    assert_eq!(status, 200, "{body}");
    body["version"].clone()
}

/// Asserts a 400 problem naming `pointer`, whose detail says `says`.
#[track_caller]
pub fn assert_refused(answer: &(u16, Value), pointer: &str, says: &str) {
    let (status, body) = answer;
    assert_eq!(*status, 400, "{body}");
    assert_eq!(body["pointer"], pointer, "{body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(says), "`{says}` not in: {body}");
}

/// Checks the recorded answers against the OpenAPI document (and the document itself)
/// with the PyPI validators.
pub fn check_openapi(recorder: &Recorder, name: &str) {
    let exchanges = recorder.exchanges.lock().unwrap().clone();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join(format!("{name}.json"));
    std::fs::write(&file, serde_json::to_vec_pretty(&exchanges).unwrap()).expect("write");
    openapi_script(&[file.as_os_str()]);
}

/// Runs `tests/scripts/check_openapi.py` with these arguments and asserts it passes.
pub fn openapi_script(args: &[&std::ffi::OsStr]) {
    let out = Command::new(python())
        .arg(repo_root().join("tests/scripts/check_openapi.py"))
        .args(args)
        .current_dir(repo_root())
        .output()
        .expect("run check_openapi.py");
    assert!(
        out.status.success(),
        "check_openapi.py {args:?}:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `sluice ctl --server {sluice} {args}`, with `SLUICE_ADMIN_TOKEN` set to `token` (or
/// unset).
pub fn ctl(sluice: &Sluice, args: &[&str], token: Option<&str>) -> Output {
    let mut command = Command::new(sluice_bin());
    command
        .arg("ctl")
        .arg("--server")
        .arg(sluice.url(""))
        .args(args);
    command.env_remove("SLUICE_ADMIN_TOKEN");
    if let Some(token) = token {
        command.env("SLUICE_ADMIN_TOKEN", token);
    }
    command.output().expect("run sluice ctl")
}

/// The standard output of a `ctl` run that must succeed.
pub fn ctl_ok(sluice: &Sluice, args: &[&str]) -> String {
    let out = ctl(sluice, args, None);
    assert!(
        out.status.success(),
        "ctl failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The standard error of a `ctl` run that must fail.
pub fn ctl_err(sluice: &Sluice, args: &[&str]) -> String {
    let out = ctl(sluice, args, None);
    assert!(!out.status.success(), "ctl {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}
