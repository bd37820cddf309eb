//! The tool gateway end to end: the loopback upstream is scripted to call tools, the tools are
//! real (an HTTP service that counts its calls, programs under the workspace, an MCP server),
//! and operators decide approvals through the admin API while OpenAI clients wait.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs,
};
use axum::Json;
use axum::extract::State;
use axum::routing::post;
use serde_json::{Value, json};

use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace, types};
use crate::helpers::TestWorkspace;

/// Every call a [`ToolServer`] received: (path, JSON body).
type CallLog = Arc<Mutex<Vec<(String, Value)>>>;

/// A tool service on loopback that records every call it receives, by path.
#[derive(Clone, Default)]
pub struct ToolServer {
    pub url: String,
    calls: CallLog,
}

impl ToolServer {
    pub async fn start() -> Self {
        let calls: CallLog = Arc::default();
        async fn record(
            State(calls): State<CallLog>,
            uri: axum::http::Uri,
            Json(body): Json<Value>,
        ) -> Json<Value> {
            calls
                .lock()
                .unwrap()
                .push((uri.path().to_owned(), body.clone()));
            Json(json!({ "ok": true, "path": uri.path(), "echo": body }))
        }
        let app = axum::Router::new()
            .route("/{*path}", post(record))
            .with_state(Arc::clone(&calls));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, calls }
    }

    /// How many calls reached `path`.
    pub fn count(&self, path: &str) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == path)
            .count()
    }
}

/// The API workspace plus tools served by `tools`: `weather.lookup` (low risk, allowed),
/// `payments.refund` (high risk: needs approval), `files.delete` (denied by rule), and the
/// agent `clerk` that may call all three. `runtime_extra` goes into the Runtime spec.
pub fn tools_workspace(
    upstream: &MockUpstream,
    tools: &ToolServer,
    runtime_extra: &str,
) -> TestWorkspace {
    let governance = "  governance:\n    default: allow\n    rules:\n      - { name: no-deletes, match: { tools: [\"files.*\"] }, decision: deny, reason: deleting files is never allowed }\n      - { name: high-risk-needs-human, match: { risk: [high] }, decision: needs_approval }\n      - { name: vip-tier, match: { metadata: { tier: vip } }, decision: deny }\n";
    let workspace = api_workspace(upstream, &format!("{governance}{runtime_extra}"));
    workspace.write(
        "config/catalogs/tools.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: {{ name: tools }}\nspec:\n  tools:\n    - id: weather.lookup\n      description: Current weather for a city.\n      inputSchema: {{ type: object, properties: {{ city: {{ type: string }} }}, required: [city], additionalProperties: false }}\n      risk: low\n      http: {{ method: POST, url: \"{url}/weather\" }}\n    - id: payments.refund\n      inputSchema: {{ type: object, properties: {{ amount: {{ type: number }} }}, required: [amount] }}\n      risk: high\n      http: {{ method: POST, url: \"{url}/refund\" }}\n    - id: files.delete\n      risk: medium\n      http: {{ method: POST, url: \"{url}/delete\" }}\n",
            url = tools.url
        ),
    );
    workspace.write(
        "config/agents/clerk.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: clerk }\nspec:\n  backend: openai\n  model: main\n  tools: [weather.lookup, payments.refund, files.delete]\n  maxIterations: 3\n",
    );
    workspace
}

/// The function names offered to the model in the `index`th upstream call.
pub(super) fn offered_functions(upstream: &MockUpstream, index: usize) -> Vec<String> {
    upstream.calls()[index].body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
        .collect()
}

/// The tool messages of the `index`th upstream call.
fn tool_messages(upstream: &MockUpstream, index: usize) -> Vec<Value> {
    upstream.calls()[index].body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .cloned()
        .collect()
}

fn tool_result(message: &Value) -> Value {
    serde_json::from_str(message["content"].as_str().unwrap()).unwrap()
}

