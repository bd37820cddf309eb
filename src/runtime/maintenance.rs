//! The runtime's side of store maintenance: the retention policy compiled from the workspace,
//! the background pruning loop (`store.retention.every`), and the passes operators ask for
//! (`POST /admin/store/prune`, `POST /admin/store/backup`). One pass runs at a time.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::Runtime;
use crate::store::StoreError;
use crate::store::retention::{self, BackupReport, PruneReport, RetentionPolicy};
use crate::workspace::CompiledWorkspace;

/// How long after start the first background pass runs (the store is busiest resuming runs
/// right at start).
const FIRST_PASS_AFTER: Duration = Duration::from_secs(5);

/// The workspace's retention: `store.retention` with each agent's own window.
pub fn retention_policy(workspace: &CompiledWorkspace) -> RetentionPolicy {
    let retention = &workspace.runtime.retention;
    RetentionPolicy {
        default_window: retention.requests,
        agent_windows: workspace
            .agents
            .values()
            .filter_map(|agent| agent.retention.map(|window| (agent.name.clone(), window)))
            .collect(),
        min_keep: retention.min_keep,
        archive_dir: retention.archive_dir.clone(),
    }
}

impl Runtime {
    /// Starts the background pruning loop (the server does; one-shot commands like `run` and
    /// `store prune` never do). Each pass reads the retention of the workspace serving then,
    /// so a reload that sets, changes or removes a window takes effect at the next pass.
    pub fn start_retention(&self) {
        // The loop must not keep the runtime (and so the store) alive: it holds a weak
        // reference and ends once the runtime is gone or shutting down.
        let inner = Arc::downgrade(&self.inner);
        let shutdown = self.inner.admitting_stopped.clone();
        let mut wait = FIRST_PASS_AFTER.min(self.workspace().runtime.retention.every);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(wait) => {}
                }
                let Some(inner) = inner.upgrade() else { return };
                if shutdown.is_cancelled() {
                    return;
                }
                let runtime = Runtime { inner };
                let workspace = runtime.workspace();
                wait = workspace.runtime.retention.every;
                if retention_policy(&workspace).is_active() {
                    // A failed pass is logged and recorded; the next one tries again.
                    let _ = runtime.prune(false).await;
                }
            }
        });
    }

    /// One pruning pass now (dry: only counts what would go).
    pub async fn prune(&self, dry_run: bool) -> Result<PruneReport, StoreError> {
        let _one_at_a_time = self.inner.maintenance.lock().await;
        let policy = retention_policy(&self.workspace());
        retention::prune(self.inner.store.as_ref(), &policy, dry_run).await
    }

    /// A consistent copy of the store, written to the new file `file` while serving.
    pub async fn backup(&self, file: &Path) -> Result<BackupReport, StoreError> {
        let _one_at_a_time = self.inner.maintenance.lock().await;
        retention::backup(self.inner.store.as_ref(), file).await
    }
}
