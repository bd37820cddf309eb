//! One run, from its slot to its terminal event. Every step is written through the journal:
//! status changes, events (numbered by the journal, gapless), the conversation state after
//! each step, tool call records and approvals, and at the end statuses, the assistant message
//! and the terminal event in one transaction. The steps that must be durable before the run
//! goes on — a model turn's checkpoint, a tool call's start and its result, an approval — are
//! committed and waited for; if one cannot be committed the run stops and fails (kind
//! `store`) instead of carrying on past a lost write. The run's tools go through the gateway
//! bound to this run ([`RunTools`]); while a call waits on an approval the run is
//! `waiting_approval` and its active-time budget is paused.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chrono::Utc;
use serde_json::{Map, Value, json};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

use super::clock::ActiveClock;
use super::events::{
    ADAPTER_EVENT, BUDGET_EXCEEDED, MEMORY_APPROVAL_REQUESTED, MEMORY_CANDIDATE_SUBMITTED,
    MEMORY_LIFECYCLE, MEMORY_PLUGIN_FAILED, MEMORY_RECALL_COMPLETED, PHASE_HANDOFF,
    PROGRESS_NARRATION, REQUEST_CANCELLED, REQUEST_COMPLETED, REQUEST_FAILED, REQUEST_STARTED,
    TOOL_CLIENT_COMPLETED, USAGE_RECORDED, output_delta,
};
use super::{
    History, Inventory, Journal, JournalError, NewRequest, Protocol, Runtime, RuntimeError,
    Submitted, narration, new_id,
};
use crate::adapters::{
    AdapterContext, AdapterError, EventSink, FailureKind, RuntimeOutput, ToolCall, ToolInvoker,
    ToolResult, ToolSpec, Transcript,
};
use crate::gateway::{RunHost, RunScope, ToolGateway};
use crate::store::{
    ApprovalDecision, ApprovalRecord, ApprovalStatus, EventRecord, MessageRecord, RunStatus,
    WriteOp,
};
use crate::workspace::{AgentConfig, NarrationConfig, wire_name};

pub(super) struct RunJob {
    pub submitted: Submitted,
    pub messages: Transcript,
    /// Where the run's own messages start (see [`AdapterContext::own_from`]).
    pub own_from: usize,
    pub options: Map<String, Value>,
    /// The client's tools and the results of calls it ran.
    pub client: super::ClientTurn,
    /// The workflow node this run executes, if it is one.
    pub node: Option<super::workflow::NodeJob>,
    pub parent_message_id: Option<String>,
    /// The request's metadata (policy input).
    pub metadata: Value,
    /// The client key identity that owns the request (delegated requests inherit it).
    pub owner: String,
    /// The session its model calls are charged to (see [`super::charge_session`]).
    pub charge_session: String,
    /// A run continued after a restart: its recorded tool calls and approvals are loaded.
    pub resumed: bool,
    /// The run's attempt number (a retry's run is the request's next attempt).
    pub attempt: i64,
    /// Who cancelled the run before it started here (claimed only to be ended).
    pub cancel_by: Option<String>,
    /// Why a resumed run cannot go on ([`resumed_transcript`]): it fails with this, running
    /// nothing.
    pub cannot_resume: Option<String>,
    /// Counts the run against admission until it ends or parks (`None`: a run claimed only
    /// to be ended counts against nothing).
    pub permit: Option<OwnedSemaphorePermit>,
    /// An execution slot taken at submit time (the run was stored as running).
    pub slot: Option<OwnedSemaphorePermit>,
}

/// How a run is stopped from outside (see `LiveRun`).
pub(super) struct Stop {
    pub cancel: CancellationToken,
    pub handed_over: Arc<AtomicBool>,
    pub cancelled_by: Arc<std::sync::OnceLock<String>>,
}

/// Writes the events and steps of one run; narrates the events the narrator knows.
struct RunEvents {
    runtime: Runtime,
    /// The inventory the run started with (a reload does not change it).
    inventory: Arc<Inventory>,
    submitted: Submitted,
    owner: String,
    /// The owner's key labels, from the workspace the run started with (policy and budgets
    /// read them).
    key_labels: std::collections::BTreeMap<String, String>,
    /// The session its model calls are charged to.
    charge_session: String,
    narration: NarrationConfig,
    clock: ActiveClock,
    /// The run's execution slot; given back while the run waits on an approval.
    slot: Mutex<Option<OwnedSemaphorePermit>>,
    /// The run's admission place, traded for a parked place while it waits on an approval
    /// (kept when `limits.maxParkedRuns` are parked already).
    admission: Mutex<Option<OwnedSemaphorePermit>>,
    parked: Mutex<Option<OwnedSemaphorePermit>>,
    /// Who cancelled the run, if someone did.
    cancelled_by: Arc<std::sync::OnceLock<String>>,
    /// When the run started here (its duration metric).
    started: std::time::Instant,
    /// The run's cancellation (an operator's cancel, or shutdown).
    cancel: CancellationToken,
    /// Stops the adapter when a write the run depends on was lost (a child of `cancel`).
    stop: CancellationToken,
    /// The lost write that stopped the run, if one did.
    lost: Mutex<Option<JournalError>>,
    /// Set when the run is given up here (see `LiveRun::hand_over`): it writes nothing more.
    handed_over: Arc<AtomicBool>,
    /// The requests this run delegated to: a cancel of the run cancels them too.
    delegated: Mutex<Vec<String>>,
    /// The request's `user` (`/v1` `user`, or the `/runtime` metadata's): fills `{user}`
    /// memory namespaces.
    user: Option<String>,
    /// Memory candidates this run proposed (`write-after-run` reports them).
    candidates: AtomicUsize,
    /// The workflow node this run executes, if it is one.
    node: Option<super::workflow::NodeJob>,
    /// A tool node's gateway decision, for its edges.
    decision: Mutex<Option<crate::workspace::NodeDecision>>,
    /// The request's metadata (policy input; a workflow's next node gets it too).
    metadata: Value,
    /// The ids each of its events carries, made once for all of them.
    ids: EventIds,
}

/// The ids of a run's events: shared by all of them, not copied into each (four
/// allocations an event fewer: docs/profiling.md, the thirty-second pass).
struct EventIds {
    request_id: Arc<str>,
    run_id: Arc<str>,
    session_id: Arc<str>,
    agent_id: Arc<str>,
}

impl EventIds {
    fn of(submitted: &Submitted) -> Self {
        Self {
            request_id: submitted.request_id.as_str().into(),
            run_id: submitted.run_id.as_str().into(),
            session_id: submitted.session_id.as_str().into(),
            agent_id: submitted.agent_id.as_str().into(),
        }
    }
}

impl RunEvents {
    /// An event of this run; the journal gives it its `seq` when it commits.
    fn event(&self, event_type: &str, data: Value) -> EventRecord {
        EventRecord {
            id: new_id("evt"),
            request_id: Arc::clone(&self.ids.request_id),
            run_id: Arc::clone(&self.ids.run_id),
            session_id: Arc::clone(&self.ids.session_id),
            agent_id: Arc::clone(&self.ids.agent_id),
            seq: 0,
            event_type: event_type.to_owned(),
            at: Utc::now(),
            data,
        }
    }

