//! Events between instances: what another instance commits to a shared store reaches this
//! one's live followers and approval waiters.
//!
//! The store announces other instances' appends ([`StoreChange::Events`]). For a request
//! someone here follows, the announced events are read from the store and published on the
//! local hub, where followers order them by `seq` and fill any gap from the store. Every
//! announcement also wakes the approval waiters of its request (a decision taken on another
//! instance appends `runtime.approval.resolved`), which then read the decision from the store.
//! A cancel asked on another instance stops the request's run if it executes here.
//! When announcements may have been missed ([`StoreChange::Resync`], or this side fell
//! behind), every waiter reads the store again; followers read it on their own every few
//! seconds of silence.

use std::sync::Arc;

use tokio::sync::broadcast;

use super::Runtime;
use crate::store::StoreChange;

/// Follows `changes` for as long as the runtime lives.
pub(super) fn start(runtime: &Runtime, mut changes: broadcast::Receiver<StoreChange>) {
    let inner = Arc::downgrade(&runtime.inner);
    tokio::spawn(async move {
        loop {
            let change = match changes.recv().await {
                Ok(change) => change,
                Err(broadcast::error::RecvError::Lagged(_)) => StoreChange::Resync,
                Err(broadcast::error::RecvError::Closed) => return,
            };
            let Some(inner) = inner.upgrade() else { return };
            match change {
                StoreChange::Events {
                    request_id,
                    first,
                    last,
                } => {
                    inner.approvals.notify_request(&request_id);
                    if !inner.hub.has_subscribers(&request_id) {
                        continue;
                    }
                    let count = last.saturating_sub(first).saturating_add(1);
                    match inner
                        .store
                        .events(&request_id, first.saturating_sub(1), count)
                        .await
                    {
                        Ok(events) => {
                            let events: Vec<_> = events.into_iter().map(Arc::new).collect();
                            inner.hub.publish(&events);
                        }
                        // Followers find the events on their next read of the store.
                        Err(error) => {
                            tracing::debug!(%error, "could not read another instance's events")
                        }
                    }
                }
                StoreChange::CancelRequested { run_id, by } => {
                    Runtime { inner }.cancel_live_run(&run_id, &by);
                }
                StoreChange::Resync => inner.approvals.notify_all(),
            }
        }
    });
}
