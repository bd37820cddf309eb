//! The tool gateway (SPEC section 5): the only path by which any tool runs.
//!
//! Every call goes through the same steps, in order: a call with a recorded result returns
//! that result (a resumed run never runs a tool twice); the tool must be in the agent's
//! `tools`; the arguments must be JSON and valid against the tool's `inputSchema` (errors go
//! back to the model so it can correct itself); the policy decides (fail closed); a call that
//! needs approval is parked in the durable approval queue until an operator decides or the
//! approval times out; a `started` record with the call's idempotency key commits; the tool
//! runs with its timeout and that key; the result is redacted and committed, and only then
//! returned. Each step is an event. Parallel calls of one model turn run concurrently.
//!
//! Calls are identified by their place in the run (`key`: model turn and position), never by
//! the id the model gave them — providers reuse `call_0` or send none. A call that started
//! before a crash and has no result is *interrupted*: it runs again with the same idempotency
//! key when its tool allows (`onInterrupted: rerun`, never for a high-risk tool), becomes an
//! approval "outcome unknown after a restart" (`ask`), or gives the model an error (`fail`).
//!
//! The gateway knows nothing of runs beyond [`RunScope`]: the runtime supplies the identity of
//! the run and a [`RunHost`] through which events and records are written.

mod approvals;
pub mod callbacks;
pub mod client;
mod exec;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

pub use crate::redact::Redactor;
pub use approvals::ApprovalWaiters;
pub use exec::McpClients;

use crate::governance::{self, PolicyInput, Verdict};
use crate::runtime::events::{
    APPROVAL_REQUESTED, TOOL_CLIENT_REQUESTED, TOOL_DENIED, TOOL_DIRECT_COMPLETED,
    TOOL_DIRECT_STARTED,
};
use crate::store::{
    ApprovalDecision, ApprovalKind, ApprovalRecord, ApprovalStatus, Store, ToolCallRecord, WriteOp,
};
use crate::workspace::{
    AgentConfig, CompiledWorkspace, Decision, InterruptedAction, Risk, ToolConfig,
};

/// The outcome of a `started` record: the call was about to run, and has no result yet.
const STARTED: &str = "started";

/// One call as a model (or a script) asked for it.
#[derive(Debug, Clone)]
pub struct ToolCall {
    /// The call's stable place in its run (`t3.0`: model turn 3, position 0): how the
    /// gateway records and finds it, the same when a resumed run asks again.
    pub key: String,
    /// The id the caller gave the call (the model's `tool_call.id`), passed through to events.
    pub id: String,
    pub tool_id: String,
    /// A JSON object, or a string holding one (as models send them).
    pub arguments: Value,
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Completed,
    /// The tool ran and failed (error result, timeout, bad output).
    Failed,
    /// The tool is not in the agent's `tools`.
    NotAllowed,
    InvalidArguments,
    /// Policy denied it, or an operator did, or its approval expired.
    Denied,
    /// The run was cancelled while the call waited or ran.
    Cancelled,
    /// A client tool's call, allowed and handed to the client to run; its record is completed
    /// when the client's next call brings the result.
    #[serde(rename = "client")]
    ToClient,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::NotAllowed => "not_allowed",
            Self::InvalidArguments => "invalid_arguments",
            Self::Denied => "denied",
            Self::Cancelled => "cancelled",
            Self::ToClient => "client",
        }
    }

    /// The outcome a stored record names (anything unknown is `failed`).
    pub fn parse(text: &str) -> Self {
        [
            Self::Completed,
            Self::NotAllowed,
            Self::InvalidArguments,
            Self::Denied,
            Self::Cancelled,
            Self::ToClient,
        ]
        .into_iter()
        .find(|o| o.as_str() == text)
        .unwrap_or(Self::Failed)
    }
}

/// What the caller gets back: `content` is what the model reads as the tool's answer (the
/// output, or `{"error": {"code", "message", ...}}`), secrets already redacted.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolResult {
    pub outcome: Outcome,
    pub content: Value,
}

impl ToolResult {
    fn error(outcome: Outcome, code: &str, message: impl Into<String>, details: Value) -> Self {
        let mut error = json!({ "code": code, "message": message.into() });
        if let Value::Object(extra) = details {
            for (key, value) in extra {
                error[key] = value;
            }
        }
        Self {
            outcome,
            content: json!({ "error": error }),
        }
    }

