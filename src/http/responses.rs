//! The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), on the same
//! runtime path as chat completions: the input items become a Chat Completions transcript,
//! the request is submitted and its events followed, and the answer is rendered as a response
//! object or as the exact streaming event sequence clients' accumulators expect.
//!
//! A response *is* a request: `resp_<x>` is the request `req_<x>`, visible to operators like
//! any other. What only a response has (instructions, tools, `store`, the chain) is stored
//! with the request's input, so a stored response lives and is pruned with its request, and
//! its output is read back from the request's terminal event. `previous_response_id`
//! continues from the whole stored chain: the previous request's transcript (without its
//! instructions) and its output, function calls included. The chain is held in the session:
//! a turn stores what it brings under the message where the chain ends (the previous answer)
//! and is run on the session's path through it, so a chain is stored once, not once a turn.

use std::sync::Arc;

use axum::Extension;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::AppState;
use super::auth::Caller;
use super::extract::{ApiPath, V1Json};
use super::messages::validate_messages;
use super::response_input::{Member, ResponseInput, append_items, check_calls_answered};
use super::sse::{self, Frame};
use super::v1::{
    Chain, V1Submission, client_calls, client_functions, completed_event, delta_text,
    finish_reason, hold_until_started, keep_alive, next_streamed, progress_event, session_id,
    submit, terminal_failure, v1_error, v1_metadata, wants_named_events, with_request_headers,
};
use super::views::{JsonText, run_failure, store_error};
use crate::adapters::ClientCall;
use crate::error::{ApiError, ErrorCode};
use crate::json;
use crate::runtime::events::{REQUEST_COMPLETED, is_terminal};
use crate::runtime::{ApprovalWatch, LEADING, Submitted, TRANSCRIPT_THROUGH};
use crate::store::{EventRecord, RequestRecord, RunStatus, Store};

/// `input.surface.api` of a request the Responses API submitted.
const SURFACE: &str = "responses";

/// A response's `tool_choice` and `parallel_tool_calls` when the client sends none.
const DEFAULT_TOOL_CHOICE: &str = "auto";
const DEFAULT_PARALLEL_TOOL_CALLS: bool = true;

/// `POST /v1/responses` body: what clients send (RESPONSES.md); unknown fields, tool types and
/// `include` values are accepted and ignored.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct CreateResponseRequest {
    /// The agent id.
    pub model: String,
    /// A string, or a list of items (messages, `function_call`, `function_call_output`,
    /// `reasoning`).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub input: ResponseInput,
    /// A system message for this call only (not carried along a chain).
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
    /// Keep the response for `GET` and `previous_response_id` (default true).
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default)]
    pub user: Option<String>,
    /// Everything else: generation options (forwarded) and fields this surface ignores.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub rest: Map<String, Value>,
}

/// The fields of a response that come from its creation, not from its run.
#[derive(Debug, Clone, PartialEq)]
struct Shape {
    id: String,
    created_at: i64,
    model: String,
    instructions: Option<String>,
    metadata: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: Value,
    previous_response_id: Option<String>,
    store: bool,
}

impl Shape {
    /// What is stored with the request (`input.surface`): the API, the time, and each other
    /// field only where it differs from the default [`Shape::from_request`] gives a field
    /// that is absent. A common response stores two keys instead of nine, each one fewer
    /// to build, redact, write and keep (docs/profiling.md, the fiftieth pass). The
    /// instructions are not among them: the request's `leading` system message holds them,
    /// which its run is sent (an agent's instructions, sent every turn, were stored twice).
    fn to_stored(&self) -> Value {
        let mut stored = Map::new();
        stored.insert("api".to_owned(), SURFACE.into());
        stored.insert("createdAt".to_owned(), self.created_at.into());
        let mut keep = |key: &str, value: Value| {
            stored.insert(key.to_owned(), value);
        };
        if self
            .metadata
            .as_object()
            .is_none_or(|fields| !fields.is_empty())
        {
            keep("metadata", self.metadata.clone());
        }
        if self.tools.as_array().is_none_or(|tools| !tools.is_empty()) {
            keep("tools", self.tools.clone());
        }
        if self.tool_choice != DEFAULT_TOOL_CHOICE {
            keep("toolChoice", self.tool_choice.clone());
        }
        if self.parallel_tool_calls != DEFAULT_PARALLEL_TOOL_CALLS {
            keep("parallelToolCalls", self.parallel_tool_calls.clone());
        }
        if let Some(previous) = &self.previous_response_id {
            keep("previousResponseId", previous.as_str().into());
        }
        if !self.store {
            keep("store", false.into());
        }
        Value::Object(stored)
    }

    fn from_request(request: &RequestRecord) -> Option<Self> {
        let stored = request.input.get("surface")?;
        (stored.get("api")?.as_str()? == SURFACE).then_some(())?;
        Some(Self {
            id: response_id(&request.id),
            created_at: stored
                .get("createdAt")
                .and_then(Value::as_i64)
                .unwrap_or_else(|| request.created_at.timestamp()),
            model: request.agent_id.clone(),
            // Read from the surface's fields for a response stored before they left them.
            instructions: stored
                .get("instructions")
                .or_else(|| stored_instructions(&request.input))
                .and_then(Value::as_str)
                .map(str::to_owned),
            metadata: stored.get("metadata").cloned().unwrap_or(json!({})),
            tools: stored.get("tools").cloned().unwrap_or(json!([])),
            tool_choice: stored
                .get("toolChoice")
                .cloned()
                .unwrap_or_else(|| DEFAULT_TOOL_CHOICE.into()),
            parallel_tool_calls: stored
                .get("parallelToolCalls")
                .cloned()
                .unwrap_or(DEFAULT_PARALLEL_TOOL_CALLS.into()),
            previous_response_id: stored
                .get("previousResponseId")
                .and_then(Value::as_str)
                .map(str::to_owned),
            store: stored.get("store").and_then(Value::as_bool).unwrap_or(true),
        })
    }

