//! `stable-harness validate`: every problem at once, or the inventory — as text, or with
//! `--json` as a JSON array of diagnostics (invalid) or a JSON inventory (valid), for scripts
//! and CI that check what a workspace serves.

use super::{ValidateArgs, exit, output};
use crate::workspace::{
    self, CompiledWorkspace, ToolImplementation, UpstreamUrl, WorkflowTarget, inventory, wire_name,
};

pub fn run(args: &ValidateArgs) -> u8 {
    let result = workspace::load(&args.workspace);
    if args.json {
        let rendered = match &result {
            Ok(compiled) => serde_json::to_string_pretty(&inventory(compiled)),
            Err(diagnostics) => serde_json::to_string_pretty(&diagnostics.0),
        };
        match rendered {
            Ok(text) => output::print(&text),
            Err(error) => output::error(&format!("cannot render the result: {error}")),
        }
    } else {
        match &result {
            Ok(compiled) => {
                output::print(&summary(&args.workspace.display().to_string(), compiled))
            }
            Err(diagnostics) => output::error(&diagnostics.to_string()),
        }
    }
    if result.is_ok() {
        exit::OK
    } else {
        exit::USAGE
    }
}

/// The inventory in a few lines: what `start` would serve.
pub fn summary(name: &str, workspace: &CompiledWorkspace) -> String {
    let runtime = &workspace.runtime;
    let mut lines = vec![format!(
        "{name}: valid — {} agent(s), {} model(s), {} tool(s), {} workflow(s)",
        workspace.agents.len(),
        workspace.models.len(),
        workspace.tools.len(),
        workspace.workflows.len()
    )];
    lines.push(format!(
        "  runtime   {} (default agent: {}; store: {}; {} governance rule(s), default {})",
        runtime.name,
        runtime.default_agent.as_deref().unwrap_or("none"),
        runtime.store_url.as_deref().unwrap_or("embedded SQLite"),
        runtime.governance.rules.len(),
        wire_name(&runtime.governance.default),
    ));
    for agent in workspace.agents.values() {
        let model = agent
            .model
            .as_deref()
            .map(|m| format!(", model {m}"))
            .unwrap_or_default();
        lines.push(format!(
            "  agent     {} ({}{model}; tools: {})",
            agent.name,
            wire_name(&agent.backend),
            list(&agent.tools)
        ));
    }
    for model in workspace.models.values() {
        let upstream = match &model.base_url {
            UpstreamUrl::Fixed(url) => url.clone(),
            UpstreamUrl::FromEnv(var) => format!("${var}"),
        };
        lines.push(format!(
            "  model     {} -> {} at {upstream}",
            model.id, model.upstream_model
        ));
    }
    for tool in workspace.tools.values() {
        let detail = match &tool.implementation {
            ToolImplementation::Mcp { server, tool, .. } => format!("mcp {server}/{tool}"),
            other => other.kind().to_owned(),
        };
        lines.push(format!(
            "  tool      {} ({detail}, risk {})",
            tool.id,
            wire_name(&tool.risk)
        ));
    }
    for workflow in workspace.workflows.values() {
        let agents = workflow
            .nodes
            .iter()
            .filter(|n| matches!(n.target, WorkflowTarget::Agent(_)))
            .count();
        lines.push(format!(
            "  workflow  {} ({} node(s), {agents} agent node(s), entry {})",
            workflow.name,
            workflow.nodes.len(),
            workflow.entry
        ));
    }
    lines.join("\n")
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}
