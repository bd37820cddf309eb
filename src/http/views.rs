//! Wire views of stored records, shared by `/runtime` and `/admin` (a request's and a run's
//! written by hand, the others by serde), the one mapping of runtime errors to API errors, how
//! a JSON answer is written ([`Json`], or [`JsonText`] for one a surface wrote itself) and how
//! an SSE event's JSON data is written from a value.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use crate::error::{ApiError, ErrorCode};
use crate::json;
use crate::runtime::{JournalError, Runtime, RuntimeError};
use crate::spend::SpendError;
use crate::store::spend::UsageTotals;
use crate::store::{
    ApprovalRecord, EventRecord, MessageRecord, RequestInFull, RequestRecord, RunRecord, RunStatus,
    SessionRecord, StoreError,
};
use crate::time;

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunView {
    pub run_id: String,
    pub request_id: String,
    pub attempt: i64,
    pub status: RunStatus,
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    #[serde(serialize_with = "crate::time::serialize")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::serialize_optional")]
    pub started_at: Option<DateTime<Utc>>,
    #[serde(serialize_with = "crate::time::serialize_optional")]
    pub ended_at: Option<DateTime<Utc>>,
}

impl From<RunRecord> for RunView {
    fn from(run: RunRecord) -> Self {
        Self {
            run_id: run.id,
            request_id: run.request_id,
            attempt: run.attempt,
            status: run.status,
            error: run.error,
            created_at: run.created_at,
            started_at: run.started_at,
            ended_at: run.ended_at,
        }
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RequestView {
    pub request_id: String,
    pub session_id: String,
    pub agent_id: String,
    pub protocol: String,
    /// The client key identity that owns the request.
    pub owner: String,
    pub status: RunStatus,
    pub output: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    #[schema(value_type = Option<Object>)]
    pub usage: Option<Value>,
    /// What the request's model calls cost in USD, from the models' `pricing` (`null` when a
    /// model has no pricing or the request has not completed).
    pub cost_usd: Option<f64>,
    #[schema(value_type = Object)]
    pub metadata: Value,
    #[serde(serialize_with = "crate::time::serialize")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::serialize")]
    pub updated_at: DateTime<Utc>,
    pub runs: Vec<RunView>,
    /// The request's approvals, oldest first (in a request's own view; lists leave it out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approvals: Option<Vec<ApprovalRecord>>,
    /// What the budgets were charged for this request: every upstream call of every run
    /// (retries, tool-loop turns and failed attempts included), from the usage ledger. In a
    /// request's own view; lists leave it out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub charged: Option<crate::store::spend::UsageTotals>,
}

impl RequestView {
    pub fn new(request: RequestRecord, runs: Vec<RunRecord>) -> Self {
        Self {
            request_id: request.id,
            session_id: request.session_id,
            agent_id: request.agent_id,
            protocol: request.protocol,
            owner: request.owner,
            status: request.status,
            output: request.output,
            error: request.error,
            cost_usd: request
                .usage
                .as_ref()
                .and_then(|usage| usage.get("costUsd"))
                .and_then(Value::as_f64),
            usage: request.usage,
            metadata: request.metadata,
            created_at: request.created_at,
            updated_at: request.updated_at,
            runs: runs.into_iter().map(RunView::from).collect(),
            approvals: None,
            charged: None,
        }
    }

    /// The view of one request, with its approvals and what it was charged.
    pub fn in_full(full: RequestInFull) -> Self {
        let mut view = Self::new(full.request, full.runs);
        view.approvals = Some(full.approvals);
        view.charged = Some(full.charged);
        view
    }
}

// The views below are written straight into their text, the bytes their derived `Serialize`
// writes (the tests compare both): a waiting client's answer is a request's view, and
// serde_json's serializer spent ~13,000 instructions on one (docs/profiling.md, the
// forty-ninth pass). The derives stay the reference, and utoipa's schema.

impl RunView {
    /// Appends the run's JSON text.
    pub fn write(&self, out: &mut String) {
        out.push_str("{\"runId\":");
        json::write_str(out, &self.run_id);
        out.push_str(",\"requestId\":");
        json::write_str(out, &self.request_id);
        out.push_str(",\"attempt\":");
        out.push_str(itoa::Buffer::new().format(self.attempt));
        write_status(out, self.status.as_str());
        out.push_str(",\"error\":");
        json::write_or_null(out, self.error.as_ref());
        out.push_str(",\"createdAt\":");
        time::write_json(out, &self.created_at);
        out.push_str(",\"startedAt\":");
        time::write_json_optional(out, self.started_at.as_ref());
        out.push_str(",\"endedAt\":");
        time::write_json_optional(out, self.ended_at.as_ref());
        out.push('}');
    }
}

impl RequestView {
    /// Appends the request's JSON text.
    pub fn write(&self, out: &mut String) {
        out.push_str("{\"requestId\":");
        json::write_str(out, &self.request_id);
        out.push_str(",\"sessionId\":");
        json::write_str(out, &self.session_id);
        out.push_str(",\"agentId\":");
        json::write_str(out, &self.agent_id);
        out.push_str(",\"protocol\":");
        json::write_str(out, &self.protocol);
        out.push_str(",\"owner\":");
        json::write_str(out, &self.owner);
        write_status(out, self.status.as_str());
        out.push_str(",\"output\":");
        json::write_str_or_null(out, self.output.as_deref());
        out.push_str(",\"error\":");
        json::write_or_null(out, self.error.as_ref());
        out.push_str(",\"usage\":");
        json::write_or_null(out, self.usage.as_ref());
        out.push_str(",\"costUsd\":");
        json::write_f64_or_null(out, self.cost_usd);
        out.push_str(",\"metadata\":");
        json::write(out, &self.metadata);
        out.push_str(",\"createdAt\":");
        time::write_json(out, &self.created_at);
        out.push_str(",\"updatedAt\":");
        time::write_json(out, &self.updated_at);
        out.push_str(",\"runs\":");
        json::write_array(out, &self.runs, |out, run| run.write(out));
        if let Some(approvals) = &self.approvals {
            out.push_str(",\"approvals\":");
            json::write_array(out, approvals, write_approval);
        }
        if let Some(charged) = &self.charged {
            out.push_str(",\"charged\":");
            write_totals(out, charged);
        }
        out.push('}');
    }
}

impl RequestList {
    /// Appends the page's JSON text.
    pub fn write(&self, out: &mut String) {
        out.push_str("{\"data\":");
        json::write_array(out, &self.data, |out, view| view.write(out));
        out.push_str(",\"nextCursor\":");
        json::write_str_or_null(out, self.next_cursor.as_deref());
        out.push('}');
    }
}

/// A view's answer: its JSON text, written by the view's own writer.
macro_rules! written_answer {
    ($($view:ty),*) => {$(
        impl axum::response::IntoResponse for $view {
            fn into_response(self) -> axum::response::Response {
                // Most views fit without growing it.
                let mut text = String::with_capacity(1024);
                self.write(&mut text);
                JsonText(text).into_response()
            }
        }
    )*};
}

written_answer!(RunView, RequestView, RequestList);

/// `,"status":"…"`: a status's text needs no escapes.
fn write_status(out: &mut String, status: &str) {
    out.push_str(",\"status\":\"");
    out.push_str(status);
    out.push('"');
}

/// An approval as its derived `Serialize` writes it.
fn write_approval(out: &mut String, approval: &ApprovalRecord) {
    out.push_str("{\"id\":");
    json::write_str(out, &approval.id);
    out.push_str(",\"requestId\":");
    json::write_str(out, &approval.request_id);
    out.push_str(",\"runId\":");
    json::write_str(out, &approval.run_id);
    out.push_str(",\"sessionId\":");
    json::write_str(out, &approval.session_id);
    out.push_str(",\"agentId\":");
    json::write_str(out, &approval.agent_id);
    out.push_str(",\"callKey\":");
    json::write_str(out, &approval.call_key);
    out.push_str(",\"kind\":\"");
    out.push_str(approval.kind.as_str());
    out.push_str("\",\"execution\":");
    out.push_str(itoa::Buffer::new().format(approval.execution));
    out.push_str(",\"toolCallId\":");
    json::write_str(out, &approval.tool_call_id);
    out.push_str(",\"toolId\":");
    json::write_str(out, &approval.tool_id);
    out.push_str(",\"arguments\":");
    json::write(out, &approval.arguments);
    out.push_str(",\"rule\":");
    json::write_str_or_null(out, approval.rule.as_deref());
    write_status(out, approval.status.as_str());
    out.push_str(",\"reason\":");
    json::write_str_or_null(out, approval.reason.as_deref());
    out.push_str(",\"decidedBy\":");
    json::write_str_or_null(out, approval.decided_by.as_deref());
    out.push_str(",\"createdAt\":");
    time::write_json(out, &approval.created_at);
    out.push_str(",\"expiresAt\":");
    time::write_json_optional(out, approval.expires_at.as_ref());
    out.push_str(",\"decidedAt\":");
    time::write_json_optional(out, approval.decided_at.as_ref());
    out.push('}');
}

/// What a request was charged, as its derived `Serialize` writes it.
fn write_totals(out: &mut String, totals: &UsageTotals) {
    let mut digits = itoa::Buffer::new();
    out.push_str("{\"group\":");
    json::write_str(out, &totals.group);
    out.push_str(",\"calls\":");
    out.push_str(digits.format(totals.calls));
    out.push_str(",\"promptTokens\":");
    out.push_str(digits.format(totals.prompt_tokens));
    out.push_str(",\"completionTokens\":");
    out.push_str(digits.format(totals.completion_tokens));
    out.push_str(",\"totalTokens\":");
    out.push_str(digits.format(totals.total_tokens));
    out.push_str(",\"cost\":");
    json::write_f64_or_null(out, totals.cost);
    out.push_str(",\"estimatedCalls\":");
    out.push_str(digits.format(totals.estimated_calls));
    out.push('}');
}

/// A page of events: `nextAfter` is the `after` of the next call.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventPage {
    pub data: Vec<EventRecord>,
    pub next_after: i64,
}

/// `?after=SEQ&limit=N` of the event endpoints.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Only events with a greater seq (0 or more; default 0).
    #[serde(default)]
    pub after: Option<i64>,
    /// At most this many, 1 to 1000 (JSON only; default 500).
    #[serde(default)]
    pub limit: Option<i64>,
}

