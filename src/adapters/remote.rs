//! The `http` backend: a run delegated to a customer-owned agent service over HTTP, protocol
//! `stable-harness.agent/v1` (documented in docs/remote-agents.md).
//!
//! For each attempt the adapter posts the run (transcript, memory, the agent's tools as
//! function specs, a callback grant, metadata) to the agent's `endpoint` and reads the answer:
//! an SSE stream of JSON events (`delta`, `progress`, `final`, `error`) or one JSON object
//! `{output, usage?}`. While the stream is open it also serves the service's tool callbacks,
//! which arrive through the run's callback queue and go through the run's gateway handle like a
//! model's calls. Every read is bounded (an event, the whole answer, the output); a service that
//! hangs meets `endpoint.timeout`; connection errors, 5xx and timeouts follow `recovery` as long
//! as nothing was delivered (no output, no callback) in the attempt.

use std::time::Duration;

use chrono::Utc;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::openai::read_limited;
use super::retry::{AttemptError, refused, retry_after, settle, transport_failure};
use super::sse::{Events, MAX_EVENT_BYTES, SseDecoder};
use super::{
    AdapterContext, AdapterError, FailureKind, RuntimeAdapter, RuntimeOutput, ToolCall, Usage,
    call_tools,
};
use crate::gateway::callbacks::{CallbackCall, CallbackGrant};
use crate::runtime::events::ADAPTER_EVENT;
use crate::text::excerpt;
use crate::workspace::EndpointConfig;

/// The protocol name and version every call carries.
pub const PROTOCOL: &str = "stable-harness.agent/v1";

/// The most a service's answer may hold, streamed or not.
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// The adapter event phase of a service's `progress` event.
pub const PHASE_PROGRESS: &str = "agent.progress";

#[derive(Debug)]
pub struct RemoteAdapter {
    http: reqwest::Client,
}

impl RemoteAdapter {
    pub fn new(http: reqwest::Client) -> Self {
        Self { http }
    }
}

/// What an attempt may read and must tell about itself.
struct Attempt<'q> {
    queue: Option<&'q mut mpsc::Receiver<CallbackCall>>,
    /// Output reached the run, or a callback was served: the attempt is never repeated.
    delivered: bool,
}

#[async_trait::async_trait]
impl RuntimeAdapter for RemoteAdapter {
    async fn run(&self, context: AdapterContext<'_>) -> Result<RuntimeOutput, AdapterError> {
        let Some(endpoint) = context.agent.endpoint.as_ref() else {
            return Err(AdapterError::new(
                FailureKind::Unsupported,
                format!("agent `{}` has no endpoint", context.agent.name),
            ));
        };
        // The token lives as long as the run could: its active time plus an approval's wait.
        let lifetime =
            context.agent.timeout + context.workspace.runtime.governance.approval_timeout;
        let expires_at = Utc::now()
            + chrono::Duration::from_std(lifetime).unwrap_or_else(|_| chrono::Duration::days(1));
        let opened = context.callbacks.open(&context.run.run_id, expires_at);
        let (grant, mut queue) = match opened {
            Some((grant, queue)) => (Some(grant), Some(queue)),
            None => (None, None),
        };
        let body = request_body(&context, grant.as_ref());
        let recovery = &context.workspace.runtime.recovery;
        let mut last_error = None;
        for attempt in 1..=recovery.max_attempts {
            let mut state = Attempt {
                queue: queue.as_mut(),
                delivered: false,
            };
            // A service's cost is known only from what it reports: the budgets must have
            // room before it is posted, and are charged what its answer reports.
            // The least there is (a token, a billionth of cost): a budget at its limit refuses.
            let hold = context.spend.reserve(&context.agent.name, 1, 1e-9).await?;
            let result = self.attempt(&context, endpoint, &body, &mut state).await;
            match &result {
                Ok(output) if output.usage != Usage::default() || output.cost_usd.is_some() => {
                    let charge = crate::spend::Charge {
                        model: format!("agent:{}", context.agent.name),
                        source: "agent",
                        prompt_tokens: output.usage.prompt_tokens,
                        completion_tokens: output.usage.completion_tokens,
                        cost: output.cost_usd,
                        estimated: false,
                    };
                    context
                        .spend
                        .charge(&context.agent.name, hold, charge)
                        .await;
                }
                _ => context.spend.release(hold).await,
            }
            let failure = match result {
                Ok(output) => return Ok(output),
                Err(mut failure) => {
                    failure.delivered_text |= state.delivered;
                    failure
                }
            };
            settle(&context, &failure, attempt, &context.agent.name).await?;
            last_error = Some(failure.error);
        }
        // The grant lives until here: the token is revoked when the run's adapter returns.
        drop(grant);
        Err(last_error
            .unwrap_or_else(|| AdapterError::new(FailureKind::Unsupported, "no attempt was made")))
    }
}

