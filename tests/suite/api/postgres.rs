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
    request_id_header, sse_ids, wait_until_done_at,
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
    let request_id = request_id_header(&response);
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
    // Every connection to the database is cut (a failover, a restart of the server): the
    // instances reconnect, keep serving what is stored, and accept work again.
    let cut = crate::pg::psql(
        &url,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
    );
    assert!(cut.trim().parse::<u32>().unwrap() >= 2, "{cut}");
    let (status, _) = super::get_json(
        &http,
        &a.url(&format!("/runtime/requests/{request_id}")),
        CLIENT_KEY,
    )
    .await;
    assert_eq!(status, 200);
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
    let shipped = std::fs::read_dir("migrations/postgres").unwrap().count();
    assert_eq!(
        migrations.trim(),
        shipped.to_string(),
        "each migration applied once"
    );
    a.terminate();
    b.terminate();
}

/// Two instances of the teller workspace (`trust.rs`) on a fresh database, and one request
/// submitted to A.
struct TwoInstances {
    url: String,
    _workspace: crate::helpers::TestWorkspace,
    a: ServerProcess,
    b: ServerProcess,
    http: reqwest::Client,
    request_id: String,
    run_id: String,
}

impl TwoInstances {
    async fn start(
        upstream: &MockUpstream,
        tools: &RecordingTools,
        runtime_extra: &str,
        text: &str,
    ) -> Self {
        let url = crate::pg::fresh_database();
        let workspace =
            teller_workspace(upstream, tools, "UNSET_KEY_A", "UNSET_KEY_B", runtime_extra);
        let env = [("STABLE_HARNESS_DATABASE_URL", url.as_str())];
        let a = ServerProcess::start(workspace.path(), &env);
        let b = ServerProcess::start(workspace.path(), &env);
        let http = reqwest::Client::new();
        let (status, accepted) = submit(
            &http,
            &a.base,
            &json!({ "agentId": "teller", "input": { "text": text } }),
        )
        .await;
        assert_eq!(status, 202, "{accepted}");
        Self {
            request_id: accepted["requestId"].as_str().unwrap().to_owned(),
            run_id: accepted["runId"].as_str().unwrap().to_owned(),
            url,
            _workspace: workspace,
            a,
            b,
            http,
        }
    }
}

/// Which instance holds a run's lease (`-`: none).
fn lease_holder(url: &str, run_id: &str) -> String {
    crate::pg::psql(
        url,
        &format!("SELECT coalesce(lease_holder, '-') FROM runs WHERE id = '{run_id}'"),
    )
    .trim()
    .to_owned()
}

#[tokio::test]
async fn a_request_on_a_is_approved_through_b_and_followed_live_from_b_then_resumed_on_a() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    // The refund waits at the tool service until the test has read B's stream up to it.
    tools.hold("/refund");
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":5}"#),
        Reply::Text("refund sent".into()),
    ]);
    let TwoInstances {
        a,
        b,
        http,
        request_id,
        ..
    } = TwoInstances::start(&upstream, &tools, "", "refund me").await;

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
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    tools.hold("/ledger");
    upstream.push([
        Reply::call("ledger_write", r#"{"entry":"rent"}"#),
        Reply::Text("written down".into()),
    ]);
    let TwoInstances {
        url,
        a,
        b,
        http,
        request_id,
        run_id,
        ..
    } = TwoInstances::start(&upstream, &tools, SHORT_LEASE, "note the rent").await;
    // A is executing the call (the tool holds it) when it dies.
    tools.wait_for("/ledger", 1).await;
    assert_eq!(lease_holder(&url, &run_id), a.instance);
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
    assert_eq!(
        lease_holder(&url, &run_id),
        "-",
        "an ended run keeps no lease"
    );
    b.terminate();
}

/// A TCP proxy to PostgreSQL the tests can break. Armed with a marker, it cuts the connection
/// that next sends it (a value bound to a statement: the statement runs and commits) as the
/// reply comes back, so the client never hears of the commit. Down, it cuts every connection
/// and refuses new ones, as an unreachable database would. It keeps its port meanwhile (bound,
/// not listening): a port it gave back could go to another test's server, and the database
/// client would then talk to that.
struct PgProxy {
    port: u16,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    down: tokio::sync::watch::Sender<bool>,
}

