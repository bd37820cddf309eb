//! The OpenAI-compatible surface: agents are models. `/v1` is stateless like OpenAI — the
//! transcript is exactly what the client sends; `x-stable-harness-session-id` (or `user`) only
//! groups requests into a session. The default stream holds nothing but standard
//! `chat.completion.chunk` events and `[DONE]`, so every OpenAI SDK parses it.

use std::convert::Infallible;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::AppState;
use super::auth::Caller;
use super::extract::{ApiPath, V1Json};
use super::messages::validate_messages;
use super::views::{run_failure, store_error};
use crate::error::{ApiError, ErrorCode};
use crate::runtime::events::{
    ADAPTER_EVENT, APPROVAL_REQUESTED, APPROVAL_RESOLVED, PHASE_HANDOFF, PHASE_TOOL_RESULT,
    PHASE_TOOL_START, PROGRESS_NARRATION, REQUEST_COMPLETED, TOOL_DENIED, TOOL_DIRECT_COMPLETED,
    TOOL_DIRECT_STARTED, is_terminal, output_delta_text,
};
use crate::runtime::{ApprovalWatch, NewRequest, Protocol, Submitted, Watched};
use crate::store::{EventRecord, RunStatus};
use crate::workspace::{AgentConfig, CompiledWorkspace, wire_name};

pub const REQUEST_ID_HEADER: &str = "x-stable-harness-request-id";
pub const SESSION_ID_HEADER: &str = "x-stable-harness-session-id";
pub const EVENTS_HEADER: &str = "x-stable-harness-events";

/// Options forwarded to the agent's adapter when the client sets them.
const FORWARDED_OPTIONS: &[&str] = &[
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logit_bias",
];

/// `POST /v1/chat/completions` body: the fields SPEC section 6 lists; other OpenAI fields are
/// accepted and ignored.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct ChatCompletionRequest {
    /// The agent id.
    pub model: String,
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<Value>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default)]
    pub n: Option<u32>,
    /// Everything else: generation options (forwarded) and fields this surface ignores.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub rest: Map<String, Value>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

fn v1_error(code: ErrorCode, message: impl Into<String>) -> ApiError {
    ApiError::new(code, message).on_openai_surface()
}

#[utoipa::path(get, path = "/v1/models", tag = "v1", security(("client_key" = [])),
    responses((status = 200, description = "Every agent, as a model")))]
pub async fn list_models(State(state): State<AppState>) -> Json<Value> {
    let data: Vec<Value> = state
        .runtime
        .workspace()
        .agents
        .values()
        .map(|agent| model_json(&state, agent))
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

#[utoipa::path(get, path = "/v1/models/{id}", tag = "v1", security(("client_key" = [])),
    params(("id" = String, Path, description = "Agent id")),
    responses((status = 200, description = "The agent, as a model"), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_model(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let workspace = state.runtime.workspace();
    let agent = find_agent(&workspace, &id)?;
    Ok(Json(model_json(&state, agent)))
}

fn model_json(state: &AppState, agent: &AgentConfig) -> Value {
    json!({ "id": agent.name, "object": "model", "created": state.runtime_started_unix(), "owned_by": "stable-harness" })
}

fn find_agent<'a>(workspace: &'a CompiledWorkspace, id: &str) -> Result<&'a AgentConfig, ApiError> {
    workspace.agent(id).ok_or_else(|| {
        v1_error(
            ErrorCode::ModelNotFound,
            format!("The model `{id}` does not exist"),
        )
        .param("model")
    })
}

#[utoipa::path(get, path = "/v1/capabilities", tag = "v1", security(("client_key" = [])),
    responses((status = 200, description = "Per agent: backend, tools, streaming and model capabilities")))]