    /// The tool message text a model reads.
    pub fn to_model_text(&self) -> String {
        match &self.content {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        }
    }
}

/// The runtime's side of a run, as the gateway needs it.
#[async_trait::async_trait]
pub trait RunHost: Send + Sync {
    /// Appends an event to the run (SPEC section 7).
    async fn emit(&self, event_type: &str, data: Value);
    /// Commits `ops` together, after the run's earlier writes. On `Err` nothing may go on:
    /// the run is being stopped.
    async fn commit(&self, ops: Vec<WriteOp>) -> Result<(), String>;
    /// Commits `ops` together with an event of the run (a call's start and its
    /// `runtime.tool.direct.started`: an execution never happens without its event stored).
    async fn commit_with_event(
        &self,
        ops: Vec<WriteOp>,
        event_type: &str,
        data: Value,
    ) -> Result<(), String>;
    /// Takes a decision about a pending approval of this run (its expiry), with its event.
    /// `Ok(false)`: somebody decided first.
    async fn decide(
        &self,
        approval: &ApprovalRecord,
        decision: ApprovalDecision,
    ) -> Result<bool, String>;
    /// Called with `true` when the first call of the run starts waiting on an approval and
    /// with `false` when the last one stops: the run is `waiting_approval` in between, and
    /// its active-time budget is paused.
    async fn set_waiting(&self, waiting: bool);
    /// Hands `input` to the subagent `agent` as a request of its own (announced as
    /// `agent.handoff`) and returns its answer, or why it has none.
    async fn delegate(&self, agent: &str, input: &str, call_id: &str) -> Result<Value, String>;
    /// Proposes a memory record in the agent's write namespace (`memory.write`); the output
    /// the model gets, or a typed error (`code`, message).
    async fn remember(
        &self,
        content: &str,
        metadata: Value,
    ) -> Result<Value, (&'static str, String)>;
}

/// One run's identity and state, as far as its tool calls go.
pub struct RunScope<'a> {
    pub request_id: String,
    pub run_id: String,
    pub session_id: String,
    pub agent: &'a AgentConfig,
    /// The request's metadata (policy input).
    pub metadata: Value,
    pub host: &'a dyn RunHost,
    pub cancel: CancellationToken,
    /// Calls recorded by an earlier life of this run (a resumed run), by call key: results,
    /// and `started` records of calls a crash interrupted.
    recorded: HashMap<String, ToolCallRecord>,
    /// Approvals an earlier life of this run asked for, by call key, kind and execution.
    approvals: HashMap<(String, ApprovalKind, i64), ApprovalRecord>,
    /// The labels of the key that owns the request (trusted policy input).
    key_labels: BTreeMap<String, String>,
    /// The tools the client supplied with this request (`client.<name>`).
    client_tools: Vec<ToolConfig>,
    waiting: AtomicUsize,
}

impl std::fmt::Debug for RunScope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunScope")
            .field("run_id", &self.run_id)
            .field("agent", &self.agent.name)
            .finish_non_exhaustive()
    }
}

impl<'a> RunScope<'a> {
    pub fn new(
        request_id: String,
        run_id: String,
        session_id: String,
        agent: &'a AgentConfig,
        metadata: Value,
        host: &'a dyn RunHost,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            request_id,
            run_id,
            session_id,
            agent,
            metadata,
            host,
            cancel,
            recorded: HashMap::new(),
            approvals: HashMap::new(),
            waiting: AtomicUsize::new(0),
            key_labels: BTreeMap::new(),
            client_tools: Vec::new(),
        }
    }

    /// The tools the client supplied with the request (see [`client::compile`]).
    pub fn with_client_tools(mut self, tools: Vec<ToolConfig>) -> Self {
        self.client_tools = tools;
        self
    }

    fn client_tool(&self, tool_id: &str) -> Option<&ToolConfig> {
        self.client_tools.iter().find(|tool| tool.id == tool_id)
    }

    /// The owning key's labels, which policy rules may match with `labels`.
    pub fn with_key_labels(mut self, labels: BTreeMap<String, String>) -> Self {
        self.key_labels = labels;
        self
    }

    /// Loads what an earlier life of the run recorded (only a resumed run has any).
    pub async fn load_history(
        &mut self,
        store: &dyn Store,
    ) -> Result<(), crate::store::StoreError> {
        self.recorded = store
            .tool_calls_of_run(&self.run_id)
            .await?
            .into_iter()
            .map(|call| (call.call_key.clone(), call))
            .collect();
        self.approvals = store
            .approvals_of_run(&self.run_id)
            .await?
            .into_iter()
            .map(|approval| {
                let key = (approval.call_key.clone(), approval.kind, approval.execution);
                (key, approval)
            })
            .collect();
        Ok(())
    }

    async fn enter_wait(&self) {
        if self.waiting.fetch_add(1, Ordering::SeqCst) == 0 {
            self.host.set_waiting(true).await;
        }
    }

    async fn leave_wait(&self) {
        if self.waiting.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.host.set_waiting(false).await;
        }
    }
}

