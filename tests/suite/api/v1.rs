//! `/v1` through the OpenAI SDK and raw HTTP: completions, streams, models, errors, headers.

use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, ChatCompletionStreamOptions,
    CreateChatCompletionRequestArgs,
};
use futures::StreamExt;
use serde_json::{Value, json};

use super::upstream::{MockUpstream, Reply};
use super::{
    ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace, assert_gapless, request_id_header, types,
};

fn user_request(
    model: &str,
    text: &str,
    stream: bool,
) -> async_openai::types::chat::CreateChatCompletionRequest {
    let mut builder = CreateChatCompletionRequestArgs::default();
    builder
        .model(model)
        .messages([ChatCompletionRequestUserMessageArgs::default()
            .content(text)
            .build()
            .unwrap()
            .into()]);
    if stream {
        builder
            .stream(true)
            .stream_options(ChatCompletionStreamOptions {
                include_usage: Some(true),
                include_obfuscation: None,
            });
    }
    builder.build().unwrap()
}

#[tokio::test]
async fn sdk_stream_and_non_stream_give_the_same_text_and_usage() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("The answer is forty two".into()));
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let client = app.openai();

    let completion = client
        .chat()
        .create(user_request("assistant", "What is the answer?", false))
        .await
        .unwrap();
    let text = completion.choices[0].message.content.clone().unwrap();
    assert_eq!(text, "The answer is forty two");
    assert_eq!(completion.model, "assistant");
    let usage = completion.usage.unwrap();
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens
        ),
        (11, 5, 16)
    );

    let mut stream = client
        .chat()
        .create_stream(user_request("assistant", "What is the answer?", true))
        .await
        .unwrap();
    let mut streamed = String::new();
    let mut usage_chunks = 0;
    let mut finish = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        if let Some(usage) = chunk.usage {
            usage_chunks += 1;
            assert_eq!(usage.total_tokens, 16);
            assert!(chunk.choices.is_empty());
        }
        for choice in chunk.choices {
            if let Some(content) = choice.delta.content {
                streamed.push_str(&content);
            }
            if choice.finish_reason.is_some() {
                finish = choice.finish_reason;
            }
        }
    }
    assert_eq!(streamed, text);
    assert_eq!(usage_chunks, 1);
    assert!(finish.is_some());

    // The upstream saw the agent's instructions, its backendConfig and the mapped model name.
    let call = &upstream.calls()[0];
    assert_eq!(call.body["model"], "main-upstream");
    assert_eq!(call.body["temperature"], 0.3);
    assert_eq!(
        call.body["messages"][0],
        json!({ "role": "system", "content": "You are a test assistant." })
    );
    assert_eq!(call.body["messages"][1]["content"], "What is the answer?");
}

/// Every chunk of a stream carries OpenAI's fields, each chunk's its own: the first delta
/// names the role, the text follows, the finish reason comes with an empty delta, and with
/// `include_usage` every chunk says `usage: null` until the last, which has no choices.
#[tokio::test]
async fn every_stream_chunk_has_openai_fields_and_usage_only_at_the_end() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("one two".into()));
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    for include_usage in [false, true] {
        let mut body = json!({ "model": "assistant", "stream": true,
                               "messages": [{ "role": "user", "content": "hi" }] });
        if include_usage {
            body["stream_options"] = json!({ "include_usage": true });
        }
        let response = app
            .http
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(CLIENT_KEY)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let id = request_id_header(&response);
        let text = response.text().await.unwrap();
        let lines: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(lines.last(), Some(&"[DONE]"), "{text}");
        let chunks: Vec<Value> = lines[..lines.len() - 1]
            .iter()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        let (usage_chunk, choice_chunks) = if include_usage {
            let (last, rest) = chunks.split_last().unwrap();
            (Some(last), rest)
        } else {
            (None, &chunks[..])
        };
        let created = &chunks[0]["created"];
        assert!(
            created.as_i64().is_some_and(|t| t > 1_700_000_000),
            "{created}"
        );
        let mut streamed = String::new();
        for (n, chunk) in choice_chunks.iter().enumerate() {
            let mut expected_keys = vec![
                "choices",
                "created",
                "id",
                "model",
                "object",
                "system_fingerprint",
            ];
            if include_usage {
                expected_keys.push("usage");
                assert_eq!(chunk["usage"], Value::Null);
            }
            let keys: Vec<&str> = chunk
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect();
            assert_eq!(keys, expected_keys, "{chunk}");
            assert_eq!(
                (
                    &chunk["id"],
                    &chunk["object"],
                    &chunk["model"],
                    &chunk["created"],
                    &chunk["system_fingerprint"]
                ),
                (
                    &json!(format!("chatcmpl-{id}")),
                    &json!("chat.completion.chunk"),
                    &json!("assistant"),
                    created,
                    &Value::Null
                ),
            );
            let choices = chunk["choices"].as_array().unwrap();
            assert_eq!(choices.len(), 1, "{chunk}");
            let choice = &choices[0];
            assert_eq!(
                (&choice["index"], &choice["logprobs"]),
                (&json!(0), &Value::Null)
            );
            let delta = &choice["delta"];
            if n == 0 {
                assert_eq!(delta, &json!({ "role": "assistant", "content": "" }));
            }
            if n + 1 == choice_chunks.len() {
                assert_eq!(
                    (delta, &choice["finish_reason"]),
                    (&json!({}), &json!("stop"))
                );
            } else {
                assert_eq!(choice["finish_reason"], Value::Null, "{chunk}");
                streamed.push_str(delta["content"].as_str().unwrap());
            }
        }
        assert_eq!(streamed, "one two");
        if let Some(last) = usage_chunk {
            assert_eq!(last["choices"], json!([]), "{last}");
            assert_eq!(last["id"], json!(format!("chatcmpl-{id}")));
            assert_eq!(
                last["usage"]["total_tokens"].as_u64(),
                Some(
                    last["usage"]["prompt_tokens"].as_u64().unwrap()
                        + last["usage"]["completion_tokens"].as_u64().unwrap()
                )
            );
        }
    }
}

