//! The `openai` backend: the native loop over any OpenAI-compatible Chat Completions upstream.
//!
//! The adapter owns recovery: every attempt is counted against `recovery.maxAttempts`, only
//! error kinds in `retryOn` are retried (honouring `retry-after`), each retry is announced with
//! `runtime.retry.scheduled`, and after the last attempt the model's `fallbacks` are tried in
//! order. A stream that already delivered text is never retried: the client would see it twice.
//! Transport is hyper's pooled client ([`crate::net::upstream`]) so that timeouts, status codes
//! and `retry-after` stay in our hands (no hidden client-side retries).
//!
//! The loop: the agent's tools are offered as functions (tool ids mapped reversibly onto
//! OpenAI's `[a-zA-Z0-9_-]` names); the calls of one turn run concurrently through the
//! gateway, their results go back to the model, until it answers or `maxIterations` round
//! trips have passed. The conversation is checkpointed after every step, and a run resumed
//! with unanswered calls in its transcript finishes them first (the gateway returns results
//! it already recorded instead of running a tool again).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use http::Uri;
use serde_json::{Map, Value, json};

use super::chat_wire;
use super::retry::{AttemptError, refused, retry_after, settle, transport_failure};
use super::sse::{Events, MAX_EVENT_BYTES, SseDecoder};
use super::{
    AdapterContext, AdapterError, ClientCall, FailureKind, Outcome, RuntimeAdapter, RuntimeOutput,
    ToolCall, ToolSpec, Usage, call_tools,
};
use crate::json;
use crate::net::CallFailure;
use crate::net::upstream::{CallError, UpstreamClient};
use crate::runtime::events::MODEL_CALL_COMPLETED;
use crate::text::excerpt;
use crate::workspace::{ModelConfig, UpstreamUrl};

/// Longest `retry-after` honoured; a larger one is capped (the backoff `max` still applies).
/// Largest non-streaming upstream body read.
const MAX_BODY_BYTES: usize = 16 << 20;
/// Most tool calls one streamed turn may hold: a fragment's `index` must be below it. The
/// index sizes a vector, so an upstream must not choose it freely.
pub const MAX_TOOL_CALLS_PER_TURN: usize = 128;
/// Longest tool-call id accepted (providers send a few dozen characters).
pub const MAX_TOOL_CALL_ID_BYTES: usize = 512;
/// Longest function name accepted (OpenAI allows 64; ours are at most 64 too).
pub const MAX_FUNCTION_NAME_BYTES: usize = 256;
/// Most bytes of arguments all the tool calls of one streamed turn may hold together: one
/// event's worth, so a turn never holds more than the decoder would.
pub const MAX_TURN_ARGUMENT_BYTES: usize = MAX_EVENT_BYTES;

#[derive(Debug, Clone)]
pub struct OpenAiAdapter {
    /// The client of calls made off the HTTP shards (a shard calls with its own).
    upstream: UpstreamClient,
    /// Each upstream's Chat Completions endpoint by base URL, parsed once (a URL parse was
    /// ~0.5% of a request's CPU). Keyed by the base as read, so one from the environment that
    /// changes is parsed again; emptied when it holds [`MAX_ENDPOINTS`].
    endpoints: Arc<std::sync::Mutex<HashMap<String, Uri>>>,
}

/// Most upstream endpoints kept parsed.
const MAX_ENDPOINTS: usize = 64;
/// Longest a streamed answer's text nobody is shown live is gathered before it is emitted:
/// the journal's own hold, so a poll of the run's events sees it at most that much later.
const GATHERED_FOR: Duration = Duration::from_millis(5);
/// Most text gathered into one delta: the journal's merged deltas stop at this size too.
const GATHERED_BYTES: usize = 64 * 1024;

impl OpenAiAdapter {
    pub fn new(upstream: UpstreamClient) -> Self {
        Self {
            upstream,
            endpoints: Arc::default(),
        }
    }

    /// The Chat Completions endpoint of the upstream at `base_url`: read as a URL (so that it
    /// is normalized as before), then held as the URI a request carries.
    fn endpoint(&self, model: &ModelConfig, base_url: &str) -> Result<Uri, AdapterError> {
        if let Ok(known) = self.endpoints.lock()
            && let Some(url) = known.get(base_url)
        {
            return Ok(url.clone());
        }
        let not_a_url = |error: &dyn std::fmt::Display| {
            AdapterError::new(
                FailureKind::Unsupported,
                format!("model `{}`: its base URL is not a URL: {error}", model.id),
            )
        };
        let url = reqwest::Url::parse(&format!(
            "{}/chat/completions",
            base_url.trim_end_matches('/')
        ))
        .map_err(|error| not_a_url(&error))?;
        let url = Uri::try_from(url.as_str()).map_err(|error| not_a_url(&error))?;
        if let Ok(mut known) = self.endpoints.lock() {
            if known.len() >= MAX_ENDPOINTS {
                known.clear();
            }
            known.insert(base_url.to_owned(), url.clone());
        }
        Ok(url)
    }

    /// One upstream call under the run's budgets: its worst case is reserved before it is
    /// sent, and it is charged after — with the upstream's usage, else the estimate (marked).
    /// A call that never reached the upstream (no connection, refused with a 4xx or 429) is
    /// released uncharged.
    async fn attempt(
        &self,
        context: &AdapterContext<'_>,
        request: &TurnRequest<'_>,
        model: &ModelConfig,
        attempt: u32,
    ) -> Result<Turn, AttemptError> {
        let streaming = model.capabilities.streaming;
        let body = request_body(context, request, model, streaming);
        let prompt_tokens = crate::spend::estimate_tokens(body.len());
        let output_cap = output_cap(context, model, prompt_tokens);
        let worst_cost = model
            .pricing
            .map_or(0.0, |pricing| pricing.cost_of(prompt_tokens, output_cap));
        let hold = context
            .spend
            .reserve(
                &context.agent.name,
                prompt_tokens.saturating_add(output_cap),
                worst_cost,
            )
            .await?;
        let result = self.send(context, request, model, attempt, body).await;
        let usage = match &result {
            Ok(turn) if turn.usage_reported => Some((turn.output.usage, false)),
            Ok(turn) => {
                let written = turn.output.text.len()
                    + turn
                        .tool_calls
                        .iter()
                        .map(|c| c.arguments.len())
                        .sum::<usize>();
                Some((
                    Usage {
                        prompt_tokens,
                        completion_tokens: crate::spend::estimate_tokens(written),
                        total_tokens: 0,
                    },
                    true,
                ))
            }
            Err(failure) if failure.upstream_took => Some((
                Usage {
                    prompt_tokens,
                    completion_tokens: crate::spend::estimate_tokens(failure.written),
                    total_tokens: 0,
                },
                true,
            )),
            Err(_) => None,
        };
        match usage {
            Some((usage, estimated)) => {
                let charge = crate::spend::Charge {
                    model: model.id.clone(),
                    source: "model",
                    prompt_tokens: usage.prompt_tokens,
                    completion_tokens: usage.completion_tokens,
                    cost: model.pricing.map(|pricing| pricing.cost_usd(&usage)),
                    estimated,
                };
                context
                    .spend
                    .charge(&context.agent.name, hold, charge)
                    .await;
            }
            None => context.spend.release(hold).await,
        }
        result
    }

