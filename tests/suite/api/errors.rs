//! Errors speak the envelope everywhere: keys are checked before routes, query and path
//! parameters that do not parse name themselves, messages no model accepts never reach the
//! upstream, a disabled surface is gone, exposure is refused without an explicit flag, and
//! shutdown stops admitting without waiting on runs parked on approvals.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use serde_json::{Value, json};
use stable_harness::app::{AppError, Application, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::tools::{ToolServer, tools_workspace};
use super::upstream::MockUpstream;
use super::{ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace};
use crate::helpers::{TestWorkspace, stderr};

/// `method path` with an optional bearer key: the status, the content type and the JSON body.
async fn call(app: &TestApp, method: &str, path: &str, key: Option<&str>) -> (u16, String, Value) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = app.http.request(method, app.url(path));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (
        status,
        content_type,
        response.json().await.unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn every_surface_checks_the_key_before_it_routes() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let cases: &[(&str, &str, Option<&str>, u16, &str)] = &[
        ("GET", "/admin/nope", None, 401, "missing_api_key"),
        (
            "GET",
            "/admin/nope",
            Some("not-a-key"),
            401,
            "invalid_api_key",
        ),
        (
            "GET",
            "/admin/nope",
            Some(CLIENT_KEY),
            403,
            "wrong_key_scope",
        ),
        (
            "GET",
            "/admin/nope",
            Some(ADMIN_KEY),
            404,
            "route_not_found",
        ),
        ("GET", "/admin", None, 401, "missing_api_key"),
        ("GET", "/admin", Some(ADMIN_KEY), 404, "route_not_found"),
        ("DELETE", "/admin/requests", None, 401, "missing_api_key"),
        (
            "DELETE",
            "/admin/requests",
            Some(ADMIN_KEY),
            405,
            "method_not_allowed",
        ),
        ("GET", "/runtime/nope", None, 401, "missing_api_key"),
        (
            "GET",
            "/runtime/nope",
            Some(ADMIN_KEY),
            403,
            "wrong_key_scope",
        ),
        (
            "GET",
            "/runtime/nope",
            Some(CLIENT_KEY),
            404,
            "route_not_found",
        ),
        ("GET", "/runtime/requests", None, 401, "missing_api_key"),
        (
            "GET",
            "/runtime/requests",
            Some(CLIENT_KEY),
            405,
            "method_not_allowed",
        ),
        ("GET", "/v1/nope", None, 401, "missing_api_key"),
        ("GET", "/v1/nope", Some(ADMIN_KEY), 403, "wrong_key_scope"),
        ("GET", "/v1/nope", Some(CLIENT_KEY), 404, "route_not_found"),
        // Outside the surfaces there is nothing to protect.
        ("GET", "/administrator", None, 404, "route_not_found"),
        ("GET", "/healthz", None, 200, ""),
    ];
    for (method, path, key, status, code) in cases {
        let (actual, content_type, body) = call(&app, method, path, *key).await;
        let case = format!("{method} {path} with {key:?}: {body}");
        assert_eq!(actual, *status, "{case}");
        if code.is_empty() {
            continue;
        }
        assert_eq!(content_type, "application/json", "{case}");
        assert_eq!(body["error"]["code"], *code, "{case}");
        assert!(body["error"]["message"].is_string(), "{case}");
    }
    // The 404 quotes the path as the client sent it, prefix included.
    let (_, _, body) = call(&app, "GET", "/admin/nope", Some(ADMIN_KEY)).await;
    assert_eq!(body["error"]["message"], "no route for /admin/nope");
}

#[tokio::test]
async fn query_and_path_parameters_that_do_not_parse_are_named_in_the_envelope() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "Ada" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    let request = view["requestId"].as_str().unwrap();
    let run = view["runs"][0]["runId"].as_str().unwrap();
    let events = format!("/runtime/requests/{request}/events");
    let run_events = format!("/admin/runs/{run}/events");
    let cases: Vec<(String, &str, u16, &str, &str)> = vec![
        (
            format!("{events}?limit=abc"),
            CLIENT_KEY,
            400,
            "invalid_parameter",
            "limit",
        ),
        (
            format!("{events}?limit="),
            CLIENT_KEY,
            400,
            "invalid_parameter",
            "limit",
        ),
        (
            format!("{events}?limit=0"),
            CLIENT_KEY,
            422,
            "invalid_request",
            "limit",
        ),
        (
            format!("{events}?limit=100000"),
            CLIENT_KEY,
            422,
            "invalid_request",
            "limit",
        ),
        (
            format!("{events}?limit=99999999999999999999"),
            CLIENT_KEY,
            400,
            "invalid_parameter",
            "limit",
        ),
        (
            format!("{events}?after=x"),
            CLIENT_KEY,
            400,
            "invalid_parameter",
            "after",
        ),
        (
            format!("{events}?after=-1"),
            CLIENT_KEY,
            422,
            "invalid_request",
            "after",
        ),
        (
            format!("{events}?colour=red"),
            CLIENT_KEY,
            400,
            "unknown_field",
            "colour",
        ),
        (
            format!("{run_events}?limit=abc"),
            ADMIN_KEY,
            400,
            "invalid_parameter",
            "limit",
        ),
        (
            format!("{run_events}?limit=1001"),
            ADMIN_KEY,
            422,
            "invalid_request",
            "limit",
        ),
        (
            "/admin/requests?limit=abc".into(),
            ADMIN_KEY,
            400,
            "invalid_parameter",
            "limit",
        ),
        (
            "/admin/requests?limit=0".into(),
            ADMIN_KEY,
            422,
            "invalid_request",
            "limit",
        ),
        (
            "/admin/requests?limit=0".into(),
            ADMIN_KEY,
            422,
            "invalid_request",
            "limit",
        ),
        (
            "/admin/requests?sort=asc".into(),
            ADMIN_KEY,
            400,
            "unknown_field",
            "sort",
        ),
        (
            "/admin/requests?status=maybe".into(),
            ADMIN_KEY,
            422,
            "invalid_request",
            "status",
        ),
        (
            "/admin/approvals?limit=1.5".into(),
            ADMIN_KEY,
            400,
            "invalid_parameter",
            "limit",
        ),
        // Path segments that are not UTF-8 once percent-decoded.
        (
            "/runtime/requests/%FF".into(),
            CLIENT_KEY,
            400,
            "invalid_parameter",
            "id",
        ),
        (
            "/runtime/requests/%FF/events".into(),
            CLIENT_KEY,
            400,
            "invalid_parameter",
            "id",
        ),
        (
            "/admin/runs/%C3%28".into(),
            ADMIN_KEY,
            400,
            "invalid_parameter",
            "id",
        ),
        (
            "/v1/models/%FF".into(),
            CLIENT_KEY,
            400,
            "invalid_parameter",
            "id",
        ),
    ];
    for (path, key, status, code, param) in cases {
        let (actual, content_type, body) = call(&app, "GET", &path, Some(key)).await;
        let case = format!("GET {path}: {body}");
        assert_eq!(actual, status, "{case}");
        assert_eq!(content_type, "application/json", "{case}");
        assert_eq!(body["error"]["code"], code, "{case}");
        assert_eq!(body["error"]["param"], param, "{case}");
    }
    // In range, the same parameters work.
    let (status, page) = app
        .get(&format!("{events}?after=1&limit=2"), CLIENT_KEY)
        .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["data"].as_array().unwrap().len(), 2);
    assert_eq!(page["data"][0]["seq"], 2);

    // An SSE resume point that is not a seq is refused rather than replayed from the start.
    let response = app
        .http
        .get(app.url(&events))
        .bearer_auth(CLIENT_KEY)
        .header("accept", "text/event-stream")
        .header("last-event-id", "yesterday")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        (
            body["error"]["code"].as_str(),
            body["error"]["param"].as_str()
        ),
        (Some("invalid_parameter"), Some("Last-Event-ID"))
    );
}

