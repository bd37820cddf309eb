//! The operator control plane (issue 11) through the real server over HTTP, each behaviour on
//! the embedded store and on PostgreSQL: cancel (a stalled upstream call, a hanging command
//! tool, a run parked on an approval), retry, parked runs outside admission, sessions as
//! trees and their forks, and the inspection views.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::trust::{data_of, teller_workspace};
use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, RecordingTools, TestApp, api_workspace, assert_gapless, types};
use crate::helpers::TestWorkspace;

pub(super) const OTHER_CLIENT_KEY: &str = "another-client-key-for-tests";

pub(super) async fn spawn(workspace: TestWorkspace, store: Option<String>) -> TestApp {
    TestApp::spawn_on(
        workspace,
        store,
        &[CLIENT_KEY, OTHER_CLIENT_KEY],
        &[ADMIN_KEY],
    )
    .await
}

pub(super) async fn submit(app: &TestApp, body: Value) -> String {
    let (status, accepted) = app.post("/runtime/requests", CLIENT_KEY, &body).await;
    assert_eq!(status, 202, "{accepted}");
    accepted["requestId"].as_str().unwrap().to_owned()
}

pub(super) async fn poll<T>(what: &str, mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    for _ in 0..500 {
        if let Some(found) = probe().await {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

on_both_stores!(cancel_stops_a_stalled_upstream_call);
// Prints how long the cancel took (a figure for the closing note, not a threshold).
#[allow(clippy::print_stderr)]
async fn cancel_stops_a_stalled_upstream_call(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    // Longer than the model's 5 s timeout: a run that ends `cancelled` was stopped by the
    // cancel, not by its timeout (which would fail it, then retry).
    upstream.set_default(Reply::Stall(Duration::from_secs(30)));
    let app = spawn(api_workspace(&upstream, ""), store).await;
    let id = submit(&app, json!({ "input": { "text": "hello" } })).await;
    poll("the upstream call", async || {
        (!upstream.calls().is_empty()).then_some(())
    })
    .await;

    let cancel = format!("/runtime/requests/{id}/cancel");
    let (status, error) = app.post(&cancel, OTHER_CLIENT_KEY, &json!({})).await;
    assert_eq!(status, 404, "another key's request does not exist: {error}");
    let asked = Instant::now();
    let (status, view) = app.post(&cancel, CLIENT_KEY, &json!({})).await;
    let took = asked.elapsed();
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["status"], "cancelled", "{view}");
    eprintln!("cancel of a stalled upstream call answered in {took:?}");

    let events = app.events(&id).await;
    assert_gapless(&events);
    assert_eq!(types(&events).last().unwrap(), "runtime.request.cancelled");
    let reason = data_of(&events, "runtime.request.cancelled")[0]["reason"].clone();
    assert!(
        reason.as_str().unwrap().contains("client"),
        "the reason names who cancelled: {reason}"
    );
    assert_eq!(
        upstream.calls().len(),
        1,
        "nothing is retried after a cancel"
    );

    let (status, error) = app.post(&cancel, CLIENT_KEY, &json!({})).await;
    assert_eq!(status, 409, "{error}");
    assert_eq!(error["error"]["code"], "request_ended");
    let (status, error) = app
        .post("/admin/requests/req_0/cancel", ADMIN_KEY, &json!({}))
        .await;
    assert_eq!(status, 404, "{error}");
    assert_eq!(error["error"]["param"], "id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_of_a_run_cancels_the_request_it_delegated_to() {
    let upstream = MockUpstream::start().await;
    // The manager hands the task to `assistant`, whose model call then stalls.
    upstream.push([Reply::call("agents_assistant", r#"{"input":"work"}"#)]);
    upstream.set_default(Reply::Stall(Duration::from_secs(30)));
    let workspace = api_workspace(&upstream, "");
    workspace.write(
        "config/agents/manager.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: manager }\nspec:\n  backend: openai\n  model: main\n  subagents: [assistant]\n",
    );
    let app = spawn(workspace, None).await;
    let id = submit(
        &app,
        json!({ "agentId": "manager", "input": { "text": "go" } }),
    )
    .await;
    let child = poll("the delegated request", async || {
        let events = app.events(&id).await;
        let handoff = events
            .iter()
            .find(|e| e["data"]["event"]["phase"] == "agent.handoff")?;
        let child = handoff["data"]["event"]["requestId"].as_str()?.to_owned();
        (upstream.calls().len() >= 2).then_some(child)
    })
    .await;

    let (status, view) = app
        .post(
            &format!("/admin/requests/{id}/cancel"),
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(
        (status, view["status"].as_str()),
        (200, Some("cancelled")),
        "{view}"
    );
    let child_view = app.wait_until_done(&child).await;
    assert_eq!(child_view["status"], "cancelled", "{child_view}");
    let events = app.events(&child).await;
    let reason = data_of(&events, "runtime.request.cancelled")[0]["reason"].clone();
    assert!(reason.as_str().unwrap().contains("operator"), "{reason}");
}

on_both_stores!(cancel_kills_a_hanging_command_tool);
// Prints how long the cancel took (a figure for the closing note, not a threshold).
#[allow(clippy::print_stderr)]
async fn cancel_kills_a_hanging_command_tool(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "");
    workspace.write(
        "resources/tools/hang.sh",
        "#!/bin/sh\necho $$ > hang.pid\nsleep 60 &\necho $! > sleep.pid\nwait\n",
    );
    workspace.make_executable("resources/tools/hang.sh");
    workspace.write(
        "config/catalogs/hang.yaml",
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: hang }\nspec:\n  tools:\n    - { id: hang, timeout: 60s, command: { program: resources/tools/hang.sh } }\n",
    );
    workspace.write(
        "config/agents/sleeper.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: sleeper }\nspec:\n  backend: scripted\n  tools: [hang]\n  script: [{ toolCall: { tool: hang, arguments: {} } }, { reply: woke }]\n",
    );
    let root = workspace.path().to_path_buf();
    let app = spawn(workspace, store).await;
    let id = submit(
        &app,
        json!({ "agentId": "sleeper", "input": { "text": "sleep" } }),
    )
    .await;
    let pids: Vec<u32> = poll("the tool's processes", async || {
        let shell = std::fs::read_to_string(root.join("hang.pid")).ok()?;
        let sleep = std::fs::read_to_string(root.join("sleep.pid")).ok()?;
        Some(vec![shell.trim().parse().ok()?, sleep.trim().parse().ok()?])
    })
    .await;
    assert!(pids.iter().all(|pid| alive(*pid)));

    let asked = Instant::now();
    let (status, view) = app
        .post(
            &format!("/admin/requests/{id}/cancel"),
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["status"], "cancelled");
    poll("the tool's processes to die", async || {
        pids.iter().all(|pid| !alive(*pid)).then_some(())
    })
    .await;
    eprintln!(
        "a hanging command tool's process group was gone {:?} after the cancel",
        asked.elapsed()
    );
    let events = app.events(&id).await;
    let reason = data_of(&events, "runtime.request.cancelled")[0]["reason"].clone();
    assert!(reason.as_str().unwrap().contains("operator"), "{reason}");
    assert!(
        data_of(&events, "runtime.request.completed").is_empty(),
        "the script never went on to reply"
    );
}

/// Whether a process runs (a zombie waiting to be reaped has died).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

on_both_stores!(cancel_of_a_parked_run_cancels_its_approvals);
async fn cancel_of_a_parked_run_cancels_its_approvals(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    upstream.push([Reply::call("payments_refund", r#"{"amount":9}"#)]);
    upstream.set_default(Reply::Text("refunded".into()));
    let workspace = teller_workspace(&upstream, &tools, "UNSET_KEY_A", "UNSET_KEY_B", "");
    let app = spawn(workspace, store).await;
    let id = submit(
        &app,
        json!({ "agentId": "teller", "input": { "text": "refund" } }),
    )
    .await;
    let approval = app.pending_approval().await;
    let approval_id = approval["id"].as_str().unwrap();

    let (status, view) = app
        .post(
            &format!("/runtime/requests/{id}/cancel"),
            CLIENT_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["status"], "cancelled");
    let (status, detail) = app.get(&format!("/admin/requests/{id}"), ADMIN_KEY).await;
    assert_eq!(status, 200);
    let approvals = detail["approvals"].as_array().unwrap();
    assert_eq!(approvals.len(), 1, "{detail}");
    assert_eq!(approvals[0]["status"], "cancelled", "{detail}");
    let (status, error) = app
        .post(
            &format!("/admin/approvals/{approval_id}/approve"),
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(
        status, 409,
        "a cancelled approval cannot be decided: {error}"
    );
    assert!(tools.executions().is_empty(), "the refund never ran");
}

on_both_stores!(retry_starts_the_next_attempt_and_continues_the_seq);
async fn retry_starts_the_next_attempt_and_continues_the_seq(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.push([Reply::StatusBody {
        status: 400,
        body: r#"{"error":{"message":"bad request"}}"#.into(),
    }]);
    upstream.set_default(Reply::Text("second time lucky".into()));
    let app = spawn(api_workspace(&upstream, ""), store).await;
    let id = submit(&app, json!({ "input": { "text": "try" } })).await;
    let failed = app.wait_until_done(&id).await;
    assert_eq!(failed["status"], "failed", "{failed}");

    let retry = format!("/admin/requests/{id}/retry");
    let (status, error) = app.post(&retry, CLIENT_KEY, &json!({})).await;
    assert_eq!(status, 403, "{error}");
    let (status, retried) = app.post(&retry, ADMIN_KEY, &json!({})).await;
    assert_eq!(status, 202, "{retried}");
    assert_eq!(retried["attempt"], 2);
    let done = app.wait_until_done(&id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["output"], "second time lucky");
    let runs = done["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["status"], "failed");
    assert_eq!(runs[1]["status"], "completed");
    assert_eq!(runs[1]["runId"], retried["runId"]);

    let events = app.events(&id).await;
    assert_gapless(&events);
    let started = data_of(&events, "runtime.request.started");
    assert_eq!(started.len(), 2);
    assert_eq!(started[1]["attempt"], 2);
    let second = events
        .iter()
        .position(|e| e["runId"] == retried["runId"])
        .unwrap();
    assert_eq!(events[second - 1]["type"], "runtime.request.failed");
    // The retry saw the same input the first run did.
    let calls = upstream.calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].body["messages"], calls[1].body["messages"]);

    let (status, error) = app.post(&retry, ADMIN_KEY, &json!({})).await;
    assert_eq!(status, 409, "a completed request is not retried: {error}");
    assert_eq!(error["error"]["code"], "request_not_retryable");
}

on_both_stores!(a_retried_turn_in_a_session_answers_under_its_own_message);
async fn a_retried_turn_in_a_session_answers_under_its_own_message(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.push([
        Reply::Text("re: one".into()),
        Reply::StatusBody {
            status: 400,
            body: r#"{"error":{"message":"bad request"}}"#.into(),
        },
    ]);
    upstream.set_default(Reply::Text("re: two".into()));
    let app = spawn(api_workspace(&upstream, ""), store).await;
    let first = submit(&app, json!({ "input": { "text": "one" } })).await;
    let first = app.wait_until_done(&first).await;
    let session = first["sessionId"].as_str().unwrap().to_owned();
    let second = submit(
        &app,
        json!({ "sessionId": session, "input": { "text": "two" } }),
    )
    .await;
    assert_eq!(app.wait_until_done(&second).await["status"], "failed");

    let retry = format!("/admin/requests/{second}/retry");
    let (status, retried) = app.post(&retry, ADMIN_KEY, &json!({})).await;
    assert_eq!(status, 202, "{retried}");
    let done = app.wait_until_done(&second).await;
    assert_eq!(done["status"], "completed", "{done}");
    // The retry was sent the history and the turn's own message, and its answer hangs under
    // that message (found among what the session took on since the turn), not beside it.
    assert_eq!(
        last_heard(&upstream),
        ["one", "re: one", "two"],
        "what the retry was sent"
    );
    one_path(&app, &session, &["one", "re: one", "two", "re: two"]).await;
}

/// A session's tree read over HTTP, asserted to be one path of messages saying `texts`, root
/// first, its head the last; its messages.
async fn one_path(app: &TestApp, session: &str, texts: &[&str]) -> Vec<Value> {
    let (status, tree) = app
        .get(&format!("/runtime/sessions/{session}"), CLIENT_KEY)
        .await;
    assert_eq!(status, 200, "{tree}");
    let messages = tree["messages"].as_array().unwrap();
    let said: Vec<&str> = messages
        .iter()
        .map(|m| m["content"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(said, texts);
    assert!(messages[0]["parentId"].is_null(), "{tree}");
    for pair in messages.windows(2) {
        assert_eq!(pair[1]["parentId"], pair[0]["messageId"], "{tree}");
    }
    assert_eq!(
        tree["headMessageId"],
        messages[messages.len() - 1]["messageId"]
    );
    messages.clone()
}

on_both_stores!(parked_runs_leave_admission_to_new_requests);
async fn parked_runs_leave_admission_to_new_requests(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    upstream.set_responder(super::upstream::Responder::new(|body| {
        let asked = body["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "tool"));
        if asked {
            Reply::Text("done".into())
        } else {
            Reply::call("payments_refund", r#"{"amount":1}"#)
        }
    }));
    // One run executes at once, so two are admitted (executing or waiting); two parked runs
    // hold no admission place, and a third parked one keeps its own.
    let limits = "  limits: { maxConcurrentRuns: 1, maxParkedRuns: 2 }\n";
    let workspace = teller_workspace(&upstream, &tools, "UNSET_KEY_A", "UNSET_KEY_B", limits);
    let app = spawn(workspace, store).await;
    let refund = json!({ "agentId": "teller", "input": { "text": "refund" } });
    for parked in 1..=4 {
        submit(&app, refund.clone()).await;
        super::trust::pending_approvals(&app.http, &app.base, parked).await;
    }
    // Two parked outside admission, two inside: admission is full.
    let (status, error) = app.post("/runtime/requests", CLIENT_KEY, &refund).await;
    assert_eq!(status, 429, "{error}");
    // Decided, the runs finish and give their places back.
    for approval in super::trust::pending_approvals(&app.http, &app.base, 4).await {
        let (status, _) = app
            .post(
                &format!(
                    "/admin/approvals/{}/approve",
                    approval["id"].as_str().unwrap()
                ),
                ADMIN_KEY,
                &json!({}),
            )
            .await;
        assert_eq!(status, 200);
        app.wait_until_done(approval["requestId"].as_str().unwrap())
            .await;
    }
    let id = poll("a free admission place", async || {
        let (status, accepted) = app.post("/runtime/requests", CLIENT_KEY, &refund).await;
        (status == 202).then(|| accepted["requestId"].clone())
    })
    .await;
    assert!(id.is_string());
}

/// An upstream that answers "re: " and the last message it was sent.
async fn echoing_upstream() -> MockUpstream {
    let upstream = MockUpstream::start().await;
    upstream.set_responder(super::upstream::Responder::new(|body| {
        let last = body["messages"].as_array().and_then(|m| m.last()).cloned();
        let said = last.map(|m| m["content"].as_str().unwrap_or("").to_owned());
        Reply::Text(format!("re: {}", said.unwrap_or_default()))
    }));
    upstream
}

/// What the upstream's last call was sent, its system messages left out.
fn last_heard(upstream: &MockUpstream) -> Vec<String> {
    upstream.calls().last().unwrap().body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] != "system")
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect()
}

on_both_stores!(sessions_are_trees_and_fork_at_any_message);

async fn sessions_are_trees_and_fork_at_any_message(store: Option<String>) {
    let upstream = echoing_upstream().await;
    let app = spawn(api_workspace(&upstream, ""), store).await;
    let turn = async |session: Option<&str>, text: &str| -> Value {
        let mut body = json!({ "input": { "text": text }, "wait": true });
        if let Some(session) = session {
            body["sessionId"] = json!(session);
        }
        let (status, view) = app.post("/runtime/requests", CLIENT_KEY, &body).await;
        assert_eq!(status, 200, "{view}");
        view
    };
    let first = turn(None, "one").await;
    let session = first["sessionId"].as_str().unwrap().to_owned();
    turn(Some(&session), "two").await;

    let messages = one_path(&app, &session, &["one", "re: one", "two", "re: two"]).await;
    let (status, _) = app
        .get(&format!("/runtime/sessions/{session}"), OTHER_CLIENT_KEY)
        .await;
    assert_eq!(status, 404, "another key's session does not exist");

    // Fork after the first answer: the fork's next turn never hears "two".
    let fork_at = messages[1]["messageId"].clone();
    let fork = format!("/runtime/sessions/{session}/fork");
    let (status, forked) = app
        .post(&fork, CLIENT_KEY, &json!({ "atMessageId": fork_at }))
        .await;
    assert_eq!(status, 201, "{forked}");
    let branch = forked["sessionId"].as_str().unwrap().to_owned();
    assert_eq!(forked["forkedFrom"]["sessionId"], session.as_str());
    assert_eq!(forked["headMessageId"], fork_at);
    assert_eq!(forked["history"].as_array().unwrap().len(), 2);
    turn(Some(&branch), "three").await;
    let heard = last_heard(&upstream);
    assert_eq!(heard, ["one", "re: one", "three"]);
    let (_, branch_tree) = app
        .get(&format!("/runtime/sessions/{branch}"), CLIENT_KEY)
        .await;
    let history: Vec<&str> = branch_tree["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(history, ["one", "re: one", "three", "re: three"]);
    assert_eq!(branch_tree["messages"].as_array().unwrap().len(), 2);
    // The original session goes on from its own leaf.
    turn(Some(&session), "four").await;
    let heard = upstream.calls().last().unwrap().body["messages"].clone();
    assert!(!heard.to_string().contains("three"), "{heard}");

    let (status, error) = app
        .post(&fork, CLIENT_KEY, &json!({ "atMessageId": "msg_nope" }))
        .await;
    assert_eq!(status, 404, "{error}");
    assert_eq!(error["error"]["param"], "atMessageId");
    let (status, error) = app
        .post(&fork, OTHER_CLIENT_KEY, &json!({ "atMessageId": fork_at }))
        .await;
    assert_eq!(status, 404, "{error}");
    let (status, error) = app.post(&fork, CLIENT_KEY, &json!({ "at": 1 })).await;
    assert_eq!(status, 400, "{error}");

    // Operators list and read sessions.
    let (status, page) = app.get("/admin/sessions?limit=1", ADMIN_KEY).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(
        page["data"][0]["sessionId"],
        branch.as_str(),
        "newest first"
    );
    let cursor = page["nextCursor"].as_str().unwrap();
    let (_, next) = app
        .get(
            &format!("/admin/sessions?limit=1&cursor={cursor}"),
            ADMIN_KEY,
        )
        .await;
    assert_eq!(next["data"][0]["sessionId"], session.as_str());
    let (status, detail) = app
        .get(&format!("/admin/sessions/{session}"), ADMIN_KEY)
        .await;
    assert_eq!(status, 200);
    assert_eq!(detail["messages"].as_array().unwrap().len(), 6);
    let (status, error) = app.get("/admin/sessions?cursor=%01", ADMIN_KEY).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["param"], "cursor");
}

on_both_stores!(a_long_session_hears_its_whole_history_on_every_branch);
/// Turn after turn of one session, past the length from which the runtime keeps its newest
/// history path in memory (32 messages) and the text a model call wrote of it: each turn
/// hears the whole history, every message as the session holds it (text that JSON escapes
/// included), as does a fork taken far back, the session's own next turn after the fork's,
/// and the fork's after that.
async fn a_long_session_hears_its_whole_history_on_every_branch(store: Option<String>) {
    let upstream = echoing_upstream().await;
    let app = spawn(api_workspace(&upstream, ""), store).await;
    let turn = async |session: Option<&str>, text: &str| -> (String, Vec<String>) {
        let mut body = json!({ "input": { "text": text }, "wait": true });
        if let Some(session) = session {
            body["sessionId"] = json!(session);
        }
        let (status, view) = app.post("/runtime/requests", CLIENT_KEY, &body).await;
        assert_eq!(status, 200, "{view}");
        let heard = last_heard(&upstream);
        (view["sessionId"].as_str().unwrap().to_owned(), heard)
    };
    let mut said: Vec<String> = Vec::new();
    let mut session: Option<String> = None;
    for n in 0..25 {
        let text = if n % 3 == 0 {
            format!("turn {n}: \"quoted\", a \\ and\na line, é, \u{7}")
        } else {
            format!("turn {n}")
        };
        let (id, heard) = turn(session.as_deref(), &text).await;
        said.push(text.clone());
        assert_eq!(heard, said, "turn {n}");
        said.push(format!("re: {text}"));
        session = Some(id);
    }
    let session = session.unwrap();
    // The last call heard each message as the session holds it, whole.
    let (_, tree) = app
        .get(&format!("/runtime/sessions/{session}"), CLIENT_KEY)
        .await;
    let held: Vec<Value> = tree["history"].as_array().unwrap()[..48]
        .iter()
        .map(|message| message["content"].clone())
        .collect();
    let heard: Vec<Value> = upstream.calls().last().unwrap().body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] != "system")
        .cloned()
        .collect();
    assert_eq!(heard[..48], held[..]);
    // A fork after the fifth answer, two turns on it, then the session's own next turn.
    let (_, tree) = app
        .get(&format!("/runtime/sessions/{session}"), CLIENT_KEY)
        .await;
    let fork_at = tree["history"][9]["messageId"].clone();
    assert_eq!(tree["history"][9]["content"]["content"], "re: turn 4");
    let (status, forked) = app
        .post(
            &format!("/runtime/sessions/{session}/fork"),
            CLIENT_KEY,
            &json!({ "atMessageId": fork_at }),
        )
        .await;
    assert_eq!(status, 201, "{forked}");
    let branch = forked["sessionId"].as_str().unwrap().to_owned();
    let mut forked_said = said[..10].to_vec();
    for text in ["fork a", "fork b"] {
        let (_, heard) = turn(Some(&branch), text).await;
        forked_said.push(text.to_owned());
        assert_eq!(heard, forked_said);
        forked_said.push(format!("re: {text}"));
    }
    let (_, heard) = turn(Some(&session), "turn 25").await;
    said.push("turn 25".to_owned());
    assert_eq!(heard, said);
    // And the fork goes on from its own leaf.
    let (_, heard) = turn(Some(&branch), "fork c").await;
    forked_said.push("fork c".to_owned());
    assert_eq!(heard, forked_said);
}

/// `messages` posted to `/v1/chat/completions` for the assistant, in `session`.
async fn chat_in_session(app: &TestApp, session: &str, messages: &[Value]) -> reqwest::Response {
    app.http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .header("x-stable-harness-session-id", session)
        .json(&json!({ "model": "assistant", "messages": messages }))
        .send()
        .await
        .unwrap()
}

on_both_stores!(a_chats_instructions_the_same_each_turn_are_stored_once);
/// A Chat Completions client in a session sends the same system message every turn: a turn
/// whose leading messages are the previous turn's names the turn that stores them instead of
/// storing them again; the model hears them every turn and a retried turn is sent them;
/// changed instructions are stored anew and named from there on.
async fn a_chats_instructions_the_same_each_turn_are_stored_once(store: Option<String>) {
    const SESSION: &str = "a-chat-with-its-rules";
    let embedded = store.is_none();
    let upstream = MockUpstream::start().await;
    // Twenty turns, past the length from which the session's newest path is kept in memory
    // (32 messages); the last turn's first run fails, and an operator retries it.
    const TURNS: usize = 20;
    upstream.push((1..TURNS).map(|n| Reply::Text(format!("a{n}"))));
    upstream.push([Reply::StatusBody {
        status: 400,
        body: r#"{"error":{"message":"bad request"}}"#.into(),
    }]);
    upstream.set_default(Reply::Text(format!("a{TURNS}")));
    let app = spawn(api_workspace(&upstream, ""), store).await;
    let rules: Vec<&str> = (0..TURNS)
        .map(|turn| if turn < TURNS / 2 { "Rule A" } else { "Rule B" })
        .collect();
    let rule_message = |rule: &str| json!({ "role": "system", "content": rule });
    let mut transcript: Vec<Value> = Vec::new();
    let mut requests: Vec<String> = Vec::new();
    for (turn, rule) in rules.iter().enumerate() {
        transcript.push(json!({ "role": "user", "content": format!("q{}", turn + 1) }));
        let mut sent = vec![rule_message(rule)];
        sent.extend(transcript.iter().cloned());
        let response = chat_in_session(&app, SESSION, &sent).await;
        let refused = turn == rules.len() - 1;
        assert_eq!(response.status(), if refused { 502 } else { 200 });
        requests.push(super::request_id_header(&response));
        let heard = &upstream.calls()[turn].body["messages"];
        assert_eq!(heard[1], rule_message(rule), "turn {turn}: {heard}");
        assert_eq!(heard.as_array().unwrap()[2..], sent[1..], "turn {turn}");
        if !refused {
            let answer: Value = response.json().await.unwrap();
            transcript.push(answer["choices"][0]["message"].clone());
        }
    }
    if embedded {
        app.assert_leading_held(&requests, &rules);
    }
    // The last turn failed (the model refused it); retried, it is sent its instructions.
    app.retried_to_completion(&requests[TURNS - 1]).await;
    let heard = upstream.calls().last().unwrap().body["messages"].clone();
    assert_eq!(heard[1], rule_message("Rule B"), "{heard}");
    // The conversation as the session holds it (the client's `refusal: null` left out).
    let said = |messages: &[Value]| -> Vec<(Value, Value)> {
        messages
            .iter()
            .map(|m| (m["role"].clone(), m["content"].clone()))
            .collect()
    };
    assert_eq!(
        said(&heard.as_array().unwrap()[2..]),
        said(&transcript),
        "{heard}"
    );
}

on_both_stores!(a_chat_in_a_session_is_stored_once_and_branches_where_the_client_changes_it);
/// A Chat Completions client in a session sends its whole transcript every turn: the model
/// hears it as sent, and the session stores each message once, as one path (the answers as
/// the OpenAI SDK sends them back, `refusal: null` included). A turn sent again stores only its
/// new answer; a transcript changed far back branches where it changes; a `/runtime` request
/// on the session continues the whole conversation.
async fn a_chat_in_a_session_is_stored_once_and_branches_where_the_client_changes_it(
    store: Option<String>,
) {
    const SESSION: &str = "a-chat-of-many-turns";
    let embedded = store.is_none();
    let upstream = echoing_upstream().await;
    let app = spawn(api_workspace(&upstream, ""), store).await;
    // The client writes its instructions anew each turn (the time, say): they are the turn's
    // own, never in the session, and the model hears them as sent.
    let turns = std::cell::Cell::new(0);
    let chat = async |transcript: &[Value]| -> (Value, String) {
        turns.set(turns.get() + 1);
        let now = json!({ "role": "system", "content": format!("Now: turn {}", turns.get()) });
        let mut sent = vec![now.clone()];
        sent.extend(transcript.iter().cloned());
        let response = chat_in_session(&app, SESSION, &sent).await;
        assert_eq!(response.status(), 200);
        let request_id = super::request_id_header(&response);
        let answer: Value = response.json().await.unwrap();
        let heard = last_heard(&upstream);
        let said: Vec<String> = transcript
            .iter()
            .map(|m| m["content"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(heard, said, "the model hears the transcript as sent");
        let call = upstream.calls().last().unwrap().body["messages"].clone();
        assert!(call.as_array().unwrap().contains(&now), "{call}");
        (answer["choices"][0]["message"].clone(), request_id)
    };
    let contents = |messages: &Value| -> Vec<String> {
        messages
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["content"]["content"].as_str().unwrap().to_owned())
            .collect()
    };
    let session_view = async || {
        let (status, view) = app
            .get(&format!("/runtime/sessions/{SESSION}"), CLIENT_KEY)
            .await;
        assert_eq!(status, 200, "{view}");
        view
    };
    // Twenty turns: past the length from which the runtime keeps a session's newest path in
    // memory (32 messages).
    const TURNS: usize = 20;
    let mut transcript: Vec<Value> = Vec::new();
    let mut last_request = String::new();
    for n in 1..=TURNS {
        transcript.push(json!({ "role": "user", "content": format!("q{n}") }));
        let (answer, request_id) = chat(&transcript).await;
        assert_eq!(answer["refusal"], Value::Null);
        assert_eq!(answer["content"], format!("re: q{n}"));
        transcript.push(answer);
        last_request = request_id;
    }
    let said: Vec<String> = transcript
        .iter()
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect();
    let view = session_view().await;
    assert_eq!(contents(&view["history"]), said);
    assert_eq!(
        view["messages"].as_array().unwrap().len(),
        2 * TURNS,
        "each message stored once: {view:#}"
    );
    if embedded {
        // The last turn's stored input: its own message, and where the session's path it
        // continues ends; never the transcript.
        let input = crate::helpers::stored_input(
            &crate::helpers::store_path(app.workspace.path()),
            &last_request,
        );
        assert_eq!(
            input["messages"],
            json!([{ "role": "user", "content": format!("q{TURNS}") }]),
            "{input}"
        );
        assert_eq!(
            input["leading"],
            json!([{ "role": "system", "content": format!("Now: turn {TURNS}") }])
        );
        assert!(input["historyThrough"].is_string(), "{input}");
    }

    // The last turn sent again: only its new answer is stored, beside the first.
    chat(&transcript[..transcript.len() - 1]).await;
    let view = session_view().await;
    assert_eq!(view["messages"].as_array().unwrap().len(), 2 * TURNS + 1);
    let history = contents(&view["history"]);
    assert_eq!(history[..2 * TURNS - 1], said[..2 * TURNS - 1]);
    assert_eq!(history.len(), 2 * TURNS);

    // A transcript changed at its second answer branches there: the changed answer, the
    // new question and its answer are stored, and the session's history is the branch.
    let mut changed = transcript[..3].to_vec();
    changed.push(json!({ "role": "assistant", "content": "an answer of the client's" }));
    changed.push(json!({ "role": "user", "content": "q3'" }));
    chat(&changed).await;
    let view = session_view().await;
    assert_eq!(
        view["messages"].as_array().unwrap().len(),
        2 * TURNS + 1 + 3
    );
    let mut branch: Vec<String> = changed
        .iter()
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect();
    branch.push("re: q3'".to_owned());
    assert_eq!(contents(&view["history"]), branch);

    // A `/runtime` request on the session continues the whole branch.
    let (status, done) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "sessionId": SESSION, "input": { "text": "and now?" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{done}");
    branch.push("and now?".to_owned());
    assert_eq!(last_heard(&upstream), branch);
}

on_both_stores!(two_chats_taking_turns_in_one_session_are_each_a_branch_stored_once);
/// One `user` with two chats open: each turn's transcript leaves the session's newest path
/// (the other chat's), and continues its own chat's branch: each turn stores its new message
/// and answer, and its request only its own message and where its history ends, never the
/// transcript again. Past the length from which the runtime keeps a path in memory (32
/// messages), each chat's branch is kept beside the other's.
async fn two_chats_taking_turns_in_one_session_are_each_a_branch_stored_once(
    store: Option<String>,
) {
    chats_taking_turns_in_one_session(store, 2, 20, None).await;
}

on_both_stores!(five_chats_answered_alike_in_one_session_are_each_a_branch_stored_once);
/// Five chats in one session, every answer the same words: the branch each turn continues is
/// found among answers alike by the message before its answer, more chats than a session
/// keeps branches of.
async fn five_chats_answered_alike_in_one_session_are_each_a_branch_stored_once(
    store: Option<String>,
) {
    chats_taking_turns_in_one_session(store, 5, 4, Some("Done.")).await;
}

/// `chats` chats taking turns in one session (`user`), `rounds` turns each, each answer
/// `answer` (else an echo of the question): each message is stored once, the session's
/// history is the chat that spoke last, and the last turn's input is its own message.
async fn chats_taking_turns_in_one_session(
    store: Option<String>,
    chats: usize,
    rounds: usize,
    answer: Option<&str>,
) {
    let embedded = store.is_none();
    let upstream = echoing_upstream().await;
    if let Some(answer) = answer {
        let answer = answer.to_owned();
        upstream.set_responder(super::upstream::Responder::new(move |_| {
            Reply::Text(answer.clone())
        }));
    }
    let app = spawn(api_workspace(&upstream, ""), store).await;
    let mut transcripts: Vec<Vec<Value>> = vec![Vec::new(); chats];
    let mut last_request = String::new();
    for round in 1..=rounds {
        for (chat, transcript) in transcripts.iter_mut().enumerate() {
            transcript.push(json!({ "role": "user", "content": format!("c{chat}q{round}") }));
            let response = app
                .http
                .post(app.url("/v1/chat/completions"))
                .bearer_auth(CLIENT_KEY)
                .json(&json!({ "model": "assistant", "user": "ada", "messages": transcript }))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            last_request = super::request_id_header(&response);
            let answer: Value = response.json().await.unwrap();
            let sent: Vec<String> = transcript
                .iter()
                .map(|m| m["content"].as_str().unwrap().to_owned())
                .collect();
            assert_eq!(last_heard(&upstream), sent);
            // As the OpenAI SDK sends an answer back: `refusal: null` and all.
            transcript.push(answer["choices"][0]["message"].clone());
        }
    }
    let session = format!("user:{}:ada", stable_harness::http::fingerprint(CLIENT_KEY));
    let (status, view) = app
        .get(&format!("/runtime/sessions/{session}"), CLIENT_KEY)
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(
        view["messages"].as_array().unwrap().len(),
        2 * chats * rounds,
        "each message stored once: {view:#}"
    );
    // The session's newest path is the chat that spoke last, whole.
    let history: Vec<&str> = view["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"]["content"].as_str().unwrap())
        .collect();
    let said: Vec<&str> = transcripts[chats - 1]
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(history, said);
    if embedded {
        let input = crate::helpers::stored_input(
            &crate::helpers::store_path(app.workspace.path()),
            &last_request,
        );
        assert_eq!(
            input["messages"],
            json!([{ "role": "user", "content": format!("c{}q{rounds}", chats - 1) }]),
            "{input}"
        );
        assert!(input["historyThrough"].is_string(), "{input}");
    }
}

on_both_stores!(session_pages_reach_sessions_whose_ids_clients_chose);
async fn session_pages_reach_sessions_whose_ids_clients_chose(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("ok".into()));
    let app = spawn(api_workspace(&upstream, ""), store).await;
    let chat = json!({ "model": "assistant", "messages": [{ "role": "user", "content": "hi" }] });
    // Ids past '~' in byte order: a non-ASCII `user`, and a grouping header of tildes.
    let mut with_user = chat.clone();
    with_user["user"] = json!("zoë");
    for (body, header) in [(&with_user, None), (&chat, Some("~~~ mine")), (&chat, None)] {
        let mut call = app
            .http
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(CLIENT_KEY)
            .json(body);
        if let Some(header) = header {
            call = call.header("x-stable-harness-session-id", header);
        }
        assert_eq!(call.send().await.unwrap().status(), 200);
    }
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(cursor) => format!("/admin/sessions?limit=1&cursor={}", urlencode(cursor)),
            None => "/admin/sessions?limit=1".to_owned(),
        };
        let (status, page) = app.get(&path, ADMIN_KEY).await;
        assert_eq!(status, 200, "{page}");
        seen.extend(
            page["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["sessionId"].clone()),
        );
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
        assert!(seen.len() <= 3, "pages never end: {seen:?}");
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(
        seen.iter()
            .any(|id| id.as_str().is_some_and(|id| id.ends_with(":zoë"))),
        "{seen:?}"
    );
    assert!(seen.contains(&json!("~~~ mine")), "{seen:?}");
}

on_both_stores!(operators_inspect_traces_requests_workspace_and_health);
async fn operators_inspect_traces_requests_workspace_and_health(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    upstream.push([
        Reply::call("weather_lookup", r#"{"city":"Oslo"}"#),
        Reply::Text("sunny".into()),
    ]);
    let workspace = teller_workspace(&upstream, &tools, "UNSET_KEY_A", "UNSET_KEY_B", "");
    let app = spawn(workspace, store).await;
    let before = chrono::Utc::now();
    let id = submit(
        &app,
        json!({ "agentId": "teller", "input": { "text": "weather?" } }),
    )
    .await;
    let done = app.wait_until_done(&id).await;
    assert_eq!(done["status"], "completed", "{done}");
    let run_id = done["runs"][0]["runId"].as_str().unwrap();

    let (status, trace) = app
        .get(&format!("/admin/runs/{run_id}/trace"), ADMIN_KEY)
        .await;
    assert_eq!(status, 200, "{trace}");
    let categories = trace["categories"].as_object().unwrap();
    for category in [
        "request",
        "model",
        "tool",
        "approval",
        "adapter",
        "plan",
        "delegation",
        "memory",
        "artifact",
    ] {
        assert!(categories.contains_key(category), "{category} in {trace}");
    }
    let of = |category: &str| -> Vec<String> {
        categories[category]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["type"].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(of("tool").contains(&"runtime.tool.direct.completed".to_owned()));
    // Each model call, and what it was charged.
    assert_eq!(
        of("model"),
        [
            "runtime.model.call.completed",
            "runtime.usage.recorded",
            "runtime.model.call.completed",
            "runtime.usage.recorded"
        ]
    );
    assert!(of("request").contains(&"runtime.request.completed".to_owned()));
    let (status, _) = app.get("/admin/runs/run_nope/trace", ADMIN_KEY).await;
    assert_eq!(status, 404);

    // Filters: owner and a time range.
    let after = before.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let list = |query: String| {
        let app = &app;
        async move {
            let (status, page) = app
                .get(&format!("/admin/requests?{query}"), ADMIN_KEY)
                .await;
            assert_eq!(status, 200, "{page}");
            page["data"].as_array().unwrap().len()
        }
    };
    let owner = stable_harness::http::fingerprint(CLIENT_KEY);
    assert_eq!(list(format!("owner={owner}")).await, 1);
    assert_eq!(list("owner=somebody-else".into()).await, 0);
    assert_eq!(list(format!("createdAfter={}", urlencode(&after))).await, 1);
    assert_eq!(
        list(format!("createdBefore={}", urlencode(&after))).await,
        0
    );
    assert_eq!(
        list("limit=100000".into()).await,
        1,
        "a huge limit is clamped"
    );
    for (query, status, param) in [
        ("limit=0", 422, "limit"),
        ("createdAfter=yesterday", 400, "createdAfter"),
        ("cursor=req_zz", 400, "cursor"),
        ("status=sleeping", 422, "status"),
    ] {
        let (got, error) = app
            .get(&format!("/admin/requests?{query}"), ADMIN_KEY)
            .await;
        assert_eq!(got, status, "{query}: {error}");
        assert_eq!(error["error"]["param"], param, "{query}: {error}");
    }

    let (status, inventory) = app.get("/admin/workspace", ADMIN_KEY).await;
    assert_eq!(status, 200);
    let agents: Vec<&str> = inventory["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert!(agents.contains(&"teller"), "{inventory}");
    assert!(!inventory.to_string().contains(CLIENT_KEY));

    let (status, health) = app.get("/admin/health", ADMIN_KEY).await;
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["store"]["ok"], true, "{health}");
    assert_eq!(health["workspace"]["name"], "api-test");
    let models = health["models"].as_array().unwrap();
    assert_eq!(models.len(), 3);
    assert!(models.iter().all(|m| m["reachable"] == true), "{health}");
    let (status, _) = app.get("/admin/health", CLIENT_KEY).await;
    assert_eq!(status, 403);
}

/// Percent-encodes everything but unreserved characters, byte by byte.
fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test]
async fn health_names_a_model_upstream_that_does_not_answer() {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "");
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    workspace.write(
        "config/catalogs/dead.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: {{ name: dead }}\nspec:\n  models:\n    - {{ id: gone, provider: openai-compatible, baseUrl: \"{dead}\", upstreamModel: gone }}\n"
        ),
    );
    let app = TestApp::spawn(workspace).await;
    let (status, health) = app.get("/admin/health", ADMIN_KEY).await;
    assert_eq!(status, 200);
    assert_eq!(health["status"], "degraded", "{health}");
    let gone = health["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["model"] == "gone")
        .cloned()
        .unwrap();
    assert_eq!(gone["reachable"], false, "{health}");
    assert!(
        gone["error"]
            .as_str()
            .unwrap()
            .contains("could not connect")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_nobody_executes_is_ended_by_its_cancel() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Stall(Duration::from_secs(30)));
    // Not resumed at start: after a crash the run stays `running` with nobody executing it.
    let workspace = api_workspace(&upstream, "    resumeOnStart: false\n");
    let first = super::ServerProcess::start(workspace.path(), &[]);
    let (status, accepted) = super::trust::submit(
        &reqwest::Client::new(),
        &first.base,
        &json!({ "input": { "text": "hi" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["requestId"].as_str().unwrap().to_owned();
    poll("the upstream call", async || {
        (!upstream.calls().is_empty()).then_some(())
    })
    .await;
    first.kill9();

    let second = super::ServerProcess::start(workspace.path(), &[]);
    let http = reqwest::Client::new();
    let (_, view) = super::get_json(
        &http,
        &second.url(&format!("/runtime/requests/{id}")),
        CLIENT_KEY,
    )
    .await;
    assert_eq!(
        view["status"], "running",
        "left as the crash left it: {view}"
    );
    let response = http
        .post(second.url(&format!("/admin/requests/{id}/cancel")))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let view: Value = response.json().await.unwrap();
    assert_eq!(view["status"], "cancelled", "{view}");
    let events = super::all_events(&http, &second.base, &id).await;
    assert_gapless(&events);
    assert_eq!(types(&events).last().unwrap(), "runtime.request.cancelled");
    assert_eq!(
        upstream.calls().len(),
        1,
        "the run never called the model again"
    );
    second.terminate();
}

on_both_stores!(a_reload_swaps_a_valid_workspace_and_refuses_anything_else);
async fn a_reload_swaps_a_valid_workspace_and_refuses_anything_else(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Slow {
        text: "still the old inventory".into(),
        pause: Duration::from_millis(100),
    });
    let workspace = api_workspace(&upstream, "");
    let agents =
        std::fs::read_to_string(workspace.path().join("config/agents/agents.yaml")).unwrap();
    let app = spawn(workspace, store).await;
    let agent_names = async || -> Vec<String> {
        let (_, models) = app.get("/v1/models", CLIENT_KEY).await;
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(agent_names().await.contains(&"assistant".to_owned()));
    // A run of `assistant` is under way when `assistant` leaves the workspace.
    let running = submit(&app, json!({ "input": { "text": "hi" } })).await;
    poll("the upstream call", async || {
        (!upstream.calls().is_empty()).then_some(())
    })
    .await;

    let reload = "/admin/workspace/reload";
    let (status, _) = app.post(reload, CLIENT_KEY, &json!({})).await;
    assert_eq!(status, 403);
    // Broken: every problem is reported and nothing changes.
    app.workspace.write(
        "config/agents/broken.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: broken }\nspec:\n  backend: openai\n  model: nowhere\n  tools: [missing.tool]\n",
    );
    let (status, error) = app.post(reload, ADMIN_KEY, &json!({})).await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["code"], "invalid_workspace");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("broken.yaml:"), "{message}");
    assert!(
        message.contains("nowhere") && message.contains("missing.tool"),
        "{message}"
    );
    assert!(agent_names().await.contains(&"assistant".to_owned()));
    app.workspace.remove("config/agents/broken.yaml");

    // A setting only a restart applies: refused, named.
    let runtime_yaml = app.workspace.path().join("config/runtime/workspace.yaml");
    let original = std::fs::read_to_string(&runtime_yaml).unwrap();
    app.workspace.write(
        "config/runtime/workspace.yaml",
        format!("{original}  limits: {{ maxConcurrentRuns: 3, keptHistoryBytes: 64MiB }}\n"),
    );
    let (status, error) = app.post(reload, ADMIN_KEY, &json!({})).await;
    assert_eq!(status, 422, "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("limits.maxConcurrentRuns") && message.contains("limits.keptHistoryBytes"),
        "{error}"
    );
    app.workspace.write(
        "config/runtime/workspace.yaml",
        original.replace("defaultAgent: assistant", "defaultAgent: greeter"),
    );

    // Valid: `assistant` goes, `herald` comes.
    let without_assistant = agents.replacen(
        "metadata: { name: assistant }",
        "metadata: { name: herald }",
        1,
    );
    app.workspace
        .write("config/agents/agents.yaml", without_assistant);
    let (status, reloaded) = app.post(reload, ADMIN_KEY, &json!({})).await;
    assert_eq!(status, 200, "{reloaded}");
    assert_eq!(reloaded["addedAgents"], json!(["herald"]));
    assert_eq!(reloaded["removedAgents"], json!(["assistant"]));
    let names = agent_names().await;
    assert!(names.contains(&"herald".to_owned()) && !names.contains(&"assistant".to_owned()));
    let (status, _) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "assistant", "input": { "text": "hi" } }),
        )
        .await;
    assert_eq!(status, 404, "new requests see the new inventory");
    // The run that started before goes on with the inventory it started with.
    let done = app.wait_until_done(&running).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["output"], "still the old inventory");
    let (_, store) = app.get("/admin/store", ADMIN_KEY).await;
    let reloads: Vec<&Value> = store["maintenance"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["operation"] == "reload")
        .collect();
    assert_eq!(reloads.len(), 3, "every reload is recorded: {store}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_watch_reloads_when_files_change() {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "");
    let app = TestApp::spawn_configured(workspace, None, &[CLIENT_KEY], &[ADMIN_KEY], true).await;
    app.workspace.write(
        "config/agents/late.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: latecomer }\nspec:\n  backend: scripted\n  script: [{ reply: \"here now\" }]\n",
    );
    poll("the new agent", async || {
        let (status, _) = app.get("/v1/models/latecomer", CLIENT_KEY).await;
        (status == 200).then_some(())
    })
    .await;
    // A broken edit keeps the inventory that serves.
    app.workspace
        .write("config/agents/late.yaml", "kind: Agent\nspec: [");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (status, _) = app.get("/v1/models/latecomer", CLIENT_KEY).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_as_requests_run() {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    upstream.push([
        // A tool the model made up: its name must not become a label.
        Reply::call("made_up_tool_7f3a", "{}"),
        Reply::call("weather_lookup", r#"{"city":"Oslo"}"#),
        Reply::Text("sunny".into()),
    ]);
    let workspace = teller_workspace(&upstream, &tools, "UNSET_KEY_A", "UNSET_KEY_B", "");
    // An agent name no other test uses: the process's counters are shared.
    workspace.write(
        "config/agents/metered.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: metered }\nspec:\n  backend: openai\n  model: main\n  tools: [weather.lookup]\n",
    );
    let app = spawn(workspace, None).await;
    let scrape = async || super::metrics_text(&app.http, &app.url("/metrics")).await;
    let unauthorized = app.http.get(app.url("/metrics")).send().await.unwrap();
    assert_eq!(unauthorized.status(), 401);
    let before = scrape().await;
    let id = submit(
        &app,
        json!({ "agentId": "metered", "input": { "text": "weather?" } }),
    )
    .await;
    assert_eq!(app.wait_until_done(&id).await["status"], "completed");
    let after = scrape().await;
    let moved =
        |name: &str| super::metric_sample(&after, name) - super::metric_sample(&before, name);
    assert_eq!(
        moved("stable_harness_requests_total{agent=\"metered\",status=\"completed\"}"),
        1.0,
        "{after}"
    );
    assert_eq!(
        moved("stable_harness_run_duration_seconds_count{agent=\"metered\",status=\"completed\"}"),
        1.0
    );
    assert!(
        moved("stable_harness_tool_calls_total{tool=\"weather.lookup\",decision=\"allow\"}") >= 1.0
    );
    assert!(
        moved("stable_harness_tool_calls_total{tool=\"not_offered\",decision=\"deny\"}") >= 1.0,
        "{after}"
    );
    assert!(!after.contains("made_up_tool_7f3a"), "{after}");
    assert!(moved("stable_harness_model_call_duration_seconds_count{model=\"main\"}") >= 3.0);
    assert!(
        moved("stable_harness_events_appended_total{type=\"runtime.request.completed\"}") >= 1.0
    );
    assert!(moved("stable_harness_journal_batch_ops_count") >= 1.0);
    assert!(after.contains("stable_harness_approvals_pending"));
    assert!(after.contains("stable_harness_journal_commit_duration_seconds_bucket"));

    // The docs browse the live document, with no key.
    let docs = app.http.get(app.url("/docs/")).send().await.unwrap();
    assert_eq!(docs.status(), 200);
    assert!(
        docs.text()
            .await
            .unwrap()
            .to_lowercase()
            .contains("swagger")
    );
}

/// The input a request's row holds, on the store at `database` (`None`: the app's embedded
/// one).
pub(super) fn stored_input_of(app: &TestApp, database: Option<&str>, request_id: &str) -> Value {
    match database {
        None => {
            let db = crate::helpers::store_path(app.workspace.path());
            crate::helpers::stored_input(&db, request_id)
        }
        Some(url) => {
            let sql = format!("SELECT input::text FROM requests WHERE id = '{request_id}'");
            let text = crate::pg::psql(url, &sql);
            serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{text}: {e}"))
        }
    }
}

/// The SHA-256, in hex, of messages as compact JSON text.
fn sha256_hex(messages: &[Value]) -> String {
    use sha2::Digest;
    let text = serde_json::to_string(messages).unwrap();
    format!("{:x}", sha2::Sha256::digest(text.as_bytes()))
}

on_both_stores!(a_chat_with_no_session_names_what_an_earlier_turn_holds);
/// A Chat Completions client with no session sends its whole transcript every turn, each
/// turn a request (and a session) of its own: the model hears the transcript as sent, and a
/// turn continuing an earlier one (past 4 KiB) names the request holding its first messages
/// whole and stores only the rest, never naming a request that names another. Another
/// key's client sending the same transcript names nothing of the first key's. A turn the
/// model refused, retried by an operator, is sent its whole transcript.
async fn a_chat_with_no_session_names_what_an_earlier_turn_holds(store: Option<String>) {
    const TURNS: usize = 24;
    let upstream = MockUpstream::start().await;
    upstream.push((1..TURNS).map(|n| Reply::Text(format!("a{n}"))));
    upstream.push([Reply::StatusBody {
        status: 400,
        body: r#"{"error":{"message":"bad request"}}"#.into(),
    }]);
    upstream.set_default(Reply::Text(format!("a{TURNS}")));
    let app = spawn(api_workspace(&upstream, ""), store.clone()).await;
    let scrape = async || super::metrics_text(&app.http, &app.url("/metrics")).await;
    let carried = "stable_harness_transcript_digests_total{how=\"carried\"}";
    let carried_before = super::metric_sample(&scrape().await, carried);
    let mut sent = vec![json!({ "role": "system", "content": "Be brief." })];
    let mut turns: Vec<(String, Vec<Value>)> = Vec::new();
    for turn in 0..TURNS {
        let question = format!("q{} {}", turn + 1, "x".repeat(1_000));
        sent.push(json!({ "role": "user", "content": question }));
        let (response, request_id) = app
            .chat(&json!({ "model": "assistant", "messages": sent }))
            .await;
        let refused = turn == TURNS - 1;
        assert_eq!(response.status(), if refused { 502 } else { 200 });
        let heard = &upstream.calls()[turn].body["messages"];
        assert_eq!(heard.as_array().unwrap()[1..], sent[..], "turn {turn}");
        turns.push((request_id, sent.clone()));
        if !refused {
            let answer: Value = response.json().await.unwrap();
            sent.push(answer["choices"][0]["message"].clone());
        }
    }
    // Another key's client sends the first key's transcript as it stood at turn 10.
    let theirs = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(OTHER_CLIENT_KEY)
        .json(&json!({ "model": "assistant", "messages": turns[9].1 }))
        .send()
        .await
        .unwrap();
    assert_eq!(theirs.status(), 200);
    let theirs = super::request_id_header(&theirs);

    let inputs: Vec<Value> = turns
        .iter()
        .map(|(id, _)| stored_input_of(&app, store.as_deref(), id))
        .collect();
    let (mut stored, mut whole) = (0, 0);
    for (turn, ((_, transcript), input)) in turns.iter().zip(&inputs).enumerate() {
        let own = input["messages"].as_array().unwrap();
        // A short transcript (under 4 KiB) is stored whole, with no digest to be found by.
        let long = serde_json::to_string(transcript).unwrap().len() >= 4_096;
        let digest = input.get("inputDigest").and_then(Value::as_str);
        assert_eq!(
            digest.map(str::len),
            long.then_some(64),
            "turn {turn}: {input}"
        );
        // The SHA-256 of the whole transcript's text, though each turn after a long one
        // hashes only what it adds to the turn before (the hasher's state carried on).
        if let Some(digest) = digest {
            assert_eq!(digest, sha256_hex(transcript), "turn {turn}");
        }

        stored += own.len();
        whole += transcript.len();
        let Some(holder) = input["prefixOf"].as_str() else {
            assert_eq!(own, transcript, "turn {turn} holds its transcript whole");
            continue;
        };
        let at = turns.iter().position(|(id, _)| id == holder).unwrap();
        assert!(at < turn, "turn {turn} names a later turn");
        assert!(inputs[at].get("prefixOf").is_none(), "a holder names none");
        let held = input["prefixLen"].as_u64().unwrap() as usize;
        assert_eq!(turns[at].1.len(), held, "turn {turn}");
        assert_eq!(own[..], transcript[held..], "turn {turn}");
    }
    assert!(inputs[0].get("prefixOf").is_none());
    let naming = inputs
        .iter()
        .filter(|i| i.get("prefixOf").is_some())
        .count();
    assert!(
        naming >= TURNS * 2 / 3,
        "{naming} of {TURNS} turns name a holder"
    );
    assert!(
        stored * 2 < whole,
        "{stored} messages stored of {whole} sent"
    );
    let theirs = stored_input_of(&app, store.as_deref(), &theirs);
    assert!(theirs.get("prefixOf").is_none(), "{theirs}");
    // The same bytes, the same digest, whoever sends them.
    assert_eq!(theirs["inputDigest"], inputs[9]["inputDigest"]);
    // Each turn after the first long ones went on from the digest of the turn before (the
    // process's counter is shared: other tests' turns only add to it).
    let carried_after = super::metric_sample(&scrape().await, carried);
    assert!(
        carried_after - carried_before >= (TURNS / 2) as f64,
        "{carried_before} -> {carried_after}"
    );
    assert_eq!(theirs["messages"].as_array().unwrap(), &turns[9].1);

    // The refused turn, retried, is sent its whole transcript, read back through its holder.
    let (last, transcript) = turns.last().unwrap();
    assert!(inputs[TURNS - 1].get("prefixOf").is_some());
    app.retried_to_completion(last).await;
    let heard = upstream.calls().last().unwrap().body["messages"].clone();
    assert_eq!(heard.as_array().unwrap()[1..], transcript[..], "{heard}");
}

/// A chat turn with no session carries on the messages the turn before sent, parsed, only
/// when its own start with those very bytes: an edited message, the same transcript written
/// with other spacing, or another key's turn is parsed whole, and the model hears every
/// transcript exactly as sent, stored with the digest of its text.
#[tokio::test]
async fn a_chat_turn_carries_on_only_the_bytes_the_turn_before_sent() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("noted".into()));
    let app = spawn(api_workspace(&upstream, ""), None).await;
    let scrape = async || super::metrics_text(&app.http, &app.url("/metrics")).await;
    let carried = "stable_harness_chat_transcripts_total{how=\"carried\"}";
    let carried_before = super::metric_sample(&scrape().await, carried);
    // Sends `messages` as `body` writes them, with `key`; checks what the model heard and
    // the stored digest; gives the answer.
    let turn = async |key: &str, messages: &[Value], body: &dyn Fn(&Value) -> String| {
        let calls = upstream.calls().len();
        let response = app
            .http
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body(&json!({ "model": "assistant", "messages": messages })))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let request_id = super::request_id_header(&response);
        let answer: Value = response.json().await.unwrap();
        let heard = upstream.calls()[calls].body["messages"].clone();
        assert_eq!(heard.as_array().unwrap()[1..], messages[..], "{heard}");
        // A transcript past 4 KiB is stored with the digest of its text.
        let input = stored_input_of(&app, None, &request_id);
        let long = serde_json::to_string(messages).unwrap().len() >= 4_096;
        let digest = long.then(|| sha256_hex(messages));
        assert_eq!(
            input.get("inputDigest").and_then(Value::as_str),
            digest.as_deref()
        );
        answer["choices"][0]["message"].clone()
    };
    let compact = |body: &Value| serde_json::to_string(body).unwrap();
    let pretty = |body: &Value| serde_json::to_string_pretty(body).unwrap();
    let user =
        |n: usize| json!({ "role": "user", "content": format!("q{n} {}", "y".repeat(2_500)) });

    let mut sent = vec![user(0)];
    for n in 1..=4 {
        let answer = turn(CLIENT_KEY, &sent, &compact).await;
        sent.extend([answer, user(n)]);
    }
    let carried_after = super::metric_sample(&scrape().await, carried);
    assert!(
        carried_after - carried_before >= 2.0,
        "{carried_before} -> {carried_after}"
    );

    // The first message edited, one byte, its length and its end the same.
    let mut edited = sent.clone();
    edited[0]["content"] = json!(format!("Q0 {}", "y".repeat(2_500)));
    let answer = turn(CLIENT_KEY, &edited, &compact).await;
    edited.extend([answer, user(5)]);
    // Carried on from the edited turn (what the unedited one kept is gone); then two
    // questions with no answer between them.
    let carried_before = super::metric_sample(&scrape().await, carried);
    let answer = turn(CLIENT_KEY, &edited, &compact).await;
    let carried_after = super::metric_sample(&scrape().await, carried);
    assert!(
        carried_after > carried_before,
        "the turn after the edit carried on"
    );
    edited.extend([answer, user(6)]);
    turn(CLIENT_KEY, &edited, &compact).await;
    edited.push(user(7));
    turn(CLIENT_KEY, &edited, &compact).await;
    // The same messages written with other spacing, and then carried on from.
    edited.push(user(8));
    turn(CLIENT_KEY, &edited, &pretty).await;
    edited.push(user(9));
    turn(CLIENT_KEY, &edited, &pretty).await;
    // Another key continuing the first key's bytes, and the first key's turn before again.
    let mut theirs = edited.clone();
    theirs.push(user(10));
    turn(OTHER_CLIENT_KEY, &theirs, &compact).await;
    turn(CLIENT_KEY, &edited[..edited.len() - 1], &compact).await;
}

/// A chat client in a session sends its whole transcript every turn too: a turn whose
/// messages, as sent, start with those the turn before sent (its leading system message
/// among them) carries them on as parsed and parses only the rest. The model hears every
/// transcript exactly as sent; the session stores each message once and never the leading
/// system message (the call's own); a changed system message or an edited question reads
/// the whole, as before, and a turn in a session named by `user` carries on too.
#[tokio::test]
async fn a_session_chat_turn_carries_on_the_messages_the_turn_before_sent() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("noted".into()));
    let redacting = "  governance: { redact: { patterns: [\"sk-[a-z0-9]{8}\"] } }\n";
    let app = spawn(api_workspace(&upstream, redacting), None).await;
    let scrape = async || super::metrics_text(&app.http, &app.url("/metrics")).await;
    let carried = "stable_harness_chat_transcripts_total{how=\"carried\"}";
    let matched =
        |how: &str| format!("stable_harness_session_transcript_matches_total{{how=\"{how}\"}}");
    // Sends `messages` in `session` (the header, or else `user`); checks what the model
    // heard; gives the answer.
    let turn = async |session: Option<&str>, messages: &[Value]| {
        let calls = upstream.calls().len();
        let mut body = json!({ "model": "assistant", "messages": messages });
        let mut request = app
            .http
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(CLIENT_KEY);
        match session {
            Some(session) => request = request.header("x-stable-harness-session-id", session),
            None => body["user"] = json!("ada"),
        }
        let response = request.json(&body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let answer: Value = response.json().await.unwrap();
        let heard = upstream.calls()[calls].body["messages"].clone();
        assert_eq!(heard.as_array().unwrap()[1..], messages[..], "{heard}");
        answer["choices"][0]["message"].clone()
    };
    let session_view = async |session: &str| {
        let (status, view) = app
            .get(&format!("/runtime/sessions/{session}"), CLIENT_KEY)
            .await;
        assert_eq!(status, 200, "{view}");
        view
    };
    let system = |rules: &str| json!({ "role": "system", "content": format!("{rules} {}", "r".repeat(1_500)) });
    // Conversations told apart by their ends too, as they are (the entries kept are looked
    // for by their length and last bytes).
    let user =
        |n: usize| json!({ "role": "user", "content": format!("{} q{n}", "y".repeat(2_500)) });

    let carried_before = super::metric_sample(&scrape().await, carried);
    let matched_before = super::metric_sample(&scrape().await, &matched("carried"));
    let mut sent = vec![system("be brief"), user(0)];
    for n in 1..=5 {
        let answer = turn(Some("carry"), &sent).await;
        sent.extend([answer, user(n)]);
    }
    let carried_after = super::metric_sample(&scrape().await, carried);
    assert!(
        carried_after - carried_before >= 3.0,
        "{carried_before} -> {carried_after}"
    );
    // Each turn after the first long one compared with the session's path only what
    // followed the messages it carried on.
    let matched_after = super::metric_sample(&scrape().await, &matched("carried"));
    assert!(
        matched_after - matched_before >= 3.0,
        "{matched_before} -> {matched_after}"
    );
    let view = session_view("carry").await;
    let stored = view["messages"].as_array().unwrap();
    assert_eq!(stored.len(), 2 * 5, "each message stored once: {view:#}");
    assert!(
        stored.iter().all(|m| m["content"]["role"] != "system"),
        "{view:#}"
    );
    let history: Vec<&Value> = view["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| &m["content"]["content"])
        .collect();
    let said: Vec<&Value> = sent[1..sent.len() - 1]
        .iter()
        .map(|m| &m["content"])
        .collect();
    assert_eq!(history, said);

    // Other instructions (the first bytes differ): read whole, the session's path continued;
    // then carried on from.
    sent[0] = system("be thorough");
    let answer = turn(Some("carry"), &sent).await;
    sent.extend([answer, user(6)]);
    let carried_before = super::metric_sample(&scrape().await, carried);
    let answer = turn(Some("carry"), &sent).await;
    assert!(super::metric_sample(&scrape().await, carried) > carried_before);
    sent.extend([answer, user(7)]);
    let view = session_view("carry").await;
    assert_eq!(
        view["messages"].as_array().unwrap().len(),
        2 * 7,
        "{view:#}"
    );

    // An edited question far back: read whole, and its last question and answer stored from
    // a new root (it shares nothing with the session); then the unedited conversation goes
    // on, matched with its branch, heard as sent.
    let mut edited = sent.clone();
    edited[1]["content"] = json!(format!("Y{} q0", "y".repeat(2_499)));
    turn(Some("carry"), &edited).await;
    turn(Some("carry"), &sent).await;
    let view = session_view("carry").await;
    assert_eq!(
        view["messages"].as_array().unwrap().len(),
        2 * 9,
        "{view:#}"
    );
    assert_eq!(
        view["history"].as_array().unwrap().len(),
        sent.len(),
        "{view:#}"
    );

    // A question the store keeps redacted is not what was sent: the next turn, carried on,
    // still compares the whole and leaves the session's path there, as it would have
    // without carrying anything (its question stored from a new root).
    let secret = json!({ "role": "user", "content": format!("my key is sk-abcd1234 {}", "y".repeat(4_000)) });
    let mut leaky = vec![system("be brief"), secret];
    let answer = turn(Some("leaky"), &leaky).await;
    leaky.extend([answer, user(1)]);
    let whole_before = super::metric_sample(&scrape().await, &matched("whole"));
    turn(Some("leaky"), &leaky).await;
    assert!(super::metric_sample(&scrape().await, &matched("whole")) > whole_before);
    let view = session_view("leaky").await;
    assert_eq!(view["messages"].as_array().unwrap().len(), 4, "{view:#}");
    assert_eq!(view["history"].as_array().unwrap().len(), 2, "{view:#}");

    // Two conversations taking turns in one session: each carries its own messages on and
    // is matched with its own branch (the session's newest path is the other's); each
    // message is stored once.
    let mut chats = [
        vec![system("be brief"), user(100)],
        vec![system("be brief"), user(200)],
    ];
    let carried_before = super::metric_sample(&scrape().await, carried);
    let whole_before = super::metric_sample(&scrape().await, &matched("whole"));
    for round in 1..=3 {
        for (at, chat) in chats.iter_mut().enumerate() {
            let answer = turn(Some("two"), chat).await;
            chat.extend([answer, user(100 * (at + 1) + round)]);
        }
    }
    assert!(super::metric_sample(&scrape().await, carried) - carried_before >= 2.0);
    // The other conversation's turn is the session's newest each time: every turn with an
    // answer in it (two each round after the first) compared whole.
    assert!(super::metric_sample(&scrape().await, &matched("whole")) - whole_before >= 4.0);
    let view = session_view("two").await;
    assert_eq!(
        view["messages"].as_array().unwrap().len(),
        2 * 2 * 3,
        "{view:#}"
    );

    // A session named by `user`.
    let mut theirs = vec![
        system("be brief"),
        user(0),
        json!({ "role": "assistant", "content": "ok" }),
        user(1),
    ];
    let answer = turn(None, &theirs).await;
    theirs.extend([answer, user(2)]);
    let carried_before = super::metric_sample(&scrape().await, carried);
    turn(None, &theirs).await;
    assert!(super::metric_sample(&scrape().await, carried) > carried_before);
}
