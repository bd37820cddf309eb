//! API keys: client keys for `/v1` and `/runtime`, admin keys for `/admin`, compared in
//! constant time. No key: 401; a key of the other scope: 403; a surface with no keys
//! configured is open (and `start` warns loudly about it).

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::AppState;
use crate::error::{ApiError, ErrorCode};

/// A set of secret keys; `Debug` never prints them.
#[derive(Clone, Default)]
pub struct KeySet(Vec<String>);

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeySet([redacted; {}])", self.0.len())
    }
}

impl KeySet {
    /// Keys from explicit values and from the named environment variables (comma-separated).
    pub fn collect(explicit: &[String], env_vars: &[String]) -> Self {
        let mut keys: Vec<String> = explicit.iter().map(|k| k.trim().to_owned()).collect();
        for var in env_vars {
            if let Ok(value) = std::env::var(var) {
                keys.extend(value.split(',').map(|k| k.trim().to_owned()));
            }
        }
        keys.retain(|k| !k.is_empty());
        keys.sort();
        keys.dedup();
        Self(keys)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `candidate` is one of the keys; every key is compared, in constant time each.
    pub fn contains(&self, candidate: &str) -> bool {
        self.position(candidate).is_some()
    }

    /// The 1-based number of the matching key (every key is compared, in constant time each).
    pub fn position(&self, candidate: &str) -> Option<usize> {
        let mut found = 0usize;
        for (index, key) in self.0.iter().enumerate() {
            let matched: bool = key.as_bytes().ct_eq(candidate.as_bytes()).into();
            found |= usize::from(matched) * (index + 1);
        }
        (found != 0).then_some(found)
    }
}

/// The client and admin key sets.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    pub client: KeySet,
    pub admin: KeySet,
}

#[derive(Clone, Copy)]
enum Scope {
    Client,
    Admin,
}

fn bearer(request: &Request) -> Option<&str> {
    let value = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn check(keys: &ApiKeys, scope: Scope, request: &Request) -> Result<(), ApiError> {
    let (own, other, surface) = match scope {
        Scope::Client => (&keys.client, &keys.admin, "a client key"),
        Scope::Admin => (&keys.admin, &keys.client, "an admin key"),
    };
    if own.is_empty() {
        return Ok(());
    }
    let Some(token) = bearer(request) else {
        return Err(ApiError::new(
            ErrorCode::MissingApiKey,
            format!("this endpoint needs {surface}: send `Authorization: Bearer <key>`"),
        ));
    };
    if own.contains(token) {
        Ok(())
    } else if other.contains(token) {
        Err(ApiError::new(
            ErrorCode::WrongKeyScope,
            match scope {
                Scope::Client => "an admin key cannot be used here; use a client key",
                Scope::Admin => "a client key cannot be used on /admin; use an admin key",
            },
        ))
    } else {
        Err(ApiError::new(
            ErrorCode::InvalidApiKey,
            "the API key is not valid",
        ))
    }
}

pub async fn require_client_key_v1(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    match check(&state.keys, Scope::Client, &request) {
        Ok(()) => next.run(request).await,
        Err(error) => error.on_openai_surface().into_response(),
    }
}

pub async fn require_client_key(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    match check(&state.keys, Scope::Client, &request) {
        Ok(()) => next.run(request).await,
        Err(error) => error.into_response(),
    }
}

/// Who called an admin endpoint, as recorded with their decisions: the number of their key
/// (never the key), or `open-admin` when the admin surface has no keys.
#[derive(Debug, Clone)]
pub struct Operator(pub String);

pub async fn require_admin_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    match check(&state.keys, Scope::Admin, &request) {
        Ok(()) => {
            let operator = bearer(&request)
                .and_then(|token| state.keys.admin.position(token))
                .map_or_else(|| "open-admin".to_owned(), |n| format!("admin-key-{n}"));
            request.extensions_mut().insert(Operator(operator));
            next.run(request).await
        }
        Err(error) => error.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::KeySet;

    #[test]
    fn keys_match_exactly() {
        let keys = KeySet::collect(&["alpha".into(), " beta ".into(), String::new()], &[]);
        assert!(keys.contains("alpha") && keys.contains("beta"));
        assert!(!keys.contains("alph") && !keys.contains("alphaa") && !keys.contains(""));
        assert_eq!(format!("{keys:?}"), "KeySet([redacted; 2])");
    }
}
