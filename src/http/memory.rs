//! The operators' memory API (`/admin/memory`, admin keys): list and search records by
//! namespace, status and owner; read, approve, reject and delete one; and the maintenance
//! passes `compact`, `export` (JSON Lines, streamed) and `import`.

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::admin::{cursor, page_limit, status_filter};
use super::auth::Operator;
use super::extract::{ApiJson, ApiPath, ApiQuery};
use super::views::Json;
use crate::error::{ApiError, ErrorCode};
use crate::memory::{check_namespace, search_words, transfer};
use crate::runtime::{ImportReport, MemoryAdminError};
use crate::store::{CompactReport, MemoryFilter, MemoryRecord, MemoryStatus, PageRequest};

/// Records read per page while an export streams.
const EXPORT_PAGE: i64 = 500;

impl From<MemoryAdminError> for ApiError {
    fn from(error: MemoryAdminError) -> Self {
        match error {
            MemoryAdminError::NotFound(_) => {
                ApiError::new(ErrorCode::MemoryNotFound, error.to_string()).param("id")
            }
            MemoryAdminError::NotPending { .. } => {
                ApiError::new(ErrorCode::MemoryNotPending, error.to_string())
            }
            MemoryAdminError::InvalidLines(_) => {
                ApiError::new(ErrorCode::InvalidImport, error.to_string()).param("data")
            }
            MemoryAdminError::Store(error) => error.into(),
        }
    }
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ListMemoryQuery {
    /// A filled namespace (`agent/support`, `user/ada`).
    #[serde(default)]
    pub namespace: Option<String>,
    /// pending | active | rejected | archived
    #[serde(default)]
    pub status: Option<String>,
    /// The key identity that wrote the record.
    #[serde(default)]
    pub owner: Option<String>,
    /// Words the content contains (any of them; full-text, stemmed).
    #[serde(default)]
    pub q: Option<String>,
    /// 1 to 200 (default 50).
    #[serde(default)]
    pub limit: Option<i64>,
    /// `nextCursor` of the previous page.
    #[serde(default)]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryList {
    pub data: Vec<MemoryRecord>,
    pub next_cursor: Option<String>,
}

fn memory_filter(
    namespace: Option<String>,
    status: Option<&str>,
    owner: Option<String>,
    q: Option<&str>,
) -> Result<MemoryFilter, ApiError> {
    if let Some(namespace) = namespace.as_deref().filter(|n| !n.is_empty())
        && let Err(message) = check_namespace(namespace)
    {
        return Err(ApiError::new(ErrorCode::InvalidParameter, message).param("namespace"));
    }
    Ok(MemoryFilter {
        namespace: namespace.filter(|n| !n.is_empty()),
        status: status_filter(status, &MemoryStatus::ALL, MemoryStatus::as_str)?,
        owner: owner.filter(|o| !o.is_empty()),
        words: q.map(search_words).unwrap_or_default(),
    })
}

#[utoipa::path(get, path = "/admin/memory", tag = "admin", security(("admin_key" = [])),
    params(ListMemoryQuery),
    responses((status = 200, body = MemoryList), (status = 400, body = crate::error::ErrorEnvelope),
        (status = 422, body = crate::error::ErrorEnvelope)))]
pub async fn list_memory(
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<ListMemoryQuery>,
) -> Result<Json<MemoryList>, ApiError> {
    let filter = memory_filter(
        query.namespace,
        query.status.as_deref(),
        query.owner,
        query.q.as_deref(),
    )?;
    if query.q.as_deref().is_some_and(|q| !q.trim().is_empty()) && filter.words.is_empty() {
        // Only common words: nothing to search for, rather than everything.
        return Ok(Json(MemoryList {
            data: Vec::new(),
            next_cursor: None,
        }));
    }
    let page = PageRequest {
        limit: page_limit(query.limit)?,
        cursor: cursor(query.cursor, "mem")?,
    };
    let page = state.runtime.store().memories(&filter, &page).await?;
    Ok(Json(MemoryList {
        data: page.items,
        next_cursor: page.next_cursor,
    }))
}

#[utoipa::path(get, path = "/admin/memory/{id}", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Memory record id")),
    responses((status = 200, body = MemoryRecord), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_memory(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<MemoryRecord>, ApiError> {
    let record = state.runtime.store().memory(&id).await?;
    record
        .map(Json)
        .ok_or_else(|| MemoryAdminError::NotFound(id).into())
}

#[utoipa::path(delete, path = "/admin/memory/{id}", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Memory record id")),
    responses((status = 204, description = "Deleted"), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn delete_memory(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    Extension(operator): Extension<Operator>,
) -> Result<StatusCode, ApiError> {
    if !state.runtime.store().delete_memory(&id).await? {
        return Err(MemoryAdminError::NotFound(id).into());
    }
    tracing::info!(memory_id = %id, by = %operator.0, "memory record deleted");
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/admin/memory/{id}/approve", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Memory record id")),
    responses((status = 200, body = MemoryRecord, description = "Active: recalled from now on"),
        (status = 404, body = crate::error::ErrorEnvelope),
        (status = 409, body = crate::error::ErrorEnvelope, description = "The record is not pending")))]
