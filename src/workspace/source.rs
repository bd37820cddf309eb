//! Reading a workspace from disk: find every `*.yaml`/`*.yml` under `config/`, read each with
//! size and encoding limits, split multi-document files, and deserialize each document with the
//! raw type its `kind` names. Problems become diagnostics; one bad document never hides another.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_saphyr::MessageFormatter;

use super::diagnostics::{Diagnostic, Diagnostics, did_you_mean};
use super::located::{Located, Position};
use super::raw::{
    AgentSpec, DocumentKindProbe, ModelCatalogSpec, RawDocument, RuntimeSpec, ToolCatalogSpec,
    WorkflowSpec,
};

/// Largest workspace file read; bigger files are reported, not parsed.
pub const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// Most YAML files read from `config/`.
pub const MAX_FILES: usize = 10_000;
/// Deepest folder nesting followed under `config/`.
const MAX_DEPTH: usize = 16;

/// The document kinds, in the order SPEC.md lists them.
pub const KINDS: [&str; 5] = [
    "Runtime",
    "Agent",
    "ModelCatalog",
    "ToolCatalog",
    "Workflow",
];

/// Where a document sits: its file and the line its text starts at.
#[derive(Debug, Clone)]
pub struct Origin {
    /// Workspace-relative, `/`-separated.
    pub file: Arc<str>,
    /// Lines of the file before this document's text.
    pub line_offset: u64,
}

impl Origin {
    /// A diagnostic at `position` in this document (its first line when the position is unknown).
    pub fn diagnostic(&self, position: Position, message: impl Into<String>) -> Diagnostic {
        let (line, column) = if position.is_known() {
            (position.line, position.column)
        } else {
            (1, 1)
        };
        Diagnostic::at(&*self.file, self.line_offset + line, column, message)
    }

    /// A diagnostic at the position of a located value.
    pub fn at<T>(&self, located: &Located<T>, message: impl Into<String>) -> Diagnostic {
        self.diagnostic(located.position, message)
    }

    /// `file:line:col` of a located value, for messages that point at a second place.
    pub fn describe<T>(&self, located: &Located<T>) -> String {
        let diagnostic = self.at(located, "");
        format!(
            "{}:{}:{}",
            diagnostic.file,
            diagnostic.line.unwrap_or(1),
            diagnostic.column.unwrap_or(1)
        )
    }
}

/// A document read with the type of its kind.
#[derive(Debug)]
pub struct Document<S> {
    pub origin: Origin,
    pub raw: RawDocument<S>,
}

