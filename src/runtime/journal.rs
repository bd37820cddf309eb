//! The journal: the single, ordered path by which the runtime writes to the store.
//!
//! Writes are queued (bounded: a slow disk slows producers instead of growing memory) and a
//! writer task applies whatever is queued as one transaction, so a streaming run costs one
//! commit per burst of tokens, not one per token. Events are published to live subscribers
//! only after their transaction committed: a subscriber never sees an event the store lost.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::hub::EventHub;
use crate::store::{Store, StoreError, WriteOp};

/// Most writes applied in one transaction.
const MAX_BATCH: usize = 512;
/// Queue length before producers wait.
const QUEUE: usize = 8_192;

// Writes are the common case; boxing them would cost an allocation per event for nothing.
#[allow(clippy::large_enum_variant)]
enum Item {
    Write(WriteOp),
    /// Resolved once everything queued before it is committed.
    Flush(oneshot::Sender<Result<(), String>>),
}

/// Handle to the writer task; cheap to clone.
#[derive(Debug, Clone)]
pub struct Journal {
    sender: mpsc::Sender<Item>,
}

impl std::fmt::Debug for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Item::Write(op) => op.fmt(f),
            Item::Flush(_) => f.write_str("Flush"),
        }
    }
}

/// The journal stopped (the server is shutting down) or the store refused a write.
#[derive(Debug, thiserror::Error)]
#[error("the store journal failed: {0}")]
pub struct JournalError(pub String);

impl Journal {
    /// Starts the writer task on `tracker`; it ends when every `Journal` clone is dropped.
    pub fn start(
        store: Arc<dyn Store>,
        hub: Arc<EventHub>,
        tracker: &tokio_util::task::TaskTracker,
    ) -> Self {
        let (sender, receiver) = mpsc::channel(QUEUE);
        tracker.spawn(write_loop(store, hub, receiver));
        Self { sender }
    }

    /// Queues a write behind every earlier one.
    pub async fn write(&self, op: WriteOp) -> Result<(), JournalError> {
        self.sender
            .send(Item::Write(op))
            .await
            .map_err(|_| JournalError("the journal is closed".into()))
    }

    /// Queues several writes; they commit together (or with their neighbours).
    pub async fn write_all(&self, ops: Vec<WriteOp>) -> Result<(), JournalError> {
        for op in ops {
            self.write(op).await?;
        }
        Ok(())
    }

    /// Waits until everything queued so far is committed.
    pub async fn flush(&self) -> Result<(), JournalError> {
        let (done, wait) = oneshot::channel();
        self.sender
            .send(Item::Flush(done))
            .await
            .map_err(|_| JournalError("the journal is closed".into()))?;
        wait.await
            .map_err(|_| JournalError("the journal stopped".into()))?
            .map_err(JournalError)
    }
}

async fn write_loop(store: Arc<dyn Store>, hub: Arc<EventHub>, mut receiver: mpsc::Receiver<Item>) {
    let mut items = Vec::with_capacity(MAX_BATCH);
    while receiver.recv_many(&mut items, MAX_BATCH).await > 0 {
        let mut ops = Vec::with_capacity(items.len());
        let mut flushes = Vec::new();
        for item in items.drain(..) {
            match item {
                Item::Write(op) => ops.push(op),
                Item::Flush(done) => flushes.push(done),
            }
        }
        let result = apply_with_retry(store.as_ref(), &ops).await;
        match &result {
            Ok(()) => {
                for op in ops {
                    if let WriteOp::AppendEvent(event) = op {
                        hub.publish(Arc::new(event));
                    }
                }
            }
            Err(error) => {
                tracing::error!(%error, writes = ops.len(), "store journal could not commit a batch")
            }
        }
        for done in flushes {
            let _ = done.send(result.as_ref().map(|_| ()).map_err(ToString::to_string));
        }
    }
}

/// A transient failure (a locked database, a full disk being cleaned) gets a few tries.
async fn apply_with_retry(store: &dyn Store, ops: &[WriteOp]) -> Result<(), StoreError> {
    let mut delay = Duration::from_millis(20);
    for _ in 0..4 {
        match store.apply(ops).await {
            Ok(()) => return Ok(()),
            Err(error) => {
                tracing::warn!(%error, "store write failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 4;
            }
        }
    }
    store.apply(ops).await
}
