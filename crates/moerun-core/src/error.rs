//! The one error type of the library crates. The CLI prints it as a single line.

use std::path::PathBuf;

/// Everything that can go wrong loading or running a model, as a value.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid file: {reason}")]
    BadFile { path: PathBuf, reason: String },
    #[error("config.json: {0}")]
    Config(String),
    #[error("unsupported model_type '{found}'; supported: {supported}")]
    UnsupportedArchitecture { found: String, supported: String },
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("missing tensor '{0}' in checkpoint")]
    MissingTensor(String),
    #[error("tensor '{name}': expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("token id {id} is out of range (vocabulary size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("out of KV cache blocks: needed {needed}, free {free}")]
    OutOfKvBlocks { needed: usize, free: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A compute device failed or is unavailable (the backend's own message).
    #[error("{0}")]
    Device(String),
}

impl Error {
    /// Wrap an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
