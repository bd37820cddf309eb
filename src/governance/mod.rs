//! Governance: the policy that decides `allow | deny | needs_approval` for a tool call from
//! typed inputs only (tool id, risk, agent, labels, request metadata). Rules are tried in
//! order and the first match wins; with none, the workspace's default applies.
//!
//! Two kinds of key-value conditions, kept apart on purpose: `labels` are trusted (the tool's,
//! the agent's, the caller's key's and the Runtime's, from the workspace), `metadata` is what
//! the client sent with the request. A client can set metadata to anything, so the compiler
//! only accepts it on rules that tighten (`deny`, `needs_approval`), never on `allow`.
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
    /// `metadata.labels` of the Runtime document.
    pub runtime_labels: &'a BTreeMap<String, String>,
    /// Labels of the caller's key (`protocols.openai.keys[].labels`); empty for unnamed keys.
    pub key_labels: &'a BTreeMap<String, String>,
    /// The request's client-supplied metadata (an object), matched by `match.metadata` only.
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
        "rule `{rule}` matches request metadata `{key}`, but the request gives it a {found} value; matched metadata values are strings, numbers or booleans"
    )]
    MetadataNotScalar {
        rule: String,
        key: String,
        found: &'static str,
    },
    #[error("the policy did not decide within policyTimeout ({0:?})")]
    Timeout(std::time::Duration),
}

/// Decides for one call. First matching rule wins, else the default. Evaluation is bounded
/// by `policyTimeout`: past it, no further rule is tried and the answer is an error (which
/// [`evaluate_or_deny`] turns into a denial).
pub fn evaluate(
    governance: &GovernanceConfig,
    input: PolicyInput<'_>,
) -> Result<Verdict, PolicyError> {
    let started = std::time::Instant::now();
    for rule in &governance.rules {
        if started.elapsed() >= governance.policy_timeout {
            return Err(PolicyError::Timeout(governance.policy_timeout));
        }
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
        rule: Some(
            match error {
                PolicyError::Timeout(_) => "policy_timeout",
                PolicyError::MetadataNotScalar { .. } => "policy_error",
            }
            .to_owned(),
        ),
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
        if label_value(label, input) != Some(wanted.as_str()) {
            return Ok(false);
        }
    }
    for (key, wanted) in &rule.metadata {
        match metadata_value(rule, key, input.metadata)? {
            Some(value) if value == *wanted => {}
            _ => return Ok(false),
        }
    }
    Ok(true)
}

/// A trusted label's value: the most specific source that sets it wins (tool, then agent,
/// then the caller's key, then the Runtime). Never request metadata.
fn label_value<'a>(label: &str, input: PolicyInput<'a>) -> Option<&'a str> {
    [
        &input.tool.labels,
        &input.agent.labels,
        input.key_labels,
        input.runtime_labels,
    ]
    .into_iter()
    .find_map(|labels| labels.get(label))
    .map(String::as_str)
}