/// Every document of a workspace, grouped by kind, plus what could not be read.
#[derive(Debug, Default)]
pub struct Documents {
    pub runtimes: Vec<Document<RuntimeSpec>>,
    pub agents: Vec<Document<AgentSpec>>,
    pub model_catalogs: Vec<Document<ModelCatalogSpec>>,
    pub tool_catalogs: Vec<Document<ToolCatalogSpec>>,
    pub workflows: Vec<Document<WorkflowSpec>>,
    /// Kinds with a document that failed to parse: references into them are not judged,
    /// so one broken file does not cascade into a wall of "unknown tool" errors.
    pub unreadable_kinds: Vec<&'static str>,
    /// Kind and name of documents whose name was readable but whose spec was not.
    pub unreadable_names: Vec<(&'static str, String)>,
    /// How many YAML files were found under `config/`.
    pub files_read: usize,
}

/// Reads every document under `root/config`, reporting problems into `diagnostics`.
pub fn read_documents(root: &Path, diagnostics: &mut Diagnostics) -> Documents {
    let mut documents = Documents::default();
    if !root.is_dir() {
        diagnostics.push(Diagnostic::whole(
            root.display().to_string(),
            "workspace folder not found",
        ).with_hint("pass the folder that holds config/ with -w, or create one with `stable-harness init DIR`"));
        return documents;
    }
    let config = root.join("config");
    if !config.is_dir() {
        diagnostics.push(
            Diagnostic::whole(
                "config/",
                "folder not found: a workspace keeps its YAML under config/",
            )
            .with_hint("create one with `stable-harness init DIR`"),
        );
        return documents;
    }
    let mut files = Vec::new();
    collect_yaml_files(root, &config, 0, &mut files, diagnostics);
    files.sort();
    if files.is_empty() {
        diagnostics.push(
            Diagnostic::whole("config/", "no *.yaml or *.yml files found").with_hint(
                "a workspace needs at least config/runtime/workspace.yaml with `kind: Runtime`",
            ),
        );
    }
    documents.files_read = files.len();
    for path in files {
        let relative = relative_name(root, &path);
        if let Some(text) = read_text(&path, &relative, diagnostics) {
            for (line_offset, chunk) in split_documents(&text) {
                let origin = Origin {
                    file: Arc::clone(&relative),
                    line_offset,
                };
                parse_document(origin, chunk, &mut documents, diagnostics);
            }
        }
    }
    documents
}

fn relative_name(root: &Path, path: &Path) -> Arc<str> {
    let relative = path.strip_prefix(root).unwrap_or(path);
    let parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    Arc::from(parts.join("/"))
}

fn collect_yaml_files(
    root: &Path,
    dir: &Path,
    depth: usize,
    files: &mut Vec<PathBuf>,
    diagnostics: &mut Diagnostics,
) {
    let folder = format!("{}/", relative_name(root, dir));
    if depth > MAX_DEPTH {
        diagnostics.push(Diagnostic::whole(
            folder,
            format!("folders nested deeper than {MAX_DEPTH} levels are not read"),
        ));
        return;
    }
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) => {
            diagnostics.push(Diagnostic::whole(
                folder,
                format!("cannot read folder: {error}"),
            ));
            return;
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        // `metadata` follows symlinks; a link leaving the workspace is refused below.
        let Ok(metadata) = fs::metadata(&path) else {
            diagnostics.push(Diagnostic::whole(
                relative_name(root, &path).to_string(),
                "broken symbolic link",
            ));
            continue;
        };
        if entry.file_type().is_ok_and(|t| t.is_symlink()) && !stays_inside(root, &path) {
            diagnostics.push(Diagnostic::whole(
                relative_name(root, &path).to_string(),
                "symbolic link points outside the workspace",
            ));
            continue;
        }
        if metadata.is_dir() {
            collect_yaml_files(root, &path, depth + 1, files, diagnostics);
        } else if is_yaml_file(&path) {
            if files.len() >= MAX_FILES {
                diagnostics.push(Diagnostic::whole(
                    "config/",
                    format!("more than {MAX_FILES} YAML files"),
                ));
                return;
            }
            files.push(path);
        }
    }
}

fn stays_inside(root: &Path, path: &Path) -> bool {
    match (root.canonicalize(), path.canonicalize()) {
        (Ok(root), Ok(target)) => target.starts_with(root),
        _ => false,
    }
}

fn is_yaml_file(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    )
}

/// Reads a file as UTF-8 text within [`MAX_FILE_BYTES`].
fn read_text(path: &Path, relative: &str, diagnostics: &mut Diagnostics) -> Option<String> {
    let size = fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    if size > MAX_FILE_BYTES {
        diagnostics.push(
            Diagnostic::whole(
                relative,
                format!(
                    "file is {:.1} MiB, larger than the {} MiB limit for workspace files",
                    size as f64 / 1_048_576.0,
                    MAX_FILE_BYTES / 1_048_576
                ),
            )
            .with_hint("keep large data under resources/ and reference it from a tool"),
        );
        return None;
    }
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) => {
            diagnostics.push(Diagnostic::whole(
                relative,
                format!("cannot read file: {error}"),
            ));
            return None;
        }
    };
    match String::from_utf8(bytes) {
        Ok(text) => Some(
            text.strip_prefix('\u{feff}')
                .map(str::to_owned)
                .unwrap_or(text),
        ),
        Err(error) => {
            let valid = &error.as_bytes()[..error.utf8_error().valid_up_to()];
            let line = valid.iter().filter(|b| **b == b'\n').count() as u64 + 1;
            let line_start = valid.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            let column = String::from_utf8_lossy(&valid[line_start..])
                .chars()
                .count() as u64
                + 1;
            diagnostics.push(
                Diagnostic::at(relative, line, column, "file is not valid UTF-8")
                    .with_hint("save the file as UTF-8"),
            );
            None
        }
    }
}

