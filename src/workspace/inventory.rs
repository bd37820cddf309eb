//! The compiled inventory as JSON: what a server of this workspace serves, with the details a
//! reviewer checks. `validate --json` prints it and `GET /admin/workspace` answers it. Keys and
//! credentials appear as the names of their variables only, and a store URL without its
//! password: secrets never leave through it.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use super::{
    CompiledWorkspace, KeyConfig, McpTransport, ToolImplementation, UpstreamUrl, WorkflowTarget,
    wire_name,
};

/// The inventory as JSON: what `start` would serve, with the details a reviewer checks
/// (backends, models, each agent's tools, tool kinds and risks, governance rules). Key and
/// credential fields show variable names only; secrets never live in the workspace.
pub fn inventory(workspace: &CompiledWorkspace) -> Value {
    json!({
        "valid": true,
        "runtime": runtime_json(workspace),
        "agents": workspace.agents.values().map(|agent| json!({
            "name": agent.name,
            "description": agent.description,
            "labels": agent.labels,
            "backend": wire_name(&agent.backend),
            "model": agent.model,
            "tools": agent.tools,
            "subagents": agent.subagents,
            "clientTools": agent.client_tools.map(|risk| json!({ "enabled": true, "risk": risk })),
            "skills": agent.skills.iter().map(|s| &s.name).collect::<Vec<_>>(),
            "maxIterations": agent.max_iterations,
            "timeoutMs": millis(agent.timeout),
            "endpoint": agent.endpoint.as_ref().map(|e| &e.url),
            "memory": agent.memory.as_ref().map(|memory| json!({
                "namespaces": memory.namespaces,
                "recall": memory.recall,
                "maxRecall": memory.max_recall,
                "provider": memory.provider,
            })),
        })).collect::<Vec<_>>(),
        "models": workspace.models.values().map(|model| {
            let (base_url, base_url_env) = match &model.base_url {
                UpstreamUrl::Fixed(url) => (Some(url), None),
                UpstreamUrl::FromEnv(variable) => (None, Some(variable)),
            };
            json!({
                "id": model.id,
                "provider": wire_name(&model.provider),
                "upstreamModel": model.upstream_model,
                "baseUrl": base_url,
                "baseUrlEnv": base_url_env,
                "apiKeyEnv": model.api_key_env,
                "capabilities": model.capabilities,
                "fallbacks": model.fallbacks,
                "pricing": model.pricing.map(|p| json!({
                    "inputPerMTok": p.input_per_m_tok,
                    "outputPerMTok": p.output_per_m_tok,
                })),
                "maxOutputTokens": model.max_output_tokens,
                "timeoutMs": millis(model.timeout),
            })
        }).collect::<Vec<_>>(),
        "tools": workspace.tools.values().map(|tool| {
            let mut entry = json!({
                "id": tool.id,
                "kind": tool.implementation.kind(),
                "risk": wire_name(&tool.risk),
                "onInterrupted": wire_name(&tool.on_interrupted),
                "labels": tool.labels,
                "timeoutMs": millis(tool.timeout),
            });
            let detail = match &tool.implementation {
                ToolImplementation::Http { method, url, max_response_bytes, .. } => json!({
                    "method": wire_name(method),
                    "url": url,
                    "maxResponseBytes": max_response_bytes,
                }),
                ToolImplementation::Command { command, max_output_bytes } => json!({
                    "program": relative(workspace, &command.program),
                    "maxOutputBytes": max_output_bytes,
                }),
                ToolImplementation::Mcp { server, tool, max_output_bytes } => json!({
                    "server": server,
                    "tool": tool,
                    "maxOutputBytes": max_output_bytes,
                }),
                ToolImplementation::Builtin(builtin) => json!({ "builtin": builtin }),
                ToolImplementation::Subagent(agent) => json!({ "agent": agent }),
                ToolImplementation::Client => json!({}),
            };
            if let (Value::Object(entry), Value::Object(detail)) = (&mut entry, detail) {
                entry.extend(detail);
            }
            entry
        }).collect::<Vec<_>>(),
        "workflows": workspace.workflows.values().map(|workflow| json!({
            "name": workflow.name,
            "entry": workflow.entry,
            "maxSteps": workflow.max_steps,
            "exposeAsModel": workflow.expose_as_model,
            "nodes": workflow.nodes.iter().map(|node| match &node.target {
                WorkflowTarget::Agent(agent) => json!({ "id": node.id, "agent": agent, "input": node.input }),
                WorkflowTarget::Tool(tool) => json!({ "id": node.id, "tool": tool, "arguments": node.arguments }),
            }).collect::<Vec<_>>(),
            "edges": workflow.edges.iter().map(|edge| json!({
                "from": edge.from,
                "to": edge.to,
                "when": edge.when,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

fn spend_match(matcher: &crate::workspace::SpendMatch) -> Value {
    json!({ "keys": matcher.keys, "agents": matcher.agents, "labels": matcher.labels })
}

fn runtime_json(workspace: &CompiledWorkspace) -> Value {
    let runtime = &workspace.runtime;
    let governance = &runtime.governance;
    let keys = |keys: &[KeyConfig]| -> Vec<Value> {
        keys.iter()
            .map(|key| json!({ "name": key.name, "keyEnv": key.key_env, "labels": key.labels }))
            .collect()
    };
    json!({
        "name": runtime.name,
        "labels": runtime.labels,
        "defaultAgent": runtime.default_agent,
        "store": runtime.store_url.as_deref().map(crate::store::redact_url),
        "protocols": {
            "openai": {
                "enabled": runtime.openai.enabled,
                "apiKeysEnv": runtime.openai.api_keys_env,
                "keys": keys(&runtime.openai.keys),
                "approvalWaitMs": millis(runtime.openai.approval_wait),
            },
            "admin": {
                "apiKeysEnv": runtime.admin_api_keys_env,
                // Admin keys carry no labels.
                "keys": runtime.admin_keys.iter()
                    .map(|key| json!({ "name": key.name, "keyEnv": key.key_env }))
                    .collect::<Vec<_>>(),
            },
        },
        "limits": {
            "maxRequestBytes": runtime.limits.max_request_bytes,
            "maxConcurrentRuns": runtime.limits.max_concurrent_runs,
            "maxOutputBytes": runtime.limits.max_output_bytes,
            "keptHistoryBytes": runtime.limits.kept_history_bytes,
        },
        "budgets": runtime.budgets.iter().map(|budget| json!({
            "name": budget.name,
            "scope": wire_name(&budget.scope),
            "match": spend_match(&budget.matcher),
            "maxTokens": budget.max_tokens,
            "maxCost": budget.max_cost,
            "window": budget.window.describe(),
        })).collect::<Vec<_>>(),
        "rateLimits": runtime.rate_limits.iter().map(|limit| json!({
            "name": limit.name,
            "scope": wire_name(&limit.scope),
            "match": spend_match(&limit.matcher),
            "requestsPerMinute": limit.requests_per_minute,
            "tokensPerMinute": limit.tokens_per_minute,
        })).collect::<Vec<_>>(),
        "governance": {
            "default": wire_name(&governance.default),
            "rules": governance.rules.iter().map(|rule| json!({
                "name": rule.name,
                "decision": wire_name(&rule.decision),
                "tools": rule.tools,
                "agents": rule.agents,
                "risk": rule.risk,
                "labels": rule.labels,
                "metadata": rule.metadata,
            })).collect::<Vec<_>>(),
            "approvalTimeoutMs": millis(governance.approval_timeout),
            "onTimeout": wire_name(&governance.on_timeout),
            "policyTimeoutMs": millis(governance.policy_timeout),
            "redactPatterns": governance.redact_patterns.iter().map(regex::Regex::as_str).collect::<Vec<_>>(),
        },
        "memory": {
            "enabled": runtime.memory.enabled,
            "requireApproval": runtime.memory.write_requires_approval,
            "maxContentBytes": runtime.memory.max_content_bytes,
            "ttlMs": runtime.memory.ttl.map(millis),
            // Where each provider is and which variable holds its key, never the key.
            "providers": runtime.memory.providers.iter().map(|provider| json!({
                "name": provider.name,
                "url": provider.url,
                "apiKeyEnv": provider.api_key_env,
                "timeoutMs": millis(provider.timeout),
            })).collect::<Vec<_>>(),
        },
        "recovery": {
            "maxAttempts": runtime.recovery.max_attempts,
            "retryOn": runtime.recovery.retry_on,
            "resumeOnStart": runtime.recovery.resume_on_start,
        },
        "mcpServers": runtime.mcp_servers.values().map(|server| match &server.transport {
            McpTransport::Stdio(command) => json!({
                "name": server.name,
                "transport": "stdio",
                "program": relative(workspace, &command.program),
            }),
            McpTransport::Http { url, .. } => json!({
                "name": server.name,
                "transport": "http",
                "url": url,
            }),
        }).collect::<Vec<_>>(),
    })
}

/// A workspace program as written (workspace-relative), not the absolute path it resolved to.
fn relative(workspace: &CompiledWorkspace, program: &Path) -> String {
    program
        .strip_prefix(&workspace.root)
        .unwrap_or(program)
        .to_string_lossy()
        .into_owned()
}

/// Durations as whole milliseconds (every configured duration is at most 30 days).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
