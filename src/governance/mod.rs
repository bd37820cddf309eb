//! Governance: policy evaluation over typed inputs (first matching rule wins, fail closed)
//! and the durable approval queue.
//!
//! Empty until its issue; rules are already compiled into
//! [`crate::workspace::GovernanceConfig`].