pub async fn capabilities(State(state): State<AppState>) -> Json<Value> {
    let workspace = state.runtime.workspace();
    let data: Vec<Value> = workspace
        .agents
        .values()
        .map(|agent| {
            let model = agent.model.as_deref().and_then(|id| workspace.models.get(id));
            json!({
                "id": agent.name,
                "description": agent.description,
                "backend": wire_name(&agent.backend),
                "tools": agent.tools,
                "streaming": model.is_none_or(|m| m.capabilities.streaming),
                "model": model.map(|m| json!({ "id": m.id, "upstreamModel": m.upstream_model, "capabilities": m.capabilities })),
            })
        })
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

/// Checks what OpenAI would reject, naming the field (`param`) at fault.
fn validate(request: &ChatCompletionRequest) -> Result<(), ApiError> {
    for field in ["tools", "functions", "tool_choice", "function_call"] {
        if request.rest.get(field).is_some_and(|v| !v.is_null()) {
            return Err(v1_error(
                ErrorCode::ToolsNotSupported,
                format!("`{field}` cannot be supplied by the client: an agent's tools come from its workspace inventory"),
            )
            .param(field));
        }
    }
    if request.messages.is_empty() {
        return Err(v1_error(
            ErrorCode::InvalidRequest,
            "`messages` must contain at least one message",
        )
        .param("messages"));
    }
    validate_messages(&request.messages, "messages").map_err(ApiError::on_openai_surface)?;
    if request.n.is_some_and(|n| n != 1) {
        return Err(v1_error(ErrorCode::InvalidRequest, "only n = 1 is supported").param("n"));
    }
    Ok(())
}

/// The request's metadata: the client's, with `user` (which fills `{user}` memory
/// namespaces) set from the `user` field when it is given.
fn v1_metadata(metadata: Option<Map<String, Value>>, user: Option<&str>) -> Value {
    let mut metadata = metadata.unwrap_or_default();
    if let Some(user) = user {
        metadata.insert("user".to_owned(), Value::String(user.to_owned()));
    }
    Value::Object(metadata)
}

/// A session id from the grouping header or `user`; anything else is a new session. A `user`
/// names a session of the calling key's own (`user:<identity>:<user>`): another key's
/// `user` of the same name is another session.
fn session_id(
    headers: &HeaderMap,
    user: Option<&str>,
    owner: &str,
) -> Result<Option<String>, ApiError> {
    let raw = match headers.get(SESSION_ID_HEADER) {
        Some(value) => Some(
            value
                .to_str()
                .map_err(|_| {
                    v1_error(
                        ErrorCode::InvalidRequest,
                        format!("{SESSION_ID_HEADER} must be ASCII"),
                    )
                })?
                .to_owned(),
        ),
        None => user.map(|user| format!("user:{owner}:{user}")),
    };
    match raw {
        Some(id) if id.is_empty() || id.len() > 200 || id.chars().any(|c| c.is_control()) => {
            Err(v1_error(
                ErrorCode::InvalidRequest,
                "session ids are 1 to 200 printable characters",
            )
            .param(SESSION_ID_HEADER))
        }
        other => Ok(other),
    }
}

#[utoipa::path(post, path = "/v1/chat/completions", tag = "v1", security(("client_key" = [])),
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "A `chat.completion`, or with `stream: true` an SSE stream of `chat.completion.chunk` ending in `[DONE]`"),
        (status = 400, body = crate::error::ErrorEnvelope), (status = 401, body = crate::error::ErrorEnvelope),
        (status = 404, body = crate::error::ErrorEnvelope), (status = 413, body = crate::error::ErrorEnvelope),
        (status = 429, body = crate::error::ErrorEnvelope), (status = 502, body = crate::error::ErrorEnvelope),
        (status = 504, body = crate::error::ErrorEnvelope),
    ))]
