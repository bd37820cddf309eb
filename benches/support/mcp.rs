//! An MCP server for the load benchmark: one tool, `now`, which answers a fixed timestamp,
//! served over streamable HTTP on loopback by rmcp (the SDK the gateway's client is), and a
//! client calling it directly, to tell the server's own round trip from the gateway's cost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::serve::ListenerExt;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{
    StreamableHttpClientTransport, StreamableHttpServerConfig, StreamableHttpService,
};
use rmcp::{ErrorData, ServerHandler, ServiceExt};
use serde_json::json;

/// The tool's name on the server.
pub const TOOL: &str = "now";

#[derive(Clone)]
struct Clock;

impl ServerHandler for Clock {
    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema = json!({ "type": "object" });
        let schema = Arc::new(schema.as_object().cloned().unwrap_or_default());
        Ok(ListToolsResult::with_all_items(vec![Tool::new(
            TOOL,
            "The current date and time (UTC)",
            schema,
        )]))
    }

    async fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        Ok(CallToolResult::success(vec![ContentBlock::text("2026-01-01T00:00:00Z")]).into())
    }
}

/// Serves the MCP server on a free loopback port for the rest of the process; its URL.
pub async fn start() -> String {
    let service = StreamableHttpService::new(
        || Ok(Clock),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    // Without TCP_NODELAY each answer's last write waits for the client's delayed ACK (~40
    // ms a call here): a server built for latency sets it, as the gateway's client does.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    url
}

/// Calls the tool at `url` directly, one call after another for `duration`, over one session
/// (as the gateway keeps one): each call's time.
pub async fn direct_calls(url: &str, duration: Duration) -> Vec<Duration> {
    let client = ().serve(StreamableHttpClientTransport::from_uri(url)).await.unwrap();
    let mut times = Vec::new();
    let started = Instant::now();
    while started.elapsed() < duration {
        let call = Instant::now();
        let result = client
            .call_tool(CallToolRequestParams::new(TOOL))
            .await
            .unwrap();
        assert_ne!(result.is_error, Some(true), "{result:?}");
        times.push(call.elapsed());
    }
    // Dropping the client ends its session.
    times
}