/// A tool as a model sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub id: String,
    /// The function name the model must see exactly (a client tool keeps the client's name);
    /// `None`: derived from the id.
    pub function_name: Option<String>,
    pub description: String,
    pub parameters: Value,
}

impl ToolSpec {
    /// How a tool is offered to a model.
    pub fn of(tool: &ToolConfig) -> Self {
        let client = matches!(
            tool.implementation,
            crate::workspace::ToolImplementation::Client
        );
        Self {
            id: tool.id.clone(),
            function_name: client
                .then(|| tool.id.strip_prefix(crate::workspace::CLIENT_TOOL_PREFIX))
                .flatten()
                .map(str::to_owned),
            description: tool.description.clone().unwrap_or_default(),
            parameters: if tool.input_schema.is_object() {
                tool.input_schema.clone()
            } else {
                json!({ "type": "object" })
            },
        }
    }
}

/// The gateway; one per runtime, shared by every run.
#[derive(Debug)]
pub struct ToolGateway {
    workspace: Arc<CompiledWorkspace>,
    store: Arc<dyn Store>,
    http: reqwest::Client,
    mcp: McpClients,
    redactor: Redactor,
    waiters: Arc<ApprovalWaiters>,
    /// Every agent as a tool (`agents.<name>`), for the agents that list it in `subagents`.
    subagents: BTreeMap<String, ToolConfig>,
    /// What each agent's model is offered, built once (runs share it).
    specs: HashMap<String, Arc<[ToolSpec]>>,
}

/// The tool id under which an agent is offered to the agents that may delegate to it.
pub fn subagent_tool_id(agent: &str) -> String {
    format!("agents.{agent}")
}

/// Tools that delegate to agents: one input text, the agent's labels, its timeout (plus a
/// margin for the child run to be stored).
fn subagent_tools(workspace: &CompiledWorkspace) -> BTreeMap<String, ToolConfig> {
    let schema = json!({
        "type": "object",
        "properties": { "input": { "type": "string", "description": "What to ask the agent" } },
        "required": ["input"],
        "additionalProperties": false,
    });
    let Ok(validator) = jsonschema::validator_for(&schema) else {
        return BTreeMap::new();
    };
    let validator = Arc::new(validator);
    workspace
        .agents
        .values()
        .map(|agent| {
            let id = subagent_tool_id(&agent.name);
            let tool = ToolConfig {
                id: id.clone(),
                description: Some(
                    agent.description.clone().unwrap_or_else(|| {
                        format!("Delegate a task to the agent `{}`", agent.name)
                    }),
                ),
                input_schema: schema.clone(),
                input_validator: Arc::clone(&validator),
                risk: crate::workspace::Risk::Low,
                labels: agent.labels.clone(),
                timeout: agent.timeout + Duration::from_secs(5),
                implementation: crate::workspace::ToolImplementation::Subagent(agent.name.clone()),
                on_interrupted: InterruptedAction::Rerun,
            };
            (id, tool)
        })
        .collect()
}

impl ToolGateway {
    pub fn new(
        workspace: Arc<CompiledWorkspace>,
        store: Arc<dyn Store>,
        http: reqwest::Client,
        waiters: Arc<ApprovalWaiters>,
        redactor: Redactor,
    ) -> Self {
        let mut gateway = Self {
            mcp: McpClients::new(Arc::clone(&workspace), http.clone()),
            redactor,
            subagents: subagent_tools(&workspace),
            specs: HashMap::new(),
            workspace: Arc::clone(&workspace),
            store,
            http,
            waiters,
        };
        gateway.specs = workspace
            .agents
            .values()
            .map(|agent| (agent.name.clone(), gateway.build_specs(agent).into()))
            .collect();
        gateway
    }

