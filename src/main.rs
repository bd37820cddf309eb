//! The `stable-harness` binary: parse the command line, run it, exit with its code.

fn main() -> std::process::ExitCode {
    stable_harness::cli::main()
}
