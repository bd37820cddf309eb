//! The operator API (admin keys; a client key gets 403): list and inspect requests, runs,
//! their events and traces, and sessions; cancel and retry requests; decide approvals; ask
//! the policy to explain a decision; look after the store (sizes and maintenance passes,
//! pruning, online backup). The workspace and health views are in `inspect`.

use axum::Extension;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::AppState;
use super::auth::Operator;
use super::extract::{ApiJson, ApiPath, ApiQuery};
use super::runtime_api::{cancelled, events_response, id_param};
use super::views::{
    EventPage, EventsQuery, Json, RequestList, RequestView, RunView, SessionList, SessionSummary,
    SessionView, request_view, request_views, session_view, store_error,
};
use crate::error::{ApiError, ErrorCode};
use crate::gateway::Explanation;
use crate::store::retention::{BackupReport, PruneReport};
use crate::store::{
    ApprovalRecord, ApprovalStatus, MaintenanceRecord, PageRequest, RequestFilter, RequestInput,
    RunStatus, SessionFilter, StoreError, StoreStats,
};

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ListRequestsQuery {
    /// queued | running | waiting_approval | completed | failed | cancelled
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub agent_id: Option<String>,
    #[serde(default)]
    pub session_id: Option<String>,
    /// The client key identity that submitted the request.
    #[serde(default)]
    pub owner: Option<String>,
    /// Created at or after this instant (RFC 3339).
    #[serde(default)]
    pub created_after: Option<String>,
    /// Created before this instant (RFC 3339).
    #[serde(default)]
    pub created_before: Option<String>,
    /// Page size, 1 to 200 (default 50; more is taken as 200).
    #[serde(default)]
    pub limit: Option<i64>,
    /// `nextCursor` of the previous page.
    #[serde(default)]
    pub cursor: Option<String>,
}

#[utoipa::path(get, path = "/admin/requests", tag = "admin", security(("admin_key" = [])),
    params(ListRequestsQuery),
    responses((status = 200, body = RequestList), (status = 400, body = crate::error::ErrorEnvelope), (status = 401, body = crate::error::ErrorEnvelope),
        (status = 403, body = crate::error::ErrorEnvelope), (status = 422, body = crate::error::ErrorEnvelope)))]
pub async fn list_requests(
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<ListRequestsQuery>,
) -> Result<RequestList, ApiError> {
    let status = status_filter(query.status.as_deref(), &RunStatus::ALL, RunStatus::as_str)?;
    let created_from = instant(query.created_after.as_deref(), "createdAfter")?;
    let created_before = instant(query.created_before.as_deref(), "createdBefore")?;
    if let (Some(from), Some(before)) = (created_from, created_before)
        && from >= before
    {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "`createdAfter` must be earlier than `createdBefore`",
        )
        .param("createdAfter"));
    }
    let filter = RequestFilter {
        status,
        agent_id: query.agent_id,
        session_id: query.session_id,
        owner: query.owner,
        created_from,
        created_before,
    };
    let page = PageRequest {
        limit: page_limit(query.limit)?,
        cursor: cursor(query.cursor, "req")?,
    };
    // Views never show a request's input (its whole transcript): not read.
    let page = state
        .runtime
        .store()
        .requests(&filter, &page, RequestInput::Skipped)
        .await?;
    Ok(RequestList {
        data: request_views(&state.runtime, page.items).await?,
        next_cursor: page.next_cursor,
    })
}

#[utoipa::path(get, path = "/admin/requests/{id}", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Request id")),
    responses((status = 200, body = RequestView), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_request(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<RequestView, ApiError> {
    request_view(&state.runtime, &id, None).await
}

#[utoipa::path(get, path = "/admin/runs/{id}", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses((status = 200, body = RunView), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_run(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<RunView, ApiError> {
    let run = state.runtime.store().run(&id).await?.ok_or_else(|| {
        ApiError::new(ErrorCode::RunNotFound, format!("run `{id}` not found")).param("id")
    })?;
    Ok(RunView::from(run))
}

#[utoipa::path(get, path = "/admin/runs/{id}/events", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Run id"), EventsQuery),
    responses((status = 200, body = EventPage), (status = 400, body = crate::error::ErrorEnvelope),
        (status = 404, body = crate::error::ErrorEnvelope), (status = 422, body = crate::error::ErrorEnvelope)))]
pub async fn run_events(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<EventsQuery>,
) -> Result<Json<EventPage>, ApiError> {
    let (after, limit) = query.checked()?;
    let store = state.runtime.store();
    if store.run(&id).await?.is_none() {
        return Err(
            ApiError::new(ErrorCode::RunNotFound, format!("run `{id}` not found")).param("id"),
        );
    }
    let data = store.run_events(&id, after, limit).await?;
    Ok(Json(EventPage::new(data, after)))
}

