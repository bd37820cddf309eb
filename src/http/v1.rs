//! The OpenAI-compatible surface: agents are models. `/v1` is stateless like OpenAI — the
//! transcript is exactly what the client sends; `x-stable-harness-session-id` (or `user`) only
//! groups requests into a session. The default stream holds nothing but standard
//! `chat.completion.chunk` events and `[DONE]`, so every OpenAI SDK parses it.

use axum::Extension;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::AppState;
use super::auth::Caller;
use super::extract::{ApiPath, V1Json};
use super::messages::validate_messages_after;
use super::sse::{self, Frame};
use super::views::{Json, JsonText, run_failure, store_error};
use crate::adapters::ClientCall;
use crate::error::{ApiError, ErrorCode};
use crate::gateway::client::{self, ClientFunction};
use crate::json;
use crate::runtime::events::{
    ADAPTER_EVENT, APPROVAL_REQUESTED, APPROVAL_RESOLVED, PHASE_HANDOFF, PHASE_TOOL_RESULT,
    PHASE_TOOL_START, PROGRESS_NARRATION, REQUEST_COMPLETED, TOOL_DENIED, TOOL_DIRECT_COMPLETED,
    TOOL_DIRECT_STARTED, is_terminal, output_delta_text,
};
use crate::runtime::{
    ApprovalWatch, ClientTurn, Following, History, NewRequest, Protocol, SentTranscript, Submitted,
    Watched, names_client_calls,
};
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
    /// The conversation's messages, in order.
    // Kept as sent until parsed: a turn carrying on the one before parses only what it adds
    // (`chat_messages`).
    #[schema(value_type = Vec<Object>)]
    pub messages: Box<serde_json::value::RawValue>,
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

pub(super) fn v1_error(code: ErrorCode, message: impl Into<String>) -> ApiError {
    ApiError::new(code, message).on_openai_surface()
}

#[utoipa::path(get, path = "/v1/models", tag = "v1", security(("client_key" = [])),
    responses((status = 200, description = "Every agent, as a model")))]
pub async fn list_models(State(state): State<AppState>) -> Json<Value> {
    let workspace = state.runtime.workspace();
    let agents = workspace.agents.keys();
    let workflows = workspace
        .workflows
        .values()
        .filter(|workflow| workflow.expose_as_model)
        .map(|workflow| &workflow.name);
    let data: Vec<Value> = agents
        .chain(workflows)
        .map(|name| model_json(&state, name))
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
    let name = match find_model(&workspace, &id)? {
        Model::Agent(agent) => &agent.name,
        Model::Workflow(workflow) => &workflow.name,
    };
    Ok(Json(model_json(&state, name)))
}

fn model_json(state: &AppState, name: &str) -> Value {
    json!({ "id": name, "object": "model", "created": state.runtime_started_unix(), "owned_by": "stable-harness" })
}

/// What a `/v1` model is: an agent, or a workflow exposed as a model.
pub(super) enum Model<'a> {
    Agent(&'a AgentConfig),
    Workflow(&'a crate::workspace::WorkflowConfig),
}

pub(super) fn find_model<'a>(
    workspace: &'a CompiledWorkspace,
    id: &str,
) -> Result<Model<'a>, ApiError> {
    match find_agent(workspace, id) {
        Ok(agent) => Ok(Model::Agent(agent)),
        Err(error) => workspace
            .workflows
            .get(id)
            .filter(|workflow| workflow.expose_as_model)
            .map(Model::Workflow)
            .ok_or(error),
    }
}

pub(super) fn find_agent<'a>(
    workspace: &'a CompiledWorkspace,
    id: &str,
) -> Result<&'a AgentConfig, ApiError> {
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
                "clientTools": match agent.client_tools {
                    Some(risk) => json!({ "enabled": true, "risk": risk }),
                    None => json!({ "enabled": false }),
                },
                "streaming": model.is_none_or(|m| m.capabilities.streaming),
                "model": model.map(|m| json!({ "id": m.id, "upstreamModel": m.upstream_model, "capabilities": m.capabilities })),
            })
        })
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

/// Checks what OpenAI would reject in the legacy function-calling fields, naming the field
/// (`param`) at fault; `tools` are client tools (see `client_functions`). The messages are
/// checked as they are parsed ([`chat_messages`]), then `n` ([`validate_n`]).
fn validate_functions(rest: &Map<String, Value>) -> Result<(), ApiError> {
    for field in ["functions", "function_call"] {
        if rest.get(field).is_some_and(|v| !v.is_null()) {
            return Err(v1_error(
                ErrorCode::ToolsNotSupported,
                format!("`{field}` cannot be supplied by the client: an agent's tools come from its workspace inventory"),
            )
            .param(field));
        }
    }
    Ok(())
}

