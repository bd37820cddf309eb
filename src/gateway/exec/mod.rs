//! Tool implementations: `http`, `command`, `mcp` and `builtin`. Each turns JSON arguments into
//! a JSON output or a typed [`ToolError`]; the gateway around them owns timeouts, policy,
//! redaction and recording.

mod builtin;
mod command;
mod http;
mod mcp;

use std::path::Path;

use serde_json::Value;

pub use mcp::McpClients;

use crate::text::excerpt;
use crate::workspace::{
    AgentConfig, CommandConfig, CompiledWorkspace, ToolConfig, ToolImplementation,
};

/// What an implementation may use.
pub(super) struct ExecContext<'a> {
    pub workspace: &'a CompiledWorkspace,
    pub agent: &'a AgentConfig,
    pub host: &'a dyn super::RunHost,
    pub call_id: &'a str,
    /// Sent with every execution of the call, the same after a crash (SPEC section 4).
    pub idempotency_key: &'a str,
    pub http: &'a reqwest::Client,
    pub mcp: &'a McpClients,
}

/// A tool that ran and failed. `code` is stable (`timeout`, `http_status`, `exit_status`,
/// `bad_output`, `output_too_large`, `unavailable`, `tool_error`, ...).
#[derive(Debug, Clone)]
pub(super) struct ToolError {
    pub code: &'static str,
    pub message: String,
}

impl ToolError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

pub(super) async fn run(
    context: &ExecContext<'_>,
    tool: &ToolConfig,
    arguments: Value,
) -> Result<Value, ToolError> {
    match &tool.implementation {
        ToolImplementation::Builtin(builtin) => builtin::run(context, *builtin, &arguments).await,
        ToolImplementation::Http {
            method,
            url,
            headers_env,
            max_response_bytes,
        } => {
            http::run(
                context.http,
                http::HttpTool {
                    method: *method,
                    url,
                    headers_env,
                    max_response_bytes: *max_response_bytes,
                    idempotency_key: context.idempotency_key,
                },
                &arguments,
            )
            .await
        }
        ToolImplementation::Command {
            command,
            max_output_bytes,
        } => {
            command::run(
                &context.workspace.root,
                command,
                *max_output_bytes,
                context.idempotency_key,
                &arguments,
            )
            .await
        }
        ToolImplementation::Mcp {
            server,
            tool: name,
            max_output_bytes,
        } => {
            context
                .mcp
                .call(
                    server,
                    name,
                    *max_output_bytes,
                    arguments,
                    context.idempotency_key,
                )
                .await
        }
        ToolImplementation::Subagent(name) => {
            let input = arguments
                .get("input")
                .and_then(Value::as_str)
                .unwrap_or_default();
            context
                .host
                .delegate(name, input, context.call_id)
                .await
                .map_err(|message| ToolError::new("subagent_failed", message))
        }
        // The gateway hands these to the client before execution; never reached.
        ToolImplementation::Client => Err(ToolError::new(
            "client_tool",
            "a client tool runs at the client, never on the server",
        )),
    }
}

/// Parses a tool's output as JSON; text that is not JSON becomes a JSON string.
fn json_or_text(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()))
}

/// A program of the workspace, ready to spawn without a shell: the workspace as working
/// directory and a scrubbed environment (only `PATH` and the variables it declares).
fn scrubbed_command(root: &Path, config: &CommandConfig) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(&config.program);
    command.args(&config.args).current_dir(root).env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        command.env("PATH", path);
    }
    for variable in &config.env {
        if let Some(value) = std::env::var_os(variable) {
            command.env(variable, value);
        }
    }
    command
}
