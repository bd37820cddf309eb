//! The Responses API and client tools over HTTP: the response object and the exact stream
//! event sequence, stored responses and `previous_response_id` chains owned by their key,
//! stateless clients, and tools the client supplies governed by policy (returned, denied or
//! held for an operator), on `/v1/responses` and `/v1/chat/completions`.

use std::time::Duration;

use serde_json::{Value, json};

use super::control::OTHER_CLIENT_KEY;
use super::tools::{ToolServer, offered_functions};
use super::upstream::{MockUpstream, Reply};
use super::{
    ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace, approve_pending, request_id_header, types,
};
use crate::helpers::TestWorkspace;

/// The API workspace plus the agent `coder`, which takes client tools (risk medium) beside
/// its own `weather.lookup`. Policy: `client.rm` is denied, `client.shell` needs an operator.
fn coder_workspace(
    upstream: &MockUpstream,
    tools: &ToolServer,
    approval_wait: &str,
) -> TestWorkspace {
    let runtime = format!(
        "  protocols:\n    openai:\n      approvalWait: {approval_wait}\n  governance:\n    default: allow\n    rules:\n      - {{ name: no-rm, match: {{ tools: [\"client.rm\"] }}, decision: deny, reason: removing files is not allowed }}\n      - {{ name: shell-needs-human, match: {{ tools: [\"client.shell\"] }}, decision: needs_approval }}\n"
    );
    let workspace = api_workspace(upstream, &runtime);
    workspace.write(
        "config/catalogs/tools.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: {{ name: tools }}\nspec:\n  tools:\n    - id: weather.lookup\n      inputSchema: {{ type: object, properties: {{ city: {{ type: string }} }}, required: [city] }}\n      risk: low\n      http: {{ method: POST, url: \"{url}/weather\" }}\n",
            url = tools.url
        ),
    );
    workspace.write(
        "config/agents/coder.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: coder }\nspec:\n  backend: openai\n  model: main\n  instructions: You write code.\n  tools: [weather.lookup]\n  clientTools: { enabled: true, risk: medium }\n",
    );
    workspace
}

fn patch_tool() -> Value {
    json!({ "type": "function", "name": "apply_patch", "description": "Apply a patch",
        "parameters": { "type": "object", "properties": { "patch": { "type": "string" } }, "required": ["patch"] } })
}

/// The client's tools as a coding CLI sends them: functions, and types only it knows.
fn client_tools() -> Value {
    json!([patch_tool(), { "type": "web_search" }, { "type": "local_shell" },
        { "type": "function", "name": "rm", "parameters": { "type": "object" } },
        { "type": "function", "name": "shell", "parameters": { "type": "object" } }])
}

async fn post_as(app: &TestApp, key: &str, path: &str, body: &Value) -> (u16, Value, String) {
    let response = super::send_post(&app.http, &app.url(path), key, body).await;
    let status = response.status().as_u16();
    let request_id = response
        .headers()
        .get("x-stable-harness-request-id")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (
        status,
        response.json().await.unwrap_or(Value::Null),
        request_id,
    )
}

async fn respond(app: &TestApp, body: &Value) -> (u16, Value, String) {
    post_as(app, CLIENT_KEY, "/v1/responses", body).await
}

/// The `(type, data)` of each event of an SSE body.
fn sse_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter_map(|block| {
            let kind = block.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = block.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((kind.to_owned(), serde_json::from_str(data).unwrap()))
        })
        .collect()
}

