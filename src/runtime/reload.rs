//! Hot reload (issue 11): the workspace is compiled again from disk and, only if it is valid,
//! swapped in whole with the gateway built from it. New requests start on the new inventory;
//! a run keeps the one it started with until it ends. Settings the running server was built
//! from (the store, keys and surfaces, run limits) cannot change in place: a workspace that
//! changes them is refused, nothing swapped, and the message says a restart applies them.
//! `start --watch` polls the workspace's files and reloads once they settle.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use chrono::Utc;

use super::{Inventory, Runtime};
use crate::gateway::ToolGateway;
use crate::redact::Redactor;
use crate::workspace::{self, CompiledWorkspace, Diagnostics};

/// How often `--watch` looks at the workspace's files, and how long they must stay unchanged
/// before a reload (an editor writes a file in several steps).
const WATCH_EVERY: Duration = Duration::from_secs(1);
const SETTLE: Duration = Duration::from_millis(500);
/// Most files `--watch` fingerprints (a workspace is a few dozen).
const WATCH_MAX_FILES: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("the workspace has {count} problem(s); the running inventory keeps serving:\n{diagnostics}", count = .0.len(), diagnostics = .0)]
    Invalid(Diagnostics),
    #[error(
        "these settings cannot change while the server runs (restart to apply them); the running inventory keeps serving: {}",
        .0.join(", ")
    )]
    NeedsRestart(Vec<String>),
    #[error("the workspace could not be read: {0}")]
    Failed(String),
}

/// What a reload swapped in.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Reloaded {
    pub loaded_at: chrono::DateTime<Utc>,
    pub compile_ms: f64,
    pub agents: Vec<String>,
    pub added_agents: Vec<String>,
    pub removed_agents: Vec<String>,
    pub tools: usize,
    pub models: usize,
}

/// The settings a running server was built from, by their YAML names.
fn restart_only(workspace: &CompiledWorkspace) -> Vec<(&'static str, String)> {
    let runtime = &workspace.runtime;
    vec![
        ("store.url", format!("{:?}", runtime.store_url)),
        (
            "store.leaseDuration",
            format!("{:?}", runtime.lease_duration),
        ),
        ("store.maxSize", format!("{:?}", runtime.store_max_bytes)),
        (
            "protocols.openai.enabled",
            runtime.openai.enabled.to_string(),
        ),
        (
            "protocols.openai.apiKeysEnv",
            format!("{:?}", runtime.openai.api_keys_env),
        ),
        (
            "protocols.openai.keys",
            format!("{:?}", runtime.openai.keys),
        ),
        (
            "protocols.admin.apiKeysEnv",
            format!("{:?}", runtime.admin_api_keys_env),
        ),
        ("protocols.admin.keys", format!("{:?}", runtime.admin_keys)),
        (
            "limits.maxConcurrentRuns",
            runtime.limits.max_concurrent_runs.to_string(),
        ),
        (
            "limits.maxParkedRuns",
            runtime.limits.max_parked_runs.to_string(),
        ),
        (
            "limits.keptHistoryBytes",
            runtime.limits.kept_history_bytes.to_string(),
        ),
        (
            "recovery.resumeOnStart",
            runtime.recovery.resume_on_start.to_string(),
        ),
    ]
}

impl Runtime {
    /// Compiles the workspace again from its folder and swaps it in if it is valid.
    pub async fn reload(&self) -> Result<Reloaded, ReloadError> {
        let _one_at_a_time = self.inner.reloading.lock().await;
        let root = self.workspace().root.clone();
        let loaded = tokio::task::spawn_blocking(move || workspace::load(&root))
            .await
            .map_err(|error| ReloadError::Failed(error.to_string()))?;
        let started = Utc::now();
        let result = match loaded {
            Ok(compiled) => self.swap(compiled),
            Err(diagnostics) => Err(ReloadError::Invalid(diagnostics)),
        };
        crate::store::retention::record(self.inner.store.as_ref(), "reload", started, &result)
            .await;
        match &result {
            Ok(reloaded) => tracing::info!(
                event = "runtime.workspace.reloaded",
                agents = reloaded.agents.len(),
                compile_ms = reloaded.compile_ms,
                "workspace reloaded"
            ),
            Err(error) => tracing::warn!(%error, "workspace reload refused"),
        }
        crate::metrics::workspace_reloaded(result.is_ok());
        result
    }

