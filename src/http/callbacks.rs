//! Remote agents' tool callbacks (`stable-harness.agent/v1`): `POST
//! /runtime/runs/{runId}/tools/{toolId}` runs a tool for a live run of an `http` agent, and
//! `GET /runtime/runs/{runId}/calls/{callId}` reads a call that was still waiting on an
//! approval. Both are authorized by the run's callback token alone — not a client key: it opens
//! these two routes for its own run and nothing else, and dies with the run.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use super::AppState;
use super::auth::bearer_token;
use super::extract::{ApiJson, ApiPath};
use super::views::{Json, store_error};
use crate::error::{ApiError, ErrorCode};
use crate::gateway::callbacks::CallbackCall;
use crate::gateway::{Outcome, ToolResult};
use crate::store::{ApprovalStatus, ToolCallRecord};

/// `POST /runtime/runs/{runId}/tools/{toolId}` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CallbackBody {
    /// The tool's arguments (a JSON object).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub arguments: Value,
}

/// The longest `Idempotency-Key` a callback may carry.
const MAX_IDEMPOTENCY_KEY: usize = 200;

fn unauthorized(missing: bool) -> ApiError {
    if missing {
        ApiError::new(
            ErrorCode::MissingApiKey,
            "a tool callback needs the run's callback token as a bearer token",
        )
    } else {
        ApiError::new(
            ErrorCode::InvalidApiKey,
            "the callback token is not valid for this run (it expired, its run ended, or it is another run's)",
        )
    }
}

/// The run's callback queue, if the bearer token is its live token.
fn authorize(
    state: &AppState,
    headers: &HeaderMap,
    run_id: &str,
) -> Result<mpsc::Sender<CallbackCall>, ApiError> {
    let token = bearer_token(headers).ok_or_else(|| unauthorized(true))?;
    state
        .runtime
        .callbacks()
        .authorize(token, run_id)
        .ok_or_else(|| unauthorized(false))
}

/// The call's key: `cb.` and the service's `Idempotency-Key` (a repeated callback finds the
/// recorded result), else a new one.
fn call_key(headers: &HeaderMap) -> Result<String, ApiError> {
    match headers.get("idempotency-key") {
        None => Ok(format!("cb.{}", crate::ids::time_ordered().simple())),
        Some(value) => {
            let key = value.to_str().ok().filter(|key| {
                !key.is_empty()
                    && key.len() <= MAX_IDEMPOTENCY_KEY
                    && key.bytes().all(|b| b.is_ascii_graphic())
            });
            key.map(|key| format!("cb.{key}")).ok_or_else(|| {
                ApiError::new(
                    ErrorCode::InvalidParameter,
                    format!("Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters"),
                )
                .param("Idempotency-Key")
            })
        }
    }
}

/// A recorded outcome as the service reads it: `completed` with `result`, `denied` or `error`
/// with the gateway's typed error.
fn answer(call_id: &str, outcome: Outcome, content: &Value) -> Value {
    let error = || {
        content
            .get("error")
            .cloned()
            .unwrap_or_else(|| content.clone())
    };
    match outcome {
        Outcome::Completed => {
            json!({ "callId": call_id, "status": "completed", "result": content })
        }
        Outcome::Denied | Outcome::NotAllowed => {
            json!({ "callId": call_id, "status": "denied", "error": error() })
        }
        _ => json!({ "callId": call_id, "status": "error", "error": error() }),
    }
}

/// The pending approval of a run's call, if it waits on one.
async fn pending_approval(
    state: &AppState,
    run_id: &str,
    call_id: &str,
) -> Result<Option<String>, ApiError> {
    let approvals = state
        .runtime
        .store()
        .approvals_of_run(run_id)
        .await
        .map_err(|error| store_error(&error))?;
    Ok(approvals
        .into_iter()
        .find(|a| a.call_key == call_id && a.status == ApprovalStatus::Pending)
        .map(|a| a.id))
}