#[tokio::test]
async fn the_default_stream_is_pure_openai_chunks_ending_in_done() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    for (named, expect_named) in [(None, false), (Some("true"), true)] {
        let mut request = app.http.post(app.url("/v1/chat/completions")).bearer_auth(CLIENT_KEY).json(&json!({
            "model": "assistant", "stream": true, "messages": [{ "role": "user", "content": "hi" }]
        }));
        if let Some(value) = named {
            request = request.header("x-stable-harness-events", value);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        assert!(
            response
                .headers()
                .contains_key("x-stable-harness-request-id")
        );
        let body = response.text().await.unwrap();
        let data: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        let named_lines: Vec<&str> = body.lines().filter(|l| l.starts_with("event:")).collect();
        assert_eq!(*data.last().unwrap(), "[DONE]");
        let mut text = String::new();
        for line in &data[..data.len() - 1] {
            let chunk: Value = serde_json::from_str(line).unwrap();
            if chunk["object"] == "chat.completion.chunk" {
                text.push_str(
                    chunk["choices"][0]["delta"]["content"]
                        .as_str()
                        .unwrap_or(""),
                );
            } else {
                assert!(
                    expect_named && chunk.get("message").is_some(),
                    "unexpected data line {line}"
                );
            }
        }
        assert_eq!(text, "Hello from the upstream model");
        if expect_named {
            assert!(
                named_lines
                    .iter()
                    .all(|l| *l == "event: stable_harness.progress.narration"),
                "{named_lines:?}"
            );
            assert!(!named_lines.is_empty(), "{body}");
        } else {
            assert!(named_lines.is_empty(), "{body}");
        }
    }
}

#[tokio::test]
async fn models_and_capabilities_list_the_agents() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let models = app.openai().models().list().await.unwrap();
    let ids: Vec<&str> = models.data.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["assistant", "greeter", "impatient", "resilient"]);
    assert!(models.data.iter().all(|m| m.owned_by == "stable-harness"));
    let (status, model) = app.get("/v1/models/greeter", CLIENT_KEY).await;
    assert_eq!((status, model["id"].as_str()), (200, Some("greeter")));
    let (status, capabilities) = app.get("/v1/capabilities", CLIENT_KEY).await;
    assert_eq!(status, 200);
    let assistant = capabilities["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "assistant")
        .unwrap();
    assert_eq!(assistant["backend"], "openai");
    assert_eq!(assistant["model"]["upstreamModel"], "main-upstream");
    assert_eq!(assistant["streaming"], true);
}

