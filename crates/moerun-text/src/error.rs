//! The one error type of this crate: every failure a caller can cause (a missing or malformed
//! file, an unknown template name, a template that raises) comes back as a [`TextError`] value.

use std::path::PathBuf;

/// What went wrong while loading a tokenizer, (de)tokenizing, or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file that must exist does not (e.g. `tokenizer.json`).
    #[error("missing file: {}", path.display())]
    MissingFile { path: PathBuf },

    /// A file exists but could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    /// A JSON file is malformed or has a field of the wrong type.
    #[error("invalid JSON in {}: {message}", path.display())]
    Json { path: PathBuf, message: String },

    /// The `tokenizers` library refused a `tokenizer.json`.
    #[error("cannot load tokenizer {}: {message}", path.display())]
    TokenizerLoad { path: PathBuf, message: String },

    /// Encoding text or decoding ids failed (e.g. an id outside the vocabulary).
    #[error("tokenizer: {0}")]
    Tokenize(String),

    /// The model ships no chat template at all.
    #[error("the tokenizer has no chat template")]
    NoChatTemplate,

    /// A named template was asked for (or no default exists among several named ones).
    #[error("no chat template named {name:?} (available: {available:?})")]
    UnknownTemplate {
        name: String,
        available: Vec<String>,
    },

    /// The template source does not parse.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),

    /// The template called `raise_exception(message)`, e.g. roles that do not alternate.
    #[error("chat template refused the conversation: {0}")]
    TemplateRaised(String),

    /// Rendering failed for another reason (undefined variable used as a string, bad filter
    /// arguments, ...).
    #[error("chat template failed to render: {0}")]
    TemplateRender(String),

    /// A message, tool or template argument is not a JSON value a template can read.
    #[error("invalid template input: {0}")]
    TemplateInput(String),
}

/// Shorthand used across the crate.
pub type Result<T> = std::result::Result<T, TextError>;