/// Splits a YAML stream into its documents, each with the number of lines before it.
///
/// A line starting with `---` followed by a space or the end of the line always starts a new
/// document in YAML (no scalar may contain one at column 0), so splitting on it is exact.
/// Parsing documents one by one lets a broken document leave its neighbours readable.
pub fn split_documents(text: &str) -> Vec<(u64, &str)> {
    let mut starts = vec![0usize];
    let mut offset = 0usize;
    let mut line_starts = Vec::new();
    for line in text.split_inclusive('\n') {
        line_starts.push(offset);
        if offset > 0 && is_document_start(line) {
            // Directives (`%YAML`) just before the marker belong to the new document.
            let mut start = offset;
            let mut index = line_starts.len() - 1;
            while index > 0 && text[line_starts[index - 1]..].starts_with('%') {
                index -= 1;
                start = line_starts[index];
            }
            starts.push(start);
        }
        offset += line.len();
    }
    let mut documents = Vec::new();
    for (i, &start) in starts.iter().enumerate() {
        let end = starts.get(i + 1).copied().unwrap_or(text.len());
        let chunk = &text[start..end];
        if has_content(chunk) {
            let line_offset = text[..start].bytes().filter(|b| *b == b'\n').count() as u64;
            documents.push((line_offset, chunk));
        }
    }
    documents
}

fn is_document_start(line: &str) -> bool {
    line.strip_prefix("---")
        .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r', '\n']))
}

/// Whether a document has anything but comments, blank lines and markers.
fn has_content(chunk: &str) -> bool {
    chunk.lines().any(|line| {
        let line = if is_document_start(line) {
            &line[3..]
        } else {
            line
        };
        let trimmed = line.trim();
        !(trimmed.is_empty()
            || trimmed.starts_with('#')
            || trimmed == "..."
            || trimmed.starts_with('%'))
    })
}

fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: 64,
            max_documents: 1,
            max_aliases: 1_000,
            max_anchors: 1_000,
            max_total_scalar_bytes: MAX_FILE_BYTES as usize,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: 100_000,
            max_replay_stack_depth: 16,
            max_alias_expansions_per_anchor: 100,
        },
        strict_booleans: true,
        with_snippet: false,
    }
}

fn parse_document(
    origin: Origin,
    text: &str,
    documents: &mut Documents,
    diagnostics: &mut Diagnostics,
) {
    // Fast path: a top-level `kind:` line names a known kind, so the document is parsed once,
    // with its own type. Anything else (flow style, unknown or missing kind) is probed first.
    let kind = match kind_from_text(text) {
        Some(kind) => kind,
        None => match probe_kind(&origin, text, diagnostics) {
            Some(kind) => kind,
            None => return,
        },
    };
    let failure = match kind {
        "Runtime" => push_typed(&origin, text, &mut documents.runtimes),
        "Agent" => push_typed(&origin, text, &mut documents.agents),
        "ModelCatalog" => push_typed(&origin, text, &mut documents.model_catalogs),
        "ToolCatalog" => push_typed(&origin, text, &mut documents.tool_catalogs),
        _ => push_typed(&origin, text, &mut documents.workflows),
    };
    let Some(diagnostic) = failure else { return };
    diagnostics.push(diagnostic);
    // Remember what the broken document declared, so references into it are not reported
    // as dangling on top of the real problem.
    let name = deserialize::<DocumentKindProbe>(&origin, text)
        .ok()
        .and_then(|probe| probe.metadata)
        .and_then(|metadata| metadata.name);
    match (name, kind) {
        // Named by metadata: the name is still known, only its spec is not.
        (Some(name), "Agent" | "Workflow") => documents.unreadable_names.push((kind, name)),
        _ => documents.unreadable_kinds.push(kind),
    }
}

/// Reads only `kind`, reporting a document whose kind is missing, unknown or unreadable.
fn probe_kind(origin: &Origin, text: &str, diagnostics: &mut Diagnostics) -> Option<&'static str> {
    let probe: DocumentKindProbe = match deserialize(origin, text) {
        Ok(probe) => probe,
        Err(diagnostic) => {
            diagnostics.push(diagnostic);
            return None;
        }
    };
    let Some(kind) = probe.kind else {
        let first_content_line = text.lines().position(has_content).unwrap_or(0) as u64 + 1;
        let position = Position {
            line: first_content_line,
            column: 1,
        };
        diagnostics.push(
            origin
                .diagnostic(position, "missing field `kind`")
                .with_hint(format!(
                    "every document names its kind: one of {}",
                    KINDS.join(", ")
                )),
        );
        return None;
    };
    if let Some(known) = KINDS.into_iter().find(|known| *known == kind.value) {
        return Some(known);
    }
    let hint = did_you_mean(&kind, KINDS)
        .unwrap_or_else(|| format!("expected one of {}", KINDS.join(", ")));
    diagnostics.push(
        origin
            .at(&kind, format!("unknown kind `{}`", kind.value))
            .with_hint(hint),
    );
    None
}

