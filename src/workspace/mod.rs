//! The workspace compiler: a folder of YAML in, an immutable [`CompiledWorkspace`] out.
//!
//! `source` reads files and documents, `raw` holds their serde shapes, `compile` checks and
//! resolves them, `model` is the compiled inventory, `schema` describes documents for editors,
//! `scaffold` writes a starter workspace. Loading reports every problem at once
//! ([`Diagnostics`]), each as `file:line:col: message`.

mod compile;
mod diagnostics;
mod located;
mod model;
mod raw;
pub mod scaffold;
mod schema;
mod source;
mod units;

use std::path::Path;

pub use compile::glob_matches;
pub use diagnostics::{Diagnostic, Diagnostics};
pub use model::*;
pub use raw::API_VERSION;
pub use schema::document_schema;
pub use units::{MAX_DURATION, is_valid_name, parse_byte_size, parse_duration};

/// Reads, checks and compiles the workspace at `root`.
pub fn load(root: &Path) -> Result<CompiledWorkspace, Diagnostics> {
    let mut diagnostics = Diagnostics::default();
    let documents = source::read_documents(root, &mut diagnostics);
    let compiled = compile::compile(root, documents, &mut diagnostics);
    match compiled {
        Some(workspace) if diagnostics.is_empty() => Ok(workspace),
        _ => {
            diagnostics.sort();
            Err(diagnostics)
        }
    }
}
