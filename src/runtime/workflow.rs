//! Workflows: a request that runs a graph of nodes over existing agents and tools. Each node
//! is a run of the request (attempt = step), its events in the request's `seq`. A node's run
//! ends with a transition committed in one group: the node's run ends, the decision log
//! records its outcome and the edge taken (`runtime.workflow.node.completed`), and the next
//! node's run is inserted (`runtime.workflow.node.started`) — or the request ends with the
//! workflow. So a crash loses no step: a node that ended never runs again, and the node that
//! was running resumes like any run (its place in the workflow is in its checkpoint).
//! Edges branch on the recorded outcome of the node they leave (its status, or a tool node's
//! decision), never on text.

use chrono::Utc;
use serde_json::{Value, json};

use crate::store::{RunRecord, RunStatus};
use crate::workspace::{
    AgentConfig, EdgeCondition, NodeDecision, NodeInput, NodeOutcome, WorkflowConfig, WorkflowNode,
    WorkflowTarget,
};

pub const WORKFLOW_STARTED: &str = "runtime.workflow.started";
pub const NODE_STARTED: &str = "runtime.workflow.node.started";
pub const NODE_COMPLETED: &str = "runtime.workflow.node.completed";
pub const WORKFLOW_COMPLETED: &str = "runtime.workflow.completed";
pub const WORKFLOW_FAILED: &str = "runtime.workflow.failed";

/// Which node of which workflow a run executes, kept in the run's checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeJob {
    pub workflow: String,
    pub node: String,
    /// 1 for the entry node; the run's attempt.
    pub step: u32,
    /// The output of the last agent node before this one (`None` before the first).
    pub last_output: Option<String>,
    /// The request's own input, which `input: original` nodes get.
    pub original: Vec<Value>,
}

impl NodeJob {
    /// The checkpoint of a node run: its place, and its conversation.
    pub fn state<M: serde::Serialize + ?Sized>(&self, messages: &M) -> Value {
        json!({
            "workflow": { "id": self.workflow, "node": self.node, "step": self.step,
                "lastOutput": self.last_output, "original": self.original },
            "messages": messages,
        })
    }

    /// The node a run's checkpoint names, if it is a workflow node's.
    pub fn from_state(state: &Value) -> Option<Self> {
        let place = state.get("workflow")?;
        Some(Self {
            workflow: place.get("id")?.as_str()?.to_owned(),
            node: place.get("node")?.as_str()?.to_owned(),
            step: u32::try_from(place.get("step")?.as_u64()?).ok()?,
            last_output: place
                .get("lastOutput")
                .and_then(Value::as_str)
                .map(str::to_owned),
            original: place
                .get("original")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
        })
    }

    /// A tool node's arguments: its own, else the previous agent node's structured output
    /// (an object), else none.
    pub fn arguments(&self, node: &WorkflowNode) -> Value {
        node.arguments.clone().unwrap_or_else(|| {
            self.last_output
                .as_deref()
                .and_then(|text| serde_json::from_str::<Value>(text).ok())
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}))
        })
    }

    /// The messages an agent node starts from.
    pub fn input(&self, node: &WorkflowNode) -> Vec<Value> {
        match (node.input, &self.last_output) {
            (NodeInput::Previous, Some(previous)) => {
                vec![json!({ "role": "user", "content": previous })]
            }
            _ => self.original.clone(),
        }
    }

    /// The agent a node run answers as: the node's agent, or for a tool node the workflow
    /// itself, allowed that one tool (policy sees the workflow's name as the agent).
    pub fn tool_caller(workflow: &WorkflowConfig, tool: &str) -> AgentConfig {
        AgentConfig {
            name: workflow.name.clone(),
            labels: Default::default(),
            description: workflow.description.clone(),
            backend: crate::workspace::Backend::Scripted,
            model: None,
            instructions: None,
            tools: vec![tool.to_owned()],
            subagents: Vec::new(),
            skills: Vec::new(),
            max_iterations: 1,
            timeout: std::time::Duration::from_secs(24 * 3600),
            memory: None,
            required_evidence_tools: Vec::new(),
            backend_config: Default::default(),
            script: Vec::new(),
            endpoint: None,
            retention: None,
            client_tools: None,
            response_schema: None,
        }
    }
}

/// How a node ended, as edges see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NodeResult<'o> {
    pub outcome: NodeOutcome,
    /// Tool nodes: the gateway's decision.
    pub decision: Option<NodeDecision>,
    /// Agent nodes with a `responseSchema`: the output, parsed.
    pub output: Option<&'o Value>,
}

/// The first edge out of `node` whose condition holds.
pub fn next_node<'w>(
    workflow: &'w WorkflowConfig,
    node: &str,
    result: NodeResult<'_>,
) -> Option<&'w str> {
    workflow
        .edges
        .iter()
        .filter(|edge| edge.from == node)
        .find(|edge| match &edge.when {
            None => true,
            Some(EdgeCondition::Status(status)) => *status == result.outcome,
            Some(EdgeCondition::Decision(decision)) => result.decision == Some(*decision),
            Some(EdgeCondition::Output(condition)) => result
                .output
                .and_then(|output| output.pointer(&condition.pointer))
                .is_some_and(|value| *value == condition.equals),
        })
        .map(|edge| edge.to.as_str())
}

/// A node's run and its `node.started` event data, inserted queued.
pub fn node_run(request_id: &str, job: &NodeJob, messages: &[Value]) -> (RunRecord, Value) {
    let now = Utc::now();
    let run = RunRecord {
        state: Some(job.state(messages)),
        ..RunRecord::new(
            super::new_id("run"),
            request_id.to_owned(),
            i64::from(job.step),
            RunStatus::Queued,
            now,
        )
    };
    let started =
        json!({ "workflowId": job.workflow, "node": job.node, "step": job.step, "runId": run.id });
    (run, started)
}

/// The agent a node's run executes, or `None` for a tool node.
pub fn node_agent(node: &WorkflowNode) -> Option<&str> {
    match &node.target {
        WorkflowTarget::Agent(agent) => Some(agent),
        WorkflowTarget::Tool(_) => None,
    }
}

/// The edge a node took, as the decision log records it (`null`: none, the workflow ended).
pub fn describe_edge(to: Option<&str>) -> Value {
    match to {
        Some(to) => json!({ "to": to }),
        None => Value::Null,
    }
}
