//! The compiled inventory: checked, resolved, immutable. Everything the runtime, the gateway
//! and the protocol surfaces know about a workspace comes from a [`CompiledWorkspace`].

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

pub use super::raw::{
    Backend, BudgetScope, Decision, HttpMethod, InterruptedAction, NarrationStyle, NodeDecision,
    NodeInput, NodeOutcome, OutputCondition, Provider, RateLimitScope, RetryKind, Risk,
    TimeoutAction,
};

/// The name a config enum has in YAML and on the wire (`needs_approval`, `openai`, `high`).
pub fn wire_name<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(name)) => name,
        _ => String::new(),
    }
}

/// A workspace after every check passed. Cheap to share (`Arc` it once at start).
#[derive(Debug, Clone)]
pub struct CompiledWorkspace {
    /// Canonical absolute path of the workspace folder.
    pub root: PathBuf,
    pub runtime: RuntimeConfig,
    pub agents: BTreeMap<String, AgentConfig>,
    pub models: BTreeMap<String, ModelConfig>,
    pub tools: BTreeMap<String, ToolConfig>,
    pub workflows: BTreeMap<String, WorkflowConfig>,
    /// When it was read from disk, and how long reading and compiling took.
    pub loaded_at: chrono::DateTime<chrono::Utc>,
    pub compile_time: std::time::Duration,
}

impl CompiledWorkspace {
    pub fn agent(&self, name: &str) -> Option<&AgentConfig> {
        self.agents.get(name)
    }

    /// The labels of the named client key whose identity is `owner` (none for unnamed keys).
    pub fn key_labels(&self, owner: &str) -> BTreeMap<String, String> {
        self.runtime
            .openai
            .keys
            .iter()
            .find(|key| key.name == owner)
            .map(|key| key.labels.clone())
            .unwrap_or_default()
    }

    pub fn default_agent(&self) -> Option<&AgentConfig> {
        self.runtime
            .default_agent
            .as_deref()
            .and_then(|name| self.agents.get(name))
    }
}

#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub default_agent: Option<String>,
    /// `store.url` as written (relative SQLite paths are resolved by the store).
    pub store_url: Option<String>,
    /// `store.leaseDuration`: how long a run stays leased to its instance without a renewal.
    pub lease_duration: Duration,
    /// `store.maxSize` in bytes.
    pub store_max_bytes: Option<u64>,
    pub retention: RetentionConfig,
    pub openai: OpenAiProtocolConfig,
    pub admin_api_keys_env: Vec<String>,
    /// `protocols.admin.keys`: named operator keys (labels are always empty).
    pub admin_keys: Vec<KeyConfig>,
    pub limits: LimitsConfig,
    pub governance: GovernanceConfig,
    pub recovery: RecoveryConfig,
    pub memory: MemoryConfig,
    /// `budgets`: every matching one applies to a model call.
    pub budgets: Vec<BudgetConfig>,
    /// `rateLimits`: token buckets checked at admission.
    pub rate_limits: Vec<RateLimitConfig>,
    pub narration: NarrationConfig,
    pub cli_event_types: Vec<String>,
    pub mcp_servers: BTreeMap<String, McpServerConfig>,
}

impl RuntimeConfig {
    /// Whether any budget or rate limit is configured (admission has something to check).
    pub fn has_spend_limits(&self) -> bool {
        !self.budgets.is_empty() || !self.rate_limits.is_empty()
    }
}

#[derive(Debug, Clone)]
pub struct OpenAiProtocolConfig {
    pub enabled: bool,
    pub api_keys_env: Vec<String>,
    /// `protocols.openai.keys`: named client keys.
    pub keys: Vec<KeyConfig>,
    pub approval_wait: Duration,
}

/// A named key: its name is its stable identity; `key_env` names the variable holding it
/// (the secret itself is read at start, never kept here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyConfig {
    pub name: String,
    pub key_env: String,
    /// Trusted labels of callers using this key, matched by governance `match.labels`.
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy)]
pub struct LimitsConfig {
    pub max_request_bytes: u64,
    pub max_concurrent_runs: u32,
    /// Runs parked on an approval that count against no admission place
    /// (`limits.maxParkedRuns`, default 1000).
    pub max_parked_runs: u32,
    /// Longest output text of a run (`limits.maxOutputBytes`, default 1MiB).
    pub max_output_bytes: u64,
    /// Memory for the kept histories of recently continued sessions, estimated
    /// (`limits.keptHistoryBytes`, default 24MiB).
    pub kept_history_bytes: u64,
}

