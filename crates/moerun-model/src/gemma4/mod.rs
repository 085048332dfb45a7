//! Gemma 4 (`gemma4` / `gemma4_text`, transformers 5.24 `modeling_gemma4.py`) on the CPU.
//!
//! The decoder layer (`Gemma4TextDecoderLayer.forward`), every RMSNorm `x·w` (no `1 +`):
//! ```text
//! x = x + post_attention_layernorm(attn(input_layernorm(x)))
//! h = mlp(pre_feedforward_layernorm(x))                        dense GELU-tanh MLP
//! with enable_moe_block:
//!     h = post_feedforward_layernorm_1(h)
//!       + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x)))   routed on x
//! x = x + post_feedforward_layernorm(h)
//! with per-layer inputs: x = x + post_per_layer_input_norm(
//!     per_layer_projection(gelu_tanh(per_layer_input_gate(x)) * per_layer_input[l]))
//! x = x * layer_scalar
//! ```
//! The embedding is scaled by `sqrt(hidden)` (rounded to the table's dtype), the final logits
//! soft-capped. Attention layers differ by type (sliding/full: head dim, K/V heads, RoPE) and the
//! last `num_kv_shared_layers` attend over an earlier layer's K/V ([`attention`]).

pub mod attention;
pub(crate) mod cuda;
pub(crate) mod forward;
pub mod moe;
pub mod stats;
pub mod weights;

pub use forward::forward;
pub use weights::Gemma4Weights;
