//! Workflows that run: the example's `support-triage` on both branches with its decision log,
//! a tool node gated by an operator, a crash between nodes, `/v1` exposure, and bad input.

use std::time::Duration;

use serde_json::{Value, json};

use super::control::poll;
use super::tools::ToolServer;
use super::trust::submit;
use super::upstream::{MockUpstream, Reply};
use super::{CLIENT_KEY, ServerProcess, TestApp, api_workspace, approve_pending, get_json};
use crate::helpers::{TestWorkspace, example_workspace};

/// A copy of the example workspace (its store must not land in the repository).
fn example_copy() -> TestWorkspace {
    let workspace = TestWorkspace::empty();
    copy_dir(&example_workspace(), workspace.path());
    workspace
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() == ".stable-harness" {
            continue;
        }
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The decision log: `(node, outcome, edge taken)` per node, in order.
fn decisions(events: &[Value]) -> Vec<(String, String, Value)> {
    events
        .iter()
        .filter(|e| e["type"] == "runtime.workflow.node.completed")
        .map(|e| {
            (
                e["data"]["node"].as_str().unwrap().to_owned(),
                e["data"]["outcome"].as_str().unwrap().to_owned(),
                e["data"]["edge"]["to"].clone(),
            )
        })
        .collect()
}

async fn events_at(http: &reqwest::Client, base: &str, request_id: &str) -> Vec<Value> {
    let (_, page) = get_json(
        http,
        &format!("{base}/runtime/requests/{request_id}/events?limit=1000"),
        CLIENT_KEY,
    )
    .await;
    page["data"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_support_triage_takes_both_branches() {
    let upstream = MockUpstream::start().await;
    let workspace = example_copy();
    let server = ServerProcess::start(workspace.path(), &[("OPENAI_BASE_URL", &upstream.url)]);
    let http = reqwest::Client::new();

    // The assistant answers: greet, answer, then the timestamp tool.
    upstream.push([Reply::Text("Here is your answer.".into())]);
    let (status, accepted) = submit(
        &http,
        &server.base,
        &json!({ "workflowId": "support-triage", "input": { "text": "my order is late" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["requestId"].as_str().unwrap().to_owned();
    let view = super::wait_until_done_at(&http, &server.base, &id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["agentId"], "support-triage");
    assert_eq!(
        view["output"], "Here is your answer.",
        "the last agent node's output"
    );
    let runs = view["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3, "one run per node: {view}");
    assert_eq!(
        runs.iter()
            .map(|r| r["attempt"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        [1, 2, 3]
    );
    let events = events_at(&http, &server.base, &id).await;
    super::assert_gapless(&events);
    assert_eq!(
        decisions(&events),
        [
            ("greet".into(), "completed".into(), json!("answer")),
            ("answer".into(), "completed".into(), json!("timestamp")),
            ("timestamp".into(), "completed".into(), Value::Null),
        ]
    );
    let kinds = super::types(&events);
    assert_eq!(
        kinds.first().map(String::as_str),
        Some("runtime.workflow.started")
    );
    assert!(
        kinds.contains(&"runtime.workflow.completed".to_owned()),
        "{kinds:?}"
    );
    // The assistant node got the greeter's output as its input.
    let asked = upstream.calls()[0].body["messages"].to_string();
    assert!(
        asked.contains("Hello! You said: my order is late"),
        "{asked}"
    );

    // The assistant fails: the researcher investigates.
    upstream.push([
        Reply::Status {
            status: 400,
            retry_after: None,
        },
        Reply::Text("Investigated.".into()),
    ]);
    let (_, accepted) = submit(
        &http,
        &server.base,
        &json!({ "workflowId": "support-triage", "input": { "text": "it broke" } }),
    )
    .await;
    let id = accepted["requestId"].as_str().unwrap().to_owned();
    let view = super::wait_until_done_at(&http, &server.base, &id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "Investigated.");
    let events = events_at(&http, &server.base, &id).await;
    assert_eq!(
        decisions(&events),
        [
            ("greet".into(), "completed".into(), json!("answer")),
            ("answer".into(), "failed".into(), json!("investigate")),
            ("investigate".into(), "completed".into(), Value::Null),
        ]
    );
    // The trace shows the decision log.
    let run_id = view["runs"][0]["runId"].as_str().unwrap();
    let (status, trace) = get_json(
        &http,
        &server.url(&format!("/admin/runs/{run_id}/trace")),
        super::ADMIN_KEY,
    )
    .await;
    assert_eq!(status, 200, "{trace}");
    assert!(
        trace
            .to_string()
            .contains("runtime.workflow.node.completed"),
        "{trace}"
    );

    let (status, missing) = submit(
        &http,
        &server.base,
        &json!({ "workflowId": "nope", "input": { "text": "x" } }),
    )
    .await;
    assert_eq!(
        (status, missing["error"]["code"].as_str()),
        (404, Some("workflow_not_found"))
    );
}

/// A workflow whose entry is a tool node gated by approval, branching on the decision.
fn refund_workspace(upstream: &MockUpstream, tools: &ToolServer) -> TestWorkspace {
    let workspace = super::tools::tools_workspace(upstream, tools, "");
    workspace.write(
        "config/workflows/refunds.yaml",
        "apiVersion: stable-harness/v1\nkind: Workflow\nmetadata: { name: refunds }\nspec:\n  entry: refund\n  exposeAsModel: true\n  nodes:\n    - { id: refund, tool: payments.refund, arguments: { amount: 5 } }\n    - { id: done, agent: greeter, input: original }\n    - { id: refused, agent: assistant, input: original }\n  edges:\n    - { from: refund, to: done, when: { decision: approved } }\n    - { from: refund, to: refused, when: { decision: denied } }\n",
    );
    workspace
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_node_waits_for_an_operator_and_branches_on_the_decision() {
    let (upstream, tools) = (MockUpstream::start().await, ToolServer::start().await);
    let app = TestApp::spawn(refund_workspace(&upstream, &tools)).await;
    let (status, accepted) = submit(
        &app.http,
        &app.base,
        &json!({ "workflowId": "refunds", "input": { "text": "refund" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["requestId"].as_str().unwrap().to_owned();
    let approval = app.pending_approval().await;
    assert_eq!(approval["toolId"], "payments.refund");
    assert_eq!(tools.count("/refund"), 0);
    assert_eq!(approve_pending(&app.http, &app.base).await, 1);
    let view = app.wait_until_done(&id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "Hello refund!");
    assert_eq!(tools.count("/refund"), 1);
    let events = app.events(&id).await;
    let refund = events
        .iter()
        .find(|e| e["type"] == "runtime.workflow.node.completed" && e["data"]["node"] == "refund")
        .unwrap();
    assert_eq!(refund["data"]["decision"], "approved");
    assert_eq!(refund["data"]["edge"]["to"], "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_exposed_as_a_model_answers_on_v1() {
    let (upstream, tools) = (MockUpstream::start().await, ToolServer::start().await);
    let app = TestApp::spawn(refund_workspace(&upstream, &tools)).await;
    let (status, models) = app.get("/v1/models", CLIENT_KEY).await;
    assert_eq!(status, 200);
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == "refunds"),
        "{models}"
    );
    // Denied by an operator: the other branch answers, with the model.
    upstream.push([Reply::Text("Sorry, no refund today.".into())]);
    let waiting = {
        let (http, url) = (app.http.clone(), app.url("/v1/chat/completions"));
        tokio::spawn(async move {
            let response = http
                .post(url)
                .bearer_auth(CLIENT_KEY)
                .json(&json!({ "model": "refunds", "stream": true, "messages": [{ "role": "user", "content": "refund" }] }))
                .send()
                .await
                .unwrap();
            response.text().await.unwrap()
        })
    };
    let approval = app.pending_approval().await;
    let (status, _) = app
        .post(
            &format!("/admin/approvals/{}/deny", approval["id"].as_str().unwrap()),
            super::ADMIN_KEY,
            &json!({ "reason": "not today" }),
        )
        .await;
    assert_eq!(status, 200);
    let text = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .unwrap()
        .unwrap();
    let content = super::streamed_content(&text);
    assert_eq!(content, "Sorry, no refund today.", "{text}");
    assert_eq!(tools.count("/refund"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_nodes_a_workflow_resumes_and_no_node_runs_twice() {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "");
    workspace.write(
        "config/workflows/two.yaml",
        "apiVersion: stable-harness/v1\nkind: Workflow\nmetadata: { name: two }\nspec:\n  entry: first\n  nodes:\n    - { id: first, agent: greeter }\n    - { id: second, agent: assistant }\n  edges:\n    - { from: first, to: second }\n",
    );
    upstream.push([
        Reply::Stall(Duration::from_secs(30)),
        Reply::Text("after the crash".into()),
    ]);
    let first = ServerProcess::start(workspace.path(), &[]);
    let http = reqwest::Client::new();
    let (status, accepted) = submit(
        &http,
        &first.base,
        &json!({ "workflowId": "two", "input": { "text": "hi" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["requestId"].as_str().unwrap().to_owned();
    poll("the second node's model call", async || {
        (!upstream.calls().is_empty()).then_some(())
    })
    .await;
    first.kill9();
    let second = ServerProcess::start(workspace.path(), &[]);
    let view = super::wait_until_done_at(&http, &second.base, &id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "after the crash");
    let events = events_at(&http, &second.base, &id).await;
    super::assert_gapless(&events);
    let started: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "runtime.workflow.node.started")
        .map(|e| e["data"]["node"].as_str().unwrap())
        .collect();
    assert_eq!(
        started,
        ["first", "second"],
        "the completed node never ran again"
    );
    assert_eq!(
        decisions(&events),
        [
            ("first".into(), "completed".into(), json!("second")),
            ("second".into(), "completed".into(), Value::Null),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_agent_a_reload_removed_fails_the_workflow_clearly() {
    let (upstream, tools) = (MockUpstream::start().await, ToolServer::start().await);
    let workspace = super::tools::tools_workspace(&upstream, &tools, "");
    workspace.write(
        "config/agents/temp.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: temp }\nspec:\n  backend: scripted\n  script: [{ reply: temporary }]\n",
    );
    let flow = |then: &str| {
        format!(
            "apiVersion: stable-harness/v1\nkind: Workflow\nmetadata: {{ name: flow }}\nspec:\n  entry: refund\n  nodes:\n    - {{ id: refund, tool: payments.refund, arguments: {{ amount: 1 }} }}\n    - {{ id: later, agent: {then} }}\n  edges:\n    - {{ from: refund, to: later }}\n"
        )
    };
    workspace.write("config/workflows/flow.yaml", flow("temp"));
    let app = TestApp::spawn(workspace).await;
    let (status, accepted) = submit(
        &app.http,
        &app.base,
        &json!({ "workflowId": "flow", "input": { "text": "go" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["requestId"].as_str().unwrap().to_owned();
    app.pending_approval().await;
    // While the workflow waits, a reload removes the agent its next node runs.
    app.workspace.remove("config/agents/temp.yaml");
    app.workspace
        .write("config/workflows/flow.yaml", flow("greeter"));
    let (status, reloaded) = app
        .post("/admin/workspace/reload", super::ADMIN_KEY, &json!({}))
        .await;
    assert_eq!(status, 200, "{reloaded}");
    assert_eq!(approve_pending(&app.http, &app.base).await, 1);
    let view = app.wait_until_done(&id).await;
    assert_eq!(view["status"], "failed", "{view}");
    let message = view["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("`temp` no longer exists"), "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_routes_the_workflow_and_feeds_a_tool_node() {
    let (upstream, tools) = (MockUpstream::start().await, ToolServer::start().await);
    let workspace = super::tools::tools_workspace(&upstream, &tools, "");
    workspace.write(
        "config/agents/structured.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: classifier }\nspec:\n  backend: scripted\n  script: [{ reply: '{\"route\": \"refund\", \"amount\": 5}' }]\n  responseSchema: { type: object, properties: { route: { type: string }, amount: { type: number } }, required: [route] }\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: sloppy }\nspec:\n  backend: scripted\n  script: [{ reply: 'not json at all' }]\n  responseSchema: { type: object }\n",
    );
    workspace.write(
        "config/workflows/route.yaml",
        "apiVersion: stable-harness/v1\nkind: Workflow\nmetadata: { name: route }\nspec:\n  entry: classify\n  nodes:\n    - { id: classify, agent: classifier }\n    - { id: refund, tool: payments.refund }\n    - { id: other, agent: greeter }\n  edges:\n    - { from: classify, to: refund, when: { output: { pointer: /route, equals: refund } } }\n    - { from: classify, to: other }\n",
    );
    let app = TestApp::spawn(workspace).await;
    let (status, accepted) = submit(
        &app.http,
        &app.base,
        &json!({ "workflowId": "route", "input": { "text": "I want my money back" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["requestId"].as_str().unwrap().to_owned();
    let approval = app.pending_approval().await;
    assert_eq!(
        approval["arguments"],
        json!({ "route": "refund", "amount": 5 })
    );
    assert_eq!(approve_pending(&app.http, &app.base).await, 1);
    let view = app.wait_until_done(&id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(tools.count("/refund"), 1);
    let events = app.events(&id).await;
    assert_eq!(
        decisions(&events),
        [
            ("classify".into(), "completed".into(), json!("refund")),
            ("refund".into(), "completed".into(), Value::Null),
        ]
    );
    // An answer that does not satisfy the agent's responseSchema fails its run.
    let (_, accepted) = submit(
        &app.http,
        &app.base,
        &json!({ "agentId": "sloppy", "input": { "text": "hi" } }),
    )
    .await;
    let view = app
        .wait_until_done(accepted["requestId"].as_str().unwrap())
        .await;
    assert_eq!(view["status"], "failed", "{view}");
    assert_eq!(view["error"]["kind"], "invalid_output", "{view}");
}