#[derive(Debug, Clone)]
pub struct GovernanceConfig {
    pub default: Decision,
    pub rules: Vec<PolicyRule>,
    pub approval_timeout: Duration,
    pub on_timeout: TimeoutAction,
    pub policy_timeout: Duration,
    /// `redact.patterns`, compiled (with a size limit) at load.
    pub redact_patterns: Vec<regex::Regex>,
}

#[derive(Debug, Clone)]
pub struct PolicyRule {
    pub name: String,
    /// Tool id patterns; `*` matches any run of characters.
    pub tools: Vec<String>,
    pub agents: Vec<String>,
    pub risk: Vec<Risk>,
    /// Trusted labels: tool, agent, caller's key, Runtime.
    pub labels: BTreeMap<String, String>,
    /// Client-supplied request metadata; only `deny`/`needs_approval` rules carry it.
    pub metadata: BTreeMap<String, String>,
    pub decision: Decision,
    pub reason: Option<String>,
}

#[derive(Debug, Clone)]
pub struct RecoveryConfig {
    pub max_attempts: u32,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub retry_on: Vec<RetryKind>,
    pub resume_on_start: bool,
}

#[derive(Debug, Clone)]
pub struct MemoryConfig {
    pub enabled: bool,
    pub write_requires_approval: bool,
    pub max_content_bytes: usize,
    /// Compaction archives active records not updated for this long.
    pub ttl: Option<Duration>,
    pub providers: Vec<MemoryProviderConfig>,
}

impl MemoryConfig {
    pub fn provider(&self, name: &str) -> Option<&MemoryProviderConfig> {
        self.providers.iter().find(|p| p.name == name)
    }
}

/// An external memory service.
#[derive(Debug, Clone)]
pub struct MemoryProviderConfig {
    pub name: String,
    pub url: String,
    pub api_key_env: Option<String>,
    pub timeout: Duration,
}

/// A spend cap (`Runtime.spec.budgets[]`): tokens and/or cost per subject of its scope
/// within a window.
#[derive(Debug, Clone)]
pub struct BudgetConfig {
    pub name: String,
    pub scope: BudgetScope,
    pub matcher: SpendMatch,
    pub max_tokens: Option<u64>,
    /// In the currency of `pricing`.
    pub max_cost: Option<f64>,
    pub window: BudgetWindow,
}

/// The span a budget counts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetWindow {
    /// The last `Duration`, counted in sixtieths of it (see `spend::Window`).
    Rolling(Duration),
    /// The current UTC day.
    CalendarDay,
    /// The current UTC month.
    CalendarMonth,
    /// Forever.
    Total,
}

impl BudgetWindow {
    /// As written in YAML.
    pub fn describe(&self) -> String {
        match self {
            Self::Rolling(duration) => crate::workspace::units::format_duration(*duration),
            Self::CalendarDay => "calendarDay".into(),
            Self::CalendarMonth => "calendarMonth".into(),
            Self::Total => "total".into(),
        }
    }
}

/// Which calls a budget or rate limit counts: every listed condition holds (an empty list
/// or map is no condition).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpendMatch {
    pub keys: Vec<String>,
    pub agents: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

impl SpendMatch {
    pub fn matches(&self, key: &str, key_labels: &BTreeMap<String, String>, agent: &str) -> bool {
        (self.keys.is_empty() || self.keys.iter().any(|k| k == key))
            && (self.agents.is_empty() || self.agents.iter().any(|a| a == agent))
            && self
                .labels
                .iter()
                .all(|(name, value)| key_labels.get(name) == Some(value))
    }
}

