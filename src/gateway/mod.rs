//! The tool gateway (SPEC section 5): the only path by which any tool runs — allow-list,
//! argument validation, policy, approval, execution with a timeout, hooks, recording.
//!
//! Empty until its issue. The workspace compiler already resolves each tool's single
//! implementation ([`crate::workspace::ToolImplementation`]) and compiles its argument schema.