impl EventsQuery {
    /// `after` (0 when absent) and `limit` (500 when absent), or 422 naming the parameter out
    /// of range.
    pub fn checked(&self) -> Result<(i64, i64), ApiError> {
        let after = self.after.unwrap_or(0);
        if after < 0 {
            return Err(
                ApiError::new(ErrorCode::InvalidRequest, "`after` is a seq: 0 or more")
                    .param("after"),
            );
        }
        let limit = self.limit.unwrap_or(500);
        if !(1..=1000).contains(&limit) {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "`limit` must be between 1 and 1000",
            )
            .param("limit"));
        }
        Ok((after, limit))
    }
}

impl EventPage {
    /// A page of `data` read after `after`; `nextAfter` stays put when the page is empty.
    pub fn new(data: Vec<EventRecord>, after: i64) -> Self {
        let next_after = data.last().map_or(after, |e| e.seq);
        Self { data, next_after }
    }
}

/// A page of a list: `nextCursor` is the `cursor` of the next call, `null` at the end.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RequestList {
    pub data: Vec<RequestView>,
    pub next_cursor: Option<String>,
}

/// The request and its runs, or 404 — also when `owner` is given and the request belongs to
/// another key identity (ownership, SPEC section 4; admin views pass `None`).
pub async fn request_view(
    runtime: &Runtime,
    id: &str,
    owner: Option<&str>,
) -> Result<RequestView, ApiError> {
    let full = runtime
        .store()
        .request_in_full(id)
        .await?
        .filter(|full| owner.is_none_or(|owner| full.request.owner == owner))
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::RequestNotFound,
                format!("request `{id}` not found"),
            )
            .param("id")
        })?;
    Ok(RequestView::in_full(full))
}

