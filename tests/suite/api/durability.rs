//! What survives: a restart of the server process on the same SQLite file, a client that goes
//! away mid-stream, and a full house (bounded concurrency).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;

use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace, request_id_header};

/// The real binary serving `dir` on a random port; returns the process and its base URL.
fn start_server(dir: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(crate::helpers::binary())
        .args([
            "start",
            "-w",
            dir.to_str().unwrap(),
            "--port",
            "0",
            "--api-key",
            CLIENT_KEY,
            "--admin-key",
            ADMIN_KEY,
        ])
        .env("STABLE_HARNESS_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (line, address) = super::announced_address(&mut child);
    let address = address.unwrap_or_else(|| panic!("no address in {line:?}"));
    (child, address)
}

fn terminate(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    assert!(status.success(), "start exits 0 on SIGTERM, got {status}");
}

#[tokio::test]
async fn a_second_server_process_on_the_same_store_sees_earlier_requests() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "");
    let http = reqwest::Client::new();

    let (mut first, base) = start_server(workspace.path());
    let response = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({ "model": "greeter", "messages": [{ "role": "user", "content": "persist me" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let request_id = request_id_header(&response);
    terminate(&mut first);

    let (mut second, base) = start_server(workspace.path());
    let view: serde_json::Value = http
        .get(format!("{base}/admin/requests/{request_id}"))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "Hello persist me!");
    let events: serde_json::Value = http
        .get(format!("{base}/runtime/requests/{request_id}/events"))
        .bearer_auth(CLIENT_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        events["data"].as_array().unwrap().last().unwrap()["type"],
        "runtime.request.completed"
    );
    terminate(&mut second);
}

#[tokio::test]
async fn a_client_disconnect_mid_stream_does_not_fail_the_run() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Slow {
        text: "one two three four five six".into(),
        pause: Duration::from_millis(40),
    });
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (response, request_id) = app.chat(&json!({ "model": "assistant", "stream": true, "messages": [{ "role": "user", "content": "count" }] })).await;
    let mut body = response.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(!first.is_empty());
    drop(body);
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "one two three four five six");
}

#[tokio::test]
async fn over_the_concurrency_limit_requests_queue_then_get_429() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Slow {
        text: "slow reply here".into(),
        pause: Duration::from_millis(150),
    });
    let app = TestApp::spawn(api_workspace(
        &upstream,
        "  limits: { maxConcurrentRuns: 1 }\n",
    ))
    .await;
    let body = json!({ "input": { "text": "x" } });
    let submit = || app.post("/runtime/requests", CLIENT_KEY, &body);
    let (running, first) = submit().await;
    let (queued, second) = submit().await;
    let (refused, envelope) = submit().await;
    assert_eq!((running, queued), (202, 202));
    assert_eq!(
        (refused, envelope["error"]["code"].as_str()),
        (429, Some("too_many_runs")),
        "{envelope}"
    );
    // The queued request runs once the first one is done; both complete.
    for accepted in [first, second] {
        let view = app
            .wait_until_done(accepted["requestId"].as_str().unwrap())
            .await;
        assert_eq!(view["status"], "completed");
    }
    let calls = upstream.calls();
    assert_eq!(calls.len(), 2);
    assert!(
        calls[1].at - calls[0].at >= Duration::from_millis(400),
        "the second run waited for the slot"
    );
}

#[tokio::test]
async fn shutdown_lets_in_flight_responses_finish() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Slow {
        text: "still here at the end".into(),
        pause: Duration::from_millis(60),
    });
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let request = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({ "model": "assistant", "messages": [{ "role": "user", "content": "x" }] }))
        .send();
    let in_flight = tokio::spawn(request);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let base = app.base.clone();
    let workspace = app.stop().await;
    let response = in_flight.await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "still here at the end"
    );
    // The server no longer accepts connections, and the store holds the finished request.
    assert!(reqwest::get(format!("{base}/healthz")).await.is_err());
    let compiled = stable_harness::workspace::load(workspace.path()).unwrap();
    let store = stable_harness::store::open(None, &compiled.root, &Default::default())
        .await
        .unwrap();
    let page = store
        .requests(
            &Default::default(),
            &stable_harness::store::PageRequest {
                limit: 10,
                cursor: None,
            },
            stable_harness::store::RequestInput::Read,
        )
        .await
        .unwrap();
    assert_eq!(
        page.items[0].status,
        stable_harness::store::RunStatus::Completed
    );
}

