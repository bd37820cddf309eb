//! The server on PostgreSQL, end to end: the binary started with a `postgres://` URL serves
//! `/v1` with a tool call through the gateway, keeps the URL's password out of what it prints,
//! and — until runs are claimed with leases — refuses a second instance on the same database
//! as it refuses one on an embedded store.

use std::time::Duration;

use serde_json::{Value, json};

use super::tools::{ToolServer, tools_workspace};
use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, ServerProcess, assert_gapless};
use crate::helpers::output_within;

#[tokio::test]
async fn the_server_on_postgres_answers_v1_with_a_tool_call_and_owns_its_database() {
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
    let server = ServerProcess::start(
        workspace.path(),
        &[("STABLE_HARNESS_DATABASE_URL", with_password.as_str())],
    );
    let http = reqwest::Client::new();
    let response = http
        .post(server.url("/v1/chat/completions"))
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

    let events: Value = http
        .get(server.url(&format!("/runtime/requests/{request_id}/events")))
        .bearer_auth(CLIENT_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let events = events["data"].as_array().unwrap();
    assert_gapless(events);
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "runtime.tool.direct.completed"),
        "{events:?}"
    );
    let view: Value = http
        .get(server.url(&format!("/admin/requests/{request_id}")))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view["status"], "completed", "{view}");
    let ready = http.get(server.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);

    // A second instance on the same database is refused, and says why.
    let refused = start_beside(workspace.path(), &with_password);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(said.contains("in use"), "{said}");
    assert!(!said.contains("hunter2secret"), "{said}");
    assert!(!server.stderr().contains("hunter2secret"));

    // The ownership lock's connection dies (a database restart would do the same): the
    // instance takes the lock again and keeps serving; a newcomer is still refused.
    let killed = crate::pg::psql(
        &url,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' AND granted",
    );
    assert!(killed.trim().parse::<u32>().unwrap() >= 1, "{killed}");
    tokio::time::sleep(Duration::from_secs(7)).await;
    let held = crate::pg::psql(
        &url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
    );
    assert_eq!(held.trim(), "1", "the lock was taken again");
    let refused = start_beside(workspace.path(), &url);
    assert!(!refused.status.success());
    upstream.set_default(Reply::Text("still serving".into()));
    let response = http
        .post(server.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(&json!({ "model": "clerk", "messages": [{ "role": "user", "content": "still there?" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    server.terminate();
}

/// `start` on the same database as a running instance; its output once it exits.
fn start_beside(workspace: &std::path::Path, url: &str) -> std::process::Output {
    let mut start = std::process::Command::new(env!("CARGO_BIN_EXE_stable-harness"));
    start
        .args(["start", "-w", workspace.to_str().unwrap(), "--port", "0"])
        .args(["--database-url", url])
        .env("STABLE_HARNESS_LOG", "error");
    output_within(start, Duration::from_secs(30))
}
