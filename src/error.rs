//! The error-code table: every error any HTTP surface returns, with its status, OpenAI-style
//! `type` and log level, rendered once into SPEC section 6's envelope
//! `{"error": {"message", "type", "code", "param"}}`. Internal details are logged, never sent.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Every error code, one status each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// Malformed JSON or a body that is not the expected shape.
    InvalidJson,
    /// Well-formed but unacceptable content (400 on `/v1`, 422 elsewhere).
    InvalidRequest,
    /// A field the endpoint does not know (400).
    UnknownField,
    /// A query-string or path parameter that does not parse (`?limit=abc`, invalid UTF-8 in an
    /// id): 400, with the parameter as `param`. A value that parses but is out of range is
    /// `InvalidRequest` (422).
    InvalidParameter,
    /// A chat message no model can be given (unknown role, missing or mistyped content): 400 on
    /// every surface, as OpenAI answers it, so that it never reaches an upstream.
    InvalidMessage,
    /// Client-supplied `tools` on `/v1`: the workspace inventory decides what is callable.
    ToolsNotSupported,
    MissingApiKey,
    InvalidApiKey,
    /// A valid key of the other scope (client key on `/admin`, admin key on `/v1`).
    WrongKeyScope,
    ModelNotFound,
    AgentNotFound,
    WorkflowNotFound,
    RequestNotFound,
    RunNotFound,
    SessionNotFound,
    ApprovalNotFound,
    /// A stored response that does not exist, is not stored, or is another key's.
    ResponseNotFound,
    /// A remote agent's callback call that its run does not know.
    CallNotFound,
    ToolNotFound,
    RouteNotFound,
    /// A whole surface switched off by the workspace (`protocols.openai.enabled: false`).
    SurfaceDisabled,
    MethodNotAllowed,
    BodyTooLarge,
    /// The approval was decided already (deciding twice).
    ApprovalDecided,
    /// A cancel of a request that has ended.
    RequestEnded,
    /// A retry of a request that is not failed or cancelled.
    RequestNotRetryable,
    /// A message id that is not in the session's history (a fork point).
    MessageNotFound,
    MemoryNotFound,
    /// A decision about a memory record that is not pending.
    MemoryNotPending,
    /// An import file with lines that cannot be imported (nothing was imported).
    InvalidImport,
    /// A workspace reload found problems (or a change only a restart applies).
    InvalidWorkspace,
    /// A file the request would create exists already (a backup never overwrites).
    AlreadyExists,
    /// A `/v1` call waited `approvalWait` and the run still waits on an operator.
    ApprovalPending,
    TooManyRuns,
    /// A budget has no room for the request or its next model call.
    BudgetExceeded,
    /// A rate limit of the key or agent is exhausted for now.
    RateLimited,
    UpstreamError,
    UpstreamTimeout,
    /// The agent's backend cannot serve the request in this build.
    BackendUnavailable,
    RunFailed,
    ShuttingDown,
    /// The store cannot write at the moment (full disk, I/O errors): nothing new is accepted.
    StoreUnavailable,
    Internal,
}