/// Requests with their runs, read in one go for a page of a list.
pub async fn request_views(
    runtime: &Runtime,
    requests: Vec<RequestRecord>,
) -> Result<Vec<RequestView>, ApiError> {
    let ids: Vec<String> = requests.iter().map(|r| r.id.clone()).collect();
    let mut runs: std::collections::HashMap<String, Vec<RunRecord>> =
        std::collections::HashMap::new();
    for run in runtime.store().runs_of_requests(&ids).await? {
        runs.entry(run.request_id.clone()).or_default().push(run);
    }
    Ok(requests
        .into_iter()
        .map(|request| {
            let of_request = runs.remove(&request.id).unwrap_or_default();
            RequestView::new(request, of_request)
        })
        .collect())
}

/// Where a forked session branched off.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkOrigin {
    pub session_id: String,
    pub message_id: String,
}

/// One message of a session's tree.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessageView {
    pub message_id: String,
    /// The session the message was written in (a fork shares its origin's messages).
    pub session_id: String,
    /// The message it follows (`null` at a root).
    pub parent_id: Option<String>,
    /// The request that wrote it.
    pub request_id: Option<String>,
    pub role: String,
    /// The message as OpenAI-style JSON (`{"role", "content", ...}`).
    #[schema(value_type = Object)]
    pub content: Value,
    #[serde(serialize_with = "crate::time::serialize")]
    pub created_at: DateTime<Utc>,
}