/// Reads a document with the raw type of its kind; the diagnostic when it does not fit.
fn push_typed<S: DeserializeOwned>(
    origin: &Origin,
    text: &str,
    into: &mut Vec<Document<S>>,
) -> Option<Diagnostic> {
    match deserialize(origin, text) {
        Ok(raw) => {
            into.push(Document {
                origin: origin.clone(),
                raw,
            });
            None
        }
        Err(diagnostic) => Some(diagnostic),
    }
}

/// The kind a broken document declares on a top-level `kind:` line, if any.
fn kind_from_text(text: &str) -> Option<&'static str> {
    let declared = text.lines().find_map(|line| line.strip_prefix("kind:"))?;
    let declared = declared
        .split('#')
        .next()
        .unwrap_or_default()
        .trim()
        .trim_matches(['"', '\'']);
    KINDS.into_iter().find(|kind| *kind == declared)
}

/// Deserializes one document, turning a YAML or shape error into a diagnostic.
fn deserialize<T: DeserializeOwned>(origin: &Origin, text: &str) -> Result<T, Diagnostic> {
    serde_saphyr::from_str_with_options(text, yaml_options())
        .map_err(|error| yaml_diagnostic(origin, &error))
}

fn yaml_diagnostic(origin: &Origin, error: &serde_saphyr::Error) -> Diagnostic {
    use serde_saphyr::Error as E;
    let mut inner = error;
    while let E::WithSnippet { error, .. } | E::AliasError { error, .. } = inner {
        inner = error;
    }
    let position = error
        .location()
        .or_else(|| inner.location())
        .map(|l| Position {
            line: l.line(),
            column: l.column(),
        })
        .unwrap_or_default();
    let (message, hint) = match inner {
        E::DuplicateMappingKey { key, .. } => (
            match key {
                Some(key) => format!("duplicate key `{key}`"),
                None => "duplicate key".to_owned(),
            },
            Some("each key may appear once per mapping".to_owned()),
        ),
        E::InvalidScalar { ty, .. } => (
            format!("invalid value: expected {}", describe_scalar(ty)),
            None,
        ),
        E::Unexpected { expected, .. } => (
            format!("unexpected YAML here: expected {expected}"),
            Some(
                "a workspace document is a mapping with apiVersion, kind, metadata and spec"
                    .to_owned(),
            ),
        ),
        E::SerdeUnknownField {
            field, expected, ..
        } => (
            formatted(inner),
            did_you_mean(field, expected.iter().copied()),
        ),
        E::SerdeUnknownVariant {
            variant, expected, ..
        } => (
            formatted(inner),
            did_you_mean(variant, expected.iter().copied()),
        ),
        E::Budget { .. } => (
            formatted(inner),
            Some("workspace YAML is limited in nesting depth, size and alias expansion".to_owned()),
        ),
        _ => (formatted(inner), None),
    };
    origin
        .diagnostic(position, message)
        .with_optional_hint(hint)
}

/// The library's own wording, with control characters neutralised.
fn formatted(error: &serde_saphyr::Error) -> String {
    serde_saphyr::DefaultMessageFormatter
        .format_message(error)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Rust scalar type names in words a workspace author knows.
fn describe_scalar(ty: &str) -> String {
    match ty {
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a whole number (0 or more)".to_owned(),
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "a whole number".to_owned(),
        "f32" | "f64" => "a number".to_owned(),
        "bool" => "true or false".to_owned(),
        "char" => "a single character".to_owned(),
        other => format!("a value of type {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_on_document_markers_only() {
        let text =
            "a: 1\n---\nb: |\n  --- not a marker\n---   # comment\nc: 3\n---\n# only a comment\n";
        let docs = split_documents(text);
        assert_eq!(docs.len(), 3);
        assert_eq!(docs[0], (0, "a: 1\n"));
        assert_eq!(docs[1].0, 1);
        assert!(docs[1].1.contains("not a marker"));
        assert_eq!(docs[2], (4, "---   # comment\nc: 3\n"));
    }

    #[test]
    fn directives_travel_with_their_document() {
        let docs = split_documents("a: 1\n%YAML 1.2\n---\nb: 2\n");
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1], (1, "%YAML 1.2\n---\nb: 2\n"));
    }
}
