//! `stable-harness init`: the starter workspace, embedded in the binary. It validates as
//! written (a test checks) and serves both a model-free `scripted` agent and an `openai`
//! agent whose upstream comes from `OPENAI_BASE_URL` / `OPENAI_API_KEY`.

use std::io;
use std::path::{Path, PathBuf};

/// Workspace-relative path and content of every scaffold file.
pub const FILES: &[(&str, &str)] = &[
    (
        "config/runtime/workspace.yaml",
        include_str!("scaffold/config/runtime/workspace.yaml"),
    ),
    (
        "config/agents/greeter.yaml",
        include_str!("scaffold/config/agents/greeter.yaml"),
    ),
    (
        "config/agents/assistant.yaml",
        include_str!("scaffold/config/agents/assistant.yaml"),
    ),
    (
        "config/catalogs/models.yaml",
        include_str!("scaffold/config/catalogs/models.yaml"),
    ),
    (
        "config/catalogs/tools.yaml",
        include_str!("scaffold/config/catalogs/tools.yaml"),
    ),
    (
        "resources/prompts/assistant.md",
        include_str!("scaffold/resources/prompts/assistant.md"),
    ),
    (".gitignore", include_str!("scaffold/gitignore")),
];

/// Why a scaffold could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ScaffoldError {
    #[error("{0} already holds a workspace (config/ exists); refusing to overwrite it")]
    AlreadyAWorkspace(PathBuf),
    #[error("cannot write {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// Writes the starter workspace into `dir` (created if missing); returns the files written.
pub fn write(dir: &Path) -> Result<Vec<PathBuf>, ScaffoldError> {
    if dir.join("config").exists() {
        return Err(ScaffoldError::AlreadyAWorkspace(dir.to_path_buf()));
    }
    let mut written = Vec::with_capacity(FILES.len());
    for (relative, content) in FILES {
        let path = dir.join(relative);
        let io_error = |source| ScaffoldError::Io {
            path: path.clone(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io_error)?;
        }
        std::fs::write(&path, content).map_err(io_error)?;
        written.push(path);
    }
    Ok(written)
}