    /// The response object as text: written here field by field, its constant runs (`object`,
    /// `text`, `truncation` and the five `null`s) each one copy, with no serializer between
    /// (docs/profiling.md, the forty-eighth pass). The fields keep the order they always had.
    fn object_text(&self, outcome: &Outcome) -> String {
        let mut out = String::with_capacity(640);
        self.write_object(&mut out, outcome);
        out
    }

    /// The response object, appended to `out` (an event carrying it writes it in place).
    fn write_object(&self, out: &mut String, outcome: &Outcome) {
        out.push_str("{\"id\":");
        json::write_str(out, &self.id);
        out.push_str(",\"object\":\"response\",\"created_at\":");
        out.push_str(itoa::Buffer::new().format(self.created_at));
        out.push_str(",\"status\":");
        json::write_str(out, outcome.status);
        out.push_str(",\"model\":");
        json::write_str(out, &self.model);
        out.push_str(",\"output\":");
        json::write_array(out, &outcome.output, |out, entry| entry.write(out));
        out.push_str(",\"usage\":");
        match &outcome.usage {
            Some(usage) => usage.write(out),
            None => out.push_str("null"),
        }
        out.push_str(",\"error\":");
        json::write(out, &outcome.error);
        out.push_str(",\"incomplete_details\":");
        json::write(out, &outcome.incomplete);
        out.push_str(",\"instructions\":");
        json::write_str_or_null(out, self.instructions.as_deref());
        out.push_str(",\"metadata\":");
        json::write(out, &self.metadata);
        out.push_str(",\"parallel_tool_calls\":");
        json::write(out, &self.parallel_tool_calls);
        out.push_str(",\"tool_choice\":");
        json::write(out, &self.tool_choice);
        out.push_str(",\"tools\":");
        json::write(out, &self.tools);
        out.push_str(",\"previous_response_id\":");
        json::write_str_or_null(out, self.previous_response_id.as_deref());
        out.push_str(if self.store {
            ",\"store\":true"
        } else {
            ",\"store\":false"
        });
        out.push_str(
            ",\"text\":{\"format\":{\"type\":\"text\"}},\"truncation\":\"disabled\",\"temperature\":null,\
             \"top_p\":null,\"max_output_tokens\":null,\"reasoning\":null,\"user\":null}",
        );
    }
}

/// What a run made of a response, typed: a JSON answer and the stream's last event write it
/// out with no `Value` tree built for its output (docs/profiling.md, the forty-sixth pass).
struct Outcome {
    status: &'static str,
    output: Vec<OutputEntry>,
    /// `null` until the run ends.
    usage: Option<ResponseUsage>,
    error: Value,
    incomplete: Value,
}

/// One item of a finished run's output.
#[derive(Debug)]
enum OutputEntry {
    /// The assistant's text, as the message `id`.
    Message { id: String, text: String },
    /// A call of a function the client declared, handed to the client.
    FunctionCall(ClientCall),
}

impl OutputEntry {
    /// The item as it is in a finished response's `output`.
    fn write(&self, out: &mut String) {
        match self {
            Self::Message { id, text } => write_message_item(out, id, "completed", Some(text)),
            Self::FunctionCall(call) => {
                write_function_call_item(out, call, &call.arguments, "completed");
            }
        }
    }
}

/// A response's `usage`: always all five fields, the two details `0`.
#[derive(Debug)]
struct ResponseUsage {
    input_tokens: u64,
    output_tokens: u64,
    total_tokens: u64,
}