pub async fn approve_memory(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    Extension(operator): Extension<Operator>,
) -> Result<Json<MemoryRecord>, ApiError> {
    Ok(Json(
        state.runtime.decide_memory(&id, true, &operator.0).await?,
    ))
}

#[utoipa::path(post, path = "/admin/memory/{id}/reject", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Memory record id")),
    responses((status = 200, body = MemoryRecord, description = "Rejected: never recalled"),
        (status = 404, body = crate::error::ErrorEnvelope),
        (status = 409, body = crate::error::ErrorEnvelope, description = "The record is not pending")))]
pub async fn reject_memory(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    Extension(operator): Extension<Operator>,
) -> Result<Json<MemoryRecord>, ApiError> {
    Ok(Json(
        state.runtime.decide_memory(&id, false, &operator.0).await?,
    ))
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MemoryOperation {
    Compact,
    Export,
    Import,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MemoryMaintenanceBody {
    pub operation: MemoryOperation,
    /// Limit `compact` and `export` to one namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// `import`: the records, as JSON Lines (what `export` wrote).
    #[serde(default)]
    pub data: Option<String>,
    /// `import`: leave bad lines out (reported) instead of importing nothing.
    #[serde(default)]
    pub skip_invalid: bool,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CompactAnswer {
    pub operation: MemoryOperation,
    pub namespace: Option<String>,
    #[serde(flatten)]
    pub report: CompactReport,
}

#[utoipa::path(post, path = "/admin/memory/maintenance", tag = "admin", security(("admin_key" = [])),
    request_body = MemoryMaintenanceBody,
    responses(
        (status = 200, description = "`compact`: what was archived (JSON); `export`: every record of the namespace (or store), one JSON object per line, streamed",
            content((CompactAnswer = "application/json"), (String = "application/x-ndjson"))),
        (status = 201, body = ImportReport, description = "`import`: what was imported"),
        (status = 400, body = crate::error::ErrorEnvelope),
        (status = 422, body = crate::error::ErrorEnvelope, description = "`import` without `data`, or with lines that cannot be imported (every one named; nothing imported)")))]
pub async fn memory_maintenance(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<MemoryMaintenanceBody>,
) -> Result<Response, ApiError> {
    let namespace = body.namespace.filter(|n| !n.is_empty());
    if let Some(namespace) = &namespace
        && let Err(message) = check_namespace(namespace)
    {
        return Err(ApiError::new(ErrorCode::InvalidParameter, message).param("namespace"));
    }
    match body.operation {
        MemoryOperation::Compact => {
            let report = state.runtime.compact_memory(namespace.as_deref()).await?;
            Ok(Json(CompactAnswer {
                operation: body.operation,
                namespace,
                report,
            })
            .into_response())
        }
        MemoryOperation::Import => {
            let Some(data) = body.data else {
                return Err(ApiError::new(
                    ErrorCode::InvalidRequest,
                    "`import` needs `data`: the records as JSON Lines",
                )
                .param("data"));
            };
            let report = state
                .runtime
                .import_memory(&data, body.skip_invalid)
                .await?;
            Ok((StatusCode::CREATED, Json(report)).into_response())
        }
        MemoryOperation::Export => Ok(export(state, namespace).await),
    }
}

/// Streams every record, page by page, newest first; recorded as a maintenance pass when
/// the first page is read (a failure later cuts the stream short, which a reader sees).
async fn export(state: AppState, namespace: Option<String>) -> Response {
    let runtime = state.runtime.clone();
    let stream = async_stream::stream! {
        let report = serde_json::json!({ "namespace": namespace });
        let filter = MemoryFilter { namespace, ..MemoryFilter::default() };
        let mut cursor = None;
        let recorded = runtime.memory_pass("export", async { Ok::<_, MemoryAdminError>(report) }).await;
        if recorded.is_err() {
            return;
        }
        loop {
            let page = PageRequest { limit: EXPORT_PAGE, cursor: cursor.take() };
            let page = match runtime.store().memories(&filter, &page).await {
                Ok(page) => page,
                Err(error) => {
                    tracing::warn!(%error, "memory export cut short");
                    yield Err(std::io::Error::other(error.to_string()));
                    return;
                }
            };
            let mut chunk = String::new();
            for record in &page.items {
                chunk.push_str(&transfer::export_line(record));
                chunk.push('\n');
            }
            yield Ok::<_, std::io::Error>(chunk);
            match page.next_cursor {
                Some(next) => cursor = Some(next),
                None => return,
            }
        }
    };
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response()
}
