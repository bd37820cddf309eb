//! The integration suite: one test binary, one module per area. Every test drives the
//! product as a user does — the compiled binary or the public library API on real files.

// Helpers outside `#[test]` functions panic on setup failures too: that is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod helpers;

mod api;
mod cli;
mod crash;
mod fuzz;
mod hostile_upstream;
mod pg;
mod soak;
mod store_conformance;
mod workspace_checks;