#[tokio::test]
async fn runtime_refuses_messages_no_model_accepts_as_v1_does() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let ok = json!({ "role": "user", "content": "hi" });
    let cases = [
        (json!([{ "role": "bogus", "content": "hi" }]), "[0].role"),
        (json!([{ "content": "no role" }]), "[0].role"),
        (json!([ok, { "role": 7, "content": "hi" }]), "[1].role"),
        (json!([ok, { "role": "user" }]), "[1].content"),
        (json!([{ "role": "user", "content": 42 }]), "[0].content"),
        (
            json!([{ "role": "system", "content": { "text": "x" } }]),
            "[0].content",
        ),
        (json!([{ "role": "tool", "content": null }]), "[0].content"),
        (json!(["just a string"]), "[0].role"),
    ];
    for (messages, at) in &cases {
        let (status, body) = app
            .post(
                "/runtime/requests",
                CLIENT_KEY,
                &json!({ "agentId": "assistant", "input": { "messages": messages } }),
            )
            .await;
        let case = format!("/runtime {messages}: {body}");
        assert_eq!(status, 400, "{case}");
        assert_eq!(body["error"]["code"], "invalid_message", "{case}");
        assert_eq!(
            body["error"]["param"],
            format!("input.messages{at}"),
            "{case}"
        );

        let (status, body) = app
            .post(
                "/v1/chat/completions",
                CLIENT_KEY,
                &json!({ "model": "assistant", "messages": messages }),
            )
            .await;
        let case = format!("/v1 {messages}: {body}");
        assert_eq!(status, 400, "{case}");
        assert_eq!(body["error"]["code"], "invalid_message", "{case}");
        assert_eq!(body["error"]["param"], format!("messages{at}"), "{case}");

        // In a session named by the header, the messages are parsed with the body, never
        // kept as sent first: the same refusal.
        let response = app
            .http
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(CLIENT_KEY)
            .header("x-stable-harness-session-id", "refusals")
            .json(&json!({ "model": "assistant", "messages": messages }))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap();
        let case = format!("/v1 in a session {messages}: {body}");
        assert_eq!(status, 400, "{case}");
        assert_eq!(body["error"]["code"], "invalid_message", "{case}");
        assert_eq!(body["error"]["param"], format!("messages{at}"), "{case}");
    }
    assert!(
        upstream.calls().is_empty(),
        "no invalid message reached the upstream"
    );

    // What a model does accept goes through, an assistant turn without content included.
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "input": { "messages": [
                { "role": "developer", "content": "Be brief." },
                { "role": "user", "content": [{ "type": "text", "text": "hi" }] },
                { "role": "assistant", "content": null },
                { "role": "user", "content": "again" },
            ] }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(upstream.calls().len(), 1);
}

