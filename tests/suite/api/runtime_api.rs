//! The native runtime API: submit, inspect, read and follow events.

use futures::StreamExt;
use serde_json::{Value, json};

use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace, assert_gapless};

#[tokio::test]
async fn submit_then_read_the_request_and_its_events() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let accepted = app.submit("greeter", "Ada").await;
    let request_id = accepted["requestId"].as_str().unwrap();
    assert!(accepted["runId"].is_string() && accepted["sessionId"].is_string());
    let view = app.wait_until_done(request_id).await;
    assert_eq!(view["status"], "completed");
    assert_eq!(view["output"], "Hello Ada!");
    assert_eq!(view["agentId"], "greeter");
    assert_eq!(view["runs"].as_array().unwrap().len(), 1);
    assert_eq!(view["runs"][0]["status"], "completed");

    let events = app.events(request_id).await;
    assert_gapless(&events);
    let (_, page) = app
        .get(
            &format!("/runtime/requests/{request_id}/events?after=2"),
            CLIENT_KEY,
        )
        .await;
    let after: Vec<i64> = page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(after, (3..=events.len() as i64).collect::<Vec<_>>());
    assert_eq!(page["nextAfter"], events.len() as i64);

    // wait: true answers with the finished request.
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "input": { "text": "hi" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(
        (view["status"].as_str(), view["agentId"].as_str()),
        (Some("completed"), Some("assistant"))
    );
}

#[tokio::test]
async fn sessions_prepend_their_history() {
    let upstream = MockUpstream::start().await;
    upstream.push([
        Reply::Text("Nice to meet you".into()),
        Reply::Text("Your name is Ada".into()),
    ]);
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (_, first) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "input": { "text": "I am Ada" }, "wait": true }),
        )
        .await;
    let session = first["sessionId"].as_str().unwrap();
    let (status, second) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "sessionId": session, "input": { "text": "Who am I?" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["sessionId"], session);
    let messages = upstream.calls()[1].body["messages"].clone();
    let contents: Vec<&str> = messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        contents,
        [
            "You are a test assistant.",
            "I am Ada",
            "Nice to meet you",
            "Who am I?"
        ]
    );

    let (status, envelope) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "sessionId": "ses_missing", "input": { "text": "x" } }),
        )
        .await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (404, Some("session_not_found"))
    );
}

#[tokio::test]
async fn bad_input_is_400_or_422_with_the_field_named() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let cases = [
        (
            json!({ "agentId": "ghost", "input": { "text": "x" } }),
            404,
            "agent_not_found",
            json!("agentId"),
        ),
        (
            json!({ "input": { "text": "x" }, "colour": "red" }),
            400,
            "unknown_field",
            Value::Null,
        ),
        (
            json!({ "input": { "text": 5 } }),
            422,
            "invalid_request",
            json!("input.text"),
        ),
        (
            json!({ "input": {} }),
            422,
            "invalid_request",
            json!("input"),
        ),
        (
            json!({ "input": { "messages": [{ "content": "no role" }] } }),
            400,
            "invalid_message",
            json!("input.messages[0].role"),
        ),
    ];
    for (body, status, code, param) in cases {
        let (actual, envelope) = app.post("/runtime/requests", CLIENT_KEY, &body).await;
        assert_eq!(actual, status, "{body}: {envelope}");
        assert_eq!(envelope["error"]["code"], code, "{body}: {envelope}");
        if !param.is_null() {
            assert_eq!(envelope["error"]["param"], param, "{body}: {envelope}");
        }
    }
    let (status, envelope) = app.get("/runtime/requests/req_nope", CLIENT_KEY).await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (404, Some("request_not_found"))
    );
    let (status, _) = app.get("/runtime/requests/req_nope", ADMIN_KEY).await;
    assert_eq!(status, 403);
    let (status, envelope) = app.get("/no/such/route", CLIENT_KEY).await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (404, Some("route_not_found"))
    );
}

#[tokio::test]
async fn following_events_live_resumes_from_last_event_id_without_gaps() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Slow {
        text: "a b c d e f".into(),
        pause: std::time::Duration::from_millis(30),
    });
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (_, accepted) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "input": { "text": "go" } }),
        )
        .await;
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();

    // Read the first three events live, then drop the connection.
    let response = app
        .http
        .get(app.url(&format!("/runtime/requests/{request_id}/events")))
        .bearer_auth(CLIENT_KEY)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    let mut body = response.bytes_stream();
    let mut text = String::new();
    while text.matches("\n\n").count() < 3 {
        let Some(chunk) = body.next().await else {
            panic!("stream ended early: {text:?}")
        };
        text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    drop(body);
    let ids = super::sse_ids(&text);
    let last = *ids.last().unwrap_or_else(|| panic!("no ids in {text:?}"));

    // Resume with Last-Event-ID: the rest, to the terminal event, no gap, no duplicate.
    let rest = app
        .http
        .get(app.url(&format!("/runtime/requests/{request_id}/events")))
        .bearer_auth(CLIENT_KEY)
        .header("accept", "text/event-stream")
        .header("last-event-id", last.to_string())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let resumed = super::sse_ids(&rest);
    let mut all = ids.clone();
    all.extend(&resumed);
    let stored = app.events(&request_id).await;
    assert_eq!(all, (1..=stored.len() as i64).collect::<Vec<_>>());
    assert!(
        rest.contains("event: runtime.request.completed"),
        "the stream ends after the terminal event"
    );
}

/// `/v1` and `wait: true` start the run without waiting for the submit to commit. When the
/// store refuses that submit (here a trigger on `requests`), the client gets the error at once,
/// not a hang or, at the agent's timeout, a 404 for an id it was never given.
#[tokio::test]
async fn a_request_the_store_refuses_is_answered_with_an_error_at_once() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let db = crate::helpers::store_path(app.workspace.path());
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute_batch(
            "CREATE TRIGGER refuse_marked_requests BEFORE INSERT ON requests
             WHEN NEW.input LIKE '%refuse-me%'
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END;",
        )
        .unwrap();
    let within = std::time::Duration::from_secs(20);

    let (status, body) = tokio::time::timeout(
        within,
        app.post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "refuse-me" }, "wait": true }),
        ),
    )
    .await
    .expect("a refused waiting request was answered at once");
    assert_eq!(status, 500, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");

    let (status, body) = tokio::time::timeout(
        within,
        app.post(
            "/v1/chat/completions",
            CLIENT_KEY,
            &json!({ "model": "greeter", "messages": [{ "role": "user", "content": "refuse-me" }] }),
        ),
    )
    .await
    .expect("a refused /v1 request was answered at once");
    assert_eq!(status, 500, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");

    // Nothing of either was stored, and the next request is served as usual.
    let stored = crate::helpers::store_rows(&db, "SELECT id FROM requests");
    assert!(stored.is_empty(), "{stored:?}");
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "Ada" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["output"], "Hello Ada!");
}
