//! Sequences and the loop that feeds them through a model: each sequence owns a block table in
//! the shared KV cache; a step reserves blocks for its new tokens and runs them as one flat batch.

pub mod block_manager;
pub mod generate;
pub mod generation_config;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod stop;

pub use sequence::{run_step, Sequence, SequenceKv};
