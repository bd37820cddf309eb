//! Upstreams over HTTPS, as every hosted provider is: the binary verifies the upstream's
//! certificate against the roots it trusts (the system's, or `SSL_CERT_FILE`), speaks HTTP/2
//! where the upstream offers it by ALPN and HTTP/1.1 where it does not, and keeps its
//! connections: calls in sequence reuse one, and concurrent calls share one over HTTP/2, where
//! a call cut mid-answer fails alone. Where `HTTPS_PROXY` names a proxy, it tunnels through it.

use std::sync::{Arc, Mutex};

use axum::http::Version;
use serde_json::{Value, json};

use super::upstream::{Alpn, MockUpstream, Reply, Responder};
use super::{
    ADMIN_KEY, CLIENT_KEY, ServerProcess, api_workspace, get_json, post_text, streamed_content,
};

/// The binary on a workspace whose models call `upstream`, trusting only the CA in `ca_pem`
/// when given (the system's roots otherwise), with `env` added. One HTTP shard, so that one
/// connection pool makes every call (each shard keeps its own). Calls to loopback go direct
/// even where the machine's environment names a proxy, unless `env` says otherwise.
fn start_trusting(upstream: &MockUpstream, ca_pem: Option<&str>, env: &[(&str, &str)]) -> Served {
    let workspace = api_workspace(upstream, "");
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    let mut all = vec![
        ("TOKIO_WORKER_THREADS", "1".to_owned()),
        ("NO_PROXY", "localhost,127.0.0.1".to_owned()),
    ];
    if let Some(pem) = ca_pem {
        std::fs::write(ca_file.path(), pem).unwrap();
        all.push(("SSL_CERT_FILE", ca_file.path().to_str().unwrap().to_owned()));
    }
    all.extend(env.iter().map(|(k, v)| (*k, (*v).to_owned())));
    let all: Vec<(&str, &str)> = all.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Served {
        server: ServerProcess::start(workspace.path(), &all),
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
    post_text(http, &server.url("/v1/chat/completions"), CLIENT_KEY, &body).await
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
    let served = start_trusting(&upstream, Some(&ca_pem), &[]);
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
    let served = start_trusting(&upstream, Some(&ca_pem), &[]);
    ask_in_sequence(&client(), &served.server, 4).await;
    assert_calls_on_one_connection(&upstream, 4, Version::HTTP_11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_http_upstream_is_called_on_a_kept_connection() {
    let upstream = MockUpstream::start().await;
    let served = start_trusting(&upstream, None, &[]);
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
    let served = start_trusting(&upstream, Some(&other_ca), &[]);
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
    let served = start_trusting(&upstream, Some(&ca_pem), &[]);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_is_reached_through_the_proxy_https_proxy_names() {
    // As behind a company's egress proxy: the binary asks the proxy for a tunnel (`CONNECT`)
    // and speaks TLS to the upstream through it, so the proxy never sees the key or the
    // prompt, and the upstream's certificate is still checked.
    let (upstream, ca_pem) = MockUpstream::start_tls(Alpn::Http2AndHttp1).await;
    let proxy = TunnelProxy::start().await;
    let key = "upstream-key-seen-only-by-the-upstream";
    let served = start_trusting(
        &upstream,
        Some(&ca_pem),
        &[
            ("HTTPS_PROXY", proxy.url.as_str()),
            ("NO_PROXY", ""),
            ("STABLE_HARNESS_TEST_UPSTREAM_KEY", key),
        ],
    );
    ask_in_sequence(&client(), &served.server, 2).await;

    let port = upstream
        .url
        .split(':')
        .nth(2)
        .unwrap()
        .trim_end_matches("/v1");
    let heads = proxy.heads();
    assert_eq!(heads.len(), 1, "one tunnel, kept: {heads:?}");
    assert!(
        heads[0].starts_with(&format!("CONNECT localhost:{port} HTTP/1.1\r\n")),
        "{heads:?}"
    );
    assert_calls_on_one_connection(&upstream, 2, Version::HTTP_2);
    let bearer = format!("Bearer {key}");
    for call in upstream.calls() {
        assert_eq!(call.authorization.as_deref(), Some(bearer.as_str()));
    }
    let through = proxy.tunnelled();
    assert!(through.len() > 1_000, "the calls went through the tunnel");
    for plain in [key.as_bytes(), b"main-upstream", b"hello 1"] {
        assert!(
            !through.windows(plain.len()).any(|window| window == plain),
            "the proxy saw {:?} in clear",
            String::from_utf8_lossy(plain)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_upstream_is_reached_through_the_proxy_http_proxy_names_with_its_credentials() {
    // A plain `http://` upstream behind a forwarding proxy: the binary sends the proxy the
    // request itself, its target in absolute form, with the credentials the proxy's URL
    // carries; the connection to the proxy is kept for the next call.
    let upstream = MockUpstream::start().await;
    let proxy = TunnelProxy::start().await;
    let with_credentials = proxy.url.replace("http://", "http://egress:s3cret@");
    let served = start_trusting(
        &upstream,
        None,
        &[("HTTP_PROXY", with_credentials.as_str()), ("NO_PROXY", "")],
    );
    ask_in_sequence(&client(), &served.server, 2).await;

    let heads = proxy.heads();
    assert_eq!(
        heads.len(),
        1,
        "one connection to the proxy, kept: {heads:?}"
    );
    let target = format!("{}/chat/completions", upstream.url);
    assert!(
        heads[0].starts_with(&format!("POST {target} HTTP/1.1\r\n")),
        "{heads:?}"
    );
    // `egress:s3cret` in base64, as HTTP's basic scheme sends it.
    let credentials = heads[0].lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("proxy-authorization")
            .then(|| value.trim().to_owned())
    });
    assert_eq!(
        credentials.as_deref(),
        Some("Basic ZWdyZXNzOnMzY3JldA=="),
        "{heads:?}"
    );
    assert_eq!(upstream.calls().len(), 2, "both calls reached the upstream");
    assert_eq!(upstream.connections(), 1, "through one relayed connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_cannot_be_a_header_fails_the_call_before_it_is_sent_and_is_not_shown() {
    // A key pasted with its line end: no call leaves with a broken header, and the error
    // says what to mend without printing the key.
    let upstream = MockUpstream::start().await;
    let served = start_trusting(
        &upstream,
        None,
        &[(
            "STABLE_HARNESS_TEST_UPSTREAM_KEY",
            "sk-pasted\nwith-its-line-end",
        )],
    );
    let (status, body) = chat(&client(), &served.server, ask("hello")).await;
    assert_ne!(status, 200, "{body}");
    assert!(
        body.contains("its key is not a valid HTTP header value"),
        "{body}"
    );
    assert!(!body.contains("sk-pasted"), "{body}");
    assert!(upstream.calls().is_empty(), "nothing was sent");
}

/// A forward proxy on loopback: it tunnels a `CONNECT host:port` (as HTTPS clients use a
/// proxy) and relays a plain request sent in absolute form (as plain HTTP clients do),
/// recording each connection's first request head and every byte the client sent through
/// a tunnel.
struct TunnelProxy {
    url: String,
    heads: Arc<Mutex<Vec<String>>>,
    tunnelled: Arc<Mutex<Vec<u8>>>,
}

impl TunnelProxy {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Self {
            url: format!("http://{}", listener.local_addr().unwrap()),
            heads: Arc::default(),
            tunnelled: Arc::default(),
        };
        let (heads, tunnelled) = (Arc::clone(&proxy.heads), Arc::clone(&proxy.tunnelled));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(tunnel(client, Arc::clone(&heads), Arc::clone(&tunnelled)));
            }
        });
        proxy
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }

    fn tunnelled(&self) -> Vec<u8> {
        self.tunnelled.lock().unwrap().clone()
    }
}

/// Reads one request head; a `CONNECT` is answered 200 and its bytes are relayed both ways,
/// as a plain request's are after its head is sent on to the host its target names.
async fn tunnel(
    mut client: tokio::net::TcpStream,
    heads: Arc<Mutex<Vec<String>>>,
    tunnelled: Arc<Mutex<Vec<u8>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let Ok(byte) = client.read_u8().await else {
            return;
        };
        head.push(byte);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    heads.lock().unwrap().push(head.clone());
    let connect = head
        .strip_prefix("CONNECT ")
        .and_then(|rest| rest.split_whitespace().next());
    let forward = head
        .split_whitespace()
        .nth(1)
        .and_then(|target| target.strip_prefix("http://"))
        .and_then(|rest| rest.split('/').next());
    let upstream = match connect.or(forward) {
        Some(target) => tokio::net::TcpStream::connect(target).await.ok(),
        None => None,
    };
    let Some(mut upstream) = upstream else {
        let _ = client
            .write_all(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            .await;
        return;
    };
    let started = if connect.is_some() {
        client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
    } else {
        upstream.write_all(head.as_bytes()).await
    };
    if started.is_err() {
        return;
    }
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_upstream, mut to_upstream) = upstream.into_split();
    let outbound = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        while let Ok(read) = from_client.read(&mut buffer).await {
            if read == 0 {
                break;
            }
            tunnelled.lock().unwrap().extend_from_slice(&buffer[..read]);
            if to_upstream.write_all(&buffer[..read]).await.is_err() {
                break;
            }
        }
        let _ = to_upstream.shutdown().await;
    };
    let inbound = tokio::io::copy(&mut from_upstream, &mut to_client);
    let _ = tokio::join!(outbound, inbound);
}
