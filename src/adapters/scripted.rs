//! The `scripted` backend: plays `spec.script` in order for every request, without a model.
//! A `reply` streams its text (`{{input}}` becomes the last user message); the answer is the
//! concatenation of the replies. A `toolCall` step runs through the tool gateway exactly like a
//! model's call; its key (`sN`, N the step) is stable, so a resumed run never repeats it.

use super::{
    AdapterContext, AdapterError, FailureKind, RuntimeAdapter, RuntimeOutput, ToolCall, call_tools,
    last_user_text,
};
use crate::workspace::ScriptStep;

#[derive(Debug, Clone, Copy)]
pub struct ScriptedAdapter;

#[async_trait::async_trait]
impl RuntimeAdapter for ScriptedAdapter {
    async fn run(&self, context: AdapterContext<'_>) -> Result<RuntimeOutput, AdapterError> {
        let input = last_user_text(context.messages.iter());
        let mut text = String::new();
        for (index, step) in context.agent.script.iter().enumerate() {
            if context.cancel.is_cancelled() {
                return Err(AdapterError::new(
                    FailureKind::Cancelled,
                    "the run was cancelled",
                ));
            }
            match step {
                ScriptStep::Reply(template) => {
                    let reply = template.replace("{{input}}", &input);
                    context.events.emit_delta(&reply).await;
                    text.push_str(&reply);
                }
                ScriptStep::ToolCall { tool, arguments } => {
                    let call = ToolCall {
                        key: format!("s{}", index + 1),
                        id: format!("script-{}", index + 1),
                        tool_id: tool.clone(),
                        arguments: arguments.clone().into(),
                    };
                    call_tools(&context, vec![call]).await;
                }
            }
        }
        Ok(RuntimeOutput {
            text,
            cost_usd: None,
            usage: Default::default(),
            finish_reason: "stop".to_owned(),
            client_calls: Vec::new(),
            client_turns: Vec::new(),
        })
    }
}
