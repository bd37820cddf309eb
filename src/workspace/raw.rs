//! Raw workspace documents: exactly what the YAML says, checked only for shape.
//!
//! These types reject unknown fields, carry the position of every value later checks judge
//! ([`Located`]), and derive the JSON Schema that `stable-harness schema` prints, so editors
//! validate YAML against the same types the loader uses. [`super::compile`] turns them into
//! the checked inventory.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;

use super::located::Located;

/// The only `apiVersion` this build understands.
pub const API_VERSION: &str = "stable-harness/v1";

/// A string naming a duration such as `200ms`, `120s`, `5m`, `24h` or `1h30m`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct DurationText(pub String);

impl JsonSchema for DurationText {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": "^([0-9]+(ms|s|m|h|d))+$",
            "description": "A duration: one or more <integer><unit> parts, units ms, s, m, h, d (e.g. `120s`, `1h30m`).",
        })
    }
}

/// A byte size such as `4MiB`, `512KiB` or a plain number of bytes.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct ByteSizeText(pub String);

impl JsonSchema for ByteSizeText {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ByteSize".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [
                { "type": "string", "pattern": "^[0-9]+ ?(B|KB|MB|GB|KiB|MiB|GiB)?$" },
                { "type": "integer", "minimum": 0 }
            ],
            "description": "A size in bytes, optionally with a unit B, KB, MB, GB, KiB, MiB, GiB (e.g. `4MiB`).",
        })
    }
}

/// A located name of an environment variable (fields ending in `Env`): secrets never live in YAML.
pub type EnvVarRef = Located<String>;

/// One YAML document of a workspace: `apiVersion`, `kind`, `metadata` and a kind-specific `spec`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawDocument<S> {
    pub api_version: Located<String>,
    pub kind: Located<String>,
    pub metadata: Metadata,
    pub spec: S,
}

/// Just enough of a document to learn its kind before reading it with the right type.
#[derive(Debug, Deserialize)]
pub struct DocumentKindProbe {
    #[serde(default)]
    pub kind: Option<Located<String>>,
    #[serde(default)]
    pub metadata: Option<NameProbe>,
}

/// `metadata.name`, if it is a string, whatever else the document holds.
#[derive(Debug, Deserialize)]
pub struct NameProbe {
    #[serde(default)]
    pub name: Option<String>,
}

/// `metadata` of every document.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Metadata {
    /// Unique per kind; `[a-z0-9][a-z0-9._-]*`.
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]*$"))]
    pub name: Located<String>,
    /// Free-form labels, usable by governance rules.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

// ---------------------------------------------------------------------------------------------
// Runtime

/// `kind: Runtime` — the service as a whole (exactly one per workspace).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RuntimeSpec {
    /// Agent used when a request names none.
    #[serde(default)]
    pub default_agent: Option<Located<String>>,
    #[serde(default)]
    pub store: Option<StoreSpec>,
    #[serde(default)]
    pub protocols: ProtocolsSpec,
    #[serde(default)]
    pub limits: LimitsSpec,
    #[serde(default)]
    pub governance: GovernanceSpec,
    #[serde(default)]
    pub recovery: RecoverySpec,
    /// Memory: whether agents may remember, how writes are governed, where memory lives.
    #[serde(default)]
    pub memory: MemorySpec,
    /// Spend caps in tokens and/or cost, per key, agent, session or the whole workspace;
    /// every matching budget applies.
    #[serde(default)]
    pub budgets: Vec<BudgetSpec>,
    /// Token buckets on requests and tokens per minute, per key or agent.
    #[serde(default)]
    pub rate_limits: Vec<RateLimitSpec>,
    #[serde(default)]
    pub progress: ProgressSpec,
    #[serde(default)]
    pub cli: CliSpec,
    #[serde(default)]
    pub mcp_servers: Vec<McpServerSpec>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct StoreSpec {
    /// `sqlite://PATH` (relative to the workspace) or `postgres://...`.
    #[serde(default)]
    pub url: Option<Located<String>>,
    /// How long a run stays leased to the instance executing it without a renewal (renewed
    /// every third of it); after that another instance may take it over. Default `30s`, at
    /// least `1s`.
    #[serde(default)]
    pub lease_duration: Option<Located<DurationText>>,
    /// The most the database may hold (e.g. `10GiB`): past it, writes wait as on a full disk
    /// (new requests get 503) until pruning frees room or the limit is raised.
    #[serde(default)]
    pub max_size: Option<Located<ByteSizeText>>,
    /// What is kept, and for how long; without it, everything is kept.
    #[serde(default)]
    pub retention: Option<RetentionSpec>,
}

