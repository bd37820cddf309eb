//! Redaction: secret values never land in anything stored or logged.
//!
//! Secrets are (1) the values of every environment variable the workspace names for
//! credentials (`apiKeyEnv`, `headersEnv`, an MCP server's headers, a command's declared
//! `env`), found wherever they appear in text; (2) whatever matches one of
//! `governance.redact.patterns`; and (3) the values of object keys that name a credential
//! (`password`, `token`, `apiKey`, `authorization`, ...), matched on word boundaries so that
//! `max_tokens` or `total_tokens` are not mistaken for one.
//!
//! Variable values are read when redaction happens, not once at start: a rotated key is
//! redacted from the moment it is in the environment. The journal redacts every write before
//! it reaches the store (one choke point for everything persisted); the gateway redacts what
//! a tool returns before the model sees it; log lines that quote outside text go through
//! [`Redactor::redact_text`].

use std::sync::Arc;

use serde_json::Value;

use crate::workspace::{CompiledWorkspace, McpTransport, ToolImplementation};

pub const REDACTED: &str = "[redacted]";

/// A secret value given on the command line or in code (an API key): `Debug` prints
/// `[redacted]`, so no config or argument struct that holds one can leak it into a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(value))
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self::new(value)
    }
}

/// Secrets shorter than this are not searched for in text: they would match by accident.
const MIN_SECRET_LEN: usize = 6;

/// What to redact; cheap to clone.
#[derive(Clone, Default)]
pub struct Redactor {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Names of the credential variables (their values are read at each use).
    variables: Vec<String>,
    patterns: Vec<regex::Regex>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Redactor({} variables, {} patterns)",
            self.inner.variables.len(),
            self.inner.patterns.len()
        )
    }
}

/// The secrets in force for one redaction pass (variable values read now).
#[derive(Default)]
pub struct Secrets<'a> {
    values: Vec<String>,
    patterns: &'a [regex::Regex],
}

impl std::fmt::Debug for Secrets<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets([redacted; {}])", self.values.len())
    }
}

impl Redactor {
    /// The credential variables the workspace names, and its redaction patterns.
    pub fn from_workspace(workspace: &CompiledWorkspace) -> Self {
        let mut names: Vec<String> = Vec::new();
        for model in workspace.models.values() {
            names.extend(model.api_key_env.clone());
        }
        for agent in workspace.agents.values() {
            if let Some(endpoint) = &agent.endpoint {
                names.extend(endpoint.api_key_env.clone());
            }
        }
        for tool in workspace.tools.values() {
            match &tool.implementation {
                ToolImplementation::Http { headers_env, .. } => {
                    names.extend(headers_env.values().cloned());
                }
                ToolImplementation::Command { command, .. } => {
                    names.extend(command.env.iter().cloned());
                }
                ToolImplementation::Mcp { .. }
                | ToolImplementation::Builtin(_)
                | ToolImplementation::Subagent(_)
                | ToolImplementation::Client => {}
            }
        }
        for provider in &workspace.runtime.memory.providers {
            names.extend(provider.api_key_env.clone());
        }
        for server in workspace.runtime.mcp_servers.values() {
            match &server.transport {
                McpTransport::Http { headers_env, .. } => {
                    names.extend(headers_env.values().cloned());
                }
                McpTransport::Stdio(command) => names.extend(command.env.iter().cloned()),
            }
        }
        names.sort();
        names.dedup();
        Self::new(names, workspace.runtime.governance.redact_patterns.clone())
    }

    pub fn new(variables: Vec<String>, patterns: Vec<regex::Regex>) -> Self {
        Self {
            inner: Arc::new(Inner {
                variables,
                patterns,
            }),
        }
    }

    /// What both redact: the union of their variables and patterns.
    pub fn merged(&self, other: &Redactor) -> Redactor {
        let mut variables = self.inner.variables.clone();
        variables.extend(other.inner.variables.iter().cloned());
        variables.sort();
        variables.dedup();
        let mut patterns = self.inner.patterns.clone();
        for pattern in &other.inner.patterns {
            if !patterns.iter().any(|p| p.as_str() == pattern.as_str()) {
                patterns.push(pattern.clone());
            }
        }
        Self::new(variables, patterns)
    }

