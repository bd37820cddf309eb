//! Tool callbacks of remote agents (the `http` backend, protocol `stable-harness.agent/v1`).
//! While a remote agent's run is active, its service may call the agent's tools back through
//! the gateway at `/runtime/runs/{runId}/tools/{toolId}`, with a token scoped to that run.
//!
//! A token is 32 random bytes, handed to the service once and kept here only as its SHA-256
//! (never stored, never logged). It opens exactly one live run's callback queue, which the
//! run's adapter serves through the same [`ToolInvoker`](crate::adapters::ToolInvoker) as a
//! model's calls: allow-list, schema, policy, approvals, recording. The token dies with the
//! run (the adapter's [`CallbackGrant`] is dropped when the run ends, is cancelled or fails)
//! or at its expiry, whichever comes first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use chrono::{DateTime, Utc};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use super::ToolResult;

/// Calls a run's service may have waiting to be served at once.
const QUEUE: usize = 64;

/// One call a remote agent's service made, for its run's adapter to serve.
#[derive(Debug)]
pub struct CallbackCall {
    /// The call's key in its run (`cb.<Idempotency-Key>`, or a new id): a repeated callback
    /// with the same `Idempotency-Key` finds the recorded result.
    pub call_key: String,
    pub tool_id: String,
    pub arguments: Value,
    /// Where the result goes (the callback may have stopped waiting).
    pub reply: oneshot::Sender<ToolResult>,
}

/// A live run's callback entry.
#[derive(Debug)]
struct Entry {
    run_id: String,
    expires_at: DateTime<Utc>,
    calls: mpsc::Sender<CallbackCall>,
}

/// The live runs' callback tokens, by their digest.
#[derive(Debug, Default)]
pub struct Callbacks {
    entries: Mutex<HashMap<[u8; 32], Entry>>,
    /// The server's own base URL, as services reach it (`None` without a server: the CLI).
    base_url: OnceLock<String>,
}

/// What a remote agent's service gets to call back, and the revocation of it: dropping the
/// grant forgets the token.
#[derive(Debug)]
pub struct CallbackGrant {
    /// `{base}/runtime/runs/{runId}`.
    pub url: String,
    pub token: String,
    pub expires_at: DateTime<Utc>,
    digest: [u8; 32],
    callbacks: Arc<Callbacks>,
}

impl Drop for CallbackGrant {
    fn drop(&mut self) {
        if let Ok(mut entries) = self.callbacks.entries.lock() {
            entries.remove(&self.digest);
        }
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Callbacks {
    /// Sets the base URL services call back (once, when the server has its address).
    pub fn set_base_url(&self, url: String) {
        let _ = self.base_url.set(url);
    }

    /// Opens callbacks for a run until `expires_at`: the grant to give its service, and the
    /// queue of the calls it makes. `None` when there is no server to call back.
    pub fn open(
        self: &Arc<Self>,
        run_id: &str,
        expires_at: DateTime<Utc>,
    ) -> Option<(CallbackGrant, mpsc::Receiver<CallbackCall>)> {
        let base = self.base_url.get()?;
        let token = format!("shcb_{}", hex_random());
        let digest = digest(&token);
        let (calls, queue) = mpsc::channel(QUEUE);
        self.entries.lock().ok()?.insert(
            digest,
            Entry {
                run_id: run_id.to_owned(),
                expires_at,
                calls,
            },
        );
        let grant = CallbackGrant {
            url: format!("{base}/runtime/runs/{run_id}"),
            token,
            expires_at,
            digest,
            callbacks: Arc::clone(self),
        };
        Some((grant, queue))
    }

    /// The queue of `run_id`'s calls, if `token` is that run's live, unexpired token.
    pub fn authorize(&self, token: &str, run_id: &str) -> Option<mpsc::Sender<CallbackCall>> {
        let entries = self.entries.lock().ok()?;
        let entry = entries.get(&digest(token))?;
        (entry.run_id == run_id && entry.expires_at > Utc::now()).then(|| entry.calls.clone())
    }
}

/// 32 random bytes as hex (UUID v4s draw from the OS's random source).
fn hex_random() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}
