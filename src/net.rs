//! Outbound HTTP: a response body read within a bound, for the services the runtime calls
//! (tools, memory providers), so no answer can grow without limit in memory; each HTTP
//! shard's own clients; and a failed connection told in words safe to show. Model upstreams
//! have a client of their own ([`upstream`]).

pub mod upstream;

use futures::StreamExt;

use upstream::UpstreamClient;

/// Why a body was not read whole.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the response is larger than {0} bytes")]
    TooLarge(u64),
    #[error("reading the response: {0}")]
    Read(reqwest::Error),
}

/// The whole body, or [`BodyError::TooLarge`] as soon as it passes `max` bytes.
pub async fn read_capped(response: reqwest::Response, max: u64) -> Result<Vec<u8>, BodyError> {
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|error| BodyError::Read(error.without_url()))?;
        body.extend_from_slice(&chunk);
        if body.len() as u64 > max {
            return Err(BodyError::TooLarge(max));
        }
    }
    Ok(body)
}

/// What a failed call says of itself, whichever client made it.
pub trait CallFailure: std::error::Error + 'static {
    /// No connection was made: the request never reached the peer.
    fn is_connect(&self) -> bool;
    /// The connection, or a read on it, timed out.
    fn is_timeout(&self) -> bool;
}

impl CallFailure for reqwest::Error {
    fn is_connect(&self) -> bool {
        reqwest::Error::is_connect(self)
    }

    fn is_timeout(&self) -> bool {
        reqwest::Error::is_timeout(self)
    }
}

/// An answer's body that broke off (a model upstream's, read through hyper).
impl CallFailure for hyper::Error {
    fn is_connect(&self) -> bool {
        false
    }

    fn is_timeout(&self) -> bool {
        hyper::Error::is_timeout(self)
    }
}

/// A connection that failed, in words safe to show a client (no URL, no address): whether the
/// peer's TLS certificate was refused (not signed by a trusted root, expired, for another
/// name), which the operator must mend, or the connection failed otherwise.
pub fn connect_failure(error: &(dyn std::error::Error + 'static)) -> &'static str {
    if certificate_refused(error) {
        "could not connect: its TLS certificate was refused"
    } else {
        "could not connect"
    }
}

/// Whether rustls refused a certificate anywhere in `error`'s chain. An `io::Error` does not
/// name the error it wraps among its sources, so that one is looked into too.
fn certificate_refused(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(current) = next {
        if let Some(rustls::Error::InvalidCertificate(_)) = current.downcast_ref::<rustls::Error>()
        {
            return true;
        }
        if let Some(inner) = current
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            && certificate_refused(inner)
        {
            return true;
        }
        next = current.source();
    }
    false
}

thread_local! {
    /// This thread's own outbound client, on threads that keep one (an HTTP shard).
    static THREAD_CLIENT: std::cell::OnceCell<reqwest::Client> = const { std::cell::OnceCell::new() };
    /// This thread's own client of model upstreams, beside it.
    static THREAD_UPSTREAM: std::cell::OnceCell<UpstreamClient> = const { std::cell::OnceCell::new() };
}

/// Gives this thread clients of its own (an HTTP shard does, at its start): a pooled
/// connection is driven by the runtime that opened it, so a shard calling upstream through
/// a connection another thread opened would wake that thread at every read and write.
pub fn keep_thread_clients(client: reqwest::Client, upstream: UpstreamClient) {
    THREAD_CLIENT.with(|own| {
        let _ = own.set(client);
    });
    THREAD_UPSTREAM.with(|own| {
        let _ = own.set(upstream);
    });
}

/// `call` with this thread's own client of model upstreams, if it keeps one, else `shared`
/// (lent, not cloned: a call's future holds what it needs of the pool).
pub fn with_upstream_here<T>(
    shared: &UpstreamClient,
    call: impl FnOnce(&UpstreamClient) -> T,
) -> T {
    THREAD_UPSTREAM.with(|own| call(own.get().unwrap_or(shared)))
}

/// The client to call out with from this thread: its own, if it keeps one, else `shared`.
pub fn client_here(shared: &reqwest::Client) -> reqwest::Client {
    THREAD_CLIENT
        .with(|own| own.get().cloned())
        .unwrap_or_else(|| shared.clone())
}