    pub fn redactor(&self) -> &Redactor {
        &self.redactor
    }

    /// A workspace tool, or `agents.<name>` for an agent.
    pub fn find_tool(&self, tool_id: &str) -> Option<&ToolConfig> {
        self.workspace
            .tools
            .get(tool_id)
            .or_else(|| self.subagents.get(tool_id))
    }

    /// The tool `tool_id` if `agent` may call it: one of its `tools`, or `agents.<name>` for
    /// one of its `subagents`.
    fn tool_for(&self, agent: &AgentConfig, tool_id: &str) -> Option<&ToolConfig> {
        if agent.tools.iter().any(|id| id == tool_id) {
            return self.workspace.tools.get(tool_id);
        }
        let name = tool_id.strip_prefix("agents.")?;
        agent
            .subagents
            .iter()
            .any(|s| s == name)
            .then(|| self.subagents.get(tool_id))
            .flatten()
    }

    /// The tools an agent may call, in its declared order, then its subagents.
    pub fn specs(&self, agent: &AgentConfig) -> Arc<[ToolSpec]> {
        self.specs
            .get(&agent.name)
            .cloned()
            .unwrap_or_else(|| Arc::from(Vec::new()))
    }

    fn build_specs(&self, agent: &AgentConfig) -> Vec<ToolSpec> {
        let subagents: Vec<String> = agent
            .subagents
            .iter()
            .map(|name| subagent_tool_id(name))
            .collect();
        agent
            .tools
            .iter()
            .chain(subagents.iter())
            .filter_map(|id| self.tool_for(agent, id))
            .map(ToolSpec::of)
            .collect()
    }

    /// What the gateway would decide for a call, without running anything: the allow-list,
    /// the argument check, then the policy.
    pub fn explain(
        &self,
        agent: &AgentConfig,
        tool: &ToolConfig,
        arguments: &Value,
        metadata: &Value,
    ) -> Explanation {
        let client = matches!(
            tool.implementation,
            crate::workspace::ToolImplementation::Client
        );
        let allowed =
            self.tool_for(agent, &tool.id).is_some() || (client && agent.client_tools.is_some());
        let argument_errors = match parse_arguments(arguments) {
            Ok(arguments) => schema_errors(tool, &arguments),
            Err(message) => vec![message],
        };
        let verdict = if !allowed {
            not_allowed_verdict(agent, &tool.id)
        } else {
            governance::evaluate_or_deny(
                &self.workspace.runtime.governance,
                PolicyInput {
                    agent,
                    tool,
                    runtime_labels: &self.workspace.runtime.labels,
                    key_labels: &BTreeMap::new(),
                    metadata,
                },
            )
        };
        Explanation {
            verdict,
            allowed_for_agent: allowed,
            argument_errors,
        }
    }

