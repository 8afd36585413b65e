//! The one error type of the core library. Every message names the file and,
//! where there is one, the tensor, so a broken model folder is diagnosed from a
//! single line.

use std::path::PathBuf;

/// Errors raised while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file the model folder must contain is missing.
    #[error("{path}: missing from the model folder ({what})")]
    MissingFile { path: PathBuf, what: &'static str },
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file that does not parse or lacks a field.
    #[error("{path}: invalid JSON: {message}")]
    Json { path: PathBuf, message: String },
    /// A config value that is present but unusable.
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    /// The architecture named in config.json is not one we implement.
    #[error("{path}: unsupported model_type '{model_type}' (supported: {supported})")]
    UnsupportedArchitecture {
        path: PathBuf,
        model_type: String,
        supported: String,
    },
    /// A safetensors file that is truncated or otherwise unreadable.
    #[error("{path}: corrupt safetensors file: {message}")]
    CorruptWeights { path: PathBuf, message: String },
    /// A tensor the architecture needs is not in any weight file.
    #[error("{dir}: tensor '{tensor}' not found in any weight file")]
    MissingTensor { dir: PathBuf, tensor: String },
    /// A tensor whose shape differs from what config.json implies.
    #[error("{path}: tensor '{tensor}' has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A tensor stored in a dtype we cannot compute with.
    #[error("{path}: tensor '{tensor}' has unsupported dtype {dtype} (supported: F32, BF16, F16)")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// Tokenizer or chat-template failures.
    #[error("{path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    /// Bad request-level input (empty prompt, token id out of range, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// Failures of the expert dispatch path (remote workers, missing experts).
    #[error("expert dispatch failed: {0}")]
    Dispatch(String),
    /// Failures of remote attention (attention-workers of a tensor-parallel cluster).
    #[error("remote attention failed: {0}")]
    Attention(String),
    /// A bug: an invariant broke or code panicked (e.g. in the forward pass).
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result alias for the core library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Config {
            path: path.into(),
            message: message.into(),
        }
    }
}
