//! Checkpoints, typed configs, model families and the forward pass over a flat token batch.

pub mod checkpoint;
pub mod safetensors;
