//! `stable-harness start`: serve the workspace until SIGINT/SIGTERM. Exit 2 for what the
//! command line or the keys got wrong (an invalid workspace, a flag not supported yet, open
//! surfaces on a non-loopback address without `--insecure-open-surfaces`), 1 for a failure
//! to serve.

use std::sync::Arc;

use super::{StartArgs, exit, output};
use crate::app::{AppError, Application, ServerConfig};
use crate::workspace;

pub async fn run(args: StartArgs) -> u8 {
    let compiled = match workspace::load(&args.workspace) {
        Ok(compiled) => Arc::new(compiled),
        Err(diagnostics) => {
            output::error(&diagnostics.to_string());
            return exit::USAGE;
        }
    };
    let config = ServerConfig {
        workspace: Arc::clone(&compiled),
        host: args.host,
        port: args.port,
        database_url: args.database_url,
        api_keys: args.api_keys,
        admin_keys: args.admin_keys,
        insecure_open_surfaces: args.insecure_open_surfaces,
        metrics_public: args.metrics_public,
        watch: args.watch,
    };
    let app = match Application::build(config).await {
        Ok(app) => app,
        Err(error) => {
            output::error(&format!("stable-harness start: {error}"));
            // Refused exposure is a matter of flags and keys: bad usage, like an invalid workspace.
            return match error {
                AppError::OpenSurfacesOnPublicAddress { .. } => exit::USAGE,
                _ => exit::FAILED,
            };
        }
    };
    let agents: Vec<&str> = compiled.agents.keys().map(String::as_str).collect();
    let default = compiled
        .runtime
        .default_agent
        .as_deref()
        .map(|a| format!(" (default {a})"))
        .unwrap_or_default();
    let shutdown = shutdown_signal();
    output::print(&format!(
        "stable-harness listening on http://{} — store: {} — instance: {} — agents: {}{default}",
        app.address(),
        app.runtime().store().describe(),
        app.runtime().store().holder(),
        agents.join(", "),
    ));
    if app.keys().client.is_empty() {
        tracing::warn!(
            "NO CLIENT KEYS: /v1 and /runtime are open to anyone who can reach this address"
        );
    }
    if app.keys().admin.is_empty() {
        tracing::warn!("NO ADMIN KEYS: /admin is open to anyone who can reach this address");
    }
    if app.resumed_runs() > 0 {
        tracing::info!(
            runs = app.resumed_runs(),
            "resumed runs no instance was executing"
        );
    }
    match app.run_until(shutdown).await {
        Ok(()) => exit::OK,
        Err(error) => {
            output::error(&format!("stable-harness start: {error}"));
            exit::FAILED
        }
    }
}

/// Completes on SIGINT or SIGTERM. The handlers are installed when this is called, not when
/// the future is first polled: a signal sent right after the startup line is a clean stop.
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        async move {
            match (interrupt, terminate) {
                (Ok(mut interrupt), Ok(mut terminate)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