impl ResponseUsage {
    fn write(&self, out: &mut String) {
        let mut digits = itoa::Buffer::new();
        out.push_str("{\"input_tokens\":");
        out.push_str(digits.format(self.input_tokens));
        out.push_str(",\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":");
        out.push_str(digits.format(self.output_tokens));
        out.push_str(",\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":");
        out.push_str(digits.format(self.total_tokens));
        out.push('}');
    }
}

impl Outcome {
    fn in_progress(status: &'static str) -> Self {
        Self {
            status,
            output: Vec::new(),
            usage: None,
            error: Value::Null,
            incomplete: Value::Null,
        }
    }

    /// From the request's terminal event.
    fn ended(request_id: &str, event: &EventRecord) -> Self {
        let data = &event.data;
        if event.event_type != REQUEST_COMPLETED {
            let status = if event.event_type.ends_with(".cancelled") {
                RunStatus::Cancelled
            } else {
                RunStatus::Failed
            };
            let error = data.get("error").cloned().unwrap_or_else(
                || json!({ "message": data.get("reason").and_then(Value::as_str).unwrap_or("the run was cancelled") }),
            );
            let error = run_failure(request_id, status, &error);
            let mut failed = Self::in_progress(if status == RunStatus::Cancelled {
                "cancelled"
            } else {
                "failed"
            });
            failed.error = json!({ "code": error.code.as_str(), "message": error.message });
            return failed;
        }
        let text = data.get("output").and_then(Value::as_str).unwrap_or("");
        let mut output = Vec::new();
        if !text.is_empty() {
            output.push(OutputEntry::Message {
                id: message_item_id(request_id),
                text: text.to_owned(),
            });
        }
        output.extend(
            client_calls(data)
                .into_iter()
                .map(OutputEntry::FunctionCall),
        );
        let truncated = finish_reason(data) == "length";
        Self {
            status: if truncated { "incomplete" } else { "completed" },
            output,
            usage: Some(usage(data.get("usage"))),
            error: Value::Null,
            incomplete: if truncated {
                json!({ "reason": "max_output_tokens" })
            } else {
                Value::Null
            },
        }
    }
}

/// `req_<x>` <-> `resp_<x>`.
fn response_id(request_id: &str) -> String {
    format!(
        "resp_{}",
        request_id.strip_prefix("req_").unwrap_or(request_id)
    )
}

fn request_id_of(response_id: &str) -> Option<String> {
    response_id
        .strip_prefix("resp_")
        .filter(|rest| !rest.is_empty() && rest.len() <= 64)
        .map(|rest| format!("req_{rest}"))
}

fn message_item_id(request_id: &str) -> String {
    format!(
        "msg_{}",
        request_id.strip_prefix("req_").unwrap_or(request_id)
    )
}

/// The output item id of a client's call `call_<x>`: `fc_<x>`.
fn function_call_item_id(call: &ClientCall) -> String {
    format!("fc_{}", call.id.strip_prefix("call_").unwrap_or(&call.id))
}

/// A client's function call, as an output item: its `arguments` as far as they are known.
fn write_function_call_item(out: &mut String, call: &ClientCall, arguments: &str, status: &str) {
    out.push_str("{\"arguments\":");
    json::write_str(out, arguments);
    out.push_str(",\"call_id\":");
    json::write_str(out, &call.id);
    out.push_str(",\"id\":");
    json::write_str(out, &function_call_item_id(call));
    out.push_str(",\"name\":");
    json::write_str(out, &call.name);
    out.push_str(",\"status\":");
    json::write_str(out, status);
    out.push_str(",\"type\":\"function_call\"}");
}

/// The assistant's message, as an output item: its one text part, or none while it opens.
fn write_message_item(out: &mut String, id: &str, status: &str, text: Option<&str>) {
    match text {
        Some(text) => {
            out.push_str("{\"content\":[{\"annotations\":[],\"logprobs\":[],\"text\":");
            json::write_str(out, text);
            out.push_str(",\"type\":\"output_text\"}]");
        }
        None => out.push_str("{\"content\":[]"),
    }
    out.push_str(",\"id\":");
    json::write_str(out, id);
    out.push_str(",\"role\":\"assistant\",\"status\":");
    json::write_str(out, status);
    out.push_str(",\"type\":\"message\"}");
}

/// The run's usage (a Chat Completions `usage`) in the Responses shape.
fn usage(usage: Option<&Value>) -> ResponseUsage {
    let count = |key: &str| {
        usage
            .and_then(|u| u.get(key))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    let (input, output) = (count("prompt_tokens"), count("completion_tokens"));
    ResponseUsage {
        input_tokens: input,
        output_tokens: output,
        total_tokens: count("total_tokens").max(input.saturating_add(output)),
    }
}

/// Generation options from a Responses request, in the Chat Completions names the adapter
/// forwards.
fn options(request: &CreateResponseRequest) -> Map<String, Value> {
    let mut options = Map::new();
    for key in ["temperature", "top_p"] {
        if let Some(value) = request.rest.get(key).filter(|v| !v.is_null()) {
            options.insert(key.to_owned(), value.clone());
        }
    }
    if let Some(max) = request.rest.get("max_output_tokens").filter(|v| v.is_u64()) {
        options.insert("max_tokens".to_owned(), max.clone());
    }
    match request.rest.get("text").and_then(|text| text.get("format")) {
        Some(format) if format.get("type").and_then(Value::as_str) == Some("json_schema") => {
            options.insert(
                "response_format".to_owned(),
                json!({ "type": "json_schema", "json_schema": {
                    "name": format.get("name").cloned().unwrap_or(json!("response")),
                    "schema": format.get("schema").cloned().unwrap_or(json!({})),
                    "strict": format.get("strict").cloned().unwrap_or(Value::Null),
                } }),
            );
        }
        Some(format) if format.get("type").and_then(Value::as_str) == Some("json_object") => {
            options.insert(
                "response_format".to_owned(),
                json!({ "type": "json_object" }),
            );
        }
        _ => {}
    }
    options
}

/// A stored request behind a response id that `caller` may see, with its terminal event if
/// it ended.
struct StoredResponse {
    request: RequestRecord,
    shape: Shape,
    terminal: Option<EventRecord>,
}

/// What of a stored response is read: its instructions too (the response object), or not
/// (a turn continuing it, which compares its own with the digest its input keeps).
#[derive(Clone, Copy, PartialEq)]
enum Instructions {
    Read,
    Unread,
}

/// The stored request behind a response id, if `caller` may see it, read with its last event
/// at once.
async fn stored_request(
    store: &dyn Store,
    caller: &Caller,
    id: &str,
    instructions: Instructions,
) -> Result<Option<StoredResponse>, ApiError> {
    let Some(request_id) = request_id_of(id) else {
        return Ok(None);
    };
    let Some((mut request, last)) = store
        .request_and_last_event(&request_id)
        .await
        .map_err(|e| store_error(&e))?
    else {
        return Ok(None);
    };
    if request.owner != caller.identity {
        return Ok(None);
    }
    // Instructions held by the request the input names are read in.
    if instructions == Instructions::Read && request.input.get(LEADING).is_none() {
        let leading = crate::runtime::stored_leading(store, &request, None)
            .await
            .map_err(|e| store_error(&e))?;
        if !leading.is_empty() {
            request.input[LEADING] = Value::Array(leading);
        }
    }
    let Some(shape) = Shape::from_request(&request).filter(|shape| shape.store) else {
        return Ok(None);
    };
    Ok(Some(StoredResponse {
        terminal: last.filter(|event| is_terminal(&event.event_type)),
        request,
        shape,
    }))
}

fn response_not_found(id: &str, param: Option<&str>) -> ApiError {
    let error = v1_error(
        ErrorCode::ResponseNotFound,
        format!("no stored response `{id}`"),
    );
    match param {
        Some(param) => error.param(param),
        None => error,
    }
}

/// What a stored request made of its response.
fn stored_outcome(stored: &StoredResponse) -> Outcome {
    match stored.request.status {
        RunStatus::Queued => Outcome::in_progress("queued"),
        RunStatus::Running | RunStatus::WaitingApproval => Outcome::in_progress("in_progress"),
        _ => match &stored.terminal {
            Some(event) => Outcome::ended(&stored.request.id, event),
            None => Outcome::in_progress("in_progress"),
        },
    }
}

/// The previous response's answer as its client saw it (text and function calls), and the
/// session message holding it, if it completed.
fn previous_answer(previous: &StoredResponse) -> Option<(Value, Option<String>)> {
    let event = previous
        .terminal
        .as_ref()
        .filter(|event| event.event_type == REQUEST_COMPLETED)?;
    let text = event
        .data
        .get("output")
        .and_then(Value::as_str)
        .unwrap_or("");
    let answer = ClientCall::assistant_message(text, &client_calls(&event.data));
    let message_id = event
        .data
        .get("messageId")
        .and_then(Value::as_str)
        .map(str::to_owned);
    Some((answer, message_id))
}

/// The instructions of a stored response: its request's `leading` system message (a
/// Responses request leads with nothing else).
fn stored_instructions(input: &Value) -> Option<&Value> {
    let [message] = input.get(LEADING)?.as_array()?.as_slice() else {
        return None;
    };
    (message.get("role")? == "system").then_some(())?;
    message.get("content")
}

/// A copy of the transcript a chain continues from, without the previous request's
/// instructions: the session's path to where it ends, or for a response stored before chains
/// were held in the session, the transcript its input holds (instructions first).
async fn copied_chain(
    store: &dyn crate::store::Store,
    previous: &StoredResponse,
    through: Option<&str>,
) -> Result<Vec<Value>, ApiError> {
    if let Some(through) = through {
        let path = store
            .message_path(through)
            .await
            .map_err(|e| store_error(&e))?;
        return Ok(path.into_iter().map(|message| message.content).collect());
    }
    let input = &previous.request.input;
    let mut messages = crate::store::named_input::stored_messages(store, &previous.request)
        .await
        .map_err(|e| store_error(&e))?;
    let instructions_inside = input.get(LEADING).is_none() && previous.shape.instructions.is_some();
    if instructions_inside && !messages.is_empty() {
        messages.remove(0);
    }
    Ok(messages)
}

#[utoipa::path(post, path = "/v1/responses", tag = "v1", security(("client_key" = [])),
    request_body = CreateResponseRequest,
    responses(
        (status = 200, description = "A `response` object, or with `stream: true` an SSE stream of Responses events from `response.created` to one terminal event"),
        (status = 400, body = crate::error::ErrorEnvelope), (status = 401, body = crate::error::ErrorEnvelope),
        (status = 404, body = crate::error::ErrorEnvelope), (status = 409, body = crate::error::ErrorEnvelope),
        (status = 413, body = crate::error::ErrorEnvelope), (status = 429, body = crate::error::ErrorEnvelope),
        (status = 502, body = crate::error::ErrorEnvelope), (status = 504, body = crate::error::ErrorEnvelope),
    ))]
pub async fn create_response(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    V1Json(mut request): V1Json<CreateResponseRequest>,
) -> Result<Response, ApiError> {
    // Responses tools are flat: `{type: "function", name, ...}`.
    let tools = client_functions(request.tools.as_ref(), None)?;
    let store = state.runtime.store();
    let leading: Vec<Value> = request
        .instructions
        .as_deref()
        .map(|instructions| json!({ "role": "system", "content": instructions }))
        .into_iter()
        .collect();
    // The turn's own messages: what continues the chain (the previous answer, or a copy of
    // the whole chain), then the input.
    let mut messages = Vec::new();
    let mut session = session_id(&headers, request.user.as_deref(), &caller.identity)?;
    let mut chain = None;
    if let Some(previous_id) = &request.previous_response_id {
        let read = stored_request(store.as_ref(), &caller, previous_id, Instructions::Unread);
        let Some(previous) = read.await? else {
            return Err(response_not_found(
                previous_id,
                Some("previous_response_id"),
            ));
        };
        // A chain is one session unless the client groups it otherwise.
        let session = session.get_or_insert_with(|| previous.request.session_id.clone());
        let answer = previous_answer(&previous);
        let through = previous
            .request
            .input
            .get(TRANSCRIPT_THROUGH)
            .and_then(Value::as_str);
        chain = Some(match through {
            // The session holds the chain's transcript: the turn names where it ends and
            // stores only what is new, so a long chain is stored once, not once a turn.
            Some(through) if *session == previous.request.session_id => {
                let answer_message = answer
                    .as_ref()
                    .and_then(|(_, message_id)| message_id.clone());
                messages.extend(answer.map(|(answer, _)| answer));
                Chain::Continued {
                    through: through.to_owned(),
                    answer_message,
                    // Instructions the same as the previous turn's are named, not stored
                    // again.
                    leading_held_by: crate::runtime::held_leading(&previous.request, &leading),
                }
            }
            // Another session (or a response stored before chains were held in the session)
            // starts from a copy of the whole chain.
            _ => {
                messages = copied_chain(store.as_ref(), &previous, through).await?;
                messages.extend(answer.map(|(answer, _)| answer));
                Chain::Copied
            }
        });
    }
    match std::mem::take(&mut request.input) {
        Member::Text(text) => {
            messages.push(json::object([
                ("role", "user".into()),
                ("content", text.into()),
            ]));
        }
        Member::List(items) => append_items(&mut messages, items, "input")?,
        Member::Absent | Member::Other => {
            return Err(v1_error(
                ErrorCode::InvalidParameter,
                "`input` must be a string or a list of items",
            )
            .param("input"));
        }
    }
    let continued = matches!(chain, Some(Chain::Continued { .. }));
    if !continued
        && !messages
            .iter()
            .any(|m| m.get("role").and_then(Value::as_str) != Some("system"))
    {
        return Err(v1_error(
            ErrorCode::InvalidParameter,
            "`input` holds nothing to answer",
        )
        .param("input"));
    }
    check_calls_answered(&messages)?;
    validate_messages(&messages, "input").map_err(ApiError::on_openai_surface)?;
    let shape = Shape {
        id: String::new(),
        created_at: chrono::Utc::now().timestamp(),
        model: request.model.clone(),
        instructions: request.instructions.clone(),
        metadata: Value::Object(request.metadata.clone().unwrap_or_default()),
        tools: request.tools.clone().unwrap_or(json!([])),
        tool_choice: request
            .rest
            .get("tool_choice")
            .cloned()
            .unwrap_or_else(|| DEFAULT_TOOL_CHOICE.into()),
        parallel_tool_calls: request
            .rest
            .get("parallel_tool_calls")
            .cloned()
            .unwrap_or(DEFAULT_PARALLEL_TOOL_CALLS.into()),
        previous_response_id: request.previous_response_id.clone(),
        store: request.store.unwrap_or(true),
    };
    let named_events = wants_named_events(&headers);
    let super::v1::Followed {
        submitted,
        events,
        final_only,
    } = submit(
        &state,
        &caller,
        V1Submission {
            agent: request.model.clone(),
            leading,
            messages,
            sent: None,
            chain,
            chainable: shape.store,
            tools,
            options: options(&request),
            metadata: v1_metadata(request.metadata, request.user.as_deref()),
            session_id: session,
            surface: Some(shape.to_stored()),
            stream: request.stream.unwrap_or(false),
        },
    )
    .await?;
    let shape = Shape {
        id: response_id(&submitted.request_id),
        ..shape
    };
    let answered = if request.stream.unwrap_or(false) {
        stream_response(events, shape, submitted.clone(), named_events, final_only).await
    } else {
        complete_response(events, &shape, &submitted).await
    };
    Ok(with_request_headers(
        answered.unwrap_or_else(IntoResponse::into_response),
        &submitted,
    ))
}

#[utoipa::path(get, path = "/v1/responses/{id}", tag = "v1", security(("client_key" = [])),
    params(("id" = String, Path, description = "Response id (`resp_…`)")),
    responses((status = 200, description = "The stored response, as it stands"), (status = 404, body = crate::error::ErrorEnvelope)))]