    /// The agent's memory, if it has any (and memory is on).
    fn agent_memory(&self) -> Option<crate::memory::AgentMemory<'_>> {
        let workspace = &self.inventory.workspace;
        let config = &workspace.runtime.memory;
        let agent = workspace.agents.get(&self.submitted.agent_id)?;
        let memory = agent.memory.as_ref().filter(|_| config.enabled)?;
        Some(crate::memory::AgentMemory {
            config,
            agent: memory,
            store: Arc::clone(&self.runtime.inner.store),
            http: self.runtime.http(),
        })
    }

    /// What this request fills memory namespaces with.
    fn memory_context(&self) -> crate::memory::Context<'_> {
        crate::memory::Context {
            agent_id: &self.submitted.agent_id,
            session_id: &self.submitted.session_id,
            user: self.user.as_deref(),
            owner: &self.owner,
        }
    }

    /// `read-before-plan`: searches the agent's namespaces with the last user message.
    /// A provider that fails is reported and the run goes on without its records.
    async fn recall(&self, messages: &Transcript) -> Vec<crate::memory::Recalled> {
        let Some(memory) = self.agent_memory().filter(|memory| memory.agent.recall) else {
            return Vec::new();
        };
        let context = self.memory_context();
        let namespaces = memory.namespaces(&context);
        self.record(
            MEMORY_LIFECYCLE,
            json!({ "hook": "read-before-plan",
                "namespaces": namespaces.iter().map(|n| &n.name).collect::<Vec<_>>() }),
        )
        .await;
        let query = crate::adapters::last_user_text(messages.iter());
        let mut recalled = Vec::new();
        for found in memory.recall(&context, namespaces, &query).await {
            match found.found {
                Ok(crate::memory::Recall { records, usage }) => {
                    if let Some(usage) = usage {
                        let charge = crate::spend::Charge {
                            model: format!("memory:{}", memory.provider_name()),
                            source: "memory",
                            prompt_tokens: usage.prompt_tokens,
                            completion_tokens: usage.completion_tokens,
                            cost: usage.cost_usd,
                            estimated: false,
                        };
                        let agent = self.submitted.agent_id.clone();
                        crate::adapters::SpendMeter::charge(self, &agent, None, charge).await;
                    }
                    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
                    let contents: Vec<&str> = records.iter().map(|r| r.content.as_str()).collect();
                    self.record(
                        MEMORY_RECALL_COMPLETED,
                        json!({ "namespace": found.namespace.name, "recordIds": ids,
                            "context": contents, "provider": memory.provider_name() }),
                    )
                    .await;
                    recalled.extend(records);
                }
                Err(error) => {
                    let error = self
                        .inventory
                        .gateway
                        .redactor()
                        .redact_text(&error.to_string());
                    tracing::warn!(%error, "memory recall failed; the run goes on without it");
                    self.record(
                        MEMORY_PLUGIN_FAILED,
                        json!({ "provider": memory.provider_name(), "operation": "recall",
                            "namespace": found.namespace.name, "error": error }),
                    )
                    .await;
                }
            }
        }
        recalled
    }

    /// Completes the records of calls the client ran with the results it brought (redacted
    /// like any tool result), each announced as `runtime.tool.client.completed`. A call
    /// completed already (by an earlier life of this run) is left as it is.
    async fn complete_client_calls(
        &self,
        results: &[super::ClientResult],
    ) -> Result<(), AdapterError> {
        let redactor = self.inventory.gateway.redactor();
        for result in results {
            if self.is_handed_over() {
                break;
            }
            let output = redactor.redact(&result.output);
            let completed = self
                .runtime
                .inner
                .store
                .complete_client_call(&result.run_id, &result.call_key, &output, Utc::now())
                .await
                .map_err(|error| {
                    AdapterError::new(
                        FailureKind::Store,
                        format!("the client's tool result could not be recorded: {error}"),
                    )
                })?;
            if completed {
                self.record(
                    TOOL_CLIENT_COMPLETED,
                    json!({ "toolId": result.tool_id, "toolCallId": result.call_id,
                        "callKey": result.call_key, "requestId": result.request_id,
                        "output": output }),
                )
                .await;
            }
        }
        Ok(())
    }

    fn is_handed_over(&self) -> bool {
        self.handed_over.load(Ordering::SeqCst)
    }

    /// Moves the run to `status`, unless it was handed over.
    async fn set_status(&self, status: RunStatus) {
        if !self.is_handed_over() {
            set_status(&self.runtime, &self.submitted, status).await;
        }
    }

    async fn record(&self, event_type: &str, data: Value) -> String {
        self.record_as(event_type, data, false).await
    }

    /// [`RunEvents::record`]; with `with_first_output`, the event (and its narration) is held
    /// like the request's submit, even when the request is streamed live: it commits with
    /// the run's first write that commits (its first output delta when the model answers
    /// within the journal's hold), so a stream's first token waits for one commit, not two.
    async fn record_as(&self, event_type: &str, data: Value, with_first_output: bool) -> String {
        let event = self.event(event_type, data);
        let id = event.id.clone();
        if self.is_handed_over() {
            return id;
        }
        let narration = self
            .narration
            .enabled
            .then(|| narration::narrate(event_type, &event.data, self.narration.style))
            .flatten();
        let journal = &self.runtime.inner.journal;
        let request = Some(self.submitted.request_id.as_str());
        let op = WriteOp::AppendEvent(event);
        let written = if with_first_output {
            journal.write_submit(request, vec![op]).await
        } else {
            journal.write(request, op).await
        };
        if let Err(error) = written {
            tracing::error!(%error, event_type, "event could not be journaled");
        }
        if let Some(message) = narration {
            Box::pin(self.record_as(
                PROGRESS_NARRATION,
                json!({
                    "message": message,
                    "provider": "template",
                    "sourceEventTypes": [event_type],
                    "sourceEventIds": [id],
                }),
                with_first_output,
            ))
            .await;
        }
        id
    }

    /// Commits `ops` after the run's earlier writes. A failure stops the run: nothing it
    /// does next may rest on a write that was lost.
    async fn commit(&self, ops: Vec<WriteOp>) -> Result<(), JournalError> {
        let request = Some(self.submitted.request_id.as_str());
        let result = async { self.journal()?.commit(request, ops).await }.await;
        self.stopped_by(result)
    }

    /// Queues `op` after the run's earlier writes without waiting for its commit: the
    /// journal commits it with the run's next write that commits (or after its hold), and
    /// refuses that write if this one was lost. A failure to queue it stops the run.
    async fn queue(&self, op: WriteOp) -> Result<(), JournalError> {
        let request = Some(self.submitted.request_id.as_str());
        let result = async { self.journal()?.write(request, op).await }.await;
        self.stopped_by(result)
    }

    /// The journal the run writes through, unless the run was handed over to another
    /// instance.
    fn journal(&self) -> Result<&Journal, JournalError> {
        if self.is_handed_over() {
            return Err(JournalError::LeaseLost(
                "the run was handed over to another instance".to_owned(),
            ));
        }
        Ok(&self.runtime.inner.journal)
    }

    /// A write that failed stops the run, and is what the run ends with.
    fn stopped_by(&self, result: Result<(), JournalError>) -> Result<(), JournalError> {
        if let Err(error) = &result {
            tracing::error!(%error, "a run step could not be committed; stopping the run");
            if let Ok(mut lost) = self.lost.lock() {
                lost.get_or_insert_with(|| error.clone());
            }
            self.stop.cancel();
        }
        result
    }
}

