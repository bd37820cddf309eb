//! The trust semantics of issue 8, end to end through the real server over HTTP: calls are
//! known by their place in the run (never the model's id), every execution carries its
//! idempotency key, a call a crash interrupted is re-run with the same key (medium risk) or put
//! to a human (high risk), one process owns a store, a client key's data is its own, and
//! secrets never reach the store.

use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use stable_harness::http::fingerprint;

use super::upstream::{MockUpstream, Reply};
use super::{
    ADMIN_KEY, CLIENT_KEY, RecordingTools, ServerProcess, TestApp, all_events, api_workspace,
    approve_pending, assert_gapless, get_json, request_id_header,
};
use crate::helpers::{TestWorkspace, output_within, stderr, store_path, store_rows, store_texts};

/// The API workspace (agents `assistant`, `greeter`, ...) plus tools served by `tools` and the
/// agent `teller` that may call them all: `weather.lookup` (low risk), `ledger.write` (medium),
/// `payments.refund` (high: needs approval by policy), `vault.read` (low; its `X-Vault-Token`
/// header comes from `vault_var`), and the command tool `stamp`, which answers the
/// idempotency key it was given. The model `main` takes its key from `upstream_key_var`.
/// `stamper` is a scripted agent calling `stamp` once.
fn trust_workspace(
    upstream: &MockUpstream,
    tools: &RecordingTools,
    upstream_key_var: &str,
    vault_var: &str,
) -> TestWorkspace {
    teller_workspace(upstream, tools, upstream_key_var, vault_var, "")
}

/// [`trust_workspace`] with `runtime_extra` added to the runtime's spec.
pub(super) fn teller_workspace(
    upstream: &MockUpstream,
    tools: &RecordingTools,
    upstream_key_var: &str,
    vault_var: &str,
    runtime_extra: &str,
) -> TestWorkspace {
    let governance = format!(
        "  governance:\n    default: allow\n    rules:\n      - {{ name: high-risk-needs-human, match: {{ risk: [high] }}, decision: needs_approval }}\n{runtime_extra}"
    );
    let workspace = api_workspace(upstream, &governance);
    workspace.write(
        "config/catalogs/models.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: {{ name: models }}\nspec:\n  models:\n    - {{ id: main, provider: openai-compatible, baseUrl: \"{url}\", apiKeyEnv: {upstream_key_var}, upstreamModel: main-upstream, timeout: 5s }}\n    - {{ id: flaky, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: flaky-upstream, timeout: 5s, fallbacks: [main] }}\n    - {{ id: slow, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: slow-upstream, timeout: 1s }}\n",
            url = upstream.url
        ),
    );
    workspace.write(
        "config/catalogs/tools.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: {{ name: tools }}\nspec:\n  tools:\n    - {{ id: weather.lookup, risk: low, http: {{ method: POST, url: \"{url}/weather\" }} }}\n    - {{ id: ledger.write, risk: medium, http: {{ method: POST, url: \"{url}/ledger\" }} }}\n    - {{ id: payments.refund, risk: high, http: {{ method: POST, url: \"{url}/refund\" }} }}\n    - {{ id: vault.read, risk: low, http: {{ method: POST, url: \"{url}/vault\", headersEnv: {{ X-Vault-Token: {vault_var} }} }} }}\n    - {{ id: stamp, risk: low, command: {{ program: resources/tools/stamp.sh }} }}\n",
            url = tools.url
        ),
    );
    workspace.write(
        "resources/tools/stamp.sh",
        "#!/bin/sh\ncat > /dev/null\nprintf '{\"key\": \"%s\"}\\n' \"$STABLE_HARNESS_IDEMPOTENCY_KEY\"\n",
    );
    workspace.make_executable("resources/tools/stamp.sh");
    workspace.write(
        "config/agents/teller.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: teller }\nspec:\n  backend: openai\n  model: main\n  tools: [weather.lookup, ledger.write, payments.refund, vault.read, stamp]\n  maxIterations: 5\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: stamper }\nspec:\n  backend: scripted\n  tools: [stamp]\n  script: [{ toolCall: { tool: stamp, arguments: {} } }, { reply: stamped }]\n",
    );
    workspace
}

/// A workspace whose credential variables nobody sets (tests that do not look at secrets).
fn plain_workspace(upstream: &MockUpstream, tools: &RecordingTools) -> TestWorkspace {
    trust_workspace(
        upstream,
        tools,
        "STABLE_HARNESS_TRUST_UNSET_UPSTREAM_KEY",
        "STABLE_HARNESS_TRUST_UNSET_VAULT_TOKEN",
    )
}

