//! A real OpenAI-compatible upstream on loopback for tests and benchmarks: it speaks Chat
//! Completions (JSON and SSE), plays scripted replies in order (or lets a [`Responder`] pick
//! each reply from the call's transcript), can be told to fail, stall, cut a stream or send
//! garbage (raw SSE of a test's choosing, an event that never ends), and records every call
//! it received (with the HTTP version it came over) and every connection it accepted. It serves
//! plain HTTP/1.1 ([`MockUpstream::start`]) or TLS with the protocols a test offers by ALPN
//! ([`MockUpstream::start_tls`]), as real providers serve.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, Version};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// What the upstream answers to one call.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A completion of this text (streamed word by word when the call asks for a stream).
    Text(String),
    /// An error status, with an optional `retry-after` in seconds.
    Status {
        status: u16,
        retry_after: Option<u64>,
    },
    /// Waits this long before answering with text: longer than a model timeout is a stall.
    Stall(Duration),
    /// A stream whose second chunk is not JSON.
    Malformed,
    /// A stream that sends this text, then drops the connection without `[DONE]`.
    CutAfter(String),
    /// A stream of this text with a pause between words.
    Slow { text: String, pause: Duration },
    /// A turn that calls tools: (function name, arguments as the JSON text a model sends).
    /// Streamed as fragments (the arguments cut in two), as OpenAI does.
    ToolCalls(Vec<(String, String)>),
    /// A stream of exactly these parts, whatever they hold (a hostile or broken upstream).
    Raw(Vec<String>),
    /// One `data:` line that never ends: 64 KiB pieces with no line break until `max_bytes`
    /// were sent or the client hung up, then the connection drops.
    /// [`MockUpstream::endless_bytes_sent`] tells how far it got.
    EndlessEvent { max_bytes: usize },
    /// Like `ToolCalls`, with the ids the model gives its calls: (id, function name, arguments).
    /// Real providers reuse `call_0` every turn or send empty ids.
    ToolCallsWithIds(Vec<(String, String, String)>),
    /// An error status with this body, as a provider's 4xx explains itself.
    StatusBody { status: u16, body: String },
    /// A completion of `text` after `pause` reporting this usage (`None`: no usage at all,
    /// as some providers answer), streamed word by word with the usage in the final chunk.
    Metered {
        text: String,
        usage: Option<(u64, u64)>,
        pause: Duration,
    },
}

impl Reply {
    /// A turn calling one function.
    pub fn call(name: &str, arguments: &str) -> Self {
        Self::ToolCalls(vec![(name.to_owned(), arguments.to_owned())])
    }
}

/// One call the upstream received.
#[derive(Debug, Clone)]
pub struct Call {
    pub body: Value,
    pub at: Instant,
    /// The HTTP version the call came over.
    pub version: Version,
    /// Its `authorization` header, as it arrived.
    pub authorization: Option<String>,
}

/// The protocols a TLS upstream offers by ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// `h2` and `http/1.1`, as most providers: the client picks.
    Http2AndHttp1,
    /// `http/1.1` alone: an upstream that does not speak HTTP/2.
    Http1Only,
}

#[derive(Debug)]
struct MockState {
    script: Mutex<VecDeque<Reply>>,
    fallback: Mutex<Reply>,
    calls: Mutex<Vec<Call>>,
    /// Off for benchmarks: a record of millions of calls would grow (and stall) the process.
    recording: std::sync::atomic::AtomicBool,
    endless_sent: Arc<AtomicUsize>,
    responder: Mutex<Option<Responder>>,
    /// TCP connections accepted so far.
    connections: AtomicUsize,
}

/// Decides the reply from the call's body (its transcript): for upstreams shared by many
/// concurrent requests, where a queue's order would not say which request gets what.
#[derive(Clone)]
pub struct Responder(Arc<dyn Fn(&Value) -> Reply + Send + Sync>);

impl Responder {
    pub fn new(decide: impl Fn(&Value) -> Reply + Send + Sync + 'static) -> Self {
        Self(Arc::new(decide))
    }
}

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Responder")
    }
}

#[derive(Debug, Clone)]
pub struct MockUpstream {
    /// Base URL ending in `/v1`.
    pub url: String,
    state: Arc<MockState>,
}

