//! Threads that run a single-threaded tokio runtime of their own (the store's writer, the
//! HTTP shards), and the one way the crate locks what threads share.

use std::thread::JoinHandle;

/// Locks `mutex`, whatever a holder that panicked left: nothing in the crate panics while
/// holding a lock, so what a poisoned one guards is still whole.
pub fn locked<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts thread `name` with a single-threaded runtime made by `make` on the thread itself
/// (a runtime must never be dropped inside another one's context), then runs `body` with it
/// there. Returns once the runtime exists, with a handle to it.
pub fn spawn_with_runtime(
    name: &str,
    make: fn() -> std::io::Result<tokio::runtime::Runtime>,
    body: impl FnOnce(tokio::runtime::Runtime) + Send + 'static,
) -> std::io::Result<(JoinHandle<()>, tokio::runtime::Handle)> {
    let (started_tx, started) = std::sync::mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let runtime = match make() {
                Ok(runtime) => runtime,
                Err(error) => {
                    let _ = started_tx.send(Err(error));
                    return;
                }
            };
            let _ = started_tx.send(Ok(runtime.handle().clone()));
            body(runtime);
        })?;
    let handle = started
        .recv()
        .map_err(|_| std::io::Error::other(format!("thread `{name}` ended before it started")))??;
    Ok((thread, handle))
}
