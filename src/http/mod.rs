//! Protocol surfaces (SPEC section 6): the OpenAI-compatible `/v1`, the native `/runtime`
//! API and the operator `/admin` API, plus health and the OpenAPI document.
//!
//! Handlers are thin: extract, call the runtime, map the result. Only this module knows wire
//! types; every error leaves through [`crate::error::ApiError`]'s envelope.

mod admin;
mod auth;
mod extract;
mod health;
pub mod openapi;
mod runtime_api;
mod v1;
mod views;

use std::sync::Arc;

use axum::Router;
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
}

impl AppState {
    pub fn new(runtime: Runtime, keys: ApiKeys) -> Self {
        Self {
            runtime,
            keys: Arc::new(keys),
            started_unix: chrono::Utc::now().timestamp(),
        }
    }

    pub fn runtime_started_unix(&self) -> i64 {
        self.started_unix
    }
}

/// The whole HTTP surface.
pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(v1::list_models))
        .route("/v1/models/{id}", get(v1::get_model))
        .route("/v1/capabilities", get(v1::capabilities))
        .route("/v1/chat/completions", post(v1::chat_completions))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_client_key_v1,
        ));
    let runtime = Router::new()
        .route("/runtime/requests", post(runtime_api::create_request))
        .route("/runtime/requests/{id}", get(runtime_api::get_request))
        .route(
            "/runtime/requests/{id}/events",
            get(runtime_api::request_events),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_client_key,
        ));
    let admin = Router::new()
        .route("/admin/requests", get(admin::list_requests))
        .route("/admin/requests/{id}", get(admin::get_request))
        .route("/admin/runs/{id}", get(admin::get_run))
        .route("/admin/runs/{id}/events", get(admin::run_events))
        .route("/admin/approvals", get(admin::list_approvals))
        .route("/admin/approvals/{id}", get(admin::get_approval))
        .route("/admin/approvals/{id}/approve", post(admin::approve))
        .route("/admin/approvals/{id}/deny", post(admin::deny))
        .route("/admin/policy/explain", post(admin::explain_policy))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_admin_key,
        ));
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/openapi.json", get(openapi::serve))
        .merge(v1)
        .merge(runtime)
        .merge(admin)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        ErrorCode::RouteNotFound,
        format!("no route for {}", uri.path()),
    )
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("{method} is not allowed on {}", uri.path()),
    )
}