/// The assistant message of the `index`th upstream call's transcript that asked for tools
/// last, and the tool messages after it: (call ids asked, (tool_call_id, result) answered).
fn last_turn(upstream: &MockUpstream, index: usize) -> (Vec<String>, Vec<(String, Value)>) {
    let messages = upstream.calls()[index].body["messages"]
        .as_array()
        .unwrap()
        .clone();
    let turn = messages
        .iter()
        .rposition(|m| m["role"] == "assistant")
        .unwrap();
    let asked = messages[turn]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    let answered = messages[turn + 1..]
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap().to_owned(),
                serde_json::from_str(m["content"].as_str().unwrap()).unwrap(),
            )
        })
        .collect();
    (asked, answered)
}

/// The data of every event of `kind`.
pub(super) fn data_of(events: &[Value], kind: &str) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["type"] == kind)
        .map(|e| e["data"].clone())
        .collect()
}

/// `POST /runtime/requests` on a spawned server with the client key: status and body.
pub(super) async fn submit(http: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    super::post_json(http, &format!("{base}/runtime/requests"), CLIENT_KEY, body).await
}

/// Polls until `count` approvals are pending at `base`; returns them.
pub(super) async fn pending_approvals(
    http: &reqwest::Client,
    base: &str,
    count: usize,
) -> Vec<Value> {
    for _ in 0..800 {
        let (status, page) = get_json(
            http,
            &format!("{base}/admin/approvals?status=pending"),
            ADMIN_KEY,
        )
        .await;
        assert_eq!(status, 200, "{page}");
        let data = page["data"].as_array().cloned().unwrap_or_default();
        if data.len() >= count {
            return data;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{count} approval(s) never became pending");
}

#[tokio::test]
async fn reused_or_empty_model_call_ids_still_run_each_call_once_with_its_own_result() {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    let call = |id: &str, city: &str| {
        (
            id.to_owned(),
            "weather_lookup".to_owned(),
            format!(r#"{{"city":"{city}"}}"#),
        )
    };
    upstream.push([
        Reply::ToolCallsWithIds(vec![call("call_0", "Oslo")]),
        Reply::ToolCallsWithIds(vec![call("call_0", "Rome")]),
        Reply::ToolCallsWithIds(vec![call("", "Pisa"), call("", "Bari")]),
        Reply::Text("four cities".into()),
    ]);
    let app = TestApp::spawn(plain_workspace(&upstream, &tools)).await;
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "teller", "input": { "text": "weather" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["output"], "four cities", "{view}");

    // Each call ran exactly once.
    let mut cities: Vec<String> = tools
        .at("/weather")
        .iter()
        .map(|e| e.body["city"].as_str().unwrap().to_owned())
        .collect();
    cities.sort();
    assert_eq!(cities, ["Bari", "Oslo", "Pisa", "Rome"]);

    // The model got each call's own result, answered under the id it gave that call (empty
    // ids replaced by ids of their own, so the two calls of one turn stay apart).
    assert_eq!(upstream.calls().len(), 4);
    for (index, expected) in [
        (1, vec!["Oslo"]),
        (2, vec!["Rome"]),
        (3, vec!["Pisa", "Bari"]),
    ] {
        let (asked, answered) = last_turn(&upstream, index);
        let ids: Vec<&String> = answered.iter().map(|(id, _)| id).collect();
        assert_eq!(ids, asked.iter().collect::<Vec<_>>(), "call {index}");
        let got: Vec<&str> = answered
            .iter()
            .map(|(_, result)| result["echo"]["city"].as_str().unwrap())
            .collect();
        assert_eq!(got, expected, "call {index}");
    }
    let (asked, _) = last_turn(&upstream, 3);
    assert!(
        asked[0] != asked[1] && asked.iter().all(|id| !id.is_empty()),
        "{asked:?}"
    );
    // The whole transcript of the last call pairs every result with its own call.
    let last = &upstream.calls()[3].body;
    let in_order: Vec<Value> = last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            serde_json::from_str::<Value>(m["content"].as_str().unwrap()).unwrap()["echo"]["city"]
                .clone()
        })
        .collect();
    assert_eq!(
        in_order,
        [json!("Oslo"), json!("Rome"), json!("Pisa"), json!("Bari")]
    );

    // Records and events are distinct per call: keyed by turn and position.
    let request_id = view["requestId"].as_str().unwrap();
    let run_id = view["runs"][0]["runId"].as_str().unwrap();
    let events = app.events(request_id).await;
    assert_gapless(&events);
    let mut keys: Vec<(String, String)> = data_of(&events, "runtime.tool.direct.started")
        .iter()
        .map(|d| {
            (
                d["callKey"].as_str().unwrap().to_owned(),
                d["idempotencyKey"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    keys.sort();
    let expected: Vec<(String, String)> = ["t1.0", "t3.0", "t5.0", "t5.1"]
        .iter()
        .map(|k| ((*k).to_owned(), format!("{run_id}.{k}")))
        .collect();
    assert_eq!(keys, expected);
    assert_eq!(
        data_of(&events, "runtime.tool.direct.completed").len(),
        4,
        "one completion per call"
    );
    let rows = store_rows(
        &store_path(app.workspace.path()),
        &format!(
            "SELECT call_key, model_call_id, outcome, result FROM tool_calls WHERE run_id = '{run_id}' ORDER BY call_key"
        ),
    );
    let stored: Vec<(&str, &str, &str)> = rows
        .iter()
        .map(|r| {
            (
                r["call_key"].as_str().unwrap(),
                r["model_call_id"].as_str().unwrap(),
                r["outcome"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(stored.len(), 4, "{rows:?}");
    assert_eq!(
        stored[..2],
        [
            ("t1.0", "call_0", "completed"),
            ("t3.0", "call_0", "completed")
        ]
    );
    let results: Vec<Value> = rows
        .iter()
        .map(|r| serde_json::from_str::<Value>(r["result"].as_str().unwrap()).unwrap())
        .collect();
    assert_eq!(results[0]["echo"]["city"], "Oslo");
    assert_eq!(results[1]["echo"]["city"], "Rome");
}

#[tokio::test]
async fn every_execution_carries_the_idempotency_key_of_its_place_in_the_run() {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    upstream.push([
        Reply::ToolCalls(vec![
            ("weather_lookup".into(), r#"{"city":"Lima"}"#.into()),
            ("stamp".into(), "{}".into()),
        ]),
        Reply::Text("looked and stamped".into()),
    ]);
    let app = TestApp::spawn(plain_workspace(&upstream, &tools)).await;
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "teller", "input": { "text": "go" }, "wait": true }),
        )
        .await;
    assert_eq!(
        (status, &view["output"]),
        (200, &json!("looked and stamped")),
        "{view}"
    );
    let run_id = view["runs"][0]["runId"].as_str().unwrap();

    // http: the `Idempotency-Key` header; command: STABLE_HARNESS_IDEMPOTENCY_KEY.
    let weather = tools.at("/weather");
    assert_eq!(weather.len(), 1);
    assert_eq!(
        weather[0].idempotency_key.as_deref(),
        Some(format!("{run_id}.t1.0").as_str())
    );
    let (_, answered) = last_turn(&upstream, 1);
    assert_eq!(
        answered[1].1["key"],
        format!("{run_id}.t1.1"),
        "{answered:?}"
    );

    // The started events say which call and key each execution is.
    let events = app.events(view["requestId"].as_str().unwrap()).await;
    let mut started: Vec<(String, String, String)> =
        data_of(&events, "runtime.tool.direct.started")
            .iter()
            .map(|d| {
                (
                    d["toolId"].as_str().unwrap().to_owned(),
                    d["callKey"].as_str().unwrap().to_owned(),
                    d["idempotencyKey"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
    started.sort();
    assert_eq!(
        started,
        [
            (
                "stamp".to_owned(),
                "t1.1".to_owned(),
                format!("{run_id}.t1.1")
            ),
            (
                "weather.lookup".to_owned(),
                "t1.0".to_owned(),
                format!("{run_id}.t1.0")
            ),
        ]
    );

    // A scripted step is known by its step number.
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "stamper", "input": { "text": "go" }, "wait": true }),
        )
        .await;
    assert_eq!(
        (status, &view["output"]),
        (200, &json!("stamped")),
        "{view}"
    );
    let run_id = view["runs"][0]["runId"].as_str().unwrap();
    let events = app.events(view["requestId"].as_str().unwrap()).await;
    let completed = data_of(&events, "runtime.tool.direct.completed");
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0]["output"]["key"], format!("{run_id}.s1"));
}

#[tokio::test]
async fn an_interrupted_call_reruns_with_its_key_or_waits_for_a_human_when_high_risk() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    tools.hold("/ledger");
    tools.hold("/refund");
    upstream.push([
        Reply::ToolCalls(vec![
            ("ledger_write".into(), r#"{"entry":"rent"}"#.into()),
            ("payments_refund".into(), r#"{"amount":1}"#.into()),
            ("payments_refund".into(), r#"{"amount":2}"#.into()),
        ]),
        Reply::Text("all settled".into()),
    ]);
    let workspace = plain_workspace(&upstream, &tools);
    let http = reqwest::Client::new();
    let server = ServerProcess::start(workspace.path(), &[]);
    let (status, accepted) = submit(
        &http,
        &server.base,
        &json!({ "agentId": "teller", "input": { "text": "settle" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    let run_id = accepted["runId"].as_str().unwrap().to_owned();

    // Both refunds are approved by an operator; then all three calls are executing (held by
    // the tool service) when the server dies.
    for _ in 0..800 {
        approve_pending(&http, &server.base).await;
        if tools.at("/refund").len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(tools.wait_for("/refund", 2).await.len(), 2);
    assert_eq!(tools.wait_for("/ledger", 1).await.len(), 1);
    server.kill9();
    tools.release("/ledger");
    tools.release("/refund");

    let server = ServerProcess::start(workspace.path(), &[]);
    // The medium-risk call runs again by itself, with the same key.
    let ledger = tools.wait_for("/ledger", 2).await;
    let key = |k: &str| Some(format!("{run_id}.{k}"));
    assert_eq!(ledger[0].idempotency_key, key("t1.0"));
    assert_eq!(ledger[1].idempotency_key, key("t1.0"));

    // The high-risk calls are not run again: each becomes an `interrupted` approval.
    let mut pending = pending_approvals(&http, &server.base, 2).await;
    pending.sort_by_key(|a| a["callKey"].as_str().unwrap().to_owned());
    for (approval, call_key) in pending.iter().zip(["t1.1", "t1.2"]) {
        assert_eq!(approval["kind"], "interrupted", "{approval}");
        assert_eq!(approval["rule"], "interrupted", "{approval}");
        assert_eq!(approval["callKey"], call_key, "{approval}");
        assert_eq!(approval["runId"], run_id.as_str());
        assert!(
            approval["reason"]
                .as_str()
                .unwrap()
                .starts_with("outcome unknown after a restart"),
            "{approval}"
        );
    }
    assert_eq!(
        tools.at("/refund").len(),
        2,
        "no high-risk re-run before a decision"
    );
    let (_, view) = get_json(
        &http,
        &server.url(&format!("/runtime/requests/{request_id}")),
        CLIENT_KEY,
    )
    .await;
    assert_eq!(view["status"], "waiting_approval", "{view}");

    // Approving runs the call again with the same key; denying tells the model.
    let decide = |id: &str, verb: &str| {
        http.post(server.url(&format!("/admin/approvals/{id}/{verb}")))
            .bearer_auth(ADMIN_KEY)
            .json(&json!({ "reason": "checked the bank" }))
            .send()
    };
    let approved = decide(pending[0]["id"].as_str().unwrap(), "approve")
        .await
        .unwrap();
    assert_eq!(approved.status(), 200);
    let denied = decide(pending[1]["id"].as_str().unwrap(), "deny")
        .await
        .unwrap();
    assert_eq!(denied.status(), 200);
    let view = super::wait_until_done_at(&http, &server.base, &request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "all settled");

    let refunds = tools.at("/refund");
    let of = |amount: i64| {
        refunds
            .iter()
            .filter(|e| e.body["amount"] == amount)
            .map(|e| e.idempotency_key.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        of(1),
        [key("t1.1"), key("t1.1")],
        "approved: ran again, same key"
    );
    assert_eq!(of(2), [key("t1.2")], "denied: not run again");
    assert_eq!(tools.at("/ledger").len(), 2);

    // The model was not asked for the turn again, and got a result for every call.
    assert_eq!(upstream.calls().len(), 2);
    let (_, answered) = last_turn(&upstream, 1);
    assert_eq!(answered.len(), 3, "{answered:?}");
    assert_eq!(answered[0].1["echo"]["entry"], "rent");
    assert_eq!(answered[1].1["echo"]["amount"], 1);
    assert_eq!(
        answered[2].1["error"]["code"], "approval_denied",
        "{answered:?}"
    );

    let events = all_events(&http, &server.base, &request_id).await;
    assert_gapless(&events);
    let refund_starts: Vec<String> = data_of(&events, "runtime.tool.direct.started")
        .iter()
        .filter(|d| d["callKey"] == "t1.1")
        .map(|d| d["idempotencyKey"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        refund_starts,
        [format!("{run_id}.t1.1"), format!("{run_id}.t1.1")]
    );
    server.terminate();
}

#[tokio::test]

async fn a_high_risk_call_interrupted_twice_is_put_to_a_human_twice() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    tools.hold("/refund");
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":9}"#),
        Reply::Text("refunded at last".into()),
    ]);
    let workspace = plain_workspace(&upstream, &tools);
    let http = reqwest::Client::new();
    let server = ServerProcess::start(workspace.path(), &[]);
    let (_, accepted) = submit(
        &http,
        &server.base,
        &json!({ "agentId": "teller", "input": { "text": "refund" } }),
    )
    .await;
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    let policy = pending_approvals(&http, &server.base, 1).await;
    assert_eq!(policy[0]["kind"], "policy");
    approve_pending(&http, &server.base).await;
    tools.wait_for("/refund", 1).await;
    server.kill9();

    // First restart: the operator approves the re-run, which is interrupted again.
    let server = ServerProcess::start(workspace.path(), &[]);
    let first = pending_approvals(&http, &server.base, 1).await;
    assert_eq!(first[0]["kind"], "interrupted", "{first:?}");
    approve_pending(&http, &server.base).await;
    tools.wait_for("/refund", 2).await;
    server.kill9();
    tools.release("/refund");

    // Second restart: the outcome is unknown again, so a human is asked again: the earlier
    // decision covered one re-run, not every one after it.
    let server = ServerProcess::start(workspace.path(), &[]);
    let mut asked = None;
    for _ in 0..800 {
        let (_, page) = get_json(
            &http,
            &server.url("/admin/approvals?status=pending"),
            ADMIN_KEY,
        )
        .await;
        if let Some(approval) = page["data"].as_array().and_then(|d| d.first()) {
            asked = Some(approval.clone());
            break;
        }
        if tools.at("/refund").len() > 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        tools.at("/refund").len(),
        2,
        "the high-risk call ran a third time with no decision after its second interruption"
    );
    let asked = asked.expect("an approval for the second interruption");
    assert_eq!(asked["kind"], "interrupted");
    approve_pending(&http, &server.base).await;
    let view = super::wait_until_done_at(&http, &server.base, &request_id).await;
    assert_eq!(view["output"], "refunded at last", "{view}");
    assert_eq!(tools.at("/refund").len(), 3);
    server.terminate();
}

#[tokio::test]
async fn a_second_process_on_a_live_store_refuses_at_once_and_touches_nothing() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    tools.hold("/ledger");
    upstream.push([
        Reply::call("ledger_write", r#"{"entry":"once"}"#),
        Reply::Text("written once".into()),
    ]);
    let workspace = plain_workspace(&upstream, &tools);
    let http = reqwest::Client::new();
    let server = ServerProcess::start(workspace.path(), &[]);
    let (status, accepted) = submit(
        &http,
        &server.base,
        &json!({ "agentId": "teller", "input": { "text": "write" } }),
    )
    .await;
    assert_eq!(status, 202);
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    tools.wait_for("/ledger", 1).await;

    // A second `start` on the same workspace: refused before it resumes or binds anything.
    let dir = workspace.path().to_str().unwrap();
    let mut second = Command::new(crate::helpers::binary());
    second.args([
        "start",
        "-w",
        dir,
        "--port",
        "0",
        "--api-key",
        CLIENT_KEY,
        "--admin-key",
        ADMIN_KEY,
    ]);
    let refused = output_within(second, Duration::from_secs(60));
    assert!(!refused.status.success(), "{refused:?}");
    let message = stderr(&refused);
    assert!(message.contains("in use"), "{message}");
    assert!(
        message.contains("state.db"),
        "the message names the store: {message}"
    );

    // `run` against the live server's store refuses too.
    let mut run = Command::new(crate::helpers::binary());
    run.args(["run", "-w", dir, "--agent", "greeter", "hello"]);
    let refused = output_within(run, Duration::from_secs(60));
    assert!(!refused.status.success(), "{refused:?}");
    assert!(stderr(&refused).contains("in use"), "{}", stderr(&refused));

    // Neither re-ran the live server's call nor added a request.
    assert_eq!(tools.at("/ledger").len(), 1);
    tools.release("/ledger");
    let view = super::wait_until_done_at(&http, &server.base, &request_id).await;
    assert_eq!(view["output"], "written once", "{view}");
    assert_eq!(tools.at("/ledger").len(), 1);
    let events = all_events(&http, &server.base, &request_id).await;
    assert_gapless(&events);
    assert_eq!(data_of(&events, "runtime.request.started").len(), 1);
    let (_, all) = get_json(&http, &server.url("/admin/requests"), ADMIN_KEY).await;
    assert_eq!(all["data"].as_array().unwrap().len(), 1, "{all}");
    server.terminate();

    // Once the server is gone, the store is free again.
    let mut run = Command::new(crate::helpers::binary());
    run.args(["run", "-w", dir, "--agent", "greeter", "again"]);
    let ran = output_within(run, Duration::from_secs(60));
    assert!(ran.status.success(), "{}", stderr(&ran));
    assert!(crate::helpers::stdout(&ran).contains("Hello again!"));
}

#[tokio::test]
async fn a_client_key_sees_and_continues_only_its_own_requests_and_sessions() {
    const ALICE_KEY: &str = "client-key-of-alice";
    const BOB_KEY: &str = "client-key-of-bob";
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    let app = TestApp::spawn_with_keys(
        plain_workspace(&upstream, &tools),
        &[ALICE_KEY, BOB_KEY],
        &[ADMIN_KEY],
    )
    .await;
    let (alice, bob) = (fingerprint(ALICE_KEY), fingerprint(BOB_KEY));
    assert_ne!(alice, bob);

    let (status, view) = app
        .post(
            "/runtime/requests",
            ALICE_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "Ada" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["owner"], alice.as_str());
    let request_id = view["requestId"].as_str().unwrap().to_owned();
    let session_id = view["sessionId"].as_str().unwrap().to_owned();

    // To Bob, Alice's request and session do not exist.
    let (status, body) = app
        .get(&format!("/runtime/requests/{request_id}"), BOB_KEY)
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("request_not_found"))
    );
    let (status, _) = app
        .get(&format!("/runtime/requests/{request_id}/events"), BOB_KEY)
        .await;
    assert_eq!(status, 404);
    let sse = app
        .http
        .get(app.url(&format!("/runtime/requests/{request_id}/events")))
        .bearer_auth(BOB_KEY)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(sse.status(), 404);
    let (status, body) = app
        .post(
            "/runtime/requests",
            BOB_KEY,
            &json!({ "agentId": "greeter", "sessionId": session_id, "input": { "text": "Eve" }, "wait": true }),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("session_not_found")),
        "{body}"
    );
    let via_v1 = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(BOB_KEY)
        .header("x-stable-harness-session-id", &session_id)
        .json(&json!({ "model": "greeter", "messages": [{ "role": "user", "content": "Eve" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(via_v1.status(), 404);

    // Alice continues her own session, and sees her request and its events.
    let (status, again) = app
        .post(
            "/runtime/requests",
            ALICE_KEY,
            &json!({ "agentId": "greeter", "sessionId": session_id, "input": { "text": "again" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["sessionId"], session_id.as_str());
    let (status, _) = app
        .get(&format!("/runtime/requests/{request_id}/events"), ALICE_KEY)
        .await;
    assert_eq!(status, 200);

    // `/v1`'s `user` names a session of the caller's own.
    let v1 = |key: &'static str, user: &'static str| {
        app.http
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(key)
            .json(&json!({ "model": "greeter", "user": user, "messages": [{ "role": "user", "content": "hi" }] }))
            .send()
    };
    let header = |response: &reqwest::Response, name: &str| {
        response.headers()[name].to_str().unwrap().to_owned()
    };
    let alices = v1(ALICE_KEY, "carol").await.unwrap();
    assert_eq!(alices.status(), 200);
    assert_eq!(
        header(&alices, "x-stable-harness-session-id"),
        format!("user:{alice}:carol")
    );
    let alices_request = header(&alices, "x-stable-harness-request-id");
    let bobs = v1(BOB_KEY, "carol").await.unwrap();
    assert_eq!(bobs.status(), 200);
    assert_eq!(
        header(&bobs, "x-stable-harness-session-id"),
        format!("user:{bob}:carol")
    );
    let (status, _) = app
        .get(&format!("/runtime/requests/{alices_request}"), BOB_KEY)
        .await;
    assert_eq!(status, 404);
    let into_alices = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(BOB_KEY)
        .header("x-stable-harness-session-id", format!("user:{alice}:carol"))
        .json(&json!({ "model": "greeter", "messages": [{ "role": "user", "content": "hi" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(into_alices.status(), 404);

    // Admin keys see everything, with the owner, and filter by it.
    let (status, seen) = app
        .get(&format!("/admin/requests/{request_id}"), ADMIN_KEY)
        .await;
    assert_eq!((status, &seen["owner"]), (200, &json!(alice)));
    let owners = |page: &Value| -> Vec<String> {
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["owner"].as_str().unwrap().to_owned())
            .collect()
    };
    let (_, of_alice) = app
        .get(&format!("/admin/requests?owner={alice}"), ADMIN_KEY)
        .await;
    assert_eq!(owners(&of_alice), vec![alice.clone(); 3], "{of_alice}");
    let (_, of_bob) = app
        .get(&format!("/admin/requests?owner={bob}"), ADMIN_KEY)
        .await;
    assert_eq!(owners(&of_bob), [bob], "{of_bob}");

    // An approval's decision names the admin key's identity.
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":3}"#),
        Reply::Text("refunded".into()),
    ]);
    let (_, accepted) = app
        .post(
            "/runtime/requests",
            ALICE_KEY,
            &json!({ "agentId": "teller", "input": { "text": "refund" } }),
        )
        .await;
    let approval = app.pending_approval().await;
    let (status, decided) = app
        .post(
            &format!(
                "/admin/approvals/{}/approve",
                approval["id"].as_str().unwrap()
            ),
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(status, 200, "{decided}");
    assert_eq!(decided["decidedBy"], fingerprint(ADMIN_KEY));
    let refund_request = accepted["requestId"].as_str().unwrap();
    let mut view = Value::Null;
    for _ in 0..400 {
        (_, view) = app
            .get(&format!("/runtime/requests/{refund_request}"), ALICE_KEY)
            .await;
        if view["status"] == "completed" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(view["output"], "refunded", "{view}");
    let events = all_events_as(&app, refund_request, ALICE_KEY).await;
    let resolved = data_of(&events, "runtime.approval.resolved");
    assert_eq!(resolved[0]["decidedBy"], fingerprint(ADMIN_KEY));
    let (status, _) = app
        .get(
            &format!("/runtime/requests/{refund_request}/events"),
            BOB_KEY,
        )
        .await;
    assert_eq!(status, 404);
}

/// Every event of a request read with `key` (one page is enough for these tests).
async fn all_events_as(app: &TestApp, request_id: &str, key: &str) -> Vec<Value> {
    let (status, page) = app
        .get(&format!("/runtime/requests/{request_id}/events"), key)
        .await;
    assert_eq!(status, 200, "{page}");
    page["data"].as_array().cloned().unwrap_or_default()
}

#[tokio::test]
async fn secrets_never_reach_the_store_wherever_they_appear() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    let nonce = format!("{:016x}", fastrand::u64(..));
    let upstream_var = format!("STABLE_HARNESS_TRUST_UPSTREAM_KEY_{nonce}");
    let vault_var = format!("STABLE_HARNESS_TRUST_VAULT_TOKEN_{nonce}");
    let upstream_secret = format!("sk-upstream-{nonce}");
    let vault_secret = format!("vault-token-{nonce}");
    let named_secret = format!("hunter2-{nonce}");
    let workspace = trust_workspace(&upstream, &tools, &upstream_var, &vault_var);
    // The tool answers with a credential variable's value and a credential-named field.
    tools.answer(
        "/vault",
        json!({ "note": format!("the vault holds {upstream_secret}"), "password": named_secret }),
    );
    upstream.push([
        Reply::ToolCallsWithIds(vec![
            (
                "call_a".into(),
                "vault_read".into(),
                format!(r#"{{"query":"{upstream_secret}"}}"#),
            ),
            (
                "call_b".into(),
                "vault_read".into(),
                format!("{{not json at all {vault_secret}"),
            ),
        ]),
        Reply::Text(format!("the model repeats {vault_secret}")),
        Reply::StatusBody {
            status: 400,
            body: json!({ "error": { "message": format!("invalid key {upstream_secret} for {vault_secret}"), "type": "invalid_request_error" } }).to_string(),
        },
    ]);
    let http = reqwest::Client::new();
    let server = ServerProcess::start(
        workspace.path(),
        &[
            (upstream_var.as_str(), upstream_secret.as_str()),
            (vault_var.as_str(), vault_secret.as_str()),
            ("STABLE_HARNESS_LOG", "info"),
        ],
    );

    // In the input and options of /v1, in tool arguments (one of them unparseable), in a
    // tool's result and in the model's answer.
    let response = http
        .post(server.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({
            "model": "teller",
            "max_tokens": 77,
            "metadata": { "password": named_secret },
            "messages": [{ "role": "user", "content": format!("my key is {upstream_secret}") }],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let v1_request = request_id_header(&response);
    // In /runtime input and metadata, and in an upstream 4xx error body.
    let (status, failed) = submit(
        &http,
        &server.base,
        &json!({
            "agentId": "assistant",
            "input": { "text": format!("again {vault_secret}") },
            "metadata": { "api_key": named_secret },
            "wait": true,
        }),
    )
    .await;
    assert_eq!(status, 200, "{failed}");
    assert_eq!(failed["status"], "failed", "{failed}");

    // The secrets did flow: the tool got the real values.
    let vault = tools.at("/vault");
    assert_eq!(vault.len(), 1, "the unparseable call never runs");
    assert_eq!(vault[0].headers["x-vault-token"], vault_secret);
    assert_eq!(vault[0].body["query"], upstream_secret.as_str());
    let logs = server.stderr();
    server.terminate();

    let db = store_path(workspace.path());
    let texts = store_texts(&db);
    assert!(!texts.is_empty());
    let mut leaks = Vec::new();
    for secret in [&upstream_secret, &vault_secret, &named_secret] {
        leaks.extend(
            texts
                .iter()
                .filter(|(_, _, text)| text.contains(secret.as_str()))
                .map(|(table, column, text)| format!("{secret} in {table}.{column}: {text}")),
        );
        // Not even in a freed page or a WAL frame.
        for file in ["state.db", "state.db-wal"] {
            let path = db.with_file_name(file);
            if let Ok(bytes) = std::fs::read(&path)
                && bytes.windows(secret.len()).any(|w| w == secret.as_bytes())
            {
                leaks.push(format!("{secret} in the bytes of {file}"));
            }
        }
        leaks.extend(
            logs.lines()
                .filter(|line| line.contains(secret.as_str()))
                .map(|line| format!("{secret} logged: {line}")),
        );
    }
    assert!(
        leaks.is_empty(),
        "secrets were stored:\n{}",
        leaks.join("\n")
    );
    // What is not a secret survives, and redaction left its mark where secrets were.
    let input = crate::helpers::stored_input(&db, &v1_request);
    assert_eq!(input["options"]["max_tokens"], 77, "{input}");
    assert_eq!(
        input["messages"][0]["content"], "my key is [redacted]",
        "{input}"
    );
    let errors = store_rows(&db, "SELECT error FROM requests WHERE status = 'failed'");
    let error = errors[0]["error"].as_str().unwrap();
    assert!(error.contains("[redacted]"), "{error}");
}

#[tokio::test]

async fn a_credential_named_argument_never_reaches_the_checkpoint() {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    let secret = format!("hunter2-{:016x}", fastrand::u64(..));
    upstream.push([
        Reply::call(
            "weather_lookup",
            &format!(r#"{{"city":"Oslo","api_token":"{secret}"}}"#),
        ),
        Reply::Text("done".into()),
    ]);
    let app = TestApp::spawn(plain_workspace(&upstream, &tools)).await;
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "teller", "input": { "text": "weather" }, "wait": true }),
        )
        .await;
    assert_eq!((status, &view["output"]), (200, &json!("done")), "{view}");
    assert_eq!(tools.at("/weather")[0].body["api_token"], secret.as_str());
    let workspace = app.stop().await;
    let leaks: Vec<String> = store_texts(&store_path(workspace.path()))
        .into_iter()
        .filter(|(_, _, text)| text.contains(&secret))
        .map(|(table, column, text)| format!("{table}.{column}: {text}"))
        .collect();
    assert!(leaks.is_empty(), "stored:\n{}", leaks.join("\n"));
}

#[allow(clippy::print_stderr)]
#[tokio::test]
async fn while_the_store_refuses_writes_readyz_is_red_and_submits_get_503_until_it_recovers() {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    let app = std::sync::Arc::new(TestApp::spawn(plain_workspace(&upstream, &tools)).await);
    let (status, _) = app.get("/readyz", CLIENT_KEY).await;
    assert_eq!(status, 200);

    // Another connection holds the database's write lock: the server's writes get SQLITE_BUSY.
    let db = store_path(app.workspace.path());
    let blocker = rusqlite::Connection::open(&db).unwrap();
    blocker.busy_timeout(Duration::from_secs(30)).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let locked = std::time::Instant::now();

    // A submit waits for its durable write; meanwhile readiness turns red.
    let client = std::sync::Arc::clone(&app);
    let waiting = tokio::spawn(async move {
        client
            .post(
                "/runtime/requests",
                CLIENT_KEY,
                &json!({ "agentId": "greeter", "input": { "text": "Ida" } }),
            )
            .await
    });
    let mut red = None;
    for _ in 0..2400 {
        let (status, body) = app.get("/readyz", CLIENT_KEY).await;
        if status == 503 {
            red = Some(body);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let red = red.expect("/readyz turned red while the store refused writes");
    eprintln!(
        "the store was reported unavailable {:?} after its write lock was taken",
        locked.elapsed()
    );
    assert_eq!(red["status"], "unavailable", "{red}");
    let (status, refused) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "Max" } }),
        )
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{refused}"
    );

    // The lock goes away: service resumes by itself, and the waiting submit was not lost.
    blocker.execute_batch("ROLLBACK").unwrap();
    drop(blocker);
    let (status, accepted) = waiting.await.unwrap();
    assert_eq!(status, 202, "{accepted}");
    let view = app
        .wait_until_done(accepted["requestId"].as_str().unwrap())
        .await;
    assert_eq!(view["output"], "Hello Ida!", "{view}");
    let (status, _) = app.get("/readyz", CLIENT_KEY).await;
    assert_eq!(status, 200);
    let (status, _) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "Max" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200);
}
