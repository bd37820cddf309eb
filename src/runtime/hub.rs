//! Live event fan-out inside one process: one broadcast channel per request with subscribers.
//! Subscribers that fall behind are told so (`Lagged`) and catch up from the store, so a slow
//! reader costs memory bounded by the channel size, never by the stream length.
//!
//! The hub also knows which requests are *streamed*: followed by someone who shows each event
//! as it comes (an SSE answer, a tail of the event log). The journal commits their writes at
//! once; a request only waited on to its end lets its writes ride along with its next commit.
//!
//! And which requests' *views are awaited at their end* (a `wait` answer): the journal reads
//! such a request's view right after the commit of its terminal event, and hands it over
//! before it publishes that event, so the waiter has it when it wakes.

use std::sync::{Arc, Mutex};

use tokio::sync::{broadcast, oneshot};

use crate::ids::IdMap;
use crate::store::{EventRecord, RequestInFull};
use crate::threads::locked;

/// Events buffered per request for live subscribers. Every request with a follower has a
/// channel, allocated whole when it is made: a 1,024-slot channel was ~50 KB of allocation
/// per request, visible in the profile. A follower further behind catches up from the store
/// (and a streamed run's deltas merge into one event per commit), so a short buffer loses
/// nothing.
const CHANNEL_CAPACITY: usize = 64;

#[derive(Debug, Default)]
pub struct EventHub {
    channels: Mutex<IdMap<String, broadcast::Sender<Arc<EventRecord>>>>,
    /// Requests streamed live, with how many followers stream each.
    streamed: Mutex<IdMap<String, usize>>,
    /// Requests whose view someone awaits at their end.
    views: Mutex<IdMap<String, oneshot::Sender<RequestInFull>>>,
}

/// A request streamed live, while this is held (see [`EventHub::stream`]).
#[derive(Debug)]
pub struct Streamed {
    hub: Arc<EventHub>,
    request_id: String,
}

impl Drop for Streamed {
    fn drop(&mut self) {
        let mut streamed = locked(&self.hub.streamed);
        if let Some(count) = streamed.get_mut(&self.request_id) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                streamed.remove(&self.request_id);
            }
        }
    }
}

/// A request's view awaited at its end (see [`EventHub::await_view`]); dropped, the hub
/// forgets it.
#[derive(Debug)]
pub struct AwaitedView {
    hub: Arc<EventHub>,
    request_id: String,
    receiver: oneshot::Receiver<RequestInFull>,
}

impl AwaitedView {
    /// The view, if the journal delivered it: it does so before publishing the terminal
    /// event, so a waiter that saw the end finds it here.
    pub fn take(&mut self) -> Option<RequestInFull> {
        self.receiver.try_recv().ok()
    }
}

impl Drop for AwaitedView {
    fn drop(&mut self) {
        locked(&self.hub.views).remove(&self.request_id);
    }
}

impl EventHub {
    /// Receives every event of `request_id` committed from now on.
    pub fn subscribe(&self, request_id: &str) -> broadcast::Receiver<Arc<EventRecord>> {
        let mut channels = locked(&self.channels);
        channels
            .entry(request_id.to_owned())
            .or_insert_with(|| broadcast::channel(CHANNEL_CAPACITY).0)
            .subscribe()
    }

    /// Marks `request_id` as streamed live until the returned guard drops: its writes
    /// commit as they come instead of riding along with its next commit.
    pub fn stream(self: &Arc<Self>, request_id: &str) -> Streamed {
        *locked(&self.streamed)
            .entry(request_id.to_owned())
            .or_default() += 1;
        Streamed {
            hub: Arc::clone(self),
            request_id: request_id.to_owned(),
        }
    }

    /// Asks for the view of `request_id` as it stands right after the commit of its
    /// terminal event, until the returned guard drops. Nothing arrives if the request has
    /// not ended by then, or the read failed: the waiter reads the view itself.
    pub fn await_view(self: &Arc<Self>, request_id: &str) -> AwaitedView {
        let (sender, receiver) = oneshot::channel();
        locked(&self.views).insert(request_id.to_owned(), sender);
        AwaitedView {
            hub: Arc::clone(self),
            request_id: request_id.to_owned(),
            receiver,
        }
    }

    /// The requests among `events` that end here and whose view is still awaited, taken
    /// out of the hub: the journal reads each view and sends it before it publishes the
    /// request's events.
    pub fn views_awaited(
        &self,
        events: &[Arc<EventRecord>],
    ) -> Vec<(Arc<str>, oneshot::Sender<RequestInFull>)> {
        let mut views = locked(&self.views);
        if views.is_empty() {
            return Vec::new();
        }
        // A waiter that gave up took its entry with it (`AwaitedView`'s drop).
        events
            .iter()
            .filter(|event| super::events::is_terminal(&event.event_type))
            .filter_map(|event| {
                let sender = views.remove(&*event.request_id)?;
                Some((Arc::clone(&event.request_id), sender))
            })
            .collect()
    }

