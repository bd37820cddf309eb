//! HTTP API tests: the real application on a random port (in-process, or the binary as a
//! [`ServerProcess`] that can be killed), a real loopback upstream, tool services that record
//! every execution, and clients speaking HTTP (async-openai where OpenAI's SDK fits, reqwest
//! elsewhere).

pub mod upstream;

/// One test per store for a behaviour written once.
macro_rules! on_both_stores {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$name(None).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$name(Some(crate::pg::fresh_database())).await;
            }
        }
    };
}

mod admin;
mod control;
mod durability;
mod enforced;
mod errors;
mod maintenance;
mod mcp;
mod memory;
mod operator_cli;
mod postgres;
mod recovery;
mod remote;
mod responses;
mod runtime_api;
mod spend;
mod tls_upstream;
pub mod tools;
mod trust;
mod v1;
mod workflows;

use std::sync::Arc;

use serde_json::{Value, json};
use stable_harness::app::{Application, ServerConfig};
use tokio::sync::oneshot;

use crate::helpers::TestWorkspace;
use upstream::MockUpstream;

pub const CLIENT_KEY: &str = "client-key-for-tests";
pub const ADMIN_KEY: &str = "admin-key-for-tests";

/// A workspace whose models point at `upstream`: agents `assistant` (model `main`),
/// `resilient` (model `flaky`, falling back to `main`), `impatient` (model `slow`, 1s timeout)
/// and `greeter` (scripted). Retries are fast: 3 attempts, 20ms..100ms backoff. `runtime_extra`
/// is appended to the Runtime spec right after its `recovery` block (indent 4 to extend it).
pub fn api_workspace(upstream: &MockUpstream, runtime_extra: &str) -> TestWorkspace {
    let workspace = TestWorkspace::empty();
    workspace.write(
        "config/runtime/workspace.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: {{ name: api-test }}\nspec:\n  defaultAgent: assistant\n  progress: {{ narration: {{ enabled: true }} }}\n  recovery:\n    maxAttempts: 3\n    backoff: {{ initial: 20ms, max: 100ms }}\n{runtime_extra}"
        ),
    );
    workspace.write(
        "config/agents/agents.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: main\n  instructions: You are a test assistant.\n  backendConfig: { temperature: 0.3 }\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: resilient }\nspec:\n  backend: openai\n  model: flaky\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: impatient }\nspec:\n  backend: openai\n  model: slow\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: greeter }\nspec:\n  backend: scripted\n  script: [{ reply: \"Hello {{input}}\" }, { reply: \"!\" }]\n",
    );
    workspace.write(
        "config/catalogs/models.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: {{ name: models }}\nspec:\n  models:\n    - {{ id: main, provider: openai-compatible, baseUrl: \"{url}\", apiKeyEnv: STABLE_HARNESS_TEST_UPSTREAM_KEY, upstreamModel: main-upstream, timeout: 5s }}\n    - {{ id: flaky, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: flaky-upstream, timeout: 5s, fallbacks: [main] }}\n    - {{ id: slow, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: slow-upstream, timeout: 1s }}\n",
            url = upstream.url
        ),
    );
    workspace
}