/// Only one choice is made.
fn validate_n(n: Option<u32>) -> Result<(), ApiError> {
    if n.is_some_and(|n| n != 1) {
        return Err(v1_error(ErrorCode::InvalidRequest, "only n = 1 is supported").param("n"));
    }
    Ok(())
}

/// The request's metadata: the client's, with `user` (which fills `{user}` memory
/// namespaces) set from the `user` field when it is given.
pub(super) fn v1_metadata(metadata: Option<Map<String, Value>>, user: Option<&str>) -> Value {
    let mut metadata = metadata.unwrap_or_default();
    if let Some(user) = user {
        metadata.insert("user".to_owned(), Value::String(user.to_owned()));
    }
    Value::Object(metadata)
}

/// A session id from the grouping header or `user`; anything else is a new session. A `user`
/// names a session of the calling key's own (`user:<identity>:<user>`): another key's
/// `user` of the same name is another session.
pub(super) fn session_id(
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
    validate_functions(&request.rest)?;
    // A turn whose session header is refused carries nothing on; the refusal is answered
    // after the messages' own errors, as it always was.
    let session_id = session_id(&headers, request.user.as_deref(), &caller.identity);
    let (mut messages, mut sent) = chat_messages(
        &state,
        &caller.identity,
        &request.model,
        session_id.is_ok(),
        request.messages,
    )?;
    validate_n(request.n)?;
    // Chat tools nest the function: `{type: "function", function: {name, ...}}`.
    let tools = client_functions(request.rest.get("tools"), Some("function"))?;
    let session_id = session_id?;
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
    let stream = request.stream.unwrap_or(false);
    let include_usage = request
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let named_events = wants_named_events(&headers);
    // In a session, the transcript's leading system and developer messages are the call's own
    // (as a Responses call's `instructions` are), never in the session: a client that writes
    // its instructions anew each turn (the time, what it retrieved) still continues the
    // session's path.
    let leading = match session_id {
        Some(_) => leading_messages(&mut messages, &mut sent),
        None => Vec::new(),
    };
    let Followed {
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
            sent,
            chain: None,
            chainable: false,
            tools,
            options,
            metadata: v1_metadata(request.metadata, request.user.as_deref()),
            session_id,
            surface: None,
            stream,
        },
    )
    .await?;
    let completion = Completion {
        id: format!("chatcmpl-{}", submitted.request_id),
        created: chrono::Utc::now().timestamp(),
        model: request.model,
    };
    let answered = if stream {
        stream_response(
            events,
            completion,
            submitted.clone(),
            StreamOptionsOf {
                include_usage,
                named_events,
                final_only,
            },
        )
        .await
    } else {
        complete_response(events, completion, &submitted).await
    };
    // Errors after the submit name the request too: its run may go on (approval_pending).
    Ok(with_request_headers(
        answered.unwrap_or_else(IntoResponse::into_response),
        &submitted,
    ))
}

/// A chat request's messages, parsed and checked. When the turn `carries` (with no session
/// or in one: not under a refused session header), the turn before of the same key and
/// agent is carried on when the messages as sent start with its own, byte for byte: only
/// those after them are parsed, and the first returned are those (`runtime::carried_digests`;
/// docs/profiling.md, the eighty-seventh and eighty-eighth passes). The messages as sent are
/// kept for the next turn, unless the transcript names calls handed to the client: the
/// runtime completes those with the calls' stored turns, so what the run is given is not
/// what was sent. A mismatch anywhere only parses the whole, as every turn did before.
fn chat_messages(
    state: &AppState,
    owner: &str,
    agent: &str,
    carries: bool,
    sent: Box<serde_json::value::RawValue>,
) -> Result<(Vec<Value>, Option<SentTranscript>), ApiError> {
    // Kept as it is, never copied: a long transcript is megabytes.
    let sent: Box<str> = sent.into();
    let carried = carries
        .then(|| state.runtime.take_carried_transcript(owner, agent, &sent))
        .flatten()
        .and_then(|(end, carried)| Some((parsed_after(&sent, end)?, carried)));
    let (messages, carried) = match carried {
        Some((messages, carried)) => (messages, Some(carried)),
        None => {
            let messages: Vec<Value> = super::extract::from_json(sent.as_bytes())
                .map_err(|error| error.param("messages").on_openai_surface())?;
            if messages.is_empty() {
                return Err(v1_error(
                    ErrorCode::InvalidRequest,
                    "`messages` must contain at least one message",
                )
                .param("messages"));
            }
            (messages, None)
        }
    };
    if carries {
        crate::metrics::chat_transcript(if carried.is_some() {
            "carried"
        } else {
            "parsed"
        });
    }
    let before = carried.as_ref().map_or(0, |carried| carried.history.len());
    validate_messages_after(&messages, "messages", before).map_err(ApiError::on_openai_surface)?;
    let mut sent = SentTranscript { sent, carried };
    if !carries || names_client_calls(&messages) {
        return Ok((sent.take_back(messages), None));
    }
    Ok((messages, Some(sent)))
}

