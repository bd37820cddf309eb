//! The workspace compiler: a folder of YAML in, an immutable [`CompiledWorkspace`] out.
//!
//! `source` reads files and documents, `raw` holds their serde shapes, `compile` checks and
//! resolves them, `model` is the compiled inventory, `schema` describes documents for editors,
//! `scaffold` writes a starter workspace, `inventory` describes a compiled one as JSON. Loading reports every problem at once
//! ([`Diagnostics`]), each as `file:line:col: message`.

mod compile;
mod diagnostics;
mod inventory;
mod located;
mod model;
mod raw;
pub mod scaffold;
mod schema;
mod source;
mod units;

use std::path::Path;

pub use compile::{CLIENT_TOOL_PREFIX, glob_matches};
pub use diagnostics::{Diagnostic, Diagnostics};
pub use inventory::inventory;
pub use model::*;
pub use raw::API_VERSION;
pub use schema::document_schema;
pub use units::{MAX_DURATION, is_valid_name, parse_byte_size, parse_duration};

/// Reads, checks and compiles the workspace at `root`.
pub fn load(root: &Path) -> Result<CompiledWorkspace, Diagnostics> {
    let started = std::time::Instant::now();
    let mut diagnostics = Diagnostics::default();
    let documents = source::read_documents(root, &mut diagnostics);
    let compiled = compile::compile(root, documents, &mut diagnostics);
    match compiled {
        Some(mut workspace) if diagnostics.is_empty() => {
            workspace.compile_time = started.elapsed();
            Ok(workspace)
        }
        _ => {
            diagnostics.sort();
            Err(diagnostics)
        }
    }
}
