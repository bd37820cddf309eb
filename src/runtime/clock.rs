//! An agent's `timeout` counts active execution only (SPEC section 4): time parked on an
//! approval is bounded by the approval timeout instead. [`ActiveClock`] is a deadline that
//! stops while the run waits.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

#[derive(Debug)]
pub(super) struct ActiveClock {
    budget: Duration,
    state: Mutex<ClockState>,
    changed: Notify,
}

#[derive(Debug)]
struct ClockState {
    started: Instant,
    paused_total: Duration,
    paused_since: Option<Instant>,
}

impl ActiveClock {
    pub fn start(budget: Duration) -> Self {
        Self {
            budget,
            state: Mutex::new(ClockState {
                started: Instant::now(),
                paused_total: Duration::ZERO,
                paused_since: None,
            }),
            changed: Notify::new(),
        }
    }

    pub fn pause(&self, paused: bool) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match (paused, state.paused_since) {
            (true, None) => state.paused_since = Some(Instant::now()),
            (false, Some(since)) => {
                state.paused_total += since.elapsed();
                state.paused_since = None;
            }
            _ => return,
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Active time left, or `None` while paused.
    fn remaining(&self) -> Option<Duration> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.paused_since.is_some() {
            return None;
        }
        let active = state.started.elapsed().saturating_sub(state.paused_total);
        Some(self.budget.saturating_sub(active))
    }

    /// Resolves once the active budget is spent.
    pub async fn expired(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.remaining() {
                Some(remaining) if remaining.is_zero() => return,
                Some(remaining) => {
                    tokio::select! {
                        () = tokio::time::sleep(remaining) => {}
                        () = &mut changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }
}
