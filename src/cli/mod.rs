//! The command line (SPEC section 2): argument parsing, logging set-up and one file per
//! subcommand. Exit codes: 0 success, 1 a failed run, 2 bad usage or an invalid workspace,
//! 3 a cancelled run or a denied approval.

mod init;
mod operator;
mod output;
mod run;
mod schema;
mod start;
mod store;
mod validate;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::redact::Secret;

/// Exit codes shared by every subcommand.
pub mod exit {
    pub const OK: u8 = 0;
    pub const FAILED: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const CANCELLED: u8 = 3;
    /// The operator commands could not reach the server (or it is not stable-harness).
    pub const UNREACHABLE: u8 = 4;
}

#[derive(Debug, Parser)]
#[command(
    name = "stable-harness",
    version,
    about = "Turns a folder of YAML into a governed, durable agent service."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the workspace over HTTP (/v1, /runtime, /admin).
    Start(StartArgs),
    /// Execute one request in-process and print its progress and output.
    Run(RunArgs),
    /// Check a workspace and print its inventory, or every problem found.
    Validate(ValidateArgs),
    /// Write a working starter workspace into DIR.
    Init(InitArgs),
    /// Print the OpenAPI document of the HTTP surfaces (JSON).
    Openapi,
    /// Print the JSON Schema of workspace documents, for editors.
    Schema,
    /// Apply the store migrations to a database.
    Migrate(MigrateArgs),
    /// Look after the store: prune by the retention policy, or copy an online backup.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Operate a running server: list, show, approve or deny approvals.
    #[command(subcommand)]
    Approvals(operator::ApprovalsCommand),
    /// Operate a running server: list, show, cancel, retry requests; read or follow events.
    #[command(subcommand)]
    Requests(operator::RequestsCommand),
    /// Ask a running server what its budgets were charged, by key, agent, model or day.
    Usage(operator::UsageArgs),
}

#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Remove what the workspace's retention lets go (`--dry-run` only reports it).
    Prune(PruneArgs),
    /// Copy a consistent snapshot of the store to a new file (works beside a running server).
    Backup(BackupArgs),
}

#[derive(Debug, clap::Args)]
pub struct PruneArgs {
    /// Workspace folder (its `store.retention` and agents' windows are the policy).
    #[arg(short = 'w', long = "workspace", default_value = ".")]
    pub workspace: PathBuf,
    #[arg(long, env = "STABLE_HARNESS_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Only report what would be removed.
    #[arg(long, conflicts_with = "now", required_unless_present = "now")]
    pub dry_run: bool,
    /// Remove it now.
    #[arg(long)]
    pub now: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct BackupArgs {
    /// Workspace folder (for its store).
    #[arg(short = 'w', long = "workspace", default_value = ".")]
    pub workspace: PathBuf,
    #[arg(long, env = "STABLE_HARNESS_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// The new file to write (never overwritten); it opens as a store.
    #[arg(long)]
    pub to: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct StartArgs {
    /// Workspace folder.
    #[arg(short = 'w', long = "workspace", default_value = ".")]
    pub workspace: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8642)]
    pub port: u16,
    /// Store URL (sqlite://PATH or postgres://...); default: DIR/.stable-harness/state.db.
    #[arg(long, env = "STABLE_HARNESS_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Client key accepted on /v1 and /runtime (repeatable; adds to the workspace's keys).
    #[arg(
        long = "api-key",
        env = "STABLE_HARNESS_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<Secret>,
    /// Operator key accepted on /admin (repeatable; adds to the workspace's keys).
    #[arg(
        long = "admin-key",
        env = "STABLE_HARNESS_ADMIN_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub admin_keys: Vec<Secret>,
    /// Serve /metrics without an admin key (for a scraper inside a trusted network).
    #[arg(long)]
    pub metrics_public: bool,
    /// Reload the workspace when its files change (debounced); an invalid or restart-only
    /// change is logged and the running inventory keeps serving.
    #[arg(long)]
    pub watch: bool,
    /// Serve a surface that has no keys (no client keys: /v1, /runtime and so tool execution;
    /// no admin keys: /admin) on a non-loopback --host anyway. Without it that is refused.
    #[arg(long)]
    pub insecure_open_surfaces: bool,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Workspace folder.
    #[arg(short = 'w', long = "workspace", default_value = ".")]
    pub workspace: PathBuf,
    /// Agent to run (default: the workspace's defaultAgent).
    #[arg(long)]
    pub agent: Option<String>,
    /// Session to continue.
    #[arg(long)]
    pub session: Option<String>,
    /// Print every event as a JSON line instead of narration.
    #[arg(long)]
    pub json: bool,
    /// Approve every tool call that needs approval.
    #[arg(long)]
    pub approve_all: bool,
    #[arg(long, env = "STABLE_HARNESS_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// The user message.
    pub message: String,
}