impl RemoteAdapter {
    async fn attempt<'a>(
        &self,
        context: &'a AdapterContext<'a>,
        endpoint: &EndpointConfig,
        body: &Value,
        state: &mut Attempt<'_>,
    ) -> Result<RuntimeOutput, AttemptError> {
        let mut request = crate::net::client_here(&self.http)
            .post(&endpoint.url)
            .header(
                reqwest::header::ACCEPT,
                "text/event-stream, application/json",
            )
            .json(body);
        if let Some(key) = endpoint
            .api_key_env
            .as_deref()
            .and_then(|name| std::env::var(name).ok())
        {
            request = request.bearer_auth(key);
        }
        // A service may call tools back before it answers at all: callbacks are served from
        // the moment the run is posted.
        let mut in_flight = InFlight::new();
        let response =
            serve_while(context, endpoint, state, &mut in_flight, request.send()).await?;
        let response = response.map_err(|error| AttemptError::from(transport(context, &error)))?;
        if !response.status().is_success() {
            let who = format!("agent service of `{}`", context.agent.name);
            let (status, after) = (response.status(), retry_after(response.headers()));
            let body = response.bytes_stream();
            return Err(refused(status, after, body, &who, endpoint.timeout).await);
        }
        let is_json = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        if is_json {
            let read = read_limited(
                response.bytes_stream(),
                MAX_ANSWER_BYTES + 1,
                endpoint.timeout,
            );
            let text = serve_while(context, endpoint, state, &mut in_flight, read)
                .await?
                .map_err(AttemptError::from)?;
            if text.len() > MAX_ANSWER_BYTES {
                return Err(malformed(
                    context,
                    format!("its answer is larger than {MAX_ANSWER_BYTES} bytes"),
                )
                .into());
            }
            let answer: Value = serde_json::from_str(&text).map_err(|_| {
                malformed(
                    context,
                    format!("its answer is not JSON: {}", excerpt(&text)),
                )
            })?;
            let mut output = final_output(context, &answer)?;
            if !output.text.is_empty() {
                context.events.emit_delta(&output.text).await;
                state.delivered = true;
            }
            output.finish_reason = "stop".to_owned();
            return Ok(output);
        }
        self.read_stream(context, endpoint, response, state, &mut in_flight)
            .await
    }

    /// Reads the service's event stream to its `final` (or `error`) event, serving its tool
    /// callbacks meanwhile.
    async fn read_stream<'a>(
        &self,
        context: &'a AdapterContext<'a>,
        endpoint: &EndpointConfig,
        response: reqwest::Response,
        state: &mut Attempt<'_>,
        in_flight: &mut InFlight<'a>,
    ) -> Result<RuntimeOutput, AttemptError> {
        let cap = context.output_cap();
        let mut body = response.bytes_stream();
        let mut decoder = SseDecoder::with_limit(MAX_EVENT_BYTES);
        let mut events = Events::default();
        let mut read = 0usize;
        let mut text = String::new();
        loop {
            let next = serve_while(context, endpoint, state, in_flight, body.next()).await?;
            let chunk = match next {
                None => {
                    return Err(AdapterError::new(
                        FailureKind::Connection,
                        format!(
                            "the agent service of `{}` closed its stream before a `final` event",
                            context.agent.name
                        ),
                    )
                    .into());
                }
                Some(Err(error)) => return Err(transport(context, &error).into()),
                Some(Ok(chunk)) => chunk,
            };
            read = read.saturating_add(chunk.len());
            if read > MAX_ANSWER_BYTES {
                return Err(malformed(
                    context,
                    format!("its stream passed {MAX_ANSWER_BYTES} bytes"),
                )
                .into());
            }
            events.clear();
            let decoded = decoder.feed(&chunk, &mut events);
            for data in events.iter() {
                let event: Value = serde_json::from_str(data).map_err(|_| {
                    malformed(
                        context,
                        format!("it sent an event that is not JSON: {}", excerpt(data)),
                    )
                })?;
                match event.get("type").and_then(Value::as_str) {
                    Some("delta") => {
                        let Some(delta) = event.get("text").and_then(Value::as_str) else {
                            return Err(malformed(
                                context,
                                "a `delta` event needs `text`".to_owned(),
                            )
                            .into());
                        };
                        if text.len().saturating_add(delta.len()) > cap {
                            return Err(malformed(
                                context,
                                format!("its output passed limits.maxOutputBytes ({cap} bytes)"),
                            )
                            .into());
                        }
                        text.push_str(delta);
                        state.delivered = true;
                        context.events.emit_delta(delta).await;
                    }
                    Some("progress") => {
                        let message = event
                            .get("message")
                            .and_then(Value::as_str)
                            .unwrap_or_default();
                        context
                                    .events
                                    .emit(ADAPTER_EVENT, json!({ "event": { "phase": PHASE_PROGRESS, "message": excerpt(message) } }))
                                    .await;
                    }
                    Some("final") => {
                        // Calls still being served end with the run; their results are
                        // recorded as they come (the gateway commits before answering).
                        let mut output = final_output(context, &event)?;
                        if output.text.is_empty() {
                            output.text = text;
                        } else if text.is_empty() {
                            context.events.emit_delta(&output.text).await;
                        }
                        output.finish_reason = "stop".to_owned();
                        return Ok(output);
                    }
                    Some("error") => {
                        let code = event.get("code").and_then(Value::as_str).unwrap_or("error");
                        let message = event
                            .get("message")
                            .and_then(Value::as_str)
                            .unwrap_or("no message");
                        return Err(AdapterError::new(
                            FailureKind::UpstreamRejected,
                            format!(
                                "the agent service of `{}` failed the run ({}): {}",
                                context.agent.name,
                                excerpt(code),
                                excerpt(message)
                            ),
                        )
                        .into());
                    }
                    _ => {
                        return Err(malformed(
                            context,
                            format!("it sent an event of unknown type: {}", excerpt(data)),
                        )
                        .into());
                    }
                }
            }
            if let Err(error) = decoded {
                return Err(malformed(context, error.to_string()).into());
            }
        }
    }
}