pub async fn get_response(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let store = state.runtime.store();
    let Some(stored) = stored_request(store.as_ref(), &caller, &id, Instructions::Read).await?
    else {
        return Err(response_not_found(&id, None));
    };
    Ok(JsonText(stored.shape.object_text(&stored_outcome(&stored))).into_response())
}

async fn complete_response(
    mut events: ApprovalWatch,
    shape: &Shape,
    submitted: &Submitted,
) -> Result<Response, ApiError> {
    let event = completed_event(&mut events, submitted).await?;
    let outcome = Outcome::ended(&submitted.request_id, &event);
    Ok(JsonText(shape.object_text(&outcome)).into_response())
}

/// Numbers a stream's events from 0, as every Responses event carries `sequence_number`.
struct Sequence(u64);

impl Sequence {
    fn next(&mut self) -> u64 {
        let number = self.0;
        self.0 += 1;
        number
    }

    /// The event `event_type` whose fields `fields` writes (`"key":value` pairs, comma
    /// separated, without the braces), then its number and type: every event of a stream is
    /// written straight into its text, as the JSON answer is (docs/profiling.md, the
    /// forty-eighth pass).
    fn written(&mut self, event_type: &'static str, fields: impl FnOnce(&mut String)) -> Frame {
        let number = self.next();
        Frame::named(event_type, |data| {
            data.push('{');
            fields(data);
            data.push_str(",\"sequence_number\":");
            data.push_str(itoa::Buffer::new().format(number));
            data.push_str(",\"type\":");
            json::write_str(data, event_type);
            data.push('}');
        })
    }

