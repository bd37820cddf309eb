//! Extractors that answer in the error envelope, never in axum's plain-text rejections.
//!
//! - Bodies ([`ApiJson`], [`V1Json`]): read within `limits.maxRequestBytes` (413 beyond, sent
//!   once the refused body was read on to its end, within bounds: a client still writing it
//!   gets the answer, not a broken pipe), parsed as JSON with the path of the offending field
//!   as the error's `param`. Malformed JSON and unknown fields are 400; well-formed but
//!   invalid content is 422 (400 on `/v1`, as OpenAI does).
//! - Query strings ([`ApiQuery`]): a value that does not parse is 400 `invalid_parameter`, an
//!   unknown parameter 400 `unknown_field`, both naming the parameter. Range checks (422) are
//!   the handler's, on the parsed value.
//! - Path parameters ([`ApiPath`]): a segment that does not decode or parse (invalid UTF-8
//!   after percent-decoding) is 400 `invalid_parameter` naming the parameter.

use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use futures::StreamExt;
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
    let drain_bound = limit.saturating_add(DRAIN_BYTES);
    let mut body = request.into_body().into_data_stream();
    if let Some(length) = declared
        && length > limit
    {
        // Refused before a byte is kept; read on (and dropped) only if it ends within bounds.
        if length <= drain_bound {
            drain(body, length).await;
        }
        return Err(too_large());
    }
    // Room for the declared length (within the limit, checked above) from the start, up to
    // a bound (what a client declares is not trusted with more): a body of megabytes (a
    // long transcript) grown chunk by chunk was copied at each doubling.
    let declared = declared.map_or(0, |length| usize::try_from(length).unwrap_or(0));
    let mut bytes = Vec::with_capacity(declared.min(RESERVED_BYTES));
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|_| read_failed())?;
        if (bytes.len() as u64).saturating_add(chunk.len() as u64) > limit {
            drain(body, drain_bound.saturating_sub(bytes.len() as u64)).await;
            return Err(too_large());
        }
        bytes.extend_from_slice(&chunk);
    }
    // No body reads as `{}`: a POST whose fields are all optional needs none.
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return from_json(b"{}");
    }
    from_json(&bytes)
}

/// The most room a body is given up front, on its declared length.
const RESERVED_BYTES: usize = 8 * 1024 * 1024;

/// A refused body is read on and dropped, up to this many bytes past the limit and for at
/// most [`DRAIN_TIME`], before the 413 is sent. A client still writing its body when the
/// server closes the connection gets a broken pipe, and HTTP clients report that failure,
/// not the answer waiting for them. Past either bound the connection closes at once.
const DRAIN_BYTES: u64 = 16 * 1024 * 1024;
/// Longest a refused body is read on.
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Reads and drops at most `bound` more bytes of `body`, for at most [`DRAIN_TIME`].
async fn drain(mut body: axum::body::BodyDataStream, bound: u64) {
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        let mut read = 0u64;
        while read <= bound
            && let Some(Ok(chunk)) = body.next().await
        {
            read = read.saturating_add(chunk.len() as u64);
        }
    })
    .await;
}

fn read_failed() -> ApiError {
    ApiError::new(
        ErrorCode::InvalidRequest,
        "the request body could not be read to its end",
    )
}

/// Parses JSON, naming the field at fault.
pub fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // The path to a field is tracked only in a second pass over a body the first refused:
    // tracking it costs an allocation for every member of every object (an agent's
    // transcript has thousands), and nearly every body parses. The first pass is the
    // stricter (it also refuses text after the value), so what it takes the second would
    // take the same, and what it refuses the second judges as it always has.
    if let Ok(value) = serde_json::from_slice(bytes) {
        return Ok(value);
    }
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

/// A query string (`?after=3&limit=10`) whose rejections use the envelope.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        from_query(parts.uri.query().unwrap_or_default()).map(ApiQuery)
    }
}

/// Parses a query string, naming the parameter at fault.
pub fn from_query<T: DeserializeOwned>(query: &str) -> Result<T, ApiError> {
    let deserializer =
        serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
    serde_path_to_error::deserialize::<_, T>(deserializer).map_err(|error| {
        let path = error.path().to_string();
        let message = error.into_inner().to_string();
        // serde names an unknown field in the message; the path stops before it.
        let unknown = message
            .strip_prefix("unknown field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(field, _)| field.to_owned());
        let (code, param) = match unknown {
            Some(field) => (ErrorCode::UnknownField, Some(field)),
            None => (
                ErrorCode::InvalidParameter,
                (!path.is_empty() && path != ".").then_some(path),
            ),
        };
        let described = match &param {
            Some(param) => format!("invalid query parameter `{param}`: {message}"),
            None => format!("invalid query string: {message}"),
        };
        let mut error = ApiError::new(code, described);
        error.param = param;
        error
    })
}

/// Path parameters (`/requests/{id}`) whose rejections use the envelope.
#[derive(Debug)]
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(ApiPath(value)),
            Err(rejection) => {
                // A route with one parameter names it even when the error does not.
                let raw = axum::extract::RawPathParams::from_request_parts(parts, state).await;
                let only = raw.ok().and_then(|params| {
                    let mut names = params.iter().map(|(name, _)| name.to_owned());
                    match (names.next(), names.next()) {
                        (Some(only), None) => Some(only),
                        _ => None,
                    }
                });
                Err(path_error(rejection, only))
            }
        }
    }
}

fn path_error(rejection: PathRejection, only_param: Option<String>) -> ApiError {
    use axum::extract::path::ErrorKind;
    let PathRejection::FailedToDeserializePathParams(failed) = rejection else {
        // Only a handler mounted without its route's parameters gets here: our bug, not input.
        return ApiError::internal(rejection.body_text());
    };
    let message = failed.kind().to_string();
    let key = match failed.into_kind() {
        ErrorKind::ParseErrorAtKey { key, .. }
        | ErrorKind::InvalidUtf8InPathParam { key }
        | ErrorKind::DeserializeError { key, .. } => Some(key),
        _ => None,
    };
    let param = key.or(only_param);
    let mut error = ApiError::new(
        ErrorCode::InvalidParameter,
        format!("invalid path parameter: {message}"),
    );
    error.param = param;
    error
}
