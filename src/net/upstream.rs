//! The model upstream's HTTP client: hyper's pooled client, called directly.
//!
//! Why not reqwest, as every other outbound call: a model call is on every request's path,
//! and reqwest wraps each call in services of its own that a POST to a known endpoint does
//! not need. Counted per call, ~24,000 instructions (~5% of a whole chat request): the URL
//! parsed from its text twice (its redirect policy looks at the request, and the answer is
//! given its URL back), a redirect service and a retry service around the call, and the
//! proxy matched per call (`docs/profiling.md`, the forty-seventh pass).
//!
//! What it keeps of that client, so that an upstream is reached exactly as before:
//! - the same TLS: rustls with the platform's verifier (the system's roots, or
//!   `SSL_CERT_FILE` / `SSL_CERT_DIR`), TLS 1.2 and 1.3, and HTTP/2 or HTTP/1.1 agreed by
//!   ALPN (plain `http://` upstreams over HTTP/1.1);
//! - the same proxies, read from the environment as curl reads it (`HTTPS_PROXY`,
//!   `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`, lower case too): an HTTPS upstream through a
//!   `CONNECT` tunnel with TLS end to end inside it, a plain one forwarded in absolute form,
//!   with the proxy's credentials when its URL carries them;
//! - the same pool: connections kept 60 s idle, a connect timeout of 10 s, `TCP_NODELAY`;
//! - no redirects followed and no call retried by the client: the adapter's recovery
//!   decides (a request hyper never wrote, on a pooled connection that closed, is sent
//!   again on a fresh one, as reqwest's client did too).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue, PROXY_AUTHORIZATION};
use http::uri::Scheme;
use http::{Method, Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::proxy::Tunnel;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::proxy::matcher::Matcher;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a connection is kept unused in the pool.
const POOL_IDLE: Duration = Duration::from_secs(60);
/// How long a connection (to the upstream, or to its proxy) may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A pooled client for model upstreams. Cloning it shares its pool.
#[derive(Clone)]
pub struct UpstreamClient {
    client: Client<Connector, Full<Bytes>>,
    proxies: Arc<Matcher>,
}

impl std::fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamClient").finish_non_exhaustive()
    }
}

/// Why a call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The key cannot be sent as a header (a byte HTTP does not allow in one).
    #[error("its key is not a valid HTTP header value")]
    Key,
    /// No connection: the request never left this process.
    #[error("could not connect")]
    Connect(#[source] hyper_util::client::legacy::Error),
    /// The request was (or may have been) sent, and no answer came.
    #[error("connection failed")]
    Sent(#[source] hyper_util::client::legacy::Error),
}

impl super::CallFailure for CallError {
    fn is_connect(&self) -> bool {
        matches!(self, Self::Connect(_) | Self::Key)
    }

    fn is_timeout(&self) -> bool {
        timed_out(self)
    }
}

impl UpstreamClient {
    /// A client trusting the platform's roots and the environment's proxies, as read now.
    pub fn new() -> Self {
        crate::app::install_crypto_provider();
        let tls = TLS.get_or_init(|| Arc::new(tls_config())).clone();
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let proxies = Arc::new(Matcher::from_system());
        let connector = Connector {
            direct: HttpsConnector::from((tcp, tls.clone())),
            tls,
            proxies: proxies.clone(),
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(connector);
        Self { client, proxies }
    }

    /// POSTs `body` (JSON) to `uri`, with `key` as its bearer token when given; the answer's
    /// head, its body still to read. No timeout here: the caller bounds the call. The future
    /// holds what it needs of the pool, not `self`.
    pub fn post_json(
        &self,
        uri: &Uri,
        body: Vec<u8>,
        key: Option<&str>,
    ) -> impl Future<Output = Result<Response<Incoming>, CallError>> + Send + use<> {
        let sent = self
            .request(uri, body, key)
            .map(|request| self.client.request(request));
        async move {
            sent?.await.map_err(|error| {
                if error.is_connect() {
                    CallError::Connect(error)
                } else {
                    CallError::Sent(error)
                }
            })
        }
    }

    fn request(
        &self,
        uri: &Uri,
        body: Vec<u8>,
        key: Option<&str>,
    ) -> Result<Request<Full<Bytes>>, CallError> {
        let mut request = Request::new(Full::new(Bytes::from(body)));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = uri.clone();
        let headers = request.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(ACCEPT, HeaderValue::from_static("*/*"));
        if let Some(key) = key {
            let mut value =
                HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| CallError::Key)?;
            // Never indexed by HTTP/2's header compression, as reqwest marks it too.
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        // A plain upstream through a proxy gets the request itself: its credentials go with
        // it (a tunnel's go with its `CONNECT`).
        if uri.scheme() == Some(&Scheme::HTTP)
            && let Some(auth) = self
                .proxies
                .intercept(uri)
                .and_then(|proxy| proxy.basic_auth().cloned())
        {
            headers.insert(PROXY_AUTHORIZATION, auth);
        }
        Ok(request)
    }
}

impl Default for UpstreamClient {
    fn default() -> Self {
        Self::new()
    }
}

/// The TLS configuration every upstream client of the process shares: the platform's roots
/// are read and parsed once, not once per HTTP shard.
static TLS: std::sync::OnceLock<Arc<rustls::ClientConfig>> = std::sync::OnceLock::new();

/// rustls with the platform's verifier, offering HTTP/2 and HTTP/1.1. Should the platform's
/// verifier not build, no root is trusted: every HTTPS call fails as refused, never
/// unverified.
fn tls_config() -> rustls::ClientConfig {
    use rustls_platform_verifier::BuilderVerifierExt;
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
    let verified = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .and_then(BuilderVerifierExt::with_platform_verifier);
    let mut config = match verified {
        Ok(builder) => builder.with_no_client_auth(),
        Err(error) => {
            tracing::error!(%error, "the platform's certificate verifier did not build: no HTTPS upstream is trusted");
            rustls::ClientConfig::builder()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        }
    };
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config
}

/// Whether an I/O error anywhere in `error`'s chain is a timeout.
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(current) = next {
        if let Some(io) = current.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::TimedOut
        {
            return true;
        }
        if current
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout)
        {
            return true;
        }
        next = current.source();
    }
    false
}

