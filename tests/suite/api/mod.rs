//! HTTP API tests: the real application on a random port, a real loopback upstream, and
//! clients speaking HTTP (async-openai where OpenAI's SDK fits, reqwest elsewhere).

pub mod upstream;

mod admin;
mod durability;
mod errors;
mod mcp;
mod recovery;
mod runtime_api;
pub mod tools;
mod v1;

use std::sync::Arc;

use serde_json::Value;
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
        stable_harness::app::install_crypto_provider();
        let compiled = stable_harness::workspace::load(workspace.path())
            .unwrap_or_else(|d| panic!("invalid test workspace:\n{d}"));
        let app = Application::build(ServerConfig {
            workspace: Arc::new(compiled),
            host: "127.0.0.1".into(),
            port: 0,
            database_url: None,
            api_keys: client.iter().map(|k| (*k).into()).collect(),
            admin_keys: admin.iter().map(|k| (*k).into()).collect(),
            insecure_open_surfaces: false,
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
        let response = self
            .http
            .post(self.url(path))
            .bearer_auth(key)
            .json(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
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
        let request_id = response.headers()["x-stable-harness-request-id"]
            .to_str()
            .unwrap()
            .to_owned();
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

/// `GET url` with a bearer key: the status and the JSON body (`null` if there is none).
pub async fn get_json(http: &reqwest::Client, url: &str, key: &str) -> (u16, Value) {
    let response = http.get(url).bearer_auth(key).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
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

/// Asserts that events are numbered 1, 2, 3, ... with no gap.
pub fn assert_gapless(events: &[Value]) {
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=events.len() as i64).collect::<Vec<_>>(),
        "events are not gapless"
    );
}