async fn raw_post(
    app: &TestApp,
    key: Option<&str>,
    session: Option<&str>,
    body: reqwest::Body,
) -> (u16, Value) {
    let mut request = app
        .http
        .post(app.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    if let Some(session) = session {
        request = request.header("x-stable-harness-session-id", session);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn every_error_uses_the_envelope_with_code_and_param() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(
        &upstream,
        "  limits: { maxRequestBytes: 2KiB }\n",
    ))
    .await;
    let ok = json!({ "model": "greeter", "messages": [{ "role": "user", "content": "hi" }] })
        .to_string();
    // (case, key, body, status, code, param)
    type Case<'a> = (&'a str, Option<&'a str>, String, u16, &'a str, Value);
    let cases: Vec<Case> = vec![
        ("unknown model", Some(CLIENT_KEY), json!({ "model": "nope", "messages": [{ "role": "user", "content": "hi" }] }).to_string(), 404, "model_not_found", json!("model")),
        ("no key", None, ok.clone(), 401, "missing_api_key", Value::Null),
        ("bad key", Some("wrong"), ok.clone(), 401, "invalid_api_key", Value::Null),
        ("admin key on /v1", Some(ADMIN_KEY), ok.clone(), 403, "wrong_key_scope", Value::Null),
        ("malformed JSON", Some(CLIENT_KEY), "{\"model\": ".into(), 400, "invalid_json", Value::Null),
        ("wrong type", Some(CLIENT_KEY), json!({ "model": 5, "messages": [] }).to_string(), 400, "invalid_request", json!("model")),
        ("client tools", Some(CLIENT_KEY), json!({ "model": "greeter", "messages": [{ "role": "user", "content": "hi" }], "tools": [{ "type": "function", "function": { "name": "x" } }] }).to_string(), 400, "tools_not_supported", json!("tools")),
        ("bad role", Some(CLIENT_KEY), json!({ "model": "greeter", "messages": [{ "role": "wizard", "content": "hi" }] }).to_string(), 400, "invalid_message", json!("messages[0].role")),
        ("messages not a list", Some(CLIENT_KEY), json!({ "model": "greeter", "messages": "hi" }).to_string(), 400, "invalid_request", json!("messages")),
        ("no messages", Some(CLIENT_KEY), json!({ "model": "greeter", "messages": [] }).to_string(), 400, "invalid_request", json!("messages")),
        ("n mistyped", Some(CLIENT_KEY), json!({ "model": "greeter", "messages": [{ "role": "user", "content": "hi" }], "n": "x" }).to_string(), 400, "invalid_request", json!("n")),
        ("no messages and n = 2", Some(CLIENT_KEY), json!({ "model": "greeter", "messages": [], "n": 2 }).to_string(), 400, "invalid_request", json!("messages")),
        ("too large", Some(CLIENT_KEY), json!({ "model": "greeter", "messages": [{ "role": "user", "content": "x".repeat(4096) }] }).to_string(), 413, "body_too_large", Value::Null),
    ];
    // With the session header, the body's messages are parsed with the rest of it, not kept
    // as sent first: the same answers.
    for session in [None, Some("errors")] {
        for (name, key, body, status, code, param) in &cases {
            let (actual_status, envelope) =
                raw_post(&app, *key, session, body.clone().into()).await;
            let name = format!("{name} (session {session:?})");
            assert_eq!(actual_status, *status, "{name}: {envelope}");
            assert_eq!(envelope["error"]["code"], *code, "{name}: {envelope}");
            assert_eq!(envelope["error"]["param"], *param, "{name}: {envelope}");
            assert!(
                envelope["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "{name}"
            );
            assert!(envelope["error"]["type"].is_string(), "{name}");
        }
    }
    // A body streamed without Content-Length is cut at the limit too.
    let chunks = futures::stream::iter((0..8).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1024])));
    let (status, envelope) = raw_post(
        &app,
        Some(CLIENT_KEY),
        None,
        reqwest::Body::wrap_stream(chunks),
    )
    .await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (413, Some("body_too_large"))
    );
    // The SDK surfaces the same envelope.
    let error = app
        .openai()
        .chat()
        .create(user_request("nope", "hi", false))
        .await
        .unwrap_err();
    assert!(error.to_string().contains("does not exist"), "{error}");
}

#[tokio::test]
async fn upstream_failures_become_502_and_504_envelopes_never_hangs() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let request =
        json!({ "model": "assistant", "messages": [{ "role": "user", "content": "hi" }] });

    upstream.push([Reply::Status {
        status: 400,
        retry_after: None,
    }]);
    let (status, envelope) = app.post("/v1/chat/completions", CLIENT_KEY, &request).await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (502, Some("upstream_error")),
        "{envelope}"
    );
    assert!(
        envelope["error"]["message"]
            .as_str()
            .unwrap()
            .contains("returned 400"),
        "{envelope}"
    );
    assert!(envelope["error"]["requestId"].is_string());

    upstream.push([Reply::Malformed]);
    let (status, envelope) = app.post("/v1/chat/completions", CLIENT_KEY, &request).await;
    assert_eq!(status, 502, "{envelope}");
    assert!(
        envelope["error"]["message"]
            .as_str()
            .unwrap()
            .contains("malformed"),
        "{envelope}"
    );

    // The `slow` model times out after 1s per attempt: 3 attempts, then 504.
    upstream.set_default(Reply::Stall(std::time::Duration::from_secs(3)));
    let started = std::time::Instant::now();
    let impatient = json!({ "model": "impatient", "stream": true, "messages": [{ "role": "user", "content": "hi" }] });
    let (status, envelope) = app
        .post("/v1/chat/completions", CLIENT_KEY, &impatient)
        .await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (504, Some("upstream_timeout")),
        "{envelope}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(6));
}