#[async_trait::async_trait]
impl EventSink for RunEvents {
    async fn emit(&self, event_type: &str, data: Value) {
        self.record(event_type, data).await;
    }

    async fn emit_delta(&self, text: &str) {
        // While the run's previous delta waits in the journal's queue, the text joins it
        // there: the writer would have merged the two events, and none is built. (No delta
        // is narrated, so nothing else `record` does is skipped.)
        let (request, run) = (&self.submitted.request_id, &self.submitted.run_id);
        if !self.is_handed_over()
            && self
                .runtime
                .inner
                .journal
                .extend_queued_delta(request, run, text)
        {
            return;
        }
        self.record(ADAPTER_EVENT, output_delta(text)).await;
    }

    async fn checkpoint(&self, messages: &Transcript, own_from: usize) -> Result<(), AdapterError> {
        // A workflow node's checkpoint keeps its place in the workflow, and its conversation
        // (built from that place, not read again from the request).
        let state = match &self.node {
            Some(job) => job.state(messages),
            None => checkpoint_state(messages, own_from),
        };
        // Queued, not awaited: it commits with the run's next write that commits at the
        // latest, and every way a turn's tool runs first commits a record of the call (its
        // `started` record), which the journal refuses if this checkpoint was lost.
        self.queue(WriteOp::UpdateRun {
            id: self.submitted.run_id.clone(),
            status: RunStatus::Running,
            error: None,
            state: Some(state),
            at: Utc::now(),
        })
        .await
        .map_err(|error| store_failure(&error))
    }

    fn shown_live(&self) -> bool {
        self.runtime
            .inner
            .hub
            .is_streamed(&self.submitted.request_id)
    }
}

#[async_trait::async_trait]
impl crate::adapters::SpendMeter for RunEvents {
    async fn reserve(
        &self,
        agent: &str,
        tokens: u64,
        cost: f64,
    ) -> Result<Option<crate::spend::Hold>, AdapterError> {
        let amount = crate::store::spend::Amount {
            tokens,
            cost_nanos: crate::store::spend::to_nanos(cost),
        };
        let reserved = self
            .runtime
            .inner
            .spend
            .reserve(
                &self.inventory.workspace,
                &self.payer(agent),
                &self.submitted.run_id,
                amount,
            )
            .await;
        match reserved {
            Ok(hold) => Ok(hold),
            Err(crate::spend::SpendError::Budget(refusal)) => {
                self.record(BUDGET_EXCEEDED, refusal.event_data()).await;
                Err(AdapterError::budget(&refusal))
            }
            Err(error) => Err(AdapterError::new(
                FailureKind::Store,
                format!("the budgets could not be read: {error}"),
            )),
        }
    }

    async fn charge(
        &self,
        agent: &str,
        hold: Option<crate::spend::Hold>,
        charge: crate::spend::Charge,
    ) {
        let record = crate::store::spend::UsageRecord {
            id: new_id("use"),
            at: Utc::now(),
            request_id: self.submitted.request_id.clone(),
            run_id: self.submitted.run_id.clone(),
            owner: self.owner.clone(),
            agent_id: agent.to_owned(),
            session_id: self.charge_session.clone(),
            model: charge.model,
            source: charge.source.to_owned(),
            prompt_tokens: charge.prompt_tokens,
            completion_tokens: charge.completion_tokens,
            cost_nanos: charge.cost.map(crate::store::spend::to_nanos),
            estimated: charge.estimated,
        }
        .bounded();
        let settled = self
            .runtime
            .inner
            .spend
            .settle(&self.inventory.workspace, &self.payer(agent), hold, &record)
            .await;
        if let Err(error) = settled {
            tracing::error!(%error, "a call's usage could not be recorded in the ledger");
        }
        self.record(
            USAGE_RECORDED,
            json!({
                "model": record.model,
                "source": record.source,
                "agent": agent,
                "key": self.owner,
                "chargedSession": self.charge_session,
                "promptTokens": record.prompt_tokens,
                "completionTokens": record.completion_tokens,
                "totalTokens": record.prompt_tokens.saturating_add(record.completion_tokens),
                "cost": record.cost_nanos.map(crate::store::spend::from_nanos),
                "estimated": record.estimated,
            }),
        )
        .await;
    }

    async fn release(&self, hold: Option<crate::spend::Hold>) {
        if let Some(hold) = hold
            && let Err(error) = self.runtime.inner.spend.release(hold).await
        {
            tracing::warn!(%error, "a reservation could not be released; it lapses with the run");
        }
    }
}

impl RunEvents {
    /// Who this run's calls by `agent` are charged to.
    fn payer<'a>(&'a self, agent: &'a str) -> crate::spend::Payer<'a> {
        crate::spend::Payer {
            key: &self.owner,
            key_labels: &self.key_labels,
            agent,
            session: &self.charge_session,
        }
    }
}

/// The error a run fails with when one of its writes was lost.
fn store_failure(error: &JournalError) -> AdapterError {
    AdapterError::new(
        FailureKind::Store,
        format!("the run stopped because the store did not record one of its steps: {error}"),
    )
}

#[async_trait::async_trait]
impl RunHost for RunEvents {
    async fn emit(&self, event_type: &str, data: Value) {
        self.record(event_type, data).await;
    }

    async fn commit(&self, ops: Vec<WriteOp>) -> Result<(), String> {
        RunEvents::commit(self, ops)
            .await
            .map_err(|error| error.to_string())
    }

    async fn commit_with_event(
        &self,
        mut ops: Vec<WriteOp>,
        event_type: &str,
        data: Value,
    ) -> Result<(), String> {
        ops.push(WriteOp::AppendEvent(self.event(event_type, data)));
        RunEvents::commit(self, ops)
            .await
            .map_err(|error| error.to_string())
    }

    async fn decide(
        &self,
        approval: &ApprovalRecord,
        decision: ApprovalDecision,
    ) -> Result<bool, String> {
        match self.runtime.decide(approval, decision).await {
            Ok(_) => Ok(true),
            Err(RuntimeError::ApprovalDecided { .. }) => Ok(false),
            Err(error) => Err(error.to_string()),
        }
    }

    async fn set_waiting(&self, waiting: bool) {
        if waiting {
            // A run parked on a human gives its execution slot to a run that can use it, and
            // its admission place to a new request (a parked place bounds the parked runs).
            self.clock.pause(true);
            drop(self.slot.lock().ok().and_then(|mut slot| slot.take()));
            if let Ok(mut parked) = self.parked.lock()
                && parked.is_none()
                && let Ok(place) = Arc::clone(&self.runtime.inner.parked).try_acquire_owned()
            {
                *parked = Some(place);
                drop(self.admission.lock().ok().and_then(|mut held| held.take()));
            }
            self.set_status(RunStatus::WaitingApproval).await;
            return;
        }
        let slots = Arc::clone(&self.runtime.inner.slots);
        // Cancel first: a run cancelled while it waited never takes a slot it would not use.
        let slot = tokio::select! {
            biased;
            () = self.cancel.cancelled() => None,
            slot = slots.acquire_owned() => slot.ok(),
        };
        if let Ok(mut held) = self.slot.lock() {
            *held = slot;
        }
        self.clock.pause(false);
        self.set_status(RunStatus::Running).await;
    }