    /// `response.output_item.added` or `.done`: `item`, written by `write_item`.
    fn output_item(
        &mut self,
        event_type: &'static str,
        output_index: usize,
        write_item: impl FnOnce(&mut String),
    ) -> Frame {
        self.written(event_type, |out| {
            out.push_str("\"item\":");
            write_item(out);
            out.push_str(",\"output_index\":");
            out.push_str(itoa::Buffer::new().format(output_index));
        })
    }

    /// `response.output_text.delta`, the event a stream sends per delta: written straight
    /// into its text.
    fn text_delta(&mut self, item_id: &str, delta: &str) -> Frame {
        self.written("response.output_text.delta", |out| {
            out.push_str("\"content_index\":0,\"delta\":");
            json::write_str(out, delta);
            out.push_str(",\"item_id\":");
            json::write_str(out, item_id);
            out.push_str(",\"logprobs\":[],\"output_index\":0");
        })
    }

    /// The two events that open a message's text: its item, then its text part, both empty.
    fn message_opened(&mut self, item_id: &str) -> [Frame; 2] {
        [
            self.output_item("response.output_item.added", 0, |out| {
                write_message_item(out, item_id, "in_progress", None);
            }),
            self.content_part("response.content_part.added", item_id, ""),
        ]
    }

    /// The three events that close a message's text, each carrying all of it.
    fn message_done(&mut self, item_id: &str, text: &str) -> [Frame; 3] {
        [
            self.written("response.output_text.done", |out| {
                out.push_str("\"content_index\":0,\"item_id\":");
                json::write_str(out, item_id);
                out.push_str(",\"logprobs\":[],\"output_index\":0,\"text\":");
                json::write_str(out, text);
            }),
            self.content_part("response.content_part.done", item_id, text),
            self.output_item("response.output_item.done", 0, |out| {
                write_message_item(out, item_id, "completed", Some(text));
            }),
        ]
    }

