//! Steering (SPEC section 6, issue 11): an operator or a request's owner cancels a request, an
//! operator retries one, a client forks a session at any message.
//!
//! A cancel reaches the run wherever it executes. Here, its cancellation signal fires at once:
//! the upstream call is dropped, a tool's process group is killed, a wait on an approval or a
//! slot ends, and the run ends `cancelled` with its pending approvals `cancelled`. On another
//! instance, the store marks the run and announces it; the holder stops it when it hears (or
//! at its next lease renewal, should the announcement be lost). A run nobody executes is
//! claimed here and ended at once.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use serde_json::{Value, json};

use super::{
    Runtime, RuntimeError, Submitted, new_id, request_start,
    run::{self},
};
use crate::store::{RequestRecord, RunRecord, RunStatus, SessionRecord, WriteOp};

/// How long a cancel waits for the run to end before answering with the state it is in.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// The session and message a forked session branched from (its metadata's `forkedFrom`).
pub(super) fn forked_from(session: &SessionRecord) -> Option<(&str, &str)> {
    let origin = session.metadata.get("forkedFrom")?;
    Some((
        origin.get("sessionId")?.as_str()?,
        origin.get("messageId")?.as_str()?,
    ))
}

impl Runtime {
    /// Stops a run if it executes here, on a stored cancel mark (asked here or elsewhere);
    /// true when it does.
    pub(super) fn cancel_live_run(&self, run_id: &str, by: &str) -> bool {
        let Ok(live) = self.inner.live.lock() else {
            return false;
        };
        let run = live.values().find(|run| run.run_id == run_id);
        if let Some(run) = run {
            run.cancel(by);
        }
        run.is_some()
    }

    /// Cancels a request: its live run stops and ends `cancelled`, its pending approvals end
    /// `cancelled`. `owner` limits it to that key's requests (others are not found). Returns
    /// the request once it ended, or as it is after a bounded wait.
    pub async fn cancel(
        &self,
        request_id: &str,
        owner: Option<&str>,
        by: &str,
    ) -> Result<RequestRecord, RuntimeError> {
        // The request may have been accepted a moment ago: what is queued reaches the store.
        self.inner.journal.flush().await?;
        let request = self.owned_request(request_id, owner).await?;
        if request.status.is_terminal() {
            return Err(RuntimeError::RequestEnded {
                id: request.id,
                status: request.status.as_str(),
            });
        }
        // The mark is stored first, wherever the run executes: a run handed over or resumed
        // elsewhere before it heard still ends cancelled.
        let run = self.latest_run(request_id).await?;
        let store = &self.inner.store;
        if !store.request_cancel(&run.id, by).await? {
            return Err(self.ended(request_id, owner).await);
        }
        if !self.cancel_live_run(&run.id, by) {
            // Nobody executes it (an instance died, or resuming is off): end it here. Else its
            // holder heard the announcement.
            if let Some(claimed) = store.claim_run(&run.id).await? {
                self.inner.journal.forgive(request_id).await?;
                self.resume_run(claimed, None).await?;
            }
        }
        let request = self.wait_until_ended(request_id, CANCEL_WAIT).await?;
        // The run finished on its own before it heard: the cancel came too late.
        if request.status.is_terminal() && request.status != RunStatus::Cancelled {
            return Err(RuntimeError::RequestEnded {
                id: request.id,
                status: request.status.as_str(),
            });
        }
        Ok(request)
    }

    /// The refusal for a request that ended before a cancel reached it.
    async fn ended(&self, request_id: &str, owner: Option<&str>) -> RuntimeError {
        match self.owned_request(request_id, owner).await {
            Ok(ended) => RuntimeError::RequestEnded {
                id: ended.id,
                status: ended.status.as_str(),
            },
            Err(error) => error,
        }
    }

