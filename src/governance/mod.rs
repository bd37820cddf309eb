//! Governance: the policy that decides `allow | deny | needs_approval` for a tool call from
//! typed inputs only (tool id, risk, labels, agent, request metadata). Rules are tried in
//! order and the first match wins; with none, the workspace's default applies.
//!
//! The policy fails closed: an input it cannot evaluate is an error, and the gateway turns any
//! error into `deny`. The durable approval queue that `needs_approval` leads to lives in the
//! store and the gateway; this module only decides.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::workspace::{
    AgentConfig, Decision, GovernanceConfig, PolicyRule, ToolConfig, glob_matches, wire_name,
};

/// What the policy looks at; nothing else (never the arguments' text).
#[derive(Debug, Clone, Copy)]
pub struct PolicyInput<'a> {
    pub agent: &'a AgentConfig,
    pub tool: &'a ToolConfig,
    /// The request's metadata (an object); its scalar values act as labels.
    pub metadata: &'a Value,
}

/// A decision and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    #[schema(value_type = String, example = "needs_approval")]
    pub decision: Decision,
    /// The rule that matched; `None` when the default decided.
    pub rule: Option<String>,
    pub reason: String,
}

/// The policy could not evaluate its input; the caller denies.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "rule `{rule}` matches label `{label}`, but the request metadata gives it a {found} value; labels are strings, numbers or booleans"
    )]
    LabelNotScalar {
        rule: String,
        label: String,
        found: &'static str,
    },
}

/// Decides for one call. First matching rule wins, else the default.
pub fn evaluate(
    governance: &GovernanceConfig,
    input: PolicyInput<'_>,
) -> Result<Verdict, PolicyError> {
    for rule in &governance.rules {
        if rule_matches(rule, input)? {
            let reason = rule.reason.clone().unwrap_or_else(|| {
                format!(
                    "rule `{}` decides {} for tool `{}`",
                    rule.name,
                    wire_name(&rule.decision),
                    input.tool.id
                )
            });
            return Ok(Verdict {
                decision: rule.decision,
                rule: Some(rule.name.clone()),
                reason,
            });
        }
    }
    Ok(Verdict {
        decision: governance.default,
        rule: None,
        reason: format!(
            "no rule matched; the default decision is {}",
            wire_name(&governance.default)
        ),
    })
}

/// The verdict, with any evaluation error turned into a denial (fail closed).
pub fn evaluate_or_deny(governance: &GovernanceConfig, input: PolicyInput<'_>) -> Verdict {
    evaluate(governance, input).unwrap_or_else(|error| Verdict {
        decision: Decision::Deny,
        rule: Some("policy_error".to_owned()),
        reason: format!("the policy could not decide, so the call is denied: {error}"),
    })
}

/// Every condition of a rule must hold; a list condition holds when any entry matches.
fn rule_matches(rule: &PolicyRule, input: PolicyInput<'_>) -> Result<bool, PolicyError> {
    // An empty list places no condition.
    let any_matches = |patterns: &[String], text: &str| {
        patterns.is_empty() || patterns.iter().any(|pattern| glob_matches(pattern, text))
    };
    if !any_matches(&rule.tools, &input.tool.id) || !any_matches(&rule.agents, &input.agent.name) {
        return Ok(false);
    }
    if !rule.risk.is_empty() && !rule.risk.contains(&input.tool.risk) {
        return Ok(false);
    }
    for (label, wanted) in &rule.labels {
        match label_value(rule, label, input)? {
            Some(value) if value == *wanted => {}
            _ => return Ok(false),
        }
    }
    Ok(true)
}

/// A label's value: the tool's own labels first, then the agent's, then request metadata.
fn label_value(
    rule: &PolicyRule,
    label: &str,
    input: PolicyInput<'_>,
) -> Result<Option<String>, PolicyError> {
    let from_config = |labels: &BTreeMap<String, String>| labels.get(label).cloned();
    if let Some(value) =
        from_config(&input.tool.labels).or_else(|| from_config(&input.agent.labels))
    {
        return Ok(Some(value));
    }
    match input.metadata.get(label) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(Value::Bool(flag)) => Ok(Some(flag.to_string())),
        Some(Value::Number(number)) => Ok(Some(number.to_string())),
        Some(other) => Err(PolicyError::LabelNotScalar {
            rule: rule.name.clone(),
            label: label.to_owned(),
            found: if other.is_array() { "list" } else { "object" },
        }),
    }
}
