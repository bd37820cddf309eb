//! `command` tools: a program under the workspace, never through a shell. The arguments go to
//! stdin as JSON and the output is JSON on stdout. The environment is scrubbed (only `PATH`
//! and the declared variables pass), the workspace is the working directory, output is bounded,
//! and the process runs as the leader of its own process group, so that a timeout (the future
//! being dropped) or an oversized output kills everything it started.

use std::path::Path;
use std::process::Stdio;

use process_wrap::tokio::{ChildWrapper, CommandWrap, KillOnDrop, ProcessGroup};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use super::{ToolError, excerpt};
use crate::workspace::CommandConfig;

/// How much of stderr is kept for an error message.
const MAX_STDERR_BYTES: u64 = 16 << 10;

/// Kills the whole process group unless the child was reaped.
struct GroupGuard {
    child: Box<dyn ChildWrapper>,
    reaped: bool,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = self.child.start_kill();
        }
    }
}

/// The variable holding the call's idempotency key (the same on a re-run after a crash).
pub const IDEMPOTENCY_KEY_VAR: &str = "STABLE_HARNESS_IDEMPOTENCY_KEY";

pub(super) async fn run(
    root: &Path,
    config: &CommandConfig,
    max_output_bytes: u64,
    idempotency_key: &str,
    arguments: &Value,
) -> Result<Value, ToolError> {
    let mut command = super::scrubbed_command(root, config);
    command
        .env(IDEMPOTENCY_KEY_VAR, idempotency_key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut wrapped = CommandWrap::from(command);
    wrapped.wrap(ProcessGroup::leader()).wrap(KillOnDrop);
    let child = wrapped.spawn().map_err(|error| {
        ToolError::new(
            "unavailable",
            format!("cannot start {}: {error}", config.program.display()),
        )
    })?;
    let mut guard = GroupGuard {
        child,
        reaped: false,
    };
    let stdin = guard.child.stdin().take();
    let stdout = guard.child.stdout().take();
    let stderr = guard.child.stderr().take();
    let input = serde_json::to_vec(arguments).unwrap_or_default();
    let write = async move {
        if let Some(mut stdin) = stdin {
            // A tool that does not read its input closes the pipe: that is its business.
            let _ = stdin.write_all(&input).await;
            let _ = stdin.shutdown().await;
        }
    };
    let child = &mut guard.child;
    let read_output = async move {
        let output = read_bounded(stdout, max_output_bytes, Overflow::Fail).await;
        if output.is_none() {
            // Kill now: stderr is drained until the tool is gone.
            let _ = child.start_kill();
        }
        output
    };
    let (_, output, errors) = tokio::join!(
        write,
        read_output,
        read_bounded(stderr, MAX_STDERR_BYTES, Overflow::Truncate)
    );
    let Some(output) = output else {
        // Dropping the guard kills the group.
        return Err(ToolError::new(
            "output_too_large",
            format!("the tool printed more than {max_output_bytes} bytes"),
        ));
    };
    let status = guard
        .child
        .wait()
        .await
        .map_err(|e| ToolError::new("unavailable", format!("waiting for the tool: {e}")))?;
    guard.reaped = true;
    let stderr_text = String::from_utf8_lossy(&errors.unwrap_or_default()).into_owned();
    if !status.success() {
        let code = status
            .code()
            .map(|c| format!("exit code {c}"))
            .unwrap_or_else(|| "a signal".to_owned());
        return Err(ToolError::new(
            "exit_status",
            format!("the tool ended with {code}: {}", excerpt(&stderr_text)),
        ));
    }
    serde_json::from_slice(&output).map_err(|_| {
        ToolError::new(
            "bad_output",
            format!(
                "the tool must print one JSON value on stdout; it printed: {}",
                excerpt(&String::from_utf8_lossy(&output))
            ),
        )
    })
}

/// What to do with output past the limit.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Overflow {
    /// Stop reading and report `None` (the caller kills the tool).
    Fail,
    /// Keep the first bytes and drain the rest, so the tool never blocks on a full pipe.
    Truncate,
}

/// Reads a pipe to its end, keeping at most `limit` bytes.
async fn read_bounded(
    pipe: Option<impl AsyncRead + Unpin>,
    limit: u64,
    overflow: Overflow,
) -> Option<Vec<u8>> {
    let mut buffer = Vec::new();
    let Some(mut pipe) = pipe else {
        return Some(buffer);
    };
    if (&mut pipe)
        .take(limit + 1)
        .read_to_end(&mut buffer)
        .await
        .is_err()
    {
        return Some(buffer);
    }
    if buffer.len() as u64 <= limit {
        return Some(buffer);
    }
    match overflow {
        Overflow::Fail => None,
        Overflow::Truncate => {
            buffer.truncate(limit as usize);
            let _ = tokio::io::copy(&mut pipe, &mut tokio::io::sink()).await;
            Some(buffer)
        }
    }
}
