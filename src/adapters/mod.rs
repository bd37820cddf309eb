//! Backend adapters (SPEC section 9): a [`RuntimeAdapter`] turns a stable request into
//! upstream calls, and upstream progress into events and a [`RuntimeOutput`].
//!
//! Adapters receive everything through [`AdapterContext`] — the compiled agent, the input
//! transcript, an event sink, a tool-gateway handle (the only way to run a tool) and a
//! cancellation signal — and never route on keywords, never hard-code a tool or domain.

mod chat_wire;
mod openai;
mod remote;
mod retry;
mod scripted;
mod sse;
mod transcript;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

pub use crate::gateway::{Outcome, ToolCall, ToolResult, ToolSpec};
use crate::runtime::events::{ADAPTER_EVENT, PHASE_TOOL_RESULT, PHASE_TOOL_START, output_delta};
use crate::workspace::{AgentConfig, Backend, CompiledWorkspace};

pub use openai::{ModelProbe, OpenAiAdapter, probe};
pub use remote::{PHASE_PROGRESS, PROTOCOL as AGENT_PROTOCOL, RemoteAdapter};
pub use retry::backoff_delay;
pub use scripted::ScriptedAdapter;
pub use transcript::{SharedHistory, Transcript, estimated_text_bytes};

/// Where an adapter reports what happens; the runtime stores and streams it.
#[async_trait::async_trait]
pub trait EventSink: Send + Sync {
    /// Records an event of `event_type` with `data` (SPEC section 7).
    async fn emit(&self, event_type: &str, data: Value);
    /// Records an output delta of `text` (an [`ADAPTER_EVENT`] with [`output_delta`]'s data).
    /// A sink may append it to the run's previous delta instead, while that is not stored
    /// yet: the same text, in the same order, in fewer events.
    async fn emit_delta(&self, text: &str) {
        self.emit(ADAPTER_EVENT, output_delta(text)).await;
    }
    /// Persists the conversation after a step (a model turn, tool results), committed with
    /// the run's next write that commits at the latest, and that write is refused if this one
    /// was lost: a model turn's tools never run before the turn is stored (a call's `started`
    /// record commits before it runs), and a run resumed after a crash starts from the last
    /// checkpoint that committed, with the results its calls recorded. `Err`: the run cannot
    /// go on. `own_from` is [`AdapterContext::own_from`]: the messages before it are the
    /// run's input, which its request holds already, and only those after it are stored.
    async fn checkpoint(&self, messages: &Transcript, own_from: usize) -> Result<(), AdapterError>;
    /// Whether someone is shown the run's events as they come (a stream). While nobody is,
    /// an adapter may gather a streamed answer's text into fewer output deltas: the same
    /// text, in the same order, in fewer events.
    fn shown_live(&self) -> bool {
        true
    }
}

/// The run's handle on its budgets (see [`crate::spend`]): every upstream call is reserved
/// before it is sent and charged after it.
#[async_trait::async_trait]
pub trait SpendMeter: Send + Sync {
    /// Reserves a call's worst case (`tokens`, and `cost` at the model's price) for `agent`;
    /// a budget without room refuses it (`budget_exceeded`, announced as
    /// `runtime.budget.exceeded`). `None`: no budget applies.
    async fn reserve(
        &self,
        agent: &str,
        tokens: u64,
        cost: f64,
    ) -> Result<Option<crate::spend::Hold>, AdapterError>;
    /// Charges a call to the budgets, settling its reservation, and records
    /// `runtime.usage.recorded`.
    async fn charge(
        &self,
        agent: &str,
        hold: Option<crate::spend::Hold>,
        charge: crate::spend::Charge,
    );
    /// Gives a reservation back uncharged (the call never reached the upstream).
    async fn release(&self, hold: Option<crate::spend::Hold>);
}

/// The run's handle on the tool gateway.
#[async_trait::async_trait]
pub trait ToolInvoker: Send + Sync {
    /// The tools the agent may call.
    fn specs(&self) -> &[ToolSpec];
    /// Runs one call through the gateway; every problem comes back as a result.
    async fn call(&self, call: ToolCall) -> ToolResult;
}

