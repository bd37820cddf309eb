//! The native runtime API (client keys): submit requests, read them, read or follow their
//! events, cancel them; read a session's message tree and fork it at any message. A key sees
//! only what it owns. `GET .../events` answers JSON pages, or with `Accept: text/event-stream`
//! follows live (each SSE `id:` is the seq; `Last-Event-ID` resumes without gaps or
//! duplicates).

use std::time::Duration;

use axum::Extension;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::AppState;
use super::auth::Caller;
use super::extract::{ApiJson, ApiPath, ApiQuery};
use super::messages::validate_messages;
use super::sse::{self, Frame};
use super::views::{
    EventPage, EventsQuery, Json, RequestView, SessionView, request_view, session_view, store_error,
};
use crate::error::{ApiError, ErrorCode};
use crate::runtime::{AwaitedView, Following, History, NewRequest, Protocol, RuntimeError};

/// `POST /runtime/requests` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CreateRequest {
    /// Default: the workspace's `defaultAgent`.
    #[serde(default)]
    pub agent_id: Option<String>,
    /// Run this workflow instead of an agent (not with `agentId`).
    #[serde(default)]
    pub workflow_id: Option<String>,
    /// Continue a session: its stored history is prepended to the input.
    #[serde(default)]
    pub session_id: Option<String>,
    pub input: RequestInput,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
    /// Answer when the request ends (200) instead of at once (202).
    #[serde(default)]
    pub wait: bool,
}

/// `{text}` or `{messages}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RequestInput {
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub messages: Option<Vec<Value>>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    pub request_id: String,
    pub run_id: String,
    pub session_id: String,
    pub status: crate::store::RunStatus,
}

#[utoipa::path(post, path = "/runtime/requests", tag = "runtime", security(("client_key" = [])),
    request_body = CreateRequest,
    responses(
        (status = 202, body = Accepted, description = "Accepted; the run goes on"),
        (status = 200, body = RequestView, description = "With `wait: true`: the request once it ended"),
        (status = 400, body = crate::error::ErrorEnvelope), (status = 404, body = crate::error::ErrorEnvelope),
        (status = 422, body = crate::error::ErrorEnvelope), (status = 429, body = crate::error::ErrorEnvelope),
    ))]
pub async fn create_request(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(body): ApiJson<CreateRequest>,
) -> Result<Response, ApiError> {
    let messages = match (body.input.text, body.input.messages) {
        (Some(text), None) => vec![json!({ "role": "user", "content": text })],
        (None, Some(messages)) if !messages.is_empty() => {
            validate_messages(&messages, "input.messages")?;
            messages
        }
        _ => {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "`input` needs exactly one of `text` or a non-empty `messages`",
            )
            .param("input"));
        }
    };
    if body.agent_id.is_some() && body.workflow_id.is_some() {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "give `agentId` or `workflowId`, not both",
        )
        .param("workflowId"));
    }
    let new_messages = messages.len();
    let request = NewRequest {
        leading_held_by: None,
        agent_id: body.agent_id,
        session_id: body.session_id,
        owner: caller.identity.clone(),
        history: History::SessionLeaf,
        leading: Vec::new(),
        chainable: false,
        messages,
        sent: None,
        new_messages,
        options: Map::new(),
        metadata: body
            .metadata
            .map(Value::Object)
            .unwrap_or_else(|| json!({})),
        protocol: Protocol::Runtime,
        // A 202 is sent once the request is durable; a waiting client is answered only after
        // the request's end (or its approval) committed, and its submit with it.
        durable_before_return: !body.wait,
        client: Default::default(),
        surface: None,
        workflow: body.workflow_id,
    };
    if body.wait {
        // Followed from its first event: waiting reads nothing from the store, and the view
        // at the end comes with it (read by the journal beside the end's commit).
        let (submitted, events, mut awaited) = state.runtime.submit_and_await_view(request).await?;
        let agent_timeout = state
            .runtime
            .workspace()
            .agents
            .get(&submitted.agent_id)
            .map(|a| a.timeout)
            .unwrap_or(Duration::from_secs(120));
        state
            .runtime
            .wait_followed(events, agent_timeout + Duration::from_secs(5))
            .await?;
        let view = match awaited.as_mut().and_then(AwaitedView::take) {
            Some(full) => RequestView::in_full(full),
            // Stopped short of the end (an approval, the limit), ended by another
            // instance, or the journal's read failed.
            None => request_view(&state.runtime, &submitted.request_id, None).await?,
        };
        let status = if view.status.is_terminal() {
            StatusCode::OK
        } else {
            StatusCode::ACCEPTED
        };
        return Ok((status, view).into_response());
    }
    let submitted = state.runtime.submit(request).await?;
    let accepted = Accepted {
        request_id: submitted.request_id,
        run_id: submitted.run_id,
        session_id: submitted.session_id,
        status: submitted.status,
    };
    Ok((StatusCode::ACCEPTED, Json(accepted)).into_response())
}

#[utoipa::path(get, path = "/runtime/requests/{id}", tag = "runtime", security(("client_key" = [])),
    params(("id" = String, Path, description = "Request id")),
    responses((status = 200, body = RequestView), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_request(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<RequestView, ApiError> {
    request_view(&state.runtime, &id, Some(&caller.identity)).await
}

#[utoipa::path(get, path = "/runtime/requests/{id}/events", tag = "runtime", security(("client_key" = [])),
    params(("id" = String, Path, description = "Request id"), EventsQuery),
    responses(
        (status = 200, body = EventPage, description = "A page of events; with `Accept: text/event-stream`, a live SSE stream ending after the terminal event"),
        (status = 400, body = crate::error::ErrorEnvelope, description = "A parameter that does not parse"),
        (status = 404, body = crate::error::ErrorEnvelope),
        (status = 422, body = crate::error::ErrorEnvelope, description = "`after` or `limit` out of range"),
    ))]