/// The callbacks an attempt is serving.
type InFlight<'a> =
    FuturesUnordered<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>>;

/// Awaits `work` while serving the run's callbacks; `endpoint.timeout` bounds the silence —
/// no answer and no callback — not the whole wait.
async fn serve_while<'a, T>(
    context: &'a AdapterContext<'a>,
    endpoint: &EndpointConfig,
    state: &mut Attempt<'_>,
    in_flight: &mut InFlight<'a>,
    work: impl std::future::Future<Output = T>,
) -> Result<T, AttemptError> {
    tokio::pin!(work);
    loop {
        let idle = if in_flight.is_empty() {
            endpoint.timeout
        } else {
            Duration::MAX
        };
        tokio::select! {
            () = context.cancel.cancelled() => return Err(cancelled().into()),
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            call = next_call(&mut state.queue) => {
                if let Some(call) = call {
                    state.delivered = true;
                    in_flight.push(Box::pin(serve(context, call)));
                }
            }
            done = tokio::time::timeout(idle, &mut work) => {
                return done.map_err(|_| timeout(context, endpoint).into());
            }
        }
    }
}

/// The next callback of the run, or never when the run has no callbacks.
async fn next_call(queue: &mut Option<&mut mpsc::Receiver<CallbackCall>>) -> Option<CallbackCall> {
    match queue {
        Some(queue) => queue.recv().await,
        None => std::future::pending().await,
    }
}