/// `store.retention`: ended requests past the window are pruned with everything they own.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RetentionSpec {
    /// How long an ended request is kept (e.g. `30d`; agents may override it).
    #[serde(default)]
    pub requests: Option<Located<DurationText>>,
    /// The newest ended requests kept whatever their age (default 1000).
    #[serde(default)]
    pub min_keep: Option<Located<u64>>,
    /// How often a pruning pass runs (default `10m`).
    #[serde(default)]
    pub every: Option<Located<DurationText>>,
    /// Pruned requests are first written here as JSON Lines.
    #[serde(default)]
    pub archive: Option<ArchiveSpec>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ArchiveSpec {
    /// A folder of the workspace (created when missing).
    pub dir: Located<String>,
}

/// An agent's own retention window, overriding `store.retention.requests`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AgentRetentionSpec {
    pub requests: Located<DurationText>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProtocolsSpec {
    #[serde(default)]
    pub openai: OpenAiProtocolSpec,
    #[serde(default)]
    pub admin: AdminProtocolSpec,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OpenAiProtocolSpec {
    /// Serve `/v1` (default true).
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Environment variables holding the client keys accepted on `/v1` and `/runtime`.
    #[serde(default)]
    pub api_keys_env: Vec<EnvVarRef>,
    /// Named client keys: a stable identity (the name) and labels governance rules may match.
    #[serde(default)]
    pub keys: Vec<ClientKeySpec>,
    /// How long a `/v1` call waits on a pending approval (default 120s).
    #[serde(default)]
    pub approval_wait: Option<Located<DurationText>>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AdminProtocolSpec {
    /// Environment variables holding the operator keys accepted on `/admin`.
    #[serde(default)]
    pub api_keys_env: Vec<EnvVarRef>,
    /// Named operator keys: the name is the key's identity in audit records.
    #[serde(default)]
    pub keys: Vec<AdminKeySpec>,
}

/// A named client key. Names are unique across client and admin keys.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientKeySpec {
    /// The key's identity; `[a-z0-9][a-z0-9._-]*`.
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]*$"))]
    pub name: Located<String>,
    /// Environment variable holding the key (comma-separated values allowed).
    pub key_env: EnvVarRef,
    /// Trusted labels of the caller, matched by governance `match.labels`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A named operator key.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AdminKeySpec {
    /// The key's identity; `[a-z0-9][a-z0-9._-]*`.
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]*$"))]
    pub name: Located<String>,
    /// Environment variable holding the key (comma-separated values allowed).
    pub key_env: EnvVarRef,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LimitsSpec {
    /// Largest accepted request body (default 4MiB).
    #[serde(default)]
    pub max_request_bytes: Option<Located<ByteSizeText>>,
    /// Runs executing at once; more are queued or refused with 429 (default 256).
    #[serde(default)]
    pub max_concurrent_runs: Option<Located<u32>>,
    /// Runs that may wait on an approval without counting against admission (default
    /// 1000): a long approval queue never turns new requests away. Beyond it, a parked run
    /// keeps its admission place.
    #[serde(default)]
    pub max_parked_runs: Option<Located<u32>>,
    /// Longest output text a run may produce (default 1MiB).
    #[serde(default)]
    pub max_output_bytes: Option<Located<ByteSizeText>>,
    /// Memory for the newest histories of recently continued sessions, by their estimated
    /// size (default 24MiB): a turn of a kept conversation reads from the store only what
    /// the turn before added. One conversation's history may take half of it at most.
    #[serde(default)]
    pub kept_history_bytes: Option<Located<ByteSizeText>>,
}