/// Opens a connection to a destination: directly, through a proxy's tunnel, or to a proxy
/// that forwards.
#[derive(Clone)]
struct Connector {
    direct: HttpsConnector<HttpConnector>,
    tls: Arc<rustls::ClientConfig>,
    proxies: Arc<Matcher>,
}

type Direct = MaybeHttpsStream<TokioIo<TcpStream>>;

/// An open connection.
#[allow(
    clippy::large_enum_variant,
    reason = "the direct stream is what nearly every call uses: boxing it would add an indirection to each of its reads and writes"
)]
enum Conn {
    /// To the upstream, or (`forwarding`) to a proxy that takes absolute-form requests.
    Direct { stream: Direct, forwarding: bool },
    /// TLS to the upstream, inside a proxy's `CONNECT` tunnel (itself plain or TLS).
    Tunneled(Box<MaybeHttpsStream<Direct>>),
}

impl tower::Service<Uri> for Connector {
    type Response = Conn;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Conn, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, destination: Uri) -> Self::Future {
        let Some(proxy) = self.proxies.intercept(&destination) else {
            let connecting = self.direct.call(destination);
            return Box::pin(async move {
                Ok(Conn::Direct {
                    stream: connecting.await?,
                    forwarding: false,
                })
            });
        };
        if destination.scheme() == Some(&Scheme::HTTPS) {
            let mut tunnel = Tunnel::new(proxy.uri().clone(), self.direct.clone());
            if let Some(auth) = proxy.basic_auth() {
                tunnel = tunnel.with_auth(auth.clone());
            }
            let mut inside = HttpsConnector::from((tunnel, self.tls.clone()));
            let connecting = inside.call(destination);
            Box::pin(async move { Ok(Conn::Tunneled(Box::new(connecting.await?))) })
        } else {
            let connecting = self.direct.call(proxy.uri().clone());
            Box::pin(async move {
                Ok(Conn::Direct {
                    stream: connecting.await?,
                    forwarding: true,
                })
            })
        }
    }
}

impl Connection for Conn {
    fn connected(&self) -> Connected {
        match self {
            Self::Direct { stream, forwarding } => stream.connected().proxy(*forwarding),
            Self::Tunneled(stream) => stream.connected(),
        }
    }
}

impl Read for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Direct { stream, .. } => Pin::new(stream).poll_read(cx, buf),
            Self::Tunneled(stream) => Pin::new(&mut **stream).poll_read(cx, buf),
        }
    }
}

impl Write for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Direct { stream, .. } => Pin::new(stream).poll_write(cx, buf),
            Self::Tunneled(stream) => Pin::new(&mut **stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Direct { stream, .. } => Pin::new(stream).poll_write_vectored(cx, bufs),
            Self::Tunneled(stream) => Pin::new(&mut **stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Direct { stream, .. } => stream.is_write_vectored(),
            Self::Tunneled(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Direct { stream, .. } => Pin::new(stream).poll_flush(cx),
            Self::Tunneled(stream) => Pin::new(&mut **stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Direct { stream, .. } => Pin::new(stream).poll_shutdown(cx),
            Self::Tunneled(stream) => Pin::new(&mut **stream).poll_shutdown(cx),
        }
    }
}
