//! Checkpoints, typed configs, model families and the forward pass over a flat token batch.

pub mod attention;
pub mod backend;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod cuda;
pub mod ffn;
pub mod forward;
pub mod gated_deltanet;
pub mod gemma4;
pub mod kv;
pub mod linear;
pub mod linear_state;
pub mod model;
pub mod npy;
pub mod safetensors;
pub mod stats;
pub mod weights;

pub use batch::{Batch, LogitsFor, SeqChunk};
pub use config::ModelConfig;
pub use kv::KvCache;
pub use linear_state::LinearStateCache;
pub use model::argmax;
pub use model::{ForwardOutput, Model, WeightsIn};
