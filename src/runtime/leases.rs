//! Runs owned through leases (SPEC section 8), the runtime's side.
//!
//! The store leases a run to the instance that inserts it. This module keeps those leases:
//! every third of `store.leaseDuration` it renews them all in one statement, stops any run
//! here whose lease another instance holds now (its writes are fenced by the store anyway),
//! and claims runs nobody executes — left by a crashed instance once their lease expired,
//! given back by one that shut down, or interrupted on the embedded store — to resume them
//! from their persisted state with the trust rules for interrupted tool calls.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::{Runtime, RuntimeError, Submitted, input_messages, run};
use crate::store::{RunRecord, RunStatus};

/// Bounds of the interval between two lease passes.
const MIN_TICK: Duration = Duration::from_millis(100);
const MAX_TICK: Duration = Duration::from_secs(10);

impl Runtime {
    /// Starts keeping this instance's leases, and with `claim`, taking over runs nobody
    /// executes (`recovery.resumeOnStart`; one-shot commands like `run` never claim). The
    /// loop ends at shutdown, when the leases are given back.
    pub fn start_leases(&self, claim: bool) {
        let claim = claim && self.inner.workspace.runtime.recovery.resume_on_start;
        let tick = (self.inner.workspace.runtime.lease_duration / 3).clamp(MIN_TICK, MAX_TICK);
        let inner = Arc::downgrade(&self.inner);
        let stop = self.inner.leasing.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(tick) => {}
                }
                let Some(inner) = inner.upgrade() else { return };
                let runtime = Runtime { inner };
                runtime.keep_leases().await;
                if claim
                    && !runtime.inner.admitting_stopped.is_cancelled()
                    && let Err(error) = runtime.claim_runs().await
                {
                    tracing::warn!(%error, "could not claim runs left without an instance");
                }
            }
        });
    }

    /// Renews this instance's leases and stops the runs here whose lease is gone.
    async fn keep_leases(&self) {
        let inner = &self.inner;
        let held: HashSet<String> = match inner.store.renew_leases().await {
            Ok(held) => held.into_iter().collect(),
            Err(error) => {
                tracing::warn!(%error, "could not renew run leases");
                return;
            }
        };
        let live: Vec<(String, tokio_util::sync::CancellationToken)> = match inner.live.lock() {
            Ok(live) => live
                .values()
                .filter(|run| !held.contains(&run.run_id))
                .map(|run| (run.run_id.clone(), run.cancel.clone()))
                .collect(),
            Err(_) => return,
        };
        for (run_id, cancel) in live {
            // Not renewed: either not committed yet (a run just submitted), ended, or taken.
            let Ok(Some(record)) = inner.store.run(&run_id).await else {
                continue;
            };
            let ours = record
                .lease
                .as_ref()
                .is_some_and(|lease| lease.holder == inner.store.holder());
            if !record.status.is_terminal() && !ours {
                tracing::warn!(%run_id, "another instance holds this run's lease now; stopping it here");
                cancel.cancel();
            }
        }
    }

    /// Claims the runs nobody executes, as many as admission allows, and starts them. Returns
    /// how many started.
    pub async fn claim_runs(&self) -> Result<usize, RuntimeError> {
        let inner = &self.inner;
        // Admission first: a run claimed is a run this instance starts now.
        let mut permits = Vec::new();
        while let Ok(permit) = Arc::clone(&inner.admission).try_acquire_owned() {
            permits.push(permit);
            if permits.len() >= 256 {
                break;
            }
        }
        if permits.is_empty() {
            return Ok(0);
        }
        let claimed = inner.store.claim_runs(permits.len() as i64).await?;
        let mut started = 0;
        for run in claimed {
            // Ours already (its lease expired while the store could not be reached).
            if self.is_live(&run.request_id) {
                continue;
            }
            let Some(permit) = permits.pop() else { break };
            self.inner.journal.forgive(&run.request_id).await?;
            if self.resume_run(run, permit).await? {
                started += 1;
            }
        }
        Ok(started)
    }

    fn is_live(&self, request_id: &str) -> bool {
        self.inner
            .live
            .lock()
            .map(|live| live.contains_key(request_id))
            .unwrap_or(true)
    }

    /// Starts a claimed run from its persisted state: the conversation at its last checkpoint
    /// (or its input), with its events continuing the request's sequence.
    async fn resume_run(
        &self,
        run: RunRecord,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<bool, RuntimeError> {
        let store = &self.inner.store;
        let Some(request) = store.request(&run.request_id).await? else {
            return Ok(false);
        };
        let history = store.messages(&request.session_id).await?;
        let input = input_messages(&request.id, &request.input, &history);
        let own_from = input.len();
        let messages = match run
            .state
            .as_ref()
            .and_then(|state| state.get("messages"))
            .and_then(Value::as_array)
        {
            Some(checkpoint) => checkpoint.clone(),
            None => input,
        };
        let options = request
            .input
            .get("options")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        tracing::info!(request_id = %request.id, run_id = %run.id, "resuming a run no instance executes");
        self.start_run(run::RunJob {
            submitted: Submitted {
                request_id: request.id.clone(),
                run_id: run.id.clone(),
                session_id: request.session_id.clone(),
                agent_id: request.agent_id.clone(),
                status: RunStatus::Queued,
            },
            messages,
            own_from,
            options,
            parent_message_id: history.last().map(|m| m.id.clone()),
            metadata: request.metadata.clone(),
            owner: request.owner.clone(),
            resumed: true,
            permit,
            slot: None,
        });
        Ok(true)
    }

    /// Gives this instance's leases back (at shutdown, after the last commit), so another
    /// instance resumes the runs at once instead of after their lease expires.
    pub(super) async fn release_leases(&self) {
        self.inner.leasing.cancel();
        match self.inner.store.release_leases().await {
            Ok(0) => {}
            Ok(released) => tracing::info!(released, "gave the leases of unfinished runs back"),
            Err(error) => {
                tracing::warn!(%error, "could not give leases back; they expire by themselves");
            }
        }
    }
}