/// Runs a batch of calls concurrently, announcing each as `agent.tool.start` and
/// `agent.tool.result`; results come back in the batch's order.
pub async fn call_tools(context: &AdapterContext<'_>, calls: Vec<ToolCall>) -> Vec<ToolResult> {
    let runs = calls.into_iter().map(|call| async move {
        // Models send arguments as JSON text: the event carries them parsed. (Secrets are
        // removed by the journal, like from everything stored.)
        let args = match &call.arguments {
            Value::String(text) => serde_json::from_str(text).unwrap_or_else(|_| call.arguments.clone()),
            other => other.clone(),
        };
        context
            .events
            .emit(
                ADAPTER_EVENT,
                json!({ "event": { "phase": PHASE_TOOL_START, "toolId": call.tool_id, "toolCallId": call.id, "callKey": call.key, "args": args } }),
            )
            .await;
        let (tool_id, call_id, key) = (call.tool_id.clone(), call.id.clone(), call.key.clone());
        let result = context.tools.call(call).await;
        context
            .events
            .emit(
                ADAPTER_EVENT,
                json!({ "event": { "phase": PHASE_TOOL_RESULT, "toolId": tool_id, "toolCallId": call_id, "callKey": key, "outcome": result.outcome, "result": result.content } }),
            )
            .await;
        result
    });
    futures::future::join_all(runs).await
}

/// Everything an adapter may use for one run.
pub struct AdapterContext<'a> {
    pub workspace: &'a CompiledWorkspace,
    pub agent: &'a AgentConfig,
    /// OpenAI-style messages (`{"role", "content", ...}`), system instructions not included.
    /// The adapter's own: one that extends the transcript takes it instead of copying it; a
    /// long session's history, most of it, is shared, never copied ([`Transcript`]).
    pub messages: Transcript,
    /// Where the run's own messages start in `messages`: earlier ones came from the client
    /// (tool calls in them are history, never run), later ones from an earlier life of this
    /// run (a resumed run finishes their unanswered calls).
    pub own_from: usize,
    /// Generation options from the client (temperature, max_tokens, stop, ...).
    pub options: &'a Map<String, Value>,
    /// What memory recalled for this run (`read-before-plan`); empty without memory.
    pub memory: &'a [crate::memory::Recalled],
    /// Which run this is.
    pub run: &'a RunIdentity,
    /// The request's metadata (a remote agent's service receives it).
    pub metadata: &'a Value,
    /// Where a remote agent's service calls tools back (see [`crate::gateway::callbacks`]).
    pub callbacks: &'a Arc<crate::gateway::callbacks::Callbacks>,
    pub events: &'a dyn EventSink,
    pub tools: &'a dyn ToolInvoker,
    pub spend: &'a dyn SpendMeter,
    pub cancel: CancellationToken,
}

impl AdapterContext<'_> {
    /// The most output text a run may produce (`limits.maxOutputBytes`).
    pub fn output_cap(&self) -> usize {
        usize::try_from(self.workspace.runtime.limits.max_output_bytes).unwrap_or(usize::MAX)
    }
}

impl std::fmt::Debug for AdapterContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterContext")
            .field("agent", &self.agent.name)
            .field("messages", &self.messages.len())
            .finish_non_exhaustive()
    }
}

/// The request, run and session a run belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunIdentity {
    pub request_id: String,
    pub run_id: String,
    pub session_id: String,
}

/// Token usage as OpenAI reports it (a missing figure reads as 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

impl Usage {
    pub fn add(&mut self, other: Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.total_tokens += other.total_tokens;
    }
}

/// What a successful run produced.
#[derive(Debug, Clone, Default)]
pub struct RuntimeOutput {
    pub text: String,
    pub usage: Usage,
    /// What the model calls cost in USD, from each answering model's `pricing`; `None` when
    /// a call's model has no pricing (or no model was called).
    pub cost_usd: Option<f64>,
    /// `stop`, `length`, ... as the upstream reported it (`tool_calls` when the run ends
    /// handing calls to the client).
    pub finish_reason: String,
    /// Calls of client tools the client is to run (the run's last turn; empty otherwise).
    pub client_calls: Vec<ClientCall>,
    /// With `client_calls`: the run's own messages (its turns, and the results of the server
    /// calls among them), which the client's next call continues from.
    pub client_turns: Vec<Value>,
}

/// A call of a client tool, handed back to the client: its id, the client's name for the
/// tool, and the arguments as the model wrote them (JSON text).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ClientCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

impl ClientCall {
    /// The call as a Chat Completions `tool_calls` entry.
    pub fn to_chat_json(&self) -> Value {
        json!({ "id": self.id, "type": "function", "function": { "name": self.name, "arguments": self.arguments } })
    }

    /// The assistant message of a turn that answered `text` and handed `calls` to the client.
    pub fn assistant_message(text: &str, calls: &[ClientCall]) -> Value {
        let mut message = json!({ "role": "assistant", "content": text });
        if !calls.is_empty() {
            message["tool_calls"] = calls.iter().map(Self::to_chat_json).collect();
        }
        message
    }
}