impl From<MessageRecord> for MessageView {
    fn from(message: MessageRecord) -> Self {
        Self {
            message_id: message.id,
            session_id: message.session_id,
            parent_id: message.parent_id,
            request_id: message.request_id,
            role: message.role,
            content: message.content,
            created_at: message.created_at,
        }
    }
}

/// A session as lists show it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionSummary {
    pub session_id: String,
    pub agent_id: String,
    /// The client key identity that owns it.
    pub owner: String,
    pub forked_from: Option<ForkOrigin>,
    #[serde(serialize_with = "crate::time::serialize")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::serialize")]
    pub updated_at: DateTime<Utc>,
}

impl From<SessionRecord> for SessionSummary {
    fn from(session: SessionRecord) -> Self {
        let forked_from = session.metadata.get("forkedFrom").and_then(|origin| {
            Some(ForkOrigin {
                session_id: origin.get("sessionId")?.as_str()?.to_owned(),
                message_id: origin.get("messageId")?.as_str()?.to_owned(),
            })
        });
        Self {
            session_id: session.id,
            agent_id: session.agent_id,
            owner: session.owner,
            forked_from,
            created_at: session.created_at,
            updated_at: session.updated_at,
        }
    }
}

/// A session and its message tree.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionView {
    pub session_id: String,
    pub agent_id: String,
    pub owner: String,
    pub forked_from: Option<ForkOrigin>,
    #[serde(serialize_with = "crate::time::serialize")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::serialize")]
    pub updated_at: DateTime<Utc>,
    /// The newest leaf: the message the session's next request continues from.
    pub head_message_id: Option<String>,
    /// The history the next request continues: the path from the root to the head, shared
    /// messages of the session it was forked from included.
    pub history: Vec<MessageView>,
    /// Every message written in this session, every branch, oldest first, each with its
    /// parent.
    pub messages: Vec<MessageView>,
}

/// A page of sessions.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionList {
    pub data: Vec<SessionSummary>,
    pub next_cursor: Option<String>,
}

/// A session with its tree, or 404 — also when `owner` is given and another key owns it.
pub async fn session_view(
    runtime: &Runtime,
    id: &str,
    owner: Option<&str>,
) -> Result<SessionView, ApiError> {
    let session = runtime
        .owned_session(id, owner)
        .await
        .map_err(|error| ApiError::from(error).param("id"))?;
    let history = runtime.session_history(&session).await?;
    let messages = runtime.store().messages(&session.id).await?;
    let summary = SessionSummary::from(session);
    Ok(SessionView {
        session_id: summary.session_id,
        agent_id: summary.agent_id,
        owner: summary.owner,
        forked_from: summary.forked_from,
        created_at: summary.created_at,
        updated_at: summary.updated_at,
        head_message_id: history.last().map(|m| m.id.clone()),
        history: history.into_iter().map(MessageView::from).collect(),
        messages: messages.into_iter().map(MessageView::from).collect(),
    })
}

