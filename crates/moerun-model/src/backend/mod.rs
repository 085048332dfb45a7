//! The ops a forward pass is written in, implemented once per compute backend.
//!
//! A family's flow (which norms, which projections, in what order, how residuals add up) is
//! written once, in [`crate::forward`], over this trait; the CPU ([`cpu::CpuPass`]) and CUDA
//! (`crate::cuda`) backends implement the ops. Weights are always named by their host
//! description (`&Linear`, `&[f32]` norm weights, `&MoeWeights`): the CPU reads them where they
//! are mapped, a device backend looks up the copy it uploaded for them. Ops that a backend fuses
//! (the whole routed-expert computation, attention with its KV write) are single ops here, with
//! the CPU's composition as the reference the fused version is tested against.
//!
//! An implementation is one forward pass's view of its backend: it was told the batch (token
//! positions, block tables) when it was created, and `rope`/`attention` use that placement.

pub mod cpu;

use moerun_core::{Result, Tensor};

use crate::config::{ModelConfig, MoeConfig};
use crate::weights::{AttentionWeights, GatedDeltaNetWeights, Linear, MlpWeights, MoeWeights};

/// Shape of one attention layer's softmax attention, as the generic block hands it over.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
}

/// What attention needs from a layer's input: rotated q and k, v, and the output gate where the
/// family has one.
pub struct AttentionInputs<A> {
    pub q: A,
    pub k: A,
    pub v: A,
    pub gate: Option<A>,
}

/// The ops of the forward pass over activations `Act`, rows of f32 values (`[rows, width]`; the
/// width follows from the op: a weight's shape or an explicit argument).
pub trait Backend {
    type Act;

