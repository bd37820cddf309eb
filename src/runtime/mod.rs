//! Runtime lifecycle: requests, sessions, runs and their events (SPEC section 4 and 7).
//!
//! So far this module holds the event vocabulary the workspace refers to; the lifecycle
//! itself (request -> run -> events, persisted and subscribable) arrives with its issue.

pub mod events;
