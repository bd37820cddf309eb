//! Running for months (issue 9): retention prunes what passed its window, whole and in
//! batches, gives the space back and never touches pending or live work; an online backup
//! taken under load opens as a store with every request acknowledged before it; a full store
//! answers 503, loses nothing, and recovers by itself once there is room.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use super::tools::{ToolServer, tools_workspace};
use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, ServerProcess, TestApp, api_workspace, request_id_header};
use crate::helpers::{stable_harness, stderr, stdout, store_path, store_rows};

/// Requests of one id set still in the store's tables (any table that names a request).
fn rows_of(db: &std::path::Path, ids: &BTreeSet<String>) -> Vec<String> {
    let list = ids
        .iter()
        .map(|id| format!("'{id}'"))
        .collect::<Vec<_>>()
        .join(",");
    let mut found = Vec::new();
    for (table, column) in [
        ("requests", "id"),
        ("runs", "request_id"),
        ("events", "request_id"),
        ("messages", "request_id"),
        ("tool_calls", "request_id"),
        ("approvals", "request_id"),
    ] {
        let n = store_rows(
            db,
            &format!("SELECT COUNT(*) AS n FROM {table} WHERE {column} IN ({list})"),
        )[0]["n"]
            .as_u64()
            .unwrap();
        if n > 0 {
            found.push(format!("{table}: {n}"));
        }
    }
    found
}

async fn greet(app: &TestApp, text: &str) -> String {
    let (response, request_id) = app
        .chat(&json!({ "model": "greeter", "messages": [{ "role": "user", "content": text }] }))
        .await;
    assert_eq!(response.status(), 200);
    request_id
}