/// A session turn's leading system and developer messages (the call's own, never in the
/// session): moved out of `messages`, or copied from the carried messages that hold them
/// (those stay whole, as sent, for the next turn). Carried messages that are all leading
/// ones are taken back first: where the leading ones end is among `messages` then.
fn leading_messages(messages: &mut Vec<Value>, sent: &mut Option<SentTranscript>) -> Vec<Value> {
    if let Some(sent) = sent.as_mut()
        && let Some(carried) = &sent.carried
    {
        let count = leading_instructions(&carried.history);
        if count < carried.history.len() {
            return carried.history[..count].to_vec();
        }
        *messages = sent.take_back(std::mem::take(messages));
    }
    messages.drain(..leading_instructions(messages)).collect()
}

/// The messages of the JSON array `sent` after its items up to `end` (a `,` follows them),
/// parsed.
fn parsed_after(sent: &str, end: usize) -> Option<Vec<Value>> {
    let rest = sent.get(end..)?.trim_start().strip_prefix(',')?;
    let mut array = String::with_capacity(rest.len() + 1);
    array.push('[');
    array.push_str(rest);
    serde_json::from_str(&array).ok()
}

/// How many of a transcript's first messages are system or developer messages.
fn leading_instructions(messages: &[Value]) -> usize {
    messages
        .iter()
        .take_while(|m| {
            matches!(
                m.get("role").and_then(Value::as_str),
                Some("system" | "developer")
            )
        })
        .count()
}

/// Whether the client asked for the named progress events (`x-stable-harness-events: true`).
pub(super) fn wants_named_events(headers: &HeaderMap) -> bool {
    headers
        .get(EVENTS_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

/// Names the request and its session on a `/v1` answer.
pub(super) fn with_request_headers(mut response: Response, submitted: &Submitted) -> Response {
    let headers = response.headers_mut();
    for (name, value) in [
        (REQUEST_ID_HEADER, &submitted.request_id),
        (SESSION_ID_HEADER, &submitted.session_id),
    ] {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    }
    response
}

/// The function tools of a client's `tools` list, each defined under the key `nested` of its
/// entry, or by the entry itself; other tool types are accepted and not offered to the model.
pub(super) fn client_functions(
    tools: Option<&Value>,
    nested: Option<&str>,
) -> Result<Vec<ClientFunction>, ApiError> {
    let tools = match tools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(tools)) => tools,
        Some(_) => {
            return Err(
                v1_error(ErrorCode::InvalidParameter, "`tools` must be an array").param("tools"),
            );
        }
    };
    tools
        .iter()
        .enumerate()
        .filter(|(_, tool)| tool.get("type").and_then(Value::as_str) == Some("function"))
        .map(|(index, tool)| {
            let definition = match nested {
                Some(key) => tool.get(key).unwrap_or(&Value::Null),
                None => tool,
            };
            client_function(index, definition)
        })
        .collect()
}

/// One function tool (`{name, description?, parameters?}`) at `tools[index]`.
fn client_function(index: usize, function: &Value) -> Result<ClientFunction, ApiError> {
    let Some(name) = function.get("name").and_then(Value::as_str) else {
        return Err(v1_error(
            ErrorCode::InvalidParameter,
            format!("tools[{index}] needs a `name`"),
        )
        .param(format!("tools[{index}]")));
    };
    Ok(ClientFunction {
        index,
        name: name.to_owned(),
        description: function
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_owned),
        parameters: function.get("parameters").filter(|p| !p.is_null()).cloned(),
    })
}

