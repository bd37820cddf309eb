//! The command line, run as a user runs it: the compiled binary, exit codes and output.

use serde_json::json;

use crate::helpers::{TestWorkspace, example_workspace, stable_harness, stderr, stdout};

#[test]
fn validate_prints_the_inventory_of_the_example() {
    let example = example_workspace();
    let output = stable_harness(&["validate", "-w", example.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.contains("valid — 5 agent(s), 3 model(s), 7 tool(s), 1 workflow(s)"),
        "{text}"
    );
    assert!(
        text.contains("agent     greeter (scripted; tools: none)"),
        "{text}"
    );
    assert!(
        text.contains("tool      docs.search (mcp docs/search, risk low)"),
        "{text}"
    );
}

#[test]
fn validate_reports_every_problem_with_exit_code_2() {
    let workspace = TestWorkspace::base();
    workspace.write(
        "config/agents/assistant.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: nope\n  tools: [gone]\n",
    );
    let output = stable_harness(&["validate", "-w", workspace.path().to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        stderr(&output),
        "config/agents/assistant.yaml:6:10: unknown model `nope`\nconfig/agents/assistant.yaml:7:11: unknown tool `gone`\n2 problem(s) found\n"
    );

    let output = stable_harness(&[
        "validate",
        "--json",
        "-w",
        workspace.path().to_str().unwrap(),
    ]);
    assert_eq!(output.status.code(), Some(2));
    let diagnostics: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        diagnostics,
        serde_json::json!([
            { "file": "config/agents/assistant.yaml", "line": 6, "column": 10, "message": "unknown model `nope`" },
            { "file": "config/agents/assistant.yaml", "line": 7, "column": 11, "message": "unknown tool `gone`" }
        ])
    );
}

#[test]
fn validate_json_of_a_valid_workspace_prints_the_inventory() {
    let output = stable_harness(&[
        "validate",
        "--json",
        "-w",
        example_workspace().to_str().unwrap(),
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(output.stderr.is_empty(), "{}", stderr(&output));
    let inventory: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(inventory["valid"], true);
    let find = |list: &str, key: &str, value: &str| -> serde_json::Value {
        inventory[list]
            .as_array()
            .unwrap()
            .iter()
            .find(|item| item[key] == value)
            .cloned()
            .unwrap_or_else(|| panic!("no {list} with {key} {value}: {inventory:#}"))
    };
    let names = |list: &str, key: &str| -> Vec<String> {
        inventory[list]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item[key].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        names("agents", "name"),
        [
            "assistant",
            "billing",
            "greeter",
            "researcher",
            "timekeeper"
        ]
    );
    assert_eq!(names("models", "id"), ["default", "fast", "local"]);
    assert_eq!(names("tools", "id").len(), 7);

    let assistant = find("agents", "name", "assistant");
    assert_eq!(assistant["backend"], "openai");
    assert_eq!(assistant["model"], "default");
    assert_eq!(
        assistant["tools"],
        json!([
            "weather.lookup",
            "clock.now",
            "skills.get",
            "docs.search",
            "memory.write"
        ])
    );
    assert_eq!(
        assistant["memory"]["namespaces"],
        json!(["user/{user}", "agent/{agentId}"])
    );
    assert_eq!(inventory["runtime"]["memory"]["requireApproval"], true);
    assert_eq!(assistant["subagents"], json!(["researcher"]));
    assert_eq!(find("agents", "name", "billing")["backend"], "http");
    assert_eq!(
        find("models", "id", "default")["baseUrlEnv"],
        "OPENAI_BASE_URL"
    );

    let docs = find("tools", "id", "docs.search");
    assert_eq!(
        (&docs["kind"], &docs["server"], &docs["tool"]),
        (&json!("mcp"), &json!("docs"), &json!("search"))
    );
    assert_eq!(docs["maxOutputBytes"], 256 * 1024);
    let delete = find("tools", "id", "files.delete");
    assert_eq!(
        (&delete["risk"], &delete["onInterrupted"]),
        (&json!("high"), &json!("fail"))
    );
    assert_eq!(delete["program"], "resources/tools/delete-file.sh");
    assert_eq!(
        find("tools", "id", "weather.lookup")["onInterrupted"],
        "rerun"
    );

    let runtime = &inventory["runtime"];
    assert_eq!(runtime["defaultAgent"], "assistant");
    let rules: Vec<&str> = runtime["governance"]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|rule| rule["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        rules,
        [
            "no-deletes",
            "high-risk-needs-human",
            "researcher-files-need-human",
            "external-network-reviewed",
            "client-shell-needs-human",
            "sandbox-requests-never-delegate"
        ]
    );
    assert_eq!(
        runtime["governance"]["rules"][5]["metadata"],
        json!({ "sandbox": "true" })
    );
    assert_eq!(
        runtime["governance"]["redactPatterns"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        runtime["protocols"]["openai"]["keys"][0],
        json!({ "name": "web-frontend", "keyEnv": "STABLE_HARNESS_WEB_KEY", "labels": { "channel": "web" } })
    );
    assert_eq!(
        runtime["protocols"]["admin"]["keys"],
        json!([{ "name": "on-call", "keyEnv": "STABLE_HARNESS_ONCALL_KEY" }])
    );
    assert_eq!(runtime["limits"]["maxOutputBytes"], 1 << 20);
    assert_eq!(
        runtime["budgets"][1],
        json!({ "name": "web-sessions", "scope": "session", "match": { "keys": ["web-frontend"], "agents": [], "labels": {} }, "maxTokens": 500000, "maxCost": null, "window": "1d" })
    );
    assert_eq!(runtime["budgets"][2]["maxCost"], 500.0);
    assert_eq!(runtime["rateLimits"][0]["requestsPerMinute"], 1200);
    assert_eq!(find("models", "id", "local")["maxOutputTokens"], 4096);
    assert_eq!(
        inventory["workflows"][0]["nodes"][3],
        json!({ "id": "timestamp", "tool": "clock.now", "arguments": null })
    );
}

#[test]
fn validate_bad_input_never_panics() {
    let missing = stable_harness(&["validate", "-w", "/nonexistent/stable-harness-workspace"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        stderr(&missing)
            .contains("/nonexistent/stable-harness-workspace: workspace folder not found")
    );

    let workspace = TestWorkspace::base();
    workspace.write("config/broken.yaml", "kind: Agent\n  - : : [\n\t\u{0}");
    let output = stable_harness(&["validate", "-w", workspace.path().to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).starts_with("config/broken.yaml:"),
        "{}",
        stderr(&output)
    );
    assert!(!stderr(&output).contains("panicked"));
}

#[test]
fn init_writes_a_workspace_that_validates_and_refuses_to_overwrite() {
    let target = TestWorkspace::empty();
    let dir = target.path().join("my-agents");
    let output = stable_harness(&["init", dir.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(stdout(&output).contains("Created a workspace"));
    let workspace = stable_harness::workspace::load(&dir).unwrap();
    assert_eq!(workspace.runtime.default_agent.as_deref(), Some("greeter"));
    assert_eq!(
        workspace.agents["greeter"].backend,
        stable_harness::workspace::Backend::Scripted
    );
    assert_eq!(
        workspace.agents["assistant"].backend,
        stable_harness::workspace::Backend::Openai
    );
    assert_eq!(
        workspace.models["default"].base_url,
        stable_harness::workspace::UpstreamUrl::FromEnv("OPENAI_BASE_URL".into())
    );
    assert_eq!(
        workspace.models["default"].api_key_env.as_deref(),
        Some("OPENAI_API_KEY")
    );
    assert!(
        workspace.agents["assistant"]
            .instructions
            .as_deref()
            .unwrap_or_default()
            .contains("clock.now")
    );

    let again = stable_harness(&["init", dir.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(2));
    assert!(stderr(&again).contains("already holds a workspace"));
}

#[test]
fn schema_validates_the_example_documents() {
    let output = stable_harness(&["schema"]);
    assert_eq!(output.status.code(), Some(0));
    let schema: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();

    let mut checked = 0;
    for path in yaml_files(&example_workspace().join("config")) {
        let text = std::fs::read_to_string(&path).unwrap();
        for document in serde_saphyr::from_multiple::<serde_json::Value>(&text).unwrap() {
            let errors: Vec<String> = validator
                .iter_errors(&document)
                .map(|e| e.to_string())
                .collect();
            assert!(errors.is_empty(), "{}: {errors:#?}", path.display());
            checked += 1;
        }
    }
    assert_eq!(checked, 9);

    // And it rejects what the loader rejects: an unknown field, a wrong kind, a bad name.
    for bad in [
        serde_json::json!({"apiVersion": "stable-harness/v1", "kind": "Agent", "metadata": {"name": "a"}, "spec": {"backend": "openai", "modle": "x"}}),
        serde_json::json!({"apiVersion": "stable-harness/v1", "kind": "Agnet", "metadata": {"name": "a"}, "spec": {}}),
        serde_json::json!({"apiVersion": "stable-harness/v1", "kind": "Workflow", "metadata": {"name": "Bad Name"}, "spec": {"entry": "a", "nodes": []}}),
        serde_json::json!({"apiVersion": "v2", "kind": "Runtime", "metadata": {"name": "a"}, "spec": {}}),
    ] {
        assert!(!validator.is_valid(&bad), "schema accepted {bad}");
    }
}

#[test]
fn committed_schema_matches_the_binary() {
    let output = stable_harness(&["schema"]);
    let committed = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schema/workspace.schema.json"),
    )
    .unwrap();
    assert!(
        stdout(&output) == committed,
        "schema/workspace.schema.json is stale: run `cargo run -- schema > schema/workspace.schema.json`"
    );
}

#[test]
fn committed_openapi_matches_the_binary() {
    let output = stable_harness(&["openapi"]);
    assert_eq!(output.status.code(), Some(0));
    let document: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert!(document["paths"]["/v1/chat/completions"]["post"].is_object());
    let committed = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi/openapi.json"),
    )
    .unwrap();
    assert!(
        stdout(&output).trim_end() == committed.trim_end(),
        "openapi/openapi.json is stale: run `cargo run -- openapi > openapi/openapi.json`"
    );
}

#[test]
fn run_prints_narration_and_output_and_exits_0() {
    let workspace = TestWorkspace::base();
    workspace.write(
        "config/agents/greeter.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: greeter }\nspec:\n  backend: scripted\n  script: [{ reply: \"Hi {{input}}!\" }]\n",
    );
    workspace.write(
        "config/runtime/workspace.yaml",
        "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  defaultAgent: greeter\n  progress: { narration: { enabled: true } }\n",
    );
    let dir = workspace.path().to_str().unwrap();
    let output = stable_harness(&["run", "-w", dir, "there"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(stdout(&output), "Hi there!\n");
    assert!(
        stderr(&output).contains("· Working on it (greeter)."),
        "{}",
        stderr(&output)
    );

    // --json: every event as a JSON line, gapless, ending with the terminal event.
    let output = stable_harness(&["run", "-w", dir, "--json", "--agent", "greeter", "again"]);
    assert_eq!(output.status.code(), Some(0));
    let events: Vec<serde_json::Value> = stdout(&output)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>());
    assert_eq!(events.first().unwrap()["type"], "runtime.request.started");
    assert_eq!(events.last().unwrap()["type"], "runtime.request.completed");
    assert_eq!(events.last().unwrap()["data"]["output"], "Hi again!");

    // The same store holds both requests.
    assert!(workspace.path().join(".stable-harness/state.db").is_file());
}

#[test]
fn run_exit_codes_for_failures_and_bad_usage() {
    let workspace = TestWorkspace::base();
    let dir = workspace.path().to_str().unwrap();
    // The base agent calls a model at an address where nothing listens: the run fails (1).
    let output = stable_harness(&["run", "-w", dir, "hello"]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("failed: upstream model `default`"),
        "{}",
        stderr(&output)
    );
    // An unknown agent is bad usage (2), as is an invalid workspace.
    let output = stable_harness(&["run", "-w", dir, "--agent", "ghost", "hello"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("unknown agent `ghost`"));
    workspace.write("config/agents/broken.yaml", "kind: Agent\n");
    assert_eq!(
        stable_harness(&["run", "-w", dir, "hello"]).status.code(),
        Some(2)
    );
}

#[test]
fn migrate_creates_an_sqlite_store_and_refuses_unknown_databases() {
    let dir = TestWorkspace::empty();
    let db = dir.path().join("nested/state.db");
    let url = format!("sqlite://{}", db.display());
    let output = stable_harness(&["migrate", "--database-url", &url]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(db.is_file());
    let output = stable_harness(&["migrate", "--database-url", "mysql://localhost/db"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(stderr(&output).contains("unsupported store url"));
}

#[test]
fn bad_usage_exits_2() {
    assert_eq!(stable_harness(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(
        stable_harness(&["validate", "--no-such-flag"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(stable_harness(&["--help"]).status.code(), Some(0));
}

#[test]
fn start_refuses_a_huge_text_setting_it_does_not_know() {
    // An empty folder: a start that got past the setting would stop at the workspace, with
    // another message.
    let empty = tempfile::tempdir().expect("a folder");
    let mut start = std::process::Command::new(crate::helpers::binary());
    start
        .args(["start", "-w"])
        .arg(empty.path())
        .args(["--port", "0"])
        .env("STABLE_HARNESS_HUGE_TEXT", "sometimes");
    let output = crate::helpers::output_within(start, std::time::Duration::from_secs(30));
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("STABLE_HARNESS_HUGE_TEXT must be `on` or `off`"));
}

fn yaml_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(yaml_files(&path));
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// A scripted agent whose only step is a tool call that needs approval (`default: needs_approval`).
fn approval_workspace() -> TestWorkspace {
    let workspace = TestWorkspace::base();
    workspace.write(
        "config/runtime/workspace.yaml",
        "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: test }\nspec:\n  defaultAgent: clockwatcher\n  governance: { default: needs_approval }\n",
    );
    workspace.write(
        "config/agents/clockwatcher.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: clockwatcher }\nspec:\n  backend: scripted\n  tools: [echo]\n  script:\n    - toolCall: { tool: echo, arguments: { said: hi } }\n    - reply: checked\n",
    );
    workspace
}

#[test]
fn run_asks_for_approval_denies_without_a_terminal_and_approve_all_approves() {
    let workspace = approval_workspace();
    let dir = workspace.path().to_str().unwrap();
    // No terminal on stdin: the call is denied, the run still answers, the exit code says so.
    let denied = stable_harness(&["run", "-w", dir, "--json", "check"]);
    assert_eq!(denied.status.code(), Some(3), "{}", stderr(&denied));
    assert!(
        stderr(&denied).contains("no terminal"),
        "{}",
        stderr(&denied)
    );
    let lines = stdout(&denied);
    assert!(lines.contains("\"decision\":\"denied\""), "{lines}");
    assert!(lines.contains("approval_denied"), "{lines}");

    let approved = stable_harness(&["run", "-w", dir, "--approve-all", "check"]);
    assert_eq!(approved.status.code(), Some(0), "{}", stderr(&approved));
    assert_eq!(stdout(&approved).trim(), "checked");
}

/// Every field of the workspace schema is named in the configuration reference.
#[test]
fn the_configuration_reference_names_every_schema_field() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("schema/workspace.schema.json")).unwrap(),
    )
    .unwrap();
    let reference = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let mut fields = std::collections::BTreeSet::new();
    collect_properties(&schema, &mut fields);
    assert!(fields.len() > 50, "{fields:?}");
    let missing: Vec<&String> = fields
        .iter()
        .filter(|field| {
            !reference.contains(&format!("`{field}`")) && !reference.contains(&format!(".{field}`"))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "docs/configuration.md does not describe {missing:?}: document them beside the schema"
    );
}

fn collect_properties(value: &serde_json::Value, fields: &mut std::collections::BTreeSet<String>) {
    match value {
        serde_json::Value::Object(object) => {
            if let Some(serde_json::Value::Object(properties)) = object.get("properties") {
                fields.extend(properties.keys().cloned());
            }
            object.values().for_each(|v| collect_properties(v, fields));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_properties(v, fields)),
        _ => {}
    }
}
