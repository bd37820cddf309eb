//! Memory lifecycle: recall before a run, candidate writes after it, approval, maintenance.
//!
//! Empty until its issue; agents already carry their namespace
//! ([`crate::workspace::AgentMemoryConfig`]).