/// A `status` query filter: absent or empty is no filter, anything else one of `all`.
pub(super) fn status_filter<T: Copy>(
    text: Option<&str>,
    all: &[T],
    name: fn(T) -> &'static str,
) -> Result<Option<T>, ApiError> {
    let Some(text) = text.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    match all.iter().copied().find(|status| name(*status) == text) {
        Some(status) => Ok(Some(status)),
        None => {
            let known: Vec<&str> = all.iter().map(|status| name(*status)).collect();
            Err(ApiError::new(
                ErrorCode::InvalidRequest,
                format!("unknown status `{text}`: one of {}", known.join(", ")),
            )
            .param("status"))
        }
    }
}

/// A list page size: 50 by default, at least 1, and more than 200 is taken as 200.
pub(super) fn page_limit(limit: Option<i64>) -> Result<i64, ApiError> {
    match limit.unwrap_or(50) {
        limit if limit < 1 => Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "`limit` must be at least 1",
        )
        .param("limit")),
        limit => Ok(limit.min(200)),
    }
}

/// A list cursor: the id of the last item of the previous page (`{prefix}_` and 32 hex
/// digits); anything else is a client bug, answered rather than read as an empty page.
pub(super) fn cursor(cursor: Option<String>, prefix: &str) -> Result<Option<String>, ApiError> {
    let Some(cursor) = cursor.filter(|c| !c.is_empty()) else {
        return Ok(None);
    };
    let valid = cursor
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix('_'))
        .is_some_and(|hex| hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
    if valid {
        Ok(Some(cursor))
    } else {
        Err(ApiError::new(
            ErrorCode::InvalidParameter,
            "`cursor` must be the `nextCursor` of a previous page",
        )
        .param("cursor"))
    }
}

/// A cursor of the session list: a session id, which a `/v1` client may have chosen.
fn session_cursor(cursor: Option<String>) -> Result<Option<String>, ApiError> {
    match cursor.filter(|c| !c.is_empty()) {
        Some(cursor) if cursor.len() > 1024 || cursor.chars().any(char::is_control) => {
            Err(ApiError::new(
                ErrorCode::InvalidParameter,
                "`cursor` must be the `nextCursor` of a previous page",
            )
            .param("cursor"))
        }
        cursor => Ok(cursor),
    }
}

/// An RFC 3339 instant of a query filter.
pub(super) fn instant(
    text: Option<&str>,
    param: &str,
) -> Result<Option<chrono::DateTime<chrono::Utc>>, ApiError> {
    text.filter(|t| !t.is_empty())
        .map(|t| {
            chrono::DateTime::parse_from_rfc3339(t)
                .map(|t| t.with_timezone(&chrono::Utc))
                .map_err(|_| {
                    ApiError::new(
                        ErrorCode::InvalidParameter,
                        format!("`{param}` must be an RFC 3339 instant, e.g. 2026-01-31T12:00:00Z"),
                    )
                    .param(param)
                })
        })
        .transpose()
}

#[utoipa::path(get, path = "/admin/requests/{id}/events", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Request id"), EventsQuery),
    responses(
        (status = 200, body = EventPage, description = "A page of the request's events (every run); with `Accept: text/event-stream`, a live SSE stream ending after the terminal event"),
        (status = 400, body = crate::error::ErrorEnvelope), (status = 404, body = crate::error::ErrorEnvelope),
        (status = 422, body = crate::error::ErrorEnvelope),
    ))]
pub async fn request_events(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    headers: axum::http::HeaderMap,
    ApiQuery(query): ApiQuery<EventsQuery>,
) -> Result<axum::response::Response, ApiError> {
    events_response(&state, &id, None, &headers, &query).await
}

#[utoipa::path(post, path = "/admin/requests/{id}/cancel", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Request id")),
    responses(
        (status = 200, body = RequestView, description = "Cancelled: the run stopped and the request ended `cancelled`"),
        (status = 202, body = RequestView, description = "The run was told to stop and has not ended yet (it executes on another instance)"),
        (status = 404, body = crate::error::ErrorEnvelope),
        (status = 409, body = crate::error::ErrorEnvelope, description = "The request has ended already"),
    ))]
pub async fn cancel_request(
    State(state): State<AppState>,
    Extension(operator): Extension<Operator>,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::response::Response, ApiError> {
    let by = format!("operator `{}`", operator.0);
    cancelled(&state, &id, None, &by).await
}

/// What a retry started.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Retried {
    pub request_id: String,
    pub run_id: String,
    pub session_id: String,
    pub attempt: i64,
    pub status: RunStatus,
}

