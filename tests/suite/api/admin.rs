//! The operator API: a separate key scope, request lists with filters and cursors, runs and
//! their events.

use serde_json::{Value, json};

use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace, assert_gapless};

#[tokio::test]
async fn admin_keys_are_a_separate_scope() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let response = app
        .http
        .get(app.url("/admin/requests"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let (status, envelope) = app.get("/admin/requests", CLIENT_KEY).await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (403, Some("wrong_key_scope"))
    );
    let (status, _) = app.get("/admin/requests", "not-a-key").await;
    assert_eq!(status, 401);
    let (status, _) = app.get("/admin/requests", ADMIN_KEY).await;
    assert_eq!(status, 200);
    // Health and the OpenAPI document need no key.
    for path in ["/healthz", "/readyz", "/openapi.json"] {
        assert_eq!(
            app.http.get(app.url(path)).send().await.unwrap().status(),
            200,
            "{path}"
        );
    }
}

#[tokio::test]
async fn requests_filter_and_paginate_with_cursors() {
    let upstream = MockUpstream::start().await;
    upstream.push([Reply::Status {
        status: 400,
        retry_after: None,
    }]);
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    // One failed openai request, then four scripted ones.
    let (_, failed) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "assistant", "input": { "text": "x" }, "wait": true }),
        )
        .await;
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["error"]["kind"], "upstream_rejected");
    for n in 0..4 {
        let (status, _) = app
            .post(
                "/runtime/requests",
                CLIENT_KEY,
                &json!({ "agentId": "greeter", "input": { "text": n.to_string() }, "wait": true }),
            )
            .await;
        assert_eq!(status, 200);
    }
    let (_, all) = app.get("/admin/requests", ADMIN_KEY).await;
    assert_eq!(all["data"].as_array().unwrap().len(), 5);
    assert!(all["nextCursor"].is_null());

    let (_, failed_only) = app.get("/admin/requests?status=failed", ADMIN_KEY).await;
    assert_eq!(failed_only["data"].as_array().unwrap().len(), 1);
    assert_eq!(failed_only["data"][0]["requestId"], failed["requestId"]);
    let (_, greeter) = app
        .get(
            "/admin/requests?agentId=greeter&status=completed",
            ADMIN_KEY,
        )
        .await;
    assert_eq!(greeter["data"].as_array().unwrap().len(), 4);

    // Pages of two, newest first, until the cursor runs out.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(cursor) => format!("/admin/requests?limit=2&cursor={cursor}"),
            None => "/admin/requests?limit=2".to_owned(),
        };
        let (status, page) = app.get(&path, ADMIN_KEY).await;
        assert_eq!(status, 200);
        seen.extend(
            page["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["requestId"].as_str().unwrap().to_owned()),
        );
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    let expected: Vec<String> = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["requestId"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(seen, expected);

    let (status, envelope) = app.get("/admin/requests?status=sleeping", ADMIN_KEY).await;
    assert_eq!(
        (status, envelope["error"]["param"].as_str()),
        (422, Some("status"))
    );
    let (status, _) = app.get("/admin/requests?limit=0", ADMIN_KEY).await;
    assert_eq!(status, 422);
}

/// On PostgreSQL a request's events are stored a run's stretch to a row (migration 0010),
/// and read back one by one, whole, from every cursor: by request and by run.
#[tokio::test]
async fn on_postgres_events_are_stored_in_rows_and_read_back_one_by_one() {
    let database = crate::pg::fresh_database();
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn_on(
        api_workspace(&upstream, ""),
        Some(database.clone()),
        &[CLIENT_KEY],
        &[ADMIN_KEY],
    )
    .await;
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "input": { "text": "x" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    let request_id = view["requestId"].as_str().unwrap();
    let run_id = view["runs"][0]["runId"].as_str().unwrap();
    let events_path = format!("/runtime/requests/{request_id}/events");
    let (_, page) = app.get(&events_path, CLIENT_KEY).await;
    let events = page["data"].as_array().unwrap().clone();
    assert_gapless(&events);
    assert_eq!(events.last().unwrap()["type"], "runtime.request.completed");
    let stored = crate::pg::psql(
        &database,
        &format!(
            "SELECT count(*) || ' ' || sum(1 + coalesce(jsonb_array_length(more), 0)) \
             FROM events WHERE request_id = '{request_id}'"
        ),
    );
    let (rows, in_rows) = stored.trim().split_once(' ').unwrap();
    let (rows, in_rows): (usize, usize) = (rows.parse().unwrap(), in_rows.parse().unwrap());
    assert_eq!(in_rows, events.len(), "the rows hold every event once");
    assert!(
        rows < events.len(),
        "{} events in {rows} rows: one row each",
        events.len()
    );
    for after in 0..events.len() as i64 {
        for (path, key, of_run) in [
            (events_path.clone(), CLIENT_KEY, false),
            (format!("/admin/runs/{run_id}/events"), ADMIN_KEY, true),
        ] {
            let (status, page) = app.get(&format!("{path}?after={after}&limit=2"), key).await;
            assert_eq!(status, 200, "{page}");
            let found: Vec<&Value> = page["data"].as_array().unwrap().iter().collect();
            let wanted: Vec<&Value> = events
                .iter()
                .filter(|e| e["seq"].as_i64().unwrap() > after && (!of_run || e["runId"] == run_id))
                .take(2)
                .collect();
            assert_eq!(found, wanted, "{path} after {after}");
        }
    }
}

#[tokio::test]
async fn runs_and_their_events() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (_, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "input": { "text": "x" }, "wait": true }),
        )
        .await;
    let run_id = view["runs"][0]["runId"].as_str().unwrap();
    let (status, run) = app.get(&format!("/admin/runs/{run_id}"), ADMIN_KEY).await;
    assert_eq!(status, 200);
    assert_eq!(
        (run["status"].as_str(), run["attempt"].as_i64()),
        (Some("completed"), Some(1))
    );
    assert!(run["startedAt"].is_string() && run["endedAt"].is_string());
    let (status, page) = app
        .get(&format!("/admin/runs/{run_id}/events"), ADMIN_KEY)
        .await;
    assert_eq!(status, 200);
    let events = page["data"].as_array().unwrap();
    assert_gapless(events);
    assert!(events.iter().all(|e| e["runId"] == run_id));
    let (status, envelope) = app.get("/admin/runs/run_nope/events", ADMIN_KEY).await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (404, Some("run_not_found"))
    );
}