#[tokio::test]
async fn a_run_interrupted_by_kill_9_resumes_after_restart() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    upstream.push([Reply::Slow {
        text: "never finished because the server dies".into(),
        pause: Duration::from_millis(300),
    }]);
    upstream.set_default(Reply::Text("finished after the restart".into()));
    let workspace = api_workspace(&upstream, "");
    let http = reqwest::Client::new();

    let (mut first, base) = start_server(workspace.path());
    let (status, accepted) = {
        let response = http
            .post(format!("{base}/runtime/requests"))
            .bearer_auth(CLIENT_KEY)
            .json(&json!({ "input": { "text": "survive" } }))
            .send()
            .await
            .unwrap();
        (
            response.status().as_u16(),
            response.json::<serde_json::Value>().await.unwrap(),
        )
    };
    assert_eq!(status, 202);
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    // Wait until the run is mid-stream, then kill the process without any chance to clean up.
    while upstream.calls().is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    first.kill().unwrap();
    let _ = first.wait();

    let (mut second, base) = start_server(workspace.path());
    let view = super::wait_until_done_at(&http, &base, &request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "finished after the restart");
    assert_eq!(upstream.calls().len(), 2);
    let events: serde_json::Value = http
        .get(format!("{base}/runtime/requests/{request_id}/events"))
        .bearer_auth(CLIENT_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let events = events["data"].as_array().unwrap();
    super::assert_gapless(events);
    let starts = events
        .iter()
        .filter(|e| e["type"] == "runtime.request.started")
        .count();
    assert_eq!(starts, 2, "the resumed run announces itself again");
    terminate(&mut second);
}

#[tokio::test]
async fn a_session_turn_stores_only_its_own_messages_and_resumes_with_the_whole_history() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    upstream.push([
        Reply::Text("first answer".into()),
        Reply::Slow {
            text: "never finished because the server dies".into(),
            pause: Duration::from_millis(300),
        },
    ]);
    upstream.set_default(Reply::Text("second answer after the restart".into()));
    let workspace = api_workspace(&upstream, "");
    let http = reqwest::Client::new();
    let (mut first, base) = start_server(workspace.path());
    let submit = |body: serde_json::Value| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            http.post(format!("{base}/runtime/requests"))
                .bearer_auth(CLIENT_KEY)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    let opening = submit(json!({ "input": { "text": "one" }, "wait": true })).await;
    assert_eq!(opening["output"], "first answer", "{opening}");
    let session = opening["sessionId"].as_str().unwrap();
    let accepted = submit(json!({ "sessionId": session, "input": { "text": "two" } })).await;
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    while upstream.calls().len() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    first.kill().unwrap();
    let _ = first.wait();

    // The turn's stored input is its own message, naming the history it continues.
    let db = crate::helpers::store_path(workspace.path());
    let input = crate::helpers::stored_input(&db, &request_id);
    assert_eq!(
        input["messages"],
        json!([{ "role": "user", "content": "two" }]),
        "{input}"
    );
    assert!(input["historyThrough"].is_string(), "{input}");

    let (mut second, base) = start_server(workspace.path());
    let view = super::wait_until_done_at(&http, &base, &request_id).await;
    assert_eq!(view["output"], "second answer after the restart", "{view}");
    let resumed = upstream.calls().last().unwrap().body["messages"].clone();
    let contents: Vec<&str> = resumed
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] != "system")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["one", "first answer", "two"], "{resumed}");
    terminate(&mut second);
}

