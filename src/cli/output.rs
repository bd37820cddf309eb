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

/// Asks a yes/no question on the terminal (stderr), reading the answer from stdin.
pub fn confirm(question: &str) -> bool {
    {
        let mut stderr = std::io::stderr().lock();
        let _ = write!(stderr, "{question} [y/N] ");
        let _ = stderr.flush();
    }
    let mut answer = String::new();
    if std::io::stdin().read_line(&mut answer).is_err() {
        return false;
    }
    matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes")
}
