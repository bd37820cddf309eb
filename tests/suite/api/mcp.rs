//! MCP tools through the gateway: a real MCP server written with rmcp, served over streamable
//! HTTP on loopback, and a stdio server that dies in the middle of a call.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{Value, json};

use super::{CLIENT_KEY, TestApp};
use crate::helpers::TestWorkspace;

/// An MCP server with `add` (structured result), `refuse` (an error result) and `repeat`
/// (`size` characters of text); it counts calls and keeps the idempotency key each call's
/// `_meta` carried.
#[derive(Clone)]
struct Calculator {
    calls: Arc<AtomicUsize>,
    keys: Arc<std::sync::Mutex<Vec<String>>>,
}

impl ServerHandler for Calculator {
    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema = json!({ "type": "object" });
        let schema = Arc::new(schema.as_object().unwrap().clone());
        Ok(ListToolsResult::with_all_items(vec![
            Tool::new("add", "Adds a and b", Arc::clone(&schema)),
            Tool::new("refuse", "Always fails", Arc::clone(&schema)),
            Tool::new("repeat", "Returns `size` characters", schema),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        // rmcp hands a request's `_meta` to the handler in its context.
        let key = context
            .meta
            .0
            .0
            .get("idempotencyKey")
            .or_else(|| request.meta.as_ref()?.0.0.get("idempotencyKey"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        self.keys.lock().unwrap().push(key);
        let arguments = request.arguments.unwrap_or_default();
        let result = match request.name.as_ref() {
            "add" => {
                let sum =
                    arguments["a"].as_f64().unwrap_or(0.0) + arguments["b"].as_f64().unwrap_or(0.0);
                let mut result = CallToolResult::success(vec![ContentBlock::text(sum.to_string())]);
                result.structured_content = Some(json!({ "sum": sum }));
                result
            }
            "repeat" => {
                let size = arguments["size"].as_u64().unwrap_or(0) as usize;
                CallToolResult::success(vec![ContentBlock::text("x".repeat(size))])
            }
            _ => CallToolResult::error(vec![ContentBlock::text("refused on purpose")]),
        };
        Ok(result.into())
    }
}

type Keys = Arc<std::sync::Mutex<Vec<String>>>;

async fn start_calculator() -> (String, Arc<AtomicUsize>, Keys) {
    let calls = Arc::new(AtomicUsize::new(0));
    let keys: Keys = Arc::default();
    let handler = Calculator {
        calls: Arc::clone(&calls),
        keys: Arc::clone(&keys),
    };
    let service = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, calls, keys)
}

/// A stdio MCP server (Python, no SDK) that answers the handshake and dies on any tool call.
const DYING_SERVER: &str = r#"import json, sys
for line in sys.stdin:
    message = json.loads(line)
    method = message.get("method")
    if method == "initialize":
        result = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "dying", "version": "1"}}
        print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
    elif method == "tools/call":
        sys.exit(7)
    elif "id" in message:
        print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {}}), flush=True)
"#;

#[tokio::test]
async fn mcp_tools_run_over_streamable_http_and_a_dying_stdio_server_is_a_typed_error() {
    let (url, calls, keys) = start_calculator().await;
    let workspace = TestWorkspace::empty();
    workspace.write(
        "config/runtime/workspace.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: {{ name: mcp-test }}\nspec:\n  mcpServers:\n    - {{ name: calc, url: \"{url}\" }}\n    - {{ name: dying, command: {{ program: python3, args: [resources/dying.py] }} }}\n"
        ),
    );
    workspace.write("resources/dying.py", DYING_SERVER);
    workspace.write(
        "config/catalogs/tools.yaml",
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: mcp }\nspec:\n  tools:\n    - { id: calc.add, mcp: { server: calc, tool: add } }\n    - { id: calc.refuse, mcp: { server: calc, tool: refuse } }\n    - { id: dying.work, timeout: 5s, mcp: { server: dying, tool: work } }\n",
    );
    workspace.write(
        "config/agents/mathematician.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: mathematician }\nspec:\n  backend: scripted\n  tools: [calc.add, calc.refuse, dying.work]\n  script:\n    - toolCall: { tool: calc.add, arguments: { a: 2, b: 3 } }\n    - toolCall: { tool: calc.refuse, arguments: {} }\n    - toolCall: { tool: dying.work, arguments: {} }\n    - toolCall: { tool: calc.add, arguments: { a: 1, b: 1 } }\n    - reply: done\n",
    );
    let app = TestApp::spawn(workspace).await;
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "mathematician", "input": { "text": "sum" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["status"], "completed", "{view}");
    let events = app.events(view["requestId"].as_str().unwrap()).await;
    let completed: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "runtime.tool.direct.completed")
        .map(|e| &e["data"])
        .collect();
    assert_eq!(completed.len(), 4);
    assert_eq!(completed[0]["output"], json!({ "sum": 5.0 }));
    assert_eq!(completed[1]["error"]["code"], "tool_error");
    assert!(
        completed[1]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("refused on purpose")
    );
    assert_eq!(
        completed[2]["error"]["code"], "unavailable",
        "{}",
        completed[2]
    );
    assert_eq!(
        completed[3]["output"],
        json!({ "sum": 2.0 }),
        "the run went on after the death"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    // Every call carried its idempotency key in `_meta`: the run and the script step.
    let run_id = view["runs"][0]["runId"].as_str().unwrap();
    assert_eq!(
        *keys.lock().unwrap(),
        [
            format!("{run_id}.s1"),
            format!("{run_id}.s2"),
            format!("{run_id}.s4")
        ]
    );
}

#[tokio::test]
async fn an_mcp_result_larger_than_its_bound_is_output_too_large() {
    let (url, calls, _keys) = start_calculator().await;
    let workspace = TestWorkspace::empty();
    workspace.write(
        "config/runtime/workspace.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: {{ name: mcp-test }}\nspec:\n  mcpServers:\n    - {{ name: calc, url: \"{url}\" }}\n"
        ),
    );
    workspace.write(
        "config/catalogs/tools.yaml",
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: mcp }\nspec:\n  tools:\n    - { id: calc.repeat, mcp: { server: calc, tool: repeat, maxOutputBytes: 1KiB } }\n    - { id: calc.repeat-default, mcp: { server: calc, tool: repeat } }\n",
    );
    workspace.write(
        "config/agents/echoer.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: echoer }\nspec:\n  backend: scripted\n  tools: [calc.repeat, calc.repeat-default]\n  script:\n    - toolCall: { tool: calc.repeat, arguments: { size: 1000 } }\n    - toolCall: { tool: calc.repeat, arguments: { size: 4096 } }\n    - toolCall: { tool: calc.repeat-default, arguments: { size: 4096 } }\n    - reply: done\n",
    );
    let app = TestApp::spawn(workspace).await;
    let (status, view) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "echoer", "input": { "text": "go" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["status"], "completed", "{view}");
    let events = app.events(view["requestId"].as_str().unwrap()).await;
    let completed: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "runtime.tool.direct.completed")
        .map(|e| &e["data"])
        .collect();
    assert_eq!(completed.len(), 3);
    // 1,000 characters serialize to 1,002 bytes of JSON: within 1KiB.
    assert_eq!(completed[0]["output"], json!("x".repeat(1000)));
    assert_eq!(
        completed[1]["error"]["code"], "output_too_large",
        "{}",
        completed[1]
    );
    assert!(completed[1]["output"].is_null(), "{}", completed[1]);
    // The default bound (1MiB, like command output) lets the same result through.
    assert_eq!(completed[2]["output"], json!("x".repeat(4096)));
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}
