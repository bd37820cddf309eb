//! Request bodies: read within `limits.maxRequestBytes` (413 beyond), parsed as JSON with the
//! path of the offending field as the error's `param`. Malformed JSON and unknown fields are
//! 400; well-formed but invalid content is 422 (400 on `/v1`, as OpenAI does).

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use super::AppState;
use crate::error::{ApiError, ErrorCode};

/// A JSON body on `/runtime` and `/admin`.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// A JSON body on `/v1`.
#[derive(Debug)]
pub struct V1Json<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        parse(request, state).await.map(ApiJson)
    }
}

impl<T: DeserializeOwned> FromRequest<AppState> for V1Json<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        parse(request, state)
            .await
            .map(V1Json)
            .map_err(ApiError::on_openai_surface)
    }
}

async fn parse<T: DeserializeOwned>(request: Request, state: &AppState) -> Result<T, ApiError> {
    let limit = state.runtime.workspace().runtime.limits.max_request_bytes;
    let too_large = || {
        ApiError::new(
            ErrorCode::BodyTooLarge,
            format!(
                "the request body is larger than the {limit}-byte limit (limits.maxRequestBytes)"
            ),
        )
    };
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit) {
        return Err(too_large());
    }
    let body: Body = request.into_body();
    let bytes = axum::body::to_bytes(body, usize::try_from(limit).unwrap_or(usize::MAX))
        .await
        .map_err(|_| too_large())?;
    // No body reads as `{}`: a POST whose fields are all optional needs none.
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return from_json(b"{}");
    }
    from_json(&bytes)
}

/// Parses JSON, naming the field at fault.
pub fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(&mut deserializer) {
        Ok(value) => Ok(value),
        Err(error) => {
            let path = error.path().to_string();
            let inner = error.into_inner();
            let syntax = matches!(
                inner.classify(),
                serde_json::error::Category::Syntax | serde_json::error::Category::Eof
            );
            // A syntax error has no field at fault, whatever the parser had reached.
            let param = (!syntax && !path.is_empty() && path != ".").then_some(path);
            let message = inner.to_string();
            let code = if syntax {
                ErrorCode::InvalidJson
            } else if message.starts_with("unknown field") {
                ErrorCode::UnknownField
            } else {
                ErrorCode::InvalidRequest
            };
            let mut error = ApiError::new(code, format!("invalid request body: {message}"));
            error.param = param;
            Err(error)
        }
    }
}