    /// One upstream call, streaming deltas into events as they arrive.
    async fn send(
        &self,
        context: &AdapterContext<'_>,
        request: &TurnRequest<'_>,
        model: &ModelConfig,
        attempt: u32,
        body: Vec<u8>,
    ) -> Result<Turn, AttemptError> {
        let url = self.endpoint(model, &upstream_url(model)?)?;
        let streaming = model.capabilities.streaming;
        let output_budget = request.output_budget;
        let key = api_key(model);
        let call = crate::net::with_upstream_here(&self.upstream, |client| {
            client.post_json(&url, body, key.as_deref())
        });
        let started = Instant::now();
        let response = tokio::select! {
            () = context.cancel.cancelled() => return Err(AttemptError::taken(AdapterError::new(FailureKind::Cancelled, "the run was cancelled"))),
            result = tokio::time::timeout(model.timeout, call) => result,
        };
        // A call that found no connection never reached the upstream; one that was sent and
        // then timed out or broke off may have been billed.
        let response = match response {
            Err(_) => return Err(AttemptError::taken(timeout_error(model))),
            Ok(Err(error @ CallError::Key)) => {
                return Err(AdapterError::new(
                    FailureKind::Unsupported,
                    format!("upstream model `{}`: {error}", model.id),
                )
                .into());
            }
            Ok(Err(error)) if error.is_connect() => {
                return Err(transport_error(model, &error).into());
            }
            Ok(Err(error)) => return Err(AttemptError::taken(transport_error(model, &error))),
            Ok(Ok(response)) => response,
        };
        let (head, body) = response.into_parts();
        let body = http_body_util::BodyDataStream::new(body);
        if !head.status.is_success() {
            let who = format!("upstream model `{}`", model.id);
            let after = retry_after(&head.headers);
            return Err(refused(head.status, after, body, &who, model.timeout).await);
        }
        let mut output = if streaming {
            self.read_stream(context, model, body, output_budget)
                .await?
        } else {
            let text = read_limited(body, MAX_BODY_BYTES, model.timeout)
                .await
                .map_err(AttemptError::taken)?;
            let mut turn = parse_completion(model, &text).map_err(|mut failure| {
                failure.upstream_took = true;
                failure
            })?;
            if turn.output.text.len() > output_budget {
                let kept = prefix_within(&turn.output.text, output_budget).len();
                turn.output.text.truncate(kept);
                turn.output.finish_reason = "length".to_owned();
                turn.tool_calls.clear();
            }
            if turn.tool_calls.len() > MAX_TOOL_CALLS_PER_TURN {
                return Err(AttemptError::from(AdapterError::new(
                    FailureKind::Malformed,
                    format!(
                        "upstream model `{}` asked for {} tool calls in one turn; at most {MAX_TOOL_CALLS_PER_TURN} are accepted",
                        model.id,
                        turn.tool_calls.len()
                    ),
                )));
            }
            if !turn.output.text.is_empty() {
                context.events.emit_delta(&turn.output.text).await;
            }
            turn
        };
        output.output.cost_usd = model
            .pricing
            .map(|pricing| pricing.cost_usd(&output.output.usage));
        context
            .events
            .emit(
                MODEL_CALL_COMPLETED,
                json!({
                    "model": model.id,
                    "upstreamModel": model.upstream_model,
                    "latencyMs": started.elapsed().as_millis() as u64,
                    "usage": output.output.usage,
                    "costUsd": output.output.cost_usd,
                    "attempt": attempt,
                    "toolCalls": output.tool_calls.len(),
                }),
            )
            .await;
        Ok(output)
    }

