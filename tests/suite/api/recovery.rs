//! Recovery of upstream calls, counted against the upstream's own record of calls: retries
//! with backoff, `retry-after`, only the configured error kinds, fallbacks, and no retry once
//! a stream delivered text.

use std::time::Duration;

use serde_json::{Value, json};

use super::upstream::{MockUpstream, Reply, chunk};
use super::{CLIENT_KEY, TestApp, api_workspace, types};

fn ask(model: &str, stream: bool) -> Value {
    json!({ "model": model, "stream": stream, "messages": [{ "role": "user", "content": "hi" }] })
}

#[tokio::test]
async fn retryable_errors_are_retried_with_backoff_until_success() {
    let upstream = MockUpstream::start().await;
    upstream.push([
        Reply::Status {
            status: 500,
            retry_after: None,
        },
        Reply::Status {
            status: 503,
            retry_after: None,
        },
    ]);
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (response, request_id) = app.chat(&ask("assistant", false)).await;
    assert_eq!(response.status(), 200);
    let events = app.events(&request_id).await;
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Hello from the upstream model"
    );

    let calls = upstream.calls();
    assert_eq!(calls.len(), 3, "maxAttempts counts every attempt");
    let retries: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "runtime.retry.scheduled")
        .collect();
    assert_eq!(retries.len(), 2);
    assert_eq!(retries[0]["data"]["attempt"], 2);
    assert_eq!(retries[0]["data"]["errorKind"], "upstream_5xx");
    assert_eq!(retries[1]["data"]["attempt"], 3);
    for (index, retry) in retries.iter().enumerate() {
        let delay = retry["data"]["delayMs"].as_u64().unwrap();
        assert!(
            (10..=100).contains(&delay),
            "jittered backoff within [initial/2, max]: {delay}"
        );
        let gap = calls[index + 1].at - calls[index].at;
        assert!(
            gap >= Duration::from_millis(delay),
            "waited {gap:?} < {delay}ms"
        );
    }
    let completed = events
        .iter()
        .find(|e| e["type"] == "runtime.model.call.completed")
        .unwrap();
    assert_eq!(completed["data"]["attempt"], 3);
}

#[tokio::test]
async fn retry_after_is_honoured_and_other_kinds_are_not_retried() {
    let upstream = MockUpstream::start().await;
    upstream.push([Reply::Status {
        status: 429,
        retry_after: Some(1),
    }]);
    let app = TestApp::spawn(api_workspace(&upstream, "    retryOn: [rate_limited]\n")).await;
    let (status, _) = app
        .post("/v1/chat/completions", CLIENT_KEY, &ask("assistant", false))
        .await;
    assert_eq!(status, 200);
    let calls = upstream.calls();
    assert_eq!(calls.len(), 2);
    assert!(
        calls[1].at - calls[0].at >= Duration::from_secs(1),
        "retry-after: 1 was not honoured"
    );

    // 500 is not in retryOn here: one call, then the run fails.
    upstream.push([Reply::Status {
        status: 500,
        retry_after: None,
    }]);
    let (status, envelope) = app
        .post("/v1/chat/completions", CLIENT_KEY, &ask("assistant", false))
        .await;
    assert_eq!(status, 502, "{envelope}");
    assert_eq!(upstream.calls().len(), 3);

    // A 4xx other than 429 is never retried, whatever retryOn says.
    upstream.push([Reply::Status {
        status: 401,
        retry_after: None,
    }]);
    let (status, _) = app
        .post("/v1/chat/completions", CLIENT_KEY, &ask("assistant", false))
        .await;
    assert_eq!(status, 502);
    assert_eq!(upstream.calls().len(), 4);
}

