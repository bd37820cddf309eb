//! The `Store` interface and its implementations: embedded SQLite and PostgreSQL, with
//! migrations under `migrations/sqlite` and `migrations/postgres` (SPEC section 8).
//!
//! Empty until the runtime lifecycle issue.
