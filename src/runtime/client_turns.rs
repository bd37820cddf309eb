//! Client tools across calls. A run whose model calls a client tool ends by handing the call
//! to the client (`finishReason: tool_calls`); the client runs it and its next call — a new
//! request — carries the result. That request's transcript is completed here from the store,
//! found by the call ids the client was given: a turn that also called server tools gets back
//! those calls and their results, which the client never saw, so a stateless client (full
//! input each turn) and a stored chain give the model the same context. The results the client
//! brings complete the handed-over calls' records when the new run starts.

use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

use super::{CLIENT_CALL_PREFIX, Runtime, RuntimeError};
use crate::gateway::client::ClientFunction;
use crate::store::ClientCallRecord;

/// What a request brings for client tools: the tools it supplies and the results of calls
/// handed to the client earlier.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientTurn {
    pub tools: Vec<ClientFunction>,
    pub results: Vec<ClientResult>,
}

/// The result of a call handed to the client, as the client reported it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientResult {
    pub run_id: String,
    pub call_key: String,
    pub call_id: String,
    pub tool_id: String,
    /// The request that handed the call over.
    pub request_id: String,
    pub output: Value,
}

impl ClientTurn {
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty() && self.results.is_empty()
    }

    /// Adds this turn to a request's stored `input` (a resumed or retried run reads it back).
    pub(super) fn store_in(&self, input: &mut Value) {
        if !self.tools.is_empty() {
            input["clientTools"] = self.tools.iter().map(ClientFunction::to_json).collect();
        }
        if !self.results.is_empty() {
            input["clientResults"] = self
                .results
                .iter()
                .map(|r| {
                    json!({ "runId": r.run_id, "callKey": r.call_key, "callId": r.call_id,
                        "toolId": r.tool_id, "requestId": r.request_id, "output": r.output })
                })
                .collect();
        }
    }

    /// The turn a request's stored `input` holds.
    pub(super) fn stored_in(input: &Value) -> Self {
        let list = |key: &str| {
            input
                .get(key)
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        };
        let text = |value: &Value, key: &str| {
            value
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        Self {
            tools: list("clientTools")
                .iter()
                .enumerate()
                .filter_map(|(index, tool)| ClientFunction::from_json(index, tool))
                .collect(),
            results: list("clientResults")
                .iter()
                .map(|r| ClientResult {
                    run_id: text(r, "runId"),
                    call_key: text(r, "callKey"),
                    call_id: text(r, "callId"),
                    tool_id: text(r, "toolId"),
                    request_id: text(r, "requestId"),
                    output: r.get("output").cloned().unwrap_or(Value::Null),
                })
                .collect(),
        }
    }
}

fn tool_call_ids(message: &Value) -> impl Iterator<Item = &str> {
    message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|call| call.get("id").and_then(Value::as_str))
}

/// The ids of the calls handed to the client that `messages`' answers make.
fn client_call_ids(messages: &[Value]) -> impl Iterator<Item = &str> {
    messages
        .iter()
        .filter(|m| is_assistant(m))
        .flat_map(tool_call_ids)
        .filter(|id| id.starts_with(CLIENT_CALL_PREFIX))
}

/// Whether an answer among `messages` made a call handed to the client: a transcript
/// [`Runtime::continue_client_turns`] may change.
pub fn names_client_calls(messages: &[Value]) -> bool {
    client_call_ids(messages).next().is_some()
}

fn is_assistant(message: &Value) -> bool {
    message.get("role").and_then(Value::as_str) == Some("assistant")
}

impl Runtime {
    /// The terminal event of a request, if it ended.
    pub async fn terminal_event(
        &self,
        request_id: &str,
    ) -> Result<Option<crate::store::EventRecord>, RuntimeError> {
        Ok(self
            .inner
            .store
            .last_event(request_id)
            .await?
            .filter(|event| super::events::is_terminal(&event.event_type)))
    }

    /// Completes `messages` (Chat Completions shape) with what the store holds of the client
    /// calls they name, and returns the results they bring for calls still waiting on the
    /// client. Calls of another key's requests are not found: they stay as the client sent
    /// them.
    pub async fn continue_client_turns(
        &self,
        owner: &str,
        messages: Vec<Value>,
    ) -> Result<(Vec<Value>, Vec<ClientResult>), RuntimeError> {
        let ids: Vec<String> = client_call_ids(&messages)
            .map(str::to_owned)
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        if ids.is_empty() {
            return Ok((messages, Vec::new()));
        }
        let found: HashMap<String, ClientCallRecord> = self
            .inner
            .store
            .client_calls(&ids, owner)
            .await?
            .into_iter()
            .map(|record| (record.call.model_call_id.clone(), record))
            .collect();
        // The run's own messages (its turns, server calls and their results), for each run
        // that called server tools beside the client's: its terminal event keeps them.
        let mut turns: HashMap<String, Vec<Value>> = HashMap::new();
        for record in found.values().filter(|r| r.server_calls) {
            let run_id = &record.call.run_id;
            if turns.contains_key(run_id) {
                continue;
            }
            let own = match self.terminal_event(&record.call.request_id).await? {
                Some(event) => event
                    .data
                    .get("clientTurns")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default(),
                None => continue,
            };
            turns.insert(run_id.clone(), own);
        }
        let mut expanded: HashSet<String> = HashSet::new();
        let mut completed = Vec::new();
        let mut out = Vec::with_capacity(messages.len());
        for message in messages {
            if is_assistant(&message) {
                let runs: Vec<&str> = tool_call_ids(&message)
                    .filter_map(|id| found.get(id))
                    .map(|record| record.call.run_id.as_str())
                    .filter(|run| turns.contains_key(*run))
                    .collect();
                if let Some(run) = runs.first() {
                    // The client's copy of the run's answer stands for the run's own turns.
                    if expanded.insert((*run).to_owned()) {
                        out.extend(turns[*run].iter().cloned());
                    }
                    continue;
                }
            } else if message.get("role").and_then(Value::as_str) == Some("tool")
                && let Some(record) = message
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .and_then(|id| found.get(id))
                && record.call.outcome == crate::gateway::Outcome::ToClient.as_str()
            {
                completed.push(ClientResult {
                    run_id: record.call.run_id.clone(),
                    call_key: record.call.call_key.clone(),
                    call_id: record.call.model_call_id.clone(),
                    tool_id: record.call.tool_id.clone(),
                    request_id: record.call.request_id.clone(),
                    output: message.get("content").cloned().unwrap_or(Value::Null),
                });
            }
            out.push(message);
        }
        Ok((out, completed))
    }
}
