//! The operator CLI (`stable-harness approvals ...`, `stable-harness requests ...`) against a
//! real server over HTTP: tables, `--json`, a live follow of events, and its exit codes.

use serde_json::Value;

use super::trust::teller_workspace;
use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, RecordingTools, TestApp};
use crate::helpers::{stable_harness, stderr, stdout};

/// Runs the binary off the async threads (the server under test runs on them).
async fn cli(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        stable_harness(&args)
    })
    .await
    .unwrap()
}

fn args(base: &str, words: &[&str]) -> Vec<String> {
    let mut all: Vec<String> = words.iter().map(|w| (*w).to_owned()).collect();
    all.extend([
        "--url".into(),
        base.into(),
        "--admin-key".into(),
        ADMIN_KEY.into(),
    ]);
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_list_decide_follow_and_steer_from_the_command_line() {
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":7}"#),
        Reply::Text("refunded".into()),
    ]);
    let workspace = teller_workspace(&upstream, &tools, "UNSET_KEY_A", "UNSET_KEY_B", "");
    let app = TestApp::spawn(workspace).await;
    let accepted = app.submit("teller", "refund").await;
    let request = accepted["requestId"].as_str().unwrap().to_owned();
    let approval = app.pending_approval().await["id"]
        .as_str()
        .unwrap()
        .to_owned();

    let listed = cli(args(&app.base, &["approvals", "list"])).await;
    assert_eq!(listed.status.code(), Some(0), "{}", stderr(&listed));
    let table = stdout(&listed);
    assert!(table.starts_with("ID"), "{table}");
    assert!(
        table.contains(&approval) && table.contains("payments.refund"),
        "{table}"
    );

    let shown = cli(args(&app.base, &["approvals", "show", &approval, "--json"])).await;
    let shown: Value = serde_json::from_str(&stdout(&shown)).unwrap();
    assert_eq!(shown["status"], "pending");

    let approved = cli(args(
        &app.base,
        &["approvals", "approve", &approval, "--reason", "checked"],
    ))
    .await;
    assert_eq!(approved.status.code(), Some(0), "{}", stderr(&approved));
    assert_eq!(stdout(&approved).trim(), format!("{approval} approved"));

    // Follows live until the request ends.
    let followed = cli(args(
        &app.base,
        &["requests", "events", &request, "--follow"],
    ))
    .await;
    assert_eq!(followed.status.code(), Some(0), "{}", stderr(&followed));
    let lines = stdout(&followed);
    assert!(
        lines
            .lines()
            .last()
            .unwrap()
            .contains("runtime.request.completed"),
        "{lines}"
    );
    assert!(lines.contains("runtime.approval.resolved"), "{lines}");

    let detail = cli(args(&app.base, &["requests", "show", &request])).await;
    let detail = stdout(&detail);
    assert!(detail.contains("status    completed"), "{detail}");
    assert!(
        detail.contains(&format!("approval  {approval}")),
        "{detail}"
    );

    let listed = cli(args(&app.base, &["requests", "list", "--json"])).await;
    let page: Value = serde_json::from_str(&stdout(&listed)).unwrap();
    assert_eq!(page["data"][0]["requestId"], request.as_str());

    // Refusals: the server's error, exit 1.
    let cancel = cli(args(&app.base, &["requests", "cancel", &request])).await;
    assert_eq!(cancel.status.code(), Some(1));
    assert!(
        stderr(&cancel).contains("request_ended"),
        "{}",
        stderr(&cancel)
    );
    let unknown = cli(args(&app.base, &["requests", "show", "req_nope"])).await;
    assert_eq!(unknown.status.code(), Some(1));
    assert!(stderr(&unknown).contains("404"), "{}", stderr(&unknown));
    let wrong_key = cli(vec![
        "requests".into(),
        "list".into(),
        "--url".into(),
        app.base.clone(),
        "--admin-key".into(),
        "not-a-key".into(),
    ])
    .await;
    assert_eq!(wrong_key.status.code(), Some(1));
    assert!(stderr(&wrong_key).contains("401"), "{}", stderr(&wrong_key));

    // Bad usage: no key at all.
    let keyless = cli(vec![
        "approvals".into(),
        "list".into(),
        "--url".into(),
        app.base.clone(),
    ])
    .await;
    assert_eq!(keyless.status.code(), Some(2), "{}", stderr(&keyless));

    // A server that is down: a clear message, exit 4.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let unreachable = cli(args(&down, &["requests", "list"])).await;
    assert_eq!(unreachable.status.code(), Some(4));
    assert!(
        stderr(&unreachable).contains("cannot reach the server"),
        "{}",
        stderr(&unreachable)
    );
}