#[tokio::test]
async fn retention_prunes_what_passed_its_window_whole_and_keeps_pending_and_live_work() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    let app = TestApp::spawn(tools_workspace(
        &upstream,
        &tools,
        "  store:\n    retention: { requests: 2s, minKeep: 4, every: 1h, archive: { dir: archive } }\n",
    ))
    .await;
    let db = store_path(app.workspace.path());

    // Old: 40 stateless requests (a session each), a session's first request, and a request
    // waiting on an approval.
    let mut old = BTreeSet::new();
    for index in 0..40 {
        old.insert(greet(&app, &format!("visitor {index} {}", "x".repeat(2_000))).await);
    }
    let (status, first) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "Ada" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    let session = first["sessionId"].as_str().unwrap().to_owned();
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":12.5}"#),
        Reply::Text("Refunded".into()),
    ]);
    let pending = app.submit("clerk", "refund").await;
    app.pending_approval().await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;

    // New: the session goes on (so its old request is history of a live session), and one
    // more stateless request.
    let (status, second) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "sessionId": session, "input": { "text": "again" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{second}");
    let fresh = greet(&app, "newcomer").await;
    let (_, before) = app.get("/admin/store", ADMIN_KEY).await;

    // A dry run reports and removes nothing. minKeep 4 keeps the newest ended requests:
    // `fresh`, the session's two (inside its live session anyway) and the newest of the 40.
    let (status, dry) = app
        .post("/admin/store/prune", ADMIN_KEY, &json!({ "dryRun": true }))
        .await;
    assert_eq!(status, 200, "{dry}");
    assert_eq!(dry["dryRun"], true);
    assert_eq!(
        (
            dry["removed"]["sessions"].as_u64(),
            dry["removed"]["requests"].as_u64()
        ),
        (Some(39), Some(39)),
        "{dry}"
    );
    assert!(
        dry["removed"]["events"].as_u64().unwrap() >= 39 * 3,
        "{dry}"
    );
    // requests, runs, events and messages of the old ones are all still there.
    assert_eq!(rows_of(&db, &old).len(), 4, "a dry run deletes nothing");

    let (status, report) = app.post("/admin/store/prune", ADMIN_KEY, &json!({})).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["removed"], dry["removed"], "{report}");
    assert_eq!(report["archivedSessions"], 39, "{report}");
    assert!(report["reclaimedBytes"].as_u64().unwrap() > 0, "{report}");

    // Gone with every row, except the newest of the 40 (minKeep).
    let survivors: Vec<String> = old
        .iter()
        .filter(|id| {
            !store_rows(&db, &format!("SELECT id FROM requests WHERE id = '{id}'")).is_empty()
        })
        .cloned()
        .collect();
    assert_eq!(survivors, vec![old.iter().next_back().unwrap().clone()]);
    let pruned: BTreeSet<String> = old
        .iter()
        .filter(|id| !survivors.contains(id))
        .cloned()
        .collect();
    assert!(
        rows_of(&db, &pruned).is_empty(),
        "{:?}",
        rows_of(&db, &pruned)
    );
    let (status, _) = app
        .get(
            &format!("/admin/requests/{}", pruned.iter().next().unwrap()),
            ADMIN_KEY,
        )
        .await;
    assert_eq!(status, 404);
    // Pending and live work survives whole.
    for id in [
        first["requestId"].as_str().unwrap(),
        second["requestId"].as_str().unwrap(),
        pending["requestId"].as_str().unwrap(),
        fresh.as_str(),
    ] {
        let (status, view) = app.get(&format!("/admin/requests/{id}"), ADMIN_KEY).await;
        assert_eq!(status, 200, "{id}: {view}");
    }
    let history = store_rows(
        &db,
        &format!("SELECT content FROM messages WHERE session_id = '{session}'"),
    );
    assert_eq!(
        history.len(),
        4,
        "the live session's history is whole: {history:?}"
    );
    let approval = app.pending_approval().await;
    assert_eq!(approval["status"], "pending");

    // The archive holds the pruned sessions, one JSON line each, with their requests.
    let archive_dir = app.workspace.path().join("archive");
    let mut archived = BTreeSet::new();
    for entry in std::fs::read_dir(&archive_dir).unwrap() {
        for line in std::fs::read_to_string(entry.unwrap().path())
            .unwrap()
            .lines()
        {
            let session: Value = serde_json::from_str(line).unwrap();
            // A chat turn's two messages, and its request with its run and events.
            assert_eq!(session["messages"].as_array().unwrap().len(), 2, "{line}");
            for request in session["requests"].as_array().unwrap() {
                assert_eq!(
                    request["request"]["sessionId"], session["session"]["id"],
                    "{line}"
                );
                assert_eq!(request["runs"].as_array().unwrap().len(), 1, "{line}");
                assert!(!request["events"].as_array().unwrap().is_empty());
                archived.insert(request["request"]["id"].as_str().unwrap().to_owned());
            }
        }
    }
    assert_eq!(archived, pruned);

    // The space came back to the filesystem (at the checkpoint that follows; a reader may
    // hold it back a moment), and the pass is on record.
    let mut after = Value::Null;
    for _ in 0..100 {
        after = app.get("/admin/store", ADMIN_KEY).await.1;
        if after["stats"]["databaseBytes"].as_u64() < before["stats"]["databaseBytes"].as_u64() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        after["stats"]["databaseBytes"].as_u64() < before["stats"]["databaseBytes"].as_u64(),
        "before {before}\nafter {after}"
    );
    let record = &after["maintenance"][0];
    assert_eq!(
        (record["operation"].as_str(), record["status"].as_str()),
        (Some("prune"), Some("completed")),
        "{after}"
    );
    assert_eq!(record["report"]["removed"]["sessions"], 39);
}