#[tokio::test]
async fn a_disabled_openai_surface_answers_404_on_every_v1_route() {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(
        &upstream,
        "  protocols:\n    openai:\n      enabled: false\n",
    );
    let app = TestApp::spawn(workspace).await;
    for (method, path) in [
        ("GET", "/v1/models"),
        ("GET", "/v1/models/assistant"),
        ("GET", "/v1/capabilities"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1"),
        ("GET", "/v1/anything/else"),
    ] {
        for key in [Some(CLIENT_KEY), Some(ADMIN_KEY), None] {
            let (status, content_type, body) = call(&app, method, path, key).await;
            let case = format!("{method} {path} with {key:?}: {body}");
            assert_eq!(status, 404, "{case}");
            assert_eq!(content_type, "application/json", "{case}");
            assert_eq!(body["error"]["code"], "surface_disabled", "{case}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("protocols.openai.enabled: false"),
                "{case}"
            );
        }
    }
    // The native surface is unaffected.
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "Ada" }, "wait": true }),
        )
        .await;
    assert_eq!((status, view["output"].as_str()), (200, Some("Hello Ada!")));
    assert!(upstream.calls().is_empty());
}

/// `Application::build` for `workspace` on `host`, port 0, with these keys.
async fn build_on(
    workspace: &TestWorkspace,
    host: &str,
    client: &[&str],
    admin: &[&str],
    insecure_open_surfaces: bool,
) -> Result<Application, AppError> {
    stable_harness::app::install_crypto_provider();
    let compiled = Arc::new(stable_harness::workspace::load(workspace.path()).unwrap());
    // The previous build on this workspace releases its store (and lock) once its writer
    // task has seen the runtime go: wait for that instead of failing with "in use".
    for _ in 0..100 {
        let built = Application::build(ServerConfig {
            workspace: Arc::clone(&compiled),
            host: host.into(),
            port: 0,
            database_url: None,
            api_keys: client.iter().map(|k| (*k).into()).collect(),
            admin_keys: admin.iter().map(|k| (*k).into()).collect(),
            insecure_open_surfaces,
            metrics_public: false,
            watch: false,
        })
        .await;
        match built {
            Err(AppError::Store(stable_harness::store::StoreError::InUse(_))) => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
    panic!("the store of an earlier build was never released");
}

#[tokio::test]
async fn open_surfaces_on_a_public_address_are_refused_unless_explicitly_allowed() {
    let upstream = MockUpstream::start().await;
    let workspace = api_workspace(&upstream, "");
    let store = workspace.path().join(".stable-harness/state.db");
    let cases: [(&[&str], &[&str], &[&str]); 3] = [
        (&[], &[], &["/v1 and /runtime", "/admin"]),
        (&[CLIENT_KEY], &[], &["/admin has no admin keys"]),
        (
            &[],
            &[ADMIN_KEY],
            &["/v1 and /runtime (and so tool execution) have no client keys"],
        ),
    ];
    for (client, admin, named) in cases {
        let error = build_on(&workspace, "0.0.0.0", client, admin, false)
            .await
            .err()
            .unwrap_or_else(|| panic!("{client:?}/{admin:?} was served on 0.0.0.0"));
        assert!(
            matches!(error, AppError::OpenSurfacesOnPublicAddress { .. }),
            "{error}"
        );
        let message = error.to_string();
        for surface in named {
            assert!(message.contains(surface), "{surface} not in {message}");
        }
        assert!(message.contains("--insecure-open-surfaces"), "{message}");
        assert!(message.contains("0.0.0.0:0"), "{message}");
        // Refused before anything was opened, resumed or bound.
        assert!(!store.exists(), "the store was opened before the refusal");
    }

    // Keys on both surfaces, or a loopback address, need no flag.
    let keyed = build_on(&workspace, "0.0.0.0", &[CLIENT_KEY], &[ADMIN_KEY], false)
        .await
        .unwrap();
    drop(keyed);
    let local = build_on(&workspace, "127.0.0.1", &[], &[], false)
        .await
        .unwrap();
    drop(local);

    // With the flag the open server binds, and answers (through loopback).
    let open = build_on(&workspace, "0.0.0.0", &[], &[], true)
        .await
        .unwrap();
    assert!(open.address().ip().is_unspecified());
    let port = open.port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(open.run_until(async move {
        let _ = stopped.await;
    }));
    let (status, models) = super::get_json(
        &reqwest::Client::new(),
        &format!("http://127.0.0.1:{port}/v1/models"),
        "",
    )
    .await;
    assert_eq!(status, 200, "{models}");
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

/// Runs `start` with `args` until it exits by itself (it should: each case is refused at
/// once); a `start` that serves instead is killed and reported.
fn start_expecting_exit(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(crate::helpers::binary())
        .arg("start")
        .args(args)
        .env_remove("STABLE_HARNESS_LOG")
        .env_remove("STABLE_HARNESS_API_KEY")
        .env_remove("STABLE_HARNESS_ADMIN_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // `start` prints its address line only once it listens: a line there means it served.
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    if !line.is_empty() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("start {args:?} served instead of refusing: {line}");
    }
    let output = child.wait_with_output().unwrap();
    (output.status.code(), stderr(&output))
}

#[test]
fn start_refuses_open_surfaces_on_a_public_address_and_serves_them_with_the_flag() {
    let workspace = TestWorkspace::base();
    let dir = workspace.path().to_str().unwrap();
    let (code, err) = start_expecting_exit(&["-w", dir, "--host", "0.0.0.0", "--port", "0"]);
    assert_eq!(code, Some(2), "{err}");
    for expected in [
        "refusing to serve open surfaces on the non-loopback address 0.0.0.0:0",
        "/v1 and /runtime (and so tool execution) have no client keys",
        "/admin has no admin keys",
        "--insecure-open-surfaces",
    ] {
        assert!(err.contains(expected), "{expected:?} not in {err}");
    }
    let (code, err) = start_expecting_exit(&[
        "-w",
        dir,
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--admin-key",
        ADMIN_KEY,
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("have no client keys") && !err.contains("/admin has"),
        "{err}"
    );

    // With the flag it serves (and still warns).
    let mut child: Child = Command::new(crate::helpers::binary())
        .args(["start", "-w", dir, "--host", "0.0.0.0", "--port", "0"])
        .arg("--insecure-open-surfaces")
        .env("STABLE_HARNESS_LOG", "warn")
        .env_remove("STABLE_HARNESS_API_KEY")
        .env_remove("STABLE_HARNESS_ADMIN_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("listening on http://0.0.0.0:"), "{line}");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.contains("NO CLIENT KEYS") && err.contains("NO ADMIN KEYS"),
        "{err}"
    );
}

#[tokio::test]
async fn a_run_parked_on_an_approval_does_not_hold_up_shutdown() {
    let upstream = MockUpstream::start().await;
    let tools = ToolServer::start().await;
    upstream.push([super::upstream::Reply::call(
        "payments_refund",
        r#"{"amount":7}"#,
    )]);
    let app = TestApp::spawn(tools_workspace(&upstream, &tools, "")).await;
    let accepted = app.submit("clerk", "refund").await;
    app.pending_approval().await;
    let (_, view) = app
        .get(
            &format!(
                "/runtime/requests/{}",
                accepted["requestId"].as_str().unwrap()
            ),
            CLIENT_KEY,
        )
        .await;
    assert_eq!(view["status"], "waiting_approval", "{view}");

    // The shutdown grace is 10s; a shutdown that waited on the parked run would take it all.
    let started = std::time::Instant::now();
    app.stop().await;
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(8),
        "shutdown waited {took:?} on a run parked on an approval"
    );
    assert_eq!(tools.count("/refund"), 0);
}

#[tokio::test]
async fn a_request_still_arriving_when_shutdown_starts_gets_503_shutting_down() {
    let upstream = MockUpstream::start().await;
    let app = TestApp::spawn(api_workspace(&upstream, "")).await;
    let address = app.base.trim_start_matches("http://").to_owned();
    let body = json!({ "agentId": "greeter", "input": { "text": "late" } }).to_string();

    // Send the head and wait for `100 Continue`: the handler is now reading the body.
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    let head = format!(
        "POST /runtime/requests HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {CLIENT_KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut interim = Vec::new();
    while !interim.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await.unwrap();
        interim.push(byte[0]);
    }
    assert!(
        interim.starts_with(b"HTTP/1.1 100 Continue"),
        "{}",
        String::from_utf8_lossy(&interim)
    );

    // SIGTERM's equivalent; once new connections are refused the signal has been handled.
    let stopping = tokio::spawn(app.stop());
    let mut refused = false;
    for _ in 0..400 {
        if tokio::net::TcpStream::connect(&address).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert!(
        refused,
        "the server kept accepting connections after the signal"
    );

    // The rest of the request arrives during the drain: answered, but not admitted.
    stream.write_all(body.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    assert!(response.starts_with("HTTP/1.1 503"), "{response}");
    let (_, json_body) = response.split_once("\r\n\r\n").unwrap();
    let envelope: Value = serde_json::from_str(json_body).unwrap();
    assert_eq!(envelope["error"]["code"], "shutting_down", "{envelope}");
    stopping.await.unwrap();
}
