//! Waiting on a durable approval. The approval lives in the store; a decision taken in this
//! process wakes its waiter at once through [`ApprovalWaiters`], one taken on another instance
//! through the store's announcement of its event, and the waiter always re-reads the store,
//! which is the only source of truth. On a store several instances share, the waiter also
//! reads it every few seconds, so a lost announcement costs latency, never the decision.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::Utc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::store::{ApprovalDecision, ApprovalRecord, ApprovalStatus, Store};

/// Wake-ups for calls waiting on approvals, by approval id (with the approval's request).
#[derive(Debug, Default)]
pub struct ApprovalWaiters {
    waiting: Mutex<HashMap<String, (String, Arc<Notify>)>>,
}

impl ApprovalWaiters {
    fn register(&self, approval: &ApprovalRecord) -> Arc<Notify> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let (_, notify) = waiting
            .entry(approval.id.clone())
            .or_insert_with(|| (approval.request_id.clone(), Arc::default()));
        Arc::clone(notify)
    }

    fn release(&self, approval_id: &str) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.remove(approval_id);
    }

    /// Wakes whoever waits on `approval_id` (it then reads the decision from the store).
    pub fn notify(&self, approval_id: &str) {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, notify)) = waiting.get(approval_id) {
            notify.notify_waiters();
        }
    }

    /// Wakes whoever waits on an approval of `request_id` (another instance wrote to it).
    pub fn notify_request(&self, request_id: &str) {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        for (request, notify) in waiting.values() {
            if request == request_id {
                notify.notify_waiters();
            }
        }
    }

    /// Wakes every waiter (announcements may have been missed).
    pub fn notify_all(&self) {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        for (_, notify) in waiting.values() {
            notify.notify_waiters();
        }
    }
}

/// Waits until the approval is no longer pending and returns it as decided. When it expires
/// first, this side marks it `expired` (unless a decision wins the race). `Err` when the run
/// is cancelled meanwhile or the store cannot be read.
pub(super) async fn wait_for_decision(
    store: &dyn Store,
    host: &dyn super::RunHost,
    waiters: &ApprovalWaiters,
    approval: &ApprovalRecord,
    cancel: &CancellationToken,
) -> Result<ApprovalRecord, String> {
    let notify = waiters.register(approval);
    let poll = store.is_shared();
    let result = async {
        loop {
            // Armed before reading, so a decision committed after the read still wakes us.
            let woken = notify.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let current = store
                .approval(&approval.id)
                .await
                .map_err(|error| format!("the approval could not be read: {error}"))?
                .unwrap_or_else(|| approval.clone());
            if current.status != ApprovalStatus::Pending {
                return Ok(current);
            }
            let until_expiry = current
                .expires_at
                .map(|at| (at - Utc::now()).to_std().unwrap_or_default());
            let expiry = async {
                match until_expiry {
                    Some(delay) => tokio::time::sleep(delay).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut woken => {}
                () = tokio::time::sleep(crate::store::SHARED_POLL), if poll => {}
                () = cancel.cancelled() => return Err("the run was cancelled while the call waited for approval".to_owned()),
                () = expiry => {
                    let decision = ApprovalDecision {
                        id: approval.id.clone(),
                        status: ApprovalStatus::Expired,
                        reason: Some("nobody decided before the approval timeout".to_owned()),
                        decided_by: "system:timeout".to_owned(),
                        at: Utc::now(),
                    };
                    // Through the run's journal: the row and its event commit together; losing
                    // the race to an operator's decision is fine (the loop reads it).
                    host.decide(&current, decision)
                        .await
                        .map_err(|error| format!("the approval could not be expired: {error}"))?;
                }
            }
        }
    }
    .await;
    waiters.release(&approval.id);
    result
}