#[tokio::test]
async fn an_allowed_call_runs_once_and_its_result_goes_back_to_the_model() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::call("weather_lookup", r#"{"city":"Paris"}"#),
        Reply::Text("It is sunny in Paris".into()),
    ]);
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;

    let request = CreateChatCompletionRequestArgs::default()
        .model("clerk")
        .messages([ChatCompletionRequestUserMessageArgs::default()
            .content("weather in Paris?")
            .build()
            .unwrap()
            .into()])
        .build()
        .unwrap();
    let response = app.openai().chat().create(request).await.unwrap();
    assert_eq!(
        response.choices[0].message.content.as_deref(),
        Some("It is sunny in Paris")
    );
    assert_eq!(tools.count("/weather"), 1);

    // The model was offered the agent's tools under OpenAI-safe names, and got the result.
    assert_eq!(
        offered_functions(&upstream, 0),
        ["weather_lookup", "payments_refund", "files_delete"]
    );
    let results = tool_messages(&upstream, 1);
    assert_eq!(results.len(), 1);
    assert_eq!(tool_result(&results[0])["echo"], json!({ "city": "Paris" }));

    let request_id = response.id.trim_start_matches("chatcmpl-").to_owned();
    let events = app.events(&request_id).await;
    super::assert_gapless(&events);
    let kinds = types(&events);
    for expected in [
        "runtime.tool.direct.started",
        "runtime.tool.direct.completed",
    ] {
        assert_eq!(
            kinds.iter().filter(|k| *k == expected).count(),
            1,
            "{kinds:?}"
        );
    }
    let phases: Vec<&str> = events
        .iter()
        .filter_map(|e| e["data"]["event"]["phase"].as_str())
        .filter(|p| p.starts_with("agent.tool"))
        .collect();
    assert_eq!(phases, ["agent.tool.start", "agent.tool.result"]);
}

#[tokio::test]
async fn a_denied_call_never_reaches_the_tool_and_the_model_learns_why() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::call("files_delete", "{}"),
        Reply::Text("I may not delete files".into()),
    ]);
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;
    let (response, request_id) = app
        .chat(
            &json!({ "model": "clerk", "messages": [{ "role": "user", "content": "delete it" }] }),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(tools.count("/delete"), 0);
    let result = tool_result(&tool_messages(&upstream, 1)[0]);
    assert_eq!(result["error"]["code"], "denied");
    assert_eq!(result["error"]["rule"], "no-deletes");
    assert_eq!(
        result["error"]["message"],
        "deleting files is never allowed"
    );
    let events = app.events(&request_id).await;
    let denied = events
        .iter()
        .find(|e| e["type"] == "runtime.tool.denied")
        .expect("a denial event");
    assert_eq!(denied["data"]["rule"], "no-deletes");
    assert!(!types(&events).contains(&"runtime.tool.direct.started".to_owned()));
}

#[tokio::test]
async fn bad_calls_come_back_to_the_model_as_typed_errors_and_the_run_goes_on() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::ToolCalls(vec![
            ("shell_exec".into(), r#"{"cmd":"rm -rf /"}"#.into()),
            ("weather_lookup".into(), "{not json".into()),
            (
                "weather_lookup".into(),
                r#"{"city":42,"extra":true}"#.into(),
            ),
        ]),
        Reply::Text("sorry".into()),
    ]);
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;
    let (response, request_id) = app
        .chat(&json!({ "model": "clerk", "stream": true, "messages": [{ "role": "user", "content": "go" }] }))
        .await;
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    assert!(
        body.contains("sorry") && body.trim_end().ends_with("data: [DONE]"),
        "{body}"
    );
    assert_eq!(tools.count("/weather"), 0);

    let results: Vec<Value> = tool_messages(&upstream, 1)
        .iter()
        .map(tool_result)
        .collect();
    let codes: Vec<&str> = results
        .iter()
        .map(|r| r["error"]["code"].as_str().unwrap())
        .collect();
    assert_eq!(
        codes,
        ["tool_not_allowed", "invalid_arguments", "invalid_arguments"]
    );
    assert!(
        results[1]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    let schema_errors = results[2]["error"]["errors"].as_array().unwrap();
    assert_eq!(schema_errors.len(), 2, "{schema_errors:?}");
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "completed");
}