#[derive(Debug, clap::Args)]
pub struct ValidateArgs {
    /// Workspace folder.
    #[arg(short = 'w', long = "workspace", default_value = ".")]
    pub workspace: PathBuf,
    /// Print JSON: the diagnostics as an array, or the inventory when the workspace is valid.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct InitArgs {
    /// Folder to create the workspace in.
    pub dir: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    #[arg(long, env = "STABLE_HARNESS_DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            let code = if error.use_stderr() {
                exit::USAGE
            } else {
                exit::OK
            };
            let _ = error.print();
            return ExitCode::from(code);
        }
    };
    // `start` logs what it serves; the other commands only speak up about trouble.
    init_logging(if matches!(cli.command, Command::Start(_)) {
        "info"
    } else {
        "error"
    });
    ExitCode::from(run(cli.command))
}

/// Runs one subcommand and returns its exit code.
pub fn run(command: Command) -> u8 {
    match command {
        Command::Validate(args) => validate::run(&args),
        Command::Init(args) => init::run(&args),
        Command::Schema => schema::run(),
        Command::Openapi => {
            output::print(&crate::http::openapi::document());
            exit::OK
        }
        Command::Start(args) => match hot_code_onto_huge_pages() {
            Ok(()) => block_on(start::run(args)),
            Err(usage) => {
                output::error(usage);
                exit::USAGE
            }
        },
        Command::Run(args) => block_on(run::run(args)),
        Command::Migrate(args) => block_on(migrate(args)),
        Command::Store(StoreCommand::Prune(args)) => block_on(store::prune(args)),
        Command::Store(StoreCommand::Backup(args)) => block_on(store::backup(args)),
        Command::Approvals(command) => block_on(operator::approvals(command)),
        Command::Requests(command) => block_on(operator::requests(command)),
        Command::Usage(args) => block_on(operator::usage(args)),
    }
}

/// Moves the server's hottest code onto huge pages; called before any thread starts.
/// `STABLE_HARNESS_HUGE_TEXT=off` skips it, for profilers, which cannot name code in
/// anonymous memory; a value other than `on` or `off` is a usage error.
fn hot_code_onto_huge_pages() -> Result<(), &'static str> {
    match std::env::var("STABLE_HARNESS_HUGE_TEXT").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("on") => {}
        Ok("off") => return Ok(()),
        _ => return Err("STABLE_HARNESS_HUGE_TEXT must be `on` or `off`"),
    }
    match crate::hot_text::move_onto_huge_pages() {
        Ok(bytes) => tracing::debug!(bytes, "the hottest code moved onto huge pages"),
        Err(reason) => tracing::debug!(%reason, "the code stays on small pages"),
    }
    Ok(())
}

/// Runs an async subcommand on a multi-threaded runtime.
fn block_on(future: impl std::future::Future<Output = u8>) -> u8 {
    crate::app::install_crypto_provider();
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(future),
        Err(error) => {
            output::error(&format!("cannot start the async runtime: {error}"));
            exit::FAILED
        }
    }
}

/// `migrate`: creates or upgrades the store at `--database-url`.
async fn migrate(args: MigrateArgs) -> u8 {
    let options = crate::store::OpenOptions::default();
    match crate::store::open(
        Some(&args.database_url),
        std::path::Path::new("."),
        &options,
    )
    .await
    {
        Ok(store) => {
            output::print(&format!("migrated: {}", store.describe()));
            exit::OK
        }
        Err(error) => {
            output::error(&format!("stable-harness migrate: {error}"));
            exit::FAILED
        }
    }
}

/// Logs go to stderr; `STABLE_HARNESS_LOG` is the filter, `STABLE_HARNESS_LOG_FORMAT` json|pretty.
fn init_logging(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("STABLE_HARNESS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let json =
        std::env::var("STABLE_HARNESS_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Cli, Command};

    #[test]
    fn keys_given_on_the_command_line_never_show_in_debug_output() {
        let cli = Cli::try_parse_from([
            "stable-harness",
            "start",
            "--api-key",
            "client-secret-123",
            "--admin-key",
            "admin-secret-456,admin-secret-789",
        ])
        .unwrap();
        let Command::Start(args) = &cli.command else {
            panic!("not a start command");
        };
        assert_eq!(args.admin_keys.len(), 2);
        assert_eq!(args.api_keys[0].expose(), "client-secret-123");
        let printed = format!("{cli:?}");
        assert!(!printed.contains("secret-"), "{printed}");
        assert!(printed.contains("[redacted]"), "{printed}");
    }
}