/// A policy outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Allow,
    Deny,
    NeedsApproval,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GovernanceSpec {
    /// Decision when no rule matches (default allow).
    #[serde(default)]
    pub default: Option<Decision>,
    /// Evaluated in order; the first match wins.
    #[serde(default)]
    pub rules: Vec<PolicyRuleSpec>,
    #[serde(default)]
    pub approvals: ApprovalsSpec,
    /// An external policy that does not answer in time is a deny (default 5s).
    #[serde(default)]
    pub policy_timeout: Option<Located<DurationText>>,
    /// Secret patterns redacted from everything stored and logged.
    #[serde(default)]
    pub redact: RedactSpec,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RedactSpec {
    /// Regular expressions (Rust `regex` syntax); every match is replaced by `[redacted]`.
    #[serde(default)]
    pub patterns: Vec<Located<String>>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PolicyRuleSpec {
    pub name: Located<String>,
    /// All given criteria must hold; an empty match matches every call.
    #[serde(default, rename = "match")]
    pub matches: PolicyMatchSpec,
    pub decision: Decision,
    /// Shown to the model and the operator when this rule denies or holds a call.
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PolicyMatchSpec {
    /// Tool ids; `*` matches any run of characters (`files.*`).
    #[serde(default)]
    pub tools: Vec<Located<String>>,
    /// Agent names.
    #[serde(default)]
    pub agents: Vec<Located<String>>,
    #[serde(default)]
    pub risk: Vec<Risk>,
    /// Trusted labels that must all hold: looked up on the tool, then the agent, then the
    /// caller's key, then the Runtime.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Client-supplied request metadata that must all hold. Clients control it, so a rule
    /// using it may only decide `deny` or `needs_approval`.
    #[serde(default)]
    pub metadata: Option<Located<BTreeMap<String, String>>>,
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, JsonSchema, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Risk {
    Low,
    Medium,
    High,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TimeoutAction {
    Deny,
    Approve,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ApprovalsSpec {
    /// How long an approval may stay pending (default 24h).
    #[serde(default)]
    pub timeout: Option<Located<DurationText>>,
    /// What an expired approval means for the call (default deny).
    #[serde(default)]
    pub on_timeout: Option<TimeoutAction>,
}

/// Upstream error kinds the runtime may retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryKind {
    Timeout,
    #[serde(rename = "upstream_5xx")]
    Upstream5xx,
    RateLimited,
    Connection,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RecoverySpec {
    /// Attempts per model call, the first included (default 3).
    #[serde(default)]
    pub max_attempts: Option<Located<u32>>,
    #[serde(default)]
    pub backoff: BackoffSpec,
    /// Error kinds that are retried (default: all).
    #[serde(default)]
    pub retry_on: Option<Vec<RetryKind>>,
    /// Continue runs interrupted by a crash when the server starts (default true).
    #[serde(default)]
    pub resume_on_start: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BackoffSpec {
    /// First delay (default 200ms).
    #[serde(default)]
    pub initial: Option<Located<DurationText>>,
    /// Largest delay (default 5s).
    #[serde(default)]
    pub max: Option<Located<DurationText>>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MemorySpec {
    /// Agents may have `memory` (default false).
    #[serde(default)]
    pub enabled: Option<Located<bool>>,
    #[serde(default)]
    pub write: MemoryWriteSpec,
    /// Compaction archives active records not updated for this long (default: never).
    #[serde(default)]
    pub ttl: Option<Located<DurationText>>,
    /// External memory services agents may use instead of the store (`provider`).
    #[serde(default)]
    pub providers: Vec<MemoryProviderSpec>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MemoryWriteSpec {
    /// Memory candidates wait for an operator before they are recalled (default true).
    #[serde(default)]
    pub require_approval: Option<bool>,
    /// Largest content of one record (default 4KiB, at most 64KiB).
    #[serde(default)]
    pub max_content_bytes: Option<Located<ByteSizeText>>,
}

/// An external memory service (`stable-harness.memory/v1`).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MemoryProviderSpec {
    pub name: Located<String>,
    /// Base URL: the runtime posts to `{url}/recall` and `{url}/write`.
    pub url: Located<String>,
    /// Environment variable holding the bearer key sent to the service.
    #[serde(default)]
    pub api_key_env: Option<EnvVarRef>,
    /// Per call (default 2s, at most 60s). A slower answer counts as a failure.
    #[serde(default)]
    pub timeout: Option<Located<DurationText>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum BudgetScope {
    Agent,
    Session,
    ApiKey,
    Workspace,
}

/// A spend cap: `maxTokens` and/or `maxCost` within a `window`, kept per subject of its
/// `scope` (each key, agent or session has its own counter; `workspace` has one).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BudgetSpec {
    /// Named in refusals (`param`), events, `/admin/budgets` and metrics.
    pub name: Located<String>,
    pub scope: BudgetScope,
    /// Which calls it counts (default: all).
    #[serde(default, rename = "match")]
    pub matcher: Option<SpendMatchSpec>,
    /// Prompt plus completion tokens.
    #[serde(default)]
    pub max_tokens: Option<Located<u64>>,
    /// In the currency of the models' `pricing`.
    #[serde(default)]
    pub max_cost: Option<Located<f64>>,
    /// A rolling duration (`24h`, at most `30d`), `calendarDay`, `calendarMonth` (UTC) or
    /// `total`.
    pub window: Located<String>,
}

/// Which calls a budget or rate limit counts: all of the listed conditions hold.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SpendMatchSpec {
    /// Client key identities (a named key's name, or `key-` and its fingerprint).
    #[serde(default)]
    pub keys: Vec<Located<String>>,
    /// Agent ids.
    #[serde(default)]
    pub agents: Vec<Located<String>>,
    /// Labels of the calling named key.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum RateLimitScope {
    ApiKey,
    Agent,
}

/// A token bucket per key or agent: a minute's worth may be spent at once, refilled evenly.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RateLimitSpec {
    pub name: Located<String>,
    pub scope: RateLimitScope,
    #[serde(default, rename = "match")]
    pub matcher: Option<SpendMatchSpec>,
    #[serde(default)]
    pub requests_per_minute: Option<Located<u64>>,
    #[serde(default)]
    pub tokens_per_minute: Option<Located<u64>>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProgressSpec {
    #[serde(default)]
    pub narration: NarrationSpec,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NarrationStyle {
    Concise,
    Verbose,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NarrationSpec {
    #[serde(default)]
    pub enabled: Option<bool>,
    #[serde(default)]
    pub style: Option<NarrationStyle>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CliSpec {
    #[serde(default)]
    pub events: CliEventsSpec,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CliEventsSpec {
    /// Event types `stable-harness run` prints besides the final output.
    #[serde(default)]
    pub include: Vec<Located<String>>,
}

/// An MCP server whose tools the ToolCatalog may expose (`mcp: {server, tool}`).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct McpServerSpec {
    pub name: Located<String>,
    /// Start the server as a child process speaking MCP over stdio.
    #[serde(default)]
    pub command: Option<Located<CommandSpec>>,
    /// Or reach it over streamable HTTP.
    #[serde(default)]
    pub url: Option<Located<String>>,
    /// HTTP headers whose values come from environment variables.
    #[serde(default)]
    pub headers_env: BTreeMap<String, EnvVarRef>,
    /// Per-call timeout (default 30s).
    #[serde(default)]
    pub timeout: Option<Located<DurationText>>,
}

/// A program started without a shell.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CommandSpec {
    /// A path under the workspace (`resources/tools/x.sh`) or, for MCP servers, a program on PATH.
    pub program: Located<String>,
    #[serde(default)]
    pub args: Vec<String>,
    /// Environment variables passed through to the process; everything else is scrubbed.
    #[serde(default)]
    pub env: Vec<EnvVarRef>,
}

// ---------------------------------------------------------------------------------------------
// Agent

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The native loop over an OpenAI-compatible Chat Completions upstream.
    Openai,
    /// Plays `spec.script`, for demos and tests without a model.
    Scripted,
    /// Delegates to a customer-owned agent service.
    Http,
}

/// `kind: Agent`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AgentSpec {
    #[serde(default)]
    pub description: Option<String>,
    pub backend: Located<Backend>,
    /// Model id from a ModelCatalog (required for `openai`).
    #[serde(default)]
    pub model: Option<Located<String>>,
    #[serde(default)]
    pub instructions: Option<Located<String>>,
    /// Workspace-relative file with the instructions.
    #[serde(default)]
    pub instructions_file: Option<Located<String>>,
    /// Tool ids from a ToolCatalog; nothing else is callable.
    #[serde(default)]
    pub tools: Vec<Located<String>>,
    /// Other agents this one may delegate to.
    #[serde(default)]
    pub subagents: Vec<Located<String>>,
    /// Files under `resources/skills/`, offered through the `skills.get` tool.
    #[serde(default)]
    pub skills: Vec<Located<String>>,
    /// Model<->tool round trips per run (default 8).
    #[serde(default)]
    pub max_iterations: Option<Located<u32>>,
    /// Active execution time per run (default 120s).
    #[serde(default)]
    pub timeout: Option<Located<DurationText>>,
    /// What the agent remembers: recalled before each run, written with `memory.write`.
    #[serde(default)]
    pub memory: Option<Located<AgentMemorySpec>>,
    #[serde(default)]
    pub contract: Option<ContractSpec>,
    /// Passed to the adapter untouched (temperature, etc.).
    #[serde(default)]
    pub backend_config: Option<Located<serde_json::Map<String, serde_json::Value>>>,
    /// `scripted` only: the steps played for every request.
    #[serde(default)]
    pub script: Option<Located<Vec<ScriptStep>>>,
    /// `http` only: the agent service.
    #[serde(default)]
    pub endpoint: Option<Located<EndpointSpec>>,
    /// How long this agent's ended requests are kept (overrides `store.retention.requests`).
    #[serde(default)]
    pub retention: Option<AgentRetentionSpec>,
    /// Tools the `/v1` client supplies (Responses or Chat Completions `tools`), offered to the
    /// model beside the agent's own and governed as `client.<name>` (`openai` backend only).
    #[serde(default)]
    pub client_tools: Option<Located<ClientToolsSpec>>,
    /// The agent answers JSON valid against this schema (an object); any other answer fails
    /// its run. Workflows may branch on it and pass it to a tool node.
    #[serde(default)]
    pub response_schema: Option<Located<serde_json::Value>>,
}

/// An agent's opt-in to tools supplied by the client.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientToolsSpec {
    /// Offer the client's tools to the model (default false: a non-empty `tools` is refused).
    pub enabled: bool,
    /// The risk policy rules see for every client tool (default medium).
    #[serde(default)]
    pub risk: Option<Risk>,
}

/// An agent's memory (needs `Runtime.spec.memory.enabled: true`).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AgentMemorySpec {
    /// A namespace template (default `agent/{agentId}`): `agent/…`, `session/…` or
    /// `user/…`, with `{agentId}`, `{sessionId}` and `{user}` filled from the request.
    #[serde(default)]
    pub namespace: Option<Located<String>>,
    /// More namespace templates, recalled after `namespace`. `memory.write` writes to the
    /// first one the request can fill.
    #[serde(default)]
    pub namespaces: Vec<Located<String>>,
    /// Search the namespaces before each run (default true).
    #[serde(default)]
    pub recall: Option<bool>,
    /// Records recalled per namespace (default 5, 1 to 50).
    #[serde(default)]
    pub max_recall: Option<Located<u32>>,
    /// A provider of `Runtime.spec.memory.providers` (default: the store).
    #[serde(default)]
    pub provider: Option<Located<String>>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ContractSpec {
    /// Not supported yet (a non-empty list is rejected): tools that must have run for the
    /// run to count as completed.
    #[serde(default)]
    pub required_evidence_tools: Option<Located<Vec<Located<String>>>>,
}

/// One step of a scripted agent.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub enum ScriptStep {
    /// Stream this text (`{{input}}` is replaced by the last user message).
    Reply(String),
    /// Call a tool through the gateway, exactly like a model would.
    ToolCall(ScriptToolCall),
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScriptToolCall {
    pub tool: Located<String>,
    #[serde(default)]
    pub arguments: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EndpointSpec {
    pub url: Located<String>,
    #[serde(default)]
    pub api_key_env: Option<EnvVarRef>,
    #[serde(default)]
    pub timeout: Option<Located<DurationText>>,
}

// ---------------------------------------------------------------------------------------------
// ModelCatalog

/// `kind: ModelCatalog`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ModelCatalogSpec {
    pub models: Vec<ModelSpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Provider {
    /// Any server speaking OpenAI Chat Completions.
    OpenaiCompatible,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ModelSpec {
    pub id: Located<String>,
    pub provider: Provider,
    #[serde(default)]
    pub base_url: Option<Located<String>>,
    #[serde(default)]
    pub base_url_env: Option<EnvVarRef>,
    #[serde(default)]
    pub api_key_env: Option<EnvVarRef>,
    /// The model name sent upstream.
    pub upstream_model: Located<String>,
    #[serde(default)]
    pub capabilities: CapabilitiesSpec,
    #[serde(default)]
    pub context_window: Option<u64>,
    #[serde(default)]
    pub pricing: Option<PricingSpec>,
    /// The most tokens one answer may hold: what a budget reserves for a call whose client
    /// sets no `max_tokens`.
    #[serde(default)]
    pub max_output_tokens: Option<Located<u64>>,
    /// Per upstream call (default 60s).
    #[serde(default)]
    pub timeout: Option<Located<DurationText>>,
    /// Other model ids, tried in order on retryable errors.
    #[serde(default)]
    pub fallbacks: Vec<Located<String>>,
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CapabilitiesSpec {
    #[serde(default)]
    pub tools: Option<bool>,
    #[serde(default)]
    pub streaming: Option<bool>,
    #[serde(default)]
    pub vision: Option<bool>,
    #[serde(default)]
    pub json_schema: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PricingSpec {
    /// Price per million input tokens.
    pub input_per_m_tok: Located<f64>,
    /// Price per million output tokens.
    pub output_per_m_tok: Located<f64>,
}

// ---------------------------------------------------------------------------------------------
// ToolCatalog

/// `kind: ToolCatalog`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ToolCatalogSpec {
    pub tools: Vec<ToolSpec>,
}

/// A tool; exactly one of `http`, `command`, `mcp`, `builtin` says how it runs.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ToolSpec {
    pub id: Located<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// JSON Schema of the arguments (default: any object).
    #[serde(default)]
    pub input_schema: Option<Located<serde_json::Value>>,
    /// Policy input (default low).
    #[serde(default)]
    pub risk: Option<Risk>,
    /// Policy input.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Execution timeout (default 30s).
    #[serde(default)]
    pub timeout: Option<Located<DurationText>>,
    /// What happens to a call interrupted by a crash (started, no recorded result) when its
    /// run resumes (default `ask` for `risk: high`, `rerun` otherwise).
    #[serde(default)]
    pub on_interrupted: Option<InterruptedAction>,
    #[serde(default)]
    pub http: Option<Located<HttpToolSpec>>,
    #[serde(default)]
    pub command: Option<Located<CommandToolSpec>>,
    #[serde(default)]
    pub mcp: Option<Located<McpToolSpec>>,
    #[serde(default)]
    pub builtin: Option<Located<String>>,
}

/// What a resumed run does with a call that started but has no recorded result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InterruptedAction {
    /// Run it again with the same idempotency key.
    Rerun,
    /// Hold it as an approval ("outcome unknown after a restart"); an operator decides.
    Ask,
    /// Give the model an error result instead of running it again.
    Fail,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum HttpMethod {
    Get,
    Post,
    Put,
    Patch,
    Delete,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HttpToolSpec {
    /// Default POST (arguments as the JSON body; GET sends them as query parameters).
    #[serde(default)]
    pub method: Option<HttpMethod>,
    pub url: Located<String>,
    /// Header name -> environment variable holding its value.
    #[serde(default)]
    pub headers_env: BTreeMap<String, EnvVarRef>,
    /// Largest response accepted (default 1MiB).
    #[serde(default)]
    pub max_response_bytes: Option<Located<ByteSizeText>>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CommandToolSpec {
    /// Workspace-relative executable; JSON arguments on stdin, JSON on stdout.
    pub program: Located<String>,
    #[serde(default)]
    pub args: Vec<String>,
    /// Environment variables passed through; everything else is scrubbed.
    #[serde(default)]
    pub env: Vec<EnvVarRef>,
    /// Largest stdout accepted (default 1MiB).
    #[serde(default)]
    pub max_output_bytes: Option<Located<ByteSizeText>>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct McpToolSpec {
    /// Name of a server in `Runtime.spec.mcpServers`.
    pub server: Located<String>,
    /// The tool's name on that server.
    pub tool: String,
    /// Largest result accepted, as serialized JSON (default 1MiB, like command output).
    #[serde(default)]
    pub max_output_bytes: Option<Located<ByteSizeText>>,
}

// ---------------------------------------------------------------------------------------------
// Workflow

/// `kind: Workflow` — an explicit graph over existing agents and tools.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WorkflowSpec {
    #[serde(default)]
    pub description: Option<String>,
    /// Id of the first node.
    pub entry: Located<String>,
    pub nodes: Vec<WorkflowNodeSpec>,
    #[serde(default)]
    pub edges: Vec<WorkflowEdgeSpec>,
    /// Most node executions per request (1 to 1000); required when the graph has a cycle.
    #[serde(default)]
    pub max_steps: Option<Located<u32>>,
    /// List the workflow in `/v1/models` and run it as a model (default false).
    #[serde(default)]
    pub expose_as_model: bool,
}

/// A node runs exactly one agent or one tool.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WorkflowNodeSpec {
    pub id: Located<String>,
    #[serde(default)]
    pub agent: Option<Located<String>>,
    #[serde(default)]
    pub tool: Option<Located<String>>,
    /// Agent nodes: `previous` (default) gets the previous agent node's output, `original` the
    /// request's input.
    #[serde(default)]
    pub input: Option<Located<NodeInput>>,
    /// Tool nodes: the arguments (checked against the tool's `inputSchema`); without them, the
    /// previous agent node's structured output (its agent has a `responseSchema`).
    #[serde(default)]
    pub arguments: Option<Located<serde_json::Map<String, serde_json::Value>>>,
}

/// What an agent node is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum NodeInput {
    #[default]
    Previous,
    Original,
}

/// The gateway's decision on a tool node's call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeDecision {
    /// Policy allowed it.
    Allow,
    /// Policy denied it.
    Deny,
    /// An operator approved it.
    Approved,
    /// An operator denied it, or its approval expired.
    Denied,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WorkflowEdgeSpec {
    pub from: Located<String>,
    pub to: Located<String>,
    /// Condition on the run state of `from`; absent means always.
    #[serde(default)]
    pub when: Option<EdgeConditionSpec>,
}

/// Outcome of a node, as the runtime records it (never its text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeOutcome {
    Completed,
    Failed,
}

/// The condition of an edge, on the recorded outcome of the node it leaves: exactly one of
/// `status`, `decision` (tool nodes) and `output`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EdgeConditionSpec {
    #[serde(default)]
    pub status: Option<NodeOutcome>,
    #[serde(default)]
    pub decision: Option<Located<NodeDecision>>,
    /// On the structured output of an agent node whose agent has a `responseSchema`.
    #[serde(default)]
    pub output: Option<Located<OutputCondition>>,
}

/// `output: {pointer, equals}`: the value at a JSON pointer of the node's output.
#[derive(Debug, Clone, Deserialize, JsonSchema, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OutputCondition {
    /// A JSON pointer (`/route`).
    pub pointer: String,
    pub equals: serde_json::Value,
}