    async fn read_stream(
        &self,
        context: &AdapterContext<'_>,
        model: &ModelConfig,
        mut body: http_body_util::BodyDataStream<hyper::body::Incoming>,
        output_budget: usize,
    ) -> Result<Turn, AttemptError> {
        let mut output = RuntimeOutput::default();
        let mut usage_reported = false;
        let mut calls = StreamedCalls::default();
        let mut decoder = SseDecoder::default();
        let mut events = Events::default();
        // Whatever fails now, the upstream took the call; `written` bytes of text reached
        // the run.
        let fail = |error: AdapterError, written: usize| AttemptError {
            error,
            delivered_text: written > 0,
            retry_after: None,
            upstream_took: true,
            written,
        };
        let malformed = |message: String, written: usize| {
            fail(AdapterError::new(FailureKind::Malformed, message), written)
        };
        // One wait for cancellation and one idle timer for the whole stream, the timer moved
        // on at each read: made anew for each read, both registered and unregistered
        // themselves (with the token's waiters, in the timer wheel) once per chunk.
        let cancelled = context.cancel.cancelled();
        tokio::pin!(cancelled);
        let idle = tokio::time::sleep(model.timeout);
        tokio::pin!(idle);
        // The text of the deltas read and not yet emitted. It is emitted as one event when a
        // read is handled (or before anything else happens): a fast upstream's burst of
        // chunks costs one event, not one each. While nobody is shown the run live (an answer
        // rendered whole), it is gathered over reads until `gathered` goes off,
        // `GATHERED_FOR` after its first word, or it holds `GATHERED_BYTES`: its events
        // commit with the run's next write anyway. The text and its order are the same
        // either way.
        let mut pending = String::new();
        let gathered = tokio::time::sleep(GATHERED_FOR);
        tokio::pin!(gathered);
        loop {
            // Biased: a cancellation wins, and a read that is ready wins over the timers, as
            // `timeout` around the read did.
            let next = tokio::select! {
                biased;
                () = &mut cancelled => Err(AdapterError::new(FailureKind::Cancelled, "the run was cancelled")),
                next = body.next() => Ok(next),
                // The upstream pauses with text gathered: it is emitted now, not at the next
                // read, however long the pause.
                () = &mut gathered, if !pending.is_empty() => {
                    emit_pending(context, &mut pending).await;
                    continue;
                }
                () = &mut idle => Err(timeout_error(model)),
            };
            idle.as_mut()
                .reset(tokio::time::Instant::now() + model.timeout);
            let chunk = match next {
                Ok(Some(Ok(chunk))) => chunk,
                ended => {
                    emit_pending(context, &mut pending).await;
                    let error = match ended {
                        Err(error) => error,
                        Ok(Some(Err(error))) => transport_error(model, &error),
                        _ => AdapterError::new(
                            FailureKind::Connection,
                            format!(
                                "upstream model `{}` closed the stream before [DONE]",
                                model.id
                            ),
                        ),
                    };
                    return Err(fail(error, output.text.len()));
                }
            };
            // Events completed before a decoding error still count: one may be `[DONE]`.
            events.clear();
            let decoded = decoder.feed(&chunk, &mut events);
            let gathering = !pending.is_empty();
            for data in events.iter() {
                if data.trim() == "[DONE]" {
                    emit_pending(context, &mut pending).await;
                    return Ok(Turn {
                        output,
                        tool_calls: calls.finish(),
                        usage_reported,
                    });
                }
                let Ok(parsed) = chat_wire::parse(data) else {
                    emit_pending(context, &mut pending).await;
                    let message = format!(
                        "upstream model `{}` sent a malformed stream chunk: {}",
                        model.id,
                        excerpt(data)
                    );
                    return Err(malformed(message, output.text.len()));
                };
                let Some(parsed) = parsed else {
                    continue;
                };
                if let Some(error) = &parsed.error.0 {
                    emit_pending(context, &mut pending).await;
                    let message = format!(
                        "upstream model `{}` reported an error mid-stream: {}",
                        model.id,
                        excerpt(&error.to_string())
                    );
                    return Err(fail(
                        AdapterError::new(FailureKind::Upstream5xx, message),
                        output.text.len(),
                    ));
                }
                if let Some(usage) = parsed.reported_usage() {
                    output.usage = usage;
                    usage_reported = true;
                }
                let Some(choice) = parsed.choice() else {
                    continue;
                };
                let delta = choice.delta.0.as_ref();
                if let Some(text) = delta.and_then(|delta| delta.content.as_str())
                    && !text.is_empty()
                {
                    let room = output_budget.saturating_sub(output.text.len());
                    if text.len() > room {
                        // The run's output is capped: keep what fits and end the answer
                        // here, as a model does at its token limit.
                        let kept = prefix_within(text, room);
                        pending.push_str(kept);
                        output.text.push_str(kept);
                        emit_pending(context, &mut pending).await;
                        output.finish_reason = "length".to_owned();
                        return Ok(Turn {
                            output,
                            tool_calls: Vec::new(),
                            usage_reported,
                        });
                    }
                    pending.push_str(text);
                    output.text.push_str(text);
                }
                if let Some(fragments) = delta.and_then(|delta| delta.tool_calls.0.as_deref())
                    && let Err(error) = calls.feed(fragments)
                {
                    emit_pending(context, &mut pending).await;
                    let message = format!("upstream model `{}` sent {error}", model.id);
                    return Err(malformed(message, output.text.len()));
                }
                if let Some(reason) = choice.finish_reason.as_str() {
                    output.finish_reason = reason.to_owned();
                }
            }
            // Shown live, the text goes out at once and the timer is never set.
            if !pending.is_empty() {
                if context.events.shown_live() {
                    emit_pending(context, &mut pending).await;
                } else {
                    let now = tokio::time::Instant::now();
                    if !gathering {
                        gathered.as_mut().reset(now + GATHERED_FOR);
                    }
                    if pending.len() >= GATHERED_BYTES || now >= gathered.deadline() {
                        emit_pending(context, &mut pending).await;
                    }
                }
            }
            if let Err(error) = decoded {
                emit_pending(context, &mut pending).await;
                let message = format!("upstream model `{}` sent {error}", model.id);
                return Err(malformed(message, output.text.len()));
            }
        }
    }
}

/// One model call's input: the transcript so far and the functions offered.
struct TurnRequest<'a> {
    messages: &'a super::Transcript,
    functions: &'a [Value],
    /// Bytes of text the run may still produce (`limits.maxOutputBytes`).
    output_budget: usize,
}

/// One model turn: its text (already streamed as deltas) and the tools it asked for.
struct Turn {
    output: RuntimeOutput,
    tool_calls: Vec<ModelToolCall>,
    /// The upstream reported the turn's usage (else the ledger gets an estimate).
    usage_reported: bool,
}

/// The most tokens a call's answer may hold: the client's (or the agent's) `max_tokens`,
/// within the model's `maxOutputTokens` or what its context window leaves; without either,
/// [`crate::spend::DEFAULT_OUTPUT_CAP`].
fn output_cap(context: &AdapterContext<'_>, model: &ModelConfig, prompt_tokens: u64) -> u64 {
    // The largest the client (or the agent) asked for: the upstream honours one of them.
    let asked = ["max_completion_tokens", "max_tokens"]
        .iter()
        .filter_map(|key| {
            context
                .options
                .get(*key)
                .or_else(|| context.agent.backend_config.get(*key))
                .and_then(Value::as_u64)
                .filter(|asked| *asked > 0)
        })
        .max();
    let model_cap = model.max_output_tokens.or_else(|| {
        model
            .context_window
            .map(|window| window.saturating_sub(prompt_tokens).max(1))
    });
    match (asked, model_cap) {
        (Some(asked), Some(cap)) => asked.min(cap),
        (Some(limit), None) | (None, Some(limit)) => limit,
        (None, None) => crate::spend::DEFAULT_OUTPUT_CAP,
    }
}

/// A tool call as the model sent it, by function name.
#[derive(Debug, Clone, Default)]
struct ModelToolCall {
    id: String,
    name: String,
    arguments: String,
}

impl ModelToolCall {
    fn to_json(&self) -> Value {
        json!({ "id": self.id, "type": "function", "function": { "name": self.name, "arguments": self.arguments } })
    }
}

/// Tool-call fragments of a stream, assembled by their `index`, within the per-turn bounds
/// (an upstream's numbers and lengths never size an allocation unchecked).
#[derive(Default)]
struct StreamedCalls {
    calls: Vec<ModelToolCall>,
    argument_bytes: usize,
}