/// A tool turn's checkpoints commit with the writes around them, not each alone: the model's
/// turn with the call's `started` record (which the journal refuses if the turn was lost,
/// so the tool never runs before the turn is stored), the transcript with the results with
/// the run's next commit. Counted in the binary's own metrics, one request at a time: a
/// request with one tool call commits at most three times more than a plain one (the
/// `started` record, the result, and the results' checkpoint alone if its hold ends before
/// the run does), where the two checkpoints were two more commits of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_turns_checkpoints_commit_with_the_writes_around_them() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.set_responder(super::upstream::Responder::new(|body| {
        let last = &body["messages"].as_array().unwrap().last().unwrap().clone();
        if last["role"] == "tool" {
            Reply::Text("sunny".into())
        } else if last["content"] == "weather?" {
            Reply::call("weather_lookup", r#"{"city":"Paris"}"#)
        } else {
            Reply::Text("hello".into())
        }
    }));
    let workspace = tools_workspace(&upstream, &tools, "");
    let server = super::ServerProcess::start(
        workspace.path(),
        &[("STABLE_HARNESS_TEST_UPSTREAM_KEY", "test-upstream-key")],
    );
    let http = reqwest::Client::new();
    // The commits of one request: counted once everything it held has committed too.
    let commits_of = async |asked: &str| {
        let count = async || {
            let text = super::metrics_text(&http, &server.url("/metrics")).await;
            super::metric_sample(
                &text,
                "stable_harness_journal_commit_duration_seconds_count",
            )
        };
        let before = count().await;
        let (status, body) = super::post_json(
            &http,
            &server.url("/v1/chat/completions"),
            CLIENT_KEY,
            &json!({ "model": "clerk", "messages": [{ "role": "user", "content": asked }] }),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        count().await - before
    };
    commits_of("hi").await;
    let plain = commits_of("hi").await;
    let mut with_a_tool = Vec::new();
    for _ in 0..3 {
        with_a_tool.push(commits_of("weather?").await);
    }
    assert_eq!(tools.count("/weather"), 3, "each call ran once");
    let fewest = with_a_tool.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(
        plain >= 1.0 && fewest - plain <= 3.0,
        "a plain request committed {plain} times, one with a tool call {with_a_tool:?}"
    );
}