    /// Starts a new run of a failed or cancelled request: attempt + 1, its events continuing
    /// the request's `seq`, from the request's input (and its session history as it was).
    pub async fn retry(&self, request_id: &str, by: &str) -> Result<Submitted, RuntimeError> {
        let inner = &self.inner;
        if inner.admitting_stopped.is_cancelled() {
            return Err(RuntimeError::ShuttingDown);
        }
        if !inner.journal.is_available() {
            return Err(RuntimeError::StoreUnavailable);
        }
        let _one_at_a_time = inner.retrying.lock().await;
        inner.journal.flush().await?;
        let request = self.owned_request(request_id, None).await?;
        if !matches!(request.status, RunStatus::Failed | RunStatus::Cancelled) {
            return Err(RuntimeError::NotRetryable {
                id: request.id,
                status: request.status.as_str(),
            });
        }
        if request.input.get("workflow").is_some() {
            return Err(RuntimeError::NotRetryable {
                id: request.id,
                status: "a workflow's (submit it again)",
            });
        }
        let workspace = self.workspace();
        if !workspace.agents.contains_key(&request.agent_id) {
            return Err(RuntimeError::AgentNotFound(request.agent_id));
        }
        let permit = Arc::clone(&inner.admission)
            .try_acquire_owned()
            .map_err(|_| RuntimeError::Busy {
                running: workspace.runtime.limits.max_concurrent_runs,
            })?;
        let previous = self.latest_run(request_id).await?;
        let (messages, parent_message_id) =
            request_start(inner.store.as_ref(), &inner.histories, &request).await?;
        let now = Utc::now();
        let run_id = new_id("run");
        let attempt = previous.attempt.saturating_add(1);
        let ops = vec![
            WriteOp::InsertRun(RunRecord::new(
                run_id.clone(),
                request.id.clone(),
                attempt,
                RunStatus::Queued,
                now,
            )),
            WriteOp::UpdateRequest {
                id: request.id.clone(),
                status: RunStatus::Queued,
                output: None,
                error: None,
                usage: None,
                at: now,
            },
        ];
        match inner.journal.commit(Some(&request.id), ops).await {
            Ok(()) => {}
            // Another instance retried it first (the attempt number is taken).
            Err(super::JournalError::Rejected(_) | super::JournalError::Conflict(_)) => {
                // The refused batch must not keep the request's later writes out.
                inner.journal.forgive(&request.id).await?;
                return Err(RuntimeError::NotRetryable {
                    id: request.id,
                    status: "being retried",
                });
            }
            Err(error) => return Err(error.into()),
        }
        tracing::info!(request_id = %request.id, %run_id, attempt, by, "retrying a request");
        let submitted = Submitted {
            request_id: request.id.clone(),
            run_id,
            session_id: request.session_id.clone(),
            agent_id: request.agent_id.clone(),
            status: RunStatus::Queued,
        };
        let own_from = messages.len();
        self.start_run(run::RunJob {
            submitted: submitted.clone(),
            messages,
            own_from,
            options: request
                .input
                .get("options")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
            client: super::ClientTurn::stored_in(&request.input),
            node: None,
            parent_message_id,
            charge_session: super::charge_session(
                &request.protocol,
                &request.metadata,
                &request.session_id,
            ),
            metadata: request.metadata,
            owner: request.owner,
            resumed: false,
            attempt,
            cancel_by: None,
            cannot_resume: None,
            permit: Some(permit),
            slot: None,
        });
        Ok(submitted)
    }

    /// Makes a new session of the same owner and agent whose history is `session_id`'s up to
    /// and including `at_message_id`; a request on it continues from there.
    pub async fn fork_session(
        &self,
        session_id: &str,
        at_message_id: &str,
        owner: Option<&str>,
    ) -> Result<SessionRecord, RuntimeError> {
        let inner = &self.inner;
        if !inner.journal.is_available() {
            return Err(RuntimeError::StoreUnavailable);
        }
        let session = self.owned_session(session_id, owner).await?;
        let not_in_history = || RuntimeError::MessageNotFound {
            session: session_id.to_owned(),
            message: at_message_id.to_owned(),
        };
        let message = inner
            .store
            .message(at_message_id)
            .await?
            .ok_or_else(not_in_history)?;
        // The message is the session's own, or on the shared path of the session it was
        // forked from (a fork of a fork).
        if message.session_id != session.id {
            let shared = match forked_from(&session) {
                Some((_, at)) => inner.store.message_path(at).await?,
                None => Vec::new(),
            };
            if !shared.iter().any(|m| m.id == message.id) {
                return Err(not_in_history());
            }
        }
        let now = Utc::now();
        let fork = SessionRecord {
            id: new_id("ses"),
            agent_id: session.agent_id.clone(),
            owner: session.owner.clone(),
            metadata: json!({ "forkedFrom": { "sessionId": session.id, "messageId": message.id } }),
            created_at: now,
            updated_at: now,
        };
        inner
            .journal
            .commit(None, vec![WriteOp::TouchSession(fork.clone())])
            .await?;
        Ok(fork)
    }

    /// A request, if `owner` (when given) owns it; another key's request is not found.
    pub async fn owned_request(
        &self,
        request_id: &str,
        owner: Option<&str>,
    ) -> Result<RequestRecord, RuntimeError> {
        match self.inner.store.request(request_id).await? {
            Some(request) if owner.is_none_or(|owner| owner == request.owner) => Ok(request),
            _ => Err(RuntimeError::RequestNotFound(request_id.to_owned())),
        }
    }

    /// A session, if `owner` (when given) owns it.
    pub async fn owned_session(
        &self,
        session_id: &str,
        owner: Option<&str>,
    ) -> Result<SessionRecord, RuntimeError> {
        match self.inner.store.session(session_id).await? {
            Some(session) if owner.is_none_or(|owner| owner == session.owner) => Ok(session),
            _ => Err(RuntimeError::SessionNotFound(session_id.to_owned())),
        }
    }

    /// The history a session's next request continues: the path from its newest leaf, or for
    /// a fork with none of its own yet, from the message it was forked at.
    pub async fn session_history(
        &self,
        session: &SessionRecord,
    ) -> Result<Vec<crate::store::MessageRecord>, RuntimeError> {
        let store = self.inner.store.as_ref();
        if let Some((_, path)) = store.session_path_below(&session.id, None).await? {
            return Ok(path.messages);
        }
        match forked_from(session) {
            Some((_, message)) => Ok(store.message_path(message).await?),
            None => Ok(Vec::new()),
        }
    }

    async fn latest_run(&self, request_id: &str) -> Result<RunRecord, RuntimeError> {
        self.inner
            .store
            .runs_of(request_id)
            .await?
            .pop()
            .ok_or_else(|| RuntimeError::RequestNotFound(request_id.to_owned()))
    }
}