    /// `response.content_part.added` or `.done`: the message's one text part.
    fn content_part(&mut self, event_type: &'static str, item_id: &str, text: &str) -> Frame {
        self.written(event_type, |out| {
            out.push_str("\"content_index\":0,\"item_id\":");
            json::write_str(out, item_id);
            out.push_str(",\"output_index\":0,\"part\":{\"annotations\":[],\"text\":");
            json::write_str(out, text);
            out.push_str(",\"type\":\"output_text\"}");
        })
    }

    /// A client's call's arguments: all of them as one delta, then done.
    fn call_arguments(&mut self, call: &ClientCall, output_index: usize) -> [Frame; 2] {
        let item_id = function_call_item_id(call);
        let index = itoa::Buffer::new().format(output_index).to_owned();
        [
            self.written("response.function_call_arguments.delta", |out| {
                out.push_str("\"delta\":");
                json::write_str(out, &call.arguments);
                out.push_str(",\"item_id\":");
                json::write_str(out, &item_id);
                out.push_str(",\"output_index\":");
                out.push_str(&index);
            }),
            self.written("response.function_call_arguments.done", |out| {
                out.push_str("\"arguments\":");
                json::write_str(out, &call.arguments);
                out.push_str(",\"item_id\":");
                json::write_str(out, &item_id);
                out.push_str(",\"name\":");
                json::write_str(out, &call.name);
                out.push_str(",\"output_index\":");
                out.push_str(&index);
            }),
        ]
    }

    /// `error`: what ended the stream.
    fn error(&mut self, error: &ApiError) -> Frame {
        self.written("error", |out| {
            out.push_str("\"code\":");
            json::write_str(out, error.code.as_str());
            out.push_str(",\"message\":");
            json::write_str(out, &error.message);
            out.push_str(",\"param\":");
            json::write_str_or_null(out, error.param.as_deref());
        })
    }

    /// An event carrying the whole response as it stands (`response.created`,
    /// `response.completed`, ...).
    fn response(&mut self, event_type: &'static str, shape: &Shape, outcome: &Outcome) -> Frame {
        self.written(event_type, |out| {
            out.push_str("\"response\":");
            shape.write_object(out, outcome);
        })
    }

    /// An event carrying `response`, the response object's text written already (the two
    /// events before any output carry the same).
    fn whole(&mut self, event_type: &'static str, response: &str) -> Frame {
        self.written(event_type, |out| {
            out.push_str("\"response\":");
            out.push_str(response);
        })
    }

    /// `response.created` and `response.in_progress`, the events before any output: the
    /// same response object (in progress, no output yet) in both, written once. They come
    /// before the first token, and the object carries every tool the client declared.
    fn started(&mut self, shape: &Shape) -> [Frame; 2] {
        let response = shape.object_text(&Outcome::in_progress("in_progress"));
        [
            self.whole("response.created", &response),
            self.whole("response.in_progress", &response),
        ]
    }
}

async fn stream_response(
    mut events: ApprovalWatch,
    shape: Shape,
    submitted: Submitted,
    named_events: bool,
    final_only: bool,
) -> Result<Response, ApiError> {
    let held = hold_until_started(&mut events, &submitted, final_only).await?;
    let keep_alive = keep_alive(&events);
    let body = async_stream::stream! {
        let mut seq = Sequence(0);
        for event in seq.started(&shape) {
            yield event;
        }
        let item_id = message_item_id(&submitted.request_id);
        let mut text = String::new();
        let mut opened = false;
        let mut held = held.into_iter();
        loop {
            let event: Arc<EventRecord> = match next_streamed(&mut held, &mut events, &submitted).await {
                Some(Ok(event)) => event,
                None => return,
                Some(Err(error)) => {
                    for event in failed(&mut seq, &shape, &error) {
                        yield event;
                    }
                    return;
                }
            };
            if named_events && let Some(progress) = progress_event(&event) {
                yield progress;
            }
            if let Some(delta) = delta_text(&event).filter(|_| !final_only) {
                if !opened {
                    opened = true;
                    for event in seq.message_opened(&item_id) {
                        yield event;
                    }
                }
                text.push_str(delta);
                yield seq.text_delta(&item_id, delta);
                continue;
            }
            if !is_terminal(&event.event_type) {
                continue;
            }
            if event.event_type != REQUEST_COMPLETED {
                let error = terminal_failure(&submitted, &event);
                for event in failed(&mut seq, &shape, &error) {
                    yield event;
                }
                return;
            }
            let outcome = Outcome::ended(&submitted.request_id, &event);
            let final_text = event.data.get("output").and_then(Value::as_str).unwrap_or("");
            if !opened && !final_text.is_empty() {
                // Output that came without deltas: opened and filled at once.
                opened = true;
                text = final_text.to_owned();
                for event in seq.message_opened(&item_id) {
                    yield event;
                }
                yield seq.text_delta(&item_id, &text);
            }
            let mut output_index = 0;
            if opened {
                for event in seq.message_done(&item_id, &text) {
                    yield event;
                }
                output_index = 1;
            }
            for call in client_calls(&event.data) {
                yield seq.output_item("response.output_item.added", output_index, |out| {
                    write_function_call_item(out, &call, "", "in_progress");
                });
                for event in seq.call_arguments(&call, output_index) {
                    yield event;
                }
                yield seq.output_item("response.output_item.done", output_index, |out| {
                    write_function_call_item(out, &call, &call.arguments, "completed");
                });
                output_index += 1;
            }
            let terminal = if outcome.status == "incomplete" { "response.incomplete" } else { "response.completed" };
            yield seq.response(terminal, &shape, &outcome);
            return;
        }
    };
    Ok(sse::response(body, keep_alive))
}

