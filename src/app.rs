//! The application as a value: build it (store opened and migrated, interrupted runs resumed,
//! listener bound), ask its `port()`, run it until a shutdown signal. Tests build it on port 0.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::http::shards::Shards;
use crate::http::{ApiKeys, AppState, KeySet};
use crate::redact::Secret;
use crate::runtime::{Runtime, RuntimeError};
use crate::store::StoreError;
use crate::workspace::CompiledWorkspace;

/// How long in-flight HTTP responses (and then runs) get to finish at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What `start` is given.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub workspace: Arc<CompiledWorkspace>,
    pub host: String,
    pub port: u16,
    pub database_url: Option<String>,
    /// Client keys in addition to those the workspace names.
    pub api_keys: Vec<Secret>,
    /// Admin keys in addition to those the workspace names.
    pub admin_keys: Vec<Secret>,
    /// Serve a surface that has no keys on a non-loopback address anyway
    /// (`start --insecure-open-surfaces`); without it such a start is refused.
    pub insecure_open_surfaces: bool,
    /// Serve `GET /metrics` without an admin key (`start --metrics-public`).
    pub metrics_public: bool,
    /// Reload the workspace when its files change (`start --watch`).
    pub watch: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("cannot open the store: {0}")]
    Store(#[from] StoreError),
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error(
        "refusing to serve open surfaces on the non-loopback address {address}: {open}; set the keys, bind a loopback address (--host 127.0.0.1), or pass --insecure-open-surfaces to serve them open anyway"
    )]
    OpenSurfacesOnPublicAddress {
        address: String,
        /// Which surfaces are open and which keys would close them.
        open: String,
    },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("HTTP server failed: {0}")]
    Serve(std::io::Error),
}

#[derive(Debug)]
pub struct Application {
    listener: TcpListener,
    address: SocketAddr,
    runtime: Runtime,
    state: AppState,
    resumed: usize,
}

/// Installs the process-wide TLS crypto provider (ring) once; later calls do nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The HTTP client used for upstream calls: connect timeout here, per-call timeouts at the
/// call site (they come from the model catalog), and no redirects to unexpected hosts.
pub fn upstream_client() -> reqwest::Client {
    install_crypto_provider();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
        .unwrap_or_default()
}

/// How many HTTP shards serve: `TOKIO_WORKER_THREADS` when set to a count, else one per core
/// this process may use.
fn shard_count() -> usize {
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|count| count.trim().parse::<usize>().ok())
        .filter(|count| *count > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
}

/// Builds the runtime over the configured (or embedded) store and keeps its run leases. With
/// `resume`, it also claims — now and from then on — the runs no instance executes: those a
/// dead process left unfinished (on a shared store, once their lease expired).
pub async fn build_runtime(
    workspace: Arc<CompiledWorkspace>,
    database_url: Option<&str>,
    resume: bool,
    callback_base_url: Option<String>,
) -> Result<(Runtime, usize), AppError> {
    let url = database_url
        .map(str::to_owned)
        .or_else(|| workspace.runtime.store_url.clone());
    let options = crate::store::OpenOptions {
        max_bytes: workspace.runtime.store_max_bytes,
        lease: workspace.runtime.lease_duration,
    };
    let store = crate::store::open(url.as_deref(), &workspace.root, &options).await?;
    let runtime = Runtime::new(workspace, store, upstream_client());
    if let Some(url) = callback_base_url {
        runtime.callbacks().set_base_url(url);
    }
    let resumed = if resume && runtime.workspace().runtime.recovery.resume_on_start {
        runtime.claim_runs().await?
    } else {
        0
    };
    runtime.start_leases(resume);
    Ok((runtime, resumed))
}

/// Where remote agents' services call this server back: its bound address, with a wildcard
/// address (`0.0.0.0`, `::`) reached on loopback.
fn callback_base_url(address: std::net::SocketAddr) -> String {
    let ip = match address.ip() {
        ip if ip.is_unspecified() && ip.is_ipv4() => std::net::IpAddr::from([127, 0, 0, 1]),
        ip if ip.is_unspecified() => std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", std::net::SocketAddr::new(ip, address.port()))
}

/// Whether `host` only ever reaches this machine. A name other than `localhost` may resolve
/// anywhere, so it counts as public.
fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

/// The surfaces anyone who can reach the server may use, each with the keys that close it.
/// No client keys opens `/runtime` (and `/v1` unless disabled), and with them tool execution.
fn open_surfaces(keys: &ApiKeys, v1_enabled: bool) -> Vec<&'static str> {
    let mut open = Vec::new();
    if keys.client.is_empty() {
        open.push(if v1_enabled {
            "/v1 and /runtime (and so tool execution) have no client keys (--api-key or protocols.openai.apiKeysEnv)"
        } else {
            "/runtime (and so tool execution) has no client keys (--api-key or protocols.openai.apiKeysEnv)"
        });
    }
    if keys.admin.is_empty() {
        open.push("/admin has no admin keys (--admin-key or protocols.admin.apiKeysEnv)");
    }
    open
}