    /// Runs one call through every step; never fails: every problem is a recorded result.
    #[tracing::instrument(skip_all, fields(tool = %call.tool_id, call = %call.key, run_id = %scope.run_id))]
    pub async fn call(&self, scope: &RunScope<'_>, call: ToolCall) -> ToolResult {
        let started = Instant::now();
        if let Some(recorded) = scope.recorded.get(&call.key) {
            if recorded.outcome != STARTED {
                return ToolResult {
                    outcome: Outcome::parse(&recorded.outcome),
                    content: recorded.result.clone(),
                };
            }
            return self.interrupted(scope, &call, recorded, started).await;
        }
        let tool = self
            .tool_for(scope.agent, &call.tool_id)
            .or_else(|| scope.client_tool(&call.tool_id));
        let Some(tool) = tool else {
            let verdict = not_allowed_verdict(scope.agent, &call.tool_id);
            let result = ToolResult::error(
                Outcome::NotAllowed,
                "tool_not_allowed",
                verdict.reason.clone(),
                json!({ "allowedTools": scope.agent.tools }),
            );
            return self
                .refuse(scope, &call, Value::Null, &verdict, result, started)
                .await;
        };
        let arguments = match parse_arguments(&call.arguments) {
            Ok(arguments) => arguments,
            Err(message) => {
                let result = ToolResult::error(
                    Outcome::InvalidArguments,
                    "invalid_arguments",
                    message,
                    json!({}),
                );
                return self
                    .finish(scope, &call, &call.arguments, result, started)
                    .await;
            }
        };
        // What is stored of the arguments; the journal redacts it on the way to the store.
        let stored_arguments = arguments.clone();
        let errors = schema_errors(tool, &arguments);
        if !errors.is_empty() {
            let result = ToolResult::error(
                Outcome::InvalidArguments,
                "invalid_arguments",
                format!(
                    "the arguments do not match the input schema of `{}`; correct them and call again",
                    tool.id
                ),
                json!({ "errors": errors }),
            );
            return self
                .finish(scope, &call, &stored_arguments, result, started)
                .await;
        }
        let verdict = governance::evaluate_or_deny(
            &self.workspace.runtime.governance,
            PolicyInput {
                agent: scope.agent,
                tool,
                runtime_labels: &self.workspace.runtime.labels,
                key_labels: &scope.key_labels,
                metadata: &scope.metadata,
            },
        );
        match verdict.decision {
            Decision::Allow => {}
            Decision::Deny => {
                let result = ToolResult::error(
                    Outcome::Denied,
                    "denied",
                    verdict.reason.clone(),
                    json!({ "rule": verdict.rule }),
                );
                return self
                    .refuse(scope, &call, stored_arguments, &verdict, result, started)
                    .await;
            }
            Decision::NeedsApproval => {
                let asked = Ask {
                    kind: ApprovalKind::Policy,
                    execution: 0,
                    rule: verdict.rule.clone(),
                    reason: verdict.reason.clone(),
                };
                if let Err(result) = self
                    .await_approval(scope, &call, &stored_arguments, asked)
                    .await
                {
                    return self
                        .finish(scope, &call, &stored_arguments, result, started)
                        .await;
                }
            }
        }
        if matches!(
            tool.implementation,
            crate::workspace::ToolImplementation::Client
        ) {
            return self.hand_to_client(scope, &call, &stored_arguments).await;
        }
        self.run_and_finish(scope, &call, tool, arguments, &stored_arguments, started)
            .await
    }

    /// An allowed call of a client tool: recorded as handed to the client (with
    /// `runtime.tool.client.requested`), never run here. The record is completed when the
    /// client's next call brings the result.
    async fn hand_to_client(
        &self,
        scope: &RunScope<'_>,
        call: &ToolCall,
        stored_arguments: &Value,
    ) -> ToolResult {
        let result = ToolResult {
            outcome: Outcome::ToClient,
            content: Value::Null,
        };
        let record = WriteOp::RecordToolCall(call_record(
            scope,
            call,
            stored_arguments,
            result.outcome.as_str(),
            Value::Null,
            0,
        ));
        let requested = json!({ "toolId": call.tool_id, "toolCallId": call.id, "callKey": call.key, "arguments": stored_arguments });
        match scope
            .host
            .commit_with_event(vec![record], TOOL_CLIENT_REQUESTED, requested)
            .await
        {
            Ok(()) => result,
            Err(message) => ToolResult::error(
                Outcome::Cancelled,
                "store_unavailable",
                format!("the call could not be recorded ({message})"),
                json!({}),
            ),
        }
    }

    /// A call that started in an earlier life of the run and has no result: its outcome is
    /// unknown. Run it again with the same idempotency key, ask an operator, or tell the model.
    async fn interrupted(
        &self,
        scope: &RunScope<'_>,
        call: &ToolCall,
        record: &ToolCallRecord,
        started: Instant,
    ) -> ToolResult {
        let stored_arguments = record.arguments.clone();
        let tool = self.tool_for(scope.agent, &call.tool_id);
        let arguments = parse_arguments(&call.arguments);
        let (Some(tool), Ok(arguments)) = (tool, arguments) else {
            // The workspace changed under the run: nothing to run again safely.
            let result = ToolResult::error(
                Outcome::Failed,
                "interrupted",
                "the call was interrupted by a restart and can no longer run (its tool or arguments are no longer valid)",
                json!({ "idempotencyKey": record.idempotency_key }),
            );
            return self
                .finish(scope, call, &stored_arguments, result, started)
                .await;
        };
        // A high-risk call is never run again without a human, whatever the tool says.
        let action = match tool.on_interrupted {
            InterruptedAction::Rerun if tool.risk == Risk::High => InterruptedAction::Ask,
            action => action,
        };
        tracing::warn!(action = ?action, "a tool call was interrupted by a restart");
        match action {
            InterruptedAction::Rerun => {}
            InterruptedAction::Fail => {
                let result = ToolResult::error(
                    Outcome::Failed,
                    "interrupted",
                    format!(
                        "the call to `{}` was interrupted by a restart; its outcome is unknown and it was not run again",
                        tool.id
                    ),
                    json!({ "idempotencyKey": record.idempotency_key }),
                );
                return self
                    .finish(scope, call, &stored_arguments, result, started)
                    .await;
            }
            InterruptedAction::Ask => {
                // Each interruption is its own question: an approval given for an earlier
                // execution does not cover this one.
                let asked = Ask {
                    kind: ApprovalKind::Interrupted,
                    execution: record.executions,
                    rule: Some("interrupted".to_owned()),
                    reason: INTERRUPTED_REASON.to_owned(),
                };
                if let Err(result) = self
                    .await_approval(scope, call, &stored_arguments, asked)
                    .await
                {
                    return self
                        .finish(scope, call, &stored_arguments, result, started)
                        .await;
                }
            }
        }
        self.run_and_finish(scope, call, tool, arguments, &stored_arguments, started)
            .await
    }