    async fn remember(
        &self,
        content: &str,
        metadata: Value,
    ) -> Result<Value, (&'static str, String)> {
        let Some(memory) = self.agent_memory() else {
            return Err((
                "memory_disabled",
                format!("agent `{}` has no memory", self.submitted.agent_id),
            ));
        };
        // Secrets never reach a memory record (nor the events that show it).
        let redactor = self.inventory.gateway.redactor();
        let content = redactor.redact_text(content);
        let metadata = redactor.redact(&metadata);
        let source = (
            self.submitted.request_id.as_str(),
            self.submitted.run_id.as_str(),
        );
        let written = memory
            .write(&self.memory_context(), &content, metadata.clone(), source)
            .await;
        let (namespace, written) = match written {
            Ok(written) => written,
            Err(refusal) => {
                if let crate::memory::WriteRefusal::Provider(error) = &refusal {
                    self.record(
                        MEMORY_PLUGIN_FAILED,
                        json!({ "provider": memory.provider_name(), "operation": "write",
                            "error": redactor.redact_text(&error.to_string()) }),
                    )
                    .await;
                }
                return Err((refusal.code(), refusal.to_string()));
            }
        };
        self.candidates.fetch_add(1, Ordering::SeqCst);
        let decision = if written.merged {
            "merged"
        } else {
            written.status.as_str()
        };
        let record = json!({ "memoryId": written.memory_id, "status": written.status });
        self.record(
            MEMORY_CANDIDATE_SUBMITTED,
            json!({
                "candidate": { "namespace": namespace.name, "content": content, "metadata": metadata },
                "decision": decision,
                "record": record,
                "provider": memory.provider_name(),
            }),
        )
        .await;
        if written.status == crate::store::MemoryStatus::Pending && !written.merged {
            self.record(
                MEMORY_APPROVAL_REQUESTED,
                json!({ "approval": { "memoryId": written.memory_id, "namespace": namespace.name } }),
            )
            .await;
        }
        Ok(
            json!({ "memoryId": written.memory_id, "status": written.status, "merged": written.merged }),
        )
    }

    async fn delegate(&self, agent: &str, input: &str, call_id: &str) -> Result<Value, String> {
        let Some(config) = self.inventory.workspace.agents.get(agent) else {
            return Err(format!("agent `{agent}` does not exist"));
        };
        let child = self
            .runtime
            .submit(NewRequest {
                leading_held_by: None,
                agent_id: Some(agent.to_owned()),
                session_id: None,
                owner: self.owner.clone(),
                history: History::Stateless,
                leading: Vec::new(),
                chainable: false,
                messages: vec![json!({ "role": "user", "content": input })],
                sent: None,
                new_messages: 1,
                options: Map::new(),
                metadata: json!({
                    "parentRequestId": self.submitted.request_id,
                    "parentRunId": self.submitted.run_id,
                    "toolCallId": call_id,
                    "parentSessionId": self.charge_session,
                }),
                protocol: Protocol::Agent,
                durable_before_return: true,
                client: Default::default(),
                surface: None,
                workflow: None,
            })
            .await
            .map_err(|error| format!("agent `{agent}` could not take the task: {error}"))?;
        self.record(
            ADAPTER_EVENT,
            json!({ "event": {
                "phase": PHASE_HANDOFF,
                "from": self.submitted.agent_id,
                "to": agent,
                "toolCallId": call_id,
                "requestId": child.request_id,
            } }),
        )
        .await;
        if let Ok(mut delegated) = self.delegated.lock() {
            delegated.push(child.request_id.clone());
        }
        let ended = self
            .runtime
            .wait_until_ended(
                &child.request_id,
                config.timeout + std::time::Duration::from_secs(5),
            )
            .await
            .map_err(|error| format!("agent `{agent}`: {error}"))?;
        match ended.status {
            RunStatus::Completed => Ok(json!({
                "agent": agent,
                "requestId": child.request_id,
                "output": ended.output,
            })),
            status => Err(format!(
                "agent `{agent}` ended {} (request {}): {}",
                status.as_str(),
                child.request_id,
                ended
                    .error
                    .as_ref()
                    .and_then(|e| e.get("message"))
                    .and_then(Value::as_str)
                    .unwrap_or("no answer")
            )),
        }
    }
}

/// Decisions moving a run's pending approvals to `cancelled`.
async fn cancel_pending_approvals(
    runtime: &Runtime,
    run_id: &str,
    at: chrono::DateTime<Utc>,
) -> Vec<WriteOp> {
    let approvals = match runtime.inner.store.approvals_of_run(run_id).await {
        Ok(approvals) => approvals,
        Err(error) => {
            // The run still ends; an approval left pending is refused when decided.
            tracing::warn!(%error, "could not read the approvals of a cancelled run");
            return Vec::new();
        }
    };
    approvals
        .into_iter()
        .filter(|approval| approval.status == ApprovalStatus::Pending)
        .map(|approval| {
            WriteOp::DecideApproval(ApprovalDecision {
                id: approval.id,
                status: ApprovalStatus::Cancelled,
                reason: Some("the run was cancelled".to_owned()),
                decided_by: "runtime".to_owned(),
                at,
            })
        })
        .collect()
}

/// Moves a live run (and its request) to `status`, committed at once: whoever looks sees a
/// run parked on an approval as waiting as soon as the approval shows.
async fn set_status(runtime: &Runtime, submitted: &Submitted, status: RunStatus) {
    let now = Utc::now();
    let written = runtime
        .inner
        .journal
        .write_group_now(
            Some(&submitted.request_id),
            vec![
                WriteOp::UpdateRun {
                    id: submitted.run_id.clone(),
                    status,
                    error: None,
                    state: None,
                    at: now,
                },
                WriteOp::UpdateRequest {
                    id: submitted.request_id.clone(),
                    status,
                    output: None,
                    error: None,
                    usage: None,
                    at: now,
                },
            ],
        )
        .await;
    if let Err(error) = written {
        tracing::error!(%error, status = status.as_str(), "a run status could not be journaled");
    }
}

/// The gateway, bound to one run: what the adapter calls tools through.
struct RunTools<'a> {
    gateway: &'a ToolGateway,
    scope: RunScope<'a>,
    specs: Arc<[ToolSpec]>,
}

#[async_trait::async_trait]
impl ToolInvoker for RunTools<'_> {
    fn specs(&self) -> &[ToolSpec] {
        &self.specs
    }

    async fn call(&self, call: ToolCall) -> ToolResult {
        self.gateway.call(&self.scope, call).await
    }
}

/// A cancelled run takes the requests it delegated to down with it (those ended already
/// refuse the cancel, which is then nothing to do).
fn cancel_delegated(runtime: &Runtime, events: &RunEvents, by: &str) {
    let delegated = events
        .delegated
        .lock()
        .map(|mut delegated| std::mem::take(&mut *delegated))
        .unwrap_or_default();
    for child in delegated {
        let (tasks, runtime, by) = (runtime.inner.tasks.clone(), runtime.clone(), by.to_owned());
        tasks.spawn(async move {
            let _ = runtime.cancel(&child, None, &by).await;
        });
    }
}