/// The application, served on a random loopback port until dropped.
pub struct TestApp {
    pub base: String,
    pub http: reqwest::Client,
    pub workspace: TestWorkspace,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

/// Waits until the embedded store of `workspace` (if it has one) is released: its writer
/// thread lets go of it once the journal, dropped with the stopped server, has finished,
/// which on a loaded machine can come after the server's task. A process restart waits
/// for the old process to exit; a restart within the test process waits for this.
async fn wait_for_the_store_released(workspace: &std::path::Path) {
    let Ok(database) = stable_harness::store::sqlite_path(None, workspace) else {
        return;
    };
    let lock = stable_harness::store::SqliteStore::ownership_lock_path(&database);
    let Ok(file) = std::fs::File::open(&lock) else {
        return;
    };
    for _ in 0..1_000 {
        // Taken means released; dropping `file` gives it back.
        if file.try_lock().is_ok() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the stopped server still holds {}", lock.display());
}

impl TestApp {
    /// Serves `workspace` with one client and one admin key.
    pub async fn spawn(workspace: TestWorkspace) -> Self {
        Self::spawn_with_keys(workspace, &[CLIENT_KEY], &[ADMIN_KEY]).await
    }

    pub async fn spawn_with_keys(
        workspace: TestWorkspace,
        client: &[&str],
        admin: &[&str],
    ) -> Self {
        Self::spawn_on(workspace, None, client, admin).await
    }

    /// Serves `workspace` on the store at `database_url` (`None`: the embedded one).
    pub async fn spawn_on(
        workspace: TestWorkspace,
        database_url: Option<String>,
        client: &[&str],
        admin: &[&str],
    ) -> Self {
        Self::spawn_configured(workspace, database_url, client, admin, false).await
    }

    /// Like [`TestApp::spawn_on`]; with `watch`, the workspace reloads when its files change.
    pub async fn spawn_configured(
        workspace: TestWorkspace,
        database_url: Option<String>,
        client: &[&str],
        admin: &[&str],
        watch: bool,
    ) -> Self {
        stable_harness::app::install_crypto_provider();
        let compiled = stable_harness::workspace::load(workspace.path())
            .unwrap_or_else(|d| panic!("invalid test workspace:\n{d}"));
        let app = Application::build(ServerConfig {
            workspace: Arc::new(compiled),
            host: "127.0.0.1".into(),
            port: 0,
            database_url,
            api_keys: client.iter().map(|k| (*k).into()).collect(),
            admin_keys: admin.iter().map(|k| (*k).into()).collect(),
            insecure_open_surfaces: false,
            metrics_public: false,
            watch,
        })
        .await
        .unwrap();
        let base = format!("http://127.0.0.1:{}", app.port());
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            app.run_until(async move {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
        Self {
            base,
            http: reqwest::Client::new(),
            workspace,
            stop: Some(stop),
            server: Some(server),
        }
    }

    /// Stops the server the way SIGTERM does and waits for it.
    pub async fn stop(mut self) -> TestWorkspace {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
        wait_for_the_store_released(self.workspace.path()).await;
        std::mem::replace(&mut self.workspace, TestWorkspace::empty())
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// An OpenAI SDK client pointed at this server's `/v1`.
    pub fn openai(&self) -> async_openai::Client<async_openai::config::OpenAIConfig> {
        let config = async_openai::config::OpenAIConfig::new()
            .with_api_base(self.url("/v1"))
            .with_api_key(CLIENT_KEY);
        async_openai::Client::with_config(config)
    }

    pub async fn get(&self, path: &str, key: &str) -> (u16, Value) {
        get_json(&self.http, &self.url(path), key).await
    }

    pub async fn post(&self, path: &str, key: &str, body: &Value) -> (u16, Value) {
        post_json(&self.http, &self.url(path), key, body).await
    }

    /// `POST /runtime/requests` of `text` to `agent` with the client key, accepted (202):
    /// the answer (`requestId`, `runId`, `sessionId`).
    pub async fn submit(&self, agent: &str, text: &str) -> Value {
        let (status, accepted) = self
            .post(
                "/runtime/requests",
                CLIENT_KEY,
                &json!({ "agentId": agent, "input": { "text": text } }),
            )
            .await;
        assert_eq!(status, 202, "{accepted}");
        accepted
    }

    /// `POST /v1/chat/completions` with the client key: the response and its request id.
    pub async fn chat(&self, body: &Value) -> (reqwest::Response, String) {
        let response = self
            .http
            .post(self.url("/v1/chat/completions"))
            .bearer_auth(CLIENT_KEY)
            .json(body)
            .send()
            .await
            .unwrap();
        let request_id = request_id_header(&response);
        (response, request_id)
    }

    /// Every stored event of a request, through the admin-free runtime API.
    pub async fn events(&self, request_id: &str) -> Vec<Value> {
        let (status, page) = self
            .get(
                &format!("/runtime/requests/{request_id}/events"),
                CLIENT_KEY,
            )
            .await;
        assert_eq!(status, 200, "{page}");
        page["data"].as_array().cloned().unwrap_or_default()
    }

    /// Polls the request until it ended (bounded).
    pub async fn wait_until_done(&self, request_id: &str) -> Value {
        wait_until_done_at(&self.http, &self.base, request_id).await
    }

    /// On the embedded store, how `requests` (turns of one session, in order) hold their
    /// leading messages, a system message of `rules[turn]` each: the first turn of each rule
    /// holds them (`leading`), the others name it (`leadingOf`) with their digest, the same
    /// for all that name it.
    pub fn assert_leading_held(&self, requests: &[String], rules: &[&str]) {
        let db = crate::helpers::store_path(self.workspace.path());
        let inputs: Vec<Value> = requests
            .iter()
            .map(|id| crate::helpers::stored_input(&db, id))
            .collect();
        for (turn, input) in inputs.iter().enumerate() {
            let holder = rules.iter().position(|rule| *rule == rules[turn]).unwrap();
            if turn == holder {
                let held = json!([{ "role": "system", "content": rules[turn] }]);
                assert_eq!(input["leading"], held, "turn {turn}: {input}");
                assert!(input.get("leadingOf").is_none(), "turn {turn}: {input}");
            } else {
                assert_eq!(input["leadingOf"], json!(requests[holder]), "turn {turn}");
                assert!(input.get("leading").is_none(), "turn {turn}: {input}");
                // With their digest, which the next turn compares its own with.
                let digest = input["leadingDigest"].as_str().unwrap_or_default();
                assert_eq!(digest.len(), 64, "turn {turn}: {input}");
                let first_naming = &inputs[holder + 1]["leadingDigest"];
                assert_eq!(&input["leadingDigest"], first_naming, "turn {turn}");
            }
        }
    }

    /// Waits for `request_id` to fail, has an operator retry it, and waits for it to
    /// complete.
    pub async fn retried_to_completion(&self, request_id: &str) {
        let view = self.wait_until_done(request_id).await;
        assert_eq!(view["status"], "failed", "{view}");
        let retry = format!("/admin/requests/{request_id}/retry");
        let (status, retried) = self.post(&retry, ADMIN_KEY, &json!({})).await;
        assert_eq!(status, 202, "{retried}");
        let done = self.wait_until_done(request_id).await;
        assert_eq!(done["status"], "completed", "{done}");
    }

    /// Polls the admin API until an approval is pending; returns it.
    pub async fn pending_approval(&self) -> Value {
        pending_approval_at(&self.http, &self.base).await
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The first line a child process printed (its address announcement), and the `http://`
/// address in it.
pub fn announced_address(child: &mut std::process::Child) -> (String, Option<String>) {
    use std::io::{BufRead, BufReader};
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        let _ = BufReader::new(stdout).read_line(&mut line);
    }
    let address = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .map(str::to_owned);
    (line, address)
}

/// The text a `/v1` chat stream carried, its `delta.content`s joined.
pub fn streamed_content(stream: &str) -> String {
    stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// The request id a `/v1` answer names in its `x-stable-harness-request-id` header.
pub fn request_id_header(response: &reqwest::Response) -> String {
    response.headers()["x-stable-harness-request-id"]
        .to_str()
        .expect("a request id header of ASCII")
        .to_owned()
}

/// `GET url` with a bearer key: the status and the JSON body (`null` if there is none).
pub async fn get_json(http: &reqwest::Client, url: &str, key: &str) -> (u16, Value) {
    let response = http.get(url).bearer_auth(key).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The server's metrics at `url` (its `/metrics`), read with the admin key.
pub async fn metrics_text(http: &reqwest::Client, url: &str) -> String {
    let response = http.get(url).bearer_auth(ADMIN_KEY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.text().await.unwrap()
}

/// The value of a Prometheus sample line `name{labels} value`, 0 when absent.
pub fn metric_sample(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// `POST url` of `body` as JSON with a bearer key: the response, its body unread.
pub async fn send_post(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    body: &Value,
) -> reqwest::Response {
    http.post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// [`send_post`]: the status and the body as text (an SSE stream's too).
pub async fn post_text(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    body: &Value,
) -> (u16, String) {
    let response = send_post(http, url, key, body).await;
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// [`post_text`], its body read as JSON (`null` if it is not).
pub async fn post_json(http: &reqwest::Client, url: &str, key: &str, body: &Value) -> (u16, Value) {
    let (status, text) = post_text(http, url, key, body).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Polls `GET {base}/runtime/requests/{id}` until the request ended (bounded); its view.
pub async fn wait_until_done_at(http: &reqwest::Client, base: &str, request_id: &str) -> Value {
    let url = format!("{base}/runtime/requests/{request_id}");
    for _ in 0..400 {
        let (_, view) = get_json(http, &url, CLIENT_KEY).await;
        if matches!(
            view["status"].as_str(),
            Some("completed" | "failed" | "cancelled")
        ) {
            return view;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("request {request_id} did not end");
}

/// Polls `GET {base}/admin/approvals?status=pending` until one is pending; returns it.
pub async fn pending_approval_at(http: &reqwest::Client, base: &str) -> Value {
    let url = format!("{base}/admin/approvals?status=pending");
    for _ in 0..400 {
        let (status, page) = get_json(http, &url, ADMIN_KEY).await;
        assert_eq!(status, 200, "{page}");
        if let Some(first) = page["data"].as_array().and_then(|d| d.first()) {
            return first.clone();
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("no approval became pending");
}

/// Event types of a list of events, in order.
pub fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The `id:` lines of an SSE text.
pub fn sse_ids(text: &str) -> Vec<i64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("id:"))
        .map(|s| s.trim().parse().unwrap())
        .collect()
}

/// Asserts that events are numbered 1, 2, 3, ... with no gap.
pub fn assert_gapless(events: &[Value]) {
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=events.len() as i64).collect::<Vec<_>>(),
        "events are not gapless"
    );
}

/// The real binary serving a workspace on a random loopback port, with the test keys: killed
/// with SIGKILL on drop (a test that fails midway leaves no server behind).
pub struct ServerProcess {
    child: std::process::Child,
    pub base: String,
    /// The instance id it holds run leases as (from its startup line).
    pub instance: String,
    stderr: tempfile::NamedTempFile,
}

impl ServerProcess {
    /// `stable-harness start` on `dir` with `env` added to its environment; returns once it
    /// printed its address.
    pub fn start(dir: &std::path::Path, env: &[(&str, &str)]) -> Self {
        use std::process::{Command, Stdio};
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let mut command = Command::new(crate::helpers::binary());
        command
            .args([
                "start",
                "-w",
                dir.to_str().unwrap(),
                "--port",
                "0",
                "--api-key",
                CLIENT_KEY,
                "--admin-key",
                ADMIN_KEY,
            ])
            .env_remove("STABLE_HARNESS_DATABASE_URL")
            .env("STABLE_HARNESS_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr.reopen().unwrap());
        let mut child = command.spawn().unwrap();
        let (line, address) = announced_address(&mut child);
        let Some(address) = address else {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "no address in {line:?}; stderr: {}",
                std::fs::read_to_string(stderr.path()).unwrap_or_default()
            );
        };
        let instance = line
            .split_whitespace()
            .find(|w| w.starts_with("ins_"))
            .unwrap_or_else(|| panic!("no instance id in {line:?}"))
            .to_owned();
        Self {
            base: address.to_owned(),
            instance,
            child,
            stderr,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `kill -9`: no chance to clean up or finish anything.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits: the server drains and exits 0.
    pub fn terminate(mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "start exits 0 on SIGTERM, got {status}");
    }

    /// Everything the server logged so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.stderr.path()).unwrap_or_default()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One execution a [`RecordingTools`] service received.
#[derive(Debug, Clone)]
pub struct Execution {
    pub path: String,
    /// The `Idempotency-Key` header, if the call had one.
    pub idempotency_key: Option<String>,
    pub headers: std::collections::BTreeMap<String, String>,
    pub body: Value,
    /// When the execution arrived (wall clock, comparable with the store's timestamps).
    pub at: chrono::DateTime<chrono::Utc>,
}

struct RecordingState {
    executions: std::sync::Mutex<Vec<Execution>>,
    /// Paths whose executions wait until released.
    held: std::sync::Mutex<std::collections::HashSet<String>>,
    released: tokio::sync::watch::Sender<u64>,
    /// Fixed answers by path (default: an echo of the call).
    answers: std::sync::Mutex<std::collections::HashMap<String, Value>>,
}

/// An `http` tool service on loopback that records every execution (path, idempotency key,
/// headers, body, arrival time). A body's `sleep_ms` makes that execution slow; a held path
/// keeps its executions waiting (so a test can kill the server while a tool runs) until
/// released. It answers `{ok, path, idempotencyKey, echo}` unless told otherwise.
#[derive(Clone)]
pub struct RecordingTools {
    pub url: String,
    state: Arc<RecordingState>,
}

impl RecordingTools {
    pub async fn start() -> Self {
        let (released, _) = tokio::sync::watch::channel(0);
        let state = Arc::new(RecordingState {
            executions: Default::default(),
            held: Default::default(),
            released,
            answers: Default::default(),
        });
        let app = axum::Router::new()
            .route("/{*path}", axum::routing::any(record_execution))
            .with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, state }
    }

    pub fn executions(&self) -> Vec<Execution> {
        self.state.executions.lock().unwrap().clone()
    }

    /// The executions that reached `path`.
    pub fn at(&self, path: &str) -> Vec<Execution> {
        self.executions()
            .into_iter()
            .filter(|e| e.path == path)
            .collect()
    }

    /// Executions of `path` wait from now on until [`Self::release`].
    pub fn hold(&self, path: &str) {
        self.state.held.lock().unwrap().insert(path.to_owned());
    }

    pub fn release(&self, path: &str) {
        self.state.held.lock().unwrap().remove(path);
        self.state
            .released
            .send_modify(|generation| *generation += 1);
    }

    /// Executions of `path` are answered with `body`.
    pub fn answer(&self, path: &str, body: Value) {
        self.state
            .answers
            .lock()
            .unwrap()
            .insert(path.to_owned(), body);
    }

    /// Polls until `path` received `count` executions (bounded); returns them.
    pub async fn wait_for(&self, path: &str, count: usize) -> Vec<Execution> {
        for _ in 0..1200 {
            let executions = self.at(path);
            if executions.len() >= count {
                return executions;
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        panic!("{path} never received {count} execution(s)");
    }
}

async fn record_execution(
    axum::extract::State(state): axum::extract::State<Arc<RecordingState>>,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::Json<Value> {
    let path = uri.path().to_owned();
    let body: Value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    let idempotency_key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let headers = headers
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect();
    state.executions.lock().unwrap().push(Execution {
        path: path.clone(),
        idempotency_key: idempotency_key.clone(),
        headers,
        body: body.clone(),
        at: chrono::Utc::now(),
    });
    loop {
        // Subscribed before looking, so a release in between is not missed.
        let mut changed = state.released.subscribe();
        if !state.held.lock().unwrap().contains(&path) {
            break;
        }
        let _ = changed.changed().await;
    }
    if let Some(ms) = body.get("sleep_ms").and_then(Value::as_u64) {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    if let Some(answer) = state.answers.lock().unwrap().get(&path) {
        return axum::Json(answer.clone());
    }
    axum::Json(
        serde_json::json!({ "ok": true, "path": path, "idempotencyKey": idempotency_key, "echo": body }),
    )
}

/// Approves every pending approval at `base` (one page); how many it approved. Errors (a
/// server being killed) count as nothing approved.
pub async fn approve_pending(http: &reqwest::Client, base: &str) -> usize {
    let Ok(response) = http
        .get(format!("{base}/admin/approvals?status=pending&limit=200"))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
    else {
        return 0;
    };
    let Ok(page) = response.json::<Value>().await else {
        return 0;
    };
    let mut approved = 0;
    for approval in page["data"].as_array().cloned().unwrap_or_default() {
        let Some(id) = approval["id"].as_str() else {
            continue;
        };
        let decided = http
            .post(format!("{base}/admin/approvals/{id}/approve"))
            .bearer_auth(ADMIN_KEY)
            .json(&serde_json::json!({ "reason": "operator loop" }))
            .send()
            .await;
        if decided.is_ok_and(|r| r.status().is_success()) {
            approved += 1;
        }
    }
    approved
}

/// Every stored event of a request, page after page, with the client key.
pub async fn all_events(http: &reqwest::Client, base: &str, request_id: &str) -> Vec<Value> {
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let (status, page) = get_json(
            http,
            &format!("{base}/runtime/requests/{request_id}/events?after={after}&limit=1000"),
            CLIENT_KEY,
        )
        .await;
        assert_eq!(status, 200, "{page}");
        let data = page["data"].as_array().cloned().unwrap_or_default();
        if data.is_empty() {
            return events;
        }
        after = page["nextAfter"].as_i64().unwrap();
        events.extend(data);
    }
}