/// The 202 of a call still waiting (on an approval, when it has one).
fn still_pending(call_id: &str, approval: Option<String>) -> Response {
    let body = json!({ "callId": call_id, "status": "pending", "approvalId": approval });
    (StatusCode::ACCEPTED, Json(body)).into_response()
}

#[utoipa::path(post, path = "/runtime/runs/{runId}/tools/{toolId}", tag = "runtime",
    security(("callback_token" = [])),
    params(("runId" = String, Path, description = "The run the token was given to"),
        ("toolId" = String, Path, description = "One of the agent's tools")),
    request_body = CallbackBody,
    responses(
        (status = 200, description = "`{callId, status: completed | error | denied, result?, error?}`"),
        (status = 202, description = "Still waiting on an approval after `approvalWait`: `{callId, status: pending, approvalId}`; poll `GET /runtime/runs/{runId}/calls/{callId}`"),
        (status = 400, body = crate::error::ErrorEnvelope), (status = 401, body = crate::error::ErrorEnvelope),
        (status = 409, body = crate::error::ErrorEnvelope),
    ))]
pub async fn call_tool(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiPath((run_id, tool_id)): ApiPath<(String, String)>,
    ApiJson(body): ApiJson<CallbackBody>,
) -> Result<Response, ApiError> {
    let queue = authorize(&state, &headers, &run_id)?;
    let call_key = call_key(&headers)?;
    let (reply, answered) = oneshot::channel::<ToolResult>();
    let call = CallbackCall {
        call_key: call_key.clone(),
        tool_id,
        arguments: if body.arguments.is_null() {
            json!({})
        } else {
            body.arguments
        },
        reply,
    };
    // The run ended between the check and the call: its token is dead now.
    queue.send(call).await.map_err(|_| unauthorized(false))?;
    let wait = state.runtime.workspace().runtime.openai.approval_wait;
    match tokio::time::timeout(wait, answered).await {
        Ok(Ok(result)) => {
            Ok(Json(answer(&call_key, result.outcome, &result.content)).into_response())
        }
        Ok(Err(_)) => Err(ApiError::new(
            ErrorCode::RequestEnded,
            "the run ended before the call was answered",
        )),
        Err(_) => Ok(still_pending(
            &call_key,
            pending_approval(&state, &run_id, &call_key).await?,
        )),
    }
}

#[utoipa::path(get, path = "/runtime/runs/{runId}/calls/{callId}", tag = "runtime",
    security(("callback_token" = [])),
    params(("runId" = String, Path, description = "The run the token was given to"),
        ("callId" = String, Path, description = "The `callId` a callback answered")),
    responses(
        (status = 200, description = "The call's recorded outcome: `{callId, status, result?, error?}`"),
        (status = 202, description = "Still waiting: `{callId, status: pending, approvalId}`"),
        (status = 401, body = crate::error::ErrorEnvelope), (status = 404, body = crate::error::ErrorEnvelope),
    ))]
pub async fn get_call(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiPath((run_id, call_id)): ApiPath<(String, String)>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, &run_id)?;
    let calls = state
        .runtime
        .store()
        .tool_calls_of_run(&run_id)
        .await
        .map_err(|error| store_error(&error))?;
    match calls.iter().find(|call| call.call_key == call_id) {
        Some(ToolCallRecord {
            outcome, result, ..
        }) if outcome != "started" => {
            Ok(Json(answer(&call_id, Outcome::parse(outcome), result)).into_response())
        }
        // Started, or not recorded yet: still running, or waiting on an approval.
        found => match pending_approval(&state, &run_id, &call_id).await? {
            Some(approval) => Ok(still_pending(&call_id, Some(approval))),
            None if found.is_some() => Ok(still_pending(&call_id, None)),
            None => Err(ApiError::new(
                ErrorCode::CallNotFound,
                format!("run `{run_id}` has no call `{call_id}`"),
            )
            .param("callId")),
        },
    }
}