impl MockUpstream {
    /// Starts on a random loopback port; answers `Text("Hello from upstream")` unless told otherwise.
    pub async fn start() -> Self {
        let state = MockState::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let counted = Arc::clone(&state);
        // As providers do: a stream's chunks go out as written, not held back by Nagle.
        let listener = axum::serve::ListenerExt::tap_io(listener, move |tcp| {
            counted.connections.fetch_add(1, Ordering::SeqCst);
            let _ = tcp.set_nodelay(true);
        });
        let app = router(Arc::clone(&state));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, state }
    }

    /// Starts over TLS (`https://localhost:PORT/v1`) offering `alpn`, with a certificate for
    /// `localhost` signed by a CA made for it. Returns the CA's certificate (PEM): a client
    /// trusts the upstream only when told to trust it (`SSL_CERT_FILE` for the binary).
    pub async fn start_tls(alpn: Alpn) -> (Self, String) {
        let (server_config, ca_pem) = tls_config(alpn);
        let state = MockState::new();
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://localhost:{}/v1", tcp.local_addr().unwrap().port());
        let listener = TlsListener {
            tcp,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server_config)),
            state: Arc::clone(&state),
        };
        let app = router(Arc::clone(&state));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (Self { url, state }, ca_pem)
    }

    /// TCP connections accepted so far (a client that keeps its connections opens few).
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Queues replies, played one per call in order; then the default reply.
    pub fn push(&self, replies: impl IntoIterator<Item = Reply>) {
        self.state.script.lock().unwrap().extend(replies);
    }

    /// The reply once the queue is empty.
    pub fn set_default(&self, reply: Reply) {
        *self.state.fallback.lock().unwrap() = reply;
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state.calls.lock().unwrap().clone()
    }

    /// Bytes handed to the connection by `Reply::EndlessEvent` replies so far.
    pub fn endless_bytes_sent(&self) -> usize {
        self.state.endless_sent.load(Ordering::SeqCst)
    }

    /// Stops recording calls ([`MockUpstream::calls`] stays as it is).
    pub fn stop_recording(&self) {
        self.state.recording.store(false, Ordering::Relaxed);
    }

    /// From now on every call is answered by `responder` (the queue and default are unused).
    pub fn set_responder(&self, responder: Responder) {
        *self.state.responder.lock().unwrap() = Some(responder);
    }
}

impl MockState {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            script: Mutex::new(VecDeque::new()),
            fallback: Mutex::new(Reply::Text("Hello from the upstream model".into())),
            calls: Mutex::new(Vec::new()),
            recording: std::sync::atomic::AtomicBool::new(true),
            endless_sent: Arc::new(AtomicUsize::new(0)),
            responder: Mutex::new(None),
            connections: AtomicUsize::new(0),
        })
    }
}

fn router(state: Arc<MockState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(state)
}

/// A server certificate for `localhost` and `127.0.0.1`, signed by a CA made for it, offering
/// `alpn`; and the CA's certificate (PEM).
fn tls_config(alpn: Alpn) -> (rustls::ServerConfig, String) {
    use rcgen::{
        BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "stable-harness test CA");
    let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    config.alpn_protocols = match alpn {
        Alpn::Http2AndHttp1 => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        Alpn::Http1Only => vec![b"http/1.1".to_vec()],
    };
    (config, ca_pem)
}

