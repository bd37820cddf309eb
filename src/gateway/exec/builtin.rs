//! Tools built into the binary: `clock.now`, `skills.get` and `memory.write` (which hands the
//! proposal to the run: memory belongs to the runtime, see [`crate::memory`]).

use serde_json::{Value, json};

use super::{ExecContext, ToolError};
use crate::workspace::BuiltinTool;

/// Largest skill file served.
const MAX_SKILL_BYTES: u64 = 1 << 20;

pub(super) async fn run(
    context: &ExecContext<'_>,
    tool: BuiltinTool,
    arguments: &Value,
) -> Result<Value, ToolError> {
    match tool {
        BuiltinTool::ClockNow => {
            let now = chrono::Utc::now();
            Ok(json!({
                "now": now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                "unix": now.timestamp(),
                "timezone": "UTC",
            }))
        }
        BuiltinTool::SkillsGet => skills_get(context, arguments).await,
        BuiltinTool::MemoryWrite => {
            let content = arguments
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let metadata = arguments
                .get("metadata")
                .cloned()
                .unwrap_or_else(|| json!({}));
            context
                .host
                .remember(content, metadata)
                .await
                .map_err(|(code, message)| ToolError::new(code, message))
        }
    }
}

/// Without `name`: the agent's skills. With `name`: that skill's text.
async fn skills_get(context: &ExecContext<'_>, arguments: &Value) -> Result<Value, ToolError> {
    let skills = &context.agent.skills;
    let Some(name) = arguments.get("name").and_then(Value::as_str) else {
        let names: Vec<&str> = skills.iter().map(|s| s.name.as_str()).collect();
        return Ok(json!({ "skills": names }));
    };
    let Some(skill) = skills.iter().find(|s| s.name == name) else {
        let names: Vec<&str> = skills.iter().map(|s| s.name.as_str()).collect();
        return Err(ToolError::new(
            "unknown_skill",
            format!(
                "agent `{}` has no skill `{name}`; it has: {}",
                context.agent.name,
                names.join(", ")
            ),
        ));
    };
    let size = tokio::fs::metadata(&skill.path)
        .await
        .map_err(|e| ToolError::new("unavailable", format!("skill `{name}` cannot be read: {e}")))?
        .len();
    if size > MAX_SKILL_BYTES {
        return Err(ToolError::new(
            "output_too_large",
            format!("skill `{name}` is {size} bytes; at most {MAX_SKILL_BYTES} are served"),
        ));
    }
    let content = tokio::fs::read_to_string(&skill.path).await.map_err(|e| {
        ToolError::new("unavailable", format!("skill `{name}` cannot be read: {e}"))
    })?;
    Ok(json!({ "name": name, "content": content }))
}
