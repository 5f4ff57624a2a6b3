//! The process's compute threads and async runtimes, set up once by whichever command runs.

use anyhow::{Context, Result};

/// Candle reads its thread count from the environment when its pool first starts, so this runs
/// before any runtime or compute thread exists.
pub(crate) fn set_compute_threads(n: usize) {
    std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
}

/// The multi-threaded runtime a daemon, or a benchmark of one, runs on.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// A single-threaded runtime for talking to a node's control API.
pub(crate) fn client_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}