pub async fn chat_completions(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    V1Json(request): V1Json<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    validate(&request)?;
    find_agent(&state.runtime.workspace(), &request.model)?;
    let session_id = session_id(&headers, request.user.as_deref(), &caller.identity)?;
    let options: Map<String, Value> = FORWARDED_OPTIONS
        .iter()
        .filter_map(|key| {
            request
                .rest
                .get(*key)
                .filter(|v| !v.is_null())
                .map(|v| ((*key).to_owned(), v.clone()))
        })
        .collect();
    // The turn new to the session: everything after the last assistant message.
    let new_messages = request
        .messages
        .iter()
        .rev()
        .take_while(|m| m.get("role").and_then(Value::as_str) != Some("assistant"))
        .count();
    let stream = request.stream.unwrap_or(false);
    let include_usage = request
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let named_events = headers
        .get(EVENTS_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let (submitted, events) = state
        .runtime
        .submit_and_follow(NewRequest {
            agent_id: Some(request.model.clone()),
            session_id,
            owner: caller.identity.clone(),
            with_history: false,
            messages: request.messages,
            new_messages,
            options,
            metadata: v1_metadata(request.metadata, request.user.as_deref()),
            protocol: Protocol::V1,
            durable_before_return: false,
        })
        .await
        .map_err(|error| ApiError::from(error).on_openai_surface())?;
    let completion = Completion {
        id: format!("chatcmpl-{}", submitted.request_id),
        created: chrono::Utc::now().timestamp(),
        model: request.model,
    };
    let approval_wait = state.runtime.workspace().runtime.openai.approval_wait;
    let events = ApprovalWatch::new(events, approval_wait);
    let answered = if stream {
        stream_response(
            events,
            completion,
            submitted.clone(),
            include_usage,
            named_events,
        )
        .await
    } else {
        complete_response(events, completion, &submitted).await
    };
    // Errors after the submit name the request too: its run may go on (approval_pending).
    let mut response = answered.unwrap_or_else(IntoResponse::into_response);
    let headers = response.headers_mut();
    for (name, value) in [
        (REQUEST_ID_HEADER, &submitted.request_id),
        (SESSION_ID_HEADER, &submitted.session_id),
    ] {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    }
    Ok(response)
}

struct Completion {
    id: String,
    created: i64,
    model: String,
}

impl Completion {
    fn chunk(&self, delta: Value, finish_reason: Option<&str>, include_usage: bool) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason }],
        });
        if include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

fn delta_text(event: &EventRecord) -> Option<&str> {
    (event.event_type == ADAPTER_EVENT)
        .then(|| output_delta_text(&event.data))
        .flatten()
}

/// The API error a terminal event that is not `completed` stands for.
fn terminal_failure(submitted: &Submitted, event: &EventRecord) -> ApiError {
    let status = if event.event_type == REQUEST_COMPLETED {
        RunStatus::Completed
    } else if event.event_type.ends_with(".cancelled") {
        RunStatus::Cancelled
    } else {
        RunStatus::Failed
    };
    let error = event
        .data
        .get("error")
        .cloned()
        .unwrap_or_else(|| json!({ "message": event.data.get("reason").and_then(Value::as_str).unwrap_or("the run was cancelled") }));
    run_failure(&submitted.request_id, status, &error).on_openai_surface()
}

/// The 409 of a call that waited `approvalWait` on an approval.
fn approval_pending(submitted: &Submitted, approval_id: &str) -> ApiError {
    v1_error(
        ErrorCode::ApprovalPending,
        format!(
            "the run waits on approval `{approval_id}` (protocols.openai.approvalWait passed); it continues, and its result will be at GET /runtime/requests/{}",
            submitted.request_id
        ),
    )
    .with_request_id(&submitted.request_id)
}

/// Events a client that opted in receives as `stable_harness.tool.progress`.
fn is_tool_progress(event: &EventRecord) -> bool {
    match event.event_type.as_str() {
        TOOL_DIRECT_STARTED
        | TOOL_DIRECT_COMPLETED
        | TOOL_DENIED
        | APPROVAL_REQUESTED
        | APPROVAL_RESOLVED => true,
        ADAPTER_EVENT => matches!(
            event.data.pointer("/event/phase").and_then(Value::as_str),
            Some(PHASE_TOOL_START | PHASE_TOOL_RESULT | PHASE_HANDOFF)
        ),
        _ => false,
    }
}

