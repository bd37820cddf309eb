//! A hostile or broken upstream model, end to end through the real server: a streamed tool
//! call whose `index` would size a vector of billions of calls, and one SSE event that never
//! ends. Each request fails cleanly (502 with the envelope, the run stored `failed` with kind
//! `malformed`, the upstream called once since a malformed answer is not retried), memory stays
//! bounded (the server stops reading the endless event), and the next request is served.

use serde_json::{Value, json};

use crate::api::upstream::{self, MockUpstream, Reply};
use crate::api::{CLIENT_KEY, TestApp, api_workspace};

/// One `data:` line of a chat-completion chunk with this delta.
fn chunk(delta: Value) -> String {
    upstream::chunk("main-upstream", delta, None)
}

fn ask(stream: bool) -> Value {
    json!({ "model": "assistant", "stream": stream, "messages": [{ "role": "user", "content": "hi" }] })
}

/// The request failed with a 502 envelope naming `expected`, is stored `failed` as malformed,
/// and cost exactly one upstream call; then the server still answers.
async fn assert_failed_cleanly(
    app: &TestApp,
    upstream: &MockUpstream,
    stream: bool,
    expected: &str,
) {
    let calls_before = upstream.calls().len();
    let (response, request_id) = app.chat(&ask(stream)).await;
    let status = response.status().as_u16();
    let envelope: Value = response.json().await.unwrap_or(Value::Null);
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (502, Some("upstream_error")),
        "{envelope}"
    );
    let message = envelope["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(expected), "{envelope}");
    assert!(message.contains("upstream model `main`"), "{envelope}");
    assert_eq!(envelope["error"]["requestId"], request_id.as_str());

    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "failed", "{view}");
    assert_eq!(view["error"]["kind"], "malformed", "{view}");
    assert_eq!(
        upstream.calls().len(),
        calls_before + 1,
        "a malformed answer is not retried"
    );

    let (status, answer) = app
        .post("/v1/chat/completions", CLIENT_KEY, &ask(false))
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        "Hello from the upstream model"
    );
}

#[tokio::test]
async fn a_tool_call_index_of_four_billion_fails_the_request_not_the_server() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    for stream in [false, true] {
        upstream.push([Reply::Raw(vec![
            chunk(json!({ "role": "assistant", "content": null })),
            chunk(json!({ "tool_calls": [{
                "index": 4_000_000_000u64, "id": "call_0", "type": "function",
                "function": { "name": "anything", "arguments": "{}" },
            }] })),
            "data: [DONE]\n\n".to_owned(),
        ])]);
        assert_failed_cleanly(
            &app,
            &upstream,
            stream,
            "tool-call `index` of 4000000000; at most 128 tool calls per turn",
        )
        .await;
    }
}

#[tokio::test]
async fn an_sse_event_that_never_ends_is_cut_at_the_bound() {
    const MAX_BYTES: usize = 64 << 20;
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    for stream in [false, true] {
        let sent_before = upstream.endless_bytes_sent();
        upstream.push([Reply::EndlessEvent {
            max_bytes: MAX_BYTES,
        }]);
        assert_failed_cleanly(
            &app,
            &upstream,
            stream,
            "sent an SSE event larger than 8388608 bytes",
        )
        .await;
        // The server stopped reading soon after the 8 MiB bound, far before the upstream's
        // end (what was sent beyond the bound sat in socket buffers, not in the server).
        let sent = upstream.endless_bytes_sent() - sent_before;
        assert!(sent < MAX_BYTES / 2, "the upstream sent {sent} bytes");
    }
}