/// A stream's end on failure: an `error` event, then `response.failed` (its one terminal
/// event).
fn failed(seq: &mut Sequence, shape: &Shape, error: &ApiError) -> [Frame; 2] {
    let mut outcome = Outcome::in_progress("failed");
    outcome.error = json!({ "code": error.code.as_str(), "message": error.message });
    [
        seq.error(error),
        seq.response("response.failed", shape, &outcome),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body's input is read beside its other fields, those the struct names and those it
    /// gathers (`rest`), as a client's echo of an answer comes: the answer's text kept, its
    /// other members dropped.
    #[test]
    fn a_body_reads_its_input_beside_its_other_fields() {
        let body = br#"{"model":"coder","temperature":0.2,"input":[
            {"id":"msg_1","type":"message","role":"assistant","status":"completed",
             "content":[{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}]},
            {"role":"user","content":"again"}],"store":false,"include":["x"]}"#;
        let request: CreateResponseRequest = super::super::extract::from_json(body).unwrap();
        assert_eq!(request.model, "coder");
        assert_eq!(request.store, Some(false));
        assert_eq!(request.rest.get("temperature"), Some(&json!(0.2)));
        assert_eq!(request.rest.get("include"), Some(&json!(["x"])));
        let Member::List(items) = request.input else {
            panic!("a list of items")
        };
        let mut messages = Vec::new();
        append_items(&mut messages, items, "input").unwrap();
        assert_eq!(
            Value::Array(messages),
            json!([
                { "role": "assistant", "content": "Hi" },
                { "role": "user", "content": "again" },
            ])
        );
    }

    /// The `data:` lines of a stream made of `events`, parsed.
    async fn printed(events: Vec<Frame>) -> Vec<Value> {
        let body = sse::response(
            futures::stream::iter(events),
            std::time::Duration::from_secs(15),
        )
        .into_body();
        let bytes = axum::body::to_bytes(body, usize::MAX)
            .await
            .expect("the stream's body is read");
        String::from_utf8(bytes.to_vec())
            .expect("the stream is text")
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .map(|data| serde_json::from_str(data).expect("each event's data is JSON"))
            .collect()
    }

    /// The response object's text, parsed.
    fn object_value(shape: &Shape, outcome: &Outcome) -> Value {
        serde_json::from_str(&shape.object_text(outcome)).expect("the object is JSON")
    }

    fn a_shape() -> Shape {
        Shape {
            id: "resp_1".into(),
            created_at: 1_764_547_200,
            model: "coder".into(),
            instructions: Some("Be brief.".into()),
            metadata: json!({ "team": "a" }),
            tools: json!([{ "type": "function", "name": "f" }]),
            tool_choice: json!("auto"),
            parallel_tool_calls: json!(true),
            previous_response_id: Some("resp_0".into()),
            store: true,
        }
    }

    /// A shape stored with its request is read back whole, the fields left at their default
    /// (not stored) as well as the others, `null`s among them.
    #[test]
    fn a_stored_shape_is_read_back_whole() {
        let mut defaults = a_shape();
        defaults.instructions = None;
        defaults.metadata = json!({});
        defaults.tools = json!([]);
        defaults.previous_response_id = None;
        let mut changed = a_shape();
        changed.tool_choice = json!({ "type": "function", "name": "f" });
        changed.parallel_tool_calls = json!(false);
        changed.store = false;
        let mut nulls = a_shape();
        nulls.tool_choice = Value::Null;
        nulls.parallel_tool_calls = Value::Null;
        assert_eq!(
            defaults.to_stored(),
            json!({ "api": "responses", "createdAt": 1_764_547_200 }),
            "a field at its default is not stored"
        );
        assert!(
            a_shape().to_stored().get("instructions").is_none(),
            "instructions are the request's leading message, not stored twice"
        );
        for shape in [defaults, a_shape(), changed, nulls] {
            let mut request = crate::store::test_records::request("req_1", "ses_1");
            request.agent_id = shape.model.clone();
            request.input = json!({ "messages": [], "surface": shape.to_stored() });
            if let Some(instructions) = &shape.instructions {
                request.input[LEADING] = json!([{ "role": "system", "content": instructions }]);
            }
            assert_eq!(Shape::from_request(&request), Some(shape));
        }
        // A response stored with its instructions among the surface's fields (before they
        // left them), its transcript holding them first, reads them from there.
        let mut request = crate::store::test_records::request("req_1", "ses_1");
        request.agent_id = "coder".into();
        let mut surface = a_shape().to_stored();
        surface["instructions"] = json!("Be brief.");
        request.input = json!({ "messages": [{ "role": "system", "content": "Be brief." }],
            "surface": surface });
        assert_eq!(Shape::from_request(&request), Some(a_shape()));
    }

    /// The response object's text, byte for byte as serde's derived serializer wrote it
    /// before it was written by hand: every field, in the same order, escaped the same way.
    #[test]
    fn the_response_object_is_written_as_it_was_serialized() {
        let mut shape = a_shape();
        let mut ended = Outcome::in_progress("completed");
        ended.output = vec![
            OutputEntry::Message {
                id: "msg_1".into(),
                text: "hé \"x\"\n\u{1}".into(),
            },
            OutputEntry::FunctionCall(ClientCall {
                id: "call_7".into(),
                name: "look\\up".into(),
                arguments: "{\"q\":1}".into(),
            }),
        ];
        ended.usage = Some(usage(Some(
            &json!({ "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 4 }),
        )));
        assert_eq!(
            shape.object_text(&ended),
            concat!(
                r#"{"id":"resp_1","object":"response","created_at":1764547200,"status":"completed","#,
                r#""model":"coder","output":[{"content":[{"annotations":[],"logprobs":[],"#,
                r#""text":"hé \"x\"\n\u0001","type":"output_text"}],"id":"msg_1","role":"assistant","#,
                r#""status":"completed","type":"message"},{"arguments":"{\"q\":1}","#,
                r#""call_id":"call_7","id":"fc_7","name":"look\\up","status":"completed","#,
                r#""type":"function_call"}],"usage":{"input_tokens":3,"#,
                r#""input_tokens_details":{"cached_tokens":0},"output_tokens":2,"#,
                r#""output_tokens_details":{"reasoning_tokens":0},"total_tokens":5},"#,
                r#""error":null,"incomplete_details":null,"instructions":"Be brief.","#,
                r#""metadata":{"team":"a"},"parallel_tool_calls":true,"tool_choice":"auto","#,
                r#""tools":[{"name":"f","type":"function"}],"previous_response_id":"resp_0","#,
                r#""store":true,"text":{"format":{"type":"text"}},"truncation":"disabled","#,
                r#""temperature":null,"top_p":null,"max_output_tokens":null,"reasoning":null,"#,
                r#""user":null}"#
            )
        );
        shape.instructions = None;
        shape.previous_response_id = None;
        shape.store = false;
        shape.created_at = -1;
        let mut failed = Outcome::in_progress("failed");
        failed.error = json!({ "code": "upstream_error", "message": "down" });
        failed.incomplete = json!({ "reason": "max_output_tokens" });
        let text = shape.object_text(&failed);
        for part in [
            r#""created_at":-1,"#,
            r#""output":[],"usage":null,"error":{"code":"upstream_error","message":"down"},"#,
            r#""incomplete_details":{"reason":"max_output_tokens"},"instructions":null,"#,
            r#""previous_response_id":null,"store":false,"#,
        ] {
            assert!(text.contains(part), "{part} in {text}");
        }
    }

    /// Each event written from its fields is the JSON the `Value` it replaced was (those
    /// `Value`s are written out below as the stream built them before), numbered in turn.
    #[tokio::test]
    async fn each_event_is_the_json_its_value_was() {
        let shape = a_shape();
        let started = Outcome::in_progress("in_progress");
        let mut ended = Outcome::in_progress("completed");
        let text = "hé \"x\"\n";
        ended.output = vec![OutputEntry::Message {
            id: "msg_1".into(),
            text: text.into(),
        }];
        let mut seq = Sequence(0);
        let mut events = Vec::from(seq.started(&shape));
        events.extend(seq.message_opened("msg_1"));
        events.push(seq.text_delta("msg_1", text));
        events.extend(seq.message_done("msg_1", text));
        let call = ClientCall {
            id: "call_1".into(),
            name: "f\"".into(),
            arguments: "{\"a\":\"é\"}".into(),
        };
        events.extend(seq.call_arguments(&call, 1));
        events.push(seq.response("response.completed", &shape, &ended));
        let refused =
            ApiError::new(ErrorCode::InvalidRequest, "the \"store\" failed").param("input");
        events.extend(failed(&mut seq, &shape, &refused));

        let item = |status: &str, content: Value| {
            json!({ "type": "message", "id": "msg_1", "role": "assistant", "status": status,
                    "content": content })
        };
        let done_item = item(
            "completed",
            json!([{ "type": "output_text", "text": text, "annotations": [], "logprobs": [] }]),
        );
        let mut entry = String::new();
        ended.output[0].write(&mut entry);
        assert_eq!(serde_json::from_str::<Value>(&entry).unwrap(), done_item);
        // A client's call and the usage, as the `Value`s written before them.
        let call = ClientCall {
            id: "call_7".into(),
            name: "lookup".into(),
            arguments: "{\"q\":1}".into(),
        };
        let mut typed = Outcome::in_progress("completed");
        typed.output = vec![OutputEntry::FunctionCall(call)];
        typed.usage = Some(usage(Some(
            &json!({ "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 4 }),
        )));
        let typed = object_value(&shape, &typed);
        assert_eq!(
            typed["output"],
            json!([{ "type": "function_call", "id": "fc_7", "call_id": "call_7",
                     "name": "lookup", "arguments": "{\"q\":1}", "status": "completed" }])
        );
        assert_eq!(
            typed["usage"],
            json!({ "input_tokens": 3, "input_tokens_details": { "cached_tokens": 0 },
                    "output_tokens": 2, "output_tokens_details": { "reasoning_tokens": 0 },
                    "total_tokens": 5 })
        );
        assert_eq!(object_value(&shape, &started)["usage"], Value::Null);
        let mut failed_outcome = Outcome::in_progress("failed");
        failed_outcome.error = json!({ "code": refused.code.as_str(), "message": refused.message });
        let response = |outcome: &Outcome| object_value(&shape, outcome);
        let expected = [
            json!({ "response": response(&started) }),
            json!({ "response": response(&started) }),
            json!({ "output_index": 0, "item": item("in_progress", json!([])) }),
            json!({ "item_id": "msg_1", "output_index": 0, "content_index": 0,
                    "part": { "type": "output_text", "text": "", "annotations": [] } }),
            json!({ "item_id": "msg_1", "output_index": 0, "content_index": 0,
                    "delta": text, "logprobs": [] }),
            json!({ "item_id": "msg_1", "output_index": 0, "content_index": 0, "text": text,
                    "logprobs": [] }),
            json!({ "item_id": "msg_1", "output_index": 0, "content_index": 0,
                    "part": { "type": "output_text", "text": text, "annotations": [] } }),
            json!({ "output_index": 0, "item": done_item }),
            json!({ "item_id": "fc_1", "output_index": 1, "delta": "{\"a\":\"é\"}" }),
            json!({ "item_id": "fc_1", "output_index": 1, "name": "f\"",
                    "arguments": "{\"a\":\"é\"}" }),
            json!({ "response": response(&ended) }),
            json!({ "code": refused.code.as_str(), "message": "the \"store\" failed",
                    "param": "input" }),
            json!({ "response": response(&failed_outcome) }),
        ];
        let types = [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.completed",
            "error",
            "response.failed",
        ];
        let expected: Vec<Value> = expected
            .into_iter()
            .zip(types)
            .enumerate()
            .map(|(number, (mut fields, kind))| {
                fields["type"] = json!(kind);
                fields["sequence_number"] = json!(number);
                fields
            })
            .collect();
        assert_eq!(printed(events).await, expected);
    }
}
