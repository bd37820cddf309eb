//! The operator API (admin keys; a client key gets 403): list and inspect requests, runs and
//! their events.

use axum::Json;
use axum::extract::{Path, Query, State};
use serde::Deserialize;

use super::AppState;
use super::views::{EventPage, EventsQuery, RequestList, RequestView, RunView, request_view};
use crate::error::{ApiError, ErrorCode};
use crate::store::{PageRequest, RequestFilter, RunStatus};

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
    /// 1 to 200 (default 50).
    #[serde(default)]
    pub limit: Option<i64>,
    /// `nextCursor` of the previous page.
    #[serde(default)]
    pub cursor: Option<String>,
}

#[utoipa::path(get, path = "/admin/requests", tag = "admin", security(("admin_key" = [])),
    params(ListRequestsQuery),
    responses((status = 200, body = RequestList), (status = 401, body = crate::error::ErrorEnvelope),
        (status = 403, body = crate::error::ErrorEnvelope), (status = 422, body = crate::error::ErrorEnvelope)))]
pub async fn list_requests(
    State(state): State<AppState>,
    Query(query): Query<ListRequestsQuery>,
) -> Result<Json<RequestList>, ApiError> {
    let status = match query.status.as_deref() {
        None | Some("") => None,
        Some(text) => Some(RunStatus::parse(text).ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("unknown status `{text}`: one of queued, running, waiting_approval, completed, failed, cancelled"),
            )
            .param("status")
        })?),
    };
    let limit = query.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "`limit` must be between 1 and 200",
        )
        .param("limit"));
    }
    let filter = RequestFilter {
        status,
        agent_id: query.agent_id,
        session_id: query.session_id,
    };
    let store = state.runtime.store();
    let page = store
        .requests(
            &filter,
            &PageRequest {
                limit,
                cursor: query.cursor,
            },
        )
        .await
        .map_err(ApiError::internal)?;
    let mut data = Vec::with_capacity(page.items.len());
    for request in page.items {
        let runs = store
            .runs_of(&request.id)
            .await
            .map_err(ApiError::internal)?;
        data.push(RequestView::new(request, runs));
    }
    Ok(Json(RequestList {
        data,
        next_cursor: page.next_cursor,
    }))
}

#[utoipa::path(get, path = "/admin/requests/{id}", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Request id")),
    responses((status = 200, body = RequestView), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_request(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<RequestView>, ApiError> {
    Ok(Json(request_view(&state.runtime, &id).await?))
}

#[utoipa::path(get, path = "/admin/runs/{id}", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses((status = 200, body = RunView), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_run(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<RunView>, ApiError> {
    let run = state
        .runtime
        .store()
        .run(&id)
        .await
        .map_err(ApiError::internal)?
        .ok_or_else(|| {
            ApiError::new(ErrorCode::RunNotFound, format!("run `{id}` not found")).param("id")
        })?;
    Ok(Json(RunView::from(run)))
}

#[utoipa::path(get, path = "/admin/runs/{id}/events", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Run id"), EventsQuery),
    responses((status = 200, body = EventPage), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn run_events(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
) -> Result<Json<EventPage>, ApiError> {
    let store = state.runtime.store();
    if store.run(&id).await.map_err(ApiError::internal)?.is_none() {
        return Err(
            ApiError::new(ErrorCode::RunNotFound, format!("run `{id}` not found")).param("id"),
        );
    }
    let after = query.after.unwrap_or(0).max(0);
    let data = store
        .run_events(&id, after, query.limit())
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(EventPage::new(data, after)))
}
