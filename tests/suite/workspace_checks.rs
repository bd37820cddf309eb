//! The workspace compiler's checks, one broken workspace per check (a table), each asserting
//! the exact `file:line:col: message` diagnostics; then a workspace with many problems.

use crate::helpers::{TestWorkspace, stable_harness, stderr};

/// One row: files written over the base workspace (`None` deletes), and every expected line.
struct Case {
    name: &'static str,
    files: &'static [(&'static str, Option<&'static str>)],
    expected: &'static [&'static str],
}

const AGENT: &str = "config/agents/assistant.yaml";
const TOOLS: &str = "config/catalogs/tools.yaml";
const RUNTIME: &str = "config/runtime/workspace.yaml";
const MODELS: &str = "config/catalogs/models.yaml";

const CASES: &[Case] = &[
    Case {
        name: "no runtime",
        files: &[(RUNTIME, None)],
        expected: &[
            "config/: no Runtime document found; a workspace has exactly one (hint: add config/runtime/workspace.yaml with `kind: Runtime`)",
        ],
    },
    Case {
        name: "two runtimes",
        files: &[(
            "config/runtime/second.yaml",
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: second }\nspec: {}\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:2:7: a workspace has exactly one Runtime; another is at config/runtime/second.yaml:2:7",
        ],
    },
    Case {
        name: "duplicate agent name",
        files: &[(
            "config/agents/copy.yaml",
            Some(
                "apiVersion: stable-harness/v1\nkind: Agent\nmetadata:\n  name: assistant\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n",
            ),
        )],
        expected: &[
            "config/agents/copy.yaml:4:9: duplicate agent `assistant` (first defined at config/agents/assistant.yaml:4:9)",
        ],
    },
    Case {
        name: "duplicate tool id",
        files: &[(
            TOOLS,
            Some(
                "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, builtin: clock.now }\n    - { id: clock.now, builtin: clock.now }\n    - { id: echo, builtin: clock.now }\n",
            ),
        )],
        expected: &[
            "config/catalogs/tools.yaml:8:13: duplicate tool `echo` (first defined at config/catalogs/tools.yaml:6:13)",
        ],
    },
    Case {
        name: "name syntax",
        files: &[(
            "config/agents/bad.yaml",
            Some(
                "apiVersion: stable-harness/v1\nkind: Agent\nmetadata:\n  name: Helper Bot\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n",
            ),
        )],
        expected: &[
            "config/agents/bad.yaml:4:9: invalid agent name `Helper Bot`: names match [a-z0-9][a-z0-9._-]* (hint: did you mean `helper-bot`?)",
        ],
    },
    Case {
        name: "unknown default agent",
        files: &[(
            RUNTIME,
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  defaultAgent: asistant\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:5:17: unknown agent `asistant` (hint: did you mean `assistant`?)",
        ],
    },
    Case {
        name: "dangling agent references",
        files: &[(
            AGENT,
            Some(
                "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: defualt\n  tools: [echo, weather.lookup]\n  subagents: [planner]\n",
            ),
        )],
        expected: &[
            "config/agents/assistant.yaml:6:10: unknown model `defualt` (hint: did you mean `default`?)",
            "config/agents/assistant.yaml:7:17: unknown tool `weather.lookup`",
            "config/agents/assistant.yaml:8:15: unknown agent `planner`",
        ],
    },
    Case {
        name: "workflow references",
        files: &[(
            "config/workflows/flow.yaml",
            Some(
                "apiVersion: stable-harness/v1\nkind: Workflow\nmetadata: { name: flow }\nspec:\n  entry: start\n  nodes:\n    - { id: first, agent: assistent }\n    - { id: second, tool: missing.tool }\n    - { id: third }\n  edges:\n    - { from: first, to: nowhere, when: { status: completed } }\n",
            ),
        )],
        expected: &[
            "config/workflows/flow.yaml:5:10: unknown workflow node `start`",
            "config/workflows/flow.yaml:7:27: unknown agent `assistent` (hint: did you mean `assistant`?)",
            "config/workflows/flow.yaml:8:27: unknown tool `missing.tool`",
            "config/workflows/flow.yaml:9:13: workflow node `third` needs exactly one of `agent` or `tool`",
            "config/workflows/flow.yaml:11:26: unknown workflow node `nowhere`",
        ],
    },
    Case {
        name: "model fallbacks",
        files: &[(
            MODELS,
            Some(
                "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: { name: models }\nspec:\n  models:\n    - id: default\n      provider: openai-compatible\n      baseUrl: http://127.0.0.1:9/v1\n      upstreamModel: m\n      fallbacks: [default, backup]\n",
            ),
        )],
        expected: &[
            "config/catalogs/models.yaml:10:19: model `default` lists itself as a fallback",
            "config/catalogs/models.yaml:10:28: unknown model `backup`",
        ],
    },
    Case {
        name: "instructions file missing",
        files: &[(
            AGENT,
            Some(
                "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: default\n  instructionsFile: resources/prompts/missing.md\n",
            ),
        )],
        expected: &[
            "config/agents/assistant.yaml:7:21: `instructionsFile`: file `resources/prompts/missing.md` not found in the workspace",
        ],
    },
    Case {
        name: "paths escaping the workspace",
        files: &[(
            AGENT,
            Some(
                "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: default\n  instructionsFile: ../outside.md\n  skills: [/etc/passwd, resources/prompts/x.md]\n",
            ),
        )],
        expected: &[
            "config/agents/assistant.yaml:7:21: `instructionsFile` path `../outside.md` escapes the workspace (hint: paths are relative to the workspace folder and may not use `..` or start with `/`)",
            "config/agents/assistant.yaml:8:12: `skills` path `/etc/passwd` escapes the workspace (hint: paths are relative to the workspace folder and may not use `..` or start with `/`)",
            "config/agents/assistant.yaml:8:25: `skills` path `resources/prompts/x.md` must be under resources/skills/ (hint: write `resources/skills/resources/prompts/x.md`)",
        ],
    },
    Case {
        name: "command program missing or not executable",
        files: &[
            (
                TOOLS,
                Some(
                    "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - id: echo\n      command: { program: resources/tools/missing.sh }\n    - id: clock.now\n      command: { program: resources/tools/plain.txt }\n",
                ),
            ),
            ("resources/tools/plain.txt", Some("not a program\n")),
        ],
        expected: &[
            "config/catalogs/tools.yaml:7:27: `program`: file `resources/tools/missing.sh` not found in the workspace",
            "config/catalogs/tools.yaml:9:27: program `resources/tools/plain.txt` is not executable (hint: chmod +x resources/tools/plain.txt)",
        ],
    },
    Case {
        name: "durations and sizes",
        files: &[(
            RUNTIME,
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  protocols:\n    openai: { approvalWait: 2 minutes }\n  limits: { maxRequestBytes: 4 megabytes }\n  recovery:\n    backoff: { initial: 0s, max: 5s }\n  governance:\n    approvals: { timeout: 24hours }\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:6:29: `approvalWait`: invalid duration `2 minutes`: unknown unit `minutes` (use ms, s, m, h or d)",
            "config/runtime/workspace.yaml:7:30: `maxRequestBytes`: invalid size `4 megabytes`: unknown unit `megabytes` (use B, KB, MB, GB, KiB, MiB or GiB)",
            "config/runtime/workspace.yaml:9:25: `backoff.initial` must be greater than zero",
            "config/runtime/workspace.yaml:11:27: `approvals.timeout`: invalid duration `24hours`: unknown unit `hours` (use ms, s, m, h or d)",
        ],
    },
    Case {
        name: "invalid JSON Schemas",
        files: &[(
            TOOLS,
            Some(
                "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - id: echo\n      inputSchema: { type: object, properties: { text: { type: strng } } }\n      builtin: clock.now\n    - id: clock.now\n      inputSchema: { type: array }\n      builtin: clock.now\n",
            ),
        )],
        expected: &[
            "config/catalogs/tools.yaml:7:20: tool `echo`: invalid JSON Schema at `/properties/text/type`: \"strng\" is not valid under any of the schemas listed in the 'anyOf' keyword",
            "config/catalogs/tools.yaml:10:20: tool `clock.now`: `inputSchema` must describe an object (`type: object`) (hint: tool arguments are a JSON object, as in OpenAI function calling)",
        ],
    },
    Case {
        name: "backend-specific fields",
        files: &[
            (
                AGENT,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  script: [{ reply: hi }]\n",
                ),
            ),
            (
                "config/agents/scripted.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: scripted }\nspec:\n  backend: scripted\n",
                ),
            ),
            (
                "config/agents/remote.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: remote }\nspec:\n  backend: http\n  model: default\n",
                ),
            ),
        ],
        expected: &[
            "config/agents/assistant.yaml:5:12: agent `assistant` uses backend `openai`, which needs `model`",
            "config/agents/assistant.yaml:6:11: `script` is not used by backend `openai` (hint: remove it, or set the backend that uses it)",
            "config/agents/remote.yaml:5:12: agent `remote` uses backend `http`, which needs `endpoint`",
            "config/agents/remote.yaml:6:10: `model` is not used by backend `http` (hint: remove it, or set the backend that uses it)",
            "config/agents/scripted.yaml:5:12: agent `scripted` uses backend `scripted`, which needs `script`",
        ],
    },
    Case {
        name: "tool implementations",
        files: &[(
            TOOLS,
            Some(
                "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - id: echo\n      builtin: clock.now\n      http: { url: \"http://127.0.0.1:9/x\" }\n    - id: clock.now\n      description: nothing to run\n    - id: extra\n      mcp: { server: fs, tool: read_file }\n    - id: other\n      builtin: clock.later\n",
            ),
        )],
        expected: &[
            "config/catalogs/tools.yaml:6:11: tool `echo` has 2 implementations (http, builtin); a tool has exactly one (hint: give exactly one of `http`, `command`, `mcp`, `builtin`)",
            "config/catalogs/tools.yaml:9:11: tool `clock.now` has no implementation (hint: give exactly one of `http`, `command`, `mcp`, `builtin`)",
            "config/catalogs/tools.yaml:12:22: unknown MCP server `fs` (hint: no MCP server is declared in the workspace)",
            "config/catalogs/tools.yaml:14:16: unknown built-in tool `clock.later` (hint: did you mean `clock.now`?)",
        ],
    },
    Case {
        name: "unknown field and wrong type",
        files: &[
            (
                AGENT,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: default\n  tols: [echo]\n",
                ),
            ),
            (
                "config/agents/typed.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: typed }\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n  maxIterations: many\n",
                ),
            ),
        ],
        expected: &[
            "config/agents/assistant.yaml:7:3: unknown field `tols`, expected one of description, backend, model, instructions, instructionsFile, tools, subagents, skills, maxIterations, timeout, memory, contract, backendConfig, script, endpoint, retention, clientTools, responseSchema (hint: did you mean `tools`?)",
            "config/agents/typed.yaml:7:18: invalid value: expected a whole number (0 or more)",
        ],
    },
    Case {
        name: "malformed YAML, duplicate key, unknown kind, missing kind, wrong apiVersion",
        files: &[
            (
                "config/agents/syntax.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: syntax\nspec: {}\n",
                ),
            ),
            (
                "config/agents/dup.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: dup }\nspec:\n  backend: scripted\n  backend: openai\n",
                ),
            ),
            (
                "config/extra.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agnet\nmetadata: { name: x }\nspec: {}\n---\napiVersion: stable-harness/v1\nmetadata: { name: y }\n---\napiVersion: stable-harness/v2\nkind: Agent\nmetadata: { name: z }\nspec: { backend: scripted, script: [{ reply: hi }] }\n",
                ),
            ),
        ],
        expected: &[
            "config/agents/dup.yaml:6:3: duplicate key `backend` (hint: each key may appear once per mapping)",
            "config/agents/syntax.yaml:4:5: while parsing a flow mapping, did not find expected ',' or '}'",
            "config/extra.yaml:2:7: unknown kind `Agnet` (hint: did you mean `Agent`?)",
            "config/extra.yaml:6:1: missing field `kind` (hint: every document names its kind: one of Runtime, Agent, ModelCatalog, ToolCatalog, Workflow)",
            "config/extra.yaml:9:13: unsupported apiVersion `stable-harness/v2` (hint: use `apiVersion: stable-harness/v1`)",
        ],
    },
    Case {
        name: "governance, mcp servers and cli events",
        files: &[(
            RUNTIME,
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  governance:\n    rules:\n      - { name: r1, match: { tools: [ech] }, decision: deny }\n      - { name: r1, match: { tools: [\"files.*\"], agents: [nobody] }, decision: needs_approval }\n  budgets: []\n  mcpServers:\n    - { name: both, url: \"http://127.0.0.1:9/mcp\", command: { program: npx } }\n  cli: { events: { include: [runtime.request.complete] } }\n  store: { url: \"mysql://db\" }\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:7:38: unknown tool `ech` (hint: did you mean `echo`?)",
            "config/runtime/workspace.yaml:8:17: duplicate governance rule `r1` (first defined at config/runtime/workspace.yaml:7:17)",
            "config/runtime/workspace.yaml:8:38: tool pattern `files.*` matches no tool",
            "config/runtime/workspace.yaml:8:59: unknown agent `nobody`",
            "config/runtime/workspace.yaml:11:15: MCP server `both` needs exactly one of `command` (stdio) or `url` (streamable HTTP)",
            "config/runtime/workspace.yaml:12:30: unknown event type `runtime.request.complete` (hint: did you mean `runtime.request.completed`?)",
            "config/runtime/workspace.yaml:13:17: unsupported store url `mysql://db` (hint: use sqlite://PATH or postgres://USER@HOST/DB)",
        ],
    },
    Case {
        name: "durations are capped at 30 days, and huge numbers are diagnostics",
        files: &[
            (
                RUNTIME,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  protocols:\n    openai: { approvalWait: 31d }\n  governance:\n    approvals: { timeout: 720h }\n    policyTimeout: 18446744073709551615d\n  recovery:\n    backoff: { initial: 99999999999999999999s, max: 720h1ms }\n",
                ),
            ),
            (
                TOOLS,
                Some(
                    "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, builtin: clock.now, timeout: 45d }\n    - { id: clock.now, builtin: clock.now }\n",
                ),
            ),
        ],
        expected: &[
            "config/catalogs/tools.yaml:6:48: `timeout` (45d) is longer than the 30-day maximum",
            "config/runtime/workspace.yaml:6:29: `approvalWait` (31d) is longer than the 30-day maximum",
            "config/runtime/workspace.yaml:9:20: `policyTimeout` (18446744073709551615d) is longer than the 30-day maximum",
            "config/runtime/workspace.yaml:11:25: `backoff.initial`: invalid duration `99999999999999999999s`: number too large",
            "config/runtime/workspace.yaml:11:53: `backoff.max` (720h1ms) is longer than the 30-day maximum",
        ],
    },
    Case {
        name: "retention windows, the archive folder and the store size are checked",
        files: &[
            (
                RUNTIME,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  store:\n    maxSize: 0MiB\n    retention: { requests: 4000d, every: 0s, archive: { dir: ../outside } }\n",
                ),
            ),
            (
                "config/agents/fine.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: fine }\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n  retention: { requests: soon }\n",
                ),
            ),
        ],
        expected: &[
            "config/agents/fine.yaml:7:26: `retention.requests`: invalid duration `soon`: expected a number before `soon`",
            "config/runtime/workspace.yaml:6:14: `store.maxSize` must be greater than zero",
            "config/runtime/workspace.yaml:7:28: `store.retention.requests` (4000d) is longer than the 3650-day maximum",
            "config/runtime/workspace.yaml:7:42: `store.retention.every` must be greater than zero",
            "config/runtime/workspace.yaml:7:62: `store.retention.archive.dir` path `../outside` escapes the workspace (hint: paths are relative to the workspace folder and may not use `..`, start with `/` or lead out through a link)",
        ],
    },
    Case {
        name: "fields that parse but are not enforced yet are rejected",
        files: &[
            (
                RUNTIME,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  store: { url: \"sqlite://state.db\", leaseDuration: 500ms }\n  memory: { enabled: true }\n",
                ),
            ),
            (
                AGENT,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: default\n  tools: [echo]\n  contract: { requiredEvidenceTools: [echo] }\n",
                ),
            ),
            (
                "config/agents/fine.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: fine }\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n  contract: { requiredEvidenceTools: [] }\n",
                ),
            ),
        ],
        expected: &[
            "config/agents/assistant.yaml:8:38: `contract.requiredEvidenceTools` is not supported yet (hint: remove it: execution contracts are not checked by this build)",
            "config/runtime/workspace.yaml:5:53: `store.leaseDuration` must be at least 1s (hint: a lease is renewed every third of it; shorter ones would be lost to a slow database)",
        ],
    },
    Case {
        name: "budgets and rate limits are checked",
        files: &[
            (
                RUNTIME,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  budgets:\n    - { name: nothing, scope: agent, window: 1h }\n    - { name: spend, scope: apiKey, maxCost: 5, window: calendarMonth, match: { agents: [assistent], keys: [nobody] } }\n    - { name: spend, scope: session, maxTokens: 10, window: fortnight }\n    - { name: long, scope: workspace, maxCost: -1, window: 90d }\n  rateLimits:\n    - { name: calm, scope: agent }\n    - { name: Bad, scope: apiKey, requestsPerMinute: 0 }\n",
                ),
            ),
            (
                MODELS,
                Some(
                    "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: { name: models }\nspec:\n  models:\n    - { id: default, provider: openai-compatible, baseUrl: \"http://127.0.0.1:9/v1\", upstreamModel: m, maxOutputTokens: 0, pricing: { inputPerMTok: -1, outputPerMTok: 1 } }\n    - { id: free, provider: openai-compatible, baseUrl: \"http://127.0.0.1:9/v1\", upstreamModel: m }\n",
                ),
            ),
            (
                AGENT,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: free\n",
                ),
            ),
        ],
        expected: &[
            "config/catalogs/models.yaml:6:120: `maxOutputTokens` must be at least 1",
            "config/catalogs/models.yaml:6:148: prices must be zero or positive numbers",
            "config/runtime/workspace.yaml:6:15: budget `nothing` has no limit (hint: set `maxTokens`, `maxCost` or both)",
            "config/runtime/workspace.yaml:7:90: unknown agent `assistent` (hint: did you mean `assistant`?)",
            "config/runtime/workspace.yaml:7:109: unknown key identity `nobody` (hint: name a key of `protocols.openai.keys`, or an unnamed key's identity `key-` and 12 hex digits)",
            "config/runtime/workspace.yaml:8:15: duplicate budget `spend` (first defined at config/runtime/workspace.yaml:7:15)",
            "config/runtime/workspace.yaml:8:61: unknown budget window `fortnight` (hint: a duration such as `24h`, `calendarDay`, `calendarMonth` or `total`)",
            "config/runtime/workspace.yaml:9:15: budget `long` limits cost, but model `free` has no `pricing` (hint: add `pricing: {inputPerMTok: ..., outputPerMTok: ...}` to model `free`)",
            "config/runtime/workspace.yaml:9:48: `maxCost` must be zero or a positive number",
            "config/runtime/workspace.yaml:9:60: a rolling `window` is more than 0s and at most 30d (hint: for longer spans use `calendarMonth` or `total`)",
            "config/runtime/workspace.yaml:11:15: rate limit `calm` has no rate (hint: set `requestsPerMinute`, `tokensPerMinute` or both)",
            "config/runtime/workspace.yaml:12:15: invalid rate limit name `Bad`: names match [a-z0-9][a-z0-9._-]* (hint: did you mean `bad`?)",
            "config/runtime/workspace.yaml:12:54: a rate must be at least 1 per minute",
        ],
    },
    Case {
        name: "an unknown budget scope is a diagnostic",
        files: &[(
            RUNTIME,
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  budgets:\n    - { name: b, scope: team, maxTokens: 10, window: total }\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:6:25: unknown variant `team`, expected one of agent, session, apiKey, workspace",
        ],
    },
    Case {
        name: "memory settings are checked",
        files: &[
            (
                RUNTIME,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  memory:\n    enabled: false\n    write: { maxContentBytes: 1MiB }\n    providers:\n      - { name: team, url: \"ftp://x\", timeout: 2m }\n      - { name: team, url: \"http://127.0.0.1:9\", apiKeyEnv: \"not a var\" }\n",
                ),
            ),
            (
                TOOLS,
                Some(
                    "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, builtin: clock.now }\n    - { id: remember, builtin: memory.write }\n",
                ),
            ),
            (
                AGENT,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n  memory: { namespace: \"team/x\", namespaces: [\"user/{name}\", \"agent/{agentId}\", \"agent/{agentId}\"], maxRecall: 0, provider: tem }\n",
                ),
            ),
            (
                "config/agents/forgetful.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: forgetful }\nspec:\n  backend: scripted\n  tools: [remember]\n  script: [{ reply: hi }]\n",
                ),
            ),
        ],
        expected: &[
            "config/agents/assistant.yaml:7:11: agent `memory` needs memory enabled in the Runtime (hint: set `memory: { enabled: true }` in the Runtime's spec)",
            "config/agents/assistant.yaml:7:24: namespace `team/x` must start with one of agent/, session/, user/",
            "config/agents/assistant.yaml:7:47: namespace `user/{name}` has `{`: only letters, digits, `.`, `_`, `-`, `/` and the placeholders {agentId}, {sessionId}, {user}",
            "config/agents/assistant.yaml:7:81: namespace `agent/{agentId}` is listed twice",
            "config/agents/assistant.yaml:7:112: `memory.maxRecall` must be 1 to 50, got 0",
            "config/agents/assistant.yaml:7:125: unknown memory provider `tem` (hint: did you mean `team`?)",
            "config/agents/forgetful.yaml:6:11: tool `remember` writes memory, and agent `forgetful` has no `memory` (hint: give the agent `memory: { namespace: ... }`, or remove the tool)",
            "config/runtime/workspace.yaml:7:31: `memory.write.maxContentBytes` is larger than 65536 bytes",
            "config/runtime/workspace.yaml:9:28: `memory.providers.url` must be an http:// or https:// URL, got `ftp://x`",
            "config/runtime/workspace.yaml:9:48: `memory.providers.timeout` (2m) is longer than the 60s maximum",
            "config/runtime/workspace.yaml:10:17: duplicate memory provider `team` (first defined at config/runtime/workspace.yaml:9:17)",
            "config/runtime/workspace.yaml:10:61: `apiKeyEnv` must name an environment variable, got `not a var` (hint: fields ending in `Env` hold a variable name such as OPENAI_API_KEY, never the secret itself)",
        ],
    },
    Case {
        name: "onInterrupted takes rerun, ask or fail",
        files: &[
            (
                TOOLS,
                Some(
                    "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, builtin: clock.now, onInterrupted: retry }\n    - { id: clock.now, builtin: clock.now, onInterrupted: fail }\n",
                ),
            ),
            (
                "config/catalogs/more.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: more }\nspec:\n  tools:\n    - { id: x, builtin: clock.now, onInterrupted: ask }\n    - { id: y, builtin: clock.now, onInterrupted: asks }\n",
                ),
            ),
        ],
        expected: &[
            "config/catalogs/more.yaml:7:51: unknown variant `asks`, expected one of rerun, ask, fail (hint: did you mean `ask`?)",
            "config/catalogs/tools.yaml:6:54: unknown variant `retry`, expected one of rerun, ask, fail",
        ],
    },
    Case {
        name: "named keys: names, variables and one identity per key",
        files: &[(
            RUNTIME,
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  protocols:\n    openai:\n      apiKeysEnv: [SHARED_KEY]\n      keys:\n        - { name: web, keyEnv: WEB_KEY, labels: { channel: web } }\n        - { name: Mobile App, keyEnv: MOBILE_KEY }\n        - { name: batch, keyEnv: sk-live-123 }\n        - { name: again, keyEnv: WEB_KEY }\n        - { name: shared, keyEnv: SHARED_KEY }\n    admin:\n      keys:\n        - { name: web, keyEnv: OPS_KEY }\n        - { name: ops, keyEnv: OPS_KEY2 }\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:10:19: invalid API key name `Mobile App`: names match [a-z0-9][a-z0-9._-]* (hint: did you mean `mobile-app`?)",
            "config/runtime/workspace.yaml:11:34: `keyEnv` must name an environment variable, got `sk-live-123` (hint: fields ending in `Env` hold a variable name such as OPENAI_API_KEY, never the secret itself)",
            "config/runtime/workspace.yaml:12:34: `keyEnv` WEB_KEY is already used by key `web` (hint: one variable backs one key, so that a key has one identity)",
            "config/runtime/workspace.yaml:13:35: `keyEnv` SHARED_KEY is already used by `apiKeysEnv` (hint: one variable backs one key, so that a key has one identity)",
            "config/runtime/workspace.yaml:16:19: duplicate API key `web` (first defined at config/runtime/workspace.yaml:9:19)",
        ],
    },
    Case {
        name: "admin keys carry no labels",
        files: &[(
            RUNTIME,
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  protocols:\n    admin:\n      keys:\n        - { name: ops, keyEnv: OPS_KEY, labels: { team: ops } }\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:8:41: unknown field `labels`, expected one of name, keyEnv",
        ],
    },
    Case {
        name: "client metadata may only tighten policy",
        files: &[(
            RUNTIME,
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  governance:\n    rules:\n      - { name: trusted-clients, match: { metadata: { trusted: \"yes\" } }, decision: allow }\n      - { name: sandbox, match: { metadata: { sandbox: \"true\" } }, decision: deny }\n      - { name: vip, match: { metadata: { tier: vip } }, decision: needs_approval }\n      - { name: labelled, match: { labels: { tier: vip }, metadata: {} }, decision: allow }\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:7:53: rule `trusted-clients` decides allow on client-supplied request metadata; such rules may only deny or ask for approval (hint: decide `deny` or `needs_approval`, or match trusted `labels` (tool, agent, key, runtime) instead)",
        ],
    },
    Case {
        name: "rules may name delegation tools; delegation cycles are errors",
        files: &[
            (
                RUNTIME,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  defaultAgent: assistant\n  governance:\n    rules:\n      - { name: d1, match: { tools: [agents.planner, \"agents.*\", agents.plannr] }, decision: needs_approval }\n      - { name: d2, match: { tools: [\"agents.x*\"] }, decision: deny }\n",
                ),
            ),
            (
                "config/agents/planner.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: planner }\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n  subagents: [writer]\n",
                ),
            ),
            (
                "config/agents/writer.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: writer }\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n  subagents: [assistant, writer]\n",
                ),
            ),
            (
                AGENT,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: default\n  subagents: [planner]\n",
                ),
            ),
            (
                TOOLS,
                Some(
                    "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, builtin: clock.now }\n    - { id: agents.helper, builtin: clock.now }\n",
                ),
            ),
        ],
        expected: &[
            "config/agents/writer.yaml:7:15: delegation cycle: assistant -> planner -> writer -> assistant (hint: an agent may not delegate, directly or through others, back to itself)",
            "config/agents/writer.yaml:7:26: delegation cycle: writer -> writer (hint: an agent may not delegate, directly or through others, back to itself)",
            "config/catalogs/tools.yaml:7:13: tool id `agents.helper` is reserved: `agents.<name>` names delegation to an agent (hint: give the tool another id; list the agent in `subagents` to delegate to it)",
            "config/runtime/workspace.yaml:8:66: unknown delegation tool `agents.plannr` (hint: did you mean `agents.planner`?)",
            "config/runtime/workspace.yaml:9:38: tool pattern `agents.x*` matches no tool",
        ],
    },
    Case {
        name: "redaction patterns are regular expressions",
        files: &[(
            RUNTIME,
            Some(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  governance:\n    redact:\n      patterns:\n        - 'sk-[A-Za-z0-9]{20,}'\n        - '(unclosed'\n        - 'x*'\n        - '(?:\\w{100}){100}'\n",
            ),
        )],
        expected: &[
            "config/runtime/workspace.yaml:9:11: `redact.patterns`: invalid pattern `(unclosed`: unclosed group",
            "config/runtime/workspace.yaml:10:11: `redact.patterns`: invalid pattern `x*`: it matches the empty string",
            "config/runtime/workspace.yaml:11:11: `redact.patterns`: invalid pattern `(?:\\w{100}){100}`: it compiles to more than the 1024 KiB limit",
        ],
    },
    Case {
        name: "output caps and the kept histories' memory are byte sizes",
        files: &[
            (
                RUNTIME,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  limits: { maxOutputBytes: 0, keptHistoryBytes: 0 }\n  mcpServers:\n    - { name: docs, url: \"http://127.0.0.1:9/mcp\" }\n",
                ),
            ),
            (
                TOOLS,
                Some(
                    "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, mcp: { server: docs, tool: echo, maxOutputBytes: 2 pages } }\n    - { id: clock.now, mcp: { server: docs, tool: now, maxOutputBytes: 64KiB } }\n",
                ),
            ),
        ],
        expected: &[
            "config/catalogs/tools.yaml:6:68: `maxOutputBytes`: invalid size `2 pages`: unknown unit `pages` (use B, KB, MB, GB, KiB, MiB or GiB)",
            "config/runtime/workspace.yaml:5:29: `maxOutputBytes` must be greater than zero",
            "config/runtime/workspace.yaml:5:50: `keptHistoryBytes` must be greater than zero",
        ],
    },
    Case {
        name: "scripted steps pass the same checks as a model's calls",
        files: &[(
            "config/agents/scripted.yaml",
            Some(
                "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: scripted }\nspec:\n  backend: scripted\n  tools: [echo]\n  script:\n    - toolCall: { tool: clock.now }\n    - toolCall: { tool: echo, arguments: { text: 42 } }\n",
            ),
        )],
        expected: &[
            "config/agents/scripted.yaml:8:25: script calls tool `clock.now`, which is not in this agent's `tools` (hint: add it to `tools`: scripted calls pass the same gateway as a model's)",
            "config/agents/scripted.yaml:9:25: script arguments for `echo` do not match its inputSchema: 42 is not of type \"string\"",
        ],
    },
    Case {
        name: "environment variable fields hold names, not secrets",
        files: &[(
            MODELS,
            Some(
                "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: { name: models }\nspec:\n  models:\n    - id: default\n      provider: openai-compatible\n      baseUrlEnv: OPENAI_BASE_URL\n      apiKeyEnv: sk-live-1234\n      upstreamModel: m\n",
            ),
        )],
        expected: &[
            "config/catalogs/models.yaml:9:18: `apiKeyEnv` must name an environment variable, got `sk-live-1234` (hint: fields ending in `Env` hold a variable name such as OPENAI_API_KEY, never the secret itself)",
        ],
    },
    Case {
        name: "client tools need a model; their ids are reserved and any may be governed",
        files: &[
            (
                RUNTIME,
                Some(
                    "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  defaultAgent: assistant\n  governance:\n    rules:\n      - { name: shells, match: { tools: [\"client.*\", client.shell] }, decision: needs_approval }\n",
                ),
            ),
            (
                "config/agents/scripted.yaml",
                Some(
                    "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: scripted }\nspec:\n  backend: scripted\n  clientTools: { enabled: true }\n  script: [{ reply: hi }]\n",
                ),
            ),
            (
                TOOLS,
                Some(
                    "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, builtin: clock.now }\n    - { id: clock.now, builtin: clock.now }\n    - { id: client.exec, builtin: clock.now }\n",
                ),
            ),
        ],
        expected: &[
            "config/agents/scripted.yaml:6:16: `clientTools` needs backend `openai`; agent `scripted` uses `scripted` (hint: remove `clientTools`: only a model can call the client's tools)",
            "config/catalogs/tools.yaml:8:13: tool id `client.exec` is reserved: `client.<name>` names a tool the client supplies (hint: give the tool another id)",
        ],
    },
    Case {
        name: "workflow graphs: reachable, conditions that fit their node, bounded loops",
        files: &[(
            "config/workflows/flow.yaml",
            Some(
                "apiVersion: stable-harness/v1\nkind: Workflow\nmetadata: { name: flow }\nspec:\n  entry: a\n  nodes:\n    - { id: a, agent: assistant, arguments: { x: 1 } }\n    - { id: b, tool: echo, input: original, arguments: { text: 5 } }\n    - { id: lonely, agent: assistant }\n  edges:\n    - { from: a, to: b, when: { decision: approved } }\n    - { from: b, to: a, when: { output: { pointer: /x, equals: 1 } } }\n",
            ),
        )],
        expected: &[
            "config/workflows/flow.yaml:7:45: `arguments` are for tool nodes",
            "config/workflows/flow.yaml:8:35: `input` is for agent nodes",
            "config/workflows/flow.yaml:8:56: node `b`: arguments for `echo` do not match its inputSchema: 5 is not of type \"string\"",
            "config/workflows/flow.yaml:9:13: workflow node `lonely` cannot be reached from `entry` (hint: add an edge to it, or remove it)",
            "config/workflows/flow.yaml:11:22: the workflow loops through `b` and has no `maxSteps` (hint: set `maxSteps` to bound how many nodes one request may run)",
            "config/workflows/flow.yaml:11:43: `decision` conditions are for tool nodes; `a` runs an agent (hint: branch on `status` after an agent node)",
            "config/workflows/flow.yaml:12:41: `output` conditions need a structured output: `b` must run an agent with a `responseSchema` (hint: give the agent `responseSchema`, or branch on `status`)",
        ],
    },
];

#[test]
fn base_workspace_is_valid() {
    assert_eq!(TestWorkspace::base().diagnostics(), Vec::<String>::new());
}

#[test]
fn every_check_reports_file_line_column_and_message() {
    let mut failures = Vec::new();
    for case in CASES {
        let actual = apply(case).diagnostics();
        if actual != case.expected {
            failures.push(format!(
                "case `{}`:\n  expected: {:#?}\n  actual:   {:#?}",
                case.name, case.expected, actual
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The same table through the binary: `validate` prints exactly those lines and exits 2.
#[test]
fn every_check_fails_validate_with_exit_code_2() {
    for case in CASES {
        let workspace = apply(case);
        let output = stable_harness(&["validate", "-w", workspace.path().to_str().unwrap()]);
        assert_eq!(output.status.code(), Some(2), "case `{}`", case.name);
        let mut expected: Vec<String> = case
            .expected
            .iter()
            .map(|line| (*line).to_owned())
            .collect();
        expected.push(format!("{} problem(s) found", case.expected.len()));
        assert_eq!(
            stderr(&output).lines().collect::<Vec<_>>(),
            expected,
            "case `{}`",
            case.name
        );
        assert!(output.stdout.is_empty(), "case `{}`", case.name);
    }
}

fn apply(case: &Case) -> TestWorkspace {
    let workspace = TestWorkspace::base();
    for (path, content) in case.files {
        match content {
            Some(content) => {
                workspace.write(path, content);
            }
            None => workspace.remove(path),
        }
    }
    workspace
}

#[test]
fn symlinks_cannot_lead_out_of_the_workspace() {
    let outside = TestWorkspace::empty();
    let secret = outside.write("secret.md", "top secret");
    let workspace = TestWorkspace::base();
    std::fs::create_dir_all(workspace.path().join("resources/skills")).unwrap();
    std::os::unix::fs::symlink(&secret, workspace.path().join("resources/skills/leak.md")).unwrap();
    std::os::unix::fs::symlink(outside.path(), workspace.path().join("config/linked")).unwrap();
    workspace.write(
        AGENT,
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: default\n  skills: [resources/skills/leak.md]\n",
    );
    assert_eq!(
        workspace.diagnostics(),
        [
            "config/agents/assistant.yaml:7:12: `skills` path `resources/skills/leak.md` leads outside the workspace through a symbolic link",
            "config/linked: symbolic link points outside the workspace",
        ]
    );
}

#[test]
fn file_level_problems_are_reported_with_the_rest() {
    let workspace = TestWorkspace::base();
    workspace.write(
        "config/agents/latin1.yaml",
        b"apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: caf\xe9 }\n",
    );
    let mut big = Vec::with_capacity(50 * 1024 * 1024 + 16);
    big.extend_from_slice(b"# padding\n");
    big.resize(50 * 1024 * 1024, b'#');
    workspace.write("config/huge.yaml", &big);
    workspace.write(
        "config/agents/assistant.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: nope\n",
    );
    assert_eq!(
        workspace.diagnostics(),
        [
            "config/agents/assistant.yaml:6:10: unknown model `nope`",
            "config/agents/latin1.yaml:3:22: file is not valid UTF-8 (hint: save the file as UTF-8)",
            "config/huge.yaml: file is 50.0 MiB, larger than the 4 MiB limit for workspace files (hint: keep large data under resources/ and reference it from a tool)",
        ]
    );
}

#[test]
fn alias_bombs_are_stopped_by_input_limits() {
    let workspace = TestWorkspace::base();
    let mut bomb = String::from(
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: bomb }\nspec:\n  backend: scripted\n  backendConfig:\n    a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n",
    );
    for level in 1..10 {
        let prev = level - 1;
        bomb.push_str(&format!("    a{level}: &a{level} [*a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}]\n"));
    }
    workspace.write("config/agents/bomb.yaml", bomb);
    let diagnostics = workspace.diagnostics();
    assert_eq!(diagnostics.len(), 1, "{diagnostics:#?}");
    assert!(
        diagnostics[0].starts_with("config/agents/bomb.yaml:"),
        "{diagnostics:#?}"
    );
    assert!(diagnostics[0].contains("alias"), "{diagnostics:#?}");
}

#[test]
fn empty_or_missing_config_folder() {
    let workspace = TestWorkspace::empty();
    assert_eq!(
        workspace.diagnostics(),
        [
            "config/: folder not found: a workspace keeps its YAML under config/ (hint: create one with `stable-harness init DIR`)"
        ]
    );
    std::fs::create_dir_all(workspace.path().join("config/agents")).unwrap();
    workspace.write("config/notes.txt", "not yaml");
    assert_eq!(
        workspace.diagnostics(),
        [
            "config/: no *.yaml or *.yml files found (hint: a workspace needs at least config/runtime/workspace.yaml with `kind: Runtime`)"
        ]
    );
}

#[test]
fn many_problems_are_all_reported_at_once() {
    let workspace = TestWorkspace::base();
    workspace.write(
        "config/everything.yml",
        "apiVersion: stable-harness/v1
kind: Agent
metadata: { name: one }
spec:
  backend: openai
  model: missing
  tools: [echo, gone]
  timeout: forever
---
apiVersion: stable-harness/v1
kind: Agent
metadata: { name: two }
spec:
  backend: scripted
  unknownField: true
---
apiVersion: stable-harness/v1
kind: ToolCatalog
metadata: { name: more-tools }
spec:
  tools:
    - id: broken
      inputSchema: { type: object, required: 5 }
      http: { url: \"ftp://example\" }
---
apiVersion: stable-harness/v1
kind: Workflow
metadata: { name: flow }
spec:
  entry: one
  nodes: [{ id: one, agent: three }]
",
    );
    let diagnostics = workspace.diagnostics();
    assert_eq!(
        diagnostics,
        [
            "config/everything.yml:6:10: unknown model `missing`",
            "config/everything.yml:7:17: unknown tool `gone`",
            "config/everything.yml:8:12: `timeout`: invalid duration `forever`: expected a number before `forever`",
            "config/everything.yml:15:3: unknown field `unknownField`, expected one of description, backend, model, instructions, instructionsFile, tools, subagents, skills, maxIterations, timeout, memory, contract, backendConfig, script, endpoint, retention, clientTools, responseSchema",
            "config/everything.yml:23:20: tool `broken`: invalid JSON Schema at `/required`: 5 is not of type \"array\"",
            "config/everything.yml:31:29: unknown agent `three`",
        ]
    );
}

/// What the new fields compile to, defaults included: what the runtime, the gateway and
/// authentication read.
#[test]
fn trust_fields_compile_with_their_defaults() {
    use stable_harness::workspace::{
        InterruptedAction, KeyConfig, MAX_DURATION, ToolImplementation, load,
    };
    let workspace = TestWorkspace::base();
    let compiled = load(workspace.path()).unwrap();
    assert_eq!(compiled.runtime.limits.max_output_bytes, 1 << 20);
    assert!(compiled.runtime.openai.keys.is_empty());
    assert!(compiled.runtime.admin_keys.is_empty());
    assert!(compiled.runtime.governance.redact_patterns.is_empty());
    assert_eq!(
        compiled.tools["echo"].on_interrupted,
        InterruptedAction::Rerun
    );

    workspace.write(
        RUNTIME,
        "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test, labels: { env: prod } }\nspec:\n  defaultAgent: assistant\n  protocols:\n    openai:\n      keys:\n        - { name: web, keyEnv: WEB_KEY, labels: { channel: web } }\n    admin:\n      keys: [{ name: ops, keyEnv: OPS_KEY }]\n  limits: { maxOutputBytes: 64KiB }\n  memory: { enabled: false }\n  budgets: []\n  mcpServers:\n    - { name: docs, url: \"http://127.0.0.1:9/mcp\", timeout: 30d }\n  governance:\n    redact: { patterns: ['sk-[a-z0-9]{8,}'] }\n    rules:\n      - { name: sandbox, match: { tools: [\"agents.*\"], metadata: { sandbox: \"true\" } }, decision: deny }\n",
    );
    workspace.write(
        TOOLS,
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, risk: high, builtin: clock.now }\n    - { id: clock.now, risk: high, onInterrupted: rerun, builtin: clock.now }\n    - { id: search, onInterrupted: fail, mcp: { server: docs, tool: search } }\n    - { id: fetch, mcp: { server: docs, tool: fetch, maxOutputBytes: 2KiB } }\n",
    );
    let compiled = load(workspace.path()).unwrap_or_else(|d| panic!("{d}"));
    let runtime = &compiled.runtime;
    assert_eq!(
        runtime.openai.keys,
        [KeyConfig {
            name: "web".into(),
            key_env: "WEB_KEY".into(),
            labels: [("channel".to_owned(), "web".to_owned())].into(),
        }]
    );
    assert_eq!(runtime.admin_keys[0].name, "ops");
    assert!(runtime.admin_keys[0].labels.is_empty());
    assert_eq!(runtime.limits.max_output_bytes, 64 * 1024);
    assert_eq!(runtime.mcp_servers["docs"].timeout, MAX_DURATION);
    let redact = &runtime.governance.redact_patterns;
    assert!(redact[0].is_match("key sk-abcdef123 here"));
    let rule = &runtime.governance.rules[0];
    assert_eq!(rule.metadata["sandbox"], "true");
    assert!(rule.labels.is_empty());

    let tools = &compiled.tools;
    assert_eq!(tools["echo"].on_interrupted, InterruptedAction::Ask);
    assert_eq!(tools["clock.now"].on_interrupted, InterruptedAction::Rerun);
    assert_eq!(tools["search"].on_interrupted, InterruptedAction::Fail);
    let bound = |id: &str| match &tools[id].implementation {
        ToolImplementation::Mcp {
            max_output_bytes, ..
        } => *max_output_bytes,
        other => panic!("{other:?}"),
    };
    assert_eq!((bound("search"), bound("fetch")), (1 << 20, 2048));
}
