//! The `WHERE` conditions of a listing, spelled from the filters a caller gave, in either
//! store's SQL.
//!
//! One fixed statement could serve every combination of optional filters with
//! `(?n IS NULL OR column = ?n)`, but a database plans such a statement for any value: SQLite
//! plans it once and never reads an index for those filters, and PostgreSQL's generic plan
//! does the same. So each filter is spelled as asked: its test (`column = ?n`) when given, and
//! `?n IS NULL` when not. The parameter is named either way, so every listing binds the same
//! values in the same order, and a listing has one statement per combination of filters given
//! (a handful, each prepared once per connection). Which filters a listing has, and their
//! parameters' numbers, are written once here for both stores.

use std::fmt;

use super::spend::UsageFilter;
use super::{MemoryFilter, RequestFilter, SessionFilter};

/// Whose SQL to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    Sqlite,
    Postgres,
}

impl Dialect {
    /// Bound parameter `n`: `?n`, or `$n::pg_type` (PostgreSQL infers no type for a parameter
    /// that is only tested for NULL).
    pub(crate) fn param(self, n: u8, pg_type: &str) -> String {
        match self {
            Dialect::Sqlite => format!("?{n}"),
            Dialect::Postgres => format!("${n}::{pg_type}"),
        }
    }
}

/// Conditions joined by `AND`; shown as SQL with `Display`.
#[derive(Debug)]
pub(crate) struct Conditions {
    dialect: Dialect,
    sql: String,
}

impl Conditions {
    pub(crate) fn new(dialect: Dialect) -> Self {
        Self {
            dialect,
            sql: String::new(),
        }
    }

    /// `column op` parameter `n` when the filter was `given`; else the parameter `IS NULL`.
    pub(crate) fn compare(self, given: bool, column: &str, op: &str, n: u8, pg_type: &str) -> Self {
        let param = self.dialect.param(n, pg_type);
        self.filter(given, &format!("{column} {op} {param}"), n, pg_type)
    }

    /// `test` (written in this dialect, naming parameter `n`) when the filter was `given`;
    /// else parameter `n IS NULL`, which holds for the unset value the caller still binds.
    /// Both are fixed text of the store: values are bound.
    pub(crate) fn filter(self, given: bool, test: &str, n: u8, pg_type: &str) -> Self {
        if given {
            self.always(test)
        } else {
            let param = self.dialect.param(n, pg_type);
            self.always(&format!("{param} IS NULL"))
        }
    }

    /// Rows before a page's cursor, parameter `n` (ids this store makes sort below `~`).
    pub(crate) fn before_cursor(self, n: u8) -> Self {
        let param = self.dialect.param(n, "text");
        self.always(&format!("id < COALESCE({param}, '~')"))
    }

    /// A condition every row must meet.
    fn always(mut self, condition: &str) -> Self {
        if !self.sql.is_empty() {
            self.sql.push_str(" AND ");
        }
        self.sql.push('(');
        self.sql.push_str(condition);
        self.sql.push(')');
        self
    }
}

impl fmt::Display for Conditions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.sql.is_empty() {
            f.write_str("TRUE")
        } else {
            f.write_str(&self.sql)
        }
    }
}

/// A page of requests: `$1` status, `$2` agent, `$3` session, `$4` cursor, `$6` owner, `$7`
/// created from, `$8` created before (`$5` is the page's limit).
pub(crate) fn of_requests(filter: &RequestFilter, dialect: Dialect) -> Conditions {
    Conditions::new(dialect)
        .compare(filter.status.is_some(), "status", "=", 1, "text")
        .compare(filter.agent_id.is_some(), "agent_id", "=", 2, "text")
        .compare(filter.session_id.is_some(), "session_id", "=", 3, "text")
        .before_cursor(4)
        .compare(filter.owner.is_some(), "owner", "=", 6, "text")
        .compare(
            filter.created_from.is_some(),
            "created_at",
            ">=",
            7,
            "timestamptz",
        )
        .compare(
            filter.created_before.is_some(),
            "created_at",
            "<",
            8,
            "timestamptz",
        )
}

/// A page of sessions: `$1` agent, `$2` owner, `$3` cursor (`$4` the limit). Clients choose
/// session ids, so no stand-in value (`COALESCE(cursor, '~')`) bounds them.
pub(crate) fn of_sessions(filter: &SessionFilter, cursor: bool, dialect: Dialect) -> Conditions {
    Conditions::new(dialect)
        .compare(filter.agent_id.is_some(), "agent_id", "=", 1, "text")
        .compare(filter.owner.is_some(), "owner", "=", 2, "text")
        .compare(cursor, "id", "<", 3, "text")
}

/// A page of approvals: `$1` status, `$2` cursor (`$3` the limit).
pub(crate) fn of_approvals(status: bool, dialect: Dialect) -> Conditions {
    Conditions::new(dialect)
        .compare(status, "status", "=", 1, "text")
        .before_cursor(2)
}

/// A page of memories: `$1` namespace, `$2` status, `$3` owner, `$4` cursor, `$5` words, found
/// by `words_test`, the store's full-text search (`$6` the limit).
pub(crate) fn of_memories(filter: &MemoryFilter, words_test: &str, dialect: Dialect) -> Conditions {
    Conditions::new(dialect)
        .compare(filter.namespace.is_some(), "namespace", "=", 1, "text")
        .compare(filter.status.is_some(), "status", "=", 2, "text")
        .compare(filter.owner.is_some(), "owner", "=", 3, "text")
        .before_cursor(4)
        .filter(!filter.words.is_empty(), words_test, 5, "text")
}

/// Usage records: `$1` owner, `$2` agent, `$3` session, `$4` model, `$5` from, `$6` to, `$7`
/// request.
pub(crate) fn of_usage(filter: &UsageFilter, dialect: Dialect) -> Conditions {
    Conditions::new(dialect)
        .compare(filter.owner.is_some(), "owner", "=", 1, "text")
        .compare(filter.agent_id.is_some(), "agent_id", "=", 2, "text")
        .compare(filter.session_id.is_some(), "session_id", "=", 3, "text")
        .compare(filter.model.is_some(), "model", "=", 4, "text")
        .compare(filter.from.is_some(), "at", ">=", 5, "timestamptz")
        .compare(filter.to.is_some(), "at", "<", 6, "timestamptz")
        .compare(filter.request_id.is_some(), "request_id", "=", 7, "text")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_filters_are_tested_and_missing_ones_only_name_their_parameter() {
        let filter = RequestFilter {
            owner: Some("alice".to_owned()),
            ..RequestFilter::default()
        };
        assert_eq!(
            of_requests(&filter, Dialect::Sqlite).to_string(),
            "(?1 IS NULL) AND (?2 IS NULL) AND (?3 IS NULL) AND (id < COALESCE(?4, '~')) \
             AND (owner = ?6) AND (?7 IS NULL) AND (?8 IS NULL)"
        );
        assert_eq!(
            of_approvals(true, Dialect::Postgres).to_string(),
            "(status = $1::text) AND (id < COALESCE($2::text, '~'))"
        );
        assert_eq!(Conditions::new(Dialect::Sqlite).to_string(), "TRUE");
    }
}
