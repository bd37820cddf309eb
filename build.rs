//! Rebuilds the crate when a store migration changes: `sqlx::migrate!` embeds the files of
//! `migrations/` at compile time, and cargo does not know it reads them.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
