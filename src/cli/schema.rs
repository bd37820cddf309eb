//! `stable-harness schema`: the JSON Schema of workspace documents.

use super::{exit, output};

pub fn run() -> u8 {
    let schema = crate::workspace::document_schema();
    match serde_json::to_string_pretty(&schema) {
        Ok(text) => {
            output::print(&text);
            exit::OK
        }
        Err(error) => {
            output::error(&format!("cannot render the schema: {error}"));
            exit::FAILED
        }
    }
}