/// What both `/v1` surfaces submit: the transcript in Chat Completions shape, and what came
/// with it.
pub(super) struct V1Submission {
    pub agent: String,
    /// Messages before any history (a Responses turn's instructions).
    pub leading: Vec<Value>,
    /// The turn's own messages, after the chain's stored transcript if it continues one
    /// (after those `sent` carries on, if any).
    pub messages: Vec<Value>,
    /// A chat turn's messages as sent, and what it carries on ([`chat_messages`]).
    pub sent: Option<SentTranscript>,
    /// The stored chain a Responses turn continues, if any.
    pub chain: Option<Chain>,
    /// A later turn may continue from this one (a stored response).
    pub chainable: bool,
    pub tools: Vec<ClientFunction>,
    pub options: Map<String, Value>,
    pub metadata: Value,
    pub session_id: Option<String>,
    pub surface: Option<Value>,
    /// Answered as an SSE stream: the request's events are stored as they come.
    pub stream: bool,
}

/// How a Responses turn continues a stored chain.
pub(super) enum Chain {
    /// From the session's path through `through`, where the previous response's transcript
    /// ends: the turn's messages start with the previous answer, if it completed, and
    /// `answer_message`, when known, is the session message holding that answer.
    /// `leading_held_by`: the request holding the turn's leading messages (its
    /// instructions) when they are the previous turn's ([`NewRequest::leading_held_by`]).
    Continued {
        through: String,
        answer_message: Option<String>,
        leading_held_by: Option<crate::runtime::HeldLeading>,
    },
    /// From a copy of the whole chain at the start of the turn's messages.
    Copied,
}

/// A submitted `/v1` call, followed.
pub(super) struct Followed {
    pub submitted: Submitted,
    pub events: ApprovalWatch,
    /// A workflow's answer is its last agent node's output, sent whole at the end: the text
    /// its earlier nodes stream is not part of it.
    pub final_only: bool,
}

/// Checks the client's tools against the agent, completes the transcript with the stored
/// turns of calls handed to the client, submits, and follows the request's events (a pending
/// approval is watched for `protocols.openai.approvalWait`).
pub(super) async fn submit(
    state: &AppState,
    caller: &Caller,
    submission: V1Submission,
) -> Result<Followed, ApiError> {
    let workspace = state.runtime.workspace();
    let (client_risk, workflow) = match find_model(&workspace, &submission.agent)? {
        Model::Agent(agent) => (agent.client_tools, None),
        Model::Workflow(workflow) => (None, Some(workflow.name.clone())),
    };
    if !submission.tools.is_empty() {
        let Some(risk) = client_risk else {
            return Err(v1_error(
                ErrorCode::ToolsNotSupported,
                format!(
                    "model `{}` does not take tools from the client (no `clientTools` on it); its tools come from the workspace inventory",
                    submission.agent
                ),
            )
            .param("tools"));
        };
        client::compile(&submission.tools, risk).map_err(|error| {
            v1_error(ErrorCode::InvalidParameter, error.to_string())
                .param(format!("tools[{}]", error.index))
        })?;
    }
    let answer = match &submission.chain {
        Some(Chain::Continued {
            answer_message: Some(message_id),
            ..
        }) => submission
            .messages
            .first()
            .map(|answer| (answer.clone(), message_id.clone())),
        _ => None,
    };
    let (mut messages, results) = state
        .runtime
        .continue_client_turns(&caller.identity, submission.messages)
        .await
        .map_err(|error| ApiError::from(error).on_openai_surface())?;
    // Where the turn continues from, and whether all of it is new to the session: a chained
    // turn's whole own transcript is (a later turn continues from it); else only what
    // follows the last assistant message (a transcript sent whole into a session is new to it
    // after where it matches the session's path: the runtime decides).
    let mut leading_held_by = None;
    let (history, whole) = match submission.chain {
        // The previous answer, as stored, is where the turn continues from, unless the
        // stored turns of its calls stand in for it.
        Some(Chain::Continued {
            through,
            leading_held_by: held_by,
            ..
        }) => {
            leading_held_by = held_by;
            match answer {
                Some((answer, message_id)) if messages.first() == Some(&answer) => {
                    messages.remove(0);
                    (History::Through(message_id), true)
                }
                _ => (History::Through(through), true),
            }
        }
        Some(Chain::Copied) => (History::Stateless, submission.chainable),
        None if submission.session_id.is_some() => (History::SessionPrefix, false),
        None => (History::Stateless, false),
    };
    let new_messages = if whole {
        messages.len()
    } else {
        // The carried messages come before the turn's own.
        let carried = submission
            .sent
            .as_ref()
            .and_then(|sent| sent.carried.as_ref());
        let carried = carried.map_or(&[][..], |carried| &carried.history[..]);
        carried
            .iter()
            .chain(&messages)
            .rev()
            .take_while(|m| m.get("role").and_then(Value::as_str) != Some("assistant"))
            .count()
    };
    let workflow_requested = workflow.is_some();
    let (submitted, events) = state
        .runtime
        .submit_and_follow(
            NewRequest {
                agent_id: workflow.is_none().then_some(submission.agent),
                session_id: submission.session_id,
                owner: caller.identity.clone(),
                history,
                leading: submission.leading,
                leading_held_by,
                chainable: submission.chainable,
                messages,
                sent: submission.sent,
                new_messages,
                options: submission.options,
                metadata: submission.metadata,
                protocol: Protocol::V1,
                durable_before_return: false,
                client: ClientTurn {
                    tools: submission.tools,
                    results,
                },
                surface: submission.surface,
                workflow,
            },
            if submission.stream {
                Following::Live
            } else {
                Following::ToEnd
            },
        )
        .await
        .map_err(|error| ApiError::from(error).on_openai_surface())?;
    let approval_wait = workspace.runtime.openai.approval_wait;
    Ok(Followed {
        submitted,
        events: ApprovalWatch::new(events, approval_wait),
        final_only: workflow_requested,
    })
}

