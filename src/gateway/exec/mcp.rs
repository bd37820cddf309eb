//! `mcp` tools: calls to tools of the MCP servers declared in `Runtime.spec.mcpServers`, over
//! stdio (a child process, scrubbed environment, workspace as cwd) or streamable HTTP, through
//! the official Rust SDK (`rmcp`). A server is connected on first use and kept; a server that
//! died is forgotten, so the next call starts it again. A result is bounded like command
//! output: larger than the tool's `maxOutputBytes` as serialized JSON, it is an
//! `output_too_large` error rather than model input.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, ContentBlock, MetaObject, RequestMetaObject};
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde_json::Value;
use tokio::sync::Mutex;

use super::ToolError;
use crate::workspace::{CompiledWorkspace, McpServerConfig, McpTransport};

type Client = RunningService<RoleClient, ()>;

/// Connections to the workspace's MCP servers, by server name.
pub struct McpClients {
    workspace: Arc<CompiledWorkspace>,
    http: reqwest::Client,
    connected: Mutex<HashMap<String, Arc<Client>>>,
}

impl std::fmt::Debug for McpClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpClients").finish_non_exhaustive()
    }
}

impl McpClients {
    pub fn new(workspace: Arc<CompiledWorkspace>, http: reqwest::Client) -> Self {
        Self {
            workspace,
            http,
            connected: Mutex::new(HashMap::new()),
        }
    }

    pub(super) async fn call(
        &self,
        server: &str,
        tool: &str,
        max_output_bytes: u64,
        arguments: Value,
        idempotency_key: &str,
    ) -> Result<Value, ToolError> {
        let client = self.client(server).await?;
        let mut meta = serde_json::Map::new();
        meta.insert("idempotencyKey".to_owned(), idempotency_key.into());
        let mut params = CallToolRequestParams::new(tool.to_owned());
        params.meta = Some(RequestMetaObject(MetaObject(meta)));
        if let Value::Object(arguments) = arguments {
            params = params.with_arguments(arguments);
        }
        match client.call_tool(params).await {
            Ok(result) => {
                let text: Vec<&str> = result
                    .content
                    .iter()
                    .filter_map(|block| match block {
                        ContentBlock::Text(text) => Some(text.text.as_str()),
                        _ => None,
                    })
                    .collect();
                let text = text.join("\n");
                if result.is_error == Some(true) {
                    return Err(ToolError::new(
                        "tool_error",
                        format!("MCP tool `{tool}` on `{server}` reported an error: {text}"),
                    ));
                }
                let output = match result.structured_content {
                    Some(structured) => structured,
                    None => serde_json::from_str(&text).unwrap_or(Value::String(text)),
                };
                if !fits(&output, max_output_bytes) {
                    return Err(ToolError::new(
                        "output_too_large",
                        format!(
                            "MCP tool `{tool}` on `{server}` returned more than {max_output_bytes} bytes"
                        ),
                    ));
                }
                Ok(output)
            }
            Err(ServiceError::McpError(error)) => Err(ToolError::new(
                "tool_error",
                format!(
                    "MCP server `{server}` refused the call to `{tool}`: {}",
                    error.message
                ),
            )),
            Err(error) => {
                // The connection is unusable (the server died, the stream broke): start afresh next time.
                self.forget(server, &client).await;
                Err(ToolError::new(
                    "unavailable",
                    format!("MCP server `{server}` failed during the call to `{tool}`: {error}"),
                ))
            }
        }
    }

    async fn client(&self, name: &str) -> Result<Arc<Client>, ToolError> {
        let mut connected = self.connected.lock().await;
        if let Some(client) = connected.get(name) {
            if !client.is_transport_closed() {
                return Ok(Arc::clone(client));
            }
            connected.remove(name);
        }
        let Some(server) = self.workspace.runtime.mcp_servers.get(name) else {
            return Err(ToolError::new(
                "unavailable",
                format!("MCP server `{name}` is not declared"),
            ));
        };
        let client = tokio::time::timeout(server.timeout, self.connect(server))
            .await
            .map_err(|_| {
                ToolError::new(
                    "unavailable",
                    format!(
                        "MCP server `{name}` did not complete its handshake within {}s",
                        server.timeout.as_secs_f64()
                    ),
                )
            })??;
        let client = Arc::new(client);
        connected.insert(name.to_owned(), Arc::clone(&client));
        Ok(client)
    }

    async fn connect(&self, server: &McpServerConfig) -> Result<Client, ToolError> {
        let failed = |error: &dyn std::fmt::Display| {
            ToolError::new(
                "unavailable",
                format!("cannot connect to MCP server `{}`: {error}", server.name),
            )
        };
        match &server.transport {
            McpTransport::Stdio(command) => {
                let child = super::scrubbed_command(&self.workspace.root, command);
                let (transport, _) = TokioChildProcess::builder(child)
                    .stderr(Stdio::null())
                    .spawn()
                    .map_err(|e| failed(&e))?;
                ().serve(transport).await.map_err(|e| failed(&e))
            }
            McpTransport::Http { url, headers_env } => {
                let mut headers = HashMap::new();
                for (header, variable) in headers_env {
                    let value = std::env::var(variable).map_err(|_| {
                        failed(&format!(
                            "environment variable {variable} (header {header}) is not set"
                        ))
                    })?;
                    let name = reqwest::header::HeaderName::from_bytes(header.as_bytes())
                        .map_err(|e| failed(&e))?;
                    let value =
                        reqwest::header::HeaderValue::from_str(&value).map_err(|e| failed(&e))?;
                    headers.insert(name, value);
                }
                let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
                config.custom_headers = headers;
                let transport =
                    StreamableHttpClientTransport::with_client(self.http.clone(), config);
                ().serve(transport).await.map_err(|e| failed(&e))
            }
        }
    }

    async fn forget(&self, name: &str, client: &Arc<Client>) {
        let mut connected = self.connected.lock().await;
        if connected.get(name).is_some_and(|c| Arc::ptr_eq(c, client)) {
            connected.remove(name);
        }
    }
}

/// Whether `value` serializes to at most `limit` bytes of JSON. Serializing into a counter
/// that refuses to go past the limit stops early, so an oversized result is never copied.
fn fits(value: &Value, limit: u64) -> bool {
    struct Counter {
        written: u64,
        limit: u64,
    }
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.written = self.written.saturating_add(bytes.len() as u64);
            if self.written > self.limit {
                return Err(std::io::Error::other("over the limit"));
            }
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    serde_json::to_writer(&mut Counter { written: 0, limit }, value).is_ok()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::fits;

    #[test]
    fn results_are_measured_as_serialized_json() {
        let value = json!({ "text": "abc" });
        let size = serde_json::to_vec(&value).unwrap().len() as u64;
        assert!(fits(&value, size));
        assert!(!fits(&value, size - 1));
        assert!(!fits(&json!("x".repeat(10_000)), 9_999));
    }
}