#[tracing::instrument(skip_all, fields(request_id = %job.submitted.request_id, run_id = %job.submitted.run_id, agent = %job.submitted.agent_id))]
pub(super) async fn execute(
    runtime: &Runtime,
    inventory: &Arc<Inventory>,
    job: RunJob,
    stop: Stop,
) {
    let Stop {
        cancel,
        handed_over,
        cancelled_by,
    } = stop;
    let RunJob {
        submitted,
        messages,
        own_from,
        options,
        client,
        node,
        parent_message_id,
        metadata,
        owner,
        charge_session,
        resumed,
        attempt,
        cancel_by: _,
        cannot_resume,
        permit,
        slot,
    } = job;
    let inner = &runtime.inner;
    let agent = inventory.workspace.agents.get(&submitted.agent_id);
    let events = RunEvents {
        runtime: runtime.clone(),
        inventory: Arc::clone(inventory),
        submitted: submitted.clone(),
        key_labels: inventory.workspace.key_labels(&owner),
        owner,
        charge_session,
        narration: inventory.workspace.runtime.narration,
        clock: ActiveClock::start(agent.map_or(std::time::Duration::ZERO, |a| a.timeout)),
        slot: Mutex::new(None),
        admission: Mutex::new(permit),
        parked: Mutex::new(None),
        cancelled_by,
        started: std::time::Instant::now(),
        stop: cancel.child_token(),
        cancel: cancel.clone(),
        lost: Mutex::new(None),
        handed_over,
        delegated: Mutex::new(Vec::new()),
        user: metadata
            .get("user")
            .and_then(Value::as_str)
            .map(str::to_owned),
        candidates: AtomicUsize::new(0),
        node: node.clone(),
        decision: Mutex::new(None),
        metadata: metadata.clone(),
        ids: EventIds::of(&submitted),
    };
    // A run submitted while a slot was free was stored as running already; the others wait.
    // One cancelled while it waits ends without running.
    let slot = match slot {
        Some(slot) => Some(slot),
        None => {
            let slot = tokio::select! {
                biased;
                () = cancel.cancelled() => None,
                slot = Arc::clone(&inner.slots).acquire_owned() => slot.ok(),
            };
            if events.is_handed_over() || (slot.is_none() && !cancel.is_cancelled()) {
                return;
            }
            if slot.is_some() {
                set_status(runtime, &submitted, RunStatus::Running).await;
            }
            slot
        }
    };
    let Some(slot) = slot else {
        let cancelled = AdapterError::new(FailureKind::Cancelled, "the run was cancelled");
        finish(
            runtime,
            &events,
            &submitted,
            parent_message_id,
            Err(cancelled),
        )
        .await;
        return;
    };
    if let Ok(mut held) = events.slot.lock() {
        *held = Some(slot);
    }
    // A workflow's tool node: one gateway call, on behalf of the workflow.
    let tool_node = node.as_ref().and_then(|job| {
        let workflow = inventory.workspace.workflows.get(&job.workflow)?;
        let step = workflow.node(&job.node)?;
        match &step.target {
            crate::workspace::WorkflowTarget::Tool(tool) => Some((workflow, step, tool)),
            crate::workspace::WorkflowTarget::Agent(_) => None,
        }
    });
    // The gateway bound to this run, calling as `agent`.
    let scope = |agent| {
        RunScope::new(
            submitted.request_id.clone(),
            submitted.run_id.clone(),
            submitted.session_id.clone(),
            agent,
            metadata,
            &events,
            events.stop.clone(),
        )
        .with_key_labels(events.key_labels.clone())
    };
    let result = if let Some(reason) = cannot_resume {
        Err(AdapterError::new(FailureKind::Unsupported, reason))
    } else if let Some((workflow, step, tool)) = tool_node {
        let caller = super::workflow::NodeJob::tool_caller(workflow, tool);
        let scope = scope(&caller);
        let arguments = node
            .as_ref()
            .map_or_else(|| json!({}), |job| job.arguments(step));
        // Boxed: a tool node's future (the gateway's call in it) is several times the size of
        // the rest of a run's, and an unboxed one made every run's future that large, copied
        // whole when its task was spawned (docs/profiling.md, the thirteenth pass).
        Box::pin(run_tool_node(
            runtime, &events, scope, step, tool, arguments, resumed,
        ))
        .await
    } else {
        match agent {
            Some(agent) => {
                let scope = scope(agent);
                let run = AdapterRun {
                    agent,
                    resumed,
                    attempt,
                    messages,
                    own_from,
                    options: &options,
                    client: &client,
                };
                run_adapter(runtime, &events, scope, run).await
            }
            // The workspace changed while the run was interrupted: say so instead of hanging.
            None => Err(AdapterError::new(
                FailureKind::Unsupported,
                format!(
                    "agent `{}` no longer exists in the workspace, so its run cannot resume",
                    submitted.agent_id
                ),
            )),
        }
    };
    finish(runtime, &events, &submitted, parent_message_id, result).await;
}

/// How a workflow ends, for the run's terminal group: the request's result (the last agent
/// node's output, or why it failed), and the decision log entries that go before it.
struct WorkflowEnd {
    result: Result<RuntimeOutput, AdapterError>,
    leading: Vec<WriteOp>,
    /// The last node's own end, when it differs from the workflow's.
    trailing: Vec<WriteOp>,
}