#[utoipa::path(post, path = "/admin/requests/{id}/retry", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Request id")),
    responses(
        (status = 202, body = Retried, description = "A new run of the request started (attempt + 1; its events continue the request's seq)"),
        (status = 404, body = crate::error::ErrorEnvelope),
        (status = 409, body = crate::error::ErrorEnvelope, description = "The request is not failed or cancelled"),
        (status = 429, body = crate::error::ErrorEnvelope),
    ))]
pub async fn retry_request(
    State(state): State<AppState>,
    Extension(operator): Extension<Operator>,
    ApiPath(id): ApiPath<String>,
) -> Result<(axum::http::StatusCode, Json<Retried>), ApiError> {
    let submitted = state
        .runtime
        .retry(&id, &operator.0)
        .await
        .map_err(id_param)?;
    let attempt = state
        .runtime
        .store()
        .run(&submitted.run_id)
        .await?
        .map_or(0, |run| run.attempt);
    Ok((
        axum::http::StatusCode::ACCEPTED,
        Json(Retried {
            request_id: submitted.request_id,
            run_id: submitted.run_id,
            session_id: submitted.session_id,
            attempt,
            status: submitted.status,
        }),
    ))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ListSessionsQuery {
    #[serde(default)]
    pub agent_id: Option<String>,
    /// The client key identity that owns the session.
    #[serde(default)]
    pub owner: Option<String>,
    /// Page size, 1 to 200 (default 50; more is taken as 200).
    #[serde(default)]
    pub limit: Option<i64>,
    /// `nextCursor` of the previous page.
    #[serde(default)]
    pub cursor: Option<String>,
}

#[utoipa::path(get, path = "/admin/sessions", tag = "admin", security(("admin_key" = [])),
    params(ListSessionsQuery),
    responses((status = 200, body = SessionList), (status = 400, body = crate::error::ErrorEnvelope),
        (status = 422, body = crate::error::ErrorEnvelope)))]
pub async fn list_sessions(
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<ListSessionsQuery>,
) -> Result<Json<SessionList>, ApiError> {
    let filter = SessionFilter {
        agent_id: query.agent_id,
        owner: query.owner,
    };
    let page = PageRequest {
        limit: page_limit(query.limit)?,
        cursor: session_cursor(query.cursor)?,
    };
    let page = state.runtime.store().sessions(&filter, &page).await?;
    Ok(Json(SessionList {
        data: page.items.into_iter().map(SessionSummary::from).collect(),
        next_cursor: page.next_cursor,
    }))
}

#[utoipa::path(get, path = "/admin/sessions/{id}", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = SessionView), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_session(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<SessionView>, ApiError> {
    Ok(Json(session_view(&state.runtime, &id, None).await?))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ListApprovalsQuery {
    /// pending | approved | denied | expired | cancelled
    #[serde(default)]
    pub status: Option<String>,
    /// 1 to 200 (default 50).
    #[serde(default)]
    pub limit: Option<i64>,
    /// `nextCursor` of the previous page.
    #[serde(default)]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalList {
    pub data: Vec<ApprovalRecord>,
    pub next_cursor: Option<String>,
}

#[utoipa::path(get, path = "/admin/approvals", tag = "admin", security(("admin_key" = [])),
    params(ListApprovalsQuery),
    responses((status = 200, body = ApprovalList), (status = 400, body = crate::error::ErrorEnvelope), (status = 401, body = crate::error::ErrorEnvelope),
        (status = 403, body = crate::error::ErrorEnvelope), (status = 422, body = crate::error::ErrorEnvelope)))]
pub async fn list_approvals(
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<ListApprovalsQuery>,
) -> Result<Json<ApprovalList>, ApiError> {
    let status = status_filter(
        query.status.as_deref(),
        &ApprovalStatus::ALL,
        ApprovalStatus::as_str,
    )?;
    let page = PageRequest {
        limit: page_limit(query.limit)?,
        cursor: cursor(query.cursor, "apr")?,
    };
    let page = state.runtime.store().approvals(status, &page).await?;
    Ok(Json(ApprovalList {
        data: page.items,
        next_cursor: page.next_cursor,
    }))
}

