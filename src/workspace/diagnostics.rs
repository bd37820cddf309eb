//! Diagnostics: every problem found in a workspace, each with `file:line:col`, a message and
//! an optional hint. Loading never stops at the first problem; it gathers them all.

use std::fmt;

use serde::Serialize;

/// One problem found while loading or compiling a workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Diagnostic {
    /// Path relative to the workspace root, `/`-separated (a folder ends in `/`).
    pub file: String,
    /// 1-based line; absent when the problem is about a file or folder as a whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<u64>,
    /// 1-based column; absent with `line`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub column: Option<u64>,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

impl Diagnostic {
    /// A problem at a position in a file.
    pub fn at(file: impl Into<String>, line: u64, column: u64, message: impl Into<String>) -> Self {
        Self {
            file: file.into(),
            line: Some(line),
            column: Some(column),
            message: message.into(),
            hint: None,
        }
    }

    /// A problem about a whole file or folder.
    pub fn whole(file: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            file: file.into(),
            line: None,
            column: None,
            message: message.into(),
            hint: None,
        }
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    pub fn with_optional_hint(mut self, hint: Option<String>) -> Self {
        self.hint = hint;
        self
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.line, self.column) {
            (Some(line), Some(column)) => {
                write!(f, "{}:{line}:{column}: {}", self.file, self.message)?
            }
            _ => write!(f, "{}: {}", self.file, self.message)?,
        }
        if let Some(hint) = &self.hint {
            write!(f, " (hint: {hint})")?;
        }
        Ok(())
    }
}

/// All the problems of one workspace, in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq, thiserror::Error)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    pub fn push(&mut self, diagnostic: Diagnostic) {
        self.0.push(diagnostic);
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Diagnostic> {
        self.0.iter()
    }

    /// Orders by file, then position, so output is stable whatever order checks ran in.
    pub fn sort(&mut self) {
        self.0.sort_by(|a, b| {
            (&a.file, a.line.unwrap_or(0), a.column.unwrap_or(0)).cmp(&(
                &b.file,
                b.line.unwrap_or(0),
                b.column.unwrap_or(0),
            ))
        });
        self.0.dedup();
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for diagnostic in &self.0 {
            writeln!(f, "{diagnostic}")?;
        }
        write!(f, "{} problem(s) found", self.0.len())
    }
}

/// The closest candidate to `given`, if one is close enough to be a likely typo.
pub fn did_you_mean<'a>(
    given: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    candidates
        .into_iter()
        .map(|candidate| (strsim::jaro_winkler(given, candidate), candidate))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, candidate)| format!("did you mean `{candidate}`?"))
}
