//! `Located<T>`: a value read from YAML together with where it was written.
//!
//! Compile-time checks (dangling references, bad durations, escaping paths) happen after
//! deserialization, so every value they judge must remember its line and column.

use std::fmt;
use std::ops::Deref;

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer};

/// A position inside one YAML document (1-based; 0 when unknown, e.g. after serde buffering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Position {
    pub line: u64,
    pub column: u64,
}

impl Position {
    pub fn is_known(self) -> bool {
        self.line > 0
    }
}

/// A deserialized value and the position of its YAML node.
#[derive(Clone, PartialEq, Eq)]
pub struct Located<T> {
    pub value: T,
    pub position: Position,
}

impl<T> Located<T> {
    pub fn new(value: T, position: Position) -> Self {
        Self { value, position }
    }
}

impl<T> Deref for Located<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T: fmt::Debug> fmt::Debug for Located<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.value.fmt(f)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Located<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let spanned = serde_saphyr::Spanned::<T>::deserialize(deserializer)?;
        Ok(Self {
            value: spanned.value,
            position: Position {
                line: spanned.referenced.line(),
                column: spanned.referenced.column(),
            },
        })
    }
}

impl<T: JsonSchema> JsonSchema for Located<T> {
    fn inline_schema() -> bool {
        T::inline_schema()
    }
    fn schema_name() -> std::borrow::Cow<'static, str> {
        T::schema_name()
    }
    fn schema_id() -> std::borrow::Cow<'static, str> {
        T::schema_id()
    }
    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        T::json_schema(generator)
    }
}
