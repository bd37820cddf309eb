//! The OpenAPI document, generated from the handlers' annotations (`GET /openapi.json`,
//! `stable-harness openapi`, committed as `openapi/openapi.json` and checked by a test).

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

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
        super::runtime_api::create_request,
        super::runtime_api::get_request,
        super::runtime_api::request_events,
        super::runtime_api::cancel_request,
        super::runtime_api::get_session,
        super::runtime_api::fork_session,
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
        super::admin::explain_policy,
        super::admin::get_store,
        super::admin::prune_store,
        super::admin::backup_store,
        super::inspect::workspace,
        super::inspect::reload_workspace,
        super::inspect::health,
        super::inspect::metrics,
    ),
    components(schemas(crate::error::ErrorEnvelope, crate::error::ErrorBody, crate::store::EventRecord, crate::store::RunStatus, crate::store::ApprovalStatus)),
    modifiers(&Security),
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
        for name in ["client_key", "admin_key"] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
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