#[tokio::test]
async fn an_operator_approves_while_the_openai_client_waits() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":12.5}"#),
        Reply::Text("Refunded".into()),
    ]);
    let app = Arc::new(TestApp::spawn(tools_workspace(&upstream, &tools, "")).await);
    let client = Arc::clone(&app);
    let waiting = tokio::spawn(async move {
        let (response, request_id) = client
            .chat(&json!({ "model": "clerk", "messages": [{ "role": "user", "content": "refund me" }] }))
            .await;
        (
            response.status().as_u16(),
            response.json::<Value>().await.unwrap(),
            request_id,
        )
    });

    let approval = app.pending_approval().await;
    assert_eq!(approval["toolId"], "payments.refund");
    assert_eq!(approval["rule"], "high-risk-needs-human");
    assert_eq!(approval["arguments"], json!({ "amount": 12.5 }));
    assert_eq!(
        tools.count("/refund"),
        0,
        "nothing runs before the decision"
    );
    let request_id = approval["requestId"].as_str().unwrap();
    let (_, view) = app
        .get(&format!("/runtime/requests/{request_id}"), CLIENT_KEY)
        .await;
    assert_eq!(view["status"], "waiting_approval");

    let id = approval["id"].as_str().unwrap();
    let path = format!("/admin/approvals/{id}/approve");
    let (status, body) = app.post(&path, CLIENT_KEY, &json!({})).await;
    assert_eq!(status, 403, "{body}");
    let (status, decided) = app
        .post(&path, ADMIN_KEY, &json!({ "reason": "customer verified" }))
        .await;
    assert_eq!(status, 200, "{decided}");
    assert_eq!(decided["status"], "approved");
    // The operator is named by their key's stable identity (a fingerprint), never the key.
    assert_eq!(
        decided["decidedBy"],
        stable_harness::http::fingerprint(ADMIN_KEY)
    );

    let (status, completion, request_id) = waiting.await.unwrap();
    assert_eq!(status, 200, "{completion}");
    assert_eq!(completion["choices"][0]["message"]["content"], "Refunded");
    assert_eq!(tools.count("/refund"), 1);

    // Deciding again is a conflict; an unknown approval is 404.
    let (status, again) = app
        .post(
            &format!("/admin/approvals/{id}/deny"),
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(
        (status, again["error"]["code"].as_str()),
        (409, Some("approval_already_decided"))
    );
    let (status, missing) = app
        .post(
            "/admin/approvals/apr_missing/approve",
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(
        (status, missing["error"]["code"].as_str()),
        (404, Some("approval_not_found"))
    );
    let (status, one) = app.get(&format!("/admin/approvals/{id}"), ADMIN_KEY).await;
    assert_eq!(
        (status, one["reason"].as_str()),
        (200, Some("customer verified"))
    );

    let events = app.events(&request_id).await;
    let resolved = events
        .iter()
        .find(|e| e["type"] == "runtime.approval.resolved")
        .unwrap();
    assert_eq!(resolved["data"]["decision"], "approved");
    assert_eq!(
        resolved["data"]["decidedBy"],
        stable_harness::http::fingerprint(ADMIN_KEY)
    );
}

#[tokio::test]
async fn a_denied_approval_gives_the_model_the_reason_and_the_tool_never_runs() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":999}"#),
        Reply::Text("The refund was refused".into()),
    ]);
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;
    let accepted = app.submit("clerk", "refund").await;
    let approval = app.pending_approval().await;
    let id = approval["id"].as_str().unwrap();
    let (status, _) = app
        .post(
            &format!("/admin/approvals/{id}/deny"),
            ADMIN_KEY,
            &json!({ "reason": "too large" }),
        )
        .await;
    assert_eq!(status, 200);
    let view = app
        .wait_until_done(accepted["requestId"].as_str().unwrap())
        .await;
    assert_eq!(view["status"], "completed");
    assert_eq!(tools.count("/refund"), 0);
    let result = tool_result(&tool_messages(&upstream, 1)[0]);
    assert_eq!(result["error"]["code"], "approval_denied");
    assert!(
        result["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too large")
    );
}

#[tokio::test]
async fn parallel_calls_go_on_while_one_of_them_waits_for_approval() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::ToolCalls(vec![
            ("payments_refund".into(), r#"{"amount":5}"#.into()),
            ("weather_lookup".into(), r#"{"city":"Oslo"}"#.into()),
        ]),
        Reply::Text("done".into()),
    ]);
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;
    let (_, accepted) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "clerk", "input": { "text": "both" } }),
        )
        .await;
    let approval = app.pending_approval().await;
    // The allowed call of the same batch ran while the other one waits.
    for _ in 0..200 {
        if tools.count("/weather") == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(tools.count("/weather"), 1);
    assert_eq!(tools.count("/refund"), 0);
    let id = approval["id"].as_str().unwrap();
    app.post(
        &format!("/admin/approvals/{id}/approve"),
        ADMIN_KEY,
        &json!({}),
    )
    .await;
    let view = app
        .wait_until_done(accepted["requestId"].as_str().unwrap())
        .await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(tools.count("/refund"), 1);
    let results: Vec<Value> = tool_messages(&upstream, 1)
        .iter()
        .map(tool_result)
        .collect();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0]["path"], "/refund");
    assert_eq!(results[1]["path"], "/weather");
}