#[utoipa::path(get, path = "/admin/approvals/{id}", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Approval id")),
    responses((status = 200, body = ApprovalRecord), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_approval(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<ApprovalRecord>, ApiError> {
    let approval = state.runtime.store().approval(&id).await?.ok_or_else(|| {
        ApiError::new(
            ErrorCode::ApprovalNotFound,
            format!("approval `{id}` not found"),
        )
        .param("id")
    })?;
    Ok(Json(approval))
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DecisionBody {
    /// Why; recorded with the decision and given to the model on a denial.
    #[serde(default)]
    pub reason: Option<String>,
}

#[utoipa::path(post, path = "/admin/approvals/{id}/approve", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Approval id")), request_body = DecisionBody,
    responses((status = 200, body = ApprovalRecord, description = "Approved; the waiting call runs"),
        (status = 404, body = crate::error::ErrorEnvelope), (status = 409, body = crate::error::ErrorEnvelope, description = "Already decided")))]
pub async fn approve(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    Extension(operator): Extension<Operator>,
    ApiJson(body): ApiJson<DecisionBody>,
) -> Result<Json<ApprovalRecord>, ApiError> {
    decide(&state, &id, true, body, operator).await
}

#[utoipa::path(post, path = "/admin/approvals/{id}/deny", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Approval id")), request_body = DecisionBody,
    responses((status = 200, body = ApprovalRecord, description = "Denied; the model receives the denial"),
        (status = 404, body = crate::error::ErrorEnvelope), (status = 409, body = crate::error::ErrorEnvelope, description = "Already decided")))]
pub async fn deny(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    Extension(operator): Extension<Operator>,
    ApiJson(body): ApiJson<DecisionBody>,
) -> Result<Json<ApprovalRecord>, ApiError> {
    decide(&state, &id, false, body, operator).await
}

async fn decide(
    state: &AppState,
    id: &str,
    approve: bool,
    body: DecisionBody,
    operator: Operator,
) -> Result<Json<ApprovalRecord>, ApiError> {
    let approval = state
        .runtime
        .decide_approval(id, approve, body.reason, &operator.0)
        .await
        .map_err(|error| ApiError::from(error).param("id"))?;
    Ok(Json(approval))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ExplainBody {
    pub agent_id: String,
    pub tool_id: String,
    /// The call's arguments (checked against the tool's input schema).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub arguments: Value,
    /// Request metadata, as a run would carry it (its scalar values act as labels).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub metadata: Value,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExplainResponse {
    /// allow | deny | needs_approval
    pub decision: String,
    /// The rule that matched (`tool_not_allowed` or `policy_error` for the gateway's own
    /// refusals; `null` when the default decided).
    pub rule: Option<String>,
    pub reason: String,
    pub allowed_for_agent: bool,
    pub argument_errors: Vec<String>,
}

#[utoipa::path(post, path = "/admin/policy/explain", tag = "admin", security(("admin_key" = [])),
    request_body = ExplainBody,
    responses((status = 200, body = ExplainResponse, description = "What the gateway would decide for this call"),
        (status = 404, body = crate::error::ErrorEnvelope, description = "Unknown agent or tool")))]
pub async fn explain_policy(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<ExplainBody>,
) -> Result<Json<ExplainResponse>, ApiError> {
    let inventory = state.runtime.inventory();
    let agent = inventory.workspace.agent(&body.agent_id).ok_or_else(|| {
        ApiError::new(
            ErrorCode::AgentNotFound,
            format!("agent `{}` not found", body.agent_id),
        )
        .param("agentId")
    })?;
    // A client tool (`client.<name>`) exists per request: explained as the agent would get it,
    // with the agent's client-tool risk and any arguments.
    let client_tool = body
        .tool_id
        .strip_prefix(crate::workspace::CLIENT_TOOL_PREFIX)
        .zip(agent.client_tools)
        .and_then(|(name, risk)| {
            let function = crate::gateway::client::ClientFunction {
                index: 0,
                name: name.to_owned(),
                description: None,
                parameters: None,
            };
            crate::gateway::client::compile(&[function], risk)
                .ok()?
                .pop()
        });
    let tool = client_tool
        .as_ref()
        .or_else(|| inventory.gateway.find_tool(&body.tool_id))
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::ToolNotFound,
                format!("tool `{}` not found", body.tool_id),
            )
            .param("toolId")
        })?;
    let metadata = if body.metadata.is_null() {
        serde_json::json!({})
    } else {
        body.metadata
    };
    let Explanation {
        verdict,
        allowed_for_agent,
        argument_errors,
    } = inventory
        .gateway
        .explain(agent, tool, &body.arguments, &metadata);
    Ok(Json(ExplainResponse {
        decision: crate::workspace::wire_name(&verdict.decision),
        rule: verdict.rule,
        reason: verdict.reason,
        allowed_for_agent,
        argument_errors,
    }))
}