/// A token bucket (`Runtime.spec.rateLimits[]`) per key or agent.
#[derive(Debug, Clone)]
pub struct RateLimitConfig {
    pub name: String,
    pub scope: RateLimitScope,
    pub matcher: SpendMatch,
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
pub struct NarrationConfig {
    pub enabled: bool,
    pub style: NarrationStyle,
}

#[derive(Debug, Clone)]
pub struct McpServerConfig {
    pub name: String,
    pub transport: McpTransport,
    pub timeout: Duration,
}

#[derive(Debug, Clone)]
pub enum McpTransport {
    /// A child process speaking MCP on stdio.
    Stdio(CommandConfig),
    /// Streamable HTTP; header values come from the named environment variables.
    Http {
        url: String,
        headers_env: BTreeMap<String, String>,
    },
}

/// A program to start without a shell.
#[derive(Debug, Clone)]
pub struct CommandConfig {
    /// Absolute path for workspace programs; a bare name is looked up on PATH.
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Environment variables passed through; all others are scrubbed.
    pub env: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub description: Option<String>,
    pub backend: Backend,
    pub model: Option<String>,
    /// The system instructions (from `instructions` or the file `instructionsFile` names).
    pub instructions: Option<String>,
    pub tools: Vec<String>,
    pub subagents: Vec<String>,
    pub skills: Vec<SkillFile>,
    pub max_iterations: u32,
    pub timeout: Duration,
    /// `None`: the agent remembers nothing.
    pub memory: Option<AgentMemoryConfig>,
    /// Always empty for now: a non-empty `contract.requiredEvidenceTools` is rejected.
    pub required_evidence_tools: Vec<String>,
    pub backend_config: serde_json::Map<String, serde_json::Value>,
    pub script: Vec<ScriptStep>,
    pub endpoint: Option<EndpointConfig>,
    /// How long this agent's ended requests are kept (`None`: the store's window).
    pub retention: Option<Duration>,
    /// `Some`: the agent accepts tools from the client, each governed with this risk.
    pub client_tools: Option<Risk>,
    /// The JSON Schema every answer of the agent satisfies, compiled once.
    pub response_schema: Option<ResponseSchema>,
}

/// An agent's `responseSchema`.
#[derive(Clone)]
pub struct ResponseSchema {
    pub schema: serde_json::Value,
    pub validator: Arc<jsonschema::Validator>,
}

impl fmt::Debug for ResponseSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.schema.fmt(f)
    }
}

/// `store.retention`, compiled. Pruning runs when any window is set (here or on an agent).
#[derive(Debug, Clone)]
pub struct RetentionConfig {
    /// How long an ended request is kept (`None`: forever, unless its agent says otherwise).
    pub requests: Option<Duration>,
    /// The newest ended requests kept whatever their age.
    pub min_keep: u64,
    /// Time between two pruning passes.
    pub every: Duration,
    /// Where pruned requests are archived first (absolute, inside the workspace).
    pub archive_dir: Option<PathBuf>,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            requests: None,
            min_keep: 1_000,
            every: Duration::from_secs(600),
            archive_dir: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct SkillFile {
    /// The file name without extension, as the skills tool offers it.
    pub name: String,
    pub path: PathBuf,
}

#[derive(Debug, Clone)]
pub struct AgentMemoryConfig {
    /// Namespace templates, in recall order; writes go to the first one a request fills.
    pub namespaces: Vec<String>,
    pub recall: bool,
    pub max_recall: u32,
    /// A provider of `Runtime.spec.memory.providers`; `None`: the store.
    pub provider: Option<String>,
}

#[derive(Debug, Clone)]
pub enum ScriptStep {
    Reply(String),
    ToolCall {
        tool: String,
        arguments: serde_json::Map<String, serde_json::Value>,
    },
}

#[derive(Debug, Clone)]
pub struct EndpointConfig {
    pub url: String,
    pub api_key_env: Option<String>,
    pub timeout: Duration,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelCapabilities {
    pub tools: bool,
    pub streaming: bool,
    pub vision: bool,
    pub json_schema: bool,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub id: String,
    pub provider: Provider,
    pub base_url: UpstreamUrl,
    pub api_key_env: Option<String>,
    pub upstream_model: String,
    pub capabilities: ModelCapabilities,
    pub context_window: Option<u64>,
    pub pricing: Option<Pricing>,
    /// `maxOutputTokens`: the most one answer may hold.
    pub max_output_tokens: Option<u64>,
    pub timeout: Duration,
    pub fallbacks: Vec<String>,
}

/// Where a model's upstream is: written in YAML, or read from the environment at call time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamUrl {
    Fixed(String),
    FromEnv(String),
}

#[derive(Debug, Clone, Copy)]
pub struct Pricing {
    pub input_per_m_tok: f64,
    pub output_per_m_tok: f64,
}

impl Pricing {
    /// The price of one call's usage, in USD.
    pub fn cost_usd(&self, usage: &crate::adapters::Usage) -> f64 {
        self.cost_of(usage.prompt_tokens, usage.completion_tokens)
    }