struct Completion {
    id: String,
    created: i64,
    model: String,
}

impl Completion {
    /// What a `chat.completion` or one of a stream's chunks writes after its choices:
    /// `created` to `usage` (left out when `None`) and the closing brace. A stream's chunks
    /// all end alike, so a stream writes its tail once.
    fn tail(&self, object: &str, usage: Option<&Value>) -> String {
        let mut tail = String::with_capacity(self.id.len() + self.model.len() + 112);
        tail.push_str("\"created\":");
        tail.push_str(itoa::Buffer::new().format(self.created));
        tail.push_str(",\"id\":");
        json::write_str(&mut tail, &self.id);
        tail.push_str(",\"model\":");
        json::write_str(&mut tail, &self.model);
        tail.push_str(",\"object\":");
        json::write_str(&mut tail, object);
        tail.push_str(",\"system_fingerprint\":null");
        if let Some(usage) = usage {
            tail.push_str(",\"usage\":");
            json::write(&mut tail, usage);
        }
        tail.push('}');
        tail
    }

    /// The tail of each chunk of a stream: `usage: null` when the client asked for usage
    /// (it comes in a chunk of its own at the end).
    fn chunk_tail(&self, include_usage: bool) -> String {
        self.tail(
            "chat.completion.chunk",
            include_usage.then_some(&Value::Null),
        )
    }
}

/// A `chat.completion`, or one `chat.completion.chunk` of a stream, written straight into its
/// text: its choices (none, or the one `choice` writes), then `tail` (from
/// [`Completion::tail`]). No serializer between: the parts that never change are one copy
/// each (docs/profiling.md, the forty-eighth pass). The fields are in the order a `Value`'s
/// map prints them, as they always were.
fn write_completion(out: &mut String, tail: &str, choice: impl FnOnce(&mut String)) {
    out.push_str("{\"choices\":[");
    choice(out);
    out.push_str("],");
    out.push_str(tail);
}

/// A chunk: its one choice, whose delta `delta` writes, with `finish_reason`.
fn write_chunk(
    out: &mut String,
    tail: &str,
    finish_reason: Option<&str>,
    delta: impl FnOnce(&mut String),
) {
    write_completion(out, tail, |out| {
        out.push_str("{\"delta\":");
        delta(out);
        out.push_str(",\"finish_reason\":");
        json::write_str_or_null(out, finish_reason);
        out.push_str(",\"index\":0,\"logprobs\":null}");
    })
}

/// The chunk of a delta of text (`role` only in the first): one per delta of a stream.
fn write_text_chunk(out: &mut String, tail: &str, content: &str, role: Option<&str>) {
    write_chunk(out, tail, None, |out| {
        out.push_str("{\"content\":");
        json::write_str(out, content);
        if let Some(role) = role {
            out.push_str(",\"role\":");
            json::write_str(out, role);
        }
        out.push('}');
    })
}

