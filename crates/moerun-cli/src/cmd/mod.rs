//! The subcommands. Each returns `CliResult`; `main` prints the error as one line.

pub mod bench;
pub mod bench_serve;
pub mod chat;
pub mod default_model;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod perplexity;
pub mod progress;
pub mod serve;
pub mod synth;
pub mod text_model;

/// Errors a command reports: a library error or a message of its own.
pub type CliResult<T = ()> = Result<T, Box<dyn std::error::Error>>;
