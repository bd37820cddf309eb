//! `GET /healthz` (the process answers) and `GET /readyz` (the store answers and accepts
//! writes: while it cannot write — a full disk, I/O errors — readiness is red).

use axum::extract::State;
use axum::http::StatusCode;
use serde_json::{Value, json};

use super::AppState;
use super::views::Json;

#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "The process is alive")))]
pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

#[utoipa::path(get, path = "/readyz", tag = "health", responses(
    (status = 200, description = "Ready to serve"),
    (status = 503, description = "The store does not answer or cannot write"),
))]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    if !state.runtime.store_available() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": "unavailable", "reason": "the store cannot write" })),
        );
    }
    match state.runtime.store().ping().await {
        Ok(()) => (StatusCode::OK, Json(json!({ "status": "ready" }))),
        Err(error) => {
            tracing::warn!(%error, "readiness check failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({ "status": "unavailable", "reason": "the store does not answer" })),
            )
        }
    }
}