    /// Whether someone here streams `request_id` live.
    pub fn is_streamed(&self, request_id: &str) -> bool {
        self.streamed
            .lock()
            .map(|streamed| streamed.contains_key(request_id))
            .unwrap_or(true)
    }

    /// Delivers committed events, in order, to their requests' subscribers: each event its
    /// own message, so that a follower on another thread takes the first while the rest are
    /// being sent (sent as one message per commit, c=1 was slower: docs/profiling.md, the
    /// twelfth pass). Sent after letting go of the map: a follower that ends at once drops
    /// its subscription ([`EventHub::release`]), and found the map still held by the
    /// writer's thread, a futex wait and wake on both sides.
    pub fn publish(&self, events: &[Arc<EventRecord>]) {
        let mut sends = Vec::with_capacity(events.len());
        {
            let mut channels = locked(&self.channels);
            for event in events {
                let sender = match channels.get(&*event.request_id) {
                    None => continue,
                    // Nothing more comes, or nobody listens any more: the channel goes.
                    Some(sender)
                        if super::events::is_terminal(&event.event_type)
                            || sender.receiver_count() == 0 =>
                    {
                        channels.remove(&*event.request_id)
                    }
                    Some(sender) => Some(sender.clone()),
                };
                sends.extend(sender.map(|sender| (sender, event)));
            }
        }
        for (sender, event) in sends {
            let _ = sender.send(Arc::clone(event));
        }
    }

    /// Ends the live stream of a request that will have no more events here (the store
    /// refused its first write): its subscribers see the channel closed.
    pub fn close(&self, request_id: &str) {
        locked(&self.channels).remove(request_id);
        locked(&self.views).remove(request_id);
    }

    /// Drops the channel of a request nobody listens to any more.
    pub fn release(&self, request_id: &str) {
        let mut channels = locked(&self.channels);
        if channels
            .get(request_id)
            .is_some_and(|sender| sender.receiver_count() == 0)
        {
            channels.remove(request_id);
        }
    }

    /// Whether anyone here follows `request_id`.
    pub fn has_subscribers(&self, request_id: &str) -> bool {
        self.channels
            .lock()
            .map(|channels| {
                channels
                    .get(request_id)
                    .is_some_and(|sender| sender.receiver_count() > 0)
            })
            .unwrap_or(false)
    }

    /// Requests with live subscribers (for tests and metrics).
    pub fn channel_count(&self) -> usize {
        self.channels.lock().map(|c| c.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(request_id: &str, seq: i64, event_type: &str) -> Arc<EventRecord> {
        Arc::new(EventRecord {
            id: format!("evt_{request_id}_{seq}"),
            request_id: request_id.into(),
            run_id: "run".into(),
            session_id: "ses".into(),
            agent_id: "agent".into(),
            seq,
            event_type: event_type.to_owned(),
            at: chrono::Utc::now(),
            data: serde_json::Value::Null,
        })
    }

    #[test]
    fn a_commit_reaches_each_follower_in_order_and_an_end_closes_its_channel() {
        let hub = EventHub::default();
        let mut a = hub.subscribe("req_a");
        let mut b = hub.subscribe("req_b");
        hub.publish(&[
            event("req_a", 1, "runtime.request.started"),
            event("req_b", 1, "runtime.request.started"),
            event("req_c", 1, "runtime.request.started"),
            event("req_a", 2, "runtime.adapter.event"),
            event("req_a", 3, super::super::events::REQUEST_COMPLETED),
        ]);
        let mut seen = Vec::new();
        while let Ok(event) = a.try_recv() {
            seen.push(event.seq);
        }
        assert_eq!(seen, [1, 2, 3]);
        assert_eq!(b.try_recv().unwrap().seq, 1);
        // a ended: its channel is gone and its follower sees it closed; b's stays.
        assert!(matches!(
            a.try_recv(),
            Err(broadcast::error::TryRecvError::Closed)
        ));
        assert!(!hub.has_subscribers("req_a"));
        assert!(hub.has_subscribers("req_b"));
        assert_eq!(hub.channel_count(), 1);
    }

    #[test]
    fn a_view_is_awaited_only_at_its_requests_end_and_only_while_a_waiter_holds_it() {
        let hub = Arc::new(EventHub::default());
        let a = hub.await_view("req_a");
        let b = hub.await_view("req_b");
        let c = hub.await_view("req_c");
        drop(b);
        let started = [event("req_a", 1, "runtime.request.started")];
        assert!(hub.views_awaited(&started).is_empty());
        let ended = [
            event("req_a", 2, super::super::events::REQUEST_COMPLETED),
            event("req_b", 2, super::super::events::REQUEST_FAILED),
        ];
        let awaited: Vec<String> = hub
            .views_awaited(&ended)
            .into_iter()
            .map(|(request, _)| request.to_string())
            .collect();
        // b's waiter was gone before its end: forgotten, not read; c has not ended.
        assert_eq!(awaited, ["req_a"]);
        assert!(hub.views_awaited(&ended).is_empty());
        assert_eq!(locked(&hub.views).len(), 1);
        drop(c);
        drop(a);
        assert!(locked(&hub.views).is_empty());
    }
}
