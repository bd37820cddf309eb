//! API keys: client keys for `/v1` and `/runtime`, admin keys for `/admin`. No key: 401; a
//! key of the other scope: 403; a surface with no keys configured is open (and `start` warns
//! loudly about it).
//!
//! Keys are never compared as text: both sides are hashed (SHA-256) and the digests compared
//! in constant time, so neither a key's content nor its length shows in the timing. Every key
//! has a stable identity — its configured name, else a fingerprint (a SHA-256 prefix) — which
//! owns what the key creates and names the operator who decides an approval. An identity
//! never depends on which other keys exist.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::AppState;
use crate::error::{ApiError, ErrorCode};
use crate::redact::Secret;

/// The identity of every caller on a surface that has no keys.
pub const ANONYMOUS: &str = "anonymous";

/// One accepted key: only its digest is kept. (A named key's labels live in the workspace;
/// the runtime looks them up by identity.)
#[derive(Clone)]
struct Key {
    digest: [u8; 32],
    identity: String,
}

/// A set of secret keys; `Debug` never prints them.
#[derive(Clone, Default)]
pub struct KeySet(Vec<Key>);

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeySet([redacted; {}])", self.0.len())
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The identity of an unnamed key: `key-` and the first 12 hex digits of its SHA-256.
pub fn fingerprint(key: &str) -> String {
    let digest = digest(key);
    format!("key-{}", crate::text::hex(&digest[..6]))
}

impl KeySet {
    /// Keys from explicit values and from the named environment variables (comma-separated),
    /// each known by its fingerprint.
    pub fn collect(explicit: &[Secret], env_vars: &[String]) -> Self {
        let mut keys: Vec<String> = explicit
            .iter()
            .map(|k| k.expose().trim().to_owned())
            .collect();
        for var in env_vars {
            if let Ok(value) = std::env::var(var) {
                keys.extend(value.split(',').map(|k| k.trim().to_owned()));
            }
        }
        keys.retain(|k| !k.is_empty());
        keys.sort();
        keys.dedup();
        Self(
            keys.iter()
                .map(|key| Key {
                    digest: digest(key),
                    identity: fingerprint(key),
                })
                .collect(),
        )
    }

    /// Adds a key known by `name`; a named key wins over the same key without a name.
    pub fn add_named(&mut self, key: &str, name: &str) {
        let key = key.trim();
        if key.is_empty() {
            return;
        }
        let digest = digest(key);
        self.0.retain(|existing| existing.digest != digest);
        self.0.push(Key {
            digest,
            identity: name.to_owned(),
        });
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `candidate` is one of the keys.
    pub fn contains(&self, candidate: &str) -> bool {
        self.find(candidate).is_some()
    }

    /// The key `candidate` is, if any. Every key's digest is compared with the candidate's
    /// in constant time, whatever matches.
    fn find(&self, candidate: &str) -> Option<&Key> {
        let wanted = digest(candidate);
        let mut found = None;
        for key in &self.0 {
            let matched: bool = key.digest.ct_eq(&wanted).into();
            if matched {
                found = Some(key);
            }
        }
        found
    }
}

/// Who is calling, as authentication established it (a request extension).
#[derive(Debug, Clone)]
pub struct Caller {
    /// The key's identity, or [`ANONYMOUS`] on an open surface.
    pub identity: String,
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
    bearer_token(request.headers())
}

/// The token of an `Authorization: Bearer …` header.
pub(super) fn bearer_token(headers: &axum::http::HeaderMap) -> Option<&str> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The caller, if the request carries a key of `scope` (or the surface is open).
fn check(keys: &ApiKeys, scope: Scope, request: &Request) -> Result<Caller, ApiError> {
    let (own, other, surface) = match scope {
        Scope::Client => (&keys.client, &keys.admin, "a client key"),
        Scope::Admin => (&keys.admin, &keys.client, "an admin key"),
    };
    if own.is_empty() {
        return Ok(Caller {
            identity: ANONYMOUS.to_owned(),
        });
    }
    let Some(token) = bearer(request) else {
        return Err(ApiError::new(
            ErrorCode::MissingApiKey,
            format!("this endpoint needs {surface}: send `Authorization: Bearer <key>`"),
        ));
    };
    if let Some(key) = own.find(token) {
        Ok(Caller {
            identity: key.identity.clone(),
        })
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
    mut request: Request,
    next: Next,
) -> Response {
    match check(&state.keys, Scope::Client, &request) {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(error) => error.on_openai_surface().into_response(),
    }
}

pub async fn require_client_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    match check(&state.keys, Scope::Client, &request) {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(error) => error.into_response(),
    }
}

/// Who called an admin endpoint, as recorded with their decisions: their key's identity
/// (never the key), or `open-admin` when the admin surface has no keys.
#[derive(Debug, Clone)]
pub struct Operator(pub String);

pub async fn require_admin_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    match check(&state.keys, Scope::Admin, &request) {
        Ok(caller) => {
            let operator = if caller.identity == ANONYMOUS {
                "open-admin".to_owned()
            } else {
                caller.identity
            };
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
        let keys = KeySet::collect(&["alpha".into(), " beta ".into(), "".into()], &[]);
        assert!(keys.contains("alpha") && keys.contains("beta"));
        assert!(!keys.contains("alph") && !keys.contains("alphaa") && !keys.contains(""));
        assert_eq!(format!("{keys:?}"), "KeySet([redacted; 2])");
        // An identity depends on the key alone, not on which other keys exist.
        let more = KeySet::collect(&["0-first".into(), "alpha".into()], &[]);
        let identity = |set: &KeySet| {
            set.find("alpha")
                .map(|k| k.identity.clone())
                .unwrap_or_default()
        };
        assert_eq!(identity(&keys), identity(&more));
        assert!(identity(&keys).starts_with("key-") && identity(&keys).len() == 16);
    }
}