    /// Runs an allowed call (its start recorded first) and records its result.
    async fn run_and_finish(
        &self,
        scope: &RunScope<'_>,
        call: &ToolCall,
        tool: &ToolConfig,
        arguments: Value,
        stored_arguments: &Value,
        started: Instant,
    ) -> ToolResult {
        let result = self
            .run_recorded(scope, call, tool, arguments, stored_arguments)
            .await;
        self.finish(scope, call, stored_arguments, result, started)
            .await
    }

    /// Commits the call's `started` record (with its idempotency key), then runs it.
    async fn run_recorded(
        &self,
        scope: &RunScope<'_>,
        call: &ToolCall,
        tool: &ToolConfig,
        arguments: Value,
        stored_arguments: &Value,
    ) -> ToolResult {
        let key = idempotency_key(&scope.run_id, &call.key);
        let start = WriteOp::StartToolCall(call_record(
            scope,
            call,
            stored_arguments,
            STARTED,
            Value::Null,
            0,
        ));
        let started_event = json!({ "toolId": tool.id, "toolCallId": call.id, "callKey": call.key, "idempotencyKey": key, "arguments": stored_arguments });
        if let Err(message) = scope
            .host
            .commit_with_event(vec![start], TOOL_DIRECT_STARTED, started_event)
            .await
        {
            return ToolResult::error(
                Outcome::Cancelled,
                "store_unavailable",
                format!("the call was not run: its start could not be recorded ({message})"),
                json!({}),
            );
        }
        self.execute(scope, call, tool, arguments, &key).await
    }

    /// Runs an allowed call (its start and started event committed) with the tool's timeout;
    /// ends with `runtime.tool.direct.completed`.
    async fn execute(
        &self,
        scope: &RunScope<'_>,
        call: &ToolCall,
        tool: &ToolConfig,
        arguments: Value,
        idempotency_key: &str,
    ) -> ToolResult {
        let started = Instant::now();
        let http = crate::net::client_here(&self.http);
        let context = exec::ExecContext {
            workspace: &self.workspace,
            agent: scope.agent,
            host: scope.host,
            call_id: &call.id,
            idempotency_key,
            http: &http,
            mcp: &self.mcp,
        };
        let outcome = tokio::select! {
            () = scope.cancel.cancelled() => Err(exec::ToolError::new("cancelled", "the run was cancelled while the tool ran")),
            outcome = tokio::time::timeout(tool.timeout, exec::run(&context, tool, arguments)) => match outcome {
                Ok(outcome) => outcome,
                Err(_) => Err(exec::ToolError::new("timeout", format!("tool `{}` did not finish within {}", tool.id, human(tool.timeout)))),
            },
        };
        let result = match outcome {
            Ok(output) => ToolResult {
                outcome: Outcome::Completed,
                content: self.redactor.redact(&output),
            },
            Err(error) => {
                let outcome = if error.code == "cancelled" {
                    Outcome::Cancelled
                } else {
                    Outcome::Failed
                };
                ToolResult::error(
                    outcome,
                    error.code,
                    self.redactor.redact_text(&error.message),
                    json!({}),
                )
            }
        };
        let mut data = json!({
            "toolId": tool.id,
            "toolCallId": call.id,
            "callKey": call.key,
            "durationMs": started.elapsed().as_millis() as u64,
        });
        match (&result.outcome, result.content.get("error")) {
            (Outcome::Completed, _) | (_, None) => data["output"] = result.content.clone(),
            (_, Some(error)) => data["error"] = error.clone(),
        }
        scope.host.emit(TOOL_DIRECT_COMPLETED, data).await;
        tracing::info!(
            outcome = result.outcome.as_str(),
            duration_ms = started.elapsed().as_millis() as u64,
            "tool call"
        );
        result
    }

