//! The event types of SPEC section 7: the names stored events carry and workspace settings
//! (such as `cli.events.include`) may name.

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
    "runtime.approval.requested",
    "runtime.approval.resolved",
    "runtime.workflow.started",
    "runtime.workflow.completed",
    "runtime.artifact.created",
    "runtime.memory.lifecycle",
    "runtime.memory.recall.completed",
    "runtime.memory.candidate.submitted",
    "runtime.memory.approval.requested",
    "runtime.memory.maintenance.started",
    "runtime.memory.maintenance.completed",
    "runtime.memory.maintenance.failed",
    "runtime.model.call.completed",
    "runtime.retry.scheduled",
    "runtime.budget.exceeded",
    "runtime.adapter.event",
    "runtime.progress.narration",
];