    /// The secrets as they are now: read once per pass, used for many values.
    pub fn secrets(&self) -> Secrets<'_> {
        let mut values: Vec<String> = self
            .inner
            .variables
            .iter()
            .filter_map(|name| std::env::var(name).ok())
            .filter(|value| value.len() >= MIN_SECRET_LEN)
            .collect();
        // Longest first, so a secret containing another is replaced whole.
        values.sort_by_key(|s| std::cmp::Reverse(s.len()));
        values.dedup();
        Secrets {
            values,
            patterns: &self.inner.patterns,
        }
    }

    /// A copy of `value` with secrets replaced.
    pub fn redact(&self, value: &Value) -> Value {
        let mut value = value.clone();
        self.secrets().redact_in_place(&mut value);
        value
    }

    pub fn redact_text(&self, text: &str) -> String {
        self.secrets().redact_text(text)
    }
}

impl Secrets<'_> {
    /// Whether a pass would change nothing but credential-named keys.
    fn has_text_secrets(&self) -> bool {
        !self.values.is_empty() || !self.patterns.is_empty()
    }

    /// Replaces secrets inside `value`.
    pub fn redact_in_place(&self, value: &mut Value) {
        match value {
            Value::String(text) => {
                if self.has_text_secrets()
                    && let Some(redacted) = self.redact_changed(text)
                {
                    *text = redacted;
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| self.redact_in_place(v)),
            Value::Object(fields) => {
                for (key, field) in fields.iter_mut() {
                    if is_credential_key_judged(key) && !field.is_null() {
                        *field = Value::String(REDACTED.to_owned());
                    } else if key == "arguments"
                        && let Value::String(text) = field
                        && let Some(redacted) = self.redact_encoded(text)
                    {
                        *text = redacted;
                    } else {
                        self.redact_in_place(field);
                    }
                }
            }
            _ => {}
        }
    }

    /// Tool-call arguments as models write them: JSON inside a string. Parsed, redacted like
    /// any value (credential keys included) and written back; `None` when not a JSON object.
    fn redact_encoded(&self, text: &str) -> Option<String> {
        if !text.trim_start().starts_with('{') {
            return None;
        }
        let mut value: Value = serde_json::from_str(text).ok()?;
        self.redact_in_place(&mut value);
        Some(value.to_string())
    }

    pub fn redact_text(&self, text: &str) -> String {
        self.redact_changed(text).unwrap_or_else(|| text.to_owned())
    }

    /// The redacted text, or `None` when nothing in it is secret.
    fn redact_changed(&self, text: &str) -> Option<String> {
        let mut current: Option<String> = None;
        for secret in &self.values {
            let source = current.as_deref().unwrap_or(text);
            if source.contains(secret.as_str()) {
                current = Some(source.replace(secret.as_str(), REDACTED));
            }
        }
        for pattern in self.patterns {
            let source = current.as_deref().unwrap_or(text);
            if pattern.is_match(source) {
                current = Some(pattern.replace_all(source, REDACTED).into_owned());
            }
        }
        current
    }
}

/// Credential words, matched against the words of a key (`apiKey`, `api_key`, `x-api-key`
/// and `APIKEY` all have the words `api` `key`). Each is one word, or two in a row.
const CREDENTIAL_WORDS: &[(&str, Option<&str>)] = &[
    ("password", None),
    ("passwd", None),
    ("passphrase", None),
    ("secret", None),
    ("token", None),
    ("apikey", None),
    ("api", Some("key")),
    ("authorization", None),
    ("auth", None),
    ("credential", None),
    ("credentials", None),
    ("private", Some("key")),
    ("privatekey", None),
    ("cookie", None),
];

/// Whether an object key names a credential, judged on its words: `access_token`,
/// `clientSecret` and `X-Api-Key` do; `max_tokens`, `total_tokens` and `secretary` do not.
/// Every key of everything stored passes here, so it allocates nothing.
pub fn is_credential_key(key: &str) -> bool {
    let mut previous: Option<&str> = None;
    for word in Words::new(key) {
        let found = CREDENTIAL_WORDS.iter().any(|(first, second)| match second {
            None => word.eq_ignore_ascii_case(first),
            Some(second) => {
                word.eq_ignore_ascii_case(second)
                    && previous.is_some_and(|p| p.eq_ignore_ascii_case(first))
            }
        });
        if found {
            return true;
        }
        previous = Some(word);
    }
    false
}

/// Most keys remembered per thread by [`is_credential_key_judged`]; past it, keys are judged
/// each time (a client's own keys cannot grow the memory without bound).
const MAX_JUDGED_KEYS: usize = 1_024;

