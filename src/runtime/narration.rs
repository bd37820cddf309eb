//! The built-in template narrator: turns a few runtime events into one-line progress messages
//! (`runtime.progress.narration`). It only reads events; it never changes execution.

use serde_json::Value;

use super::events::{MODEL_CALL_COMPLETED, REQUEST_STARTED, RETRY_SCHEDULED};
use crate::json;
use crate::workspace::NarrationStyle;

/// The narration of an event, if this event type is narrated.
pub fn narrate(event_type: &str, data: &Value, style: NarrationStyle) -> Option<String> {
    let text = |path: &[&str]| json::str_at(data, path).unwrap_or("?").to_owned();
    let number = |path: &[&str]| json::at(data, path).and_then(Value::as_u64).unwrap_or(0);
    let message = match event_type {
        REQUEST_STARTED => match style {
            NarrationStyle::Concise => format!("Working on it ({}).", text(&["agentId"])),
            NarrationStyle::Verbose => format!(
                "Started agent `{}` ({} backend), attempt {}.",
                text(&["agentId"]),
                text(&["backend"]),
                number(&["attempt"])
            ),
        },
        MODEL_CALL_COMPLETED => match style {
            NarrationStyle::Concise => format!(
                "Model {} answered in {} ms.",
                text(&["model"]),
                number(&["latencyMs"])
            ),
            NarrationStyle::Verbose => format!(
                "Model `{}` ({}) answered in {} ms using {} tokens (attempt {}).",
                text(&["model"]),
                text(&["upstreamModel"]),
                number(&["latencyMs"]),
                number(&["usage", "total_tokens"]),
                number(&["attempt"])
            ),
        },
        RETRY_SCHEDULED => format!(
            "The model call failed ({}); retrying in {} ms (attempt {}).",
            text(&["errorKind"]),
            number(&["delayMs"]),
            number(&["attempt"])
        ),
        _ => return None,
    };
    Some(message)
}