#[tokio::test]
async fn fallbacks_are_tried_after_the_last_attempt() {
    let upstream = MockUpstream::start().await;
    upstream.push(std::iter::repeat_n(
        Reply::Status {
            status: 502,
            retry_after: None,
        },
        3,
    ));
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (response, request_id) = app.chat(&ask("resilient", true)).await;
    assert_eq!(response.status(), 200);
    // The stream is read to its end first: its events are stored by then, not before.
    let text = response.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let events = app.events(&request_id).await;
    let models: Vec<String> = upstream
        .calls()
        .iter()
        .map(|c| c.body["model"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        models,
        [
            "flaky-upstream",
            "flaky-upstream",
            "flaky-upstream",
            "main-upstream"
        ]
    );
    assert_eq!(
        types(&events)
            .iter()
            .filter(|t| *t == "runtime.retry.scheduled")
            .count(),
        2
    );
    let completed = events
        .iter()
        .find(|e| e["type"] == "runtime.model.call.completed")
        .unwrap();
    assert_eq!(completed["data"]["model"], "main");

    // When every model fails, the run fails with the last error.
    upstream.set_default(Reply::Status {
        status: 503,
        retry_after: None,
    });
    let (status, envelope) = app
        .post("/v1/chat/completions", CLIENT_KEY, &ask("resilient", false))
        .await;
    assert_eq!(status, 502, "{envelope}");
    assert!(
        envelope["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`main` returned 503"),
        "{envelope}"
    );
    assert_eq!(upstream.calls().len(), 4 + 6);
}

#[tokio::test]
async fn a_stream_that_already_sent_text_is_never_retried() {
    let upstream = MockUpstream::start().await;
    upstream.push([Reply::CutAfter("partial answer ".into())]);
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (response, request_id) = app.chat(&ask("assistant", true)).await;
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    assert_eq!(
        upstream.calls().len(),
        1,
        "no retry after text reached the client"
    );
    assert_eq!(body.matches("partial").count(), 1, "{body}");
    assert!(!body.contains("[DONE]"), "{body}");
    let last_data = body
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap();
    let error: Value = serde_json::from_str(last_data).unwrap();
    assert_eq!(error["error"]["code"], "upstream_error", "{body}");
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "failed");

    // Before any text, a cut stream is retried like any connection failure.
    upstream.push([Reply::CutAfter(String::new())]);
    let (status, _) = app
        .post("/v1/chat/completions", CLIENT_KEY, &ask("assistant", true))
        .await;
    assert_eq!(status, 200);
    assert_eq!(upstream.calls().len(), 3);
}

/// The text of a request's stored output deltas, joined in order.
fn stored_text(events: &[Value]) -> String {
    events
        .iter()
        .filter(|event| event["data"]["event"]["phase"] == "agent.output.delta")
        .filter_map(|event| event["data"]["event"]["text"].as_str())
        .collect()
}

#[tokio::test]
async fn an_answer_rendered_whole_keeps_every_word_it_read_in_its_events() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;

    // Read after read, shown to nobody live: its text may be gathered into fewer deltas, and
    // every word is stored, in order.
    let text = "one two three four five six seven eight nine ten ";
    upstream.push([Reply::Slow {
        text: text.into(),
        pause: Duration::from_millis(2),
    }]);
    let (response, request_id) = app.chat(&ask("assistant", false)).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], text);
    assert_eq!(stored_text(&app.events(&request_id).await), text);

    // A stream that ends without `[DONE]` right after its text fails the request (text was
    // read, so it is not tried again), and the text it read is in the run's events all the
    // same: none of it is still gathered when the run fails.
    upstream.push([Reply::Raw(vec![
        chunk("main-upstream", json!({ "content": "partial " }), None),
        chunk("main-upstream", json!({ "content": "answer " }), None),
    ])]);
    let (response, request_id) = app.chat(&ask("assistant", false)).await;
    assert_eq!(response.status(), 502);
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "failed", "{view}");
    assert_eq!(
        stored_text(&app.events(&request_id).await),
        "partial answer "
    );
}

#[tokio::test]
async fn text_gathered_before_an_upstream_pause_is_emitted_during_the_pause() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    // A pause before each part of the stream: the role, "partial ", "answer ", the end.
    let pause = Duration::from_millis(500);
    upstream.push([Reply::Slow {
        text: "partial answer ".into(),
        pause,
    }]);
    // Submitted without waiting, and followed by nobody: its text is gathered.
    let accepted = app.submit("assistant", "x").await;
    let request_id = accepted["requestId"].as_str().unwrap();
    assert_eq!(app.wait_until_done(request_id).await["status"], "completed");
    let events = app.events(request_id).await;
    assert_eq!(stored_text(&events), "partial answer ");
    // The first word was emitted during the pause before the second, not with it: its own
    // event, made half a pause or more before the second's (and so stored during the pause:
    // the journal holds a write nobody waits on for at most 5 ms, its own tests say). Read
    // from the events' times, not by polling the store, which a loaded machine made late
    // enough once to see both words at its first look.
    let deltas: Vec<(&str, chrono::DateTime<chrono::Utc>)> = events
        .iter()
        .filter(|event| event["data"]["event"]["phase"] == "agent.output.delta")
        .map(|event| {
            let at = event["at"].as_str().unwrap().parse().unwrap();
            (event["data"]["event"]["text"].as_str().unwrap(), at)
        })
        .collect();
    let texts: Vec<&str> = deltas.iter().map(|(text, _)| *text).collect();
    assert_eq!(texts, ["partial ", "answer "]);
    let apart = (deltas[1].1 - deltas[0].1).to_std().unwrap();
    assert!(
        apart >= pause / 2,
        "the first word was emitted {apart:?} before the second"
    );
}