/// The `chat.completion` of a request answered whole: its one choice, the assistant's
/// `content` (text, or `null`) with the calls handed to the client, and `usage`.
fn completion_answer(
    completion: &Completion,
    finish_reason: &str,
    content: &Value,
    calls: &[ClientCall],
    usage: &Value,
) -> String {
    let tail = completion.tail("chat.completion", Some(usage));
    let mut answer = String::with_capacity(tail.len() + 160);
    write_completion(&mut answer, &tail, |out| {
        out.push_str("{\"finish_reason\":");
        json::write_str(out, finish_reason);
        out.push_str(",\"index\":0,\"logprobs\":null,\"message\":{\"content\":");
        json::write(out, content);
        out.push_str(",\"refusal\":null,\"role\":\"assistant\"");
        if !calls.is_empty() {
            out.push_str(",\"tool_calls\":");
            json::write_array(out, calls, |out, call| {
                json::write(out, &call.to_chat_json())
            });
        }
        out.push_str("}}");
    });
    answer
}

/// The calls a completed request handed to the client (`clientToolCalls`).
pub(super) fn client_calls(data: &Value) -> Vec<ClientCall> {
    data.get("clientToolCalls")
        .and_then(|calls| serde_json::from_value(calls.clone()).ok())
        .unwrap_or_default()
}

/// The finish reason of a completed request (`stop` when the upstream gave none).
pub(super) fn finish_reason(data: &Value) -> &str {
    data.get("finishReason")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty())
        .unwrap_or("stop")
}

pub(super) fn delta_text(event: &EventRecord) -> Option<&str> {
    (event.event_type == ADAPTER_EVENT)
        .then(|| output_delta_text(&event.data))
        .flatten()
}