/// Ends a workflow node's run and takes the first edge whose condition holds on its recorded
/// outcome: the node's end, the decision log entry and the next node's run commit together,
/// then the next node starts (`None`). Without an edge (or at `maxSteps`) the workflow ends the
/// request, through the run's terminal group: completed with the last agent node's output when
/// its last node completed, else failed.
async fn finish_node(
    runtime: &Runtime,
    events: &RunEvents,
    submitted: &Submitted,
    parent_message_id: &mut Option<String>,
    job: &super::workflow::NodeJob,
    result: Result<RuntimeOutput, AdapterError>,
) -> Option<WorkflowEnd> {
    use super::workflow::{
        NODE_COMPLETED, NODE_STARTED, NodeJob, NodeResult, WORKFLOW_COMPLETED, WORKFLOW_FAILED,
        describe_edge, next_node, node_agent, node_run,
    };
    use crate::workspace::NodeOutcome;
    let now = Utc::now();
    let workflow = events.inventory.workspace.workflows.get(&job.workflow);
    let outcome = if result.is_ok() {
        NodeOutcome::Completed
    } else {
        NodeOutcome::Failed
    };
    let decision = events.decision.lock().ok().and_then(|kept| *kept);
    // An agent with a `responseSchema` answered JSON (its run checked it).
    let structured = result
        .as_ref()
        .ok()
        .and_then(|output| serde_json::from_str::<Value>(&output.text).ok());
    let next = workflow.and_then(|w| {
        next_node(
            w,
            &job.node,
            NodeResult {
                outcome,
                decision,
                output: structured.as_ref(),
            },
        )
    });
    let error = result.as_ref().err().map(|error| {
        let mut error = error.clone();
        error.message = events
            .inventory
            .gateway
            .redactor()
            .redact_text(&error.message);
        error.to_json()
    });
    let agent_node = workflow
        .and_then(|w| w.node(&job.node))
        .and_then(node_agent)
        .is_some();
    let last_output = match &result {
        Ok(output) if agent_node => Some(output.text.clone()),
        _ => job.last_output.clone(),
    };
    let node_end = WriteOp::UpdateRun {
        id: submitted.run_id.clone(),
        status: if result.is_ok() {
            RunStatus::Completed
        } else {
            RunStatus::Failed
        },
        error: error.clone(),
        state: None,
        at: now,
    };
    let node_completed = WriteOp::AppendEvent(events.event(
        NODE_COMPLETED,
        json!({ "workflowId": job.workflow, "node": job.node, "step": job.step,
            "outcome": outcome, "decision": decision, "edge": describe_edge(next), "error": error }),
    ));
    let max_steps = workflow.map_or(0, |w| w.max_steps);
    if let (Some(workflow), Some(to)) = (workflow, next)
        && job.step < max_steps
        && let Some(step) = workflow.node(to)
    {
        let next_job = NodeJob {
            workflow: job.workflow.clone(),
            node: to.to_owned(),
            step: job.step + 1,
            last_output,
            original: job.original.clone(),
        };
        let messages = if node_agent(step).is_some() {
            next_job.input(step)
        } else {
            Vec::new()
        };
        let (run, started) = node_run(&submitted.request_id, &next_job, &messages);
        let next_submitted = Submitted {
            request_id: submitted.request_id.clone(),
            run_id: run.id.clone(),
            session_id: submitted.session_id.clone(),
            agent_id: node_agent(step).unwrap_or(&workflow.name).to_owned(),
            status: RunStatus::Queued,
        };
        let mut started_event = events.event(NODE_STARTED, started);
        started_event.run_id = run.id.as_str().into();
        started_event.agent_id = next_submitted.agent_id.as_str().into();
        let ops = vec![
            node_end,
            node_completed,
            WriteOp::InsertRun(run),
            WriteOp::AppendEvent(started_event),
        ];
        match runtime
            .inner
            .journal
            .settle(&submitted.request_id, ops)
            .await
        {
            Ok(()) => {
                crate::metrics::run_ended(
                    &submitted.agent_id,
                    if outcome == NodeOutcome::Completed {
                        "completed"
                    } else {
                        "failed"
                    },
                    events.started.elapsed(),
                );
                let own_from = messages.len();
                runtime.start_run(RunJob {
                    submitted: next_submitted,
                    messages: messages.into(),
                    own_from,
                    options: Map::new(),
                    client: super::ClientTurn::default(),
                    node: Some(next_job),
                    parent_message_id: parent_message_id.take(),
                    metadata: events.metadata.clone(),
                    owner: events.owner.clone(),
                    charge_session: events.charge_session.clone(),
                    resumed: false,
                    attempt: i64::from(job.step) + 1,
                    cancel_by: None,
                    cannot_resume: None,
                    permit: None,
                    slot: None,
                });
            }
            Err(error) => {
                tracing::error!(%error, "a workflow step could not be committed; the node resumes when its lease is claimed again")
            }
        }
        return None;
    }
    // The workflow ends here.
    let stopped = next.is_some();
    let ended = if let Some(workflow) = workflow.filter(|_| stopped) {
        Err(AdapterError::new(
            FailureKind::MaxSteps,
            format!(
                "workflow `{}` stopped at maxSteps ({})",
                job.workflow, workflow.max_steps
            ),
        ))
    } else if workflow.is_none() {
        Err(AdapterError::new(
            FailureKind::Unsupported,
            format!(
                "workflow `{}` no longer exists in the workspace",
                job.workflow
            ),
        ))
    } else {
        result.map(|_| RuntimeOutput {
            text: last_output.unwrap_or_default(),
            finish_reason: "stop".to_owned(),
            ..RuntimeOutput::default()
        })
    };
    let summary = json!({ "workflowId": job.workflow, "steps": job.step, "lastNode": job.node });
    let summary = if ended.is_ok() {
        events.event(WORKFLOW_COMPLETED, summary)
    } else {
        events.event(WORKFLOW_FAILED, summary)
    };
    let trailing = if (outcome == NodeOutcome::Completed) == ended.is_ok() {
        Vec::new()
    } else {
        vec![node_end]
    };
    Some(WorkflowEnd {
        result: ended,
        leading: vec![node_completed, WriteOp::AppendEvent(summary)],
        trailing,
    })
}

/// A workflow's tool node: the node's call through the gateway (allow-list of one, schema,
/// policy, approval, recording), its decision kept for the node's edges.
async fn run_tool_node(
    runtime: &Runtime,
    events: &RunEvents,
    mut scope: RunScope<'_>,
    step: &crate::workspace::WorkflowNode,
    tool: &str,
    arguments: Value,
    resumed: bool,
) -> Result<RuntimeOutput, AdapterError> {
    use crate::gateway::Outcome;
    use crate::workspace::NodeDecision;
    let store = &runtime.inner.store;
    if resumed {
        scope.load_history(store.as_ref()).await.map_err(|error| {
            AdapterError::new(
                FailureKind::Unsupported,
                format!("the run could not be resumed: {error}"),
            )
        })?;
    }
    events
        .record(
            REQUEST_STARTED,
            json!({ "workflowId": scope.agent.name, "node": step.id, "tool": tool,
                "runId": events.submitted.run_id, "instance": store.holder() }),
        )
        .await;
    let call = ToolCall {
        key: format!("node.{}", step.id),
        id: step.id.clone(),
        tool_id: tool.to_owned(),
        arguments,
    };
    let key = call.key.clone();
    let result = events.inventory.gateway.call(&scope, call).await;
    let asked = store
        .approvals_of_run(&events.submitted.run_id)
        .await
        .unwrap_or_default()
        .into_iter()
        .any(|approval| approval.call_key == key);
    let code = result
        .content
        .pointer("/error/code")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let decision = match result.outcome {
        Outcome::Denied if asked || code.starts_with("approval_") => NodeDecision::Denied,
        Outcome::Denied | Outcome::NotAllowed => NodeDecision::Deny,
        _ if asked => NodeDecision::Approved,
        _ => NodeDecision::Allow,
    };
    if let Ok(mut kept) = events.decision.lock() {
        *kept = Some(decision);
    }
    match result.outcome {
        Outcome::Completed => Ok(RuntimeOutput {
            text: result.to_model_text(),
            finish_reason: "stop".to_owned(),
            ..RuntimeOutput::default()
        }),
        Outcome::Cancelled => Err(AdapterError::new(
            FailureKind::Cancelled,
            "the run was cancelled",
        )),
        _ => Err(AdapterError::new(
            FailureKind::ToolFailed,
            format!(
                "tool node `{}` ({tool}): {}",
                step.id,
                result.to_model_text()
            ),
        )),
    }
}

/// The key of a run's checkpoint holding the messages the run added after its input.
const CHECKPOINT_ADDED: &str = "added";
/// The key of a run's checkpoint holding how many messages its input had: where the added
/// ones start.
const CHECKPOINT_OWN_FROM: &str = "ownFrom";

/// The checkpoint of a run that is no workflow node's: the messages it added after its input
/// (`own_from` on), and where they start. The input itself — the request's leading messages,
/// the session's history through the message the request names, its own messages — is the
/// request's, read again when the run resumes ([`super::request_start`]). A checkpoint of the
/// whole transcript stored the session's history again at every model turn and every tool
/// round of a long session's run: O(history) written twice a round (docs/profiling.md, the
/// eighty-first pass).
fn checkpoint_state(messages: &Transcript, own_from: usize) -> Value {
    json!({ CHECKPOINT_OWN_FROM: own_from, CHECKPOINT_ADDED: &*messages.tail_from(own_from) })
}