/// Accepts TCP connections and completes their TLS handshakes, one at a time (a test opens
/// few, and keeps them). A handshake that fails (a client that does not trust the
/// certificate) drops that connection, and the next is awaited.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    state: Arc<MockState>,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, address)) = self.tcp.accept().await else {
                continue;
            };
            self.state.connections.fetch_add(1, Ordering::SeqCst);
            let _ = tcp.set_nodelay(true);
            if let Ok(tls) = self.acceptor.accept(tcp).await {
                return (tls, address);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

async fn chat_completions(
    State(state): State<Arc<MockState>>,
    version: Version,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if state.recording.load(Ordering::Relaxed) {
        state.calls.lock().unwrap().push(Call {
            body: body.clone(),
            at: Instant::now(),
            version,
            authorization: headers
                .get(axum::http::header::AUTHORIZATION)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned),
        });
    }
    let responder = state.responder.lock().unwrap().clone();
    let reply = match responder {
        Some(responder) => (responder.0)(&body),
        None => {
            let next = state.script.lock().unwrap().pop_front();
            next.unwrap_or_else(|| state.fallback.lock().unwrap().clone())
        }
    };
    let stream = body["stream"].as_bool().unwrap_or(false);
    let model = body["model"].as_str().unwrap_or("mock").to_owned();
    match reply {
        Reply::Text(text) => answer(&model, &text, stream, Duration::ZERO),
        Reply::Slow { text, pause } => answer(&model, &text, stream, pause),
        Reply::Metered { text, usage, pause } => {
            tokio::time::sleep(pause).await;
            let usage = usage.map(|(prompt, completion)| {
                json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
            });
            metered(&model, &text, stream, usage)
        }
        Reply::ToolCalls(calls) => tool_calls(&model, &calls, stream),
        Reply::Stall(delay) => {
            tokio::time::sleep(delay).await;
            answer(&model, "too late", stream, Duration::ZERO)
        }
        Reply::Status {
            status,
            retry_after,
        } => {
            let mut response = (
                StatusCode::from_u16(status).unwrap(),
                axum::Json(json!({ "error": { "message": format!("mock failure {status}"), "type": "server_error" } })),
            )
                .into_response();
            if let Some(seconds) = retry_after {
                response
                    .headers_mut()
                    .insert("retry-after", seconds.to_string().parse().unwrap());
            }
            response
        }
        Reply::Malformed => sse(
            vec![
                Ok(chunk(
                    &model,
                    json!({ "role": "assistant", "content": "" }),
                    None,
                )),
                Ok("data: {not json\n\n".into()),
            ],
            Duration::ZERO,
        ),
        Reply::Raw(parts) => sse(parts.into_iter().map(Ok).collect(), Duration::ZERO),
        Reply::EndlessEvent { max_bytes } => endless_event(max_bytes, &state.endless_sent),
        Reply::CutAfter(text) => {
            let mut parts: Vec<Result<String, std::io::Error>> = words(&text)
                .into_iter()
                .map(|w| Ok(chunk(&model, json!({ "content": w }), None)))
                .collect();
            parts.push(Err(std::io::Error::other("connection cut by the mock")));
            sse(parts, Duration::from_millis(5))
        }
        Reply::ToolCallsWithIds(calls) => tool_calls_with_ids(&model, &calls, stream),
        Reply::StatusBody { status, body } => (
            StatusCode::from_u16(status).unwrap(),
            [("content-type", "application/json")],
            body,
        )
            .into_response(),
    }
}

fn words(text: &str) -> Vec<String> {
    text.split_inclusive(' ').map(str::to_owned).collect()
}

fn usage(text: &str) -> Value {
    let completion = words(text).len() as u64;
    json!({ "prompt_tokens": 11, "completion_tokens": completion, "total_tokens": 11 + completion })
}

/// One `data:` line of a chat-completion chunk with this delta (a stream's part).
pub fn chunk(model: &str, delta: Value, finish_reason: Option<&str>) -> String {
    let body = json!({
        "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model,
        "choices": [{ "index": 0, "delta": delta, "finish_reason": finish_reason }],
    });
    format!("data: {body}\n\n")
}

