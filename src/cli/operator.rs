//! The operator CLI: `stable-harness approvals list|show|approve|deny` and `stable-harness
//! requests list|show|cancel|retry|events [--follow]` and `stable-harness usage [--by key|agent|
//! model|day] [--since 7d]`, talking to a running server's admin API
//! with `--url` and `--admin-key` (or `STABLE_HARNESS_URL`, `STABLE_HARNESS_ADMIN_KEY`).
//! Results print as tables, or as the server's JSON with `--json`.
//!
//! Exit codes: 0 done; 1 the server refused (its error is printed: 404 unknown id, 409 wrong
//! state, ...); 2 bad usage; 4 the server could not be reached or answered something that is
//! not the API.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

use super::{exit, output};
use crate::redact::Secret;

use exit::UNREACHABLE;

#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// The server's base URL.
    #[arg(
        long,
        env = "STABLE_HARNESS_URL",
        default_value = "http://127.0.0.1:8642"
    )]
    pub url: String,
    /// An admin key of that server (the first, if the variable lists several).
    #[arg(
        long = "admin-key",
        env = "STABLE_HARNESS_ADMIN_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub admin_key: Vec<Secret>,
    /// Print the server's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Subcommand)]
pub enum ApprovalsCommand {
    /// Approvals, newest first (pending ones by default).
    List {
        #[command(flatten)]
        server: ServerArgs,
        /// pending | approved | denied | expired | cancelled | all
        #[arg(long, default_value = "pending")]
        status: String,
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// One approval, whole.
    Show {
        #[command(flatten)]
        server: ServerArgs,
        id: String,
    },
    /// Approve a pending approval: the waiting call runs.
    Approve {
        #[command(flatten)]
        server: ServerArgs,
        id: String,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Deny a pending approval: the model hears the denial.
    Deny {
        #[command(flatten)]
        server: ServerArgs,
        id: String,
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum RequestsCommand {
    /// Requests, newest first.
    List {
        #[command(flatten)]
        server: ServerArgs,
        /// queued | running | waiting_approval | completed | failed | cancelled
        #[arg(long)]
        status: Option<String>,
        #[arg(long)]
        agent: Option<String>,
        #[arg(long)]
        limit: Option<u32>,
    },
    /// One request with its runs and approvals.
    Show {
        #[command(flatten)]
        server: ServerArgs,
        id: String,
    },
    /// Cancel a request: its run stops, its pending approvals are cancelled.
    Cancel {
        #[command(flatten)]
        server: ServerArgs,
        id: String,
    },
    /// Start a new run of a failed or cancelled request.
    Retry {
        #[command(flatten)]
        server: ServerArgs,
        id: String,
    },
    /// A request's events; with --follow, live until it ends.
    Events {
        #[command(flatten)]
        server: ServerArgs,
        id: String,
        #[arg(long)]
        follow: bool,
    },
}

/// `stable-harness usage`: what the budgets were charged, from the server's ledger.
#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Group by key, agent, model or day (default: one total).
    #[arg(long)]
    pub by: Option<String>,
    /// Only the usage of the last DURATION (e.g. `7d`, `12h`; at most 3650d).
    #[arg(long)]
    pub since: Option<String>,
}

pub async fn usage(args: UsageArgs) -> u8 {
    let result = usage_query(&args);
    let result = match result {
        Ok(query) => {
            with(&args.server, |client| async move {
                let report = client.get(&format!("/admin/usage?{query}")).await?;
                Ok(table(
                    &report["data"],
                    &[
                        ("GROUP", "/group"),
                        ("CALLS", "/calls"),
                        ("PROMPT", "/promptTokens"),
                        ("COMPLETION", "/completionTokens"),
                        ("TOTAL", "/totalTokens"),
                        ("COST", "/cost"),
                        ("ESTIMATED", "/estimatedCalls"),
                    ],
                    &report,
                    args.server.json,
                ))
            })
            .await
        }
        Err(failure) => Err(failure),
    };
    finish(result)
}

fn usage_query(args: &UsageArgs) -> Result<String, Failure> {
    let mut query = Vec::new();
    if let Some(by) = &args.by {
        if !["key", "agent", "model", "day"].contains(&by.as_str()) {
            return Err(Failure {
                code: exit::USAGE,
                message: format!("--by takes key, agent, model or day, not `{by}`"),
            });
        }
        query.push(format!("groupBy={by}"));
    }
    if let Some(since) = &args.since {
        let duration = crate::workspace::parse_duration(since)
            .ok()
            .filter(|d| *d <= Duration::from_secs(3_650 * 86_400))
            .and_then(|d| chrono::Duration::from_std(d).ok())
            .ok_or_else(|| Failure {
                code: exit::USAGE,
                message: format!("--since takes a duration such as 7d or 12h, not `{since}`"),
            })?;
        let from = chrono::Utc::now() - duration;
        query.push(format!(
            "from={}",
            encode(&from.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        ));
    }
    Ok(query.join("&"))
}

/// A refusal or a failure to reach the server, with the exit code it means.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn unreachable(server: &ServerArgs, error: impl std::fmt::Display) -> Self {
        Self {
            code: UNREACHABLE,
            message: format!("cannot reach the server at {}: {error}", server.url),
        }
    }
}

struct Client<'a> {
    server: &'a ServerArgs,
    http: reqwest::Client,
}

impl<'a> Client<'a> {
    fn new(server: &'a ServerArgs) -> Result<Self, Failure> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|error| Failure::unreachable(server, error))?;
        Ok(Self { server, http })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let url = format!("{}{path}", self.server.url.trim_end_matches('/'));
        let request = self.http.request(method, url);
        match self.server.admin_key.first() {
            Some(key) => request.bearer_auth(key.expose()),
            None => request,
        }
    }

