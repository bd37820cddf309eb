//! Rebuilds the crate when a store migration changes: `sqlx::migrate!` embeds the files of
//! `migrations/` at compile time, and cargo does not know it reads them. Lays out a release
//! binary's functions by `deploy/symbol-order.txt` where the linker is LLD, its code starting
//! on a 2 MiB boundary (`src/hot_text.rs` moves the first of it onto huge pages).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-changed=deploy/symbol-order.txt");
    if lld_links_a_release() {
        let order = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/symbol-order.txt");
        if std::path::Path::new(order).is_file() {
            // The functions a server runs first and most, laid out together: a started server
            // maps fewer of the binary's pages (docs/profiling.md, the seventieth pass). Names
            // the binary does not define (a file older than the code) are skipped quietly.
            println!("cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={order}");
            println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
        }
        // The code, hottest first, starts on a 2 MiB boundary in the file and in memory, so
        // that a server can move its first MiBs onto huge pages (`src/hot_text.rs`).
        println!("cargo:rustc-link-arg-bins=-Wl,-z,separate-code");
        println!("cargo:rustc-link-arg-bins=-Wl,-z,max-page-size=0x200000");
    }
}

/// Whether this is a release build for x86-64 Linux by rustc 1.90 or later without a linker of
/// its own choosing: rustc then links with its own LLD, which reads an ordering file (GNU ld
/// refuses the option).
fn lld_links_a_release() -> bool {
    // Where a builder names a linker of their own.
    const LINKER_VARIABLES: [&str; 2] = [
        "RUSTC_LINKER",
        "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER",
    ];
    for variable in LINKER_VARIABLES {
        println!("cargo:rerun-if-env-changed={variable}");
    }
    let env = |name: &str| std::env::var(name).unwrap_or_default();
    let flags = env("CARGO_ENCODED_RUSTFLAGS");
    env("PROFILE") == "release"
        && env("TARGET") == "x86_64-unknown-linux-gnu"
        && LINKER_VARIABLES
            .iter()
            .all(|variable| env(variable).is_empty())
        && !["linker", "fuse-ld", "link-self-contained"]
            .iter()
            .any(|flag| flags.contains(flag))
        && rustc_minor().is_some_and(|minor| minor >= 90)
}

/// The minor version of the rustc cargo builds with (`rustc 1.95.0 (...)` -> 95).
fn rustc_minor() -> Option<u32> {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let output = Command::new(rustc).arg("--version").output().ok()?;
    let version = String::from_utf8(output.stdout).ok()?;
    version
        .split_whitespace()
        .nth(1)?
        .split('.')
        .nth(1)?
        .parse()
        .ok()
}