impl ErrorCode {
    pub fn status(self) -> StatusCode {
        use ErrorCode::*;
        match self {
            InvalidJson | UnknownField | InvalidParameter | InvalidMessage | ToolsNotSupported => {
                StatusCode::BAD_REQUEST
            }
            InvalidRequest | InvalidWorkspace | InvalidImport => StatusCode::UNPROCESSABLE_ENTITY,
            MissingApiKey | InvalidApiKey => StatusCode::UNAUTHORIZED,
            WrongKeyScope => StatusCode::FORBIDDEN,
            ModelNotFound | AgentNotFound | WorkflowNotFound | RequestNotFound | RunNotFound
            | SessionNotFound | ApprovalNotFound | ToolNotFound | RouteNotFound
            | SurfaceDisabled | MessageNotFound | MemoryNotFound | ResponseNotFound
            | CallNotFound => StatusCode::NOT_FOUND,
            ApprovalDecided | ApprovalPending | AlreadyExists | RequestEnded
            | RequestNotRetryable | MemoryNotPending => StatusCode::CONFLICT,
            MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            TooManyRuns | BudgetExceeded | RateLimited => StatusCode::TOO_MANY_REQUESTS,
            UpstreamError | RunFailed => StatusCode::BAD_GATEWAY,
            UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            BackendUnavailable | ShuttingDown | StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's error `type` for this code.
    pub fn error_type(self) -> &'static str {
        use ErrorCode::*;
        match self {
            InvalidJson | InvalidRequest | UnknownField | InvalidParameter | InvalidMessage
            | ToolsNotSupported | ModelNotFound | AgentNotFound | WorkflowNotFound
            | RequestNotFound | RunNotFound | SessionNotFound | ApprovalNotFound | ToolNotFound
            | RouteNotFound | SurfaceDisabled | MethodNotAllowed | BodyTooLarge
            | ApprovalDecided | ApprovalPending | AlreadyExists | RequestEnded
            | RequestNotRetryable | MessageNotFound | InvalidWorkspace | MemoryNotFound
            | MemoryNotPending | InvalidImport | ResponseNotFound | CallNotFound => {
                "invalid_request_error"
            }
            MissingApiKey | InvalidApiKey => "authentication_error",
            WrongKeyScope => "permission_error",
            TooManyRuns | BudgetExceeded | RateLimited => "rate_limit_error",
            UpstreamError | UpstreamTimeout | RunFailed => "upstream_error",
            BackendUnavailable | ShuttingDown | StoreUnavailable | Internal => "server_error",
        }
    }

    pub fn as_str(self) -> &'static str {
        use ErrorCode::*;
        match self {
            InvalidJson => "invalid_json",
            InvalidRequest => "invalid_request",
            UnknownField => "unknown_field",
            InvalidParameter => "invalid_parameter",
            InvalidMessage => "invalid_message",
            ToolsNotSupported => "tools_not_supported",
            MissingApiKey => "missing_api_key",
            InvalidApiKey => "invalid_api_key",
            WrongKeyScope => "wrong_key_scope",
            ModelNotFound => "model_not_found",
            AgentNotFound => "agent_not_found",
            WorkflowNotFound => "workflow_not_found",
            RequestNotFound => "request_not_found",
            RunNotFound => "run_not_found",
            SessionNotFound => "session_not_found",
            ApprovalNotFound => "approval_not_found",
            ResponseNotFound => "response_not_found",
            CallNotFound => "call_not_found",
            ToolNotFound => "tool_not_found",
            ApprovalDecided => "approval_already_decided",
            RequestEnded => "request_ended",
            RequestNotRetryable => "request_not_retryable",
            MessageNotFound => "message_not_found",
            MemoryNotFound => "memory_not_found",
            MemoryNotPending => "memory_not_pending",
            InvalidImport => "invalid_import",
            InvalidWorkspace => "invalid_workspace",
            AlreadyExists => "already_exists",
            ApprovalPending => "approval_pending",
            RouteNotFound => "route_not_found",
            SurfaceDisabled => "surface_disabled",
            MethodNotAllowed => "method_not_allowed",
            BodyTooLarge => "body_too_large",
            TooManyRuns => "too_many_runs",
            BudgetExceeded => "budget_exceeded",
            RateLimited => "rate_limited",
            UpstreamError => "upstream_error",
            UpstreamTimeout => "upstream_timeout",
            BackendUnavailable => "backend_unavailable",
            RunFailed => "run_failed",
            ShuttingDown => "shutting_down",
            StoreUnavailable => "store_unavailable",
            Internal => "internal_error",
        }
    }
}

/// An error as every surface returns it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub param: Option<String>,
    /// `/v1` answers every invalid request with 400, as OpenAI does.
    pub openai_surface: bool,
    /// Extra fields for the envelope (e.g. the request id of a pending or failed run).
    pub request_id: Option<String>,
    /// Seconds to wait before trying again: sent as `retry-after` (429s).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            param: None,
            openai_surface: false,
            request_id: None,
            retry_after: None,
        }
    }

    pub fn retry_after(mut self, seconds: Option<u64>) -> Self {
        self.retry_after = seconds;
        self
    }

    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Self {
        self.request_id = Some(request_id.into());
        self
    }

    /// Marks the error as answered on `/v1`.
    pub fn on_openai_surface(mut self) -> Self {
        self.openai_surface = true;
        self
    }

    /// A server fault: the detail goes to the log, the client gets a generic message.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        tracing::error!(%detail, "internal error");
        Self::new(
            ErrorCode::Internal,
            "internal server error; the details are in the server log",
        )
    }

    pub fn status(&self) -> StatusCode {
        match self.code.status() {
            StatusCode::UNPROCESSABLE_ENTITY if self.openai_surface => StatusCode::BAD_REQUEST,
            status => status,
        }
    }

    /// The JSON envelope.
    pub fn body(&self) -> serde_json::Value {
        let mut error = serde_json::json!({
            "message": self.message,
            "type": self.code.error_type(),
            "code": self.code.as_str(),
            "param": self.param,
        });
        if let Some(request_id) = &self.request_id {
            error["requestId"] = request_id.clone().into();
        }
        serde_json::json!({ "error": error })
    }
}

/// The envelope's shape, for the OpenAPI document.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorEnvelope {
    pub error: ErrorBody,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub error_type: String,
    pub code: String,
    pub param: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(code = self.code.as_str(), message = %self.message, "request failed");
        }
        let mut response = (status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds),
            );
        }
        response
    }
}
