//! The OpenAPI document, generated from the handlers' annotations (`GET /openapi.json`,
//! `stable-harness openapi`, committed as `openapi/openapi.json` and checked by a test).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::views::Json;

#[derive(Debug, OpenApi)]
#[openapi(
    info(title = "stable-harness", description = "OpenAI-compatible /v1, native /runtime and operator /admin APIs of a stable-harness workspace."),
    paths(
        super::health::healthz,
        super::health::readyz,
        super::v1::list_models,
        super::v1::get_model,
        super::v1::capabilities,
        super::v1::chat_completions,
        super::responses::create_response,
        super::responses::get_response,
        super::runtime_api::create_request,
        super::runtime_api::get_request,
        super::runtime_api::request_events,
        super::runtime_api::cancel_request,
        super::runtime_api::get_session,
        super::runtime_api::fork_session,
        super::callbacks::call_tool,
        super::callbacks::get_call,
        super::admin::list_requests,
        super::admin::get_request,
        super::admin::request_events,
        super::admin::cancel_request,
        super::admin::retry_request,
        super::admin::get_run,
        super::admin::run_events,
        super::inspect::run_trace,
        super::admin::list_sessions,
        super::admin::get_session,
        super::admin::list_approvals,
        super::admin::get_approval,
        super::admin::approve,
        super::admin::deny,
        super::memory::list_memory,
        super::memory::get_memory,
        super::memory::delete_memory,
        super::memory::approve_memory,
        super::memory::reject_memory,
        super::memory::memory_maintenance,
        super::admin::explain_policy,
        super::spend::usage,
        super::spend::budgets,
        super::admin::get_store,
        super::admin::prune_store,
        super::admin::backup_store,
        super::inspect::workspace,
        super::inspect::reload_workspace,
        super::inspect::health,
        super::inspect::metrics,
    ),
    components(schemas(crate::error::ErrorEnvelope, crate::error::ErrorBody, crate::store::EventRecord, crate::store::RunStatus, crate::store::ApprovalStatus)),
    modifiers(&Security, &CommonErrors),
    tags(
        (name = "v1", description = "OpenAI-compatible: agents are models"),
        (name = "runtime", description = "Native runtime API"),
        (name = "admin", description = "Operator API"),
        (name = "health", description = "Liveness and readiness"),
    )
)]
pub struct ApiDoc;

struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        for name in ["client_key", "admin_key", "callback_token"] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

/// The errors any operation may answer, in the one envelope: 401 and 403 where a key is
/// needed, 413 where a body is read, and 500 (a real server fault) and 503 (shutting down, or
/// the store cannot answer for now) everywhere. Operations list their own errors beside these.
struct CommonErrors;

impl Modify for CommonErrors {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let envelope = |description: &str| {
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("ErrorEnvelope")))
                        .build(),
                )
                .build()
        };
        for item in openapi.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.delete,
                &mut item.patch,
            ];
            for operation in operations.into_iter().flatten() {
                let secured = operation
                    .security
                    .as_ref()
                    .is_some_and(|security| !security.is_empty());
                let mut common = vec![
                    ("500", "A server fault (never bad input)"),
                    ("503", "Shutting down, or the store cannot answer for now"),
                ];
                if secured {
                    common.push(("401", "No key, or a key the server does not know"));
                    common.push(("403", "A key of the other surface's scope"));
                }
                if operation.request_body.is_some() {
                    common.push(("413", "The body is larger than `limits.maxRequestBytes`"));
                }
                for (status, description) in common {
                    operation
                        .responses
                        .responses
                        .entry(status.to_owned())
                        .or_insert_with(|| envelope(description).into());
                }
            }
        }
    }
}

/// The document as pretty JSON (what `stable-harness openapi` prints).
pub fn document() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}

/// `GET /docs`: Swagger UI, embedded in the binary, browsing `/openapi.json`.
pub fn docs_ui<S: Clone + Send + Sync + 'static>() -> axum::Router<S> {
    let config = utoipa_swagger_ui::Config::from("/openapi.json");
    axum::Router::from(utoipa_swagger_ui::SwaggerUi::new("/docs").config(config))
}

pub async fn serve() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