#[tokio::test]
async fn the_background_pass_prunes_by_itself_and_an_agent_window_overrides_the_store_one() {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(
        &upstream,
        "  store:\n    retention: { requests: 1h, minKeep: 0, every: 1s }\n",
    );
    // The greeter keeps its requests one second; everyone else an hour.
    let agents = std::fs::read_to_string(workspace.path().join("config/agents/agents.yaml"))
        .unwrap()
        .replace(
            "  script: [{ reply: \"Hello {{input}}\" }, { reply: \"!\" }]\n",
            "  script: [{ reply: \"Hello {{input}}\" }, { reply: \"!\" }]\n  retention: { requests: 1s }\n",
        );
    workspace.write("config/agents/agents.yaml", agents);
    upstream.set_default(Reply::Text("kept".into()));
    let app = TestApp::spawn(workspace).await;
    let greeted = greet(&app, "soon gone").await;
    let (response, kept) = app
        .chat(&json!({ "model": "assistant", "messages": [{ "role": "user", "content": "stay" }] }))
        .await;
    assert_eq!(response.status(), 200);

    let mut gone = false;
    for _ in 0..200 {
        let (status, _) = app
            .get(&format!("/admin/requests/{greeted}"), ADMIN_KEY)
            .await;
        if status == 404 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the greeter's request was never pruned");
    let (status, _) = app.get(&format!("/admin/requests/{kept}"), ADMIN_KEY).await;
    assert_eq!(status, 200, "the assistant's hour has not passed");
}

#[tokio::test]
async fn a_backup_taken_under_load_opens_as_a_store_holding_every_request_acknowledged_before_it() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "");
    let server = ServerProcess::start(workspace.path(), &[]);
    let http = reqwest::Client::new();

    // Load: four clients greet without pause; each acknowledged request is noted.
    let acknowledged: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for client in 0..4 {
        let (http, url) = (http.clone(), server.url("/v1/chat/completions"));
        let (acknowledged, stop) = (Arc::clone(&acknowledged), Arc::clone(&stop));
        clients.push(tokio::spawn(async move {
            let mut index = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                index += 1;
                let response = http
                    .post(&url)
                    .bearer_auth(CLIENT_KEY)
                    .json(&json!({ "model": "greeter", "messages": [{ "role": "user", "content": format!("{client}.{index}") }] }))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200);
                let id = request_id_header(&response);
                acknowledged.lock().unwrap().push(id);
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;

    // Through the admin API...
    let before_api: Vec<String> = acknowledged.lock().unwrap().clone();
    let response = http
        .post(server.url("/admin/store/backup"))
        .bearer_auth(ADMIN_KEY)
        .json(&json!({ "file": "under-load.db" }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let report: Value = response.json().await.unwrap();
    assert!(report["bytes"].as_u64().unwrap() > 0, "{report}");
    let api_copy = workspace
        .path()
        .join(".stable-harness/backups/under-load.db");
    assert_eq!(report["file"], api_copy.display().to_string());
    // ...twice with the same name is refused, and a name with a path in it too.
    for (body, status) in [
        (json!({ "file": "under-load.db" }), 409),
        (json!({ "file": "../../escape.db" }), 400),
    ] {
        let response = http
            .post(server.url("/admin/store/backup"))
            .bearer_auth(ADMIN_KEY)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), status, "{body}");
    }

    // ...and from the command line, beside the running server.
    let before_cli: Vec<String> = acknowledged.lock().unwrap().clone();
    let cli_copy = workspace.path().join("cli-copy.db");
    let output = stable_harness(&[
        "store",
        "backup",
        "-w",
        workspace.path().to_str().unwrap(),
        "--to",
        cli_copy.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout(&output).contains("cli-copy.db"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }
    assert!(
        before_cli.len() > before_api.len(),
        "the load went on between the backups"
    );

    for (copy, expected) in [(&api_copy, &before_api), (&cli_copy, &before_cli)] {
        let stored: BTreeSet<String> =
            store_rows(copy, "SELECT id FROM requests WHERE status = 'completed'")
                .into_iter()
                .map(|row| row["id"].as_str().unwrap().to_owned())
                .collect();
        let missing: Vec<&String> = expected.iter().filter(|id| !stored.contains(*id)).collect();
        assert!(missing.is_empty(), "{copy:?} lacks {missing:?}");
    }

    // A copy opens as a store: a server started on it serves what it holds.
    let restored = crate::helpers::TestWorkspace::empty();
    for file in [
        "config/runtime/workspace.yaml",
        "config/agents/agents.yaml",
        "config/catalogs/models.yaml",
    ] {
        restored.write(file, std::fs::read(workspace.path().join(file)).unwrap());
    }
    std::fs::create_dir_all(restored.path().join(".stable-harness")).unwrap();
    std::fs::copy(&api_copy, store_path(restored.path())).unwrap();
    let second = ServerProcess::start(restored.path(), &[]);
    let response = http
        .get(second.url(&format!("/admin/requests/{}", before_api[0])))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let view: Value = response.json().await.unwrap();
    assert_eq!(view["status"], "completed", "{view}");
}

#[tokio::test]
async fn a_full_store_answers_503_loses_nothing_and_recovers_by_itself_once_there_is_room() {
    let upstream = MockUpstream::start().await;
    // The store may hold 3 MiB. A big old request of the `ballast` agent (kept one second)
    // takes much of it; greetings (kept forever) fill the rest.
    let workspace = api_workspace(
        &upstream,
        "  store:\n    maxSize: 3MiB\n    retention: { minKeep: 0, every: 1h }\n",
    );
    workspace.write(
        "config/agents/ballast.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: ballast }\nspec:\n  backend: scripted\n  script: [{ reply: \"{{input}}\" }]\n  retention: { requests: 1s }\n",
    );
    let app = Arc::new(TestApp::spawn(workspace).await);
    let (status, ballast) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "ballast", "input": { "text": "b".repeat(400_000) }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{ballast}");
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    // Greet until the store is full: a submit is refused with 503 and /readyz is red. Requests
    // caught in flight wait at their next commit.
    let mut acknowledged = Vec::new();
    let mut in_flight = Vec::new();
    let mut refused = None;
    for index in 0..2_000 {
        let client = Arc::clone(&app);
        let call = tokio::spawn(async move {
            let app = client;
            let response = app
                .http
                .post(app.url("/v1/chat/completions"))
                .bearer_auth(CLIENT_KEY)
                .json(&json!({ "model": "greeter", "messages": [{ "role": "user", "content": format!("{index} {}", "g".repeat(4_000)) }] }))
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let id = response
                .headers()
                .get("x-stable-harness-request-id")
                .map(|v| v.to_str().unwrap().to_owned());
            (
                status,
                id,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        });
        let mut call = call;
        match tokio::time::timeout(Duration::from_millis(500), &mut call).await {
            Ok(done) => {
                let (status, id, body) = done.unwrap();
                if status == 503 {
                    assert_eq!(body["error"]["code"], "store_unavailable", "{body}");
                    refused = Some(body);
                    break;
                }
                assert_eq!(status, 200, "{body}");
                acknowledged.push(id.unwrap());
            }
            // Paused at a commit point while the store is full: it must finish later.
            Err(_) => in_flight.push(call),
        }
        if !in_flight.is_empty() {
            let (status, _) = app.get("/readyz", CLIENT_KEY).await;
            if status == 503 {
                break;
            }
        }
    }
    assert!(
        refused.is_some() || !in_flight.is_empty(),
        "the store never filled up ({} requests)",
        acknowledged.len()
    );
    let (status, ready) = app.get("/readyz", CLIENT_KEY).await;
    assert_eq!(status, 503, "{ready}");
    let (status, body) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "no room" } }),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{body}"
    );

    // The operator makes room: the ballast is past its window. Service resumes by itself.
    let (status, report) = app.post("/admin/store/prune", ADMIN_KEY, &json!({})).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["removed"]["requests"], 1, "{report}");
    let mut ready = false;
    for _ in 0..200 {
        if app.get("/readyz", CLIENT_KEY).await.0 == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "the server did not recover by itself");
    for waiting in in_flight {
        let (status, id, body) = waiting.await.unwrap();
        assert_eq!(
            status, 200,
            "a paused request failed instead of finishing: {body}"
        );
        acknowledged.push(id.unwrap());
    }

    // Nothing acknowledged was lost.
    let db = store_path(app.workspace.path());
    let stored: BTreeSet<String> = store_rows(
        &db,
        "SELECT id FROM requests WHERE status = 'completed' AND agent_id = 'greeter'",
    )
    .into_iter()
    .map(|row| row["id"].as_str().unwrap().to_owned())
    .collect();
    let lost: Vec<&String> = acknowledged
        .iter()
        .filter(|id| !stored.contains(*id))
        .collect();
    assert!(lost.is_empty(), "lost: {lost:?}");
    let (status, _) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "room again" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn store_prune_on_the_command_line_reports_then_removes_and_defers_to_a_running_server() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(
        &upstream,
        "  store:\n    retention: { requests: 1s, minKeep: 1, every: 1h }\n",
    ))
    .await;
    for index in 0..3 {
        greet(&app, &format!("guest {index}")).await;
    }
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let dir = app.workspace.path().to_str().unwrap().to_owned();
    let held = stable_harness(&["store", "prune", "-w", &dir, "--now"]);
    assert_eq!(held.status.code(), Some(1));
    assert!(
        stderr(&held).contains("POST /admin/store/prune"),
        "{}",
        stderr(&held)
    );
    let workspace = app.stop().await;
    let dir = workspace.path().to_str().unwrap().to_owned();

    let usage = stable_harness(&["store", "prune", "-w", &dir]);
    assert_eq!(
        usage.status.code(),
        Some(2),
        "--dry-run or --now is required"
    );
    let dry = stable_harness(&["store", "prune", "-w", &dir, "--dry-run"]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert!(
        stdout(&dry).contains("would remove: 2 sessions, 2 requests"),
        "{}",
        stdout(&dry)
    );
    let now = stable_harness(&["store", "prune", "-w", &dir, "--now", "--json"]);
    assert!(now.status.success(), "{}", stderr(&now));
    let report: Value = serde_json::from_str(&stdout(&now)).unwrap();
    assert_eq!(report["removed"]["requests"], 2, "{report}");
    let left = store_rows(
        &store_path(workspace.path()),
        "SELECT COUNT(*) AS n FROM requests",
    );
    assert_eq!(left[0]["n"], 1);
}