impl Application {
    /// Checks the exposure (before anything is opened or bound), opens the store, resumes
    /// interrupted runs and binds the listener.
    pub async fn build(config: ServerConfig) -> Result<Self, AppError> {
        let workspace = Arc::clone(&config.workspace);
        let mut keys = ApiKeys {
            client: KeySet::collect(&config.api_keys, &workspace.runtime.openai.api_keys_env),
            admin: KeySet::collect(&config.admin_keys, &workspace.runtime.admin_api_keys_env),
        };
        // Keys the workspace names are known by their names (and carry their labels).
        for (set, named) in [
            (&mut keys.client, &workspace.runtime.openai.keys),
            (&mut keys.admin, &workspace.runtime.admin_keys),
        ] {
            for key in named {
                if let Ok(value) = std::env::var(&key.key_env) {
                    set.add_named(&value, &key.name);
                }
            }
        }
        let address = format!("{}:{}", config.host, config.port);
        let open = open_surfaces(&keys, workspace.runtime.openai.enabled);
        if !open.is_empty() && !is_loopback(&config.host) && !config.insecure_open_surfaces {
            return Err(AppError::OpenSurfacesOnPublicAddress {
                address,
                open: open.join("; "),
            });
        }
        // Bound first: runs resumed at start may call a remote agent, whose service calls
        // tools back at this address.
        let listener = TcpListener::bind(&address)
            .await
            .map_err(|source| AppError::Bind {
                address: address.clone(),
                source,
            })?;
        let address = listener
            .local_addr()
            .map_err(|source| AppError::Bind { address, source })?;
        let (runtime, resumed) = build_runtime(
            workspace,
            config.database_url.as_deref(),
            true,
            Some(callback_base_url(address)),
        )
        .await?;
        runtime.start_retention();
        crate::metrics::install();
        if config.watch {
            runtime.watch_workspace().await;
        }
        let mut state = AppState::new(runtime.clone(), keys);
        state.metrics_public = config.metrics_public;
        Ok(Self {
            listener,
            address,
            runtime,
            state,
            resumed,
        })
    }

    pub fn port(&self) -> u16 {
        self.address.port()
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    pub fn keys(&self) -> &ApiKeys {
        &self.state.keys
    }

    /// Runs interrupted by an earlier process that this start resumed.
    pub fn resumed_runs(&self) -> usize {
        self.resumed
    }

    /// Serves until `shutdown` completes, then stops admitting requests (503
    /// `shutting_down`) and accepting connections, gives in-flight responses a bounded grace
    /// period, waits (bounded too) only for runs actively executing — a run parked on an
    /// approval is left as it is stored — and leaves unfinished runs resumable. The embedded
    /// store is released just after it returns, once the journal's task has finished on the
    /// store's writer thread (a process exit releases it whatever happens).
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AppError> {
        let router = crate::http::router(self.state.clone());
        let (stopping_tx, stopping_rx) = tokio::sync::watch::channel(false);
        let runtime = self.runtime.clone();
        let signal = async move {
            shutdown.await;
            // Refuse new work before HTTP starts draining: a request still in flight that has
            // not submitted yet gets 503 `shutting_down` instead of starting a run now.
            runtime.stop_admitting();
            tracing::info!(
                "shutting down: no new connections; in-flight responses get {}s",
                SHUTDOWN_GRACE.as_secs()
            );
            let _ = stopping_tx.send(true);
        };
        let count = shard_count();
        let mut shards =
            Shards::start(count, &router, self.address, &stopping_rx).map_err(AppError::Serve)?;
        let accepting = shards.dealer().accept(self.listener, stopping_rx.clone());
        let mut stopping = stopping_rx;
        let bounded = async move {
            let _ = stopping.wait_for(|stopping| *stopping).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        };
        let served = async {
            tokio::join!(signal, accepting);
            shards.drained().await
        };
        tokio::select! {
            result = served => result.map_err(AppError::Serve)?,
            () = bounded => tracing::warn!("in-flight responses did not finish in time; closing them"),
        }
        shards.abort();
        self.runtime.shutdown(SHUTDOWN_GRACE).await;
        shards.stop();
        Ok(())
    }
}
