//! The `http` memory provider: recall and writes delegated to a team's own memory service,
//! under the JSON contract `stable-harness.memory/v1` (documented in `docs/memory.md`).
//!
//! `POST {url}/recall` and `POST {url}/write`, with `Authorization: Bearer <apiKeyEnv>` when
//! set, each bounded by the provider's `timeout` and a 1 MiB answer. Anything else than a 2xx
//! with the documented body is a failure, which the runtime reports and runs on without.

use serde::Deserialize;
use serde_json::json;

use super::{
    Candidate, Context, MemoryProvider, Namespace, ProviderError, ProviderUsage, Recall, Recalled,
    Written,
};
use crate::store::MemoryStatus;
use crate::workspace::MemoryProviderConfig;

/// The protocol named in every body.
pub const PROTOCOL: &str = "stable-harness.memory/v1";
/// Largest answer read from the service.
const MAX_ANSWER_BYTES: u64 = 1 << 20;

#[derive(Debug)]
pub struct HttpProvider<'a> {
    config: &'a MemoryProviderConfig,
    http: reqwest::Client,
}

impl<'a> HttpProvider<'a> {
    pub fn new(config: &'a MemoryProviderConfig, http: reqwest::Client) -> Self {
        Self { config, http }
    }

    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        operation: &str,
        body: serde_json::Value,
    ) -> Result<T, ProviderError> {
        let url = format!("{}/{operation}", self.config.url.trim_end_matches('/'));
        let mut request = self
            .http
            .post(&url)
            .timeout(self.config.timeout)
            .json(&body);
        if let Some(env) = &self.config.api_key_env
            && let Ok(key) = std::env::var(env)
        {
            request = request.bearer_auth(key);
        }
        let failed = |what: String| {
            ProviderError::Service(format!(
                "memory provider `{}` {operation}: {what}",
                self.config.name
            ))
        };
        let response = request.send().await.map_err(|error| {
            failed(if error.is_timeout() {
                format!("no answer within {:?}", self.config.timeout)
            } else {
                "the service cannot be reached".to_owned()
            })
        })?;
        let status = response.status();
        if !status.is_success() {
            return Err(failed(format!("answered HTTP {}", status.as_u16())));
        }
        let body = crate::net::read_capped(response, MAX_ANSWER_BYTES)
            .await
            .map_err(|error| failed(error.to_string()))?;
        serde_json::from_slice(&body)
            .map_err(|error| failed(format!("the answer is not the documented JSON: {error}")))
    }
}

#[derive(Deserialize)]
struct RecallAnswer {
    records: Vec<RecalledRecord>,
    /// What the service spent on a model to answer, if it did.
    #[serde(default)]
    usage: Option<ProviderUsage>,
}

#[derive(Deserialize)]
struct RecalledRecord {
    id: String,
    content: String,
}

#[derive(Deserialize)]
struct WriteAnswer {
    id: String,
    status: MemoryStatus,
    #[serde(default)]
    merged: bool,
}

#[async_trait::async_trait]
impl MemoryProvider for HttpProvider<'_> {
    async fn recall(
        &self,
        namespace: &Namespace,
        query: &str,
        limit: u32,
        context: &Context<'_>,
    ) -> Result<Recall, ProviderError> {
        let answer: RecallAnswer = self
            .post(
                "recall",
                json!({
                    "protocol": PROTOCOL,
                    "namespace": namespace.name,
                    "scope": namespace.scope,
                    "query": query,
                    "limit": limit,
                    "agentId": context.agent_id,
                    "sessionId": context.session_id,
                }),
            )
            .await?;
        let records = answer
            .records
            .into_iter()
            .take(usize::try_from(limit).unwrap_or(usize::MAX))
            .map(|record| Recalled {
                id: record.id,
                namespace: namespace.name.clone(),
                content: record.content,
            })
            .collect();
        let usage = answer.usage.map(|usage| ProviderUsage {
            cost_usd: usage
                .cost_usd
                .filter(|cost| cost.is_finite() && *cost >= 0.0),
            ..usage
        });
        Ok(Recall { records, usage })
    }

    async fn write(&self, candidate: &Candidate) -> Result<Written, ProviderError> {
        let answer: WriteAnswer = self
            .post(
                "write",
                json!({
                    "protocol": PROTOCOL,
                    "namespace": candidate.namespace.name,
                    "scope": candidate.namespace.scope,
                    "owner": candidate.owner,
                    "content": candidate.content,
                    "metadata": candidate.metadata,
                    "requireApproval": candidate.require_approval,
                    "source": {
                        "requestId": candidate.source_request_id,
                        "runId": candidate.source_run_id,
                    },
                }),
            )
            .await?;
        Ok(Written {
            memory_id: answer.id,
            status: answer.status,
            merged: answer.merged,
        })
    }
}
