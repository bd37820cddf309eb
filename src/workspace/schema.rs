//! The JSON Schema of workspace documents, generated from the raw types the loader reads, so
//! an editor that validates YAML against it agrees with `stable-harness validate` on shape.

use schemars::JsonSchema;

use super::raw::{
    API_VERSION, AgentSpec, Metadata, ModelCatalogSpec, RuntimeSpec, ToolCatalogSpec, WorkflowSpec,
};

/// A workspace document as the schema describes it: `kind` selects the `spec` type.
/// (The loader reads the same spec types; this enum only exists to describe them.)
#[derive(JsonSchema)]
#[serde(tag = "kind", deny_unknown_fields)]
// Never constructed, so the size of its variants costs nothing.
#[allow(dead_code, clippy::large_enum_variant)]
enum WorkspaceDocument {
    Runtime(DocumentBody<RuntimeSpec>),
    Agent(DocumentBody<AgentSpec>),
    ModelCatalog(DocumentBody<ModelCatalogSpec>),
    ToolCatalog(DocumentBody<ToolCatalogSpec>),
    Workflow(DocumentBody<WorkflowSpec>),
}

#[derive(JsonSchema)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct DocumentBody<S> {
    /// Always `stable-harness/v1`.
    api_version: String,
    metadata: Metadata,
    spec: S,
}

/// The JSON Schema (draft 2020-12) one workspace document must satisfy.
pub fn document_schema() -> serde_json::Value {
    let mut schema =
        serde_json::to_value(schemars::schema_for!(WorkspaceDocument)).unwrap_or_default();
    if let Some(object) = schema.as_object_mut() {
        object.insert("title".into(), "stable-harness workspace document".into());
        object.insert(
            "description".into(),
            "One YAML document under a workspace's config/ folder (stable-harness schema).".into(),
        );
    }
    tidy(&mut schema);
    schema
}

/// Every `apiVersion` property becomes a constant, so editors flag other versions; the
/// `default: null` that optional fields produce is dropped as noise.
fn tidy(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(object) => {
            if let Some(property) = object
                .get_mut("properties")
                .and_then(|p| p.get_mut("apiVersion"))
            {
                *property = serde_json::json!({ "const": API_VERSION, "description": "Always `stable-harness/v1`." });
            }
            if object
                .get("default")
                .is_some_and(serde_json::Value::is_null)
            {
                object.remove("default");
            }
            object.values_mut().for_each(tidy);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(tidy),
        _ => {}
    }
}
