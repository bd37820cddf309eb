//! Following a request while it may wait on approvals: the clock of SPEC section 6. Once a
//! call has waited `approvalWait` on an operator, a caller stops waiting (the run goes on).

use std::sync::Arc;

use futures::StreamExt;
use serde_json::Value;

use super::EventStream;
use super::events::{APPROVAL_REQUESTED, APPROVAL_RESOLVED};
use crate::store::{EventRecord, StoreError};

/// A request's events, with the clock of SPEC section 6 on pending approvals: once a call
/// has waited `approvalWait` on an operator, the `/v1` answer stops waiting (the run goes on).
pub struct ApprovalWatch {
    events: EventStream,
    wait: std::time::Duration,
    pending: Vec<String>,
    deadline: Option<tokio::time::Instant>,
}

#[derive(Debug)]
pub enum Watched {
    Event(Arc<EventRecord>),
    /// Still pending after `approvalWait`: the id of the oldest pending approval.
    StillPending(String),
    Failed(StoreError),
    Ended,
}

impl std::fmt::Debug for ApprovalWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApprovalWatch")
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}

impl ApprovalWatch {
    pub fn approval_wait(&self) -> std::time::Duration {
        self.wait
    }

    pub fn new(events: EventStream, wait: std::time::Duration) -> Self {
        Self {
            events,
            wait,
            pending: Vec::new(),
            deadline: None,
        }
    }

    pub async fn next(&mut self) -> Watched {
        let next = match self.deadline {
            Some(deadline) => match tokio::time::timeout_at(deadline, self.events.next()).await {
                Ok(next) => next,
                Err(_) => {
                    return Watched::StillPending(
                        self.pending.first().cloned().unwrap_or_default(),
                    );
                }
            },
            None => self.events.next().await,
        };
        match next {
            None => Watched::Ended,
            Some(Err(error)) => Watched::Failed(error),
            Some(Ok(event)) => {
                if event.event_type == APPROVAL_REQUESTED
                    && let Some(id) = crate::json::str_at(&event.data, &["approval", "id"])
                {
                    self.pending.push(id.to_owned());
                    self.deadline
                        .get_or_insert_with(|| tokio::time::Instant::now() + self.wait);
                } else if event.event_type == APPROVAL_RESOLVED {
                    let id = event.data.get("approvalId").and_then(Value::as_str);
                    self.pending.retain(|pending| Some(pending.as_str()) != id);
                    if self.pending.is_empty() {
                        self.deadline = None;
                    }
                }
                Watched::Event(event)
            }
        }
    }
}