/// Runs one callback through the gateway (announced like a model's call) and answers it.
async fn serve(context: &AdapterContext<'_>, call: CallbackCall) {
    let CallbackCall {
        call_key,
        tool_id,
        arguments,
        reply,
    } = call;
    let call = ToolCall {
        id: call_key.clone(),
        key: call_key,
        tool_id,
        arguments,
    };
    if let Some(result) = call_tools(context, vec![call]).await.pop() {
        let _ = reply.send(result);
    }
}

/// The body of a run's call to its service.
fn request_body(context: &AdapterContext<'_>, grant: Option<&CallbackGrant>) -> Value {
    let tools: Vec<Value> = context
        .tools
        .specs()
        .iter()
        .map(|spec| {
            json!({ "type": "function", "function": {
                "name": spec.id, "description": spec.description, "parameters": spec.parameters } })
        })
        .collect();
    let memory: Vec<Value> = context
        .memory
        .iter()
        .map(|record| json!({ "id": record.id, "namespace": record.namespace, "content": record.content }))
        .collect();
    json!({
        "protocol": PROTOCOL,
        "requestId": context.run.request_id,
        "runId": context.run.run_id,
        "sessionId": context.run.session_id,
        "agentId": context.agent.name,
        "messages": &context.messages,
        "memory": memory,
        "tools": tools,
        "callback": grant.map(|grant| json!({
            "url": grant.url, "token": grant.token, "expiresAt": grant.expires_at,
        })),
        "metadata": context.metadata,
    })
}

/// The output and usage of a `final` event or a JSON answer.
fn final_output(
    context: &AdapterContext<'_>,
    answer: &Value,
) -> Result<RuntimeOutput, AdapterError> {
    let text = match answer.get("output") {
        Some(Value::String(text)) => text.clone(),
        None | Some(Value::Null) => String::new(),
        Some(_) => return Err(malformed(context, "`output` must be a string".to_owned())),
    };
    let cap = context.output_cap();
    if text.len() > cap {
        return Err(malformed(
            context,
            format!("its output passed limits.maxOutputBytes ({cap} bytes)"),
        ));
    }
    let usage = answer
        .get("usage")
        .and_then(|usage| serde_json::from_value::<Usage>(usage.clone()).ok())
        .unwrap_or_default();
    // A service may report what its own model calls cost (`usage.costUsd`).
    let cost_usd = answer
        .pointer("/usage/costUsd")
        .and_then(Value::as_f64)
        .filter(|cost| cost.is_finite() && *cost >= 0.0);
    Ok(RuntimeOutput {
        text,
        usage,
        cost_usd,
        ..RuntimeOutput::default()
    })
}

fn cancelled() -> AdapterError {
    AdapterError::new(FailureKind::Cancelled, "the run was cancelled")
}

fn malformed(context: &AdapterContext<'_>, what: String) -> AdapterError {
    AdapterError::new(
        FailureKind::Malformed,
        format!(
            "the agent service of `{}` broke the protocol: {what}",
            context.agent.name
        ),
    )
}

fn timeout(context: &AdapterContext<'_>, endpoint: &EndpointConfig) -> AdapterError {
    AdapterError::new(
        FailureKind::Timeout,
        format!(
            "the agent service of `{}` sent nothing for {}s (endpoint.timeout)",
            context.agent.name,
            endpoint.timeout.as_secs_f64()
        ),
    )
}

fn transport(context: &AdapterContext<'_>, error: &reqwest::Error) -> AdapterError {
    let who = format!("the agent service of `{}`", context.agent.name);
    transport_failure(&who, error)
}