/// A session's turn parked on an approval, its checkpoint taken: the checkpoint holds what
/// the run added (the model's call), not the session's history again; after a kill -9 the run
/// resumes from its input read again and that, and the model sees the whole conversation.
#[tokio::test]
async fn a_checkpoint_stores_what_the_run_added_and_a_resumed_run_has_the_whole_history() {
    a_parked_session_turn_resumes_after_kill_9(Surface::Runtime, Checkpoint::AsStored).await;
}

/// A checkpoint that does not follow its input (its input counted otherwise, as nothing this
/// server writes) fails its run after the restart, saying so, and runs nothing: started
/// over, the model's new calls would take the places, and the recorded results, of others.
#[tokio::test]
async fn a_checkpoint_that_does_not_follow_its_input_fails_its_run_and_runs_nothing() {
    a_parked_session_turn_resumes_after_kill_9(Surface::Runtime, Checkpoint::Misplaced).await;
}

/// The same for a chat client in a session, which sends its whole transcript: the turn's
/// input is where the session's path it matched ends and its own message, and resumed, the
/// run has the transcript the client sent.
#[tokio::test]
async fn a_chat_turn_parked_in_a_session_resumes_with_the_transcript_it_was_sent() {
    a_parked_session_turn_resumes_after_kill_9(Surface::Chat, Checkpoint::AsStored).await;
}

/// After a restart: the approval pending before the crash is pending again, the same one,
/// and an operator approves it.
async fn approve_again_after_restart(
    http: &reqwest::Client,
    base: &str,
    approval: &serde_json::Value,
) {
    let again = super::pending_approval_at(http, base).await;
    assert_eq!(
        again["id"], approval["id"],
        "the same approval survived the crash"
    );
    let decided = http
        .post(format!(
            "{base}/admin/approvals/{}/approve",
            approval["id"].as_str().unwrap()
        ))
        .bearer_auth(ADMIN_KEY)
        .json(&json!({ "reason": "after restart" }))
        .send()
        .await
        .unwrap();
    assert_eq!(decided.status(), 200);
}

#[derive(Clone, Copy, PartialEq)]
enum Surface {
    Runtime,
    Chat,
}

/// The parked run's checkpoint as the restart finds it.
#[derive(Clone, Copy, PartialEq)]
enum Checkpoint {
    AsStored,
    /// Its input counted as two messages more than the store gives.
    Misplaced,
}