/// [`is_credential_key`], remembered per key on this thread. The same few dozen keys pass in
/// every write (`role`, `content`, `usage`, ...), and judging one word by word cost more
/// than looking it up (docs/profiling.md, the thirteenth pass). Hashed with foldhash, seeded
/// per process; the table is bounded, so keys chosen to collide cost at most a scan of it.
fn is_credential_key_judged(key: &str) -> bool {
    type Judged = std::collections::HashMap<Box<str>, bool, foldhash::fast::RandomState>;
    thread_local! {
        static JUDGED: std::cell::RefCell<Judged> = std::cell::RefCell::new(Judged::default());
    }
    JUDGED.with(|judged| {
        let Ok(mut judged) = judged.try_borrow_mut() else {
            return is_credential_key(key);
        };
        if let Some(&credential) = judged.get(key) {
            return credential;
        }
        let credential = is_credential_key(key);
        if judged.len() < MAX_JUDGED_KEYS {
            judged.insert(key.into(), credential);
        }
        credential
    })
}

/// The words of an identifier, as slices of it: runs of ASCII letters and digits, split on
/// anything else and on lower-to-upper case changes (compared without regard to case).
struct Words<'a> {
    key: &'a str,
    at: usize,
}

impl<'a> Words<'a> {
    fn new(key: &'a str) -> Self {
        Self { key, at: 0 }
    }
}

impl<'a> Iterator for Words<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let bytes = self.key.as_bytes();
        while self.at < bytes.len() && !bytes[self.at].is_ascii_alphanumeric() {
            self.at += 1;
        }
        let start = self.at;
        let mut previous_lower = false;
        while let Some(&byte) = bytes.get(self.at) {
            if !byte.is_ascii_alphanumeric() || (byte.is_ascii_uppercase() && previous_lower) {
                break;
            }
            previous_lower = byte.is_ascii_lowercase() || byte.is_ascii_digit();
            self.at += 1;
        }
        // ASCII bytes only: the slice ends on character boundaries.
        (self.at > start).then(|| &self.key[start..self.at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn redacts_secret_values_patterns_and_credential_keys() {
        let redactor = Redactor::new(
            vec!["STABLE_HARNESS_REDACT_UNIT_TEST".to_owned()],
            vec![regex::Regex::new(r"ssn-\d{3}").unwrap()],
        );
        assert_eq!(
            redactor.redact_text("use sk-live-123456"),
            "use sk-live-123456"
        );
        let mut secrets = redactor.secrets();
        secrets.values.push("sk-live-123456".to_owned());
        let mut value = json!({
            "query": "use sk-live-123456 please, ssn-123",
            "api_key": "anything",
            "nested": [{ "Authorization": "Bearer x" }, "plain"],
            "count": 3,
            "max_tokens": 10,
            "usage": { "total_tokens": 12, "prompt_tokens": 3 },
            "accessToken": "t",
            "X-Api-Key": "k",
            "secretary": "Ann",
        });
        secrets.redact_in_place(&mut value);
        assert_eq!(
            value,
            json!({
                "query": "use [redacted] please, [redacted]",
                "api_key": "[redacted]",
                "nested": [{ "Authorization": "[redacted]" }, "plain"],
                "count": 3,
                "max_tokens": 10,
                "usage": { "total_tokens": 12, "prompt_tokens": 3 },
                "accessToken": "[redacted]",
                "X-Api-Key": "[redacted]",
                "secretary": "Ann",
            })
        );
    }

    /// The remembered judgement is the judgement, before and after the memory is full.
    #[test]
    fn a_remembered_judgement_is_the_judgement_of_the_words() {
        let keys: Vec<String> = (0..MAX_JUDGED_KEYS * 2)
            .map(|i| match i % 4 {
                0 => format!("token_{i}"),
                1 => format!("max_tokens_{i}"),
                2 => format!("x{i}ApiKey"),
                _ => format!("secretary{i}"),
            })
            .collect();
        for pass in 0..2 {
            for key in &keys {
                assert_eq!(
                    is_credential_key_judged(key),
                    is_credential_key(key),
                    "{key} (pass {pass})"
                );
            }
        }
        assert!(is_credential_key_judged("token_0") && !is_credential_key_judged("max_tokens_1"));
    }

    #[test]
    fn credential_keys_are_judged_on_words() {
        for key in [
            "password",
            "clientSecret",
            "api-key",
            "APIKEY",
            "refresh_token",
            "auth",
            "X-Api-Key",
            "privateKey",
            "sessionCookie",
            "APIKey",
        ] {
            assert!(is_credential_key(key), "{key}");
        }
        for key in [
            "max_tokens",
            "total_tokens",
            "tokens",
            "author",
            "keyboard",
            "secretary",
            "apiVersion",
            "key_api",
            "tökens",
            "",
        ] {
            assert!(!is_credential_key(key), "{key}");
        }
    }
}
