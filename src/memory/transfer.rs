//! Memory export and import as JSON Lines: one record per line, as `GET /admin/memory` shows
//! it. An import checks every line before it writes any: a file with a bad line imports
//! nothing (unless asked to skip bad lines), and every bad line is reported with its number.

use chrono::Utc;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{check_namespace, content_hash, is_shared, near_hash};
use crate::store::{MemoryRecord, MemoryStatus};

/// One record as a line of an export (no trailing newline).
pub fn export_line(record: &MemoryRecord) -> String {
    serde_json::to_string(record).unwrap_or_default()
}

/// A line of an import: what a record needs, the rest optional.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ImportedLine {
    namespace: String,
    content: String,
    #[serde(default)]
    scope: String,
    #[serde(default)]
    owner: Option<String>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    status: Option<MemoryStatus>,
    #[serde(default)]
    source_request_id: Option<String>,
    #[serde(default)]
    source_run_id: Option<String>,
    #[serde(default)]
    decided_by: Option<String>,
    #[serde(default)]
    created_at: Option<chrono::DateTime<Utc>>,
    #[serde(default)]
    updated_at: Option<chrono::DateTime<Utc>>,
}

/// A line that cannot be imported.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct LineError {
    /// 1-based.
    pub line: usize,
    pub message: String,
}

/// The records of a JSON Lines text, each given a new id (exact duplicates merge by content
/// when stored), and every bad line; blank lines are skipped.
pub fn parse_import(text: &str, max_content_bytes: usize) -> (Vec<MemoryRecord>, Vec<LineError>) {
    let mut records = Vec::new();
    let mut errors = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(line, max_content_bytes) {
            Ok(record) => records.push(record),
            Err(message) => errors.push(LineError {
                line: index + 1,
                message,
            }),
        }
    }
    (records, errors)
}

fn parse_line(line: &str, max_content_bytes: usize) -> Result<MemoryRecord, String> {
    let imported: ImportedLine =
        serde_json::from_str(line).map_err(|error| format!("not a memory record: {error}"))?;
    check_namespace(&imported.namespace)?;
    let content = imported.content.trim();
    if content.is_empty() {
        return Err("`content` is empty".to_owned());
    }
    if content.len() > max_content_bytes {
        return Err(format!(
            "`content` is {} bytes; at most {max_content_bytes} are kept (memory.write.maxContentBytes)",
            content.len()
        ));
    }
    if let Some(metadata) = &imported.metadata {
        let size = metadata.to_string().len();
        if !metadata.is_object() || size > max_content_bytes {
            return Err(format!(
                "`metadata` must be an object of at most {max_content_bytes} bytes (memory.write.maxContentBytes)"
            ));
        }
    }
    // Shared namespaces have no scope; private ones must name theirs.
    let shared = is_shared(&imported.namespace);
    if shared != imported.scope.is_empty() {
        return Err(if shared {
            "`scope` must be empty for an `agent/` namespace".to_owned()
        } else {
            "`scope` (the owning key's identity) is required for `user/` and `session/` namespaces"
                .to_owned()
        });
    }
    let now = Utc::now();
    let created_at = imported.created_at.unwrap_or(now);
    Ok(MemoryRecord {
        id: crate::runtime::new_id("mem"),
        owner: imported.owner.unwrap_or_else(|| imported.scope.clone()),
        namespace: imported.namespace,
        scope: imported.scope,
        content_hash: content_hash(content),
        near_hash: near_hash(content),
        content: content.to_owned(),
        metadata: imported
            .metadata
            .unwrap_or_else(|| Value::Object(Default::default())),
        status: imported.status.unwrap_or(MemoryStatus::Active),
        source_request_id: imported.source_request_id,
        source_run_id: imported.source_run_id,
        decided_by: imported.decided_by,
        created_at,
        updated_at: imported.updated_at.unwrap_or(created_at),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bad_line_is_reported_with_its_number() {
        let text = concat!(
            r#"{"namespace":"agent/a","content":"tea"}"#,
            "\n\nnot json\n",
            r#"{"namespace":"team/x","content":"y"}"#,
            "\n",
            r#"{"namespace":"user/ada","content":"z"}"#,
            "\n",
            r#"{"namespace":"user/ada","scope":"key-a","content":"fine","status":"pending"}"#,
            "\n",
            r#"{"namespace":"agent/a","content":"meta","metadata":[1]}"#,
        );
        let (records, errors) = parse_import(text, 100);
        assert_eq!(records.len(), 2);
        assert_eq!(records[1].status, MemoryStatus::Pending);
        let lines: Vec<usize> = errors.iter().map(|e| e.line).collect();
        assert_eq!(lines, [3, 4, 5, 7]);
    }

    #[test]
    fn an_exported_record_imports_as_itself_under_a_new_id() {
        let (records, _) = parse_import(r#"{"namespace":"agent/a","content":" tea "}"#, 100);
        let line = export_line(&records[0]);
        let (again, errors) = parse_import(&line, 100);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(again[0].content, "tea");
        assert_eq!(again[0].content_hash, records[0].content_hash);
        assert_ne!(again[0].id, records[0].id);
    }
}
