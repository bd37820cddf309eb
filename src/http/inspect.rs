//! Operator inspection (admin keys): a run's trace grouped by category (SPEC section 7), the
//! compiled workspace inventory (never a secret) and its reload, the health of what the
//! server depends on — the store, each model upstream probed with a short timeout, the
//! workspace loaded — and the metrics in Prometheus text.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::extract::State;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use super::AppState;
use super::extract::ApiPath;
use super::views::Json;
use crate::adapters::{ModelProbe, probe};
use crate::error::{ApiError, ErrorCode};
use crate::runtime::events::{TRACE_CATEGORIES, category};
use crate::store::EventRecord;

/// The most events a trace reads (a run's events are read in pages up to this).
const TRACE_LIMIT: usize = 20_000;
const TRACE_PAGE: i64 = 1_000;
/// How long a model upstream has to answer a health probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A run's events grouped by category, each group in `seq` order.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Trace {
    pub run_id: String,
    pub request_id: String,
    /// Every category, empty ones included: request, model, tool, approval, adapter, plan,
    /// delegation, memory, artifact.
    pub categories: BTreeMap<&'static str, Vec<EventRecord>>,
    /// The run has more events than a trace reads (20,000); page `/admin/runs/{id}/events`.
    pub truncated: bool,
}

#[utoipa::path(get, path = "/admin/runs/{id}/trace", tag = "admin", security(("admin_key" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses((status = 200, body = Trace), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn run_trace(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Trace>, ApiError> {
    let store = state.runtime.store();
    let run = store.run(&id).await?.ok_or_else(|| {
        ApiError::new(ErrorCode::RunNotFound, format!("run `{id}` not found")).param("id")
    })?;
    let mut categories: BTreeMap<&'static str, Vec<EventRecord>> = TRACE_CATEGORIES
        .iter()
        .map(|category| (*category, Vec::new()))
        .collect();
    let (mut after, mut read, mut truncated) = (0, 0, false);
    loop {
        let page = store.run_events(&id, after, TRACE_PAGE).await?;
        let full = page.len() as i64 == TRACE_PAGE;
        for event in page {
            if read == TRACE_LIMIT {
                truncated = true;
                break;
            }
            read += 1;
            after = event.seq;
            categories
                .entry(category(&event.event_type, &event.data))
                .or_default()
                .push(event);
        }
        if !full || truncated {
            break;
        }
    }
    Ok(Json(Trace {
        run_id: run.id,
        request_id: run.request_id,
        categories,
        truncated,
    }))
}

#[utoipa::path(get, path = "/admin/workspace", tag = "admin", security(("admin_key" = [])),
    responses((status = 200, description = "The compiled inventory: runtime settings, agents, models, tools, workflows. Keys and credentials appear as variable names only.")))]
pub async fn workspace(State(state): State<AppState>) -> Json<Value> {
    let workspace = state.runtime.workspace();
    let mut inventory = crate::workspace::inventory(&workspace);
    if let Some(object) = inventory.as_object_mut() {
        object.remove("valid");
        object.insert("root".into(), workspace.root.display().to_string().into());
        object.insert("loadedAt".into(), workspace.loaded_at.to_rfc3339().into());
    }
    Json(inventory)
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StoreHealth {
    /// `sqlite` or `postgres`.
    pub kind: &'static str,
    /// The store answered a query and accepts writes.
    pub ok: bool,
    pub latency_ms: u64,
    pub error: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceHealth {
    pub name: String,
    pub loaded_at: DateTime<Utc>,
    /// How long reading and compiling the workspace took.
    pub compile_ms: f64,
    pub agents: usize,
    pub tools: usize,
    pub models: usize,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Health {
    /// `ok` when the store and every model upstream answer, else `degraded`.
    pub status: &'static str,
    /// This instance's lease holder id.
    pub instance: String,
    /// Runs executing or waiting on this instance.
    pub live_runs: usize,
    pub store: StoreHealth,
    pub workspace: WorkspaceHealth,
    /// One probe per model of the workspace (`GET {baseUrl}/models`, 2 s at most each, all at
    /// once). Any HTTP answer counts as reachable; a refused key is named in `error`.
    pub models: Vec<ModelProbe>,
}

#[utoipa::path(get, path = "/admin/health", tag = "admin", security(("admin_key" = [])),
    responses((status = 200, body = Health)))]
pub async fn health(State(state): State<AppState>) -> Json<Health> {
    let runtime = &state.runtime;
    let workspace = runtime.workspace();
    let store = runtime.store();
    let started = Instant::now();
    let ping = store.ping().await;
    let store_health = StoreHealth {
        kind: if store.is_shared() {
            "postgres"
        } else {
            "sqlite"
        },
        ok: ping.is_ok() && runtime.store_available(),
        latency_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        error: match ping {
            Err(error) => Some(super::views::store_error(&error).message),
            Ok(()) if !runtime.store_available() => Some("the store cannot write".to_owned()),
            Ok(()) => None,
        },
    };
    let http = runtime.http();
    let probes = futures::future::join_all(
        workspace
            .models
            .values()
            .map(|model| probe(&http, model, PROBE_TIMEOUT)),
    )
    .await;
    let healthy = store_health.ok && probes.iter().all(|p| p.reachable && p.error.is_none());
    Json(Health {
        status: if healthy { "ok" } else { "degraded" },
        instance: store.holder().to_owned(),
        live_runs: runtime.live_runs(),
        store: store_health,
        workspace: WorkspaceHealth {
            name: workspace.runtime.name.clone(),
            loaded_at: workspace.loaded_at,
            compile_ms: workspace.compile_time.as_secs_f64() * 1000.0,
            agents: workspace.agents.len(),
            tools: workspace.tools.len(),
            models: workspace.models.len(),
        },
        models: probes,
    })
}

#[utoipa::path(post, path = "/admin/workspace/reload", tag = "admin", security(("admin_key" = [])),
    responses(
        (status = 200, body = crate::runtime::Reloaded, description = "Recompiled from disk and swapped in: new requests use it; running runs keep theirs"),
        (status = 422, body = crate::error::ErrorEnvelope, description = "Invalid (every diagnostic as `file:line:col: message` in the message), or a change only a restart applies; nothing was swapped"),
    ))]
pub async fn reload_workspace(
    State(state): State<AppState>,
) -> Result<Json<crate::runtime::Reloaded>, ApiError> {
    state
        .runtime
        .reload()
        .await
        .map(Json)
        .map_err(|error| ApiError::new(ErrorCode::InvalidWorkspace, error.to_string()))
}

#[utoipa::path(get, path = "/metrics", tag = "health", security(("admin_key" = [])),
    responses((status = 200, content_type = "text/plain", description = "Prometheus text exposition (an admin key is needed unless the server runs with --metrics-public)")))]
pub async fn metrics(State(state): State<AppState>) -> impl axum::response::IntoResponse {
    match state.runtime.store().count_pending_approvals().await {
        Ok(count) => crate::metrics::approvals_pending(count),
        Err(error) => tracing::debug!(%error, "could not count pending approvals for /metrics"),
    }
    let (paths, bytes) = state.runtime.kept_histories();
    crate::metrics::kept_histories(paths, bytes);
    let (count, bytes) = state.runtime.carried_digests();
    crate::metrics::carried_digests(count, bytes);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::render(),
    )
}