impl From<RuntimeError> for ApiError {
    fn from(error: RuntimeError) -> Self {
        match error {
            RuntimeError::AgentNotFound(agent) => ApiError::new(
                ErrorCode::AgentNotFound,
                format!("agent `{agent}` not found"),
            )
            .param("agentId"),
            RuntimeError::WorkflowNotFound(workflow) => ApiError::new(
                ErrorCode::WorkflowNotFound,
                format!("workflow `{workflow}` not found"),
            )
            .param("workflowId"),
            RuntimeError::NoDefaultAgent => {
                ApiError::new(ErrorCode::InvalidRequest, error.to_string()).param("agentId")
            }
            RuntimeError::Busy { .. } => ApiError::new(ErrorCode::TooManyRuns, error.to_string()),
            RuntimeError::RequestNotFound(id) => ApiError::new(
                ErrorCode::RequestNotFound,
                format!("request `{id}` not found"),
            ),
            RuntimeError::ApprovalNotFound(id) => ApiError::new(
                ErrorCode::ApprovalNotFound,
                format!("approval `{id}` not found"),
            ),
            RuntimeError::ApprovalDecided { .. } => {
                ApiError::new(ErrorCode::ApprovalDecided, error.to_string())
            }
            RuntimeError::SessionNotFound(id) => ApiError::new(
                ErrorCode::SessionNotFound,
                format!("session `{id}` not found"),
            )
            .param("sessionId"),
            RuntimeError::RequestEnded { .. } => {
                ApiError::new(ErrorCode::RequestEnded, error.to_string())
            }
            RuntimeError::NotRetryable { .. } => {
                ApiError::new(ErrorCode::RequestNotRetryable, error.to_string())
            }
            RuntimeError::MessageNotFound { .. } => {
                ApiError::new(ErrorCode::MessageNotFound, error.to_string()).param("atMessageId")
            }
            RuntimeError::StoreUnavailable => {
                ApiError::new(ErrorCode::StoreUnavailable, error.to_string())
            }
            RuntimeError::ShuttingDown | RuntimeError::Journal(JournalError::Closed) => {
                ApiError::new(ErrorCode::ShuttingDown, error.to_string())
            }
            RuntimeError::Journal(JournalError::Conflict(message)) => {
                ApiError::new(ErrorCode::ApprovalDecided, message)
            }
            RuntimeError::Spend(SpendError::Budget(refusal)) => {
                ApiError::new(ErrorCode::BudgetExceeded, refusal.message())
                    .param(refusal.budget.clone())
                    .retry_after(refusal.retry_after())
            }
            RuntimeError::Spend(SpendError::Rate(refusal)) => {
                let message = SpendError::Rate(refusal.clone()).to_string();
                ApiError::new(ErrorCode::RateLimited, message)
                    .param(refusal.limit.clone())
                    .retry_after(Some(refusal.retry_after()))
            }
            RuntimeError::Spend(SpendError::Store(error)) => store_error(&error),
            RuntimeError::Store(error) => store_error(&error),
            RuntimeError::Journal(error) => ApiError::internal(error),
        }
    }
}

/// A store failure as the API reports it: 503 `store_unavailable` while it may pass (the
/// database unreachable or busy: try again shortly), else a server fault.
pub fn store_error(error: &StoreError) -> ApiError {
    if error.is_transient() {
        tracing::warn!(%error, "the store cannot answer for now");
        ApiError::new(
            ErrorCode::StoreUnavailable,
            "the store cannot answer at the moment; try again shortly",
        )
    } else {
        ApiError::internal(error)
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        store_error(&error)
    }
}

