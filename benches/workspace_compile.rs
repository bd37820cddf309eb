//! Benchmark: compile a generated workspace of 1,000 agents and 1,000 tools.
//!
//! `cargo bench --bench workspace_compile` prints min / median / max over repeated loads
//! (reading every file, parsing, checking and compiling, JSON Schemas included).
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

const AGENTS: usize = 1_000;
const TOOLS: usize = 1_000;
const ITERATIONS: usize = 20;

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    generate(dir.path());
    let first = stable_harness::workspace::load(dir.path()).expect("generated workspace is valid");
    assert_eq!((first.agents.len(), first.tools.len()), (AGENTS, TOOLS));

    let mut samples: Vec<Duration> = (0..ITERATIONS)
        .map(|_| {
            let start = Instant::now();
            let workspace = stable_harness::workspace::load(dir.path()).expect("valid");
            let elapsed = start.elapsed();
            std::hint::black_box(workspace);
            elapsed
        })
        .collect();
    samples.sort();
    println!(
        "workspace_compile: {AGENTS} agents + {TOOLS} tools ({} files): min {:.1} ms, median {:.1} ms, max {:.1} ms over {ITERATIONS} loads",
        AGENTS + 3,
        ms(samples[0]),
        ms(samples[ITERATIONS / 2]),
        ms(samples[ITERATIONS - 1]),
    );
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}

fn generate(root: &Path) {
    let write = |relative: &str, content: &str| {
        let path = root.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    };
    write(
        "config/runtime/workspace.yaml",
        "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: bench }\nspec:\n  defaultAgent: agent-0\n  governance:\n    rules:\n      - { name: risky, match: { risk: [high] }, decision: needs_approval }\n      - { name: deletes, match: { tools: [\"tool-9*\"] }, decision: deny }\n",
    );
    write(
        "config/catalogs/models.yaml",
        "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: { name: models }\nspec:\n  models:\n    - { id: main, provider: openai-compatible, baseUrlEnv: OPENAI_BASE_URL, upstreamModel: m, fallbacks: [backup] }\n    - { id: backup, provider: openai-compatible, baseUrl: \"http://127.0.0.1:9/v1\", upstreamModel: m }\n",
    );
    let mut tools = String::from(
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n",
    );
    for i in 0..TOOLS {
        let risk = ["low", "medium", "high"][i % 3];
        writeln!(
            tools,
            "    - id: tool-{i}\n      description: Generated tool number {i}.\n      risk: {risk}\n      timeout: 10s\n      inputSchema:\n        type: object\n        properties:\n          city: {{ type: string, minLength: 1 }}\n          days: {{ type: integer, minimum: 1, maximum: 14 }}\n        required: [city]\n        additionalProperties: false\n      http: {{ url: \"http://127.0.0.1:9000/tools/{i}\", headersEnv: {{ x-api-key: TOOL_KEY }} }}"
        )
        .unwrap();
    }
    write("config/catalogs/tools.yaml", &tools);
    for i in 0..AGENTS {
        let picked: Vec<String> = (0..5)
            .map(|k| format!("tool-{}", (i * 7 + k * 13) % TOOLS))
            .collect();
        write(
            &format!("config/agents/agent-{i}.yaml"),
            &format!(
                "apiVersion: stable-harness/v1\nkind: Agent\nmetadata:\n  name: agent-{i}\n  labels: {{ team: t{} }}\nspec:\n  description: Generated agent {i}.\n  backend: openai\n  model: main\n  instructions: |\n    You are generated agent {i}. Use your tools carefully.\n  tools: [{}]\n  subagents: [{}]\n  maxIterations: 8\n  timeout: 120s\n  backendConfig: {{ temperature: 0.2 }}\n",
                i % 10,
                picked.join(", "),
                // A chain, not a ring: delegation cycles are compile errors.
                if i + 1 < AGENTS {
                    format!("agent-{}", i + 1)
                } else {
                    String::new()
                }
            ),
        );
    }
}
