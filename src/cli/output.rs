//! The CLI's only way to write to the terminal: results on stdout, problems on stderr.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Write;

/// Writes `text` and a newline to stdout (a closed pipe is not an error worth a panic).
pub fn print(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{text}");
}

/// Writes `text` and a newline to stderr.
pub fn error(text: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "{text}");
}