#[tokio::test]
async fn v1_answers_409_approval_pending_after_approval_wait_and_the_run_continues() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":1}"#),
        Reply::Text("late but done".into()),
        Reply::call("payments_refund", r#"{"amount":2}"#),
    ]);
    let openai = "  protocols:\n    openai:\n      approvalWait: 1s\n";
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, openai)).await;
    let (response, request_id) = app
        .chat(&json!({ "model": "clerk", "messages": [{ "role": "user", "content": "refund" }] }))
        .await;
    assert_eq!(response.status(), 409);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "approval_pending");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&request_id)
    );

    let approval = app.pending_approval().await;
    let id = approval["id"].as_str().unwrap();
    app.post(
        &format!("/admin/approvals/{id}/approve"),
        ADMIN_KEY,
        &json!({}),
    )
    .await;
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["output"], "late but done");

    // Streaming: keep-alive comments while waiting, then an error event, then the end.
    upstream.push([Reply::Text("unused".into())]);
    let (response, _) = app
        .chat(&json!({ "model": "clerk", "stream": true, "messages": [{ "role": "user", "content": "again" }] }))
        .await;
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    assert!(
        body.contains(": "),
        "keep-alive comments while pending: {body}"
    );
    assert!(body.contains("approval_pending"), "{body}");
    assert!(!body.contains("[DONE]"));
}

#[tokio::test]
async fn policy_explain_and_a_policy_that_cannot_evaluate_fails_closed() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::call("weather_lookup", r#"{"city":"Rome"}"#),
        Reply::Text("ok".into()),
    ]);
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;
    let explain = |tool: &str, metadata: Value| json!({ "agentId": "clerk", "toolId": tool, "arguments": { "amount": 3 }, "metadata": metadata });
    let (status, verdict) = app
        .post(
            "/admin/policy/explain",
            ADMIN_KEY,
            &explain("payments.refund", json!({})),
        )
        .await;
    assert_eq!(status, 200, "{verdict}");
    assert_eq!(verdict["decision"], "needs_approval");
    assert_eq!(verdict["rule"], "high-risk-needs-human");
    let (_, verdict) = app
        .post(
            "/admin/policy/explain",
            ADMIN_KEY,
            &explain("weather.lookup", json!({ "tier": "vip" })),
        )
        .await;
    assert_eq!(
        (verdict["decision"].as_str(), verdict["rule"].as_str()),
        (Some("deny"), Some("vip-tier"))
    );
    assert_eq!(verdict["argumentErrors"].as_array().unwrap().len(), 2);
    let (_, verdict) = app
        .post(
            "/admin/policy/explain",
            ADMIN_KEY,
            &explain("weather.lookup", json!({ "tier": ["vip"] })),
        )
        .await;
    assert_eq!(
        (verdict["decision"].as_str(), verdict["rule"].as_str()),
        (Some("deny"), Some("policy_error"))
    );
    let (status, error) = app
        .post(
            "/admin/policy/explain",
            ADMIN_KEY,
            &explain("nope.tool", json!({})),
        )
        .await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (404, Some("tool_not_found"))
    );
    let (status, _) = app
        .post(
            "/admin/policy/explain",
            CLIENT_KEY,
            &explain("weather.lookup", json!({})),
        )
        .await;
    assert_eq!(status, 403);

    // A run whose metadata the policy cannot read is denied, not allowed.
    let (_, accepted) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "clerk", "input": { "text": "weather" }, "metadata": { "tier": { "level": 1 } }, "wait": true }),
        )
        .await;
    assert_eq!(accepted["status"], "completed", "{accepted}");
    assert_eq!(tools.count("/weather"), 0);
    let result = tool_result(&tool_messages(&upstream, 1)[0]);
    assert_eq!(result["error"]["rule"], "policy_error");
}

