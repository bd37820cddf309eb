//! The `WHERE` conditions of a listing, spelled from the filters a caller gave.
//!
//! One fixed statement could serve every combination of optional filters with
//! `(?n IS NULL OR column = ?n)`, but a database plans such a statement for any value: SQLite
//! plans it once and never reads an index for those filters, and PostgreSQL's generic plan
//! does the same. So each filter is spelled as asked: its test (`column = ?n`) when given, and
//! `?n IS NULL` when not. The parameter is named either way, so every listing binds the same
//! values in the same order, and a listing has one statement per combination of filters given
//! (a handful, each prepared once per connection).

use std::fmt;

/// Conditions joined by `AND`; shown as SQL with `Display`.
#[derive(Debug, Default)]
pub(crate) struct Conditions {
    sql: String,
}

impl Conditions {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// `test` when the filter was `given`; else `parameter IS NULL`, which holds for the
    /// unset value the caller still binds. Both are fixed text of the store: values are bound.
    pub(crate) fn filter(self, given: bool, test: &str, parameter: &str) -> Self {
        if given {
            self.always(test)
        } else {
            self.always(&format!("{parameter} IS NULL"))
        }
    }

    /// A condition every row must meet.
    pub(crate) fn always(mut self, condition: &str) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_filters_are_tested_and_missing_ones_only_name_their_parameter() {
        let sql = Conditions::new()
            .filter(true, "owner = ?1", "?1")
            .filter(false, "agent_id = ?2", "?2")
            .always("id < COALESCE(?3, '~')")
            .to_string();
        assert_eq!(
            sql,
            "(owner = ?1) AND (?2 IS NULL) AND (id < COALESCE(?3, '~'))"
        );
        assert_eq!(Conditions::new().to_string(), "TRUE");
    }
}
