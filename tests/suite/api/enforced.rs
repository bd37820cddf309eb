//! Accepted means enforced (issue 8): model `pricing` gives each request its cost,
//! `limits.maxOutputBytes` caps a run's answer, a named key is known by its name and its
//! labels reach the policy, and a resumed run whose agent is gone fails clearly.

use std::time::Duration;

use serde_json::{Value, json};

use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, ServerProcess, TestApp, api_workspace, get_json};

#[tokio::test]
async fn each_request_costs_what_its_usage_and_the_model_pricing_say() {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "");
    workspace.write(
        "config/catalogs/models.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: {{ name: models }}\nspec:\n  models:\n    - {{ id: main, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: main-upstream, timeout: 5s, pricing: {{ inputPerMTok: 2.0, outputPerMTok: 8.0 }} }}\n    - {{ id: flaky, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: flaky-upstream, timeout: 5s }}\n    - {{ id: slow, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: slow-upstream, timeout: 1s }}\n",
            url = upstream.url
        ),
    );
    upstream.push([Reply::Text("four words of answer".into())]);
    let app = TestApp::spawn(workspace).await;
    let (response, request_id) = app
        .chat(&json!({ "model": "assistant", "messages": [{ "role": "user", "content": "hi" }] }))
        .await;
    assert_eq!(response.status(), 200);
    let (status, view) = app
        .get(&format!("/admin/requests/{request_id}"), ADMIN_KEY)
        .await;
    assert_eq!(status, 200, "{view}");
    let prompt = view["usage"]["prompt_tokens"].as_f64().unwrap();
    let completion = view["usage"]["completion_tokens"].as_f64().unwrap();
    assert!(completion > 0.0, "{view}");
    let expected = (prompt * 2.0 + completion * 8.0) / 1e6;
    let cost = view["costUsd"].as_f64().unwrap();
    assert!((cost - expected).abs() < 1e-12, "{cost} != {expected}");
    // The list shows it too; an agent whose model has no price has no cost.
    let (_, list) = app.get("/admin/requests", ADMIN_KEY).await;
    assert_eq!(list["data"][0]["costUsd"], view["costUsd"]);
    let (_, greeted) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "x" }, "wait": true }),
        )
        .await;
    assert_eq!(greeted["status"], "completed", "{greeted}");
    assert_eq!(greeted["costUsd"], Value::Null);
}

#[tokio::test]
async fn a_run_answer_is_cut_at_max_output_bytes() {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "  limits: { maxOutputBytes: 12B }\n");
    let long = "one two three four five six seven eight nine ten";
    upstream.push([Reply::Text(long.into()), Reply::Text(long.into())]);
    let app = TestApp::spawn(workspace).await;
    for stream in [false, true] {
        let (response, request_id) = app
            .chat(&json!({ "model": "assistant", "stream": stream, "messages": [{ "role": "user", "content": "hi" }] }))
            .await;
        assert_eq!(response.status(), 200);
        let _ = response.text().await.unwrap();
        let view = app.wait_until_done(&request_id).await;
        assert_eq!(view["status"], "completed", "{view}");
        let output = view["output"].as_str().unwrap();
        assert!(output.len() <= 12, "{output:?}");
        assert!(long.starts_with(output) && !output.is_empty(), "{output:?}");
        let events = app.events(&request_id).await;
        let done = events
            .iter()
            .find(|e| e["type"] == "runtime.request.completed")
            .unwrap();
        assert_eq!(done["data"]["finishReason"], "length", "{done}");
    }
}