    /// The price of `prompt` input and `completion` output tokens.
    pub fn cost_of(&self, prompt: u64, completion: u64) -> f64 {
        (prompt as f64 * self.input_per_m_tok + completion as f64 * self.output_per_m_tok)
            / 1_000_000.0
    }
}

#[derive(Clone)]
pub struct ToolConfig {
    pub id: String,
    pub description: Option<String>,
    pub input_schema: serde_json::Value,
    /// The compiled `input_schema`, built once here so the gateway only validates.
    pub input_validator: Arc<jsonschema::Validator>,
    pub risk: Risk,
    pub labels: BTreeMap<String, String>,
    pub timeout: Duration,
    /// What a resumed run does with a call of this tool that was interrupted by a crash.
    pub on_interrupted: InterruptedAction,
    pub implementation: ToolImplementation,
}

impl fmt::Debug for ToolConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolConfig")
            .field("id", &self.id)
            .field("risk", &self.risk)
            .field("timeout", &self.timeout)
            .field("on_interrupted", &self.on_interrupted)
            .field("implementation", &self.implementation)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
pub enum ToolImplementation {
    Http {
        method: HttpMethod,
        url: String,
        headers_env: BTreeMap<String, String>,
        max_response_bytes: u64,
    },
    Command {
        command: CommandConfig,
        max_output_bytes: u64,
    },
    Mcp {
        server: String,
        tool: String,
        /// Largest result accepted, as serialized JSON.
        max_output_bytes: u64,
    },
    Builtin(BuiltinTool),
    /// A tool the `/v1` client supplied for one request (`client.<name>`): the gateway
    /// governs its calls and hands the allowed ones back to the client, never running them.
    Client,
    /// Another agent, delegated to: an agent's `subagents` are offered to it as tools
    /// `agents.<name>` (built by the gateway, never declared in a catalog).
    Subagent(String),
}

impl ToolImplementation {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Http { .. } => "http",
            Self::Command { .. } => "command",
            Self::Mcp { .. } => "mcp",
            Self::Builtin(_) => "builtin",
            Self::Subagent(_) => "subagent",
            Self::Client => "client",
        }
    }
}

/// Tools built into the binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum BuiltinTool {
    /// The current time (UTC, RFC 3339).
    #[serde(rename = "clock.now")]
    ClockNow,
    /// Serves the calling agent's skill files.
    #[serde(rename = "skills.get")]
    SkillsGet,
    /// Proposes a memory record in the calling agent's namespace (its `memory`).
    #[serde(rename = "memory.write")]
    MemoryWrite,
}

impl BuiltinTool {
    pub const ALL: [(&'static str, BuiltinTool); 3] = [
        ("clock.now", BuiltinTool::ClockNow),
        ("skills.get", BuiltinTool::SkillsGet),
        ("memory.write", BuiltinTool::MemoryWrite),
    ];

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, tool)| *tool)
    }

    /// The arguments a catalog entry without `inputSchema` takes.
    pub fn input_schema(self) -> serde_json::Value {
        match self {
            Self::ClockNow | Self::SkillsGet => serde_json::json!({ "type": "object" }),
            Self::MemoryWrite => serde_json::json!({
                "type": "object",
                "properties": {
                    "content": { "type": "string", "minLength": 1, "description": "The fact to remember, self-contained" },
                    "metadata": { "type": "object", "description": "Labels kept with the record" },
                },
                "required": ["content"],
                "additionalProperties": false,
            }),
        }
    }
}

#[derive(Debug, Clone)]
pub struct WorkflowConfig {
    pub name: String,
    pub description: Option<String>,
    pub entry: String,
    pub nodes: Vec<WorkflowNode>,
    /// In order: the first whose condition holds is taken.
    pub edges: Vec<WorkflowEdge>,
    /// Most node executions per request.
    pub max_steps: u32,
    pub expose_as_model: bool,
}

impl WorkflowConfig {
    pub fn node(&self, id: &str) -> Option<&WorkflowNode> {
        self.nodes.iter().find(|node| node.id == id)
    }
}

#[derive(Debug, Clone)]
pub struct WorkflowNode {
    pub id: String,
    pub target: WorkflowTarget,
    pub input: NodeInput,
    /// Tool nodes: their arguments (an object); `None`: the previous agent node's structured
    /// output.
    pub arguments: Option<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkflowTarget {
    Agent(String),
    Tool(String),
}

#[derive(Debug, Clone)]
pub struct WorkflowEdge {
    pub from: String,
    pub to: String,
    pub when: Option<EdgeCondition>,
}

/// An edge's condition, on the recorded outcome of the node it leaves.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum EdgeCondition {
    Status(NodeOutcome),
    Decision(NodeDecision),
    Output(OutputCondition),
}