#[tokio::test]
async fn a_model_that_never_stops_calling_tools_fails_at_max_iterations() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.set_default(Reply::call("weather_lookup", r#"{"city":"Lima"}"#));
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;
    let (_, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "clerk", "input": { "text": "loop" }, "wait": true }),
        )
        .await;
    assert_eq!(view["status"], "failed", "{view}");
    assert_eq!(view["error"]["kind"], "max_iterations");
    assert_eq!(tools.count("/weather"), 3, "maxIterations: 3 round trips");
    assert_eq!(upstream.calls().len(), 4);
}

#[tokio::test]
async fn command_tools_run_without_a_shell_and_every_fault_is_a_typed_result() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let workspace = tools_workspace(&upstream, &tools, "");
    let scripts = [
        (
            "echo",
            "#!/bin/sh\nread -r input\necho \"{\\\"input\\\": $input, \\\"leaked\\\": \\\"${HOME:-unset}\\\", \\\"cwd\\\": \\\"$(pwd)\\\"}\"\n",
        ),
        ("hang", "#!/bin/sh\nsleep 30 &\nsleep 30\n"),
        ("crash", "#!/bin/sh\necho 'something broke' >&2\nexit 3\n"),
        ("garbage", "#!/bin/sh\necho 'this is not json'\n"),
        ("flood", "#!/bin/sh\nhead -c 52428800 /dev/zero\n"),
    ];
    let mut catalog = String::from(
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: commands }\nspec:\n  tools:\n",
    );
    for (name, script) in scripts {
        let path = format!("resources/tools/{name}.sh");
        workspace.write(&path, script);
        workspace.make_executable(&path);
        catalog.push_str(&format!(
            "    - {{ id: cmd.{name}, timeout: 1s, command: {{ program: {path} }} }}\n"
        ));
    }
    workspace.write("config/catalogs/commands.yaml", catalog);
    let steps: Vec<String> = scripts
        .iter()
        .map(|(name, _)| format!("{{ toolCall: {{ tool: cmd.{name}, arguments: {{ n: 1 }} }} }}"))
        .collect();
    workspace.write(
        "config/agents/operator.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: {{ name: operator }}\nspec:\n  backend: scripted\n  tools: [{}]\n  script: [{}, {{ reply: done }}]\n",
            scripts.iter().map(|(n, _)| format!("cmd.{n}")).collect::<Vec<_>>().join(", "),
            steps.join(", ")
        ),
    );
    // The tool declares no variables: the server's HOME must not reach it.
    assert!(
        std::env::var("HOME").is_ok(),
        "the suite runs with HOME set"
    );
    let app = TestApp::spawn(workspace).await;
    let started = std::time::Instant::now();
    let (_, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "operator", "input": { "text": "go" }, "wait": true }),
        )
        .await;
    assert_eq!(view["status"], "completed", "{view}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the hanging tool was killed"
    );
    let events = app.events(view["requestId"].as_str().unwrap()).await;
    let completed: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "runtime.tool.direct.completed")
        .map(|e| &e["data"])
        .collect();
    assert_eq!(completed.len(), 5);
    let output = &completed[0]["output"];
    assert_eq!(output["input"], json!({ "n": 1 }));
    assert_eq!(output["leaked"], "unset", "the environment is scrubbed");
    let root = std::fs::canonicalize(app.workspace.path()).unwrap();
    assert_eq!(output["cwd"], root.to_str().unwrap());
    let codes: Vec<&str> = completed[1..]
        .iter()
        .map(|c| c["error"]["code"].as_str().unwrap())
        .collect();
    assert_eq!(
        codes,
        ["timeout", "exit_status", "bad_output", "output_too_large"]
    );
    assert!(
        completed[2]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("something broke")
    );
}

