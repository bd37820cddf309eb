//! Tools the `/v1` client supplies with a request (Responses or Chat Completions `tools`), for
//! agents that opt in with `clientTools`. Each becomes a per-request [`ToolConfig`] with the
//! policy id `client.<name>`, the risk the agent gives client tools and the client's JSON
//! Schema compiled once, so the gateway governs its calls exactly like the workspace's tools.
//! An allowed call is never run here: it goes back to the client, which runs it and sends the
//! result with its next call.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::workspace::{
    CLIENT_TOOL_PREFIX, InterruptedAction, Risk, ToolConfig, ToolImplementation,
};

/// Most client tools one request may bring (OpenAI's own limit).
pub const MAX_CLIENT_TOOLS: usize = 128;

/// A client tool refused, and where (`index` in the request's `tools`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tools[{index}]: {message}")]
pub struct ClientToolError {
    pub index: usize,
    pub message: String,
}

/// One function tool as the client defined it, whichever surface it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientFunction {
    /// Where it sits in the request's `tools` (for errors).
    pub index: usize,
    pub name: String,
    pub description: Option<String>,
    /// `None`: no parameters (an empty object).
    pub parameters: Option<Value>,
}

impl ClientFunction {
    /// The stored form (`{name, description, parameters}`): what a resumed run compiles again.
    pub fn to_json(&self) -> Value {
        json!({ "name": self.name, "description": self.description, "parameters": self.parameters })
    }

    /// Reads the stored form back.
    pub fn from_json(index: usize, value: &Value) -> Option<Self> {
        Some(Self {
            index,
            name: value.get("name")?.as_str()?.to_owned(),
            description: value
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_owned),
            parameters: value.get("parameters").filter(|p| !p.is_null()).cloned(),
        })
    }
}

/// The policy id of the client tool `name`.
pub fn client_tool_id(name: &str) -> String {
    format!("{CLIENT_TOOL_PREFIX}{name}")
}

/// Checks and compiles a request's client tools: names OpenAI accepts and unique, parameters a
/// valid JSON Schema of an object.
pub fn compile(
    functions: &[ClientFunction],
    risk: Risk,
) -> Result<Vec<ToolConfig>, ClientToolError> {
    if let Some(extra) = functions.get(MAX_CLIENT_TOOLS) {
        return Err(ClientToolError {
            index: extra.index,
            message: format!("at most {MAX_CLIENT_TOOLS} tools may be supplied"),
        });
    }
    let mut tools: Vec<ToolConfig> = Vec::with_capacity(functions.len());
    for function in functions {
        let refuse = |message: String| ClientToolError {
            index: function.index,
            message,
        };
        let name = &function.name;
        let valid_name = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !valid_name {
            return Err(refuse(format!(
                "the name `{name}` is not a valid function name (1 to 64 of a-z, A-Z, 0-9, _ and -)"
            )));
        }
        let id = client_tool_id(name);
        if tools.iter().any(|tool| tool.id == id) {
            return Err(refuse(format!("the name `{name}` is used twice")));
        }
        let schema = function
            .parameters
            .clone()
            .unwrap_or_else(|| json!({ "type": "object", "properties": {} }));
        if !schema.is_object() {
            return Err(refuse(
                "`parameters` must be a JSON Schema object".to_owned(),
            ));
        }
        let validator = jsonschema::validator_for(&schema)
            .map_err(|error| refuse(format!("`parameters` is not a valid JSON Schema: {error}")))?;
        tools.push(ToolConfig {
            id,
            description: function.description.clone(),
            input_schema: schema,
            input_validator: Arc::new(validator),
            risk,
            labels: [("source".to_owned(), "client".to_owned())].into(),
            // Never run here: the client runs it.
            timeout: Duration::ZERO,
            on_interrupted: InterruptedAction::Fail,
            implementation: ToolImplementation::Client,
        });
    }
    Ok(tools)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{ClientFunction, compile};
    use crate::workspace::Risk;

    fn function(index: usize, name: &str, parameters: Option<serde_json::Value>) -> ClientFunction {
        ClientFunction {
            index,
            name: name.to_owned(),
            description: None,
            parameters,
        }
    }

    #[test]
    fn compiles_valid_tools_and_names_the_bad_one() {
        let tools = compile(
            &[
                function(
                    0,
                    "shell",
                    Some(
                        json!({ "type": "object", "properties": { "cmd": { "type": "string" } } }),
                    ),
                ),
                function(1, "apply_patch", None),
            ],
            Risk::High,
        )
        .unwrap();
        assert_eq!(tools[0].id, "client.shell");
        assert_eq!(tools[1].risk, Risk::High);
        assert!(!tools[0].input_validator.is_valid(&json!({ "cmd": 5 })));

        let bad =
            |functions: &[ClientFunction]| compile(functions, Risk::Medium).unwrap_err().index;
        assert_eq!(
            bad(&[function(0, "ok", None), function(3, "no spaces", None)]),
            3
        );
        assert_eq!(bad(&[function(0, "a", None), function(1, "a", None)]), 1);
        assert_eq!(bad(&[function(0, "a", Some(json!({ "type": 12 })))]), 0);
        assert_eq!(bad(&[function(0, "a", Some(json!("string")))]), 0);
    }
}
