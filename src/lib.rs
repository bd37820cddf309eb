//! stable-harness: a single binary that turns a folder of YAML (a workspace) into a governed,
//! durable, observable agent service. See ARCHITECTURE.md for the map of these modules.

pub mod adapters;
pub mod allocator;
pub mod app;
pub mod cli;
pub mod error;
pub mod gateway;
pub mod governance;
pub mod hot_text;
pub mod http;
pub mod ids;
pub mod json;
pub mod memory;
pub mod metrics;
pub mod net;
pub mod redact;
pub mod runtime;
pub mod spend;
pub mod store;
pub mod text;
pub mod threads;
pub mod time;
pub mod workspace;
