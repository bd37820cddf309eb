//! The event types of SPEC section 7: the names stored events carry and workspace settings
//! (such as `cli.events.include`) may name.

pub const REQUEST_STARTED: &str = "runtime.request.started";
pub const REQUEST_COMPLETED: &str = "runtime.request.completed";
pub const REQUEST_FAILED: &str = "runtime.request.failed";
pub const REQUEST_CANCELLED: &str = "runtime.request.cancelled";
pub const MODEL_CALL_COMPLETED: &str = "runtime.model.call.completed";
pub const RETRY_SCHEDULED: &str = "runtime.retry.scheduled";
/// A call was charged to the budgets (its usage, cost, whether estimated).
pub const USAGE_RECORDED: &str = "runtime.usage.recorded";
/// A budget refused a model call: the run stops before it.
pub const BUDGET_EXCEEDED: &str = "runtime.budget.exceeded";
pub const ADAPTER_EVENT: &str = "runtime.adapter.event";
pub const PROGRESS_NARRATION: &str = "runtime.progress.narration";
pub const TOOL_DIRECT_STARTED: &str = "runtime.tool.direct.started";
pub const TOOL_DIRECT_COMPLETED: &str = "runtime.tool.direct.completed";
pub const TOOL_DENIED: &str = "runtime.tool.denied";
/// A client tool's call, allowed and handed to the client to run.
pub const TOOL_CLIENT_REQUESTED: &str = "runtime.tool.client.requested";
/// The client brought a client tool call's result with its next call.
pub const TOOL_CLIENT_COMPLETED: &str = "runtime.tool.client.completed";
pub const APPROVAL_REQUESTED: &str = "runtime.approval.requested";
pub const APPROVAL_RESOLVED: &str = "runtime.approval.resolved";
pub const MEMORY_LIFECYCLE: &str = "runtime.memory.lifecycle";
pub const MEMORY_RECALL_COMPLETED: &str = "runtime.memory.recall.completed";
pub const MEMORY_CANDIDATE_SUBMITTED: &str = "runtime.memory.candidate.submitted";
pub const MEMORY_APPROVAL_REQUESTED: &str = "runtime.memory.approval.requested";
pub const MEMORY_PLUGIN_FAILED: &str = "runtime.memory.plugin.failed";

/// Adapter phases (`data.event.phase` of `runtime.adapter.event`).
pub const PHASE_OUTPUT_DELTA: &str = "agent.output.delta";
pub const PHASE_TOOL_START: &str = "agent.tool.start";
pub const PHASE_TOOL_RESULT: &str = "agent.tool.result";
pub const PHASE_HANDOFF: &str = "agent.handoff";

/// The data of a `runtime.adapter.event` carrying output text.
pub fn output_delta(text: &str) -> serde_json::Value {
    serde_json::json!({ "event": { "phase": PHASE_OUTPUT_DELTA, "text": text } })
}

/// The text of an output delta event's data, when `data` is exactly that.
pub fn output_delta_text(data: &serde_json::Value) -> Option<&str> {
    let outer = data.as_object()?;
    let event = outer.get("event")?.as_object()?;
    let exact = outer.len() == 1
        && event.len() == 2
        && event.get("phase").and_then(serde_json::Value::as_str) == Some(PHASE_OUTPUT_DELTA);
    exact.then(|| event.get("text")?.as_str()).flatten()
}

/// Whether an event of this type ends its request (nothing follows it for that run).
pub fn is_terminal(event_type: &str) -> bool {
    matches!(
        event_type,
        REQUEST_COMPLETED | REQUEST_FAILED | REQUEST_CANCELLED
    )
}

/// Every runtime event type, as stored and streamed.
pub const EVENT_TYPES: &[&str] = &[
    "runtime.request.started",
    "runtime.request.completed",
    "runtime.request.failed",
    "runtime.request.cancelled",
    "runtime.execution.contract.failed",
    "runtime.tool.direct.started",
    "runtime.tool.direct.completed",
    "runtime.tool.denied",
    "runtime.tool.client.requested",
    "runtime.tool.client.completed",
    "runtime.approval.requested",
    "runtime.approval.resolved",
    "runtime.workflow.started",
    "runtime.workflow.node.started",
    "runtime.workflow.node.completed",
    "runtime.workflow.completed",
    "runtime.workflow.failed",
    "runtime.artifact.created",
    "runtime.memory.lifecycle",
    "runtime.memory.recall.completed",
    "runtime.memory.candidate.submitted",
    "runtime.memory.approval.requested",
    "runtime.memory.plugin.failed",
    "runtime.memory.maintenance.started",
    "runtime.memory.maintenance.completed",
    "runtime.memory.maintenance.failed",
    "runtime.model.call.completed",
    "runtime.retry.scheduled",
    "runtime.budget.exceeded",
    "runtime.usage.recorded",
    "runtime.adapter.event",
    "runtime.progress.narration",
];

/// The categories of a run's trace (SPEC section 7), in the order views list them.
pub const TRACE_CATEGORIES: [&str; 9] = [
    "request",
    "model",
    "tool",
    "approval",
    "adapter",
    "plan",
    "delegation",
    "memory",
    "artifact",
];

/// The trace category of an event: by its type, and for an adapter's own signal by its phase
/// (a handoff is delegation; a plan step is plan).
pub fn category(event_type: &str, data: &serde_json::Value) -> &'static str {
    let family = event_type
        .strip_prefix("runtime.")
        .and_then(|rest| rest.split('.').next())
        .unwrap_or("");
    match family {
        "model" | "retry" | "usage" | "budget" => "model",
        "tool" => "tool",
        "approval" => "approval",
        "memory" => "memory",
        "artifact" => "artifact",
        "workflow" => "plan",
        "adapter" | "progress" => {
            let phase = crate::json::str_at(data, &["event", "phase"]).unwrap_or("");
            if phase == PHASE_HANDOFF {
                "delegation"
            } else if phase.starts_with("agent.plan") {
                "plan"
            } else {
                "adapter"
            }
        }
        _ => "request",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{TRACE_CATEGORIES, category};

    #[test]
    fn every_event_has_a_category_of_the_trace() {
        for event_type in super::EVENT_TYPES {
            assert!(TRACE_CATEGORIES.contains(&category(event_type, &json!({}))));
        }
        assert_eq!(category("runtime.tool.denied", &json!({})), "tool");
        assert_eq!(category("runtime.retry.scheduled", &json!({})), "model");
        assert_eq!(
            category(
                "runtime.adapter.event",
                &json!({ "event": { "phase": "agent.handoff" } })
            ),
            "delegation"
        );
        assert_eq!(
            category("runtime.execution.contract.failed", &json!({})),
            "request"
        );
    }
}
