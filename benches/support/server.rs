//! Starting the `stable-harness` binary for a benchmark, as users start it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The store arguments the benchmarks share: `STABLE_HARNESS_BENCH_DATABASE_URL=postgres://...`
/// measures the PostgreSQL store instead of the embedded one.
pub fn store_args() -> Vec<String> {
    std::env::var("STABLE_HARNESS_BENCH_DATABASE_URL")
        .map(|url| vec!["--database-url".to_owned(), url])
        .unwrap_or_default()
}

/// The binary measured as "this build": the one `STABLE_HARNESS_BENCH_SERVER` names (a build
/// made another way, such as the profile-guided one of `deploy/pgo-build.sh`), or else the one
/// cargo built beside the benchmark.
pub fn this_build() -> PathBuf {
    std::env::var_os("STABLE_HARNESS_BENCH_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_stable-harness")))
}

/// Starts `binary` on `workspace` on a free port, with `env` added to its environment, and
/// returns it with its base URL.
pub fn start(binary: &Path, workspace: &Path, env: &[(&str, &str)]) -> (Child, String) {
    let mut server = Command::new(binary)
        .args(["start", "-w", workspace.to_str().unwrap(), "--port", "0"])
        .args(store_args())
        .env("STABLE_HARNESS_LOG", "error")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap()
        .to_owned();
    (server, base)
}

/// utime + stime of a process from `/proc/PID/stat`, in seconds (at 100 ticks a second).
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The command name may hold spaces: fields are counted after its closing parenthesis.
    let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // After the name: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// Stops a server as an operator does (SIGTERM) and waits for it.
pub fn stop(mut server: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status();
    let _ = server.wait();
}