/// The transcript a resumed run goes on from: its `input` (as [`super::request_start`] read
/// it) followed by what its checkpoint `state` says it added; a checkpoint of the whole
/// transcript (a workflow node's, or any run's as builds before the eighty-first pass stored
/// it) as it is; without a checkpoint, its input. `Err` says why it cannot go on: a
/// checkpoint whose input had another length than `input` (the store keeps a path as it
/// was, so nothing this server writes does that) would put its calls in other places, where
/// the results recorded for the calls that were there would answer them.
pub(super) fn resumed_transcript(
    input: Transcript,
    state: Option<Value>,
) -> Result<Transcript, String> {
    let mut state = match state {
        None => return Ok(input),
        Some(Value::Object(state)) => state,
        Some(_) => Default::default(),
    };
    if let Some(Value::Array(whole)) = state.remove("messages") {
        return Ok(whole.into());
    }
    let from = state.get(CHECKPOINT_OWN_FROM).and_then(Value::as_u64);
    match (state.remove(CHECKPOINT_ADDED), from) {
        (Some(Value::Array(added)), Some(from))
            if usize::try_from(from).ok() == Some(input.len()) =>
        {
            let mut messages = input;
            for message in added {
                messages.push(message);
            }
            Ok(messages)
        }
        _ => Err(format!(
            "the run's checkpoint does not follow its input as the store holds it ({} messages), so its run cannot resume",
            input.len()
        )),
    }
}

/// What a run gives its adapter.
struct AdapterRun<'a> {
    agent: &'a AgentConfig,
    resumed: bool,
    attempt: i64,
    messages: Transcript,
    own_from: usize,
    options: &'a Map<String, Value>,
    client: &'a super::ClientTurn,
}

/// Loads what a resumed run recorded, announces the run and plays the agent's adapter with the
/// gateway bound to this run, within the agent's active-time budget.
async fn run_adapter(
    runtime: &Runtime,
    events: &RunEvents,
    mut scope: RunScope<'_>,
    run: AdapterRun<'_>,
) -> Result<RuntimeOutput, AdapterError> {
    let AdapterRun {
        agent,
        resumed,
        attempt,
        messages,
        own_from,
        options,
        client,
    } = run;
    let inner = &runtime.inner;
    if resumed {
        scope
            .load_history(inner.store.as_ref())
            .await
            .map_err(|error| {
                tracing::error!(%error, "the recorded tool calls of a resumed run could not be read");
                AdapterError::new(
                    FailureKind::Unsupported,
                    format!("the run could not be resumed: {error}"),
                )
            })?;
    }
    let cancel = scope.cancel.clone();
    let gateway = &events.inventory.gateway;
    // The client's tools, when the agent (still) takes them: compiled again from the stored
    // request, as the surface checked them at submit.
    let client_tools = match agent.client_tools {
        Some(risk) if !client.tools.is_empty() => {
            crate::gateway::client::compile(&client.tools, risk).unwrap_or_default()
        }
        _ => Vec::new(),
    };
    let specs = if client_tools.is_empty() {
        gateway.specs(agent)
    } else {
        let mut specs = gateway.specs(agent).to_vec();
        specs.extend(client_tools.iter().map(ToolSpec::of));
        Arc::from(specs)
    };
    let tools = RunTools {
        gateway,
        specs,
        scope: scope.with_client_tools(client_tools),
    };
    // On a shared store (PostgreSQL) a commit is a round trip: the run's start waits for
    // its first output, so that a stream's first token waits for one commit, not two
    // (-1.7 ms there). On the embedded store the submit's commit is better made while the
    // upstream answers: held, it moved onto the first token's path (+0.06 ms;
    // docs/profiling.md, the thirty-seventh pass).
    events
        .record_as(
            REQUEST_STARTED,
            json!({ "agentId": agent.name, "backend": wire_name(&agent.backend), "attempt": attempt,
                "runId": events.submitted.run_id, "instance": inner.store.holder() }),
            inner.store.is_shared(),
        )
        .await;
    events.complete_client_calls(&client.results).await?;
    let Some(adapter) = inner.adapters.for_backend(agent.backend) else {
        return Err(AdapterError::new(
            FailureKind::Unsupported,
            format!(
                "the `{}` backend is not available in this build yet",
                wire_name(&agent.backend)
            ),
        ));
    };
    // A cancel stops a slow memory provider too; the adapter then sees the cancel at once.
    let recalled = tokio::select! {
        recalled = events.recall(&messages) => recalled,
        () = cancel.cancelled() => Vec::new(),
    };
    let identity = crate::adapters::RunIdentity {
        request_id: events.submitted.request_id.clone(),
        run_id: events.submitted.run_id.clone(),
        session_id: events.submitted.session_id.clone(),
    };
    let context = AdapterContext {
        workspace: &events.inventory.workspace,
        agent,
        messages,
        own_from,
        options,
        memory: &recalled,
        run: &identity,
        metadata: &events.metadata,
        callbacks: &inner.callbacks,
        events,
        tools: &tools,
        spend: events,
        cancel,
    };
    let result = tokio::select! {
        result = adapter.run(context) => result,
        () = events.clock.expired() => Err(AdapterError::new(
            FailureKind::Timeout,
            format!(
                "agent `{}` exceeded its timeout of {}s",
                agent.name,
                agent.timeout.as_secs_f64()
            ),
        )),
    };
    result.and_then(|output| checked_response(agent, output))
}

/// The answer of an agent with a `responseSchema` must be JSON that satisfies it (a run that
/// hands calls to the client has no answer yet).
fn checked_response(
    agent: &AgentConfig,
    output: RuntimeOutput,
) -> Result<RuntimeOutput, AdapterError> {
    let Some(schema) = &agent.response_schema else {
        return Ok(output);
    };
    if !output.client_calls.is_empty() {
        return Ok(output);
    }
    let problem = match serde_json::from_str::<Value>(&output.text) {
        Err(error) => Some(format!("it is not JSON ({error})")),
        Ok(value) => schema
            .validator
            .iter_errors(&value)
            .next()
            .map(|error| error.to_string()),
    };
    match problem {
        None => Ok(output),
        Some(problem) => Err(AdapterError::new(
            FailureKind::InvalidOutput,
            format!(
                "the answer of agent `{}` does not satisfy its responseSchema: {problem}",
                agent.name
            ),
        )),
    }
}

