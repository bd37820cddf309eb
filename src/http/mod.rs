//! Protocol surfaces (SPEC section 6): the OpenAI-compatible `/v1`, the native `/runtime`
//! API and the operator `/admin` API, plus health and the OpenAPI document.
//!
//! Handlers are thin: extract, call the runtime, map the result. Only this module knows wire
//! types; every error leaves through [`crate::error::ApiError`]'s envelope — axum's own
//! rejections never reach a client (see `extract`). Each surface authenticates before it
//! routes; `protocols.openai.enabled: false` removes `/v1` (404 `surface_disabled`).

mod admin;
mod auth;
mod callbacks;
mod extract;
mod health;
mod inspect;
mod memory;
mod messages;
pub mod openapi;
mod response_input;
mod responses;
mod runtime_api;
pub mod shards;
mod spend;
mod sse;
mod v1;
mod views;

use std::sync::Arc;

use axum::Router;
use axum::extract::OriginalUri;
use axum::routing::{get, post};

pub use auth::{ANONYMOUS, ApiKeys, Caller, KeySet, fingerprint};

use crate::error::{ApiError, ErrorCode};
use crate::runtime::Runtime;

/// What every handler may use.
#[derive(Clone, Debug)]
pub struct AppState {
    pub runtime: Runtime,
    pub keys: Arc<ApiKeys>,
    /// When this server started (Unix seconds): the `created` of `/v1/models`.
    pub started_unix: i64,
    /// `GET /metrics` needs no admin key (`start --metrics-public`).
    pub metrics_public: bool,
}

impl AppState {
    pub fn new(runtime: Runtime, keys: ApiKeys) -> Self {
        Self {
            runtime,
            keys: Arc::new(keys),
            started_unix: chrono::Utc::now().timestamp(),
            metrics_public: false,
        }
    }

    pub fn runtime_started_unix(&self) -> i64 {
        self.started_unix
    }
}

/// The whole HTTP surface.
///
/// Each protocol surface is a nested router whose key check is a layer over all of it, its
/// own 404/405 fallbacks included: a path under `/v1/`, `/runtime/` or `/admin/` is judged by
/// its key first (401 without one, 403 with one of the other scope) and only then routed, so
/// an unauthenticated caller cannot map the surface by probing paths.
pub fn router(state: AppState) -> Router {
    let v1 = if state.runtime.workspace().runtime.openai.enabled {
        with_fallbacks(
            Router::new()
                .route("/models", get(v1::list_models))
                .route("/models/{id}", get(v1::get_model))
                .route("/capabilities", get(v1::capabilities))
                .route("/chat/completions", post(v1::chat_completions))
                .route("/responses", post(responses::create_response))
                .route("/responses/{id}", get(responses::get_response)),
        )
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_client_key_v1,
        ))
    } else {
        // Switched off: no route exists, whoever asks and with whatever key.
        Router::new().fallback(surface_disabled)
    };
    let runtime = with_fallbacks(
        Router::new()
            .route("/requests", post(runtime_api::create_request))
            .route("/requests/{id}", get(runtime_api::get_request))
            .route("/requests/{id}/events", get(runtime_api::request_events))
            .route("/requests/{id}/cancel", post(runtime_api::cancel_request))
            .route("/sessions/{id}", get(runtime_api::get_session))
            .route("/sessions/{id}/fork", post(runtime_api::fork_session)),
    )
    .layer(axum::middleware::from_fn_with_state(
        state.clone(),
        auth::require_client_key,
    ))
    // Remote agents' callbacks carry their run's token, never a client key.
    .merge(
        Router::new()
            .route("/runs/{run_id}/tools/{tool_id}", post(callbacks::call_tool))
            .route("/runs/{run_id}/calls/{call_id}", get(callbacks::get_call)),
    );
    let admin = with_fallbacks(
        Router::new()
            .route("/requests", get(admin::list_requests))
            .route("/requests/{id}", get(admin::get_request))
            .route("/requests/{id}/cancel", post(admin::cancel_request))
            .route("/requests/{id}/events", get(admin::request_events))
            .route("/requests/{id}/retry", post(admin::retry_request))
            .route("/runs/{id}", get(admin::get_run))
            .route("/runs/{id}/events", get(admin::run_events))
            .route("/runs/{id}/trace", get(inspect::run_trace))
            .route("/sessions", get(admin::list_sessions))
            .route("/sessions/{id}", get(admin::get_session))
            .route("/workspace", get(inspect::workspace))
            .route("/workspace/reload", post(inspect::reload_workspace))
            .route("/health", get(inspect::health))
            .route("/approvals", get(admin::list_approvals))
            .route("/approvals/{id}", get(admin::get_approval))
            .route("/approvals/{id}/approve", post(admin::approve))
            .route("/approvals/{id}/deny", post(admin::deny))
            .route("/memory", get(memory::list_memory))
            .route("/memory/maintenance", post(memory::memory_maintenance))
            .route(
                "/memory/{id}",
                get(memory::get_memory).delete(memory::delete_memory),
            )
            .route("/memory/{id}/approve", post(memory::approve_memory))
            .route("/memory/{id}/reject", post(memory::reject_memory))
            .route("/policy/explain", post(admin::explain_policy))
            .route("/usage", get(spend::usage))
            .route("/budgets", get(spend::budgets))
            .route("/store", get(admin::get_store))
            .route("/store/prune", post(admin::prune_store))
            .route("/store/backup", post(admin::backup_store)),
    )
    .layer(axum::middleware::from_fn_with_state(
        state.clone(),
        auth::require_admin_key,
    ));
    let metrics = Router::new().route("/metrics", get(inspect::metrics));
    let metrics = if state.metrics_public {
        metrics
    } else {
        metrics.layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_admin_key,
        ))
    };
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/openapi.json", get(openapi::serve))
        .merge(openapi::docs_ui())
        .merge(metrics)
        .nest("/v1", v1)
        .nest("/runtime", runtime)
        .nest("/admin", admin)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

/// A surface's own 404 and 405, set before its key check is layered over it.
fn with_fallbacks(routes: Router<AppState>) -> Router<AppState> {
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
}

// Nested routers see their path without the surface prefix: the messages quote the original.
async fn not_found(OriginalUri(uri): OriginalUri) -> ApiError {
    ApiError::new(
        ErrorCode::RouteNotFound,
        format!("no route for {}", uri.path()),
    )
}

async fn method_not_allowed(method: axum::http::Method, OriginalUri(uri): OriginalUri) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("{method} is not allowed on {}", uri.path()),
    )
}

async fn surface_disabled(OriginalUri(uri): OriginalUri) -> ApiError {
    ApiError::new(
        ErrorCode::SurfaceDisabled,
        format!(
            "no route for {}: the OpenAI-compatible surface /v1 is disabled in this workspace (protocols.openai.enabled: false)",
            uri.path()
        ),
    )
    .on_openai_surface()
}