/// The API error for a run that ended without an answer (`error` as stored in the request
/// record or the terminal event).
pub fn run_failure(request_id: &str, status: RunStatus, error: &Value) -> ApiError {
    let kind = error.get("kind").and_then(Value::as_str).unwrap_or("");
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("the run failed")
        .to_owned();
    let code = match (status, kind) {
        (RunStatus::Cancelled, _) => ErrorCode::RunFailed,
        (_, "timeout") => ErrorCode::UpstreamTimeout,
        (_, "upstream_5xx" | "rate_limited" | "connection" | "upstream_rejected" | "malformed") => {
            ErrorCode::UpstreamError
        }
        (_, "unsupported") => ErrorCode::BackendUnavailable,
        (_, "budget_exceeded") => ErrorCode::BudgetExceeded,
        _ => ErrorCode::RunFailed,
    };
    let mut api = ApiError::new(code, message).with_request_id(request_id);
    if code == ErrorCode::BudgetExceeded {
        if let Some(budget) = error.get("budget").and_then(Value::as_str) {
            api = api.param(budget);
        }
        api = api.retry_after(error.get("retryAfter").and_then(Value::as_u64));
    }
    api
}

/// A JSON answer (`Content-Type: application/json`), serialized into one `Vec`. Axum's own
/// `Json` writes through `bytes`' `io::Write` adapter, a call and a capacity check for each of
/// the many small pieces serde_json writes; into a `Vec` they are copied inline: ~40% fewer
/// instructions for a response object (docs/profiling.md, the forty-fifth pass). What the
/// handlers answer serializes (string-keyed maps and structs); should that ever fail, the
/// client gets the internal error's envelope and the log says why.
#[derive(Debug)]
pub struct Json<T>(pub T);

impl<T: Serialize> axum::response::IntoResponse for Json<T> {
    fn into_response(self) -> axum::response::Response {
        // Most answers (a completion, a response, a request's view) fit without growing it.
        let mut body = Vec::with_capacity(1024);
        match serde_json::to_writer(&mut body, &self.0) {
            Ok(()) => (
                [(
                    axum::http::header::CONTENT_TYPE,
                    axum::http::HeaderValue::from_static("application/json"),
                )],
                body,
            )
                .into_response(),
            Err(error) => ApiError::internal(format_args!("an answer did not serialize: {error}"))
                .into_response(),
        }
    }
}

/// An answer whose JSON text is written already (by a surface's own writer).
pub struct JsonText(pub String);