pub async fn request_events(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    ApiQuery(query): ApiQuery<EventsQuery>,
) -> Result<Response, ApiError> {
    events_response(&state, &id, Some(&caller.identity), &headers, &query).await
}

/// How long a live event stream stays quiet before a comment keeps its connection alive.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// A request's events for `owner` (any owner when `None`): a JSON page, or with `Accept:
/// text/event-stream` a live SSE stream from `after` (or `Last-Event-ID`) to the terminal
/// event.
pub(super) async fn events_response(
    state: &AppState,
    id: &str,
    owner: Option<&str>,
    headers: &HeaderMap,
    query: &EventsQuery,
) -> Result<Response, ApiError> {
    // Another key's request does not exist for this caller: 404, like an unknown id.
    request_view(&state.runtime, id, owner).await?;
    let wants_stream = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    let (after, limit) = query.checked()?;
    let after = match last_event_id(headers)? {
        Some(seq) => seq,
        None => after,
    };
    if wants_stream {
        let events = state.runtime.follow(id, after, Following::Live);
        let body = events.map(|event| match event {
            Ok(event) => Frame::numbered(event.seq, &event.event_type, &*event),
            Err(error) => Frame::json(Some("error"), &store_error(&error).body()),
        });
        return Ok(sse::response(body, KEEP_ALIVE));
    }
    let data = state.runtime.store().events(id, after, limit).await?;
    Ok(Json(EventPage::new(data, after)).into_response())
}

/// The `Last-Event-ID` an SSE client resumes from: a seq this server sent, so anything else is
/// a client bug worth a 400 rather than a silent replay from the start.
fn last_event_id(headers: &HeaderMap) -> Result<Option<i64>, ApiError> {
    let Some(value) = headers.get("last-event-id") else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<i64>().ok())
        .filter(|seq| *seq >= 0)
        .map(Some)
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidParameter,
                "Last-Event-ID must be the seq of an event (an integer, 0 or more)",
            )
            .param("Last-Event-ID")
        })
}

#[utoipa::path(post, path = "/runtime/requests/{id}/cancel", tag = "runtime", security(("client_key" = [])),
    params(("id" = String, Path, description = "Request id")),
    responses(
        (status = 200, body = RequestView, description = "Cancelled: the run stopped and the request ended `cancelled`"),
        (status = 202, body = RequestView, description = "The run was told to stop and has not ended yet (it executes on another instance)"),
        (status = 404, body = crate::error::ErrorEnvelope),
        (status = 409, body = crate::error::ErrorEnvelope, description = "The request has ended already"),
    ))]
pub async fn cancel_request(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let by = format!("client `{}`", caller.identity);
    cancelled(&state, &id, Some(&caller.identity), &by).await
}

/// Cancels a request for `owner` (any owner when `None`) and answers its view: 200 once it
/// ended, 202 while its run is still stopping elsewhere.
pub(super) async fn cancelled(
    state: &AppState,
    id: &str,
    owner: Option<&str>,
    by: &str,
) -> Result<Response, ApiError> {
    state
        .runtime
        .cancel(id, owner, by)
        .await
        .map_err(id_param)?;
    let view = request_view(&state.runtime, id, owner).await?;
    let status = if view.status.is_terminal() {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, view).into_response())
}

#[utoipa::path(get, path = "/runtime/sessions/{id}", tag = "runtime", security(("client_key" = [])),
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = SessionView), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<SessionView>, ApiError> {
    Ok(Json(
        session_view(&state.runtime, &id, Some(&caller.identity)).await?,
    ))
}

/// `POST /runtime/sessions/{id}/fork` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ForkBody {
    /// The last message the new session shares: one of the session's own messages, or of the
    /// history it shares with the session it was forked from.
    pub at_message_id: String,
}

#[utoipa::path(post, path = "/runtime/sessions/{id}/fork", tag = "runtime", security(("client_key" = [])),
    params(("id" = String, Path, description = "Session id")), request_body = ForkBody,
    responses(
        (status = 201, body = SessionView, description = "The new session; a request on it continues from `atMessageId`"),
        (status = 400, body = crate::error::ErrorEnvelope),
        (status = 404, body = crate::error::ErrorEnvelope, description = "Unknown session, or a message not in its history (`param: atMessageId`)"),
    ))]
pub async fn fork_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<ForkBody>,
) -> Result<(StatusCode, Json<SessionView>), ApiError> {
    let fork = state
        .runtime
        .fork_session(&id, &body.at_message_id, Some(&caller.identity))
        .await
        .map_err(id_param)?;
    let view = session_view(&state.runtime, &fork.id, Some(&caller.identity)).await?;
    Ok((StatusCode::CREATED, Json(view)))
}

/// A runtime error of an endpoint whose path names the thing: an unknown one is `param: id`.
pub(super) fn id_param(error: RuntimeError) -> ApiError {
    let names_path = matches!(
        error,
        RuntimeError::RequestNotFound(_) | RuntimeError::SessionNotFound(_)
    );
    let api = ApiError::from(error);
    if names_path { api.param("id") } else { api }
}
