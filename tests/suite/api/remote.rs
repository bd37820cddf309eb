//! The `http` backend with the reference agent service (`examples/billing-agent/agent.py`)
//! on loopback: streamed output, tool callbacks allowed, denied and approved, the run-scoped
//! token, retries, a crash mid-run; and hostile services that hang, break the protocol or
//! flood.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use super::control::poll;
use super::tools::{ToolServer, tools_workspace};
use super::trust::{data_of, submit};
use super::upstream::MockUpstream;
use super::{CLIENT_KEY, ServerProcess, TestApp, approve_pending, get_json, types};
use crate::helpers::TestWorkspace;

/// A variable every test process has, standing for the service's key (tests cannot set one).
const KEY_ENV: &str = "CARGO_MANIFEST_DIR";

/// The reference agent service, killed on drop.
struct ReferenceAgent {
    url: String,
    child: Child,
}

impl ReferenceAgent {
    fn start() -> Self {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/billing-agent/agent.py"
        );
        let mut child = Command::new("python3")
            .args([script, "--port", "0", "--key-env", KEY_ENV])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 runs the reference agent service");
        let (line, url) = super::announced_address(&mut child);
        let url = url.unwrap_or_else(|| panic!("the reference agent did not start: {line}"));
        Self { url, child }
    }

    async fn last_callback(&self) -> Value {
        reqwest::get(format!("{}/last", self.url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

impl Drop for ReferenceAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tools workspace (`weather.lookup` allowed, `payments.refund` needs approval,
/// `files.delete` denied) plus the agent `billing` served by `agent_url`.
fn billing_workspace(
    upstream: &MockUpstream,
    tools: &ToolServer,
    agent_url: &str,
    runtime_extra: &str,
) -> TestWorkspace {
    let workspace = tools_workspace(upstream, tools, runtime_extra);
    workspace.write(
        "config/agents/billing.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: {{ name: billing }}\nspec:\n  backend: http\n  endpoint: {{ url: \"{agent_url}\", apiKeyEnv: {KEY_ENV}, timeout: 5s }}\n  tools: [weather.lookup, payments.refund, files.delete]\n"
        ),
    );
    workspace
}

/// The reference agent, and the app serving `billing` in front of it.
async fn billing_app(runtime_extra: &str) -> (ReferenceAgent, MockUpstream, ToolServer, TestApp) {
    let agent = ReferenceAgent::start();
    let (upstream, tools) = (MockUpstream::start().await, ToolServer::start().await);
    let workspace = billing_workspace(
        &upstream,
        &tools,
        &format!("{}/run", agent.url),
        runtime_extra,
    );
    let app = TestApp::spawn(workspace).await;
    (agent, upstream, tools, app)
}

/// A tool callback with `token` (if any): its status.
async fn call_back(app: &TestApp, url: &str, token: Option<&str>, arguments: Value) -> u16 {
    let mut request = app.http.post(format!("{url}/tools/weather.lookup"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request
        .json(&json!({ "arguments": arguments }))
        .send()
        .await
        .unwrap();
    response.status().as_u16()
}

fn output_of(view: &Value) -> String {
    view["output"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_output_reaches_v1_and_callbacks_are_governed() {
    let (_agent, _upstream, tools, app) = billing_app("").await;
    let calls = json!([
        { "tool": "weather.lookup", "arguments": { "city": "Oslo" } },
        { "tool": "files.delete", "arguments": {} },
        { "tool": "not.mine", "arguments": {} },
    ]);
    let (response, request_id) = app
        .chat(
            &json!({ "model": "billing", "stream": true, "metadata": { "callTools": calls },
            "messages": [{ "role": "user", "content": "Why was I charged twice?" }] }),
        )
        .await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let streamed = super::streamed_content(&text);
    assert!(streamed.contains("Billing desk"), "{text}");
    assert!(
        streamed.contains("Oslo"),
        "the allowed call's result: {streamed}"
    );
    assert!(streamed.contains("files.delete denied"), "{streamed}");
    assert!(streamed.contains("not.mine denied"), "{streamed}");
    assert_eq!(tools.count("/weather"), 1);
    assert_eq!(tools.count("/delete"), 0, "a denied callback never runs");
    let events = app.events(&request_id).await;
    let kinds = types(&events);
    assert!(
        kinds.contains(&"runtime.tool.direct.completed".to_owned()),
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| *k == "runtime.tool.denied").count(),
        2,
        "{kinds:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["data"]["event"]["phase"] == "agent.progress"),
        "the service's progress is an adapter event"
    );
    // What the service reported is charged to the budgets, as the agent's own model.
    let usage = data_of(&events, "runtime.usage.recorded");
    assert_eq!(usage.len(), 1, "{events:?}");
    assert_eq!(usage[0]["model"], "agent:billing");
    assert_eq!(usage[0]["source"], "agent");
    assert_eq!(usage[0]["promptTokens"], 5, "the question's words");
    assert_eq!(usage[0]["estimated"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_waits_for_an_operator_and_the_token_dies_with_the_run() {
    let extra = "  protocols:\n    openai:\n      approvalWait: 1s\n";
    let (agent, _upstream, tools, app) = billing_app(extra).await;
    let (status, accepted) = submit(
        &app.http,
        &app.base,
        &json!({ "agentId": "billing", "input": { "text": "refund me" },
            "metadata": { "callTools": [{ "tool": "payments.refund", "arguments": { "amount": 5 } }] } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    let approval = app.pending_approval().await;
    assert_eq!(approval["toolId"], "payments.refund");
    // The callback answered 202 after approvalWait; the service polls the call meanwhile.
    let callback = agent.last_callback().await;
    let (url, token) = (
        callback["url"].as_str().unwrap().to_owned(),
        callback["token"].as_str().unwrap().to_owned(),
    );
    let call_url = format!("{url}/calls/{}", approval["callKey"].as_str().unwrap());
    let (status, pending) = get_json(&app.http, &call_url, &token).await;
    assert_eq!(
        (status, &pending["approvalId"]),
        (202, &approval["id"]),
        "{pending}"
    );
    // The token opens only its run's callbacks: not the runtime API, not another run.
    let (status, _) = get_json(
        &app.http,
        &app.url(&format!("/runtime/requests/{request_id}")),
        &token,
    )
    .await;
    assert_eq!(status, 401);
    let other = url.replace(callback["runId"].as_str().unwrap(), "run_other");
    let (status, _) = get_json(&app.http, &format!("{other}/calls/x"), &token).await;
    assert_eq!(status, 401);
    assert_eq!(
        tools.count("/refund"),
        0,
        "nothing runs before the decision"
    );

    assert_eq!(approve_pending(&app.http, &app.base).await, 1);
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert!(output_of(&view).contains("payments.refund: {"), "{view}");
    assert_eq!(tools.count("/refund"), 1);

    // Replayed after the run ended: refused.
    let replayed = call_back(&app, &url, Some(&token), json!({ "city": "Paris" })).await;
    assert_eq!(replayed, 401);
    assert_eq!(call_back(&app, &url, None, json!({})).await, 401);
    assert_eq!(tools.count("/weather"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_the_run_revokes_its_token() {
    let (agent, _upstream, tools, app) = billing_app("").await;
    let (status, accepted) = submit(
        &app.http,
        &app.base,
        &json!({ "agentId": "billing", "input": { "text": "slowly" },
            "metadata": { "pauseSeconds": 30, "callTools": [{ "tool": "weather.lookup", "arguments": { "city": "Bern" } }] } }),
    )
    .await;
    assert_eq!(status, 202);
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    poll("the callback", async || {
        (tools.count("/weather") == 1).then_some(())
    })
    .await;
    let callback = agent.last_callback().await;
    let (status, _) = app
        .post(
            &format!("/runtime/requests/{request_id}/cancel"),
            CLIENT_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(status, 200);
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "cancelled", "{view}");
    let url = callback["url"].as_str().unwrap();
    let replayed = call_back(
        &app,
        url,
        callback["token"].as_str(),
        json!({ "city": "Bern" }),
    )
    .await;
    assert_eq!(replayed, 401);
    assert_eq!(tools.count("/weather"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_is_retried_per_recovery() {
    let (_agent, _upstream, _tools, app) = billing_app("").await;
    let (status, accepted) = submit(
        &app.http,
        &app.base,
        &json!({ "agentId": "billing", "input": { "text": "hello" }, "metadata": { "fail503": 1, "callTools": [] } }),
    )
    .await;
    assert_eq!(status, 202);
    let request_id = accepted["requestId"].as_str().unwrap();
    let view = app.wait_until_done(request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    let kinds = types(&app.events(request_id).await);
    assert!(
        kinds.contains(&"runtime.retry.scheduled".to_owned()),
        "{kinds:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_run_the_run_resumes_and_no_callback_runs_twice() {
    let agent = ReferenceAgent::start();
    let (upstream, tools) = (MockUpstream::start().await, ToolServer::start().await);
    let workspace = billing_workspace(&upstream, &tools, &format!("{}/run", agent.url), "");
    let first = ServerProcess::start(workspace.path(), &[]);
    let http = reqwest::Client::new();
    let (status, accepted) = submit(
        &http,
        &first.base,
        &json!({ "agentId": "billing", "input": { "text": "what is due?" },
            "metadata": { "pauseSeconds": 2, "callTools": [{ "tool": "weather.lookup", "arguments": { "city": "Rome" } }] } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    let events_url = first.url(&format!("/runtime/requests/{request_id}/events"));
    poll("the callback's recorded result", async || {
        let (_, page) = get_json(&http, &events_url, CLIENT_KEY).await;
        page["data"]
            .as_array()?
            .iter()
            .any(|e| e["type"] == "runtime.tool.direct.completed")
            .then_some(())
    })
    .await;
    first.kill9();

    let second = ServerProcess::start(workspace.path(), &[]);
    let view = super::wait_until_done_at(&http, &second.base, &request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert!(output_of(&view).contains("Rome"), "{view}");
    assert_eq!(
        tools.count("/weather"),
        1,
        "the resumed run got the recorded result"
    );
}

/// A service that breaks the protocol in the way its path names.
async fn hostile_service() -> String {
    use axum::response::IntoResponse;
    async fn answer(
        axum::extract::Path(how): axum::extract::Path<String>,
    ) -> axum::response::Response {
        let sse = |body: axum::body::Body| {
            (
                [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
                body,
            )
                .into_response()
        };
        match how.as_str() {
            "hang" => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                sse(axum::body::Body::empty())
            }
            "garbage" => sse("data: this is not json\n\n".into()),
            "fail" => sse("data: {\"type\":\"error\",\"code\":\"ledger_down\",\"message\":\"the ledger is down\"}\n\n".into()),
            "cut" => sse("data: {\"type\":\"delta\",\"text\":\"half \"}\n\n".into()),
            "flood" => {
                // 50 MB in one event that never ends.
                let chunk = axum::body::Bytes::from(vec![b'x'; 1 << 20]);
                let parts = std::iter::once(axum::body::Bytes::from_static(b"data: "))
                    .chain((0..50).map(move |_| chunk.clone()))
                    .map(Ok::<_, std::io::Error>);
                sse(axum::body::Body::from_stream(futures::stream::iter(parts)))
            }
            _ => (axum::http::StatusCode::NOT_FOUND, "").into_response(),
        }
    }
    // Calls a tool back before it answers at all, then answers with one JSON object.
    async fn json_after_callback(axum::Json(run): axum::Json<Value>) -> axum::Json<Value> {
        let callback = &run["callback"];
        let answer: Value = reqwest::Client::new()
            .post(format!(
                "{}/tools/weather.lookup",
                callback["url"].as_str().unwrap()
            ))
            .bearer_auth(callback["token"].as_str().unwrap())
            .json(&json!({ "arguments": { "city": "Lima" } }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        axum::Json(
            json!({ "output": format!("{}: {}", answer["status"], answer["result"]["echo"]["city"]) }),
        )
    }
    let app = axum::Router::new()
        .route("/json-callback", axum::routing::post(json_after_callback))
        .route("/{how}", axum::routing::post(answer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_service_fails_the_run_clearly_and_never_the_server() {
    let service = hostile_service().await;
    let (upstream, tools) = (MockUpstream::start().await, ToolServer::start().await);
    let workspace = tools_workspace(&upstream, &tools, "");
    for how in ["hang", "garbage", "fail", "cut", "flood", "json-callback"] {
        workspace.write(
            &format!("config/agents/{how}.yaml"),
            format!("apiVersion: stable-harness/v1\nkind: Agent\nmetadata: {{ name: {how} }}\nspec:\n  backend: http\n  endpoint: {{ url: \"{service}/{how}\", timeout: 1s }}\n  tools: [weather.lookup]\n"),
        );
    }
    let app = TestApp::spawn(workspace).await;
    for (how, kind) in [
        ("garbage", "malformed"),
        ("fail", "upstream_rejected"),
        ("cut", "connection"),
        ("flood", "malformed"),
        ("hang", "timeout"),
    ] {
        let (status, accepted) = submit(
            &app.http,
            &app.base,
            &json!({ "agentId": how, "input": { "text": "hi" } }),
        )
        .await;
        assert_eq!(status, 202, "{how}: {accepted}");
        let view = app
            .wait_until_done(accepted["requestId"].as_str().unwrap())
            .await;
        assert_eq!(view["status"], "failed", "{how}: {view}");
        assert_eq!(view["error"]["kind"], kind, "{how}: {view}");
    }
    let (status, _) = app.get("/readyz", CLIENT_KEY).await;
    assert_eq!(status, 200);

    // A service that calls back before answering is served meanwhile.
    let (status, accepted) = submit(
        &app.http,
        &app.base,
        &json!({ "agentId": "json-callback", "input": { "text": "hi" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let view = app
        .wait_until_done(accepted["requestId"].as_str().unwrap())
        .await;
    assert_eq!(output_of(&view), "\"completed\": \"Lima\"", "{view}");
    assert_eq!(tools.count("/weather"), 1);
}