fn roles(call: &Value) -> Vec<String> {
    call["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap().to_owned())
        .collect()
}

/// The coder agent's app on the store at `database_url` (the embedded one without), with
/// its upstream and its tools' server.
async fn coder_app_on(database_url: Option<String>) -> (MockUpstream, ToolServer, TestApp) {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn_on(
        coder_workspace(&upstream, &tools, "5s"),
        database_url,
        &[CLIENT_KEY],
        &[ADMIN_KEY],
    )
    .await;
    (upstream, tools, app)
}

async fn stored_and_chained(database_url: Option<String>) {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn_on(
        coder_workspace(&upstream, &tools, "5s"),
        database_url,
        &[CLIENT_KEY, OTHER_CLIENT_KEY],
        &[ADMIN_KEY],
    )
    .await;
    upstream.push([
        Reply::Text("Hello there".into()),
        Reply::Text("Again".into()),
    ]);
    let (status, first, request_id) = respond(
        &app,
        &json!({ "model": "coder", "input": "hi", "instructions": "Be brief", "tools": [],
            "include": ["reasoning.encrypted_content"], "some_future_field": { "x": 1 } }),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("resp_"), "{id}");
    assert_eq!(first["object"], "response");
    assert_eq!(first["status"], "completed");
    assert_eq!(first["instructions"], "Be brief");
    assert_eq!(first["output"][0]["type"], "message");
    assert_eq!(first["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(first["output"][0]["content"][0]["text"], "Hello there");
    for field in ["input_tokens", "output_tokens", "total_tokens"] {
        assert!(first["usage"][field].is_u64(), "{field}: {first}");
    }
    assert!(first["usage"]["input_tokens_details"]["cached_tokens"].is_u64());
    assert!(first["usage"]["output_tokens_details"]["reasoning_tokens"].is_u64());
    // A response is a request, visible as one.
    let (status, view) = app
        .get(&format!("/runtime/requests/{request_id}"), CLIENT_KEY)
        .await;
    assert_eq!(
        (status, view["output"].as_str()),
        (200, Some("Hello there"))
    );
    assert_eq!(
        roles(&upstream.calls()[0].body),
        ["system", "system", "user"]
    );

    // Stored: its owner reads it back; another key and unknown ids get 404.
    let (status, fetched) = app.get(&format!("/v1/responses/{id}"), CLIENT_KEY).await;
    assert_eq!(status, 200, "{fetched}");
    assert_eq!(fetched["output"], first["output"]);
    assert_eq!(fetched["status"], "completed");
    assert_eq!(fetched["instructions"], "Be brief");
    let (status, other) = app
        .get(&format!("/v1/responses/{id}"), OTHER_CLIENT_KEY)
        .await;
    assert_eq!(
        (status, other["error"]["code"].as_str()),
        (404, Some("response_not_found"))
    );
    let (status, _) = app.get("/v1/responses/resp_nope", CLIENT_KEY).await;
    assert_eq!(status, 404);

    // The chain: the stored transcript and answer, without the first call's instructions.
    let (status, second, _) = respond(
        &app,
        &json!({ "model": "coder", "input": [{ "role": "user", "content": [{ "type": "input_text", "text": "and again?" }] }],
            "previous_response_id": id }),
    )
    .await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["previous_response_id"], json!(id));
    assert_eq!(second["output"][0]["content"][0]["text"], "Again");
    let sent = &upstream.calls()[1].body["messages"];
    assert_eq!(
        roles(&upstream.calls()[1].body),
        ["system", "user", "assistant", "user"]
    );
    assert_eq!(sent[1]["content"], "hi");
    assert_eq!(sent[2]["content"], "Hello there");
    assert!(!sent.to_string().contains("Be brief"), "{sent}");

    // Another key cannot continue it; `store: false` is never found.
    let (status, refused, _) = post_as(
        &app,
        OTHER_CLIENT_KEY,
        "/v1/responses",
        &json!({ "model": "coder", "input": "x", "previous_response_id": id }),
    )
    .await;
    assert_eq!(
        (status, refused["error"]["param"].as_str()),
        (404, Some("previous_response_id"))
    );
    upstream.push([Reply::Text("unstored".into())]);
    let (status, unstored, _) = respond(
        &app,
        &json!({ "model": "coder", "input": "x", "store": false }),
    )
    .await;
    assert_eq!(status, 200);
    let unstored_id = unstored["id"].as_str().unwrap();
    let (status, _) = app
        .get(&format!("/v1/responses/{unstored_id}"), CLIENT_KEY)
        .await;
    assert_eq!(status, 404);
    let (status, _, _) = respond(
        &app,
        &json!({ "model": "coder", "input": "x", "previous_response_id": unstored_id }),
    )
    .await;
    assert_eq!(status, 404);
}

on_both_stores!(stored_and_chained);

#[tokio::test]
async fn a_stream_has_the_exact_event_sequence() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(coder_workspace(&upstream, &tools, "5s")).await;
    upstream.push([Reply::Text("one two three".into())]);
    let response = app
        .http
        .post(app.url("/v1/responses"))
        .bearer_auth(CLIENT_KEY)
        .header("x-stable-harness-session-id", "my-session")
        .header("x-stable-harness-events", "true")
        .json(&json!({ "model": "coder", "input": "count", "stream": true }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["x-stable-harness-session-id"],
        "my-session"
    );
    // The opted-in progress events come as named events of their own, outside the sequence.
    let (progress, events): (Vec<_>, Vec<_>) = sse_events(&response.text().await.unwrap())
        .into_iter()
        .partition(|(kind, _)| kind.starts_with("stable_harness."));
    assert!(
        progress
            .iter()
            .any(|(kind, _)| kind == "stable_harness.progress.narration"),
        "{progress:?}"
    );
    let kinds: Vec<&str> = events.iter().map(|(kind, _)| kind.as_str()).collect();
    let deltas = kinds
        .iter()
        .filter(|k| **k == "response.output_text.delta")
        .count();
    assert!(deltas >= 1, "{kinds:?}");
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(kinds, expected);
    for (number, (kind, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], json!(kind));
        assert_eq!(data["sequence_number"], json!(number));
    }
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(events[0].1["response"]["output"], json!([]));
    let item_id = events[2].1["item"]["id"].clone();
    let text: String = events
        .iter()
        .filter(|(kind, _)| kind == "response.output_text.delta")
        .map(|(_, data)| {
            assert_eq!(
                (
                    &data["item_id"],
                    &data["output_index"],
                    &data["content_index"]
                ),
                (&item_id, &json!(0), &json!(0))
            );
            data["delta"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(text, "one two three");
    let completed = &events.last().unwrap().1["response"];
    assert_eq!(completed["status"], "completed");
    assert_eq!(
        completed["output"][0]["content"][0]["text"],
        "one two three"
    );
    assert!(completed["usage"]["total_tokens"].is_u64());
}

/// A turn that calls a server tool and a client tool: the server call runs, only the client
/// call is returned, and the next call gives the model both results. `stateless`: the client
/// sends the whole input again with `store: false` instead of `previous_response_id`.
async fn mixed_turn(stateless: bool) {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(coder_workspace(&upstream, &tools, "5s")).await;
    upstream.push([
        Reply::ToolCalls(vec![
            ("weather_lookup".into(), r#"{"city":"Paris"}"#.into()),
            ("apply_patch".into(), r#"{"patch":"fix"}"#.into()),
        ]),
        Reply::Text("Done".into()),
    ]);
    // With the file to fix (5 KB): a transcript long enough to be named by the next turn.
    let fix_it = format!("fix it: {}", "line\n".repeat(1_000));
    let first_input = json!([{ "role": "user", "content": fix_it }]);
    let (status, first, first_request) = respond(
        &app,
        &json!({ "model": "coder", "input": first_input, "tools": client_tools(), "store": !stateless }),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["status"], "completed");
    let output = first["output"].as_array().unwrap();
    assert_eq!(
        output.len(),
        1,
        "only the client's call comes back: {first}"
    );
    let call = &output[0];
    assert_eq!(
        (call["type"].as_str(), call["name"].as_str()),
        (Some("function_call"), Some("apply_patch"))
    );
    assert_eq!(call["arguments"], r#"{"patch":"fix"}"#);
    assert!(call["id"].as_str().unwrap().starts_with("fc_"));
    let call_id = call["call_id"].as_str().unwrap().to_owned();
    assert_eq!(tools.count("/weather"), 1, "the server's call ran");
    // The model was offered the client's function tools, by their own names, beside the agent's.
    assert_eq!(
        offered_functions(&upstream, 0),
        ["weather_lookup", "apply_patch", "rm", "shell"]
    );
    let first_events = types(&app.events(&first_request).await);
    assert!(
        first_events.contains(&"runtime.tool.client.requested".to_owned()),
        "{first_events:?}"
    );

    let output_item =
        json!({ "type": "function_call_output", "call_id": call_id, "output": "patched OK" });
    let body = if stateless {
        let mut input = first_input.as_array().unwrap().clone();
        input.push(call.clone());
        input.push(output_item);
        json!({ "model": "coder", "input": input, "tools": client_tools(), "store": false })
    } else {
        json!({ "model": "coder", "input": [output_item], "tools": client_tools(), "previous_response_id": first["id"] })
    };
    let (status, second, second_request) = respond(&app, &body).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["output"][0]["content"][0]["text"], "Done");
    let sent = upstream.calls()[1].body["messages"]
        .as_array()
        .unwrap()
        .clone();
    let turn = sent
        .iter()
        .find(|m| m["tool_calls"].is_array())
        .unwrap_or_else(|| panic!("{sent:#?}"));
    let names: Vec<&str> = turn["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["weather_lookup", "apply_patch"],
        "the stored turn: {sent:?}"
    );
    let results: Vec<&Value> = sent.iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(results.len(), 2, "{sent:?}");
    assert!(results[0]["content"].as_str().unwrap().contains("Paris"));
    assert_eq!(results[1]["content"], "patched OK");
    assert_eq!(results[1]["tool_call_id"], json!(call_id));
    assert_eq!(
        tools.count("/weather"),
        1,
        "the server's call never runs twice"
    );
    let events = app.events(&second_request).await;
    let completed = events
        .iter()
        .find(|e| e["type"] == "runtime.tool.client.completed")
        .unwrap_or_else(|| panic!("{:?}", types(&events)));
    assert_eq!(completed["data"]["toolCallId"], json!(call_id));
    assert_eq!(completed["data"]["output"], "patched OK");
    assert_eq!(completed["data"]["requestId"], json!(first_request));
    if stateless {
        // The input sent whole again is stored as what it adds to the first turn's, named.
        let db = crate::helpers::store_path(app.workspace.path());
        let stored = crate::helpers::stored_input(&db, &second_request);
        assert_eq!(stored["prefixOf"], json!(first_request), "{stored}");
        assert_eq!(stored["prefixLen"], 1, "{stored}");
        return;
    }
    // The chain goes on from the stored turns that stood in for the client's copy.
    upstream.push([Reply::Text("You are welcome".into())]);
    let (status, third, _) = respond(
        &app,
        &json!({ "model": "coder", "input": "thanks", "tools": client_tools(), "previous_response_id": second["id"] }),
    )
    .await;
    assert_eq!(status, 200, "{third}");
    let resent = &upstream.calls()[2].body["messages"];
    let mut expected = sent.clone();
    expected.push(json!({ "role": "assistant", "content": "Done" }));
    expected.push(json!({ "role": "user", "content": "thanks" }));
    assert_eq!(resent, &json!(expected));
}

/// What the model is sent on a turn continuing a chain (the coder agent's instructions, the
/// turn's own, then `turns` as user and assistant messages).
fn chain_transcript(instructions: &str, turns: &[&str]) -> Value {
    let mut messages = vec![
        json!({ "role": "system", "content": "You write code." }),
        json!({ "role": "system", "content": instructions }),
    ];
    for (index, text) in turns.iter().enumerate() {
        let role = if index % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({ "role": role, "content": text }));
    }
    Value::Array(messages)
}

/// The contents of a session's history, root first.
async fn session_history(app: &TestApp, session: &str) -> Vec<String> {
    let (status, view) = app
        .get(&format!("/runtime/sessions/{session}"), CLIENT_KEY)
        .await;
    assert_eq!(status, 200, "{view}");
    view["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m["content"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

/// A client that keeps its own transcript (no `previous_response_id`, the whole input each
/// turn, the answers sent back as output items) in a session named by `user`: each message is
/// stored once, and the model hears the input as sent, with each turn's own instructions.
#[tokio::test]
async fn a_transcript_sent_whole_into_a_session_is_stored_once() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(coder_workspace(&upstream, &tools, "5s")).await;
    upstream.push((1..=3).map(|n| Reply::Text(format!("a{n}"))));
    let mut input: Vec<Value> = Vec::new();
    let mut said = Vec::new();
    let mut session = String::new();
    for n in 1..=3 {
        input.push(json!({ "role": "user", "content": format!("q{n}") }));
        said.push(format!("q{n}"));
        let instructions = format!("Rule {n}");
        let (status, response, request_id) = respond(
            &app,
            &json!({ "model": "coder", "user": "ada", "store": false,
                "instructions": instructions, "input": input }),
        )
        .await;
        assert_eq!(status, 200, "{response}");
        let turns: Vec<&str> = said.iter().map(String::as_str).collect();
        assert_eq!(
            upstream.calls()[n - 1].body["messages"],
            chain_transcript(&instructions, &turns)
        );
        input.push(response["output"][0].clone());
        said.push(format!("a{n}"));
        let (_, view) = app
            .get(&format!("/runtime/requests/{request_id}"), CLIENT_KEY)
            .await;
        session = view["sessionId"].as_str().unwrap().to_owned();
    }
    assert_eq!(session_history(&app, &session).await, said);
    let (_, view) = app
        .get(&format!("/runtime/sessions/{session}"), CLIENT_KEY)
        .await;
    assert_eq!(view["messages"].as_array().unwrap().len(), 6, "{view:#}");
}

/// A `previous_response_id` chain is held in its session: each turn stores what is new to it
/// and names where the chain ends, and the model is sent the whole chain, each turn with only
/// its own instructions. A first turn that replays an exchange is continued from a copy, as is
/// a turn the client puts in another session; a chain branches from any of its responses.
async fn a_chain_is_held_in_its_session(database_url: Option<String>) {
    let embedded = database_url.is_none();
    let (upstream, _tools, app) = coder_app_on(database_url).await;
    // Twenty turns: past the length from which the runtime keeps a session's newest path in
    // memory (32 messages), so that later turns read only what is below it.
    const TURNS: usize = 20;
    let questions: Vec<String> = (1..=TURNS).map(|n| format!("q{n}")).collect();
    let answers: Vec<String> = (1..=TURNS).map(|n| format!("a{n}")).collect();
    let mut chain = vec!["q0", "a0"];
    upstream.push(answers.iter().map(|a| Reply::Text(a.clone())));
    let mut ids = Vec::new();
    let mut session = String::new();
    for (turn, (question, answer)) in questions.iter().zip(&answers).enumerate() {
        let instructions = format!("Rule {turn}");
        let body = match ids.last() {
            None => json!({ "model": "coder", "instructions": instructions, "input": [
                { "role": "user", "content": "q0" }, { "role": "assistant", "content": "a0" },
                { "role": "user", "content": question }] }),
            Some(previous) => json!({ "model": "coder", "instructions": instructions,
                "input": question, "previous_response_id": previous }),
        };
        let (status, response, request_id) = respond(&app, &body).await;
        assert_eq!(status, 200, "turn {turn}: {response}");
        assert_eq!(response["output"][0]["content"][0]["text"], json!(answer));
        chain.push(question.as_str());
        assert_eq!(
            upstream.calls()[turn].body["messages"],
            chain_transcript(&instructions, &chain),
            "turn {turn}"
        );
        chain.push(answer.as_str());
        ids.push(response["id"].as_str().unwrap().to_owned());
        let (_, view) = app
            .get(&format!("/runtime/requests/{request_id}"), CLIENT_KEY)
            .await;
        let this_session = view["sessionId"].as_str().unwrap().to_owned();
        if turn > 0 {
            assert_eq!(this_session, session, "a chain is one session");
        }
        session = this_session;
    }
    // From the second turn on the session holds the whole chain, stored once: the copy the
    // second turn began from, then each turn's question and answer.
    assert_eq!(session_history(&app, &session).await, chain);
    let (_, view) = app
        .get(&format!("/runtime/sessions/{session}"), CLIENT_KEY)
        .await;
    let stored = view["messages"].as_array().unwrap().len();
    assert_eq!(stored, 2 + 6 + 2 * (TURNS - 2), "{view:#}");
    if embedded {
        // A chained turn's stored input: its own message and instructions, and where the
        // chain it continues ends, never the chain.
        let input = crate::helpers::stored_input(
            &crate::helpers::store_path(app.workspace.path()),
            &format!("req_{}", ids[TURNS - 1].trim_start_matches("resp_")),
        );
        assert_eq!(
            input["messages"],
            json!([{ "role": "user", "content": "q20" }]),
            "{input}"
        );
        assert_eq!(
            input["leading"],
            json!([{ "role": "system", "content": "Rule 19" }])
        );
        assert!(
            input["surface"].get("instructions").is_none(),
            "instructions stored once: {input}"
        );
        assert!(input["historyThrough"].is_string(), "{input}");
        assert!(input["transcriptThrough"].is_string(), "{input}");
    }

    // A branch from the fourth response sees the chain to there only, and so does the turn
    // after it; the chain's own next turn sees the chain.
    upstream.push([
        Reply::Text("ab".into()),
        Reply::Text("ac".into()),
        Reply::Text("a21".into()),
    ]);
    let mut branched = chain[..2 + 2 * 4].to_vec();
    let mut previous = ids[3].clone();
    for (question, answer) in [("qb", "ab"), ("qc", "ac")] {
        let (status, branch, _) = respond(
            &app,
            &json!({ "model": "coder", "instructions": "Rule b", "input": question, "previous_response_id": previous }),
        )
        .await;
        assert_eq!(status, 200, "{branch}");
        branched.push(question);
        let call = upstream.calls().len() - 1;
        assert_eq!(
            upstream.calls()[call].body["messages"],
            chain_transcript("Rule b", &branched)
        );
        branched.push(answer);
        previous = branch["id"].as_str().unwrap().to_owned();
    }
    let (status, _, _) = respond(
        &app,
        &json!({ "model": "coder", "instructions": "Rule 21", "input": "q21", "previous_response_id": ids[TURNS - 1] }),
    )
    .await;
    assert_eq!(status, 200);
    let mut main_line = chain.clone();
    main_line.push("q21");
    assert_eq!(
        upstream.calls().last().unwrap().body["messages"],
        chain_transcript("Rule 21", &main_line)
    );

    // Continued in another session, the chain starts there from a copy, and goes on from it.
    upstream.push([Reply::Text("ax".into()), Reply::Text("ay".into())]);
    let other = "chain-elsewhere";
    let response = app
        .http
        .post(app.url("/v1/responses"))
        .bearer_auth(CLIENT_KEY)
        .header("x-stable-harness-session-id", other)
        .json(&json!({ "model": "coder", "instructions": "Rule x", "input": "qx", "previous_response_id": ids[TURNS - 1] }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let moved: Value = response.json().await.unwrap();
    let (status, _, _) = respond(
        &app,
        &json!({ "model": "coder", "instructions": "Rule y", "input": "qy", "previous_response_id": moved["id"] }),
    )
    .await;
    assert_eq!(status, 200);
    let mut elsewhere = chain.clone();
    elsewhere.extend(["qx", "ax", "qy"]);
    assert_eq!(
        upstream.calls().last().unwrap().body["messages"],
        chain_transcript("Rule y", &elsewhere)
    );
    elsewhere.push("ay");
    assert_eq!(session_history(&app, other).await, elsewhere);
}

on_both_stores!(a_chain_is_held_in_its_session);

on_both_stores!(a_chains_instructions_the_same_each_turn_are_stored_once);

/// An agent sends its own instructions every turn of a chain: a turn whose instructions are
/// the previous turn's names the turn that stores them instead of storing them again, and the
/// model, the response object and a retry each see them whole; changed instructions are
/// stored anew and named from there on.
async fn a_chains_instructions_the_same_each_turn_are_stored_once(database_url: Option<String>) {
    let embedded = database_url.is_none();
    let (upstream, _tools, app) = coder_app_on(database_url).await;
    let rules = ["Rule A", "Rule A", "Rule A", "Rule B", "Rule B", "Rule B"];
    // The sixth turn's first run fails; an operator retries it.
    upstream.push((1..=5).map(|n| Reply::Text(format!("a{n}"))));
    upstream.push([Reply::StatusBody {
        status: 400,
        body: r#"{"error":{"message":"bad request"}}"#.into(),
    }]);
    upstream.set_default(Reply::Text("a6".into()));
    let mut chain: Vec<String> = Vec::new();
    let mut ids: Vec<String> = Vec::new();
    let mut requests: Vec<String> = Vec::new();
    for (turn, rule) in rules.iter().enumerate() {
        let question = format!("q{}", turn + 1);
        let mut body = json!({ "model": "coder", "instructions": rule, "input": question });
        if let Some(previous) = ids.last() {
            body["previous_response_id"] = json!(previous);
        }
        let (status, response, request_id) = respond(&app, &body).await;
        let refused = turn == rules.len() - 1;
        assert_eq!(
            status,
            if refused { 502 } else { 200 },
            "turn {turn}: {response}"
        );
        chain.push(question);
        let heard: Vec<&str> = chain.iter().map(String::as_str).collect();
        assert_eq!(
            upstream.calls()[turn].body["messages"],
            chain_transcript(rule, &heard),
            "turn {turn}"
        );
        chain.push(format!("a{}", turn + 1));
        ids.push(format!("resp_{}", request_id.trim_start_matches("req_")));
        requests.push(request_id);
    }
    // Each response shows its own instructions.
    for (id, rule) in ids[..ids.len() - 1].iter().zip(rules) {
        let (status, fetched) = app.get(&format!("/v1/responses/{id}"), CLIENT_KEY).await;
        assert_eq!(status, 200, "{fetched}");
        assert_eq!(fetched["instructions"], rule, "{fetched}");
    }
    if embedded {
        app.assert_leading_held(&requests, &rules);
    }
    // The sixth turn failed (the model refused it); retried, it is sent its instructions.
    app.retried_to_completion(&requests[5]).await;
    let heard: Vec<&str> = chain[..chain.len() - 1]
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(
        upstream.calls().last().unwrap().body["messages"],
        chain_transcript("Rule B", &heard)
    );
    let retried = &ids[ids.len() - 1];
    let (status, fetched) = app
        .get(&format!("/v1/responses/{retried}"), CLIENT_KEY)
        .await;
    assert_eq!(status, 200, "{fetched}");
    assert_eq!(fetched["instructions"], "Rule B", "{fetched}");
}

on_both_stores!(an_agent_loops_instructions_are_named_where_its_transcript_is);

/// An agent's loop with no `previous_response_id` (the Agents SDK's) sends its instructions
/// and its whole input every call: a turn naming the request that holds its transcript's
/// first messages names its instructions there too when they are the same, and holds its
/// own when they differ (and after, until a turn holds the transcript again). The model,
/// a retry and the response object see them whole each turn; a turn continuing a naming
/// turn's session, or its chain, holds them in its own session.
async fn an_agent_loops_instructions_are_named_where_its_transcript_is(
    database_url: Option<String>,
) {
    let (upstream, _tools, app) = coder_app_on(database_url.clone()).await;
    // The third turn's first run fails; an operator retries it.
    upstream.push([Reply::Text("ok".into()), Reply::Text("ok".into())]);
    upstream.push([Reply::StatusBody {
        status: 400,
        body: r#"{"error":{"message":"bad request"}}"#.into(),
    }]);
    upstream.set_default(Reply::Text("ok".into()));
    // Long enough (5 KB) for the first turn to be named by those after it.
    let first = format!("q1 {}", "x".repeat(5_000));
    let rules = ["Rule A", "Rule A", "Rule A", "Rule B", "Rule B", "Rule A"];
    let mut said: Vec<String> = Vec::new();
    let (mut ids, mut requests) = (Vec::new(), Vec::new());
    for (turn, rule) in rules.iter().enumerate() {
        said.push(if turn == 0 {
            first.clone()
        } else {
            format!("q{}", turn + 1)
        });
        let input: Vec<Value> = said
            .iter()
            .enumerate()
            .map(|(at, text)| {
                let role = if at % 2 == 0 { "user" } else { "assistant" };
                json!({ "role": role, "content": text })
            })
            .collect();
        let body = json!({ "model": "coder", "instructions": rule, "input": input });
        let (status, response, request_id) = respond(&app, &body).await;
        if turn == 2 {
            assert_eq!(status, 502, "turn {turn}: {response}");
            // Retried, its run starts from the store: the instructions read where named.
            app.retried_to_completion(&request_id).await;
        } else {
            assert_eq!(status, 200, "turn {turn}: {response}");
        }
        let heard: Vec<&str> = said.iter().map(String::as_str).collect();
        assert_eq!(
            upstream.calls().last().unwrap().body["messages"],
            chain_transcript(rule, &heard),
            "turn {turn}"
        );
        said.push("ok".into());
        ids.push(format!("resp_{}", request_id.trim_start_matches("req_")));
        requests.push(request_id);
    }
    for (id, rule) in ids.iter().zip(rules) {
        let (status, fetched) = app.get(&format!("/v1/responses/{id}"), CLIENT_KEY).await;
        assert_eq!(status, 200, "{fetched}");
        assert_eq!(fetched["instructions"], rule, "{fetched}");
    }
    let stored = |id: &str| super::control::stored_input_of(&app, database_url.as_deref(), id);
    let holds = |input: &Value, rule: &str| {
        assert_eq!(
            input["leading"],
            json!([{ "role": "system", "content": rule }]),
            "{input}"
        );
        assert!(input.get("leadingOf").is_none(), "{input}");
    };
    let holder = stored(&requests[0]);
    holds(&holder, "Rule A");
    let digest = holder["leadingDigest"].as_str().unwrap_or_default();
    assert_eq!(digest.len(), 64, "{holder}");
    for (turn, rule) in rules.iter().enumerate().skip(1) {
        let input = stored(&requests[turn]);
        assert_eq!(
            input["prefixOf"],
            json!(requests[0]),
            "turn {turn}: {input}"
        );
        if turn < 3 {
            assert_eq!(
                input["leadingOf"],
                json!(requests[0]),
                "turn {turn}: {input}"
            );
            assert_eq!(
                input["leadingDigest"],
                json!(digest),
                "turn {turn}: {input}"
            );
            assert!(input.get("leading").is_none(), "turn {turn}: {input}");
        } else {
            // Its own, held: the holder's differ, or (the last) the turn it continues
            // held its own, which says nothing of the holder's.
            holds(&input, rule);
            assert!(input.get("leadingDigest").is_none(), "turn {turn}: {input}");
        }
    }
    // A turn in a naming turn's session, continuing what that session holds: it holds its
    // instructions, never naming another session's request for them.
    let (status, view) = app
        .get(&format!("/runtime/requests/{}", requests[1]), CLIENT_KEY)
        .await;
    assert_eq!(status, 200, "{view}");
    let session = view["sessionId"].as_str().unwrap().to_owned();
    let input = json!([{ "role": "user", "content": "q2" }, { "role": "assistant", "content": "ok" },
        { "role": "user", "content": "q-session" }]);
    let response = app
        .http
        .post(app.url("/v1/responses"))
        .bearer_auth(CLIENT_KEY)
        .header("x-stable-harness-session-id", &session)
        .json(&json!({ "model": "coder", "instructions": "Rule A", "input": input }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let in_session: Value = response.json().await.unwrap();
    let in_session = in_session["id"].as_str().unwrap().replace("resp_", "req_");
    holds(&stored(&in_session), "Rule A");
    // A chain from the second turn: the same.
    let body = json!({ "model": "coder", "instructions": "Rule A", "input": "q-chain",
        "previous_response_id": ids[1] });
    let (status, response, chained) = respond(&app, &body).await;
    assert_eq!(status, 200, "{response}");
    let mut heard: Vec<&str> = said[..4].iter().map(String::as_str).collect();
    heard.push("q-chain");
    assert_eq!(
        upstream.calls().last().unwrap().body["messages"],
        chain_transcript("Rule A", &heard)
    );
    holds(&stored(&chained), "Rule A");
}

#[tokio::test]
async fn a_mixed_turn_continues_with_previous_response_id() {
    mixed_turn(false).await;
}

#[tokio::test]
async fn a_mixed_turn_continues_for_a_stateless_client() {
    mixed_turn(true).await;
}

#[tokio::test]
async fn policy_denies_a_client_tool_and_holds_another_for_an_operator() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(coder_workspace(&upstream, &tools, "20s")).await;
    // Denied: the model reads the denial and answers.
    upstream.push([
        Reply::call("rm", r#"{"path":"/"}"#),
        Reply::Text("I may not.".into()),
    ]);
    let (status, denied, request_id) = respond(
        &app,
        &json!({ "model": "coder", "input": "clean up", "tools": client_tools() }),
    )
    .await;
    assert_eq!(status, 200, "{denied}");
    assert_eq!(denied["output"][0]["content"][0]["text"], "I may not.");
    let denial = upstream.calls()[1].body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .cloned()
        .unwrap();
    assert!(
        denial["content"]
            .as_str()
            .unwrap()
            .contains("removing files is not allowed"),
        "{denial}"
    );
    let events = types(&app.events(&request_id).await);
    assert!(
        events.contains(&"runtime.tool.denied".to_owned()),
        "{events:?}"
    );
    // Operators can ask the policy about client tools before any client sends one.
    for (tool, decision, rule) in [
        ("client.rm", "deny", json!("no-rm")),
        ("client.shell", "needs_approval", json!("shell-needs-human")),
        ("client.apply_patch", "allow", Value::Null),
    ] {
        let (status, explained) = app
            .post(
                "/admin/policy/explain",
                ADMIN_KEY,
                &json!({ "agentId": "coder", "toolId": tool, "arguments": {} }),
            )
            .await;
        assert_eq!(status, 200, "{explained}");
        assert_eq!(
            (explained["decision"].as_str(), &explained["rule"]),
            (Some(decision), &rule)
        );
        assert_eq!(explained["allowedForAgent"], true);
    }
    let (status, _) = app
        .post(
            "/admin/policy/explain",
            ADMIN_KEY,
            &json!({ "agentId": "assistant", "toolId": "client.rm", "arguments": {} }),
        )
        .await;
    assert_eq!(status, 404, "an agent without client tools has none");

    // Needs approval: the client waits while an operator approves, then gets the call.
    upstream.push([Reply::call("shell", r#"{"cmd":"ls"}"#)]);
    let waiting = {
        let (http, url) = (app.http.clone(), app.url("/v1/responses"));
        tokio::spawn(async move {
            let response = http
                .post(url)
                .bearer_auth(CLIENT_KEY)
                .json(&json!({ "model": "coder", "input": "list files", "tools": client_tools(), "stream": true }))
                .send()
                .await
                .unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        })
    };
    let approval = app.pending_approval().await;
    assert_eq!(approval["toolId"], "client.shell");
    assert_eq!(approve_pending(&app.http, &app.base).await, 1);
    let (status, body) = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, 200);
    let events = sse_events(&body);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    assert_eq!(events[2].1["item"]["arguments"], "");
    assert_eq!(events[5].1["item"]["arguments"], r#"{"cmd":"ls"}"#);
    let output = &events[6].1["response"]["output"];
    assert_eq!(
        (output[0]["name"].as_str(), output[0]["arguments"].as_str()),
        (Some("shell"), Some(r#"{"cmd":"ls"}"#))
    );
}

#[tokio::test]
async fn chat_completions_return_client_calls_streamed_and_not() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(coder_workspace(&upstream, &tools, "5s")).await;
    let chat_tools = json!([{ "type": "function", "function": { "name": "apply_patch",
        "parameters": { "type": "object", "properties": { "patch": { "type": "string" } } } } }]);
    upstream.push([
        Reply::call("apply_patch", r#"{"patch":"a"}"#),
        Reply::ToolCalls(vec![
            ("apply_patch".into(), r#"{"patch":"b"}"#.into()),
            ("apply_patch".into(), r#"{"patch":"c"}"#.into()),
        ]),
        Reply::Text("All patched".into()),
    ]);
    // A question past 4 KiB: each turn after the first carries it on as the turn before
    // sent it, then takes it back to complete the client's calls with their stored turns.
    let go = format!("go {}", "g".repeat(5_000));
    let (response, _) = app
        .chat(&json!({ "model": "coder", "messages": [{ "role": "user", "content": go }], "tools": chat_tools, "tool_choice": "auto" }))
        .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    let call = body["choices"][0]["message"]["tool_calls"][0].clone();
    assert_eq!(call["function"]["name"], "apply_patch");
    assert_eq!(call["function"]["arguments"], r#"{"patch":"a"}"#);

    // Streamed: each call has its index, its name, then its arguments; then `tool_calls`.
    let mut messages = vec![
        json!({ "role": "user", "content": go }),
        body["choices"][0]["message"].clone(),
        json!({ "role": "tool", "tool_call_id": call["id"], "content": "a applied" }),
    ];
    let (response, _) = app
        .chat(
            &json!({ "model": "coder", "messages": messages, "tools": chat_tools, "stream": true }),
        )
        .await;
    let text = response.text().await.unwrap();
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let fragments: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert_eq!(fragments.len(), 4, "{text}");
    assert_eq!(
        fragments
            .iter()
            .map(|f| f["index"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 0, 1, 1]
    );
    assert_eq!(fragments[0]["function"]["arguments"], "");
    assert_eq!(fragments[1]["function"]["arguments"], r#"{"patch":"b"}"#);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    assert!(text.trim_end().ends_with("data: [DONE]"));
    // The model saw the first result as the client reported it.
    assert!(
        upstream.calls()[1].body["messages"]
            .to_string()
            .contains("a applied")
    );

    let ids: Vec<Value> = [&fragments[0], &fragments[2]]
        .iter()
        .map(|f| f["id"].clone())
        .collect();
    messages.push(json!({ "role": "assistant", "content": null, "tool_calls": [
        { "id": ids[0], "type": "function", "function": { "name": "apply_patch", "arguments": "{\"patch\":\"b\"}" } },
        { "id": ids[1], "type": "function", "function": { "name": "apply_patch", "arguments": "{\"patch\":\"c\"}" } }] }));
    messages.push(json!({ "role": "tool", "tool_call_id": ids[0], "content": "b applied" }));
    messages.push(json!({ "role": "tool", "tool_call_id": ids[1], "content": "c applied" }));
    let (response, request_id) = app
        .chat(&json!({ "model": "coder", "messages": messages, "tools": chat_tools }))
        .await;
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "All patched");
    // Every model call heard the question whole, first after the agent's instructions.
    for call in upstream.calls() {
        assert_eq!(call.body["messages"][1]["content"], go.as_str());
    }
    let completed = app
        .events(&request_id)
        .await
        .into_iter()
        .filter(|e| e["type"] == "runtime.tool.client.completed")
        .count();
    assert_eq!(completed, 2);
}

#[tokio::test]
async fn bad_input_is_refused_with_its_param() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(coder_workspace(&upstream, &tools, "5s")).await;
    upstream.set_default(Reply::Text("fine".into()));
    let cases = [
        (
            json!({ "model": "coder", "input": [{ "type": "function_call_output", "call_id": "call_unknown", "output": "x" }] }),
            400,
            "invalid_parameter",
            json!("input[0].call_id"),
        ),
        (
            json!({ "model": "coder", "input": "x", "tools": [{ "type": "function", "name": "bad", "parameters": { "type": 7 } }] }),
            400,
            "invalid_parameter",
            json!("tools[0]"),
        ),
        (
            json!({ "model": "assistant", "input": "x", "tools": [patch_tool()] }),
            400,
            "tools_not_supported",
            json!("tools"),
        ),
        (
            json!({ "model": "coder", "input": 5 }),
            400,
            "invalid_parameter",
            json!("input"),
        ),
        (
            json!({ "model": "coder", "input": [{ "role": "wizard", "content": "x" }] }),
            400,
            "invalid_message",
            json!("input[0].role"),
        ),
        // Members of unexpected types are refused naming the item, as read from the body.
        (
            json!({ "model": "coder", "input": [{ "role": "user", "content": "x" }, { "role": null, "content": "x" }] }),
            400,
            "invalid_message",
            json!("input[1].role"),
        ),
        (
            json!({ "model": "coder", "input": [{ "type": "message", "role": "user", "content": { "text": "x" } }] }),
            400,
            "invalid_message",
            json!("input[0].content"),
        ),
        (
            json!({ "model": "coder", "input": { "role": "user", "content": "x" } }),
            400,
            "invalid_parameter",
            json!("input"),
        ),
        (
            json!({ "model": "coder" }),
            400,
            "invalid_parameter",
            json!("input"),
        ),
        (
            json!({ "model": "coder", "input": [{ "type": "function_call", "call_id": "c1", "name": "apply_patch", "arguments": "{}" }], "tools": [patch_tool()] }),
            400,
            "invalid_parameter",
            json!("input"),
        ),
        (
            json!({ "model": "nope", "input": "x" }),
            404,
            "model_not_found",
            json!("model"),
        ),
    ];
    for (body, status, code, param) in cases {
        let (actual, envelope, _) = respond(&app, &body).await;
        assert_eq!(actual, status, "{body}: {envelope}");
        assert_eq!(envelope["error"]["code"], code, "{body}: {envelope}");
        assert_eq!(envelope["error"]["param"], param, "{body}: {envelope}");
    }
    let oversized = json!({ "model": "coder", "input": "x".repeat(5 << 20) });
    let (status, envelope, _) = respond(&app, &oversized).await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (413, Some("body_too_large"))
    );
    // SDKs always send `tools`, empty for an agent without client tools; reasoning items and
    // unknown item types are accepted.
    let (status, ok, _) = respond(
        &app,
        &json!({ "model": "assistant", "input": [{ "type": "reasoning", "id": "rs_1", "summary": [] },
            { "type": "message", "role": "developer", "content": "be nice" },
            { "role": "user", "content": "hi" }], "tools": [] }),
    )
    .await;
    assert_eq!(
        (status, ok["status"].as_str()),
        (200, Some("completed")),
        "{ok}"
    );
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_finds_the_result_stored() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(coder_workspace(&upstream, &tools, "5s")).await;
    upstream.push([Reply::Slow {
        text: "a b c d e f".into(),
        pause: Duration::from_millis(100),
    }]);
    let mut response = app
        .http
        .post(app.url("/v1/responses"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({ "model": "coder", "input": "slowly", "stream": true }))
        .send()
        .await
        .unwrap();
    let request_id = request_id_header(&response);
    let mut received = String::new();
    while !received.contains("\n\n") {
        let chunk = response.chunk().await.unwrap().unwrap();
        received.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let created = sse_events(&received);
    let id = created[0].1["response"]["id"].as_str().unwrap().to_owned();
    drop(response);
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "completed");
    let (status, stored) = app.get(&format!("/v1/responses/{id}"), CLIENT_KEY).await;
    assert_eq!(status, 200);
    assert_eq!(stored["output"][0]["content"][0]["text"], "a b c d e f");
}