#[tokio::test]
async fn an_unknown_approval_and_list_filters_are_checked() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;
    let (status, error) = app.get("/admin/approvals?status=maybe", ADMIN_KEY).await;
    assert_eq!(
        (status, error["error"]["param"].as_str()),
        (422, Some("status"))
    );
    let (status, error) = app.get("/admin/approvals/apr_nope", ADMIN_KEY).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (404, Some("approval_not_found"))
    );
    let (status, _) = app.get("/admin/approvals", CLIENT_KEY).await;
    assert_eq!(status, 403);
    let (status, list) = app.get("/admin/approvals", ADMIN_KEY).await;
    assert_eq!(
        (status, list["data"].as_array().map(Vec::len)),
        (200, Some(0))
    );
}

#[tokio::test]
async fn an_agent_delegates_to_a_subagent_through_the_gateway() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let workspace = tools_workspace(&upstream, &tools, "");
    workspace.write(
        "config/agents/manager.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: manager }\nspec:\n  backend: openai\n  model: main\n  subagents: [greeter]\n",
    );
    upstream.push([
        Reply::call("agents_greeter", r#"{"input":"Ada"}"#),
        Reply::Text("The greeter says hello".into()),
    ]);
    let app = TestApp::spawn(workspace).await;
    let (response, request_id) = app
        .chat(&json!({ "model": "manager", "messages": [{ "role": "user", "content": "greet Ada" }] }))
        .await;
    assert_eq!(response.status(), 200);
    let offered = &upstream.calls()[0].body["tools"][0]["function"];
    assert_eq!(offered["name"], "agents_greeter");
    let result = tool_result(&tool_messages(&upstream, 1)[0]);
    assert_eq!(result["output"], "Hello Ada!", "{result}");

    let events = app.events(&request_id).await;
    let handoff = events
        .iter()
        .find(|e| e["data"]["event"]["phase"] == "agent.handoff")
        .expect("an agent.handoff event");
    assert_eq!(handoff["data"]["event"]["from"], "manager");
    assert_eq!(handoff["data"]["event"]["to"], "greeter");
    let child = handoff["data"]["event"]["requestId"].as_str().unwrap();
    assert_eq!(result["requestId"], child);
    let (status, child_view) = app
        .get(&format!("/admin/requests/{child}"), ADMIN_KEY)
        .await;
    assert_eq!(status, 200, "{child_view}");
    assert_eq!(child_view["status"], "completed");
    assert_eq!(child_view["output"], "Hello Ada!");

    // An agent may only delegate to its declared subagents.
    let (_, verdict) = app
        .post(
            "/admin/policy/explain",
            ADMIN_KEY,
            &json!({ "agentId": "clerk", "toolId": "agents.greeter", "arguments": { "input": "x" } }),
        )
        .await;
    assert_eq!(
        (
            verdict["decision"].as_str(),
            verdict["allowedForAgent"].as_bool()
        ),
        (Some("deny"), Some(false))
    );
}

#[tokio::test]
async fn a_run_parked_on_an_approval_gives_its_slot_to_other_runs() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":7}"#),
        Reply::Text("refunded in the end".into()),
    ]);
    let limits = "  limits: { maxConcurrentRuns: 1 }\n";
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, limits)).await;
    let (_, parked) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "clerk", "input": { "text": "refund" } }),
        )
        .await;
    let approval = app.pending_approval().await;

    // One execution slot, held by nobody while the first run waits on a human.
    let (status, other) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "Bo" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{other}");
    assert_eq!(other["output"], "Hello Bo!");

    let id = approval["id"].as_str().unwrap();
    app.post(
        &format!("/admin/approvals/{id}/approve"),
        ADMIN_KEY,
        &json!({}),
    )
    .await;
    let view = app
        .wait_until_done(parked["requestId"].as_str().unwrap())
        .await;
    assert_eq!(view["output"], "refunded in the end", "{view}");
}
