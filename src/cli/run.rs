//! `stable-harness run`: one request in-process against the same runtime and store. Prints
//! narration (or every event as a JSON line with `--json`), then the final output. Exit codes:
//! 0 completed, 1 failed, 2 bad usage or invalid workspace, 3 cancelled or an approval denied.
//!
//! A tool call that needs approval is asked about on the terminal; without a terminal it is
//! denied, unless `--approve-all` approves every call of this run.

use std::sync::Arc;

use futures::StreamExt;
use serde_json::{Value, json};

use super::{RunArgs, exit, output};
use crate::app::build_runtime;
use crate::runtime::events::{APPROVAL_REQUESTED, APPROVAL_RESOLVED, PROGRESS_NARRATION};
use crate::runtime::{Following, History, NewRequest, Protocol, Runtime};
use crate::store::RunStatus;
use crate::workspace;

/// The identity that owns what `run` creates.
const CLI_OWNER: &str = "cli";

pub async fn run(args: RunArgs) -> u8 {
    let compiled = match workspace::load(&args.workspace) {
        Ok(compiled) => Arc::new(compiled),
        Err(diagnostics) => {
            output::error(&diagnostics.to_string());
            return exit::USAGE;
        }
    };
    if let Some(agent) = &args.agent
        && !compiled.agents.contains_key(agent)
    {
        let known: Vec<&str> = compiled.agents.keys().map(String::as_str).collect();
        output::error(&format!(
            "stable-harness run: unknown agent `{agent}` (agents: {})",
            known.join(", ")
        ));
        return exit::USAGE;
    }
    // `run` executes only its own request: it never resumes another process's runs.
    let (runtime, _) = match build_runtime(
        Arc::clone(&compiled),
        args.database_url.as_deref(),
        false,
        None,
    )
    .await
    {
        Ok(built) => built,
        Err(error) => {
            output::error(&format!("stable-harness run: {error}"));
            return exit::FAILED;
        }
    };
    if let Some(session) = &args.session {
        match runtime.store().session(session).await {
            Ok(Some(_)) => {}
            Ok(None) => {
                output::error(&format!(
                    "stable-harness run: session `{session}` not found"
                ));
                return exit::USAGE;
            }
            Err(error) => {
                output::error(&format!("stable-harness run: {error}"));
                return exit::FAILED;
            }
        }
    }
    let submitted = match runtime
        .submit(NewRequest {
            leading_held_by: None,
            agent_id: args.agent.clone(),
            session_id: args.session.clone(),
            owner: CLI_OWNER.to_owned(),
            history: History::SessionLeaf,
            leading: Vec::new(),
            chainable: false,
            messages: vec![json!({ "role": "user", "content": args.message })],
            sent: None,
            new_messages: 1,
            options: Default::default(),
            metadata: json!({}),
            protocol: Protocol::Cli,
            durable_before_return: false,
            client: Default::default(),
            surface: None,
            workflow: None,
        })
        .await
    {
        Ok(submitted) => submitted,
        Err(error) => {
            output::error(&format!("stable-harness run: {error}"));
            return exit::USAGE;
        }
    };
    let included: Vec<String> = if compiled.runtime.cli_event_types.is_empty() {
        vec![PROGRESS_NARRATION.to_owned()]
    } else {
        compiled.runtime.cli_event_types.clone()
    };
    let mut events = std::pin::pin!(runtime.follow(&submitted.request_id, 0, Following::Live));
    let mut denied = false;
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                output::error(&format!("stable-harness run: {error}"));
                break;
            }
        };
        if args.json {
            output::print(&serde_json::to_string(&*event).unwrap_or_default());
        } else if included.contains(&event.event_type) {
            let line = match event.data.get("message").and_then(Value::as_str) {
                Some(message) if event.event_type == PROGRESS_NARRATION => message.to_owned(),
                _ => format!("{} {}", event.event_type, event.data),
            };
            output::error(&format!("· {line}"));
        }
        if event.event_type == APPROVAL_REQUESTED {
            answer_approval(&runtime, &event.data, args.approve_all).await;
        } else if event.event_type == APPROVAL_RESOLVED
            && event.data.get("decision").and_then(Value::as_str) != Some("approved")
        {
            denied = true;
        }
    }
    runtime.shutdown(std::time::Duration::from_secs(5)).await;
    let request = match runtime.store().request(&submitted.request_id).await {
        Ok(Some(request)) => request,
        _ => {
            output::error("stable-harness run: the request record could not be read back");
            return exit::FAILED;
        }
    };
    match request.status {
        RunStatus::Completed => {
            if !args.json {
                output::print(request.output.as_deref().unwrap_or_default());
            }
            if denied {
                output::error("stable-harness run: a tool call was denied approval");
                return exit::CANCELLED;
            }
            exit::OK
        }
        RunStatus::Cancelled => {
            output::error("stable-harness run: the request was cancelled");
            exit::CANCELLED
        }
        _ => {
            let message = request
                .error
                .as_ref()
                .and_then(|e| e.get("message"))
                .and_then(Value::as_str)
                .unwrap_or("the request failed")
                .to_owned();
            output::error(&format!("stable-harness run: failed: {message}"));
            exit::FAILED
        }
    }
}

/// Decides an approval the run asked for: `--approve-all`, else the terminal's answer, else
/// (no terminal) a denial.
async fn answer_approval(runtime: &Runtime, data: &Value, approve_all: bool) {
    use std::io::IsTerminal;
    let Some(approval) = data.get("approval") else {
        return;
    };
    let id = approval
        .get("id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let tool = approval
        .get("toolId")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let arguments = approval.get("arguments").cloned().unwrap_or(Value::Null);
    let (approve, reason) = if approve_all {
        (true, "approved by --approve-all")
    } else if std::io::stdin().is_terminal() {
        let question = format!("Run tool `{tool}` with arguments {arguments}?");
        let approve = tokio::task::spawn_blocking(move || output::confirm(&question))
            .await
            .unwrap_or(false);
        (
            approve,
            if approve {
                "approved on the terminal"
            } else {
                "denied on the terminal"
            },
        )
    } else {
        output::error(&format!(
            "stable-harness run: tool `{tool}` needs approval and there is no terminal to ask; denied (use --approve-all)"
        ));
        (false, "no terminal to ask, and --approve-all was not given")
    };
    if let Err(error) = runtime
        .decide_approval(&id, approve, Some(reason.to_owned()), "cli")
        .await
    {
        output::error(&format!("stable-harness run: {error}"));
    }
}