/// A tool-call fragment the turn cannot take; the attempt fails as malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum StreamedCallError {
    #[error("a tool-call fragment that is not an object: {0}")]
    NotAnObject(String),
    #[error("a tool-call `index` that is not a non-negative integer: {0}")]
    BadIndex(String),
    #[error(
        "a tool-call `index` of {0}; at most {MAX_TOOL_CALLS_PER_TURN} tool calls per turn are accepted"
    )]
    IndexTooLarge(String),
    #[error("more than {MAX_TOOL_CALLS_PER_TURN} tool calls in one turn")]
    TooManyCalls,
    #[error("a tool-call {field} longer than {limit} bytes")]
    FieldTooLong { field: &'static str, limit: usize },
    #[error("tool-call arguments longer than {MAX_TURN_ARGUMENT_BYTES} bytes in one turn")]
    ArgumentsTooLong,
}

impl StreamedCalls {
    fn feed(&mut self, fragments: &[Value]) -> Result<(), StreamedCallError> {
        for fragment in fragments {
            if !fragment.is_object() {
                return Err(StreamedCallError::NotAnObject(excerpt(
                    &fragment.to_string(),
                )));
            }
            let index = self.slot(fragment.get("index"))?;
            let Some(call) = self.calls.get_mut(index) else {
                return Err(StreamedCallError::TooManyCalls);
            };
            if let Some(id) = fragment.get("id").and_then(Value::as_str) {
                append_bounded(&mut call.id, id, "id", MAX_TOOL_CALL_ID_BYTES)?;
            }
            if let Some(name) = json::str_at(fragment, &["function", "name"]) {
                append_bounded(&mut call.name, name, "name", MAX_FUNCTION_NAME_BYTES)?;
            }
            if let Some(arguments) = json::str_at(fragment, &["function", "arguments"]) {
                self.argument_bytes = self.argument_bytes.saturating_add(arguments.len());
                if self.argument_bytes > MAX_TURN_ARGUMENT_BYTES {
                    return Err(StreamedCallError::ArgumentsTooLong);
                }
                call.arguments.push_str(arguments);
            }
        }
        Ok(())
    }

    /// The position of the call a fragment continues: its `index`, or a new call when it has
    /// none. The call exists once this returns.
    fn slot(&mut self, index: Option<&Value>) -> Result<usize, StreamedCallError> {
        let index = match index {
            None | Some(Value::Null) => {
                if self.calls.len() >= MAX_TOOL_CALLS_PER_TURN {
                    return Err(StreamedCallError::TooManyCalls);
                }
                self.calls.len()
            }
            Some(value) => {
                let Some(index) = value.as_u64() else {
                    // A number too large for u64 is still a number: say so, not "not an integer".
                    return Err(
                        if value.as_f64().is_some_and(|n| n >= 0.0 && n.fract() == 0.0) {
                            StreamedCallError::IndexTooLarge(excerpt(&value.to_string()))
                        } else {
                            StreamedCallError::BadIndex(excerpt(&value.to_string()))
                        },
                    );
                };
                match usize::try_from(index) {
                    Ok(index) if index < MAX_TOOL_CALLS_PER_TURN => index,
                    _ => return Err(StreamedCallError::IndexTooLarge(index.to_string())),
                }
            }
        };
        if index >= self.calls.len() {
            self.calls.resize_with(index + 1, ModelToolCall::default);
        }
        Ok(index)
    }

    fn finish(self) -> Vec<ModelToolCall> {
        self.calls
            .into_iter()
            .filter(|call| !call.name.is_empty())
            .collect()
    }
}

/// Appends a fragment of a call's `field`, refusing to grow it past `limit` bytes.
fn append_bounded(
    target: &mut String,
    fragment: &str,
    field: &'static str,
    limit: usize,
) -> Result<(), StreamedCallError> {
    if target.len().saturating_add(fragment.len()) > limit {
        return Err(StreamedCallError::FieldTooLong { field, limit });
    }
    target.push_str(fragment);
    Ok(())
}

/// Tool ids <-> OpenAI function names (`[a-zA-Z0-9_-]`, at most 64 characters). Names are
/// derived from ids and made unique, and the table maps them back.
struct FunctionNames {
    by_name: Vec<(String, String)>,
}

impl FunctionNames {
    fn new(specs: &[ToolSpec]) -> Self {
        // Names the model must see exactly (the client's) are taken first; derived names make
        // way for them.
        let mut by_name: Vec<(String, String)> = specs
            .iter()
            .filter_map(|spec| Some((spec.function_name.clone()?, spec.id.clone())))
            .collect();
        for spec in specs.iter().filter(|spec| spec.function_name.is_none()) {
            let base: String = spec
                .id
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .take(60)
                .collect();
            let mut name = base.clone();
            let mut suffix = 2;
            while by_name.iter().any(|(taken, _)| *taken == name) {
                name = format!("{base}_{suffix}");
                suffix += 1;
            }
            by_name.push((name, spec.id.clone()));
        }
        Self { by_name }
    }

    fn name_of<'n>(&'n self, tool_id: &'n str) -> &'n str {
        self.by_name
            .iter()
            .find(|(_, id)| id == tool_id)
            .map_or(tool_id, |(name, _)| name.as_str())
    }

    /// The tool id of a function name; an unknown name passes through (the gateway refuses it).
    fn tool_of<'n>(&'n self, name: &'n str) -> &'n str {
        self.by_name
            .iter()
            .find(|(n, _)| n == name)
            .map_or(name, |(_, id)| id.as_str())
    }

    fn functions(&self, specs: &[ToolSpec]) -> Vec<Value> {
        specs
            .iter()
            .map(|spec| {
                json!({
                    "type": "function",
                    "function": {
                        "name": self.name_of(&spec.id),
                        "description": spec.description,
                        "parameters": spec.parameters,
                    }
                })
            })
            .collect()
    }
}