impl axum::response::IntoResponse for JsonText {
    fn into_response(self) -> axum::response::Response {
        (
            [(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            )],
            self.0,
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use axum::response::IntoResponse;
    use serde_json::json;

    use super::Json;

    async fn answered(response: axum::response::Response) -> (u16, String, String) {
        let status = response.status().as_u16();
        let kind = response.headers()[axum::http::header::CONTENT_TYPE]
            .to_str()
            .expect("a content type is text")
            .to_owned();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("the body is read");
        (
            status,
            kind,
            String::from_utf8(body.to_vec()).expect("UTF-8"),
        )
    }

    /// An answer is serde_json's text of the value, longer than the buffer it starts with too.
    #[tokio::test]
    async fn an_answer_is_its_json_text() {
        let value = json!({ "id": "resp_1", "text": "hé \"x\"\n", "n": [1, 2.5, null],
                            "long": "y".repeat(3000) });
        let (status, kind, body) = answered(Json(&value).into_response()).await;
        assert_eq!((status, kind.as_str()), (200, "application/json"));
        assert_eq!(body, serde_json::to_string(&value).unwrap());
    }

    /// `view`'s answer: its derived `Serialize`'s text, as JSON.
    async fn written<V: serde::Serialize + IntoResponse>(view: V) -> String {
        let expected = serde_json::to_string(&view).expect("serializes");
        let (status, kind, body) = answered(view.into_response()).await;
        assert_eq!((status, kind.as_str()), (200, "application/json"));
        assert_eq!(body, expected);
        body
    }

    /// A view with its runs, approvals and charges, a run alone and pages of views are
    /// written as their derived `Serialize` writes them: every field in order, absent ones
    /// `null` or left out, escapes in strings, fractions of seconds, a cost that is no number.
    #[tokio::test]
    async fn views_are_written_as_serde_writes_them() {
        use chrono::{TimeZone, Utc};

        use super::{RequestList, RequestView, RunView};
        use crate::store::spend::UsageTotals;
        use crate::store::{
            ApprovalKind, ApprovalRecord, ApprovalStatus, RequestInFull, RequestRecord, RunRecord,
            RunStatus,
        };

        let at = Utc.with_ymd_and_hms(2026, 12, 1, 9, 30, 5).unwrap();
        let later = at + chrono::Duration::microseconds(1_250);
        let odd = "q\"uo\\te\n\u{1}é\u{7f}";
        let request = RequestRecord {
            id: "req_1".into(),
            session_id: format!("ses_{odd}"),
            agent_id: "support".into(),
            protocol: "runtime".into(),
            owner: "team-a".into(),
            status: RunStatus::Completed,
            input: serde_json::Value::Null,
            output: Some(format!("answer {odd}")),
            error: None,
            usage: Some(json!({ "promptTokens": 7, "costUsd": 0.000125, "note": odd })),
            metadata: json!({ "k": odd, "n": [1, -2, 2.5, null, true] }),
            created_at: at,
            updated_at: later,
        };
        let mut failed = RunRecord::new("run_1".into(), "req_1".into(), 1, RunStatus::Failed, at);
        failed.error = Some(json!({ "code": "upstream_error", "message": odd }));
        failed.started_at = Some(later);
        failed.ended_at = Some(later + chrono::Duration::nanoseconds(7));
        let queued = RunRecord::new("run_2".into(), "req_1".into(), 2, RunStatus::Queued, later);
        let approval = |status, decided: bool| ApprovalRecord {
            id: "apr_1".into(),
            request_id: "req_1".into(),
            run_id: "run_2".into(),
            session_id: "ses_1".into(),
            agent_id: "support".into(),
            call_key: "t1.0".into(),
            kind: ApprovalKind::Interrupted,
            execution: 2,
            tool_call_id: format!("call_{odd}"),
            tool_id: "files.write".into(),
            arguments: json!({ "path": odd }),
            rule: decided.then(|| "writes".into()),
            status,
            reason: decided.then(|| odd.into()),
            decided_by: decided.then(|| "operator `ops`".into()),
            created_at: at,
            expires_at: decided.then_some(later),
            decided_at: decided.then_some(later),
        };
        let full = RequestInFull {
            request: request.clone(),
            runs: vec![failed.clone(), queued.clone()],
            approvals: vec![
                approval(ApprovalStatus::Pending, false),
                approval(ApprovalStatus::Denied, true),
            ],
            charged: UsageTotals {
                group: String::new(),
                calls: 2,
                prompt_tokens: 7,
                completion_tokens: u64::MAX,
                total_tokens: u64::MAX,
                cost: Some(f64::NAN),
                estimated_calls: 1,
            },
        };
        let body = written(RequestView::in_full(full.clone())).await;
        assert!(body.contains("\"costUsd\":0.000125,"), "{body}");
        assert!(body.contains("\"cost\":null,"), "{body}");
        let mut unpriced = RequestView::in_full(RequestInFull {
            approvals: Vec::new(),
            charged: UsageTotals {
                cost: Some(1.5e-9),
                ..full.charged.clone()
            },
            ..full
        });
        unpriced.cost_usd = None;
        unpriced.usage = None;
        written(unpriced).await;
        written(RequestList {
            data: vec![
                RequestView::new(request.clone(), vec![queued]),
                RequestView::new(request, Vec::new()),
            ],
            next_cursor: Some("req_0".into()),
        })
        .await;
        written(RequestList {
            data: Vec::new(),
            next_cursor: None,
        })
        .await;
        written(RunView::from(failed)).await;
    }

    /// What does not serialize (here a map keyed by pairs) is answered with the internal
    /// error's envelope, not a half-written body.
    #[tokio::test]
    async fn an_answer_that_does_not_serialize_is_an_internal_error() {
        let unwritable: BTreeMap<(u8, u8), u8> = BTreeMap::from([((1, 2), 3)]);
        let (status, kind, body) = answered(Json(unwritable).into_response()).await;
        assert_eq!((status, kind.as_str()), (500, "application/json"));
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["error"]["code"], "internal_error", "{body}");
    }
}
