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

/// The `stable-harness` binary the suite drives: the one `STABLE_HARNESS_TEST_BINARY` names
/// (a build made another way, such as the profile-guided one of `deploy/pgo-build.sh`, whose
/// crash test and soak must pass as the plain build's do), or else the one cargo built.
pub fn binary() -> PathBuf {
    std::env::var_os("STABLE_HARNESS_TEST_BINARY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_stable-harness")))
}

/// Runs the `stable-harness` binary with `args`.
pub fn stable_harness(args: &[&str]) -> Output {
    Command::new(binary())
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

/// Runs `command` to its end with its output captured, failing the test if it has not ended
/// within `limit` (a command that must refuse at once, not a timing measurement).
pub fn output_within(mut command: Command, limit: std::time::Duration) -> Output {
    use std::process::Stdio;
    let stdout = tempfile::tempfile().unwrap();
    let stderr = tempfile::tempfile().unwrap();
    let mut child = command
        .env_remove("STABLE_HARNESS_DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(stdout.try_clone().unwrap())
        .stderr(stderr.try_clone().unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} did not end within {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let read = |mut file: std::fs::File| {
        use std::io::{Read, Seek};
        let mut bytes = Vec::new();
        file.seek(std::io::SeekFrom::Start(0)).unwrap();
        file.read_to_end(&mut bytes).unwrap();
        bytes
    };
    Output {
        status,
        stdout: read(stdout),
        stderr: read(stderr),
    }
}

/// The embedded store of the workspace at `root`.
pub fn store_path(root: &Path) -> PathBuf {
    root.join(".stable-harness").join("state.db")
}

/// The input the SQLite store at `db` holds for request `request_id`, parsed.
pub fn stored_input(db: &Path, request_id: &str) -> serde_json::Value {
    let rows = store_rows(
        db,
        &format!("SELECT input FROM requests WHERE id = '{request_id}'"),
    );
    let input = rows[0]["input"].as_str().unwrap();
    serde_json::from_str(input).unwrap_or_else(|e| panic!("{input}: {e}"))
}

/// The rows `sql` selects from the SQLite store at `db`, opened read-only (a live server's
/// store may be read too): each row as a JSON object by column name.
pub fn store_rows(db: &Path, sql: &str) -> Vec<serde_json::Map<String, serde_json::Value>> {
    use rusqlite::types::ValueRef;
    use serde_json::Value;
    let connection =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap_or_else(|e| panic!("open {db:?}: {e}"));
    let mut statement = connection
        .prepare(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let names: Vec<String> = statement
        .column_names()
        .iter()
        .map(|n| (*n).to_owned())
        .collect();
    let rows = statement
        .query_map([], |row| {
            let mut object = serde_json::Map::new();
            for (index, name) in names.iter().enumerate() {
                let value = match row.get_ref(index)? {
                    ValueRef::Null => Value::Null,
                    ValueRef::Integer(i) => Value::from(i),
                    ValueRef::Real(f) => Value::from(f),
                    ValueRef::Text(t) | ValueRef::Blob(t) => {
                        Value::String(String::from_utf8_lossy(t).into_owned())
                    }
                };
                object.insert(name.clone(), value);
            }
            Ok(object)
        })
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    rows.map(|row| row.unwrap()).collect()
}

/// Every text or blob value of every column of every table of the store at `db`, as
/// `(table, column, text)`: what a search for leaked secrets must cover.
pub fn store_texts(db: &Path) -> Vec<(String, String, String)> {
    let tables = store_rows(
        db,
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
    );
    let mut texts = Vec::new();
    for table in tables {
        let table = table["name"].as_str().unwrap().to_owned();
        for row in store_rows(db, &format!("SELECT * FROM \"{table}\"")) {
            for (column, value) in row {
                if let serde_json::Value::String(text) = value {
                    texts.push((table.clone(), column, text));
                }
            }
        }
    }
    texts
}
