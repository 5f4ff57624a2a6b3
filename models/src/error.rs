//! The one error type of the models crate.

use std::path::PathBuf;

/// Why a model, data or optimizer operation failed. Every variant names its cause in one line,
/// because these messages reach the user unchanged through the CLI.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Candle refused a tensor operation (shape mismatch, device problem, ...).
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// A data file could not be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// A data file was readable but its content is not what its format promises.
    #[error("{}: {msg}", path.display())]
    Format {
        /// The offending file.
        path: PathBuf,
        /// What is wrong, with a line or offset where one is known.
        msg: String,
    },
    /// Tensors do not fit the model's parameter layout (names, shapes or sizes differ).
    #[error("layout mismatch: {0}")]
    Layout(String),
    /// A value that must be finite is NaN or infinite.
    #[error("non-finite value: {0}")]
    NonFinite(String),
    /// A model or optimizer specification cannot work (for example widths that do not fit).
    #[error("invalid specification: {0}")]
    Spec(String),
}

/// Shorthand for results whose error is [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