/// Every request the archive holds (its files under the workspace's `archive/`), as stored.
fn archived_requests(app: &TestApp) -> Vec<Value> {
    let mut requests = Vec::new();
    for entry in std::fs::read_dir(app.workspace.path().join("archive")).unwrap() {
        for line in std::fs::read_to_string(entry.unwrap().path())
            .unwrap()
            .lines()
        {
            let session: Value = serde_json::from_str(line).unwrap();
            for request in session["requests"].as_array().unwrap() {
                requests.push(request["request"].clone());
            }
        }
    }
    requests
}

on_both_stores!(a_request_a_later_turn_names_is_pruned_after_that_turn);
/// Retention and a chat with no session: a turn naming the request that holds its
/// transcript's first messages keeps that request (and its session) past its window until
/// the turn itself is pruned; the turns between them go, each archived with its whole
/// transcript, and the conversation goes on, the model hearing it whole. A request older
/// than half its window is not named (a prune could take it before the naming turn is
/// stored).
async fn a_request_a_later_turn_names_is_pruned_after_that_turn(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("ok".into()));
    let retention = "  store:\n    retention: { requests: 4s, minKeep: 0, every: 1h, archive: { dir: archive } }\n";
    let app = super::control::spawn(api_workspace(&upstream, retention), store.clone()).await;
    let mut sent: Vec<Value> = Vec::new();
    let mut turns: Vec<String> = Vec::new();
    let mut transcripts: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let exists = async |app: &TestApp, id: &str| {
        let (status, _) = app.get(&format!("/admin/requests/{id}"), ADMIN_KEY).await;
        assert!(status == 200 || status == 404, "{status}");
        status == 200
    };
    let prune = async |app: &TestApp| {
        let (status, report) = app.post("/admin/store/prune", ADMIN_KEY, &json!({})).await;
        assert_eq!(status, 200, "{report}");
    };
    let mut turn = async |n: usize| {
        // Long enough (5 KB) for the first turn to be named by those after it.
        let question = format!("q{n} {}", "x".repeat(5_000));
        sent.push(json!({ "role": "user", "content": question }));
        let (response, id) = app
            .chat(&json!({ "model": "assistant", "messages": sent }))
            .await;
        assert_eq!(response.status(), 200);
        let heard = upstream.calls().last().unwrap().body["messages"].clone();
        assert_eq!(heard.as_array().unwrap()[1..], sent[..], "turn {n}");
        let answer: Value = response.json().await.unwrap();
        transcripts.insert(id.clone(), sent.clone());
        sent.push(answer["choices"][0]["message"].clone());
        id
    };
    // The first turn holds its transcript; the next four name it, the fifth well inside
    // the first half of the window.
    for n in 1..=4 {
        turns.push(turn(n).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    turns.push(turn(5).await);
    // Turns 2-4 pass their window; the fifth keeps the first.
    tokio::time::sleep(Duration::from_millis(3_700)).await;
    prune(&app).await;
    assert!(exists(&app, &turns[0]).await);
    for id in &turns[1..4] {
        assert!(!exists(&app, id).await, "{id} outlived its window");
    }
    assert!(exists(&app, &turns[4]).await);
    // Past half its window, the fifth is not named: the sixth holds its transcript whole.
    turns.push(turn(6).await);
    let transcripts = transcripts;
    let stored = |id: &str| super::control::stored_input_of(&app, store.as_deref(), id);
    assert_eq!(stored(&turns[4])["prefixOf"], json!(turns[0]));
    assert!(stored(&turns[5]).get("prefixOf").is_none());
    // Turns 2-4 were archived, each with the transcript it was sent (the named first
    // messages written in, no name left).
    let archived = archived_requests(&app);
    assert_eq!(archived.len(), 3, "{archived:?}");
    for request in &archived {
        let id = request["id"].as_str().unwrap();
        assert!(turns[1..4].iter().any(|turn| turn == id), "{id}");
        assert!(request["input"].get("prefixOf").is_none(), "{request}");
        assert_eq!(request["input"]["messages"], json!(transcripts[id]), "{id}");
    }
    // Past every window, the naming turns go, and then what they named.
    tokio::time::sleep(Duration::from_millis(4_200)).await;
    prune(&app).await;
    prune(&app).await;
    for id in &turns {
        assert!(!exists(&app, id).await, "{id} outlived its window");
    }
}