    /// Swaps `compiled` in, unless it changes a setting only a restart applies.
    fn swap(&self, compiled: CompiledWorkspace) -> Result<Reloaded, ReloadError> {
        let current = self.inventory();
        let changed: Vec<String> = restart_only(&current.workspace)
            .into_iter()
            .zip(restart_only(&compiled))
            .filter(|(old, new)| old.1 != new.1)
            .map(|(old, _)| old.0.to_owned())
            .collect();
        if !changed.is_empty() {
            return Err(ReloadError::NeedsRestart(changed));
        }
        let workspace = Arc::new(compiled);
        let redactor = Redactor::from_workspace(&workspace);
        // Runs of the old inventory still write: the journal redacts both sets of secrets.
        self.inner.journal.add_redactor(&redactor);
        let gateway = ToolGateway::new(
            Arc::clone(&workspace),
            Arc::clone(&self.inner.store),
            self.inner.http.clone(),
            Arc::clone(&self.inner.approvals),
            redactor,
        );
        let old: Vec<&String> = current.workspace.agents.keys().collect();
        let reloaded = Reloaded {
            loaded_at: workspace.loaded_at,
            compile_ms: workspace.compile_time.as_secs_f64() * 1000.0,
            agents: workspace.agents.keys().cloned().collect(),
            added_agents: workspace
                .agents
                .keys()
                .filter(|name| !old.contains(name))
                .cloned()
                .collect(),
            removed_agents: old
                .iter()
                .filter(|name| !workspace.agents.contains_key(name.as_str()))
                .map(|name| (*name).clone())
                .collect(),
            tools: workspace.tools.len(),
            models: workspace.models.len(),
        };
        let inventory = Arc::new(Inventory { workspace, gateway });
        match self.inner.inventory.write() {
            Ok(mut held) => *held = inventory,
            Err(poisoned) => *poisoned.into_inner() = inventory,
        }
        Ok(reloaded)
    }

    /// Reloads whenever the workspace's files change and then stay unchanged for a moment,
    /// until shutdown (`start --watch`). The files as they are now are the baseline, taken
    /// before this returns: a change made once the server serves is always seen (taken in
    /// the watching task instead, an edit made right after start could become the baseline
    /// and never be loaded).
    pub async fn watch_workspace(&self) {
        let runtime = self.clone();
        let stop = self.inner.leasing.clone();
        let root = runtime.workspace().root.clone();
        let mut seen = fingerprint(&root).await;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(WATCH_EVERY) => {}
                }
                let now = fingerprint(&root).await;
                if now == seen {
                    continue;
                }
                // Changed: wait until it stays put, then reload once.
                let mut settled = now;
                loop {
                    tokio::time::sleep(SETTLE).await;
                    let again = fingerprint(&root).await;
                    if again == settled {
                        break;
                    }
                    settled = again;
                }
                seen = settled;
                // A refused reload is logged and recorded; the next change tries again.
                let _ = runtime.reload().await;
            }
        });
    }
}

/// Every file under the workspace (its store folder and hidden entries aside) with its size
/// and modification time.
async fn fingerprint(root: &std::path::Path) -> Vec<(std::path::PathBuf, u64, Option<SystemTime>)> {
    let root = root.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut files = Vec::new();
        let mut folders = vec![root];
        while let Some(folder) = folders.pop() {
            let Ok(entries) = std::fs::read_dir(&folder) else {
                continue;
            };
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with('.') {
                    continue;
                }
                let Ok(meta) = entry.metadata() else { continue };
                if meta.is_dir() {
                    folders.push(entry.path());
                } else if files.len() < WATCH_MAX_FILES {
                    files.push((entry.path(), meta.len(), meta.modified().ok()));
                }
            }
        }
        files.sort();
        files
    })
    .await
    .unwrap_or_default()
}