/// Ends the run: statuses, the assistant message and the terminal event commit in one
/// transaction (statuses are in place before anyone sees the event). A run stopped by a lost
/// write fails with kind `store`, after the writes that did commit.
async fn finish(
    runtime: &Runtime,
    events: &RunEvents,
    submitted: &Submitted,
    parent_message_id: Option<String>,
    result: Result<RuntimeOutput, AdapterError>,
) {
    let now = Utc::now();
    let run_id = submitted.run_id.clone();
    let request_id = submitted.request_id.clone();
    let mut ops = Vec::new();
    let lost = events.lost.lock().ok().and_then(|mut lost| lost.take());
    if events.is_handed_over() || matches!(lost, Some(JournalError::LeaseLost(_))) {
        // Another instance holds the run now (or will) and ends it there; what this one lost
        // is forgotten, should it claim the run again later.
        tracing::info!("the run stopped here: it was handed over to another instance");
        let _ = runtime.inner.journal.forgive(&submitted.request_id).await;
        return;
    }
    let result = match (result, lost) {
        (_, Some(error)) => Err(store_failure(&error)),
        (result, None) => result,
    };
    // `write-after-run`: what the run proposed is stored already (each proposal when it was
    // made, so a crash loses none); the hook reports them as the run ends.
    let candidates = events.candidates.load(Ordering::SeqCst);
    if candidates > 0 {
        events
            .record(
                MEMORY_LIFECYCLE,
                json!({ "hook": "write-after-run", "candidates": candidates }),
            )
            .await;
    }
    // A workflow node that did not end by a cancel moves the workflow on, or ends it here.
    let mut parent_message_id = parent_message_id;
    let mut trailing = Vec::new();
    let result = match &events.node {
        Some(job) if !matches!(&result, Err(error) if error.kind == FailureKind::Cancelled) => {
            let end = finish_node(
                runtime,
                events,
                submitted,
                &mut parent_message_id,
                job,
                result,
            )
            .await;
            let Some(end) = end else { return };
            ops.extend(end.leading);
            trailing = end.trailing;
            end.result
        }
        _ => result,
    };
    let (status, terminal_type, terminal_data, output, error, usage) = match result {
        Ok(output) => {
            let reply =
                crate::adapters::ClientCall::assistant_message(&output.text, &output.client_calls);
            let message_id = new_id("msg");
            ops.push(WriteOp::InsertMessage(MessageRecord {
                id: message_id.clone(),
                session_id: submitted.session_id.clone(),
                parent_id: parent_message_id,
                request_id: Some(request_id.clone()),
                role: "assistant".into(),
                content: reply,
                created_at: now,
            }));
            let mut usage = serde_json::to_value(output.usage).unwrap_or(Value::Null);
            if let Some(cost) = output.cost_usd {
                usage["costUsd"] = json!(cost);
            }
            // `messageId`: the session message holding the answer, where a later turn may
            // continue from (a Responses chain does).
            let mut data = json!({ "output": output.text, "usage": usage,
                "finishReason": output.finish_reason, "messageId": message_id });
            if !output.client_calls.is_empty() {
                data["clientToolCalls"] = json!(output.client_calls);
                data["clientTurns"] = Value::Array(output.client_turns);
            }
            (
                RunStatus::Completed,
                REQUEST_COMPLETED,
                data,
                Some(output.text),
                None,
                Some(usage),
            )
        }
        Err(error) if error.kind == FailureKind::Cancelled => {
            let reason = match events.cancelled_by.get() {
                Some(by) => format!("cancelled by {by}"),
                None => error.message.clone(),
            };
            let data = json!({ "reason": reason, "cancelledBy": events.cancelled_by.get() });
            (
                RunStatus::Cancelled,
                REQUEST_CANCELLED,
                data,
                None,
                Some(error.to_json()),
                None,
            )
        }
        Err(error) => {
            let message = events
                .inventory
                .gateway
                .redactor()
                .redact_text(&error.message);
            tracing::warn!(kind = error.kind.as_str(), %message, "run failed");
            let error = error.to_json();
            (
                RunStatus::Failed,
                REQUEST_FAILED,
                json!({ "error": error }),
                None,
                Some(error),
                None,
            )
        }
    };
    ops.push(WriteOp::UpdateRun {
        id: run_id,
        status,
        error: error.clone(),
        state: None,
        at: now,
    });
    ops.push(WriteOp::UpdateRequest {
        id: request_id.clone(),
        status,
        output,
        error,
        usage,
        at: now,
    });
    ops.push(WriteOp::AppendEvent(
        events.event(terminal_type, terminal_data),
    ));
    ops.extend(trailing);
    // A cancelled run's calls still waiting on a human are moot: their approvals end
    // `cancelled` in the run's last transaction. One decided meanwhile refuses the group, so
    // the approvals are read again. Any other end is one try (nothing in it can conflict).
    let settled = if status == RunStatus::Cancelled {
        let mut tries = 0;
        loop {
            tries += 1;
            let mut group = ops.clone();
            group.extend(cancel_pending_approvals(runtime, &submitted.run_id, now).await);
            let settled = runtime.inner.journal.settle(&request_id, group).await;
            if tries == 3 || !matches!(settled, Err(JournalError::Conflict(_))) {
                break settled;
            }
        }
    } else {
        runtime.inner.journal.settle(&request_id, ops).await
    };
    if status == RunStatus::Cancelled
        && let Some(by) = events.cancelled_by.get()
    {
        cancel_delegated(runtime, events, by);
    }
    match settled {
        Ok(()) => {
            crate::metrics::run_ended(
                &submitted.agent_id,
                status.as_str(),
                events.started.elapsed(),
            );
        }
        Err(JournalError::LeaseLost(reason)) => {
            tracing::info!(%reason, "the run ended here after another instance took its lease over; it goes on there");
            let _ = runtime.inner.journal.forgive(&request_id).await;
        }
        Err(error) => tracing::error!(
            %error,
            status = status.as_str(),
            "the end of a run could not be committed; it resumes when its lease is claimed again"
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::{Value, json};

    use super::{Transcript, checkpoint_state, resumed_transcript};

    fn said(text: &str) -> Value {
        json!({ "role": "user", "content": text })
    }

    /// A run's input as `request_start` reads it: a leading message, a shared history, the
    /// request's own message.
    fn input() -> Transcript {
        Transcript::new(
            vec![said("lead")],
            Some(Arc::new(crate::adapters::SharedHistory::from(vec![
                said("h1"),
                said("h2"),
            ]))),
            vec![said("own")],
        )
    }

    /// A checkpoint holds what the run added after its input, not the input (the history
    /// least of all); resumed, the input read again and what was added are the transcript
    /// the run had. A whole transcript (a workflow node's) is taken as it is; a checkpoint
    /// that does not follow the input is refused.
    #[test]
    fn a_checkpoint_holds_what_the_run_added_and_resumes_after_its_input() {
        let mut running = input();
        let own_from = running.len();
        running
            .push(json!({ "role": "assistant", "content": null, "tool_calls": [{ "id": "c1" }] }));
        running.push(json!({ "role": "tool", "tool_call_id": "c1", "content": "42" }));
        let state = checkpoint_state(&running, own_from);
        assert_eq!(state["ownFrom"], 4);
        assert_eq!(state["added"].as_array().map(Vec::len), Some(2), "{state}");
        assert!(!state.to_string().contains("h1"), "no history: {state}");

        let resumed = resumed_transcript(input(), Some(state));
        assert_eq!(resumed, Ok(running));
        assert_eq!(resumed_transcript(input(), None), Ok(input()));
        let whole = json!({ "messages": [said("a"), said("b")] });
        assert_eq!(
            resumed_transcript(input(), Some(whole)),
            Ok(Transcript::from(vec![said("a"), said("b")]))
        );
        // Its calls would be in other places: the run cannot resume.
        let elsewhere = json!({ "ownFrom": 3, "added": [said("x")] });
        assert!(resumed_transcript(input(), Some(elsewhere)).is_err());
        let broken = json!({ "ownFrom": 4 });
        assert!(resumed_transcript(input(), Some(broken)).is_err());
    }
}
