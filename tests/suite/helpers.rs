//! Shared test helpers: throwaway workspaces on disk and the compiled binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A workspace in a temporary folder, deleted on drop.
pub struct TestWorkspace {
    dir: tempfile::TempDir,
}

/// The smallest valid workspace the check table mutates: one Runtime, one agent, one model,
/// a command tool and a builtin tool.
pub const BASE_FILES: &[(&str, &str)] = &[
    (
        "config/runtime/workspace.yaml",
        "apiVersion: stable-harness/v1
kind: Runtime
metadata:
  name: test
spec:
  defaultAgent: assistant
",
    ),
    (
        "config/agents/assistant.yaml",
        "apiVersion: stable-harness/v1
kind: Agent
metadata:
  name: assistant
spec:
  backend: openai
  model: default
  tools: [echo, clock.now]
",
    ),
    (
        "config/catalogs/models.yaml",
        "apiVersion: stable-harness/v1
kind: ModelCatalog
metadata:
  name: models
spec:
  models:
    - id: default
      provider: openai-compatible
      baseUrl: http://127.0.0.1:9/v1
      upstreamModel: test-model
",
    ),
    (
        "config/catalogs/tools.yaml",
        "apiVersion: stable-harness/v1
kind: ToolCatalog
metadata:
  name: tools
spec:
  tools:
    - id: echo
      inputSchema: { type: object, properties: { text: { type: string } } }
      command: { program: resources/tools/echo.sh }
    - id: clock.now
      builtin: clock.now
",
    ),
    ("resources/tools/echo.sh", "#!/bin/sh\ncat\n"),
];

impl TestWorkspace {
    /// The base workspace.
    pub fn base() -> Self {
        let workspace = Self::empty();
        for (path, content) in BASE_FILES {
            workspace.write(path, content);
        }
        workspace.make_executable("resources/tools/echo.sh");
        workspace
    }

    /// An empty folder.
    pub fn empty() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}")),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn write(&self, relative: &str, content: impl AsRef<[u8]>) -> PathBuf {
        let path = self.dir.path().join(relative);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("mkdir {parent:?}: {e}"));
        }
        std::fs::write(&path, content).unwrap_or_else(|e| panic!("write {path:?}: {e}"));
        path
    }

    pub fn remove(&self, relative: &str) {
        std::fs::remove_file(self.dir.path().join(relative))
            .unwrap_or_else(|e| panic!("rm {relative}: {e}"));
    }

    pub fn make_executable(&self, relative: &str) {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.path().join(relative);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .unwrap_or_else(|e| panic!("chmod {path:?}: {e}"));
    }

    /// The diagnostics of loading this workspace, rendered as `validate` prints them.
    pub fn diagnostics(&self) -> Vec<String> {
        match stable_harness::workspace::load(self.path()) {
            Ok(_) => Vec::new(),
            Err(diagnostics) => diagnostics.iter().map(ToString::to_string).collect(),
        }
    }
}

/// Runs the `stable-harness` binary with `args`.
pub fn stable_harness(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stable-harness"))
        .args(args)
        .env_remove("STABLE_HARNESS_LOG")
        .output()
        .unwrap_or_else(|e| panic!("spawn stable-harness: {e}"))
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The repository's example workspace.
pub fn example_workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("workspace-example")
}