fn answer(model: &str, text: &str, stream: bool, pause: Duration) -> Response {
    if !stream {
        return axum::Json(json!({
            "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": "stop" }],
            "usage": usage(text),
        }))
        .into_response();
    }
    let mut parts = vec![Ok(chunk(
        model,
        json!({ "role": "assistant", "content": "" }),
        None,
    ))];
    parts.extend(
        words(text)
            .into_iter()
            .map(|w| Ok(chunk(model, json!({ "content": w }), None))),
    );
    parts.push(Ok(chunk(model, json!({}), Some("stop"))));
    let usage_chunk = json!({ "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [], "usage": usage(text) });
    parts.push(Ok(format!("data: {usage_chunk}\n\n")));
    parts.push(Ok("data: [DONE]\n\n".into()));
    sse(parts, pause)
}

/// A completion reporting `usage` (or none), in one body or as a stream.
fn metered(model: &str, text: &str, stream: bool, usage: Option<Value>) -> Response {
    if !stream {
        let mut body = json!({
            "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": "stop" }],
        });
        if let Some(usage) = usage {
            body["usage"] = usage;
        }
        return axum::Json(body).into_response();
    }
    let mut parts: Vec<Result<String, std::io::Error>> = words(text)
        .into_iter()
        .map(|w| Ok(chunk(model, json!({ "content": w }), None)))
        .collect();
    parts.push(Ok(chunk(model, json!({}), Some("stop"))));
    if let Some(usage) = usage {
        let last = json!({ "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [], "usage": usage });
        parts.push(Ok(format!("data: {last}\n\n")));
    }
    parts.push(Ok("data: [DONE]\n\n".into()));
    sse(parts, Duration::ZERO)
}

fn tool_calls(model: &str, calls: &[(String, String)], stream: bool) -> Response {
    let id = |index: usize| format!("call_{index}_{}", fastrand::u32(..));
    if !stream {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(index, (name, arguments))| json!({ "id": id(index), "type": "function", "function": { "name": name, "arguments": arguments } }))
            .collect();
        return axum::Json(json!({
            "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{ "index": 0, "message": { "role": "assistant", "content": null, "tool_calls": calls }, "finish_reason": "tool_calls" }],
            "usage": { "prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25 },
        }))
        .into_response();
    }
    let mut parts = vec![Ok(chunk(
        model,
        json!({ "role": "assistant", "content": null }),
        None,
    ))];
    for (index, (name, arguments)) in calls.iter().enumerate() {
        let (head, tail) = arguments.split_at(arguments.len() / 2);
        parts.push(Ok(chunk(
            model,
            json!({ "tool_calls": [{ "index": index, "id": id(index), "type": "function", "function": { "name": name, "arguments": head } }] }),
            None,
        )));
        parts.push(Ok(chunk(
            model,
            json!({ "tool_calls": [{ "index": index, "function": { "arguments": tail } }] }),
            None,
        )));
    }
    parts.push(Ok(chunk(model, json!({}), Some("tool_calls"))));
    parts.push(Ok("data: [DONE]\n\n".into()));
    sse(parts, Duration::ZERO)
}

fn endless_event(max_bytes: usize, sent: &Arc<AtomicUsize>) -> Response {
    const PIECE: usize = 64 << 10;
    let sent = Arc::clone(sent);
    let mut first = true;
    let mut left = max_bytes;
    // Produced one piece per poll: a client that stops reading stops the production (hyper
    // polls the body only as the connection drains), and a dropped connection drops it.
    let stream = futures::stream::poll_fn(move |_| {
        if left == 0 {
            return std::task::Poll::Ready(Some(Err(std::io::Error::other(
                "the endless event reached its end",
            ))));
        }
        let mut piece = if std::mem::take(&mut first) {
            b"data: ".to_vec()
        } else {
            Vec::new()
        };
        piece.resize(PIECE.min(left), b'x');
        left -= piece.len();
        sent.fetch_add(piece.len(), Ordering::SeqCst);
        std::task::Poll::Ready(Some(Ok::<_, std::io::Error>(Bytes::from(piece))))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

fn sse(parts: Vec<Result<String, std::io::Error>>, pause: Duration) -> Response {
    let stream = futures::stream::iter(parts).then(move |part| async move {
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        part.map(Bytes::from)
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// A tool-call turn whose calls carry the given ids, streamed as fragments like `tool_calls`.
fn tool_calls_with_ids(model: &str, calls: &[(String, String, String)], stream: bool) -> Response {
    if !stream {
        let calls: Vec<Value> = calls
            .iter()
            .map(|(id, name, arguments)| json!({ "id": id, "type": "function", "function": { "name": name, "arguments": arguments } }))
            .collect();
        return axum::Json(json!({
            "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{ "index": 0, "message": { "role": "assistant", "content": null, "tool_calls": calls }, "finish_reason": "tool_calls" }],
            "usage": { "prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25 },
        }))
        .into_response();
    }
    let mut parts = vec![Ok(chunk(
        model,
        json!({ "role": "assistant", "content": null }),
        None,
    ))];
    for (index, (id, name, arguments)) in calls.iter().enumerate() {
        let (head, tail) = arguments.split_at(arguments.len() / 2);
        parts.push(Ok(chunk(
            model,
            json!({ "tool_calls": [{ "index": index, "id": id, "type": "function", "function": { "name": name, "arguments": head } }] }),
            None,
        )));
        parts.push(Ok(chunk(
            model,
            json!({ "tool_calls": [{ "index": index, "function": { "arguments": tail } }] }),
            None,
        )));
    }
    parts.push(Ok(chunk(model, json!({}), Some("tool_calls"))));
    parts.push(Ok("data: [DONE]\n\n".into()));
    sse(parts, Duration::ZERO)
}

use futures::StreamExt as _;