impl PgProxy {
    async fn start(target: std::net::SocketAddr, marker: &'static [u8]) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // SO_REUSEPORT lets the socket that keeps the port while down be bound before the
        // listener goes; nothing else can bind it.
        let bound = |port: u16| {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.set_reuseport(true)?;
            socket.bind(std::net::SocketAddr::from(([127, 0, 0, 1], port)))?;
            std::io::Result::Ok(socket)
        };
        let listener = bound(0).unwrap().listen(1024).unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = std::sync::Arc::new(AtomicBool::new(false));
        let (down, _) = tokio::sync::watch::channel(false);
        let cutting = std::sync::Arc::clone(&armed);
        let downs = down.clone();
        tokio::spawn(async move {
            let mut listener = Some(listener);
            // Down: the port bound, not listening (connections are refused).
            let mut kept = None;
            let mut watching = downs.subscribe();
            loop {
                let Some(open) = &listener else {
                    let _ = watching.wait_for(|down| !*down).await;
                    // A failed listen binds the port again on the next turn.
                    listener = kept
                        .take()
                        .or_else(|| bound(port).ok())
                        .and_then(|socket| socket.listen(1024).ok());
                    continue;
                };
                let client = tokio::select! {
                    accepted = open.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                    _ = watching.wait_for(|down| *down) => {
                        kept = Some(bound(port).expect("the proxy keeps its port"));
                        listener = None;
                        continue;
                    }
                };
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (mut client_in, mut client_out) = client.into_split();
                let (mut server_in, mut server_out) = server.into_split();
                let marked = std::sync::Arc::new(AtomicBool::new(false));
                let (armed, marked_up) = (
                    std::sync::Arc::clone(&cutting),
                    std::sync::Arc::clone(&marked),
                );
                let mut up_down = downs.subscribe();
                tokio::spawn(async move {
                    let mut buffer = vec![0; 64 * 1024];
                    loop {
                        let n = tokio::select! {
                            read = client_in.read(&mut buffer) => match read {
                                Ok(n) if n > 0 => n,
                                _ => break,
                            },
                            _ = up_down.wait_for(|down| *down) => break,
                        };
                        let sent = &buffer[..n];
                        if armed.load(Ordering::SeqCst)
                            && sent.windows(marker.len()).any(|w| w == marker)
                        {
                            armed.store(false, Ordering::SeqCst);
                            marked_up.store(true, Ordering::SeqCst);
                        }
                        if server_out.write_all(sent).await.is_err() {
                            break;
                        }
                    }
                });
                let mut back_down = downs.subscribe();
                tokio::spawn(async move {
                    let mut buffer = vec![0; 64 * 1024];
                    loop {
                        let n = tokio::select! {
                            read = server_in.read(&mut buffer) => match read {
                                Ok(n) if n > 0 => n,
                                _ => break,
                            },
                            _ = back_down.wait_for(|down| *down) => break,
                        };
                        // The reply to the marked statement is dropped with both ends.
                        if marked.load(Ordering::SeqCst) {
                            break;
                        }
                        if client_out.write_all(&buffer[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Self { port, armed, down }
    }

    /// `url` with this proxy in place of the database's address.
    fn url(&self, url: &str) -> String {
        let mut through = reqwest::Url::parse(url).unwrap();
        through.set_port(Some(self.port)).unwrap();
        through.to_string()
    }
}

fn database_address(url: &str) -> std::net::SocketAddr {
    let parsed = reqwest::Url::parse(url).unwrap();
    format!("127.0.0.1:{}", parsed.port().unwrap())
        .parse()
        .unwrap()
}

// The proxy runs on the test's runtime while the server starts: it needs a worker of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_database_is_unreachable_readyz_is_red_and_writes_get_503_until_it_heals() {
    stable_harness::app::install_crypto_provider();
    let url = crate::pg::fresh_database();
    let proxy = PgProxy::start(database_address(&url), b"-").await;
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("stored".into()));
    let tools = RecordingTools::start().await;
    let workspace = teller_workspace(&upstream, &tools, "UNSET_KEY_A", "UNSET_KEY_B", "");
    let through = proxy.url(&url);
    let server = ServerProcess::start(
        workspace.path(),
        &[("STABLE_HARNESS_DATABASE_URL", through.as_str())],
    );
    let http = reqwest::Client::new();
    let body = json!({ "agentId": "teller", "input": { "text": "hello" } });
    let (status, accepted) = submit(&http, &server.base, &body).await;
    assert_eq!(status, 202, "{accepted}");
    let request_id = accepted["requestId"].as_str().unwrap().to_owned();
    wait_until_done_at(&http, &server.base, &request_id).await;

    proxy.down.send_replace(true);
    let ready = http.get(server.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let (status, envelope) = super::get_json(
        &http,
        &server.url(&format!("/runtime/requests/{request_id}")),
        CLIENT_KEY,
    )
    .await;
    assert_eq!(
        (status, envelope["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{envelope}: {}",
        server.stderr()
    );
    // A submit in flight when the database went away waits for it; later ones are shed.
    // The journal's failed writes, counted: the first after this submit is its own (nothing
    // else writes meanwhile), retried until the database is back. Only then do the later
    // submits begin: a write that fails at once (a writer lane's backend cut) would
    // otherwise shed this submit if one of them came first.
    let store_errors = async || -> u64 {
        super::metrics_text(&http, &server.url("/metrics"))
            .await
            .lines()
            .filter(|line| line.starts_with("stable_harness_store_errors_total"))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let failed_before = store_errors().await;
    let waiting = tokio::spawn({
        let (http, base, body) = (http.clone(), server.base.clone(), body.clone());
        async move { submit(&http, &base, &body).await }
    });
    let mut failed = failed_before;
    for _ in 0..600 {
        failed = store_errors().await;
        if failed > failed_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        failed > failed_before,
        "the waiting submit's write was tried"
    );
    // Until its write has failed once, a submit may still join the wait (the client gives
    // up on those after a second; they are accepted once the database is back).
    let mut shed = Value::Null;
    for _ in 0..200 {
        let answer = http
            .post(server.url("/runtime/requests"))
            .bearer_auth(CLIENT_KEY)
            .json(&body)
            .timeout(Duration::from_secs(1))
            .send()
            .await;
        if let Ok(answer) = answer
            && answer.status() == 503
        {
            shed = answer.json().await.unwrap();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(shed["error"]["code"], "store_unavailable", "{shed}");

    proxy.down.send_replace(false);
    let (status, accepted) = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the waiting submit is accepted once the database is back")
        .unwrap();
    assert_eq!(status, 202, "{accepted}");
    let view =
        wait_until_done_at(&http, &server.base, accepted["requestId"].as_str().unwrap()).await;
    assert_eq!(view["status"], "completed", "{view}");
    let ready = http.get(server.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    server.terminate();
}

#[tokio::test]
async fn a_batch_whose_commit_reply_is_lost_is_found_in_the_store_not_applied_twice() {
    use stable_harness::store::{EventRecord, RequestRecord, RunStatus, SessionRecord, WriteOp};
    let url = crate::pg::fresh_database();
    let cutter = PgProxy::start(database_address(&url), b"req_lost").await;
    let through = cutter.url(&url);
    let store = stable_harness::store::open(
        Some(&through),
        std::path::Path::new("."),
        &Default::default(),
    )
    .await
    .unwrap();
    let now = chrono::Utc::now();
    let batch = [
        WriteOp::TouchSession(SessionRecord {
            id: "ses_lost".into(),
            agent_id: "assistant".into(),
            owner: "alice".into(),
            metadata: json!({}),
            created_at: now,
            updated_at: now,
        }),
        WriteOp::InsertRequest(RequestRecord {
            id: "req_lost".into(),
            session_id: "ses_lost".into(),
            agent_id: "assistant".into(),
            protocol: "runtime".into(),
            owner: "alice".into(),
            status: RunStatus::Queued,
            input: json!({}),
            output: None,
            error: None,
            usage: None,
            metadata: json!({}),
            created_at: now,
            updated_at: now,
        }),
        WriteOp::AppendEvent(EventRecord {
            id: "evt_lost".into(),
            request_id: "req_lost".into(),
            run_id: "run_lost".into(),
            session_id: "".into(),
            agent_id: "".into(),
            seq: 0,
            event_type: "runtime.request.started".into(),
            at: now,
            data: json!({}),
        }),
    ];
    cutter
        .armed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    // The batch commits, but its reply never arrives: to the journal, a transient failure.
    let batch_id = stable_harness::store::new_batch_id();
    let cut = store.apply_batch(&batch_id, &batch).await.unwrap_err();
    assert!(cut.is_transient(), "{cut:?}");
    assert!(
        !cutter.armed.load(std::sync::atomic::Ordering::SeqCst),
        "the reply was cut"
    );
    // Tried again under its id, as the journal does, it is answered with what committed, not
    // applied a second time (which the request's row would refuse).
    assert_eq!(store.apply_batch(&batch_id, &batch).await.unwrap(), [1]);
    let last = store.last_event("req_lost").await.unwrap();
    assert_eq!(last.map_or(0, |event| event.seq), 1);
    let again = store.apply(&batch).await.unwrap_err();
    assert!(
        !again.is_transient(),
        "under a new id it is a new batch: {again:?}"
    );
}

#[tokio::test]
async fn a_run_parked_on_an_approval_moves_to_the_other_instance_when_its_holder_stops() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    upstream.push([
        Reply::call("payments_refund", r#"{"amount":7}"#),
        Reply::Text("refunded after the handover".into()),
    ]);
    // A lease far longer than the test: only a lease given back lets B take the run.
    let TwoInstances {
        url,
        a,
        b,
        http,
        request_id,
        run_id,
        ..
    } = TwoInstances::start(
        &upstream,
        &tools,
        "  store: { leaseDuration: 10m }\n",
        "refund",
    )
    .await;
    pending_approvals(&http, &b.base, 1).await;
    let a_instance = a.instance.clone();
    // A stops gracefully: the parked run is handed over and its lease given back.
    a.terminate();
    let holder = || lease_holder(&url, &run_id);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut taken = holder();
    while taken != b.instance && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        taken = holder();
    }
    assert_eq!(taken, b.instance, "B claimed the run A gave back");
    // The decision, on B, wakes the run there; the refund runs once.
    let approved = super::approve_pending(&http, &b.base).await;
    assert_eq!(approved, 1);
    let view = wait_until_done_at(&http, &b.base, &request_id).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["output"], "refunded after the handover");
    assert_eq!(tools.at("/refund").len(), 1);
    let events = all_events(&http, &b.base, &request_id).await;
    assert_gapless(&events);
    let instances: Vec<Value> = data_of(&events, "runtime.request.started")
        .iter()
        .map(|d| d["instance"].clone())
        .collect();
    assert_eq!(instances, [json!(a_instance), json!(b.instance)]);
    b.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// Prints how long the cancel took (a figure for the closing note, not a threshold).
#[allow(clippy::print_stderr)]
async fn a_cancel_asked_on_b_stops_the_run_executing_on_a() {
    stable_harness::app::install_crypto_provider();
    let upstream = MockUpstream::start().await;
    let tools = RecordingTools::start().await;
    // The upstream call stalls past the model's timeout: only the cancel ends it.
    upstream.set_default(Reply::Stall(Duration::from_secs(30)));
    let TwoInstances {
        url,
        a,
        b,
        http,
        request_id,
        run_id,
        ..
    } = TwoInstances::start(
        &upstream,
        &tools,
        "  store: { leaseDuration: 10m }\n",
        "stall",
    )
    .await;
    for _ in 0..500 {
        if !upstream.calls().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(lease_holder(&url, &run_id), a.instance);

    let asked = std::time::Instant::now();
    let response = http
        .post(b.url(&format!("/admin/requests/{request_id}/cancel")))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let view: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["status"], "cancelled", "{view}");
    eprintln!(
        "a cancel asked on B ended the run on A in {:?}",
        asked.elapsed()
    );
    let events = all_events(&http, &a.base, &request_id).await;
    assert_gapless(&events);
    let cancelled = data_of(&events, "runtime.request.cancelled");
    assert!(
        cancelled[0]["reason"]
            .as_str()
            .unwrap()
            .contains("operator"),
        "{cancelled:?}"
    );
    assert_eq!(upstream.calls().len(), 1);
    a.terminate();
    b.terminate();
}

/// A batch finds the requests it locks by their keys (migration 0008): however many requests
/// are stored, it reads the index entries of those it names, not of every request. Counted by
/// PostgreSQL's own statistics of the transaction that applies the batch.
#[tokio::test]
async fn a_batch_reads_only_the_requests_it_names_however_many_are_stored() {
    const STORED: usize = 2_000;
    let url = crate::pg::fresh_database();
    // Opening the store migrates the database.
    let store = stable_harness::store::open(
        Some(&url),
        std::path::Path::new("."),
        &stable_harness::store::OpenOptions::default(),
    )
    .await
    .unwrap();
    crate::pg::psql(
        &url,
        &format!(
            "INSERT INTO sessions (id, agent_id, created_at, updated_at)
                 VALUES ('ses_many', 'assistant', now(), now());
             INSERT INTO requests (id, session_id, agent_id, protocol, status, input,
                                   created_at, updated_at)
                 SELECT 'req_' || lpad(n::text, 6, '0'), 'ses_many', 'assistant', 'runtime',
                        'running', '{{}}', now(), now()
                   FROM generate_series(1, {STORED}) AS n;
             ANALYZE requests"
        ),
    );
    // The newest request (`req_002000`), as a live request is: its key is the index's last.
    let batch = json!([{ "op": "update_request", "id": "req_002000", "status": "completed",
        "output": "done", "at": "2026-11-27T12:00:00Z" }]);
    // One transaction: the batch, then what it read of `requests_pkey`.
    let out = crate::pg::psql(
        &url,
        &format!(
            "SELECT stable_harness_apply('{batch}'::jsonb, 'tester', 1000, 'batch_1');
             SELECT pg_stat_get_xact_tuples_returned('requests_pkey'::regclass)"
        ),
    );
    let read: u64 = out
        .lines()
        .last()
        .and_then(|line| line.trim().parse().ok())
        .unwrap_or_else(|| panic!("psql printed {out:?}"));
    assert!(
        read <= 10,
        "a batch naming one request read {read} entries of requests_pkey ({STORED} stored)"
    );
    let request = store.request("req_002000").await.unwrap().unwrap();
    assert_eq!(request.status, stable_harness::store::RunStatus::Completed);
    assert_eq!(request.output.as_deref(), Some("done"));
}
