//! Runs owned through leases (SPEC section 8), the runtime's side.
//!
//! The store leases a run to the instance that inserts it. This module keeps those leases.
//! Every third of `store.leaseDuration` (at most 10 s) it renews the leases of the runs here
//! in one statement and hands over any run here whose lease another instance holds now (the
//! run stops without another write; the store fences its writes anyway), or every run when
//! renewals have failed for two thirds of a lease. Every second it claims the runs nobody
//! executes — left by a crashed instance once their lease expired, given back by one that
//! shut down, or interrupted on the embedded store — to resume them from their persisted
//! state with the trust rules for interrupted tool calls.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{Runtime, RuntimeError, Submitted, request_start, run};
use crate::store::{RunRecord, RunStatus};

/// Bounds of the interval between two lease passes.
const MIN_TICK: Duration = Duration::from_millis(100);
const MAX_TICK: Duration = Duration::from_secs(10);
/// How often runs nobody executes are looked for (a run given back at shutdown is taken over
/// within this).
const CLAIM_EVERY: Duration = Duration::from_secs(1);
/// Most runs claimed in one pass.
const MAX_CLAIM: usize = 256;

impl Runtime {
    /// Starts keeping this instance's leases, and with `claim`, taking over runs nobody
    /// executes (`recovery.resumeOnStart`; one-shot commands like `run` never claim). The
    /// loop ends at shutdown, when the leases are given back.
    pub fn start_leases(&self, claim: bool) {
        let workspace = self.workspace();
        let claim = claim && workspace.runtime.recovery.resume_on_start;
        let lease = workspace.runtime.lease_duration;
        let renew_every = (lease / 3).clamp(MIN_TICK, MAX_TICK);
        let tick = renew_every.min(CLAIM_EVERY);
        let inner = Arc::downgrade(&self.inner);
        let stop = self.inner.leasing.clone();
        tokio::spawn(async move {
            let mut renewed = Instant::now();
            let mut last_pass = Instant::now();
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(tick) => {}
                }
                let Some(inner) = inner.upgrade() else { return };
                let runtime = Runtime { inner };
                if last_pass.elapsed() >= renew_every {
                    last_pass = Instant::now();
                    runtime.keep_leases(&mut renewed, lease).await;
                }
                if claim
                    && !runtime.inner.admitting_stopped.is_cancelled()
                    && let Err(error) = runtime.claim_runs().await
                {
                    tracing::warn!(%error, "could not claim runs left without an instance");
                }
            }
        });
    }

    /// Renews the leases of the runs here and hands over those whose lease is gone. When
    /// renewals have failed for two thirds of a lease, every run here is handed over: their
    /// leases may expire before the database answers again, and another instance may take
    /// them.
    async fn keep_leases(&self, renewed: &mut Instant, lease: Duration) {
        let inner = &self.inner;
        let live: Vec<String> = match inner.live.lock() {
            Ok(live) => live.values().map(|run| run.run_id.clone()).collect(),
            Err(_) => return,
        };
        let sent = Instant::now();
        let held: HashSet<String> = match inner.store.renew_leases(&live).await {
            Ok(held) => {
                *renewed = sent;
                held.into_iter().collect()
            }
            Err(error) => {
                tracing::warn!(%error, "could not renew run leases");
                if renewed.elapsed() > lease * 2 / 3 {
                    tracing::error!(
                        "run leases could not be renewed in time; handing every run here over"
                    );
                    self.hand_over_live_runs();
                }
                return;
            }
        };
        // Cancels asked on another instance (announced too; this catches a lost announcement).
        match inner.store.cancels_requested(&live).await {
            Ok(cancels) => {
                for (run_id, by) in cancels {
                    self.cancel_live_run(&run_id, &by);
                }
            }
            Err(error) => tracing::warn!(%error, "could not read cancels asked of runs here"),
        }
        for run_id in live.into_iter().filter(|run| !held.contains(run)) {
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
                if let Ok(live) = inner.live.lock()
                    && let Some(run) = live.values().find(|run| run.run_id == run_id)
                {
                    run.hand_over();
                }
            }
        }
    }

    /// Stops every run here without a write (see `LiveRun::hand_over`).
    pub(super) fn hand_over_live_runs(&self) {
        if let Ok(live) = self.inner.live.lock() {
            for run in live.values() {
                run.hand_over();
            }
        }
    }

    /// Claims the runs nobody executes, as many as admission allows, and starts them. Returns
    /// how many started.
    pub async fn claim_runs(&self) -> Result<usize, RuntimeError> {
        let inner = &self.inner;
        // As many as admission lets this instance start now; a claimed run that finds no
        // permit after all is left to expire and be claimed again.
        let free = inner.admission.available_permits().min(MAX_CLAIM);
        if free == 0 {
            return Ok(0);
        }
        let claimed = inner.store.claim_runs(free as i64).await?;
        let mut started = 0;
        for run in claimed {
            // Ours already (its lease expired while the store could not be reached).
            if self.is_live(&run.request_id) {
                continue;
            }
            let Ok(permit) = Arc::clone(&inner.admission).try_acquire_owned() else {
                break;
            };
            inner.journal.forgive(&run.request_id).await?;
            if self.resume_run(run, Some(permit)).await? {
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
    pub(super) async fn resume_run(
        &self,
        mut run: RunRecord,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<bool, RuntimeError> {
        let store = &self.inner.store;
        let Some(request) = store.request(&run.request_id).await? else {
            return Ok(false);
        };
        let (input, parent_message_id) =
            request_start(store.as_ref(), &self.inner.histories, &request).await?;
        // A workflow node's run: its agent and input come from its place in the workflow.
        let node = run
            .state
            .as_ref()
            .and_then(super::workflow::NodeJob::from_state);
        let workspace = self.workspace();
        let step = node.as_ref().and_then(|job| {
            workspace
                .workflows
                .get(&job.workflow)
                .and_then(|w| w.node(&job.node))
        });
        let (agent_id, own_from) = match (&node, step.and_then(super::workflow::node_agent)) {
            (Some(job), Some(agent)) => (agent.to_owned(), step.map_or(0, |s| job.input(s).len())),
            (Some(_), None) => (request.agent_id.clone(), 0),
            (None, _) => (request.agent_id.clone(), input.len()),
        };
        let (messages, cannot_resume) = match run::resumed_transcript(input, run.state.take()) {
            Ok(messages) => (messages, None),
            Err(reason) => {
                tracing::error!(request_id = %request.id, run_id = %run.id, %reason, "a run cannot resume");
                (crate::adapters::Transcript::default(), Some(reason))
            }
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
                agent_id,
                status: RunStatus::Queued,
            },
            messages,
            own_from,
            options,
            client: super::ClientTurn::stored_in(&request.input),
            node,
            parent_message_id,
            metadata: request.metadata.clone(),
            owner: request.owner.clone(),
            charge_session: super::charge_session(
                &request.protocol,
                &request.metadata,
                &request.session_id,
            ),
            resumed: true,
            attempt: run.attempt,
            cancel_by: run.cancel_requested_by.clone(),
            cannot_resume,
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
