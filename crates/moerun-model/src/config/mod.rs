//! Typed model configuration, parsed from a Hugging Face `config.json`.
//!
//! Configs are data, families are code: [`ModelConfig`] holds every field the supported families
//! use at inference, already resolved (defaults applied, both the transformers v4 and v5 spellings
//! accepted, per-layer choices such as "is this layer MoE" and "does it slide" decided once here).
//! Anything we cannot honour exactly is refused by name, never approximated.

mod family;
mod raw;
mod rope;

pub use family::Family;
pub use rope::{RopeConfig, RopeScaling};

use moerun_core::{Error, Result};

/// How q and k are normalised before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm over each head's `head_dim` values (Qwen3, Qwen3-MoE).
    PerHead,
    /// RMSNorm over the whole q (resp. k) projection (OLMoE).
    WholeProjection,
}

/// Which linear layers of attention carry a bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionBias {
    pub qkv: bool,
    pub o: bool,
}

/// Routed experts of a MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    /// Intermediate size of one routed expert.
    pub expert_intermediate: usize,
    /// Renormalise the top-k probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// Qwen2-MoE's always-on expert, scaled by `sigmoid(shared_expert_gate(x))`.
    pub shared_expert: Option<SharedExpertConfig>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SharedExpertConfig {
    pub intermediate: usize,
    /// Whether a sigmoid gate (`shared_expert_gate`, one output) scales the shared expert.
    pub gated: bool,
}

/// The feed-forward block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// A dense SwiGLU MLP with this intermediate size.
    Dense { intermediate: usize },
    /// The family's sparse MoE block (see [`ModelConfig::moe`]).
    Moe,
}

/// Per-layer choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    /// A query at position p attends to keys at positions `p - window + 1 ..= p` when set.
    pub sliding_window: Option<usize>,
    pub ffn: FfnKind,
}

/// Everything the forward pass needs to know about a model, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope: RopeConfig,
    pub attention_bias: AttentionBias,
    pub mlp_bias: bool,
    pub qk_norm: QkNorm,
    /// OLMoE: clamp q, k, v to `[-c, c]` after projection (and after the q/k norms).
    pub clip_qkv: Option<f32>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub layers: Vec<LayerSpec>,
    pub moe: Option<MoeConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Parse and resolve a `config.json` text.
    pub fn from_json_str(text: &str) -> Result<ModelConfig> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("not valid JSON: {e}")))?;
        Self::from_json(&value)
    }

    /// Resolve a parsed `config.json`.
    pub fn from_json(value: &serde_json::Value) -> Result<ModelConfig> {
        raw::resolve(value)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Width of the q projection (`num_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the k and v projections (`num_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// KV cache bytes per token across all layers, at f32 (what the CPU cache stores).
    pub fn kv_bytes_per_token(&self, bytes_per_value: usize) -> usize {
        2 * self.num_layers() * self.kv_dim() * bytes_per_value
    }
}

#[cfg(test)]
mod tests;
