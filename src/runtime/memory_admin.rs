//! The operators' side of memory (SPEC section 6, issue 12): deciding pending records, and
//! the maintenance passes `compact` and `import` (`export` is read straight off the store).
//! Each pass is announced as `runtime.memory.maintenance.started` / `.completed` / `.failed`
//! (log records with that `event` field) and recorded with the other maintenance passes.

use chrono::Utc;
use serde::Serialize;

use super::Runtime;
use crate::memory::transfer::{self, LineError};
use crate::store::retention;
use crate::store::{CompactReport, MemoryRecord, MemoryStatus, MemoryTransition, StoreError};

/// Why a memory operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum MemoryAdminError {
    #[error("memory record `{0}` not found")]
    NotFound(String),
    #[error("memory record `{id}` is {status}; only a pending record is decided")]
    NotPending { id: String, status: &'static str },
    #[error("{} line(s) cannot be imported; nothing was imported: {}", .0.len(), describe(.0))]
    InvalidLines(Vec<LineError>),
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn describe(errors: &[LineError]) -> String {
    let mut text: Vec<String> = errors
        .iter()
        .take(20)
        .map(|e| format!("line {}: {}", e.line, e.message))
        .collect();
    if errors.len() > 20 {
        text.push(format!("and {} more", errors.len() - 20));
    }
    text.join("; ")
}

/// What an import did.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImportReport {
    /// Records written (new or merged).
    pub imported: u64,
    /// Of those, exact duplicates merged into records the store had.
    pub merged: u64,
    /// Lines left out (only with `skipInvalid`).
    pub skipped: Vec<LineError>,
}

impl Runtime {
    /// Approves (`active`) or rejects a pending record.
    pub async fn decide_memory(
        &self,
        id: &str,
        approve: bool,
        by: &str,
    ) -> Result<MemoryRecord, MemoryAdminError> {
        let to = if approve {
            MemoryStatus::Active
        } else {
            MemoryStatus::Rejected
        };
        let decided = self
            .inner
            .store
            .set_memory_status(id, &[MemoryStatus::Pending], to, by, Utc::now())
            .await?;
        match decided {
            MemoryTransition::Changed(record) => {
                tracing::info!(memory_id = %id, status = to.as_str(), by, "memory record decided");
                Ok(*record)
            }
            MemoryTransition::Refused(status) => Err(MemoryAdminError::NotPending {
                id: id.to_owned(),
                status: status.as_str(),
            }),
            MemoryTransition::NotFound => Err(MemoryAdminError::NotFound(id.to_owned())),
        }
    }

    /// Archives near-duplicates (the newest stays) and records older than `memory.ttl`.
    pub async fn compact_memory(
        &self,
        namespace: Option<&str>,
    ) -> Result<CompactReport, MemoryAdminError> {
        let ttl = self.workspace().runtime.memory.ttl;
        let now = Utc::now();
        let expire_before =
            ttl.and_then(|ttl| chrono::Duration::from_std(ttl).ok().map(|ttl| now - ttl));
        self.memory_pass("compact", async {
            Ok(self
                .inner
                .store
                .compact_memories(namespace, expire_before, now)
                .await?)
        })
        .await
    }

    /// Imports JSON Lines: every line is checked first; with a bad line nothing is imported
    /// unless `skip_invalid`, which leaves the bad lines out and reports them.
    pub async fn import_memory(
        &self,
        text: &str,
        skip_invalid: bool,
    ) -> Result<ImportReport, MemoryAdminError> {
        let max = self.workspace().runtime.memory.max_content_bytes;
        self.memory_pass("import", async {
            let (records, errors) = transfer::parse_import(text, max);
            if !errors.is_empty() && !skip_invalid {
                return Err(MemoryAdminError::InvalidLines(errors));
            }
            let merged = self.inner.store.import_memories(&records).await?;
            Ok(ImportReport {
                imported: records.len() as u64,
                merged,
                skipped: errors,
            })
        })
        .await
    }

    /// Runs one memory maintenance pass: one at a time, announced and recorded.
    pub(crate) async fn memory_pass<T: Serialize>(
        &self,
        operation: &str,
        pass: impl Future<Output = Result<T, MemoryAdminError>>,
    ) -> Result<T, MemoryAdminError> {
        let _one_at_a_time = self.inner.maintenance.lock().await;
        let started = Utc::now();
        tracing::info!(
            event = "runtime.memory.maintenance.started",
            operation,
            "memory maintenance"
        );
        let result = pass.await;
        match &result {
            Ok(_) => tracing::info!(
                event = "runtime.memory.maintenance.completed",
                operation,
                "memory maintenance"
            ),
            Err(error) => {
                tracing::warn!(event = "runtime.memory.maintenance.failed", operation, %error, "memory maintenance")
            }
        }
        let name = format!("memory.{operation}");
        retention::record(self.inner.store.as_ref(), &name, started, &result).await;
        result
    }
}