    /// A call refused before it could run: `runtime.tool.denied`, then recorded.
    async fn refuse(
        &self,
        scope: &RunScope<'_>,
        call: &ToolCall,
        stored_arguments: Value,
        verdict: &Verdict,
        result: ToolResult,
        started: Instant,
    ) -> ToolResult {
        scope
            .host
            .emit(
                TOOL_DENIED,
                json!({ "toolId": call.tool_id, "toolCallId": call.id, "callKey": call.key, "rule": verdict.rule, "reason": verdict.reason }),
            )
            .await;
        tracing::info!(rule = verdict.rule.as_deref(), "tool call denied");
        self.finish(scope, call, &stored_arguments, result, started)
            .await
    }

    /// Commits the result under the call's key before anyone sees it: from then on the call
    /// is never run again. A result that cannot be committed is not given to the model.
    async fn finish(
        &self,
        scope: &RunScope<'_>,
        call: &ToolCall,
        stored_arguments: &Value,
        result: ToolResult,
        started: Instant,
    ) -> ToolResult {
        let record = WriteOp::RecordToolCall(call_record(
            scope,
            call,
            stored_arguments,
            result.outcome.as_str(),
            result.content.clone(),
            i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX),
        ));
        match scope.host.commit(vec![record]).await {
            Ok(()) => result,
            Err(message) => ToolResult::error(
                Outcome::Cancelled,
                "store_unavailable",
                format!("the call's result could not be recorded ({message})"),
                json!({}),
            ),
        }
    }

    /// Parks the call until its approval is decided. `Ok` means approved (by an operator, or
    /// by `onTimeout: approve` for a policy approval); `Err` carries the result the model gets.
    async fn await_approval(
        &self,
        scope: &RunScope<'_>,
        call: &ToolCall,
        stored_arguments: &Value,
        asked: Ask,
    ) -> Result<(), ToolResult> {
        let governance = &self.workspace.runtime.governance;
        // Parked first: whoever sees the pending approval sees the run and its request
        // `waiting_approval` too (the status commits before the approval does).
        scope.enter_wait().await;
        let approval = match scope
            .approvals
            .get(&(call.key.clone(), asked.kind, asked.execution))
        {
            Some(existing) => existing.clone(),
            None => {
                let now = Utc::now();
                let approval = ApprovalRecord {
                    id: crate::runtime::new_id("apr"),
                    request_id: scope.request_id.clone(),
                    run_id: scope.run_id.clone(),
                    session_id: scope.session_id.clone(),
                    agent_id: scope.agent.name.clone(),
                    call_key: call.key.clone(),
                    kind: asked.kind,
                    execution: asked.execution,
                    tool_call_id: call.id.clone(),
                    tool_id: call.tool_id.clone(),
                    arguments: stored_arguments.clone(),
                    rule: asked.rule,
                    status: ApprovalStatus::Pending,
                    reason: Some(asked.reason),
                    decided_by: None,
                    created_at: now,
                    expires_at: chrono::Duration::from_std(governance.approval_timeout)
                        .ok()
                        .and_then(|timeout| now.checked_add_signed(timeout)),
                    decided_at: None,
                };
                // Its event commits with it, in its transaction: queued after it, the event
                // would wait out the journal's hold, since nothing the parked run writes
                // comes after it to carry it (no event of this type is narrated).
                if let Err(message) = scope
                    .host
                    .commit_with_event(
                        vec![WriteOp::InsertApproval(approval.clone())],
                        APPROVAL_REQUESTED,
                        json!({ "approval": approval }),
                    )
                    .await
                {
                    scope.leave_wait().await;
                    return Err(ToolResult::error(
                        Outcome::Cancelled,
                        "store_unavailable",
                        format!("the approval could not be recorded ({message})"),
                        json!({}),
                    ));
                }
                approval
            }
        };
        let decided = approvals::wait_for_decision(
            self.store.as_ref(),
            scope.host,
            &self.waiters,
            &approval,
            &scope.cancel,
        )
        .await;
        scope.leave_wait().await;
        let decided = match decided {
            Ok(decided) => decided,
            Err(message) => {
                return Err(ToolResult::error(
                    Outcome::Cancelled,
                    "cancelled",
                    message,
                    json!({ "approvalId": approval.id }),
                ));
            }
        };
        use crate::workspace::TimeoutAction;
        match decided.status {
            ApprovalStatus::Approved => Ok(()),
            ApprovalStatus::Expired
                if governance.on_timeout == TimeoutAction::Approve
                    && decided.kind == ApprovalKind::Policy =>
            {
                Ok(())
            }
            ApprovalStatus::Expired => Err(ToolResult::error(
                Outcome::Denied,
                "approval_expired",
                format!(
                    "nobody approved the call to `{}` in time, so it was not run",
                    decided.tool_id
                ),
                json!({ "approvalId": decided.id }),
            )),
            _ => Err(ToolResult::error(
                Outcome::Denied,
                "approval_denied",
                format!(
                    "an operator denied the call to `{}`{}",
                    decided.tool_id,
                    decided
                        .reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                ),
                json!({ "approvalId": decided.id }),
            )),
        }
    }
}