/// The API error a terminal event that is not `completed` stands for.
pub(super) fn terminal_failure(submitted: &Submitted, event: &EventRecord) -> ApiError {
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
pub(super) fn approval_pending(submitted: &Submitted, approval_id: &str) -> ApiError {
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
pub(super) fn is_tool_progress(event: &EventRecord) -> bool {
    match event.event_type.as_str() {
        TOOL_DIRECT_STARTED
        | TOOL_DIRECT_COMPLETED
        | TOOL_DENIED
        | APPROVAL_REQUESTED
        | APPROVAL_RESOLVED => true,
        ADAPTER_EVENT => matches!(
            crate::json::str_at(&event.data, &["event", "phase"]),
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
    let event = completed_event(&mut events, submitted).await?;
    let data = &event.data;
    let calls = client_calls(data);
    let output = data.get("output").unwrap_or(&Value::Null);
    // With calls handed to the client, no text is `null`, as OpenAI sends it.
    let content = if !calls.is_empty() && output.as_str() == Some("") {
        &Value::Null
    } else {
        output
    };
    let usage = data.get("usage").unwrap_or(&Value::Null);
    Ok(JsonText(completion_answer(
        &completion,
        finish_reason(data),
        content,
        &calls,
        usage,
    ))
    .into_response())
}

/// The end a non-streaming answer renders: `runtime.request.completed`; any other end (a
/// failed or cancelled run, an approval still pending after `approvalWait`, a store failure)
/// is the error the answer is.
pub(super) async fn completed_event(
    events: &mut ApprovalWatch,
    submitted: &Submitted,
) -> Result<std::sync::Arc<EventRecord>, ApiError> {
    loop {
        let event = match events.next().await {
            Watched::Event(event) => event,
            Watched::StillPending(approval) => return Err(approval_pending(submitted, &approval)),
            Watched::Failed(error) => return Err(store_error(&error)),
            Watched::Ended => {
                return Err(ApiError::internal(
                    "the event stream ended before the request did",
                ));
            }
        };
        if !is_terminal(&event.event_type) {
            continue;
        }
        if event.event_type != REQUEST_COMPLETED {
            return Err(terminal_failure(submitted, &event));
        }
        return Ok(event);
    }
}

/// The next event a stream renders: those read while its status line was held, then live
/// ones. `None`: the request's events ended; `Some(Err)`: the stream ends with that error (an
/// approval still pending after `approvalWait`, or a store failure).
pub(super) async fn next_streamed(
    held: &mut std::vec::IntoIter<std::sync::Arc<EventRecord>>,
    events: &mut ApprovalWatch,
    submitted: &Submitted,
) -> Option<Result<std::sync::Arc<EventRecord>, ApiError>> {
    if let Some(event) = held.next() {
        return Some(Ok(event));
    }
    match events.next().await {
        Watched::Event(event) => Some(Ok(event)),
        Watched::Ended => None,
        Watched::StillPending(approval) => Some(Err(approval_pending(submitted, &approval))),
        Watched::Failed(error) => {
            tracing::error!(%error, "event stream failed");
            Some(Err(store_error(&error).on_openai_surface()))
        }
    }
}

/// The named progress event a client that opted in (`x-stable-harness-events: true`)
/// receives for `event`, if it is one.
pub(super) fn progress_event(event: &EventRecord) -> Option<Frame> {
    if is_tool_progress(event) {
        let mut data = event.data.clone();
        data["type"] = Value::String(event.event_type.clone());
        Some(Frame::json(Some("stable_harness.tool.progress"), &data))
    } else if event.event_type == PROGRESS_NARRATION {
        Some(Frame::json(
            Some("stable_harness.progress.narration"),
            &event.data,
        ))
    } else {
        None
    }
}

/// Holds a stream's status line until the run produced text, ended or waits on an approval,
/// so that a run failing at once is answered with a proper error status instead of a broken
/// stream (and a pending approval gets keep-alives). Returns the events read meanwhile.
pub(super) async fn hold_until_started(
    events: &mut ApprovalWatch,
    submitted: &Submitted,
    final_only: bool,
) -> Result<Vec<std::sync::Arc<EventRecord>>, ApiError> {
    let mut held = Vec::new();
    loop {
        match events.next().await {
            Watched::Ended => {
                return Err(ApiError::internal(
                    "the event stream ended before the request did",
                ));
            }
            Watched::Failed(error) => return Err(store_error(&error)),
            Watched::StillPending(approval) => return Err(approval_pending(submitted, &approval)),
            Watched::Event(event) => {
                if is_terminal(&event.event_type) && event.event_type != REQUEST_COMPLETED {
                    return Err(terminal_failure(submitted, &event));
                }
                let start = (delta_text(&event).is_some() && !final_only)
                    || is_terminal(&event.event_type)
                    || event.event_type == APPROVAL_REQUESTED;
                held.push(event);
                if start {
                    return Ok(held);
                }
            }
        }
    }
}

/// SSE comments keep the connection alive while a call waits on an operator.
pub(super) fn keep_alive(events: &ApprovalWatch) -> std::time::Duration {
    (events.approval_wait() / 4).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(15),
    )
}

/// How a chat stream is rendered.
struct StreamOptionsOf {
    include_usage: bool,
    named_events: bool,
    /// Only the final output, as one delta at the end (a workflow model).
    final_only: bool,
}

async fn stream_response(
    mut events: ApprovalWatch,
    completion: Completion,
    submitted: Submitted,
    options: StreamOptionsOf,
) -> Result<Response, ApiError> {
    let StreamOptionsOf {
        include_usage,
        named_events,
        final_only,
    } = options;
    let held = hold_until_started(&mut events, &submitted, final_only).await?;
    let keep_alive = keep_alive(&events);
    let body = async_stream::stream! {
        let tail = completion.chunk_tail(include_usage);
        yield Frame::data(|out| write_text_chunk(out, &tail, "", Some("assistant")));
        let mut held = held.into_iter();
        loop {
            let event = match next_streamed(&mut held, &mut events, &submitted).await {
                Some(Ok(event)) => event,
                None => return,
                Some(Err(error)) => {
                    yield Frame::json(None, &error.body());
                    return;
                }
            };
            if named_events && let Some(progress) = progress_event(&event) {
                yield progress;
            }
            if let Some(text) = delta_text(&event) {
                if !final_only {
                    yield Frame::data(|out| write_text_chunk(out, &tail, text, None));
                }
            } else if event.event_type == REQUEST_COMPLETED {
                if final_only && let Some(text) = event.data.get("output").and_then(Value::as_str).filter(|t| !t.is_empty()) {
                    yield Frame::data(|out| write_text_chunk(out, &tail, text, None));
                }
                // Calls handed to the client: one `index` each, its name first, then its
                // arguments as a delta, as OpenAI streams them.
                for (index, call) in client_calls(&event.data).iter().enumerate() {
                    let opened = json!({ "tool_calls": [{ "index": index, "id": call.id, "type": "function", "function": { "name": call.name, "arguments": "" } }] });
                    yield Frame::data(|out| write_chunk(out, &tail, None, |out| json::write(out, &opened)));
                    let arguments = json!({ "tool_calls": [{ "index": index, "function": { "arguments": call.arguments } }] });
                    yield Frame::data(|out| write_chunk(out, &tail, None, |out| json::write(out, &arguments)));
                }
                let reason = finish_reason(&event.data);
                yield Frame::data(|out| write_chunk(out, &tail, Some(reason), |out| out.push_str("{}")));
                if include_usage {
                    let usage = completion.tail("chat.completion.chunk", Some(event.data.get("usage").unwrap_or(&Value::Null)));
                    yield Frame::data(|out| write_completion(out, &usage, |_| {}));
                }
                yield Frame::data(|out| out.push_str("[DONE]"));
                return;
            } else if is_terminal(&event.event_type) {
                // Failed after text was sent: an error event, then the stream closes.
                yield Frame::json(None, &terminal_failure(&submitted, &event).body());
                return;
            }
        }
    };
    Ok(sse::response(body, keep_alive))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `write` writes.
    fn text(write: impl FnOnce(&mut String)) -> String {
        let mut out = String::new();
        write(&mut out);
        out
    }

    /// The typed answer and chunks print exactly what the `Value`s they replaced printed
    /// (a `Value`'s map prints its keys in order): the same bytes reach clients.
    #[test]
    fn typed_answers_print_the_bytes_the_values_printed() {
        let completion = Completion {
            id: "chatcmpl-req_1".to_owned(),
            created: 1_800_000_000,
            model: "assistant".to_owned(),
        };
        let usage = json!({ "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5 });
        let chunk = |delta: Value, reason: Option<&str>| {
            json!({ "id": "chatcmpl-req_1", "object": "chat.completion.chunk", "created": 1_800_000_000,
                    "model": "assistant", "system_fingerprint": null, "usage": null,
                    "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": reason }] })
            .to_string()
        };
        let tail = completion.chunk_tail(true);
        assert_eq!(
            text(|out| write_text_chunk(out, &tail, "hé \"x\"\n\u{1}", None)),
            chunk(json!({ "content": "hé \"x\"\n\u{1}" }), None)
        );
        assert_eq!(
            text(|out| write_text_chunk(out, &tail, "", Some("assistant"))),
            chunk(json!({ "role": "assistant", "content": "" }), None)
        );
        assert_eq!(
            text(|out| write_chunk(out, &tail, Some("stop"), |out| out.push_str("{}"))),
            chunk(json!({}), Some("stop"))
        );
        let opened = json!({ "tool_calls": [{ "index": 0, "id": "call_1", "type": "function",
                                              "function": { "name": "f", "arguments": "" } }] });
        assert_eq!(
            text(|out| write_chunk(out, &tail, None, |out| json::write(out, &opened))),
            chunk(opened.clone(), None)
        );
        // Without usage asked for, a chunk has no `usage`.
        let mut bare: Value =
            serde_json::from_str(&chunk(json!({ "content": "a" }), None)).expect("a chunk");
        bare.as_object_mut().map(|chunk| chunk.remove("usage"));
        assert_eq!(
            text(|out| write_text_chunk(out, &completion.chunk_tail(false), "a", None)),
            bare.to_string()
        );
        let mut usage_chunk: Value =
            serde_json::from_str(&chunk(json!({}), None)).expect("a chunk");
        usage_chunk["choices"] = json!([]);
        usage_chunk["usage"] = usage.clone();
        assert_eq!(
            text(|out| write_completion(
                out,
                &completion.tail("chat.completion.chunk", Some(&usage)),
                |_| {}
            )),
            usage_chunk.to_string()
        );
        let call = ClientCall {
            id: "call_1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        };
        let answer = |content: &Value, calls: &[ClientCall]| {
            completion_answer(&completion, "tool_calls", content, calls, &usage)
        };
        let expected = |message: Value| {
            json!({ "id": "chatcmpl-req_1", "object": "chat.completion", "created": 1_800_000_000,
                    "model": "assistant", "system_fingerprint": null, "usage": usage,
                    "choices": [{ "index": 0, "logprobs": null, "finish_reason": "tool_calls",
                                  "message": message }] })
            .to_string()
        };
        assert_eq!(
            answer(&Value::Null, std::slice::from_ref(&call)),
            expected(
                json!({ "role": "assistant", "content": null, "refusal": null,
                             "tool_calls": [call.to_chat_json()] })
            )
        );
        assert_eq!(
            answer(&json!("hé \"x\""), &[]),
            expected(json!({ "role": "assistant", "content": "hé \"x\"", "refusal": null }))
        );
    }
}