impl OpenAiAdapter {
    /// One model turn with the recovery policy: retries, backoff, then fallbacks.
    async fn call_model(
        &self,
        context: &AdapterContext<'_>,
        request: &TurnRequest<'_>,
        primary: &ModelConfig,
    ) -> Result<Turn, AdapterError> {
        let workspace = context.workspace;
        let recovery = &workspace.runtime.recovery;
        let chain = std::iter::once(primary).chain(
            primary
                .fallbacks
                .iter()
                .filter_map(|id| workspace.models.get(id)),
        );
        let mut last_error = None;
        for model in chain {
            for attempt in 1..=recovery.max_attempts {
                let failure = match self.attempt(context, request, model, attempt).await {
                    Ok(turn) => return Ok(turn),
                    Err(failure) => failure,
                };
                settle(context, &failure, attempt, &model.id).await?;
                last_error = Some(failure.error);
            }
        }
        Err(last_error
            .unwrap_or_else(|| AdapterError::new(FailureKind::Unsupported, "no model to call")))
    }
}

#[async_trait::async_trait]
impl RuntimeAdapter for OpenAiAdapter {
    async fn run(&self, mut context: AdapterContext<'_>) -> Result<RuntimeOutput, AdapterError> {
        let Some(primary) = context
            .agent
            .model
            .as_deref()
            .and_then(|id| context.workspace.models.get(id))
        else {
            return Err(AdapterError::new(
                FailureKind::Unsupported,
                format!("agent `{}` has no model", context.agent.name),
            ));
        };
        let specs = context.tools.specs();
        let names = FunctionNames::new(specs);
        let functions = if primary.capabilities.tools {
            names.functions(specs)
        } else {
            Vec::new()
        };
        let mut messages = std::mem::take(&mut context.messages);
        let mut output = RuntimeOutput::default();
        // Whether every model call so far had a price (the cost is known).
        let mut rounds_priced = true;
        let mut rounds = 0;
        loop {
            // Calls of the run's last turn without results (a resumed run) are finished first.
            let pending = unanswered_calls(
                &messages.tail_from(context.own_from),
                context.own_from,
                &names,
            );
            if !pending.is_empty() {
                if rounds >= context.agent.max_iterations {
                    return Err(AdapterError::new(
                        FailureKind::MaxIterations,
                        format!(
                            "agent `{}` still asked for tools after {} model/tool round trips (maxIterations)",
                            context.agent.name, context.agent.max_iterations
                        ),
                    ));
                }
                rounds += 1;
                let asked: Vec<ToolCall> = pending.clone();
                let results = call_tools(&context, pending).await;
                if context.cancel.is_cancelled() {
                    return Err(AdapterError::new(
                        FailureKind::Cancelled,
                        "the run was cancelled",
                    ));
                }
                let mut client_calls = Vec::new();
                for (call, result) in asked.into_iter().zip(results) {
                    if result.outcome == Outcome::ToClient {
                        client_calls.push(ClientCall {
                            name: names.name_of(&call.tool_id).to_owned(),
                            arguments: match call.arguments {
                                Value::String(text) => text,
                                other => other.to_string(),
                            },
                            id: call.id,
                        });
                    } else {
                        messages.push(json!({ "role": "tool", "tool_call_id": call.id, "content": result.to_model_text() }));
                    }
                }
                context
                    .events
                    .checkpoint(&messages, context.own_from)
                    .await?;
                if !client_calls.is_empty() {
                    // The client runs these; its next call brings their results (and the
                    // server calls' results are in the stored turn).
                    output.client_calls = client_calls;
                    output.client_turns = messages.tail_from(context.own_from).into_owned();
                    output.finish_reason = "tool_calls".to_owned();
                    return Ok(output);
                }
                continue;
            }
            let cap = context.output_cap();
            let request = TurnRequest {
                messages: &messages,
                functions: &functions,
                output_budget: cap.saturating_sub(output.text.len()),
            };
            let turn = self.call_model(&context, &request, primary).await?;
            output.text.push_str(&turn.output.text);
            output.usage.add(turn.output.usage);
            output.cost_usd = match (rounds_priced, turn.output.cost_usd) {
                (true, Some(cost)) => Some(output.cost_usd.unwrap_or(0.0) + cost),
                _ => None,
            };
            rounds_priced = output.cost_usd.is_some();
            output.finish_reason = turn.output.finish_reason;
            if turn.tool_calls.is_empty() {
                return Ok(output);
            }
            let mut calls = turn.tool_calls;
            unique_call_ids(&mut calls, messages.len(), |name| {
                names
                    .tool_of(name)
                    .starts_with(crate::workspace::CLIENT_TOOL_PREFIX)
            });
            let assistant = json!({
                "role": "assistant",
                "content": if turn.output.text.is_empty() { Value::Null } else { Value::String(turn.output.text) },
                "tool_calls": calls.iter().map(ModelToolCall::to_json).collect::<Vec<_>>(),
            });
            messages.push(assistant);
            // The turn is stored before any of its tools runs.
            context
                .events
                .checkpoint(&messages, context.own_from)
                .await?;
        }
    }
}

/// Gives every call of a turn an id of its own: models reuse ids (`call_0` every turn) or send
/// none, and the transcript pairs each tool message with its call by id.
/// A call the client will run gets an id unique across runs instead: the client's next call
/// names it, and the stored turn is found by it.
fn unique_call_ids(calls: &mut [ModelToolCall], turn: usize, is_client: impl Fn(&str) -> bool) {
    let mut seen = std::collections::HashSet::new();
    for (position, call) in calls.iter_mut().enumerate() {
        if is_client(&call.name) {
            call.id = crate::runtime::client_call_id();
            seen.insert(call.id.clone());
        } else if call.id.is_empty() || !seen.insert(call.id.clone()) {
            call.id = format!("call_{turn}_{position}");
            seen.insert(call.id.clone());
        }
    }
}

/// The stable key of the call at `position` of the assistant message at `turn` in the
/// transcript: the same whenever the run is resumed from its checkpoint.
fn call_key(turn: usize, position: usize) -> String {
    format!("t{turn}.{position}")
}