/// Why a call is put to a human.
struct Ask {
    kind: ApprovalKind,
    /// The execution an `interrupted` approval concerns (0 for policy).
    execution: i64,
    rule: Option<String>,
    reason: String,
}

/// The reason an interrupted call's approval gives.
pub const INTERRUPTED_REASON: &str = "outcome unknown after a restart: the call started before the server stopped and has no recorded result; approve to run it again (with the same idempotency key) or deny";

/// The record of a call in the store, with `outcome` and `result` (a start counts one
/// execution; a result leaves the count as it is).
fn call_record(
    scope: &RunScope<'_>,
    call: &ToolCall,
    stored_arguments: &Value,
    outcome: &str,
    result: Value,
    duration_ms: i64,
) -> ToolCallRecord {
    ToolCallRecord {
        run_id: scope.run_id.clone(),
        call_key: call.key.clone(),
        model_call_id: call.id.clone(),
        request_id: scope.request_id.clone(),
        tool_id: call.tool_id.clone(),
        arguments: stored_arguments.clone(),
        idempotency_key: idempotency_key(&scope.run_id, &call.key),
        executions: i64::from(outcome == STARTED),
        outcome: outcome.to_owned(),
        result,
        duration_ms,
        recorded_at: Utc::now(),
    }
}

/// The idempotency key of a call: derived from its stable identity, so every execution of the
/// same call (a re-run after a crash included) carries the same key.
pub fn idempotency_key(run_id: &str, call_key: &str) -> String {
    format!("{run_id}.{call_key}")
}

/// What `explain` found.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    #[serde(flatten)]
    pub verdict: Verdict,
    pub allowed_for_agent: bool,
    /// Schema errors of the arguments (they would go back to the model, before any policy).
    pub argument_errors: Vec<String>,
}

fn not_allowed_verdict(agent: &AgentConfig, tool_id: &str) -> Verdict {
    Verdict {
        decision: Decision::Deny,
        rule: Some("tool_not_allowed".to_owned()),
        reason: format!(
            "tool `{tool_id}` is not in the tools of agent `{}`",
            agent.name
        ),
    }
}

/// The arguments as a JSON object: models send a string holding JSON; an empty one is `{}`.
fn parse_arguments(arguments: &Value) -> Result<Value, String> {
    let parsed = match arguments {
        Value::String(text) if text.trim().is_empty() => json!({}),
        Value::String(text) => serde_json::from_str(text)
            .map_err(|error| format!("the arguments are not valid JSON: {error}"))?,
        Value::Null => json!({}),
        other => other.clone(),
    };
    if parsed.is_object() {
        Ok(parsed)
    } else {
        Err("the arguments must be a JSON object".to_owned())
    }
}

fn schema_errors(tool: &ToolConfig, arguments: &Value) -> Vec<String> {
    tool.input_validator
        .iter_errors(arguments)
        .map(|error| {
            let path = error.instance_path().to_string();
            if path.is_empty() {
                error.to_string()
            } else {
                format!("{path}: {error}")
            }
        })
        .collect()
}

fn human(duration: Duration) -> String {
    format!("{}s", duration.as_secs_f64())
}