#[tokio::test]
async fn a_named_key_is_known_by_its_name_and_its_labels_decide_policy() {
    const VAR: &str = "STABLE_HARNESS_TEST_FINANCE_KEY";
    const FINANCE_KEY: &str = "finance-team-key-for-tests";
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(
        &upstream,
        &format!(
            "  protocols:\n    openai:\n      keys: [{{ name: finance, keyEnv: {VAR}, labels: {{ team: finance }} }}]\n  governance:\n    default: allow\n    rules:\n      - {{ name: finance-no-clock, match: {{ tools: [clock.now], labels: {{ team: finance }} }}, decision: deny }}\n"
        ),
    );
    workspace.write(
        "config/agents/clocky.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: clocky }\nspec:\n  backend: scripted\n  tools: [clock.now]\n  script: [{ toolCall: { tool: clock.now, arguments: {} } }, { reply: done }]\n",
    );
    workspace.write(
        "config/catalogs/tools.yaml",
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: clock.now, builtin: clock.now }\n",
    );
    let server = ServerProcess::start(workspace.path(), &[(VAR, FINANCE_KEY)]);
    stable_harness::app::install_crypto_provider();
    let http = reqwest::Client::new();
    let submit = |key: &'static str, body: Value| {
        let request = http
            .post(server.url("/runtime/requests"))
            .bearer_auth(key)
            .json(&body);
        async move {
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()
        }
    };
    let outcome = |events: &Value| {
        events["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| {
                e["type"] == "runtime.tool.denied" || e["type"] == "runtime.tool.direct.completed"
            })
            .map(|e| (e["type"].clone(), e["data"]["rule"].clone()))
            .unwrap()
    };
    let events_of = |view: &Value, key: &'static str| {
        let url = server.url(&format!(
            "/runtime/requests/{}/events",
            view["requestId"].as_str().unwrap()
        ));
        let http = http.clone();
        async move { get_json(&http, &url, key).await.1 }
    };
    let ask = json!({ "agentId": "clocky", "input": { "text": "time?" }, "wait": true });
    let finance = submit(FINANCE_KEY, ask.clone()).await;
    assert_eq!(finance["owner"], "finance", "{finance}");
    assert_eq!(
        outcome(&events_of(&finance, FINANCE_KEY).await),
        (json!("runtime.tool.denied"), json!("finance-no-clock"))
    );
    let other = submit(CLIENT_KEY, ask).await;
    assert_eq!(
        other["owner"],
        stable_harness::http::fingerprint(CLIENT_KEY)
    );
    assert_eq!(
        outcome(&events_of(&other, CLIENT_KEY).await).0,
        json!("runtime.tool.direct.completed")
    );
    // Request metadata saying the same never counts as the key's label.
    let forged = submit(
        CLIENT_KEY,
        json!({ "agentId": "clocky", "input": { "text": "t" }, "metadata": { "team": "finance" }, "wait": true }),
    )
    .await;
    assert_eq!(
        outcome(&events_of(&forged, CLIENT_KEY).await).0,
        json!("runtime.tool.direct.completed")
    );
    // The admin list filters by the name.
    let (_, list) = get_json(
        &http,
        &server.url("/admin/requests?owner=finance"),
        ADMIN_KEY,
    )
    .await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1, "{list}");
    server.terminate();
}

#[tokio::test]
async fn a_resumed_run_whose_agent_is_gone_fails_clearly() {
    let upstream = MockUpstream::start().await;
    upstream.push([Reply::Stall(Duration::from_secs(30))]);
    let workspace = api_workspace(&upstream, "");
    let server = ServerProcess::start(workspace.path(), &[]);
    stable_harness::app::install_crypto_provider();
    let http = reqwest::Client::new();
    let response = http
        .post(server.url("/runtime/requests"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({ "agentId": "resilient", "input": { "text": "hi" } }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let accepted: Value = response.json().await.unwrap();
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    // Wait until the model call is in flight, then die without a word.
    for _ in 0..200 {
        if !upstream.calls().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    server.kill9();
    // The agent leaves the workspace before the restart.
    let agents =
        std::fs::read_to_string(workspace.path().join("config/agents/agents.yaml")).unwrap();
    let kept: Vec<&str> = agents
        .split("---\n")
        .filter(|doc| !doc.contains("name: resilient"))
        .collect();
    workspace.write("config/agents/agents.yaml", kept.join("---\n"));
    let server = ServerProcess::start(workspace.path(), &[]);
    let view = super::wait_until_done_at(&http, &server.base, &request_id).await;
    assert_eq!(view["status"], "failed", "{view}");
    let message = view["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`resilient` no longer exists"),
        "{message}"
    );
    server.terminate();
}