    /// Sends and reads the JSON answer; an error envelope is a refusal (exit 1).
    async fn call(&self, request: reqwest::RequestBuilder) -> Result<Value, Failure> {
        let response = request
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .map_err(|error| Failure::unreachable(self.server, error))?;
        let status = response.status();
        let body: Value = response.json().await.map_err(|_| Failure {
            code: UNREACHABLE,
            message: format!(
                "the server at {} answered {status} without the API's JSON: is it stable-harness?",
                self.server.url
            ),
        })?;
        if status.is_success() {
            return Ok(body);
        }
        let error = &body["error"];
        Err(Failure {
            code: exit::FAILED,
            message: format!(
                "{status}: {} ({})",
                error["message"].as_str().unwrap_or("refused"),
                error["code"].as_str().unwrap_or("error")
            ),
        })
    }

    async fn get(&self, path: &str) -> Result<Value, Failure> {
        self.call(self.request(reqwest::Method::GET, path)).await
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value, Failure> {
        self.call(self.request(reqwest::Method::POST, path).json(&body))
            .await
    }
}

pub async fn approvals(command: ApprovalsCommand) -> u8 {
    let result = match &command {
        ApprovalsCommand::List {
            server,
            status,
            limit,
        } => {
            let filter = if status == "all" {
                String::new()
            } else {
                format!("status={}&", encode(status))
            };
            with(server, |client| async move {
                let page = client
                    .get(&format!("/admin/approvals?{filter}limit={limit}"))
                    .await?;
                Ok(table(
                    &page["data"],
                    &[
                        ("ID", "/id"),
                        ("STATUS", "/status"),
                        ("TOOL", "/toolId"),
                        ("AGENT", "/agentId"),
                        ("REQUEST", "/requestId"),
                        ("CREATED", "/createdAt"),
                    ],
                    &page,
                    server.json,
                ))
            })
            .await
        }
        ApprovalsCommand::Show { server, id } => {
            with(server, |client| async move {
                let approval = client
                    .get(&format!("/admin/approvals/{}", encode(id)))
                    .await?;
                Ok(pretty(&approval))
            })
            .await
        }
        ApprovalsCommand::Approve { server, id, reason }
        | ApprovalsCommand::Deny { server, id, reason } => {
            let verb = if matches!(command, ApprovalsCommand::Approve { .. }) {
                "approve"
            } else {
                "deny"
            };
            with(server, |client| async move {
                let decided = client
                    .post(
                        &format!("/admin/approvals/{}/{verb}", encode(id)),
                        json!({ "reason": reason }),
                    )
                    .await?;
                Ok(if server.json {
                    pretty(&decided)
                } else {
                    format!(
                        "{} {}",
                        decided["id"].as_str().unwrap_or(id),
                        text(&decided["status"])
                    )
                })
            })
            .await
        }
    };
    finish(result)
}

pub async fn requests(command: RequestsCommand) -> u8 {
    let result = match &command {
        RequestsCommand::List {
            server,
            status,
            agent,
            limit,
        } => {
            let mut query = Vec::new();
            if let Some(status) = status {
                query.push(format!("status={}", encode(status)));
            }
            if let Some(agent) = agent {
                query.push(format!("agentId={}", encode(agent)));
            }
            if let Some(limit) = limit {
                query.push(format!("limit={limit}"));
            }
            let query = query.join("&");
            with(server, |client| async move {
                let page = client.get(&format!("/admin/requests?{query}")).await?;
                Ok(table(
                    &page["data"],
                    &[
                        ("ID", "/requestId"),
                        ("STATUS", "/status"),
                        ("AGENT", "/agentId"),
                        ("OWNER", "/owner"),
                        ("CREATED", "/createdAt"),
                    ],
                    &page,
                    server.json,
                ))
            })
            .await
        }
        RequestsCommand::Show { server, id } => {
            with(server, |client| async move {
                let request = client
                    .get(&format!("/admin/requests/{}", encode(id)))
                    .await?;
                Ok(if server.json {
                    pretty(&request)
                } else {
                    request_text(&request)
                })
            })
            .await
        }
        RequestsCommand::Cancel { server, id } => {
            with(server, |client| async move {
                let request = client
                    .post(&format!("/admin/requests/{}/cancel", encode(id)), json!({}))
                    .await?;
                Ok(if server.json {
                    pretty(&request)
                } else {
                    format!("{id} {}", text(&request["status"]))
                })
            })
            .await
        }
        RequestsCommand::Retry { server, id } => {
            with(server, |client| async move {
                let retried = client
                    .post(&format!("/admin/requests/{}/retry", encode(id)), json!({}))
                    .await?;
                Ok(if server.json {
                    pretty(&retried)
                } else {
                    format!(
                        "{id} retrying: run {} (attempt {})",
                        text(&retried["runId"]),
                        retried["attempt"]
                    )
                })
            })
            .await
        }
        RequestsCommand::Events { server, id, follow } => events(server, id, *follow).await,
    };
    finish(result)
}

/// Runs `work` with a client of `server`, or fails as bad usage without an admin key.
async fn with<'a, F, Fut>(server: &'a ServerArgs, work: F) -> Result<String, Failure>
where
    F: FnOnce(Client<'a>) -> Fut,
    Fut: std::future::Future<Output = Result<String, Failure>>,
{
    if server.admin_key.is_empty() {
        return Err(Failure {
            code: exit::USAGE,
            message: "no admin key: pass --admin-key or set STABLE_HARNESS_ADMIN_KEY".into(),
        });
    }
    work(Client::new(server)?).await
}

fn finish(result: Result<String, Failure>) -> u8 {
    match result {
        Ok(text) => {
            if !text.is_empty() {
                output::print(&text);
            }
            exit::OK
        }
        Err(failure) => {
            output::error(&format!("stable-harness: {}", failure.message));
            failure.code
        }
    }
}

/// Prints a request's events, page by page; with `follow`, as they happen (SSE) until the
/// request ends. Each event is a line: `seq type data` (or its JSON with `--json`).
async fn events(server: &ServerArgs, id: &str, follow: bool) -> Result<String, Failure> {
    with(server, |client| async move {
        let path = format!("/admin/requests/{}/events", encode(id));
        if !follow {
            let mut after = 0;
            loop {
                let page = client
                    .get(&format!("{path}?after={after}&limit=1000"))
                    .await?;
                let data = page["data"].as_array().cloned().unwrap_or_default();
                for event in &data {
                    output::print(&event_line(event, server.json));
                }
                after = page["nextAfter"].as_i64().unwrap_or(after);
                if data.len() < 1000 {
                    return Ok(String::new());
                }
            }
        }
        let response = client
            .request(reqwest::Method::GET, &path)
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .send()
            .await
            .map_err(|error| Failure::unreachable(server, error))?;
        if !response.status().is_success() {
            // The same refusal a JSON read gets (404 unknown id, 401, 403).
            return client.get(&path).await.map(|_| String::new());
        }
        let mut stream = response.bytes_stream();
        let mut buffer = String::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|error| Failure::unreachable(server, error))?;
            buffer.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buffer.find("\n\n") {
                let frame: String = buffer.drain(..end + 2).collect();
                let data: String = frame
                    .lines()
                    .filter_map(|line| line.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                if let Ok(event) = serde_json::from_str::<Value>(&data) {
                    output::print(&event_line(&event, server.json));
                }
            }
        }
        Ok(String::new())
    })
    .await
}

fn event_line(event: &Value, as_json: bool) -> String {
    if as_json {
        return event.to_string();
    }
    format!(
        "{:>5}  {:<34} {}",
        event["seq"],
        text(&event["type"]),
        event["data"]
    )
}

/// Rows of `items` under `columns` (header, JSON pointer), then the next cursor if any.
fn table(items: &Value, columns: &[(&str, &str)], page: &Value, as_json: bool) -> String {
    if as_json {
        return pretty(page);
    }
    let rows: Vec<Vec<String>> = items
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|item| {
                    columns
                        .iter()
                        .map(|(_, pointer)| text(item.pointer(pointer).unwrap_or(&Value::Null)))
                        .collect()
                })
                .collect()
        })
        .unwrap_or_default();
    let widths: Vec<usize> = columns
        .iter()
        .enumerate()
        .map(|(i, (header, _))| {
            rows.iter()
                .map(|row| row[i].chars().count())
                .chain([header.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<String>| -> String {
        cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    let mut lines = vec![line(columns.iter().map(|(h, _)| (*h).to_owned()).collect())];
    lines.extend(rows.into_iter().map(line));
    if let Some(cursor) = page["nextCursor"].as_str() {
        lines.push(format!("(more: --json shows nextCursor {cursor})"));
    }
    lines.join("\n")
}

fn request_text(request: &Value) -> String {
    let mut lines = vec![
        format!("request   {}", text(&request["requestId"])),
        format!("status    {}", text(&request["status"])),
        format!("agent     {}", text(&request["agentId"])),
        format!("session   {}", text(&request["sessionId"])),
        format!("owner     {}", text(&request["owner"])),
        format!("created   {}", text(&request["createdAt"])),
    ];
    if let Some(output) = request["output"].as_str() {
        lines.push(format!("output    {output}"));
    }
    if !request["error"].is_null() {
        lines.push(format!("error     {}", request["error"]));
    }
    for run in request["runs"].as_array().into_iter().flatten() {
        lines.push(format!(
            "run       {}  attempt {}  {}",
            text(&run["runId"]),
            run["attempt"],
            text(&run["status"])
        ));
    }
    for approval in request["approvals"].as_array().into_iter().flatten() {
        lines.push(format!(
            "approval  {}  {}  {}",
            text(&approval["id"]),
            text(&approval["toolId"]),
            text(&approval["status"])
        ));
    }
    lines.join("\n")
}

fn text(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// A path segment or query value, percent-encoded.
fn encode(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}