/// A request metadata value as text; a list or object cannot be compared, so it is an error
/// (and the call is denied) rather than a silent non-match.
fn metadata_value(
    rule: &PolicyRule,
    key: &str,
    metadata: &Value,
) -> Result<Option<String>, PolicyError> {
    match metadata.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(Value::Bool(flag)) => Ok(Some(flag.to_string())),
        Some(Value::Number(number)) => Ok(Some(number.to_string())),
        Some(other) => Err(PolicyError::MetadataNotScalar {
            rule: rule.name.clone(),
            key: key.to_owned(),
            found: if other.is_array() { "list" } else { "object" },
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::{Value, json};

    use super::*;
    use crate::workspace::CompiledWorkspace;

    /// Runtime labels `env: prod`, agent `tier: gold`, tool `clock.now` `tier: bronze`.
    fn workspace() -> (tempfile::TempDir, CompiledWorkspace) {
        let dir = tempfile::tempdir().unwrap();
        let files = [
            (
                "config/runtime.yaml",
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test, labels: { env: prod } }\nspec:\n  governance:\n    default: allow\n    rules:\n      - { name: finance-key, match: { labels: { team: finance } }, decision: deny }\n      - { name: sandbox, match: { metadata: { sandbox: \"true\" } }, decision: deny }\n      - { name: gold, match: { labels: { tier: gold } }, decision: needs_approval }\n      - { name: prod-clock, match: { tools: [clock.now], labels: { env: prod } }, decision: needs_approval }\n",
            ),
            (
                "config/agent.yaml",
                "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant, labels: { tier: gold } }\nspec:\n  backend: scripted\n  tools: [echo, clock.now]\n  script: [{ reply: hi }]\n",
            ),
            (
                "config/tools.yaml",
                "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: echo, builtin: clock.now }\n    - { id: clock.now, labels: { tier: bronze }, builtin: clock.now }\n",
            ),
        ];
        for (path, text) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        let compiled = crate::workspace::load(dir.path()).unwrap_or_else(|d| panic!("{d}"));
        (dir, compiled)
    }

    fn decide(
        workspace: &CompiledWorkspace,
        tool: &str,
        key_labels: &[(&str, &str)],
        metadata: Value,
    ) -> Result<(Decision, Option<String>), PolicyError> {
        let key_labels: BTreeMap<String, String> = key_labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let input = PolicyInput {
            agent: &workspace.agents["assistant"],
            tool: &workspace.tools[tool],
            runtime_labels: &workspace.runtime.labels,
            key_labels: &key_labels,
            metadata: &metadata,
        };
        evaluate(&workspace.runtime.governance, input).map(|v| (v.decision, v.rule))
    }

    #[test]
    fn labels_are_trusted_sources_only_and_metadata_is_matched_apart() {
        let (_dir, ws) = workspace();
        let rule = |name: &str| Some(name.to_owned());
        // The caller's key labels are matched by `labels`.
        assert_eq!(
            decide(&ws, "echo", &[("team", "finance")], json!({})),
            Ok((Decision::Deny, rule("finance-key")))
        );
        // Request metadata never satisfies `labels`: the same pair sent by the client is
        // ignored by `finance-key`; the agent's `tier: gold` decides instead.
        assert_eq!(
            decide(&ws, "echo", &[], json!({ "team": "finance" })),
            Ok((Decision::NeedsApproval, rule("gold")))
        );
        // The tool's own label wins over the key's; the Runtime's label is used last.
        assert_eq!(
            decide(&ws, "clock.now", &[("tier", "gold")], json!({})),
            Ok((Decision::NeedsApproval, rule("prod-clock")))
        );
        // The key's label wins over the Runtime's.
        assert_eq!(
            decide(&ws, "clock.now", &[("env", "staging")], json!({})),
            Ok((Decision::Allow, None))
        );
        // `metadata` matches request metadata; scalars compare as text.
        assert_eq!(
            decide(&ws, "echo", &[], json!({ "sandbox": true })),
            Ok((Decision::Deny, rule("sandbox")))
        );
        assert_eq!(
            decide(&ws, "clock.now", &[], json!({ "sandbox": "false" })),
            Ok((Decision::NeedsApproval, rule("prod-clock")))
        );
    }

    #[test]
    fn metadata_that_cannot_be_compared_fails_closed() {
        let (_dir, ws) = workspace();
        let metadata = json!({ "sandbox": ["true"] });
        assert_eq!(
            decide(&ws, "echo", &[], metadata.clone()),
            Err(PolicyError::MetadataNotScalar {
                rule: "sandbox".into(),
                key: "sandbox".into(),
                found: "list",
            })
        );
        let input = PolicyInput {
            agent: &ws.agents["assistant"],
            tool: &ws.tools["echo"],
            runtime_labels: &ws.runtime.labels,
            key_labels: &BTreeMap::new(),
            metadata: &metadata,
        };
        let verdict = evaluate_or_deny(&ws.runtime.governance, input);
        assert_eq!(verdict.decision, Decision::Deny);
        assert_eq!(verdict.rule.as_deref(), Some("policy_error"));
    }

    #[test]
    fn a_policy_out_of_time_denies_with_rule_policy_timeout() {
        let (_dir, mut ws) = workspace();
        ws.runtime.governance.policy_timeout = std::time::Duration::ZERO;
        let input = PolicyInput {
            agent: &ws.agents["assistant"],
            tool: &ws.tools["echo"],
            runtime_labels: &ws.runtime.labels,
            key_labels: &BTreeMap::new(),
            metadata: &json!({}),
        };
        let verdict = evaluate_or_deny(&ws.runtime.governance, input);
        assert_eq!(verdict.decision, Decision::Deny);
        assert_eq!(verdict.rule.as_deref(), Some("policy_timeout"));
    }
}
