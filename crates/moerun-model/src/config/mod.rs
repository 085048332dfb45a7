//! Typed model configuration, parsed from a Hugging Face `config.json`.
//!
//! Configs are data, families are code: [`ModelConfig`] holds every field the supported families
//! use at inference, already resolved (defaults applied, both the transformers v4 and v5 spellings
//! accepted, per-layer choices such as "is this layer MoE" and "does it slide" decided once here).
//! Anything we cannot honour exactly is refused by name, never approximated.

mod family;
mod gemma4;
mod qwen3_5;
mod raw;
mod rope;

pub use family::Family;
pub use gemma4::{Gemma4Config, Gemma4Layer, Gemma4Rope, PerLayerInputConfig};
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

/// How a layer mixes information across positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mixer {
    /// Softmax self-attention over the paged KV cache.
    Attention,
    /// Qwen3.5's Gated DeltaNet (`linear_attn`): a causal depthwise conv and the gated delta
    /// rule, whose per-sequence state is a fixed-size conv window plus a recurrent matrix.
    GatedDeltaNet,
}

/// Shape of the Gated DeltaNet layers (`linear_*` fields of Qwen3.5 configs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearAttentionConfig {
    pub num_key_heads: usize,
    /// A multiple of `num_key_heads`: key head `h / (num_value_heads / num_key_heads)` serves
    /// value head `h`.
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    /// Taps of the causal conv1d (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
}

impl LinearAttentionConfig {
    /// Width of q and of k (`num_key_heads * key_head_dim`).
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }

    /// Width of v, z and the core output (`num_value_heads * value_head_dim`).
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// Channels of the conv: `in_proj_qkv`'s output, `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// f32 values of one sequence's state in one layer: the last `conv_kernel - 1` conv inputs
    /// and the `[num_value_heads, key_head_dim, value_head_dim]` recurrent matrix.
    pub fn state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
            + self.num_value_heads * self.key_head_dim * self.value_head_dim
    }
}

/// Per-layer choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub mixer: Mixer,
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
    /// Qwen3.5 stores RMSNorm weights zero-centred and scales by `1 + w` (`Qwen3_5MoeRMSNorm`);
    /// the loader adds the one, so the forward pass always multiplies by the stored vector.
    pub rms_norm_unit_offset: bool,
    pub rope: RopeConfig,
    pub attention_bias: AttentionBias,
    pub mlp_bias: bool,
    pub qk_norm: QkNorm,
    /// OLMoE: clamp q, k, v to `[-c, c]` after projection (and after the q/k norms).
    pub clip_qkv: Option<f32>,
    /// Qwen3.5: `q_proj` yields, per head, the query then as many gate values; the attention
    /// output is multiplied by `sigmoid(gate)` before `o_proj`.
    pub attention_output_gate: bool,
    /// Shape of the [`Mixer::GatedDeltaNet`] layers, when the model has any.
    pub linear_attention: Option<LinearAttentionConfig>,
    /// The config describes a vision tower too (`qwen3_5_moe`): only the text model is run.
    pub has_vision_tower: bool,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub layers: Vec<LayerSpec>,
    pub moe: Option<MoeConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Gemma 4's per-layer attention shapes, KV sharing, RoPE per layer type and the rest of what
    /// only that family has; `None` for every other family.
    pub gemma4: Option<Gemma4Config>,
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

    /// Layers that keep K/V per position (every layer but the Gated DeltaNet ones).
    pub fn num_attention_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| l.mixer == Mixer::Attention)
            .count()
    }

    /// K/V heads and head width of layer `l`'s own KV pool, `None` for layers that keep none
    /// (Gated DeltaNet layers, Gemma 4's KV-shared layers).
    pub fn layer_kv_shape(&self, l: usize) -> Option<(usize, usize)> {
        if let Some(g) = &self.gemma4 {
            return g.kv_shape(l);
        }
        (self.layers[l].mixer == Mixer::Attention).then_some((self.num_kv_heads, self.head_dim))
    }

    /// KV bytes per token across the layers that keep K/V, at `bytes_per_value`.
    pub fn kv_bytes_per_token(&self, bytes_per_value: usize) -> usize {
        let (full, windowed) = self.kv_bytes_per_token_by_group(bytes_per_value);
        full + windowed
    }

    /// [`Self::kv_bytes_per_token`] split into the layers that see the whole sequence and the
    /// sliding-window layers ([`Self::layer_kv_windowed`]), whose K/V can be kept for the
    /// window alone.
    pub fn kv_bytes_per_token_by_group(&self, bytes_per_value: usize) -> (usize, usize) {
        let (mut full, mut windowed) = (0, 0);
        for l in 0..self.num_layers() {
            if let Some((heads, dim)) = self.layer_kv_shape(l) {
                let bytes = 2 * heads * dim * bytes_per_value;
                if self.layer_kv_windowed(l) {
                    windowed += bytes;
                } else {
                    full += bytes;
                }
            }
        }
        (full, windowed)
    }

    /// Whether layer `l` attends over a sliding window, so that its K/V (or, for a KV-shared
    /// layer, the K/V it reads) is needed only for the last `sliding_window` positions: such
    /// layers form the *window group* of the KV cache, which may keep its own blocks and
    /// release those that fall out of the window ([`crate::Batch::window_tables`]).
    pub fn layer_kv_windowed(&self, l: usize) -> bool {
        self.layers[l].mixer == Mixer::Attention && self.layers[l].sliding_window.is_some()
    }

    /// The window of the window group: the widest sliding window of any layer, `None` when no
    /// layer has one (then every layer needs every position).
    pub fn kv_window(&self) -> Option<usize> {
        (0..self.num_layers())
            .filter(|&l| self.layer_kv_windowed(l))
            .filter_map(|l| self.layers[l].sliding_window)
            .max()
    }

    /// Bytes of one sequence's linear-attention state across all Gated DeltaNet layers (f32),
    /// whatever its length; 0 for models without such layers.
    pub fn linear_state_bytes_per_sequence(&self) -> usize {
        let layers = self.num_layers() - self.num_attention_layers();
        self.linear_attention
            .map_or(0, |la| layers * la.state_len() * 4)
    }
}

#[cfg(test)]
mod tests;
