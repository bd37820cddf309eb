//! Serving connections on *shards*: one single-threaded tokio runtime per core, each serving
//! whole the connections dealt to it, with the tasks their requests spawn (runs, upstream
//! calls) on the same thread.
//!
//! Why not the multi-threaded runtime: a request at concurrency 1 woke its two workers ten
//! times (a task woken on one was stolen by the other, which woke the first to search in
//! turn), each wake-up ~20 µs of scheduling delay on two cores shared with the store's
//! writer (`perf sched`, docs/profiling.md). On a shard a connection wakes its thread once
//! per I/O event. What it gives up: an idle core cannot take over a busy shard's work, so
//! nothing long may block a shard's thread (blocking work goes to `spawn_blocking`), and
//! connections are dealt in turn, not by load.
//!
//! The listener stays on the caller's runtime: it accepts, sets `TCP_NODELAY`, and hands
//! each connection to the next shard. A shard keeps running after its connections closed,
//! so the runs its requests started finish there, until [`Shards::stop`].

use std::net::SocketAddr;
use std::thread::JoinHandle;

use axum::Router;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};

/// Connections accepted but not yet taken by their shard, per shard.
const BACKLOG: usize = 256;
/// How long a stopping shard waits for its blocking tasks.
const ABANDON_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// The shard threads, serving until `stopping` turns true.
#[derive(Debug)]
pub struct Shards {
    shards: Vec<Shard>,
}

#[derive(Debug)]
struct Shard {
    connections: mpsc::Sender<std::net::TcpStream>,
    /// Closes the shard's connections at once (the grace period passed).
    abort: Option<oneshot::Sender<()>>,
    /// Resolved when the shard's server ended: every connection closed.
    served: Option<oneshot::Receiver<std::io::Result<()>>>,
    /// Ends the thread, dropping what still runs on it.
    end: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Shards {
    /// Starts `count` shards serving `router`. When `stopping` turns true each stops taking
    /// connections and ends once its open ones closed (see [`Shards::drained`]).
    pub fn start(
        count: usize,
        router: &Router,
        local: SocketAddr,
        stopping: &watch::Receiver<bool>,
    ) -> std::io::Result<Self> {
        let mut shards = Vec::with_capacity(count);
        for index in 0..count.max(1) {
            let (connections, incoming) = mpsc::channel(BACKLOG);
            let (abort, aborted) = oneshot::channel();
            let (served_tx, served) = oneshot::channel();
            let (end, ended) = oneshot::channel::<()>();
            let router = router.clone();
            let mut stopping = stopping.clone();
            let (thread, _) = crate::threads::spawn_with_runtime(
                &format!("http-shard-{index}"),
                || {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                },
                move |runtime| {
                    crate::net::keep_thread_clients(
                        crate::app::upstream_client(),
                        crate::net::upstream::UpstreamClient::new(),
                    );
                    runtime.block_on(async move {
                        let listener = Dealt { incoming, local };
                        let signal = async move {
                            let _ = stopping.wait_for(|stopping| *stopping).await;
                        };
                        let server = axum::serve(listener, router).with_graceful_shutdown(signal);
                        let result = tokio::select! {
                            result = server => result,
                            _ = aborted => Ok(()),
                        };
                        let _ = served_tx.send(result);
                        // The runs started here go on until the runtime's shutdown is over.
                        let _ = ended.await;
                    });
                    // Whatever is left was given its grace already: a blocking task still
                    // running is not waited for.
                    runtime.shutdown_timeout(ABANDON_AFTER);
                },
            )?;
            shards.push(Shard {
                connections,
                abort: Some(abort),
                served: Some(served),
                end: Some(end),
                thread: Some(thread),
            });
        }
        Ok(Self { shards })
    }

    /// What deals accepted connections to the shards.
    pub fn dealer(&self) -> Dealer {
        Dealer {
            shards: self.shards.iter().map(|s| s.connections.clone()).collect(),
        }
    }

    /// Waits until every shard's server ended: its connections closed after `stopping`.
    pub async fn drained(&mut self) -> std::io::Result<()> {
        let mut outcome = Ok(());
        for shard in &mut self.shards {
            if let Some(served) = shard.served.take()
                && let Ok(Err(error)) = served.await
            {
                outcome = Err(error);
            }
        }
        outcome
    }

    /// Closes every connection still open (the grace period passed).
    pub fn abort(&mut self) {
        for shard in &mut self.shards {
            if let Some(abort) = shard.abort.take() {
                let _ = abort.send(());
            }
        }
    }

    /// Ends the shard threads; what still runs on them is dropped. Called once the
    /// runtime's shutdown is over.
    pub fn stop(mut self) {
        self.end_threads();
    }

    fn end_threads(&mut self) {
        self.abort();
        for shard in &mut self.shards {
            if let Some(end) = shard.end.take() {
                let _ = end.send(());
            }
        }
        for shard in &mut self.shards {
            if let Some(thread) = shard.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

impl Drop for Shards {
    fn drop(&mut self) {
        self.end_threads();
    }
}

/// Deals accepted connections to the shards in turn.
#[derive(Debug)]
pub struct Dealer {
    shards: Vec<mpsc::Sender<std::net::TcpStream>>,
}

impl Dealer {
    /// Accepts connections on `listener` and deals them to the shards in turn, until
    /// `stopping` turns true.
    pub async fn accept(self, mut listener: TcpListener, mut stopping: watch::Receiver<bool>) {
        let mut next = 0usize;
        loop {
            let accepted = tokio::select! {
                accepted = axum::serve::Listener::accept(&mut listener) => accepted,
                _ = stopping.wait_for(|stopping| *stopping) => return,
            };
            let (tcp, _) = accepted;
            // Without TCP_NODELAY, a streamed answer's small writes wait on the client's
            // delayed ACK (Nagle): tens of milliseconds per stream.
            if let Err(error) = tcp.set_nodelay(true) {
                tracing::debug!(%error, "could not set TCP_NODELAY on a connection");
            }
            let tcp = match tcp.into_std() {
                Ok(tcp) => tcp,
                Err(error) => {
                    tracing::debug!(%error, "could not hand a connection to a shard");
                    continue;
                }
            };
            let shard = &self.shards[next % self.shards.len()];
            next = next.wrapping_add(1);
            // A shard that stopped drops its connections: the client sees them closed.
            let _ = shard.send(tcp).await;
        }
    }
}

/// A shard's side of the listener: the connections dealt to it.
struct Dealt {
    incoming: mpsc::Receiver<std::net::TcpStream>,
    local: SocketAddr,
}

impl axum::serve::Listener for Dealt {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Some(tcp) = self.incoming.recv().await else {
                // No more connections will come: the server ends by its shutdown signal.
                return std::future::pending().await;
            };
            // Registered with this shard's I/O driver.
            match TcpStream::from_std(tcp) {
                Ok(tcp) => {
                    let peer = tcp.peer_addr().unwrap_or(self.local);
                    return (tcp, peer);
                }
                Err(error) => tracing::debug!(%error, "a dealt connection could not be served"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
