//! Upstreams over HTTPS, as every hosted provider is: the binary verifies the upstream's
//! certificate against the roots it trusts (the system's, or `SSL_CERT_FILE`), speaks HTTP/2
//! where the upstream offers it by ALPN and HTTP/1.1 where it does not, and keeps its
//! connections: calls in sequence reuse one, and concurrent calls share one over HTTP/2, where
//! a call cut mid-answer fails alone.

use axum::http::Version;
use serde_json::{Value, json};

use super::upstream::{Alpn, MockUpstream, Reply, Responder};
use super::{ADMIN_KEY, CLIENT_KEY, ServerProcess, api_workspace, get_json, streamed_content};

/// The binary on a workspace whose models call `upstream`, trusting only the CA in `ca_pem`
/// when given (the system's roots otherwise). One HTTP shard, so that one connection pool makes every call (each shard keeps
/// its own).
fn start_trusting(upstream: &MockUpstream, ca_pem: Option<&str>) -> Served {
    let workspace = api_workspace(upstream, "");
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    let mut env = vec![("TOKIO_WORKER_THREADS", "1".to_owned())];
    if let Some(pem) = ca_pem {
        std::fs::write(ca_file.path(), pem).unwrap();
        env.push(("SSL_CERT_FILE", ca_file.path().to_str().unwrap().to_owned()));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Served {
        server: ServerProcess::start(workspace.path(), &env),
        _workspace: workspace,
        _ca_file: ca_file,
    }
}

/// The server, with what must outlive it: its workspace and the CA file it was told to trust.
struct Served {
    server: ServerProcess,
    _workspace: crate::helpers::TestWorkspace,
    _ca_file: tempfile::NamedTempFile,
}

/// A client of the binary (plain HTTP; reqwest still wants the process's TLS provider).
fn client() -> reqwest::Client {
    stable_harness::app::install_crypto_provider();
    reqwest::Client::new()
}

async fn chat(http: &reqwest::Client, server: &ServerProcess, body: Value) -> (u16, String) {
    let response = http
        .post(server.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

fn ask(text: &str) -> Value {
    json!({ "model": "assistant", "messages": [{ "role": "user", "content": text }] })
}

fn ask_streamed(text: &str) -> Value {
    let mut body = ask(text);
    body["stream"] = json!(true);
    body
}

/// Asks `count` questions at once: the answers' statuses and bodies.
async fn ask_at_once(
    http: &reqwest::Client,
    server: &ServerProcess,
    count: usize,
) -> Vec<(u16, String)> {
    let asked = (0..count).map(|n| chat(http, server, ask(&format!("together {n}"))));
    futures::future::join_all(asked).await
}

/// Asks `count` questions one after another, each answered whole with the upstream's text.
async fn ask_in_sequence(http: &reqwest::Client, server: &ServerProcess, count: usize) {
    for n in 0..count {
        let (status, body) = chat(http, server, ask(&format!("hello {n}"))).await;
        assert_eq!(status, 200, "{body}; server: {}", server.stderr());
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            "Hello from the upstream model"
        );
    }
}

/// The upstream received `count` calls, every one over `version`, all on one connection.
fn assert_calls_on_one_connection(upstream: &MockUpstream, count: usize, version: Version) {
    let versions: Vec<Version> = upstream.calls().iter().map(|call| call.version).collect();
    assert_eq!(versions.len(), count, "one upstream call per request");
    assert!(versions.iter().all(|v| *v == version), "{versions:?}");
    assert_eq!(
        upstream.connections(),
        1,
        "every call on the kept connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_offering_http2_is_called_over_http2_on_one_kept_connection() {
    let (upstream, ca_pem) = MockUpstream::start_tls(Alpn::Http2AndHttp1).await;
    let served = start_trusting(&upstream, Some(&ca_pem));
    let server = &served.server;
    let http = client();

    // In sequence: answered whole, then streamed.
    ask_in_sequence(&http, server, 3).await;
    let (status, body) = chat(&http, server, ask_streamed("stream it")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(streamed_content(&body), "Hello from the upstream model");

    // Then eight at once: HTTP/2 carries them on the same connection.
    for (status, body) in ask_at_once(&http, server, 8).await {
        assert_eq!(status, 200, "{body}");
    }
    assert_calls_on_one_connection(&upstream, 12, Version::HTTP_2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_without_http2_is_called_over_http1_on_a_kept_connection() {
    let (upstream, ca_pem) = MockUpstream::start_tls(Alpn::Http1Only).await;
    let served = start_trusting(&upstream, Some(&ca_pem));
    ask_in_sequence(&client(), &served.server, 4).await;
    assert_calls_on_one_connection(&upstream, 4, Version::HTTP_11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_http_upstream_is_called_on_a_kept_connection() {
    let upstream = MockUpstream::start().await;
    let served = start_trusting(&upstream, None);
    ask_in_sequence(&client(), &served.server, 4).await;
    assert_calls_on_one_connection(&upstream, 4, Version::HTTP_11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_certificate_the_binary_does_not_trust_is_refused() {
    // The binary trusts a CA, but not the one that signed this upstream's certificate (a CA
    // of its own rather than the system's roots, so that the test does not depend on what the
    // machine trusts): the handshake fails, no call reaches the upstream, and the client is
    // told why in the error envelope (502), as the operator is by `/admin/health`.
    let (upstream, _its_ca) = MockUpstream::start_tls(Alpn::Http2AndHttp1).await;
    let (_other, other_ca) = MockUpstream::start_tls(Alpn::Http2AndHttp1).await;
    let served = start_trusting(&upstream, Some(&other_ca));
    let server = &served.server;
    let http = client();
    let (status, body) = chat(&http, server, ask("hello")).await;
    assert_eq!(status, 502, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "upstream_error", "{error}");
    // Why, without the upstream's address: the certificate, not the network.
    assert_eq!(
        error["error"]["message"],
        "upstream model `main`: could not connect: its TLS certificate was refused",
        "{error}"
    );
    assert!(upstream.calls().is_empty(), "no call got through");
    assert!(upstream.connections() >= 1, "the binary did connect");

    // An operator's health check says the same of each model on that upstream.
    let (status, health) = get_json(&http, &server.url("/admin/health"), ADMIN_KEY).await;
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["status"], "degraded", "{health}");
    let models = health["models"].as_array().unwrap();
    assert_eq!(models.len(), 3, "{health}");
    for probe in models {
        assert_eq!(probe["reachable"], false, "{probe}");
        assert_eq!(
            probe["error"],
            format!(
                "upstream model `{}`: could not connect: its TLS certificate was refused",
                probe["model"].as_str().unwrap()
            ),
            "{probe}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_over_http2_fails_alone_and_its_connection_carries_the_others() {
    // One call's stream is cut mid-answer while four others share its HTTP/2 connection: the
    // cut one fails as over HTTP/1.1 (its text kept, not retried), the others are answered,
    // and the connection (one stream reset, not closed) carries the calls after it.
    let (upstream, ca_pem) = MockUpstream::start_tls(Alpn::Http2AndHttp1).await;
    upstream.set_responder(Responder::new(|body: &Value| {
        let asked = body["messages"]
            .as_array()
            .and_then(|messages| messages.last())
            .and_then(|message| message["content"].as_str())
            .unwrap_or_default();
        if asked == "cut" {
            Reply::CutAfter("partial answer ".into())
        } else {
            Reply::Text("Hello from the upstream model".into())
        }
    }));
    let served = start_trusting(&upstream, Some(&ca_pem));
    let server = &served.server;
    let http = client();
    ask_in_sequence(&http, server, 1).await;

    let ((cut_status, cut_body), others) = tokio::join!(
        chat(&http, server, ask_streamed("cut")),
        ask_at_once(&http, server, 4)
    );
    assert_eq!(cut_status, 200, "the stream had started: {cut_body}");
    assert_eq!(streamed_content(&cut_body), "partial answer ", "{cut_body}");
    assert!(!cut_body.contains("[DONE]"), "{cut_body}");
    assert!(cut_body.contains("upstream_error"), "{cut_body}");
    for (status, body) in others {
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("Hello from the upstream model"), "{body}");
    }
    ask_in_sequence(&http, server, 2).await;
    assert_calls_on_one_connection(&upstream, 1 + 1 + 4 + 2, Version::HTTP_2);
}