async fn complete_response(
    mut events: ApprovalWatch,
    completion: Completion,
    submitted: &Submitted,
) -> Result<Response, ApiError> {
    loop {
        let event = match events.next().await {
            Watched::Event(event) => event,
            Watched::StillPending(approval) => return Err(approval_pending(submitted, &approval)),
            Watched::Failed(error) => return Err(store_error(&error)),
            Watched::Ended => break,
        };
        if !is_terminal(&event.event_type) {
            continue;
        }
        if event.event_type != REQUEST_COMPLETED {
            return Err(terminal_failure(submitted, &event));
        }
        let data = &event.data;
        let body = json!({
            "id": completion.id,
            "object": "chat.completion",
            "created": completion.created,
            "model": completion.model,
            "system_fingerprint": null,
            "choices": [{
                "index": 0,
                "message": { "role": "assistant", "content": data.get("output").cloned().unwrap_or(Value::Null), "refusal": null },
                "logprobs": null,
                "finish_reason": data.get("finishReason").and_then(Value::as_str).filter(|r| !r.is_empty()).unwrap_or("stop"),
            }],
            "usage": data.get("usage").cloned().unwrap_or(Value::Null),
        });
        return Ok(Json(body).into_response());
    }
    Err(ApiError::internal(
        "the event stream ended before the request did",
    ))
}

async fn stream_response(
    mut events: ApprovalWatch,
    completion: Completion,
    submitted: Submitted,
    include_usage: bool,
    named_events: bool,
) -> Result<Response, ApiError> {
    // Hold the status line until the run produced text, ended or waits on an approval, so
    // that a run failing at once is answered with a proper error status instead of a broken
    // stream (and a pending approval gets keep-alives).
    let mut held = Vec::new();
    loop {
        match events.next().await {
            Watched::Ended => {
                return Err(ApiError::internal(
                    "the event stream ended before the request did",
                ));
            }
            Watched::Failed(error) => return Err(store_error(&error)),
            Watched::StillPending(approval) => return Err(approval_pending(&submitted, &approval)),
            Watched::Event(event) => {
                if is_terminal(&event.event_type) && event.event_type != REQUEST_COMPLETED {
                    return Err(terminal_failure(&submitted, &event));
                }
                let start = delta_text(&event).is_some()
                    || is_terminal(&event.event_type)
                    || event.event_type == APPROVAL_REQUESTED;
                held.push(event);
                if start {
                    break;
                }
            }
        }
    }
    // Comments keep the connection alive while a call waits on an operator.
    let keep_alive = (events.approval_wait() / 4).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(15),
    );
    let body = async_stream::stream! {
        yield Ok::<Event, Infallible>(Event::default().data(completion.chunk(json!({ "role": "assistant", "content": "" }), None, include_usage).to_string()));
        let mut held = held.into_iter();
        loop {
            let event = match held.next() {
                Some(event) => event,
                None => match events.next().await {
                    Watched::Event(event) => event,
                    Watched::Ended => return,
                    Watched::StillPending(approval) => {
                        yield Ok(Event::default().data(approval_pending(&submitted, &approval).body().to_string()));
                        return;
                    }
                    Watched::Failed(error) => {
                        tracing::error!(%error, "event stream failed");
                        yield Ok(Event::default().data(store_error(&error).on_openai_surface().body().to_string()));
                        return;
                    }
                },
            };
            if named_events && is_tool_progress(&event) {
                let mut data = event.data.clone();
                data["type"] = Value::String(event.event_type.clone());
                yield Ok(Event::default().event("stable_harness.tool.progress").data(data.to_string()));
            }
            if let Some(text) = delta_text(&event) {
                yield Ok(Event::default().data(completion.chunk(json!({ "content": text }), None, include_usage).to_string()));
            } else if named_events && event.event_type == PROGRESS_NARRATION {
                yield Ok(Event::default().event("stable_harness.progress.narration").data(event.data.to_string()));
            } else if event.event_type == REQUEST_COMPLETED {
                let reason = event.data.get("finishReason").and_then(Value::as_str).filter(|r| !r.is_empty()).unwrap_or("stop");
                yield Ok(Event::default().data(completion.chunk(json!({}), Some(reason), include_usage).to_string()));
                if include_usage {
                    let mut usage = completion.chunk(json!({}), None, false);
                    usage["choices"] = json!([]);
                    usage["usage"] = event.data.get("usage").cloned().unwrap_or(Value::Null);
                    yield Ok(Event::default().data(usage.to_string()));
                }
                yield Ok(Event::default().data("[DONE]"));
                return;
            } else if is_terminal(&event.event_type) {
                // Failed after text was sent: an error event, then the stream closes.
                yield Ok(Event::default().data(terminal_failure(&submitted, &event).body().to_string()));
                return;
            }
        }
    };
    Ok(Sse::new(body)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response())
}