    /// Rows of the embedding table for the batch's tokens (checked against the vocabulary).
    fn embed(&mut self, table: &Tensor, tokens: &[u32]) -> Result<Self::Act>;
    /// RMSNorm of each row of width `weight.len()` (hidden rows, or per-head rows of q/k).
    fn rms_norm(&mut self, x: &Self::Act, weight: &[f32], eps: f32) -> Result<Self::Act>;
    /// `x += y`.
    fn add_assign(&mut self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    /// `x += y`, then the RMSNorm of the new `x` (the residual add and the next layer's input
    /// norm). A backend may fuse the two; the composition is the reference.
    fn add_rms_norm(
        &mut self,
        x: &mut Self::Act,
        y: &Self::Act,
        weight: &[f32],
        eps: f32,
    ) -> Result<Self::Act> {
        self.add_assign(x, y)?;
        self.rms_norm(x, weight, eps)
    }
    /// The attention prologue of layer `layer` over its normed input: q (and Qwen3.5's output
    /// gate), k and v, normed and rotated as the family says
    /// ([`crate::forward::attention_inputs`]). A backend may fuse it; the composition is the
    /// reference. A fused prologue may also write k and v into the layer's KV (the CUDA one
    /// does); that backend's [`Backend::attention`] then does not write them again.
    fn attention_inputs(
        &mut self,
        _layer: usize,
        cfg: &ModelConfig,
        w: &AttentionWeights,
        xn: &Self::Act,
    ) -> Result<AttentionInputs<Self::Act>>
    where
        Self: Sized,
    {
        crate::forward::attention_inputs(self, cfg, w, xn)
    }
    /// Layer `layer`'s self-attention over its normed input, up to o_proj: the prologue, the
    /// batch's K/V into the layer's KV, attention, Qwen3.5's output gate
    /// ([`crate::forward::self_attention`], the reference). A backend may fold the prologue into
    /// attention (the CUDA one does at batch 1).
    fn self_attention(
        &mut self,
        layer: usize,
        cfg: &ModelConfig,
        w: &AttentionWeights,
        spec: &AttentionSpec,
        xn: &Self::Act,
    ) -> Result<Self::Act>
    where
        Self: Sized,
    {
        crate::forward::self_attention(self, layer, cfg, w, spec, xn)
    }
    /// The residual add and input norm before layer `layer`'s self-attention, then its attention
    /// block up to and including o_proj ([`crate::forward::add_norm_attention`], the reference):
    /// `x += y` where the layer before left a `y`. A backend may fold the add+norm into the q/k/v
    /// projection (the CUDA one does for one token).
    fn add_norm_attention(
        &mut self,
        layer: usize,
        cfg: &ModelConfig,
        w: &AttentionWeights,
        x: &mut Self::Act,
        y: Option<&Self::Act>,
        norm: (&[f32], f32),
    ) -> Result<Self::Act>
    where
        Self: Sized,
    {
        crate::forward::add_norm_attention(self, layer, cfg, w, x, y, norm)
    }
    /// The last residual add (`x += y` where the last layer left a `y`), then the final norm of
    /// rows `rows` (of `x`'s rows of `hidden`) and the LM head
    /// ([`crate::forward::final_logits`], the reference). A backend may fold the add and norm
    /// into the LM head's GEMV (the CUDA one does for one token).
    #[allow(clippy::too_many_arguments)]
    fn final_logits(
        &mut self,
        x: &mut Self::Act,
        y: Option<&Self::Act>,
        rows: &[usize],
        hidden: usize,
        norm: (&[f32], f32),
        lm_head: &Tensor,
    ) -> Result<Self::Act>
    where
        Self: Sized,
    {
        crate::forward::final_logits(self, x, y, rows, hidden, norm, lm_head)
    }
    /// `x · Wᵀ (+ b)`.
    fn linear(&mut self, x: &Self::Act, l: &Linear) -> Result<Self::Act>;
    /// `x · Wᵀ` for a bare matrix (the LM head, which may be the tied embedding).
    fn matmul(&mut self, x: &Self::Act, w: &Tensor) -> Result<Self::Act>;
    /// Clamp every value to `[-c, c]` (OLMoE's `clip_qkv`).
    fn clamp(&mut self, x: &mut Self::Act, c: f32) -> Result<()>;
    /// Rotary embedding of every head (`heads` of `head_dim`) of each row, at its token's
    /// position in the batch.
    fn rope(&mut self, x: &mut Self::Act, heads: usize, head_dim: usize) -> Result<()>;
    /// Qwen3.5's doubled `q_proj` output split into (queries, gates), each head's `2 * head_dim`
    /// values being its query then its gate.
    fn split_query_gate(
        &mut self,
        q_and_gate: &Self::Act,
        head_dim: usize,
    ) -> Result<(Self::Act, Self::Act)>;
    /// `x *= sigmoid(gate)`.
    fn sigmoid_gate(&mut self, x: &mut Self::Act, gate: &Self::Act) -> Result<()>;
    /// Write the batch's k/v (`[rows, kv_heads * head_dim]`) into layer `layer`'s KV at each
    /// token's position, then attend each query over its sequence's visible keys.
    fn attention(
        &mut self,
        layer: usize,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        spec: &AttentionSpec,
    ) -> Result<Self::Act>;
    /// A dense SwiGLU MLP.
    fn mlp(&mut self, x: &Self::Act, w: &MlpWeights) -> Result<Self::Act>;
    /// The MoE block: route, run the selected experts, sum in rank order, add the shared expert
    /// as the family defines.
    fn moe(&mut self, x: &Self::Act, cfg: &MoeConfig, w: &MoeWeights) -> Result<Self::Act>;
    /// The residual add and norm before a MoE block, then the block
    /// ([`crate::forward::add_norm_moe`], the reference). A backend may fold the norm into the
    /// routing (the CUDA one does for one token).
    fn add_norm_moe(
        &mut self,
        x: &mut Self::Act,
        y: &Self::Act,
        norm: (&[f32], f32),
        cfg: &MoeConfig,
        w: &MoeWeights,
    ) -> Result<Self::Act>
    where
        Self: Sized,
    {
        crate::forward::add_norm_moe(self, x, y, norm, cfg, w)
    }
    /// Qwen3.5's Gated DeltaNet layer `layer` over the normed input, advancing each sequence's
    /// state.
    fn gated_deltanet(
        &mut self,
        layer: usize,
        w: &GatedDeltaNetWeights,
        xn: &Self::Act,
    ) -> Result<Self::Act>;
    /// The rows `rows` of `x` (of width `width`), in that order.
    fn select_rows(&mut self, x: &Self::Act, width: usize, rows: &[usize]) -> Result<Self::Act>;
    /// Bring `x` to host memory.
    fn to_host(&mut self, x: Self::Act) -> Result<Vec<f32>>;
    /// Activations from host values (tests feed both backends the same inputs this way).
    fn upload(&mut self, x: &[f32]) -> Result<Self::Act>;
}
