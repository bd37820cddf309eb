//! A throwaway PostgreSQL for the suite: `STABLE_HARNESS_TEST_DATABASE_URL` when set (a server
//! whose user may create databases), else a cluster made with `initdb` and started with
//! `pg_ctl` as user `postgres` (when run as root) in a temp folder on a free port. It is
//! started once per test binary; a watchdog stops it and removes its folder when the binary
//! exits. Each test gets a database of its own. A machine without PostgreSQL fails these
//! tests: they never skip (`.ci/run` installs it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The server every PostgreSQL test of this binary uses: a base URL without a database.
struct Server {
    /// `postgres://USER@HOST:PORT` (or the given URL's server part).
    base: String,
    /// The maintenance database to create test databases from.
    admin_url: String,
}

static SERVER: OnceLock<Server> = OnceLock::new();
static NEXT_DATABASE: AtomicUsize = AtomicUsize::new(0);

/// A new, empty database on the test server; its URL.
pub fn fresh_database() -> String {
    let server = SERVER.get_or_init(start);
    let name = format!(
        "sh_test_{}_{}",
        std::process::id(),
        NEXT_DATABASE.fetch_add(1, Ordering::Relaxed)
    );
    psql(&server.admin_url, &format!("CREATE DATABASE {name}"));
    format!("{}/{name}", server.base)
}

/// Runs `sql` on the database at `url` with psql; its output.
pub fn psql(url: &str, sql: &str) -> String {
    let output = Command::new(tool("psql"))
        .args([url, "-q", "-t", "-A", "-c", sql])
        .output()
        .unwrap_or_else(|e| panic!("psql: {e}"));
    assert!(
        output.status.success(),
        "psql {sql}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn start() -> Server {
    if let Ok(url) = std::env::var("STABLE_HARNESS_TEST_DATABASE_URL") {
        let url = url.trim_end_matches('/').to_owned();
        let base = match url.rfind('/') {
            Some(slash) if slash > "postgres://".len() => url[..slash].to_owned(),
            _ => url.clone(),
        };
        return Server {
            admin_url: url,
            base,
        };
    }
    // Under /tmp, whatever TMPDIR says: the `postgres` user must reach it, and the socket
    // path must stay short.
    let dir = tempfile::Builder::new()
        .prefix("sh-pg-")
        .tempdir_in("/tmp")
        .unwrap()
        .keep();
    let data = dir.join("data");
    let as_root = is_root();
    if as_root {
        run(Command::new("chown").args(["-R", "postgres:postgres", dir.to_str().unwrap()]));
    }
    run(as_postgres(as_root, &tool("initdb")).args([
        "-D",
        data.to_str().unwrap(),
        "-A",
        "trust",
        "-U",
        "postgres",
        "-E",
        "UTF8",
        "--locale=C",
        "--no-sync",
    ]));
    let port = free_port();
    let options = format!(
        "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=400",
        dir.display()
    );
    run(as_postgres(as_root, &tool("pg_ctl")).args([
        "-D",
        data.to_str().unwrap(),
        "-o",
        &options,
        "-l",
        dir.join("log").to_str().unwrap(),
        "-w",
        "start",
    ]));
    watch(&data, &dir, as_root);
    let base = format!("postgres://postgres@127.0.0.1:{port}");
    Server {
        admin_url: format!("{base}/postgres"),
        base,
    }
}

/// Stops the cluster and removes its folder once this test binary has exited.
// The watchdog outlives this process on purpose: nobody is left to wait for it.
#[allow(clippy::zombie_processes)]
fn watch(data: &Path, dir: &Path, as_root: bool) {
    let stop = format!(
        "{}'{}' -D '{}' -m immediate stop",
        if as_root {
            "runuser -u postgres -- "
        } else {
            ""
        },
        tool("pg_ctl").display(),
        data.display()
    );
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {stop} >/dev/null 2>&1; rm -rf '{dir}'",
        pid = std::process::id(),
        dir = dir.display()
    );
    // Its own session, so an interrupt of the test run does not take the watchdog with it.
    Command::new("setsid")
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
}

fn as_postgres(as_root: bool, program: &Path) -> Command {
    if as_root {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn run(command: &mut Command) {
    let output = command.output().unwrap_or_else(|e| {
        panic!("{command:?}: {e} (is PostgreSQL installed? .ci/run installs it)")
    });
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A PostgreSQL program: on the PATH, or in Debian's versioned folder.
fn tool(name: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
    if let Some(found) = on_path {
        return found;
    }
    // The newest installed version that has the program (versions compare as numbers).
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|entry| {
                    let entry = entry.ok()?;
                    let version = entry
                        .file_name()
                        .to_str()?
                        .split('.')
                        .next()?
                        .parse()
                        .ok()?;
                    let program = entry.path().join("bin").join(name);
                    program.is_file().then_some((version, program))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
        .pop()
        .map_or_else(|| PathBuf::from(name), |(_, program)| program)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
