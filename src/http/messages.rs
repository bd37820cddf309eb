//! Chat messages as clients send them, checked once for every surface: `/v1` and `/runtime`
//! refuse what no model accepts (an unknown role, a missing or mistyped content) with 400
//! `invalid_message` naming the field, instead of passing it on to fail upstream as a 502.

use serde_json::Value;

use crate::error::{ApiError, ErrorCode};

/// The roles a message may have.
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Checks each message's `role` and `content`; `prefix` is where the list sits in the body
/// (`messages`, `input.messages`), so the error's `param` is e.g. `input.messages[2].role`.
/// An assistant message may leave `content` out or null (it carries tool calls instead).
pub fn validate_messages(messages: &[Value], prefix: &str) -> Result<(), ApiError> {
    validate_messages_after(messages, prefix, 0)
}

/// [`validate_messages`] for messages that follow `before` others in the list.
pub fn validate_messages_after(
    messages: &[Value],
    prefix: &str,
    before: usize,
) -> Result<(), ApiError> {
    for (index, message) in (before..).zip(messages) {
        let role = message.get("role").and_then(Value::as_str);
        let Some(role) = role.filter(|role| ROLES.contains(role)) else {
            return Err(ApiError::new(
                ErrorCode::InvalidMessage,
                format!("{prefix}[{index}].role must be one of {}", ROLES.join(", ")),
            )
            .param(format!("{prefix}[{index}].role")));
        };
        match message.get("content") {
            Some(Value::String(_) | Value::Array(_)) => {}
            None | Some(Value::Null) if role == "assistant" => {}
            _ => {
                return Err(ApiError::new(
                    ErrorCode::InvalidMessage,
                    format!("{prefix}[{index}].content must be a string or an array of parts"),
                )
                .param(format!("{prefix}[{index}].content")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::validate_messages;

    #[test]
    fn names_the_field_at_fault() {
        let param = |messages: serde_json::Value| {
            validate_messages(messages.as_array().unwrap(), "input.messages")
                .err()
                .and_then(|error| error.param)
        };
        assert_eq!(param(json!([{ "role": "user", "content": "hi" }])), None);
        assert_eq!(
            param(json!([{ "role": "assistant", "content": null }])),
            None
        );
        assert_eq!(
            param(json!([{ "role": "user", "content": "a" }, { "role": "bogus", "content": "b" }])),
            Some("input.messages[1].role".into())
        );
        assert_eq!(param(json!([5])), Some("input.messages[0].role".into()));
        assert_eq!(
            param(json!([{ "role": "user" }])),
            Some("input.messages[0].content".into())
        );
        assert_eq!(
            param(json!([{ "role": "tool", "content": { "x": 1 } }])),
            Some("input.messages[0].content".into())
        );
    }
}
