//! The spend views of the operator API: `GET /admin/usage` (the ledger added up, by day,
//! agent, key or model) and `GET /admin/budgets` (each budget's counters: used, reserved,
//! limit, reset). Estimates are marked: `estimatedCalls` counts the calls whose upstream
//! reported no usage.

use axum::extract::State;
use serde::{Deserialize, Serialize};

use super::AppState;
use super::admin::instant;
use super::extract::ApiQuery;
use super::views::Json;
use crate::error::{ApiError, ErrorCode};
use crate::spend::BudgetState;
use crate::store::spend::{UsageFilter, UsageGroupBy, UsageTotals};

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct UsageQuery {
    /// apiKey | agent | session | model | workspace (default: workspace, everything)
    #[serde(default)]
    pub scope: Option<String>,
    /// The key identity, agent, session or model the scope names.
    #[serde(default)]
    pub id: Option<String>,
    /// At or after this instant (RFC 3339).
    #[serde(default)]
    pub from: Option<String>,
    /// Before this instant (RFC 3339).
    #[serde(default)]
    pub to: Option<String>,
    /// day | agent | key | model (default: one total)
    #[serde(default)]
    pub group_by: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageReport {
    /// One entry per group (a day, agent, key identity or model), or the one total.
    pub data: Vec<UsageTotals>,
    /// Everything the query matched.
    pub total: UsageTotals,
    pub group_by: Option<UsageGroupBy>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BudgetList {
    pub data: Vec<BudgetState>,
}

#[utoipa::path(get, path = "/admin/usage", tag = "admin", security(("admin_key" = [])),
    params(UsageQuery),
    responses((status = 200, body = UsageReport), (status = 400, body = crate::error::ErrorEnvelope),
        (status = 401, body = crate::error::ErrorEnvelope), (status = 403, body = crate::error::ErrorEnvelope),
        (status = 422, body = crate::error::ErrorEnvelope)))]
pub async fn usage(
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<UsageQuery>,
) -> Result<Json<UsageReport>, ApiError> {
    let mut filter = UsageFilter {
        from: instant(query.from.as_deref(), "from")?,
        to: instant(query.to.as_deref(), "to")?,
        ..UsageFilter::default()
    };
    let scope = query.scope.as_deref().unwrap_or("workspace");
    let id = query.id.filter(|id| !id.is_empty());
    let needs_id = || {
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!("scope `{scope}` needs an `id`"),
        )
        .param("id")
    };
    match scope {
        "workspace" => {}
        "apiKey" => filter.owner = Some(id.ok_or_else(needs_id)?),
        "agent" => filter.agent_id = Some(id.ok_or_else(needs_id)?),
        "session" => filter.session_id = Some(id.ok_or_else(needs_id)?),
        "model" => filter.model = Some(id.ok_or_else(needs_id)?),
        other => {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                format!("unknown scope `{other}`: use apiKey, agent, session, model or workspace"),
            )
            .param("scope"));
        }
    }
    let group_by = match query.group_by.as_deref().filter(|g| !g.is_empty()) {
        None => None,
        Some("day") => Some(UsageGroupBy::Day),
        Some("agent") => Some(UsageGroupBy::Agent),
        Some("key") => Some(UsageGroupBy::Key),
        Some("model") => Some(UsageGroupBy::Model),
        Some(other) => {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                format!("unknown groupBy `{other}`: use day, agent, key or model"),
            )
            .param("groupBy"));
        }
    };
    let store = state.runtime.store();
    let total = store
        .usage_totals(&filter, None)
        .await?
        .into_iter()
        .next()
        .unwrap_or_default();
    let data = match group_by {
        Some(_) => store.usage_totals(&filter, group_by).await?,
        None => vec![total.clone()],
    };
    Ok(Json(UsageReport {
        data,
        total,
        group_by,
    }))
}

#[utoipa::path(get, path = "/admin/budgets", tag = "admin", security(("admin_key" = [])),
    responses((status = 200, body = BudgetList, description = "Each budget's counter per subject it counted anything for"),
        (status = 401, body = crate::error::ErrorEnvelope), (status = 403, body = crate::error::ErrorEnvelope)))]
pub async fn budgets(State(state): State<AppState>) -> Result<Json<BudgetList>, ApiError> {
    let workspace = state.runtime.workspace();
    let data = state.runtime.spend().budgets(&workspace).await?;
    Ok(Json(BudgetList { data }))
}