async fn a_parked_session_turn_resumes_after_kill_9(surface: Surface, checkpoint: Checkpoint) {
    const SESSION: &str = "a-parked-conversation";
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = super::tools::ToolServer::start().await;
    upstream.push([
        Reply::Text("first answer".into()),
        Reply::call("payments_refund", r#"{"amount":40}"#),
        Reply::Text("refund done after the crash".into()),
    ]);
    let workspace = super::tools::tools_workspace(&upstream, &tools, "");
    let http = reqwest::Client::new();
    let (mut first, base) = start_server(workspace.path());
    // One turn of the conversation, on the surface: awaited, its answer as the client holds
    // it, and its session (a `/runtime` session is the one its first turn made).
    let turn = |transcript: Vec<serde_json::Value>, session: Option<String>| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let call = match surface {
                Surface::Runtime => http.post(format!("{base}/runtime/requests")).json(&json!({
                    "agentId": "clerk", "sessionId": session, "wait": true,
                    "input": { "messages": transcript.last().into_iter().collect::<Vec<_>>() },
                })),
                Surface::Chat => http
                    .post(format!("{base}/v1/chat/completions"))
                    .header("x-stable-harness-session-id", SESSION)
                    .json(&json!({ "model": "clerk", "messages": transcript })),
            };
            let answer: serde_json::Value =
                call.bearer_auth(CLIENT_KEY).send().await?.json().await?;
            Ok::<_, reqwest::Error>(match surface {
                Surface::Runtime => (
                    json!({ "role": "assistant", "content": answer["output"] }),
                    answer["sessionId"].as_str().map(str::to_owned),
                ),
                Surface::Chat => (answer["choices"][0]["message"].clone(), None),
            })
        }
    };
    let mut transcript = vec![json!({ "role": "user", "content": "hello" })];
    let (answer, session) = turn(transcript.clone(), None).await.unwrap();
    assert_eq!(answer["content"], "first answer", "{answer}");
    transcript.push(answer);
    transcript.push(json!({ "role": "user", "content": "refund" }));
    // The second turn waits on an approval; the server dies under it.
    let parked = tokio::spawn(turn(transcript, session));
    let approval = super::pending_approval_at(&http, &base).await;
    let request_id = approval["requestId"].as_str().unwrap().to_owned();
    first.kill().unwrap();
    let _ = first.wait();
    assert!(parked.await.unwrap().is_err(), "the server died under it");

    let db = crate::helpers::store_path(workspace.path());
    let input = crate::helpers::stored_input(&db, &request_id);
    assert_eq!(
        input["messages"],
        json!([{ "role": "user", "content": "refund" }]),
        "{input}"
    );
    let rows = crate::helpers::store_rows(
        &db,
        &format!("SELECT state FROM runs WHERE request_id = '{request_id}'"),
    );
    let state: serde_json::Value =
        serde_json::from_str(rows[0]["state"].as_str().unwrap()).unwrap();
    // Its input: the history (two messages) and its own message.
    assert_eq!(state["ownFrom"], 3, "{state}");
    let added = state["added"].as_array().unwrap();
    assert_eq!(added.len(), 1, "{state}");
    assert_eq!(
        added[0]["tool_calls"][0]["function"]["name"],
        "payments_refund"
    );
    assert!(!state.to_string().contains("first answer"), "{state}");
    if checkpoint == Checkpoint::Misplaced {
        let db = rusqlite::Connection::open(&db).unwrap();
        let moved = db
            .execute(
                "UPDATE runs SET state = json_set(state, '$.ownFrom', 5) WHERE request_id = ?1",
                [&request_id],
            )
            .unwrap();
        assert_eq!(moved, 1);
        let (mut second, base) = start_server(workspace.path());
        let view = super::wait_until_done_at(&http, &base, &request_id).await;
        assert_eq!(view["status"], "failed", "{view}");
        let error = view["error"].to_string();
        assert!(error.contains("cannot resume"), "{view}");
        assert_eq!(tools.count("/refund"), 0, "nothing ran");
        assert_eq!(upstream.calls().len(), 2, "the model was not asked again");
        terminate(&mut second);
        return;
    }

    let (mut second, base) = start_server(workspace.path());
    approve_again_after_restart(&http, &base, &approval).await;
    let view = super::wait_until_done_at(&http, &base, &request_id).await;
    assert_eq!(view["output"], "refund done after the crash", "{view}");
    assert_eq!(tools.count("/refund"), 1, "the tool ran exactly once");
    let calls = upstream.calls();
    assert_eq!(calls.len(), 3, "the model was not asked again for the call");
    let roles: Vec<(&str, &str)> = calls[2].body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] != "system")
        .map(|m| {
            (
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        roles[..3],
        [
            ("user", "hello"),
            ("assistant", "first answer"),
            ("user", "refund")
        ],
        "{roles:?}"
    );
    assert_eq!(roles[3].0, "assistant");
    assert_eq!(roles[4].0, "tool");
    assert_eq!(roles.len(), 5, "{roles:?}");
    terminate(&mut second);
}

#[tokio::test]
async fn kill_9_while_an_approval_is_pending_then_approve_after_restart_runs_the_tool_once() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = super::tools::ToolServer::start().await;
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":40}"#),
        Reply::Text("refund done after the crash".into()),
    ]);
    let workspace = super::tools::tools_workspace(&upstream, &tools, "");
    let http = reqwest::Client::new();
    let (mut first, base) = start_server(workspace.path());
    let accepted: serde_json::Value = http
        .post(format!("{base}/runtime/requests"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({ "agentId": "clerk", "input": { "text": "refund" } }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    let approval = super::pending_approval_at(&http, &base).await;
    first.kill().unwrap();
    let _ = first.wait();

    let (mut second, base) = start_server(workspace.path());
    approve_again_after_restart(&http, &base, &approval).await;
    let view = super::wait_until_done_at(&http, &base, &request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "refund done after the crash");
    assert_eq!(tools.count("/refund"), 1, "the tool ran exactly once");
    assert_eq!(
        upstream.calls().len(),
        2,
        "the model was not asked again for the call"
    );
    terminate(&mut second);
}

/// A session of `turns` turns of `bytes`-byte messages on `/runtime`, each hearing its whole
/// history; then what `/metrics` says the server keeps of it: the paths and their estimated
/// size.
async fn kept_after_a_session(base: &str, turns: usize, bytes: usize) -> (f64, f64, f64) {
    let http = reqwest::Client::new();
    let mut session: Option<String> = None;
    for n in 0..turns {
        let mut body = json!({ "input": { "text": format!("{n:>bytes$}") }, "wait": true });
        if let Some(session) = &session {
            body["sessionId"] = json!(session);
        }
        let response = super::send_post(
            &http,
            &format!("{base}/runtime/requests"),
            CLIENT_KEY,
            &body,
        )
        .await;
        assert_eq!(response.status(), 200);
        let view: serde_json::Value = response.json().await.unwrap();
        assert_eq!(view["status"], "completed", "{view}");
        session = view["sessionId"].as_str().map(str::to_owned);
    }
    let metrics = super::metrics_text(&http, &format!("{base}/metrics")).await;
    (
        super::metric_sample(&metrics, "stable_harness_kept_histories"),
        super::metric_sample(&metrics, "stable_harness_kept_history_bytes"),
        super::metric_sample(
            &metrics,
            "stable_harness_histories_not_kept_total{why=\"too_long\"}",
        ),
    )
}

/// `limits.keptHistoryBytes` bounds the histories a server keeps in memory: a session whose
/// history outgrows half of it is not kept (each turn reads it whole, and hears it whole),
/// where the default keeps it; `/metrics` shows both, and counts the paths not kept.
#[tokio::test]
async fn the_kept_histories_stay_within_their_configured_memory() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    upstream.set_responder(super::upstream::Responder::new(|body| {
        let heard = body["messages"].as_array().map_or(0, Vec::len);
        Reply::Text(format!("heard {heard}"))
    }));
    // 40 turns of 1,000 bytes: 80 messages, ~140 KB estimated once the path is kept, where
    // 64 KiB keeps a path of 32 KiB at most.
    for (limits, kept) in [
        ("  limits: { keptHistoryBytes: 64KiB }\n", false),
        ("", true),
    ] {
        let workspace = api_workspace(&upstream, limits);
        let (mut server, base) = start_server(workspace.path());
        let (paths, bytes, too_long) = kept_after_a_session(&base, 40, 1_000).await;
        // Every turn heard the whole session: its instructions, the history and its own.
        let last = upstream.calls().last().unwrap().body["messages"]
            .as_array()
            .unwrap()
            .len();
        assert_eq!(last, 1 + 2 * 39 + 1, "{limits}");
        if kept {
            assert_eq!((paths, too_long), (1.0, 0.0));
            assert!(bytes > 64.0 * 1024.0, "{bytes}");
        } else {
            assert_eq!((paths, bytes), (0.0, 0.0), "{limits}");
            // Each turn from the sixteenth on (32 messages and more) read a path too long.
            assert!(too_long >= 20.0, "{too_long}");
        }
        terminate(&mut server);
    }
}