/// Kinds of adapter failure; the first four are the retryable kinds of `recovery.retryOn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    Timeout,
    #[serde(rename = "upstream_5xx")]
    Upstream5xx,
    RateLimited,
    Connection,
    /// The upstream refused the request (4xx other than 429).
    UpstreamRejected,
    /// The upstream answered something that is not Chat Completions.
    Malformed,
    Cancelled,
    /// The agent or workspace asks for something this build cannot do.
    Unsupported,
    /// The model still asked for tools after `maxIterations` round trips.
    MaxIterations,
    /// The store could not record a step, so the run could not go on safely.
    Store,
    /// A workflow's tool node: its call failed or was refused.
    ToolFailed,
    /// A workflow stopped at `maxSteps`.
    MaxSteps,
    /// The answer of an agent with a `responseSchema` did not satisfy it.
    InvalidOutput,
    /// A budget had no room for the next model call.
    BudgetExceeded,
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Upstream5xx => "upstream_5xx",
            Self::RateLimited => "rate_limited",
            Self::Connection => "connection",
            Self::UpstreamRejected => "upstream_rejected",
            Self::Malformed => "malformed",
            Self::Cancelled => "cancelled",
            Self::Unsupported => "unsupported",
            Self::MaxIterations => "max_iterations",
            Self::Store => "store",
            Self::ToolFailed => "tool_failed",
            Self::MaxSteps => "max_steps",
            Self::InvalidOutput => "invalid_output",
            Self::BudgetExceeded => "budget_exceeded",
        }
    }
}

/// Why a run failed in its adapter.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct AdapterError {
    pub kind: FailureKind,
    pub message: String,
    /// The upstream HTTP status, when there was one.
    pub upstream_status: Option<u16>,
    /// Fields the stored error carries beside `kind` and `message` (a refusing budget's name
    /// and `retryAfter`).
    pub detail: Option<Map<String, Value>>,
}

impl AdapterError {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            upstream_status: None,
            detail: None,
        }
    }

    /// A budget refused the next model call.
    pub fn budget(refusal: &crate::spend::BudgetRefusal) -> Self {
        let mut error = Self::new(FailureKind::BudgetExceeded, refusal.message());
        let mut detail = Map::new();
        detail.insert("budget".into(), refusal.budget.clone().into());
        detail.insert("retryAfter".into(), json!(refusal.retry_after()));
        error.detail = Some(detail);
        error
    }

    /// The error as stored in events and request records.
    pub fn to_json(&self) -> Value {
        let mut error = serde_json::json!({ "kind": self.kind.as_str(), "message": self.message });
        if let Some(status) = self.upstream_status {
            error["upstreamStatus"] = status.into();
        }
        if let (Some(detail), Some(fields)) = (&self.detail, error.as_object_mut()) {
            for (key, value) in detail {
                fields.insert(key.clone(), value.clone());
            }
        }
        error
    }
}

/// One backend.
#[async_trait::async_trait]
pub trait RuntimeAdapter: Send + Sync {
    async fn run(&self, context: AdapterContext<'_>) -> Result<RuntimeOutput, AdapterError>;
}

/// The built-in adapters, by backend.
#[derive(Clone)]
pub struct Adapters {
    by_backend: BTreeMap<&'static str, Arc<dyn RuntimeAdapter>>,
}

impl std::fmt::Debug for Adapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.by_backend.keys()).finish()
    }
}

impl Adapters {
    pub fn new(http: reqwest::Client) -> Self {
        let mut by_backend: BTreeMap<&'static str, Arc<dyn RuntimeAdapter>> = BTreeMap::new();
        by_backend.insert(
            "openai",
            Arc::new(OpenAiAdapter::new(
                crate::net::upstream::UpstreamClient::new(),
            )),
        );
        by_backend.insert("scripted", Arc::new(ScriptedAdapter));
        by_backend.insert("http", Arc::new(RemoteAdapter::new(http)));
        Self { by_backend }
    }

    /// The adapter of a backend, if this build has one.
    pub fn for_backend(&self, backend: Backend) -> Option<Arc<dyn RuntimeAdapter>> {
        let name = match backend {
            Backend::Openai => "openai",
            Backend::Scripted => "scripted",
            Backend::Http => "http",
        };
        self.by_backend.get(name).cloned()
    }
}

/// The text of the last user message (string content, or the text parts of a content array).
pub fn last_user_text<'a>(messages: impl DoubleEndedIterator<Item = &'a Value>) -> String {
    messages
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .map(message_text)
        .unwrap_or_default()
}

/// The text of one message's `content`.
pub fn message_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}
