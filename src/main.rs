//! The `stable-harness` binary: parse the command line, run it, exit with its code.

/// mimalloc, not glibc's allocator: measured, it took 4-15% less CPU per request at
/// concurrency 32 and served 10-19% more requests per second (docs/profiling.md).
#[global_allocator]
static ALLOCATOR: stable_harness::allocator::Allocator = stable_harness::allocator::Allocator;

fn main() -> std::process::ExitCode {
    stable_harness::cli::main()
}