/// The store, its retention and its last maintenance passes.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StoreView {
    /// Where the data lives (never with credentials).
    pub store: String,
    pub stats: StoreStats,
    pub retention: RetentionView,
    /// The last 20 prunes and backups, newest first.
    pub maintenance: Vec<MaintenanceRecord>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetentionView {
    /// Whether any window is set (else nothing is ever pruned).
    pub enabled: bool,
    /// `store.retention.requests`, in seconds.
    pub requests_seconds: Option<u64>,
    /// Agents with their own window, in seconds.
    pub agent_seconds: std::collections::BTreeMap<String, u64>,
    pub min_keep: u64,
    pub every_seconds: u64,
    pub archive_dir: Option<String>,
}

#[utoipa::path(get, path = "/admin/store", tag = "admin", security(("admin_key" = [])),
    responses((status = 200, body = StoreView), (status = 401, body = crate::error::ErrorEnvelope)))]
pub async fn get_store(State(state): State<AppState>) -> Result<Json<StoreView>, ApiError> {
    let store = state.runtime.store();
    let stats = store.stats().await.map_err(maintenance_error)?;
    let maintenance = store.maintenance(20).await.map_err(maintenance_error)?;
    let policy = crate::runtime::retention_policy(&state.runtime.workspace());
    Ok(Json(StoreView {
        store: store.describe(),
        stats,
        retention: RetentionView {
            enabled: policy.is_active(),
            requests_seconds: policy.default_window.map(|w| w.as_secs()),
            agent_seconds: policy
                .agent_windows
                .iter()
                .map(|(agent, window)| (agent.clone(), window.as_secs()))
                .collect(),
            min_keep: policy.min_keep,
            every_seconds: state.runtime.workspace().runtime.retention.every.as_secs(),
            archive_dir: policy.archive_dir.map(|dir| dir.display().to_string()),
        },
        maintenance,
    }))
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PruneBody {
    /// Only count what would go (default false).
    #[serde(default)]
    pub dry_run: bool,
}

#[utoipa::path(post, path = "/admin/store/prune", tag = "admin", security(("admin_key" = [])),
    request_body = PruneBody,
    responses((status = 200, body = PruneReport, description = "What the pass removed, or would remove"),
        (status = 503, body = crate::error::ErrorEnvelope, description = "The store cannot write")))]
pub async fn prune_store(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<PruneBody>,
) -> Result<Json<PruneReport>, ApiError> {
    Ok(Json(
        state
            .runtime
            .prune(body.dry_run)
            .await
            .map_err(maintenance_error)?,
    ))
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BackupBody {
    /// A file name (letters, digits, `.`, `_`, `-`) in the workspace's
    /// `.stable-harness/backups/`; default `state-<UTC time>.db`.
    #[serde(default)]
    pub file: Option<String>,
}

#[utoipa::path(post, path = "/admin/store/backup", tag = "admin", security(("admin_key" = [])),
    request_body = BackupBody,
    responses((status = 201, body = BackupReport, description = "The snapshot was written; it opens as a store"),
        (status = 400, body = crate::error::ErrorEnvelope, description = "The file name is not a plain name"),
        (status = 409, body = crate::error::ErrorEnvelope, description = "The file exists")))]
pub async fn backup_store(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<BackupBody>,
) -> Result<(axum::http::StatusCode, Json<BackupReport>), ApiError> {
    let name = body
        .file
        .unwrap_or_else(|| format!("state-{}.db", chrono::Utc::now().format("%Y%m%dT%H%M%SZ")));
    // A plain name, so the copy stays in the backups folder whatever the body says.
    let plain = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !plain {
        return Err(ApiError::new(
            ErrorCode::InvalidParameter,
            "`file` must be a plain file name: letters, digits, `.`, `_` and `-`, not starting with `.`",
        )
        .param("file"));
    }
    let file = state
        .runtime
        .workspace()
        .root
        .join(".stable-harness")
        .join("backups")
        .join(&name);
    let report = state
        .runtime
        .backup(&file)
        .await
        .map_err(|error| match error {
            StoreError::Archive { source, .. }
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                ApiError::new(
                    ErrorCode::AlreadyExists,
                    format!("backup `{name}` exists already; a backup never overwrites"),
                )
                .param("file")
            }
            error => maintenance_error(error),
        })?;
    Ok((axum::http::StatusCode::CREATED, Json(report)))
}

/// A maintenance failure: 422 when this store has no such operation, else as any store
/// failure.
fn maintenance_error(error: StoreError) -> ApiError {
    match error {
        StoreError::Unsupported(message) => ApiError::new(ErrorCode::InvalidRequest, message),
        error => store_error(&error),
    }
}