/// A model's `timeout` bounds each wait for the upstream's next bytes, not the whole stream:
/// a stream longer in all than the timeout completes while each pause is shorter than it,
/// and a pause longer than it fails the call as a timeout.
#[tokio::test]
async fn a_model_timeout_bounds_each_pause_of_a_stream_not_the_whole() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let impatient =
        json!({ "model": "impatient", "messages": [{ "role": "user", "content": "hi" }] });
    // The upstream streams `text` word by word, `pause` before each part.
    let ask = async |text: &str, pause_ms: u64| {
        upstream.set_default(Reply::Slow {
            text: text.into(),
            pause: std::time::Duration::from_millis(pause_ms),
        });
        app.post("/v1/chat/completions", CLIENT_KEY, &impatient)
            .await
    };
    // Six parts (a role, three words, the stop and the usage, then `[DONE]`) 0.3 s apart:
    // 2.1 s in all against the `slow` model's 1 s.
    let (status, body) = ask("a b c", 300).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "a b c", "{body}");
    // The headers come at once, then nothing for 2.5 s: each attempt times out.
    let (status, envelope) = ask("late", 2_500).await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (504, Some("upstream_timeout")),
        "{envelope}"
    );
}

#[tokio::test]
async fn session_header_groups_requests_and_v1_stays_stateless() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let mut sessions = Vec::new();
    for text in ["first", "second"] {
        let response = app
            .http
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(CLIENT_KEY)
            .header("x-stable-harness-session-id", "support-ticket-42")
            .json(
                &json!({ "model": "assistant", "messages": [{ "role": "user", "content": text }] }),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        sessions.push(
            response.headers()["x-stable-harness-session-id"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert_eq!(sessions, ["support-ticket-42", "support-ticket-42"]);
    // Stateless: the second upstream call saw only what the client sent.
    let second = &upstream.calls()[1];
    assert_eq!(
        second.body["messages"].as_array().unwrap().len(),
        2,
        "{}",
        second.body
    );
    let (status, list) = app
        .get("/admin/requests?sessionId=support-ticket-42", ADMIN_KEY)
        .await;
    assert_eq!(status, 200);
    assert_eq!(list["data"].as_array().unwrap().len(), 2);
    // The `user` field groups too, within the calling key's own sessions.
    let (status, _) = app.post("/v1/chat/completions", CLIENT_KEY, &json!({ "model": "greeter", "user": "ada", "messages": [{ "role": "user", "content": "hi" }] })).await;
    assert_eq!(status, 200);
    let session = format!("user:{}:ada", stable_harness::http::fingerprint(CLIENT_KEY));
    let (_, list) = app
        .get(&format!("/admin/requests?sessionId={session}"), ADMIN_KEY)
        .await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn events_are_stored_in_order_with_gapless_seq() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("one two three".into()));
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (response, request_id) = app.chat(&json!({ "model": "assistant", "stream": true, "messages": [{ "role": "user", "content": "count" }] })).await;
    let _ = response.text().await.unwrap();
    let events = app.events(&request_id).await;
    assert_gapless(&events);
    // Deltas that queued behind one commit are stored as one: one or more adapter events.
    let mut kinds = types(&events);
    kinds.dedup();
    assert_eq!(
        kinds,
        [
            "runtime.request.started",
            "runtime.progress.narration",
            "runtime.adapter.event",
            "runtime.model.call.completed",
            "runtime.progress.narration",
            "runtime.usage.recorded",
            "runtime.request.completed",
        ]
    );
    let deltas: String = events
        .iter()
        .filter_map(|e| e["data"]["event"]["text"].as_str())
        .collect();
    assert_eq!(deltas, "one two three");
    let model_call = &events
        .iter()
        .find(|e| e["type"] == "runtime.model.call.completed")
        .unwrap()["data"];
    assert_eq!(
        (
            model_call["model"].as_str(),
            model_call["upstreamModel"].as_str(),
            model_call["attempt"].as_u64()
        ),
        (Some("main"), Some("main-upstream"), Some(1))
    );
    assert_eq!(model_call["usage"]["total_tokens"], 14);
    for event in &events {
        assert_eq!(event["requestId"], request_id.as_str());
        for field in ["id", "runId", "sessionId", "agentId", "at"] {
            assert!(event[field].is_string(), "{field} missing in {event}");
        }
    }
}
