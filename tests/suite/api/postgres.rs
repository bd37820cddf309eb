//! The server on PostgreSQL, end to end, and several instances on one database (SPEC
//! section 8): each is the binary started with a `postgres://` URL. A request started on one
//! instance is approved through another's admin API and followed live from either, with
//! `Last-Event-ID` resume across them; a killed instance's run is taken over by the other once
//! its lease expires.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

use super::tools::{ToolServer, tools_workspace};
use super::trust::{data_of, pending_approvals, submit, teller_workspace};
use super::upstream::{MockUpstream, Reply};
use super::{
    ADMIN_KEY, CLIENT_KEY, RecordingTools, ServerProcess, all_events, assert_gapless,
    wait_until_done_at,
};

/// Runs are leased for 2s in these tests, so a takeover happens within seconds.
const SHORT_LEASE: &str = "  store: { leaseDuration: 2s }\n";

#[tokio::test]
async fn the_server_on_postgres_answers_v1_with_a_tool_call_beside_a_second_instance() {
    stable_harness::app::install_crypto_provider();
    let url = crate::pg::fresh_database();
    // Trust authentication accepts any password: this one must never be printed.
    let with_password = url.replacen("postgres@", "postgres:hunter2secret@", 1);
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([
        Reply::call("weather_lookup", r#"{"city":"Paris"}"#),
        Reply::Text("It is sunny in Paris".into()),
    ]);
    let workspace = tools_workspace(&upstream, &tools, "");
    let env = [("STABLE_HARNESS_DATABASE_URL", with_password.as_str())];
    // Two instances start together on a fresh database: the migration runs once.
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(|| ServerProcess::start(workspace.path(), &env));
        let b = scope.spawn(|| ServerProcess::start(workspace.path(), &env));
        (a.join().unwrap(), b.join().unwrap())
    });
    let http = reqwest::Client::new();
    let response = http
        .post(a.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({ "model": "clerk", "messages": [{ "role": "user", "content": "weather?" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let request_id = response.headers()["x-stable-harness-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "It is sunny in Paris"
    );
    assert_eq!(tools.count("/weather"), 1);

    // Either instance serves what the other stored.
    let events = all_events(&http, &b.base, &request_id).await;
    assert_gapless(&events);
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "runtime.tool.direct.completed"),
        "{events:?}"
    );
    let (_, view) = super::get_json(
        &http,
        &b.url(&format!("/admin/requests/{request_id}")),
        ADMIN_KEY,
    )
    .await;
    assert_eq!(view["status"], "completed", "{view}");
    upstream.set_default(Reply::Text("from b".into()));
    let response = http
        .post(b.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({ "model": "clerk", "messages": [{ "role": "user", "content": "hi" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    for server in [&a, &b] {
        let ready = http.get(server.url("/readyz")).send().await.unwrap();
        assert_eq!(ready.status(), 200);
        assert!(!server.stderr().contains("hunter2secret"));
    }
    let migrations = crate::pg::psql(&url, "SELECT count(*) FROM _sqlx_migrations");
    assert_eq!(migrations.trim(), "2", "each migration applied once");
    a.terminate();
    b.terminate();
}

/// The `id:` lines of an SSE text.
fn sse_ids(text: &str) -> Vec<i64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("id:"))
        .map(|s| s.trim().parse().unwrap())
        .collect()
}

#[tokio::test]
async fn a_request_on_a_is_approved_through_b_and_followed_live_from_b_then_resumed_on_a() {
    stable_harness::app::install_crypto_provider();
    let url = crate::pg::fresh_database();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    // The refund waits at the tool service until the test has read B's stream up to it.
    tools.hold("/refund");
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":5}"#),
        Reply::Text("refund sent".into()),
    ]);
    let workspace = teller_workspace(&upstream, &tools, "UNSET_KEY_A", "UNSET_KEY_B", "");
    let env = [("STABLE_HARNESS_DATABASE_URL", url.as_str())];
    let a = ServerProcess::start(workspace.path(), &env);
    let b = ServerProcess::start(workspace.path(), &env);
    let http = reqwest::Client::new();
    let (status, accepted) = submit(
        &http,
        &a.base,
        &json!({ "agentId": "teller", "input": { "text": "refund me" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();

    // B follows the request live; the run executes on A.
    let response = http
        .get(b.url(&format!("/runtime/requests/{request_id}/events")))
        .bearer_auth(CLIENT_KEY)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    let mut stream = response.bytes_stream();
    let mut seen = String::new();
    let mut read_until = async |wanted: &str, seen: &mut String| {
        while !seen.contains(wanted) {
            let chunk = tokio::time::timeout(Duration::from_secs(20), stream.next())
                .await
                .unwrap_or_else(|_| panic!("no {wanted} within 20s: {seen}"))
                .unwrap_or_else(|| panic!("the stream ended before {wanted}: {seen}"))
                .unwrap();
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    };
    read_until("event: runtime.approval.requested", &mut seen).await;

    // The operator decides on B; the run waiting on A wakes and goes on.
    let pending = pending_approvals(&http, &b.base, 1).await;
    let approval_id = pending[0]["id"].as_str().unwrap();
    let decided = http
        .post(b.url(&format!("/admin/approvals/{approval_id}/approve")))
        .bearer_auth(ADMIN_KEY)
        .json(&json!({ "reason": "checked on b" }))
        .send()
        .await
        .unwrap();
    assert_eq!(decided.status(), 200);
    read_until("event: runtime.approval.resolved", &mut seen).await;
    read_until("event: runtime.tool.direct.started", &mut seen).await;
    // Drop B's stream mid-run and resume on A from the last event B sent.
    drop(stream);
    tools.release("/refund");
    let before = sse_ids(&seen);
    let last = *before.last().unwrap();
    let rest = http
        .get(a.url(&format!("/runtime/requests/{request_id}/events")))
        .bearer_auth(CLIENT_KEY)
        .header("accept", "text/event-stream")
        .header("last-event-id", last.to_string())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(rest.contains("event: runtime.request.completed"), "{rest}");
    let mut ids = before.clone();
    ids.extend(sse_ids(&rest));
    let stored = all_events(&http, &a.base, &request_id).await;
    assert_gapless(&stored);
    assert_eq!(ids, (1..=stored.len() as i64).collect::<Vec<_>>());

    let view = wait_until_done_at(&http, &b.base, &request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(tools.at("/refund").len(), 1, "the tool ran once");
    let resolved = data_of(&stored, "runtime.approval.resolved");
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0]["decision"], "approved");
    a.terminate();
    b.terminate();
}

#[tokio::test]
async fn kill_9_of_the_instance_holding_a_run_hands_it_to_the_other_after_its_lease() {
    stable_harness::app::install_crypto_provider();
    let url = crate::pg::fresh_database();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    tools.hold("/ledger");
    upstream.push([
        Reply::call("ledger_write", r#"{"entry":"rent"}"#),
        Reply::Text("written down".into()),
    ]);
    let workspace = teller_workspace(&upstream, &tools, "UNSET_KEY_A", "UNSET_KEY_B", SHORT_LEASE);
    let env = [("STABLE_HARNESS_DATABASE_URL", url.as_str())];
    let a = ServerProcess::start(workspace.path(), &env);
    let b = ServerProcess::start(workspace.path(), &env);
    let http = reqwest::Client::new();
    let (status, accepted) = submit(
        &http,
        &a.base,
        &json!({ "agentId": "teller", "input": { "text": "note the rent" } }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    let run_id = accepted["runId"].as_str().unwrap().to_owned();
    // A is executing the call (the tool holds it) when it dies.
    tools.wait_for("/ledger", 1).await;
    let holder = |url: &str| {
        crate::pg::psql(
            url,
            &format!("SELECT coalesce(lease_holder, '-') FROM runs WHERE id = '{run_id}'"),
        )
        .trim()
        .to_owned()
    };
    let held_by_a = holder(&url);
    assert!(held_by_a.starts_with("ins_"), "{held_by_a}");
    a.kill9();
    tools.release("/ledger");

    // B claims the run once A's lease expired, and finishes it: the interrupted call (medium
    // risk) runs again with the same idempotency key.
    let view = wait_until_done_at(&http, &b.base, &request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "written down", "{view}");
    let keys: Vec<_> = tools
        .at("/ledger")
        .into_iter()
        .map(|e| e.idempotency_key.unwrap())
        .collect();
    assert_eq!(keys, [format!("{run_id}.t1.0"), format!("{run_id}.t1.0")]);
    let events = all_events(&http, &b.base, &request_id).await;
    assert_gapless(&events);
    assert_eq!(data_of(&events, "runtime.request.started").len(), 2);
    assert_eq!(holder(&url), "-", "an ended run keeps no lease");
    b.terminate();
}
