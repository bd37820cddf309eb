//! `stable-harness store prune|backup`: the store's maintenance from the command line.
//!
//! `prune` takes the store like `run` does, so it refuses while a server holds it (the server
//! prunes by itself, and `POST /admin/store/prune` asks it to now). `backup` only reads: it
//! works beside a running server, from one consistent snapshot.

use std::sync::Arc;

use super::{BackupArgs, PruneArgs, exit, output};
use crate::app::build_runtime;
use crate::store::{self, StoreError};
use crate::workspace;

pub async fn prune(args: PruneArgs) -> u8 {
    let compiled = match workspace::load(&args.workspace) {
        Ok(compiled) => Arc::new(compiled),
        Err(diagnostics) => {
            output::error(&diagnostics.to_string());
            return exit::USAGE;
        }
    };
    let every = compiled.runtime.retention.every;
    let (runtime, _) = match build_runtime(compiled, args.database_url.as_deref(), false, None)
        .await
    {
        Ok(built) => built,
        Err(crate::app::AppError::Store(StoreError::InUse(path))) => {
            output::error(&format!(
                "stable-harness store prune: a running server holds {path}; it prunes by itself every {}s, and `POST /admin/store/prune` asks it to now",
                every.as_secs()
            ));
            return exit::FAILED;
        }
        Err(error) => {
            output::error(&format!("stable-harness store prune: {error}"));
            return exit::FAILED;
        }
    };
    let report = runtime.prune(args.dry_run).await;
    runtime.shutdown(std::time::Duration::from_secs(1)).await;
    match report {
        Ok(report) if args.json => {
            output::print(&serde_json::to_string_pretty(&report).unwrap_or_default());
            exit::OK
        }
        Ok(report) => {
            let removed = &report.removed;
            let verb = if report.dry_run {
                "would remove"
            } else {
                "removed"
            };
            output::print(&format!(
                "{verb}: {} sessions, {} requests, {} runs, {} events, {} tool calls, {} approvals, {} messages",
                removed.sessions,
                removed.requests,
                removed.runs,
                removed.events,
                removed.tool_calls,
                removed.approvals,
                removed.messages
            ));
            if let Some(file) = &report.archive_file {
                output::print(&format!(
                    "archived {} sessions to {file}",
                    report.archived_sessions
                ));
            }
            if !report.dry_run {
                output::print(&format!(
                    "gave back {} bytes to the filesystem in {} ms",
                    report.reclaimed_bytes, report.took_ms
                ));
            }
            exit::OK
        }
        Err(error) => {
            output::error(&format!("stable-harness store prune: {error}"));
            exit::FAILED
        }
    }
}

pub async fn backup(args: BackupArgs) -> u8 {
    let url = match args.database_url {
        Some(url) => Some(url),
        None => match workspace::load(&args.workspace) {
            Ok(compiled) => compiled.runtime.store_url.clone(),
            Err(diagnostics) => {
                output::error(&diagnostics.to_string());
                return exit::USAGE;
            }
        },
    };
    if url.as_deref().is_some_and(store::is_postgres) {
        output::error(
            "stable-harness store backup: back a PostgreSQL store up with pg_dump (or the database's own backups)",
        );
        return exit::FAILED;
    }
    let result = match store::sqlite_path(url.as_deref(), &args.workspace) {
        Ok(database) => store::SqliteStore::backup_file(&database, &args.to).await,
        Err(error) => Err(error),
    };
    match result {
        Ok(bytes) => {
            output::print(&format!("backup: {} ({bytes} bytes)", args.to.display()));
            exit::OK
        }
        Err(error) => {
            output::error(&format!("stable-harness store backup: {error}"));
            exit::FAILED
        }
    }
}
