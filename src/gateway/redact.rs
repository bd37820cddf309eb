//! The redaction hook: secret values never land in stored events, records or logs.
//!
//! Secrets are the values of every environment variable the workspace names for credentials
//! (`apiKeyEnv`, `headersEnv`, an MCP server's headers, a command's declared `env`), wherever
//! they appear in text, and the values of object keys that name a credential
//! (`password`, `token`, `apiKey`, `authorization`, ...).

use serde_json::Value;

use crate::workspace::{CompiledWorkspace, McpTransport, ToolImplementation};

pub const REDACTED: &str = "[redacted]";

/// Secrets shorter than this are not searched for in text: they would match by accident.
const MIN_SECRET_LEN: usize = 6;

#[derive(Clone, Default)]
pub struct Redactor {
    secrets: Vec<String>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Redactor({} secrets)", self.secrets.len())
    }
}

impl Redactor {
    /// Reads the current values of the workspace's credential variables.
    pub fn from_workspace(workspace: &CompiledWorkspace) -> Self {
        let mut names: Vec<&str> = Vec::new();
        for model in workspace.models.values() {
            names.extend(model.api_key_env.as_deref());
        }
        for agent in workspace.agents.values() {
            if let Some(endpoint) = &agent.endpoint {
                names.extend(endpoint.api_key_env.as_deref());
            }
        }
        for tool in workspace.tools.values() {
            match &tool.implementation {
                ToolImplementation::Http { headers_env, .. } => {
                    names.extend(headers_env.values().map(String::as_str));
                }
                ToolImplementation::Command { command, .. } => {
                    names.extend(command.env.iter().map(String::as_str));
                }
                ToolImplementation::Mcp { .. }
                | ToolImplementation::Builtin(_)
                | ToolImplementation::Subagent(_) => {}
            }
        }
        for server in workspace.runtime.mcp_servers.values() {
            match &server.transport {
                McpTransport::Http { headers_env, .. } => {
                    names.extend(headers_env.values().map(String::as_str));
                }
                McpTransport::Stdio(command) => {
                    names.extend(command.env.iter().map(String::as_str))
                }
            }
        }
        let mut secrets: Vec<String> = names
            .into_iter()
            .filter_map(|name| std::env::var(name).ok())
            .filter(|value| value.len() >= MIN_SECRET_LEN)
            .collect();
        // Longest first, so a secret containing another is replaced whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Self { secrets }
    }

    /// A copy of `value` with secrets replaced.
    pub fn redact(&self, value: &Value) -> Value {
        match value {
            Value::String(text) => Value::String(self.redact_text(text)),
            Value::Array(items) => Value::Array(items.iter().map(|v| self.redact(v)).collect()),
            Value::Object(fields) => Value::Object(
                fields
                    .iter()
                    .map(|(key, field)| {
                        let field = if is_credential_key(key) && !field.is_null() {
                            Value::String(REDACTED.to_owned())
                        } else {
                            self.redact(field)
                        };
                        (key.clone(), field)
                    })
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    pub fn redact_text(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for secret in &self.secrets {
            if text.contains(secret.as_str()) {
                text = text.replace(secret.as_str(), REDACTED);
            }
        }
        text
    }
}

fn is_credential_key(key: &str) -> bool {
    let key: String = key
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect::<String>()
        .to_ascii_lowercase();
    [
        "password",
        "passwd",
        "secret",
        "token",
        "apikey",
        "authorization",
        "credential",
        "privatekey",
    ]
    .iter()
    .any(|word| key.contains(word))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn redacts_secret_values_and_credential_keys() {
        let redactor = Redactor {
            secrets: vec!["sk-live-123456".to_owned()],
        };
        let redacted = redactor.redact(&json!({
            "query": "use sk-live-123456 please",
            "api_key": "anything",
            "nested": [{ "Authorization": "Bearer x" }, "plain"],
            "count": 3,
        }));
        assert_eq!(
            redacted,
            json!({
                "query": "use [redacted] please",
                "api_key": "[redacted]",
                "nested": [{ "Authorization": "[redacted]" }, "plain"],
                "count": 3,
            })
        );
    }
}