/// The tool calls of the run's last assistant message that have no tool message yet (the
/// calls of a turn a crash interrupted), among `own`: the run's own messages, from
/// `own_from` in the transcript on. Calls in the client's own transcript never run.
fn unanswered_calls(own: &[Value], own_from: usize, names: &FunctionNames) -> Vec<ToolCall> {
    let Some(at) = own
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
    else {
        return Vec::new();
    };
    // The key counts from the transcript's start, as every checkpoint of the run does.
    let turn = own_from.saturating_add(at);
    let answered: Vec<&str> = own[at + 1..]
        .iter()
        .filter_map(|m| m.get("tool_call_id").and_then(Value::as_str))
        .collect();
    own[at]
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .enumerate()
                .filter_map(|(index, call)| {
                    let id = call.get("id").and_then(Value::as_str)?;
                    if answered.contains(&id) {
                        return None;
                    }
                    let name = call
                        .pointer("/function/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    Some(ToolCall {
                        key: call_key(turn, index),
                        id: id.to_owned(),
                        tool_id: names.tool_of(name).to_owned(),
                        arguments: call
                            .pointer("/function/arguments")
                            .cloned()
                            .unwrap_or(Value::Null),
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The upstream request, as JSON text: system instructions and recalled memory first, then
/// the transcript; the agent's `backendConfig` passes through and the client's explicit
/// options win over it.
fn request_body(
    context: &AdapterContext<'_>,
    request: &TurnRequest<'_>,
    model: &ModelConfig,
    streaming: bool,
) -> Vec<u8> {
    let system = context
        .agent
        .instructions
        .as_ref()
        .map(|instructions| json!({ "role": "system", "content": instructions }));
    // What memory recalled comes after the agent's own instructions, in its own block.
    let memory = crate::memory::context_message(context.memory);
    let first = system.iter().chain(memory.iter());
    let fields = request_fields(context, request, model, streaming);
    // Sized for the messages' text, most of a long conversation's body, so that the buffer
    // is not grown and copied a doubling at a time.
    let text = super::transcript::estimated_text_bytes(first.clone())
        .saturating_add(request.messages.estimated_text_bytes())
        .saturating_add(1024);
    write_request(&fields, first, request.messages, request.functions, text).into_bytes()
}

/// The upstream request's fields but its `messages` and its `tools` (when the turn offers
/// any): the agent's `backendConfig`, the client's options over it, the model, streaming.
fn request_fields(
    context: &AdapterContext<'_>,
    request: &TurnRequest<'_>,
    model: &ModelConfig,
    streaming: bool,
) -> Map<String, Value> {
    let mut body: Map<String, Value> = context.agent.backend_config.clone();
    for (key, value) in context.options {
        body.insert(key.clone(), value.clone());
    }
    // A cap that is not a positive whole number is invalid in Chat Completions, and some
    // servers read `-1` or `0` as no cap at all: it is never sent, so what a budget reserved
    // (the model's cap) bounds the answer.
    for key in ["max_completion_tokens", "max_tokens"] {
        if body
            .get(key)
            .is_some_and(|cap| cap.as_u64().is_none_or(|cap| cap == 0))
        {
            body.remove(key);
        }
    }
    // An agent that answers structured output asks the model for it (unless told otherwise).
    if let Some(schema) = &context.agent.response_schema
        && !body.contains_key("response_format")
    {
        body.insert(
            "response_format".into(),
            json!({ "type": "json_schema", "json_schema": { "name": "response", "schema": schema.schema } }),
        );
    }
    body.insert("model".into(), model.upstream_model.clone().into());
    // Written from the run's own values (see `write_request`).
    body.remove("messages");
    if !request.functions.is_empty() {
        body.remove("tools");
    }
    body.insert("stream".into(), streaming.into());
    if streaming {
        body.insert("stream_options".into(), json!({ "include_usage": true }));
    } else {
        body.remove("stream_options");
    }
    body
}

/// `fields` as a JSON object with `messages` and, when there are any, `tools` among them,
/// each key where a map holding them all would put it: the text of that map, without it
/// built. The transcript and the tools are written from the run's own values: the
/// transcript, as long as the conversation, was copied whole into a map for every model
/// call, then written and dropped (docs/profiling.md, the fiftieth pass).
fn write_request<'a>(
    fields: &Map<String, Value>,
    first: impl IntoIterator<Item = &'a Value>,
    messages: &'a super::Transcript,
    functions: &[Value],
    capacity: usize,
) -> String {
    enum Entry<'v> {
        Field(&'v Value),
        Messages,
        Tools,
    }
    let mut entries: Vec<(&str, Entry<'_>)> = fields
        .iter()
        .map(|(key, value)| (key.as_str(), Entry::Field(value)))
        .collect();
    entries.push(("messages", Entry::Messages));
    if !functions.is_empty() {
        entries.push(("tools", Entry::Tools));
    }
    // A map's keys in its order (`request_fields` left neither key in `fields`).
    entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut first = Some(first);
    let mut out = String::with_capacity(capacity);
    crate::json::write_object(&mut out, entries, |out, entry| match entry {
        Entry::Field(value) => crate::json::write(out, value),
        Entry::Messages => messages.write_array(out, first.take().into_iter().flatten()),
        Entry::Tools => crate::json::write_array(out, functions, crate::json::write),
    });
    out
}

fn parse_completion(model: &ModelConfig, text: &str) -> Result<Turn, AttemptError> {
    let malformed = || {
        AttemptError::from(AdapterError::new(
            FailureKind::Malformed,
            format!(
                "upstream model `{}` answered something that is not a chat completion: {}",
                model.id,
                excerpt(text)
            ),
        ))
    };
    let parsed = chat_wire::parse(text)
        .map_err(|_| malformed())?
        .ok_or_else(malformed)?;
    // A first choice must be there; one that is not an object says nothing.
    let choice = parsed.first_choice().ok_or_else(malformed)?.0.as_ref();
    let message = choice.and_then(|choice| choice.message.0.as_ref());
    let tool_calls = message
        .and_then(|message| message.tool_calls.0.as_deref())
        .map(|calls| {
            calls
                .iter()
                .map(|call| ModelToolCall {
                    id: call
                        .get("id")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    name: json::str_at(call, &["function", "name"])
                        .unwrap_or_default()
                        .to_owned(),
                    arguments: json::str_at(call, &["function", "arguments"])
                        .unwrap_or_default()
                        .to_owned(),
                })
                .collect()
        })
        .unwrap_or_default();
    let usage = parsed.reported_usage();
    let output = RuntimeOutput {
        client_calls: Vec::new(),
        client_turns: Vec::new(),
        cost_usd: None,
        text: message
            .and_then(|message| message.content.as_str())
            .unwrap_or_default()
            .to_owned(),
        usage: usage.unwrap_or_default(),
        finish_reason: choice
            .and_then(|choice| choice.finish_reason.as_str())
            .unwrap_or("stop")
            .to_owned(),
    };
    Ok(Turn {
        output,
        tool_calls,
        usage_reported: usage.is_some(),
    })
}

/// The longest prefix of `text` within `limit` bytes that ends on a character boundary.
fn prefix_within(text: &str, limit: usize) -> &str {
    let mut end = limit.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Emits the text gathered from one read of a stream, if any, as one delta.
async fn emit_pending(context: &AdapterContext<'_>, pending: &mut String) {
    if !pending.is_empty() {
        context.events.emit_delta(pending).await;
        pending.clear();
    }
}

pub(super) async fn read_limited<E: std::fmt::Display>(
    body: impl futures::Stream<Item = Result<bytes::Bytes, E>>,
    limit: usize,
    timeout: Duration,
) -> Result<String, AdapterError> {
    let mut stream = std::pin::pin!(body);
    let mut body = Vec::new();
    loop {
        match tokio::time::timeout(timeout, stream.next()).await {
            Err(_) => {
                return Err(AdapterError::new(
                    FailureKind::Timeout,
                    "upstream body timed out",
                ));
            }
            Ok(None) => break,
            Ok(Some(Err(error))) => {
                return Err(AdapterError::new(
                    FailureKind::Connection,
                    format!("upstream body: {error}"),
                ));
            }
            Ok(Some(Ok(chunk))) => {
                body.extend_from_slice(&chunk);
                if body.len() > limit {
                    body.truncate(limit);
                    break;
                }
            }
        }
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

fn timeout_error(model: &ModelConfig) -> AdapterError {
    AdapterError::new(
        FailureKind::Timeout,
        format!(
            "upstream model `{}` did not answer within {}s",
            model.id,
            model.timeout.as_secs_f64()
        ),
    )
}

fn transport_error(model: &ModelConfig, error: &impl CallFailure) -> AdapterError {
    transport_failure(&format!("upstream model `{}`", model.id), error)
}

/// `retry-after` in seconds (the HTTP-date form is rare for APIs and falls back to backoff).
#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::super::{SharedHistory, Transcript};
    use super::{
        MAX_FUNCTION_NAME_BYTES, MAX_TOOL_CALLS_PER_TURN, MAX_TURN_ARGUMENT_BYTES,
        StreamedCallError, StreamedCalls, write_request,
    };

    /// The upstream request's text is the text of the map holding its fields, `messages`
    /// and `tools` among them: each key where the map puts it, whatever keys the agent's
    /// configuration and the client's options add around them, and a configured `tools`
    /// kept when the turn offers none.
    #[test]
    fn the_request_is_written_as_the_map_holding_it_is() {
        let messages = [
            json!({ "role": "system", "content": "Be brief." }),
            json!({ "role": "user", "content": "hé \"x\"\n\u{1}" }),
        ];
        // The system message first, the user's in a shared history: its text written by the
        // first request and reused by the others.
        let transcript = Transcript::new(
            Vec::new(),
            Some(Arc::new(SharedHistory::from(messages[1..].to_vec()))),
            Vec::new(),
        );
        let functions =
            [json!({ "type": "function", "function": { "name": "f", "parameters": {} } })];
        let field_sets = [
            json!({}),
            json!({ "model": "m", "stream": true, "stream_options": { "include_usage": true } }),
            json!({ "aaa": 1, "max_tokens": 5, "messagez": [1], "model": "m", "n": 2,
                    "stream": false, "temperature": 0.5, "tool_choice": "auto",
                    "tools_extra": null, "zzz": { "a": [] } }),
            json!({ "Messages": 0, "messagea": 1, "tool": true, "toolt": 3 }),
        ];
        for fields in field_sets {
            let fields = fields.as_object().cloned().unwrap_or_default();
            for offered in [&functions[..], &[]] {
                let mut map = fields.clone();
                map.insert("messages".into(), messages.to_vec().into());
                if !offered.is_empty() {
                    map.insert("tools".into(), offered.to_vec().into());
                }
                let expected = serde_json::to_string(&map).expect("a map serializes");
                assert_eq!(
                    write_request(&fields, vec![&messages[0]], &transcript, offered, 16),
                    expected
                );
            }
        }
        let configured = json!({ "model": "m", "tools": [{ "type": "web" }] });
        let configured = configured.as_object().cloned().unwrap_or_default();
        let mut map = configured.clone();
        map.insert("messages".into(), messages.to_vec().into());
        assert_eq!(
            write_request(&configured, vec![&messages[0]], &transcript, &[], 16),
            serde_json::to_string(&map).expect("a map serializes")
        );
    }

    fn feed(fragments: Value) -> Result<StreamedCalls, StreamedCallError> {
        let mut calls = StreamedCalls::default();
        calls.feed(fragments.as_array().map_or(&[][..], Vec::as_slice))?;
        Ok(calls)
    }

    #[test]
    fn fragments_assemble_by_index() {
        let calls = feed(json!([
            { "index": 1, "id": "b", "function": { "name": "two", "arguments": "{\"x\"" } },
            { "index": 0, "id": "a", "function": { "name": "one", "arguments": "{}" } },
            { "index": 1, "function": { "arguments": ":1}" } },
            { "index": null, "id": "c", "function": { "name": "three" } },
        ]))
        .unwrap()
        .finish();
        let got: Vec<(&str, &str, &str)> = calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", "one", "{}"),
                ("b", "two", "{\"x\":1}"),
                ("c", "three", "")
            ]
        );
    }

    #[test]
    fn hostile_fragments_are_refused_without_allocating() {
        let cases = [
            (
                json!([{ "index": 4_000_000_000u64 }]),
                "`index` of 4000000000",
            ),
            (
                json!([{ "index": u64::MAX }]),
                "`index` of 18446744073709551615",
            ),
            (json!([{ "index": 1e300 }]), "`index` of 1e+300"),
            (
                json!([{ "index": MAX_TOOL_CALLS_PER_TURN }]),
                "at most 128 tool calls",
            ),
            (json!([{ "index": -1 }]), "not a non-negative integer: -1"),
            (json!([{ "index": "0" }]), "not a non-negative integer"),
            (json!([{ "index": 0.5 }]), "not a non-negative integer: 0.5"),
            (json!(["call"]), "not an object"),
            (
                json!([{ "index": 0, "function": { "name": "n".repeat(MAX_FUNCTION_NAME_BYTES + 1) } }]),
                "tool-call name longer than 256 bytes",
            ),
            (
                json!([{ "index": 0, "id": "i".repeat(513) }]),
                "tool-call id longer than 512 bytes",
            ),
        ];
        for (fragments, expected) in cases {
            let error = feed(fragments.clone())
                .err()
                .unwrap_or_else(|| panic!("{fragments} was accepted"));
            assert!(error.to_string().contains(expected), "{fragments}: {error}");
        }
        // Calls without an index each open a new call, up to the bound.
        let many = Value::Array(vec![json!({ "id": "x" }); MAX_TOOL_CALLS_PER_TURN + 1]);
        assert_eq!(feed(many).err(), Some(StreamedCallError::TooManyCalls));
        // Arguments are bounded over the whole turn, not per fragment.
        let half = "a".repeat(MAX_TURN_ARGUMENT_BYTES / 2 + 1);
        let error = feed(json!([
            { "index": 0, "function": { "arguments": half } },
            { "index": 1, "function": { "arguments": half } },
        ]))
        .err();
        assert_eq!(error, Some(StreamedCallError::ArgumentsTooLong));
    }

    /// Cases per property: few by default so `cargo test` stays fast; `PROPTEST_CASES` sets it.
    fn config() -> ProptestConfig {
        let mut config = ProptestConfig::default();
        if std::env::var_os("PROPTEST_CASES").is_none() {
            config.cases = 256;
        }
        config
    }

    /// Any JSON value, nested a few levels, with the numbers an upstream could send and the
    /// keys of a tool call's fragment among others.
    fn junk() -> impl Strategy<Value = Value> {
        let keys = prop_oneof![
            Just("index".to_owned()),
            Just("id".to_owned()),
            Just("function".to_owned()),
            Just("name".to_owned()),
            Just("arguments".to_owned()),
            "[a-z]{1,8}",
        ];
        crate::json::any_json(".{0,40}".boxed(), keys.boxed())
    }

    /// A fragment shaped like a real one, with hostile values in any field.
    fn fragment() -> impl Strategy<Value = Value> {
        let index = prop_oneof![
            4 => (0u64..200).prop_map(Value::from),
            1 => any::<u64>().prop_map(Value::from),
            1 => any::<i64>().prop_map(Value::from),
            1 => any::<f64>().prop_map(Value::from),
            1 => junk(),
        ];
        let text = prop_oneof![".{0,24}".prop_map(Value::String), junk()];
        (
            proptest::option::of(index),
            proptest::option::of(text.clone()),
            proptest::option::of(text.clone()),
            proptest::option::of(text),
        )
            .prop_map(|(index, id, name, arguments)| {
                let mut fragment = serde_json::Map::new();
                if let Some(index) = index {
                    fragment.insert("index".into(), index);
                }
                if let Some(id) = id {
                    fragment.insert("id".into(), id);
                }
                let mut function = serde_json::Map::new();
                if let Some(name) = name {
                    function.insert("name".into(), name);
                }
                if let Some(arguments) = arguments {
                    function.insert("arguments".into(), arguments);
                }
                fragment.insert("function".into(), Value::Object(function));
                Value::Object(fragment)
            })
    }

    proptest! {
        #![proptest_config(config())]

        /// Whatever the chunks hold, feeding them never panics, and an accepted turn stays
        /// within every bound.
        #[test]
        fn any_chunks_stay_bounded(
            chunks in proptest::collection::vec(
                proptest::collection::vec(prop_oneof![3 => fragment(), 1 => junk()], 0..8),
                0..8,
            )
        ) {
            let mut calls = StreamedCalls::default();
            for chunk in &chunks {
                if calls.feed(chunk).is_err() {
                    break;
                }
                prop_assert!(calls.calls.len() <= MAX_TOOL_CALLS_PER_TURN);
                prop_assert!(calls.argument_bytes <= MAX_TURN_ARGUMENT_BYTES);
                let arguments: usize = calls.calls.iter().map(|c| c.arguments.len()).sum();
                prop_assert_eq!(arguments, calls.argument_bytes);
                prop_assert!(calls.calls.iter().all(|c| c.name.len() <= MAX_FUNCTION_NAME_BYTES));
            }
            let _ = calls.finish();
        }
    }
}

/// Where a model's upstream is, read now (a `baseUrlEnv` variable is read at call time).
fn upstream_url(model: &ModelConfig) -> Result<String, AdapterError> {
    match &model.base_url {
        UpstreamUrl::Fixed(url) => Ok(url.clone()),
        UpstreamUrl::FromEnv(var) => std::env::var(var).map_err(|_| {
            AdapterError::new(
                FailureKind::Unsupported,
                format!(
                    "model `{}`: environment variable {var} (baseUrlEnv) is not set",
                    model.id
                ),
            )
        }),
    }
}

/// The model's key, when its variable is set.
fn api_key(model: &ModelConfig) -> Option<String> {
    model
        .api_key_env
        .as_deref()
        .and_then(|name| std::env::var(name).ok())
}

/// The request with the model's key, when its variable is set.
fn authorized(request: reqwest::RequestBuilder, model: &ModelConfig) -> reqwest::RequestBuilder {
    match api_key(model) {
        Some(key) => request.bearer_auth(key),
        None => request,
    }
}

/// What a probe of a model's upstream found.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelProbe {
    pub model: String,
    /// The upstream answered HTTP at all (any status): it is up and reachable.
    pub reachable: bool,
    /// The status of `GET {baseUrl}/models`, when it answered.
    pub status: Option<u16>,
    pub latency_ms: u64,
    /// Why it is not reachable (or what its answer says is wrong, e.g. a refused key).
    pub error: Option<String>,
}

/// Asks a model's upstream `GET {baseUrl}/models` with its key, within `timeout`.
pub async fn probe(
    http: &reqwest::Client,
    model: &ModelConfig,
    timeout: std::time::Duration,
) -> ModelProbe {
    let started = Instant::now();
    let mut probe = ModelProbe {
        model: model.id.clone(),
        reachable: false,
        status: None,
        latency_ms: 0,
        error: None,
    };
    let answer = match upstream_url(model) {
        Ok(base) => {
            let url = format!("{}/models", base.trim_end_matches('/'));
            tokio::time::timeout(timeout, authorized(http.get(url), model).send()).await
        }
        Err(error) => {
            probe.error = Some(error.message);
            return probe;
        }
    };
    probe.latency_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    match answer {
        Ok(Ok(response)) => {
            probe.reachable = true;
            probe.status = Some(response.status().as_u16());
            if response.status() == reqwest::StatusCode::UNAUTHORIZED
                || response.status() == reqwest::StatusCode::FORBIDDEN
            {
                probe.error = Some("the upstream refuses the model's key".to_owned());
            }
        }
        Ok(Err(error)) => probe.error = Some(transport_error(model, &error).message),
        Err(_) => probe.error = Some(format!("no answer within {}ms", timeout.as_millis())),
    }
    probe
}
