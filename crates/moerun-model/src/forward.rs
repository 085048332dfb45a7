//! The forward pass of the supported families over a flat batch, written once over the
//! [`Backend`] ops. The decoder layer reads top to bottom as in transformers' `modeling_*.py`:
//! `x = x + mixer(input_layernorm(x))`, where the mixer is attention,
//! `o_proj(attn(rope(norm_qk(qkv(·)))))`, or (Qwen3.5's `linear_attention` layers) the Gated
//! DeltaNet; then `x = x + ffn(post_attention_layernorm(x))` where `ffn` is a dense SwiGLU MLP or
//! the MoE block.

use moerun_core::{Result, Tensor};

use crate::backend::{AttentionInputs, AttentionSpec, Backend};
use crate::config::{ModelConfig, MoeConfig, QkNorm};
use crate::weights::{AttentionWeights, FfnWeights, MixerWeights, ModelWeights, MoeWeights};

/// Run the decoder over the batch's `tokens` and return the logits of the rows `rows`
/// (`[rows.len(), vocab]`, on the host).
pub fn decoder<B: Backend>(
    b: &mut B,
    cfg: &ModelConfig,
    w: &ModelWeights,
    tokens: &[u32],
    rows: &[usize],
) -> Result<Vec<f32>> {
    let logits = decoder_logits(b, cfg, w, tokens, rows)?;
    b.to_host(logits)
}

/// [`decoder`], leaving the logits where the backend computed them.
pub fn decoder_logits<B: Backend>(
    b: &mut B,
    cfg: &ModelConfig,
    w: &ModelWeights,
    tokens: &[u32],
    rows: &[usize],
) -> Result<B::Act> {
    let eps = cfg.rms_norm_eps;
    let mut x = b.embed(&w.embed_tokens, tokens)?;
    if w.layers.is_empty() {
        return Err(moerun_core::Error::Config("a model without layers".into()));
    }
    // The layer before's FFN output, added to the residual with the next input norm (so that a
    // backend may fold that add+norm into the next layer's first op).
    let mut pending: Option<B::Act> = None;
    for (l, layer) in w.layers.iter().enumerate() {
        let input_norm = (&layer.input_layernorm[..], eps);
        let mixed = match &layer.mixer {
            MixerWeights::Attention(aw) => {
                b.add_norm_attention(l, cfg, aw, &mut x, pending.as_ref(), input_norm)?
            }
            MixerWeights::GatedDeltaNet(gw) => {
                let xn = add_norm(b, &mut x, pending.as_ref(), input_norm)?;
                b.gated_deltanet(l, gw, &xn)?
            }
        };
        let post_norm = &layer.post_attention_layernorm;
        let ffn_out = match &layer.ffn {
            FfnWeights::Dense(mlp) => {
                let post = b.add_rms_norm(&mut x, &mixed, post_norm, eps)?;
                b.mlp(&post, mlp)?
            }
            FfnWeights::Moe(moe) => {
                let moe_cfg = cfg.moe.as_ref().expect("MoE weights imply a MoE config");
                b.add_norm_moe(&mut x, &mixed, (post_norm, eps), moe_cfg, moe)?
            }
        };
        pending = Some(ffn_out);
    }
    b.final_logits(
        &mut x,
        pending.as_ref(),
        rows,
        cfg.hidden_size,
        (&w.norm, eps),
        &w.lm_head,
    )
}

/// The last residual add, `x += y` where the last layer left a `y`, then the final norm of the
/// rows `rows` (selected first: only they are normed) and the LM head, as the plain composition
/// of ops.
pub fn final_logits<B: Backend>(
    b: &mut B,
    x: &mut B::Act,
    y: Option<&B::Act>,
    rows: &[usize],
    hidden: usize,
    (weight, eps): (&[f32], f32),
    lm_head: &Tensor,
) -> Result<B::Act> {
    if let Some(y) = y {
        b.add_assign(x, y)?;
    }
    let last = b.select_rows(x, hidden, rows)?;
    let last = b.rms_norm(&last, weight, eps)?;
    b.matmul(&last, lm_head)
}

/// Self-attention of layer `l`: q/k/v projections (with biases where the family has them), q/k
/// RMSNorm (per head or over the whole projection), OLMoE's `clip_qkv`, rotary embedding, the
/// paged-KV write and attention, Qwen3.5's sigmoid output gate, and `o_proj`.
pub(crate) fn attention_block<B: Backend>(
    b: &mut B,
    cfg: &ModelConfig,
    w: &AttentionWeights,
    l: usize,
    sliding_window: Option<usize>,
    xn: &B::Act,
) -> Result<B::Act> {
    let spec = attention_spec(cfg, sliding_window);
    let out = b.self_attention(l, cfg, w, &spec, xn)?;
    b.linear(&out, &w.o_proj)
}

/// `x += y` where there is a `y` (the layer before's FFN output), then `x` normed by `(weight,
/// eps)`.
pub(crate) fn add_norm<B: Backend>(
    b: &mut B,
    x: &mut B::Act,
    y: Option<&B::Act>,
    (weight, eps): (&[f32], f32),
) -> Result<B::Act> {
    match y {
        Some(y) => b.add_rms_norm(x, y, weight, eps),
        None => b.rms_norm(x, weight, eps),
    }
}

/// The add+norm before layer `l`'s self-attention, then its attention block, as the plain
/// composition of ops: `x += y` where there is a `y` (the layer before's FFN output), then
/// `attention_block` of `x` normed by `(weight, eps)`.
pub fn add_norm_attention<B: Backend>(
    b: &mut B,
    l: usize,
    cfg: &ModelConfig,
    w: &AttentionWeights,
    x: &mut B::Act,
    y: Option<&B::Act>,
    norm: (&[f32], f32),
) -> Result<B::Act> {
    let xn = add_norm(b, x, y, norm)?;
    attention_block(b, cfg, w, l, cfg.layers[l].sliding_window, &xn)
}

/// The shape of a layer's attention (`sliding_window`: the layer's) as
/// [`Backend::self_attention`] takes it.
pub(crate) fn attention_spec(cfg: &ModelConfig, sliding_window: Option<usize>) -> AttentionSpec {
    let d = cfg.head_dim;
    AttentionSpec {
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: d,
        scale: (d as f64).powf(-0.5) as f32,
        sliding_window,
    }
}

/// The add+norm before a MoE block, then the block, as the plain composition of ops: `x += y`,
/// then [`Backend::moe`] of `x` normed by `(weight, eps)`.
pub fn add_norm_moe<B: Backend>(
    b: &mut B,
    x: &mut B::Act,
    y: &B::Act,
    (weight, eps): (&[f32], f32),
    cfg: &MoeConfig,
    w: &MoeWeights,
) -> Result<B::Act> {
    let xn = b.add_rms_norm(x, y, weight, eps)?;
    b.moe(&xn, cfg, w)
}

/// Self-attention up to o_proj as the plain composition of ops: the prologue, attention (which
/// writes the batch's K/V), the output gate where the family has one.
pub fn self_attention<B: Backend>(
    b: &mut B,
    l: usize,
    cfg: &ModelConfig,
    w: &AttentionWeights,
    spec: &AttentionSpec,
    xn: &B::Act,
) -> Result<B::Act> {
    let AttentionInputs { q, k, v, gate } = b.attention_inputs(l, cfg, w, xn)?;
    let mut out = b.attention(l, &q, &k, &v, spec)?;
    if let Some(gate) = gate {
        b.sigmoid_gate(&mut out, &gate)?;
    }
    Ok(out)
}

/// The attention prologue as the plain composition of ops: q/k/v projections (with biases where
/// the family has them; Qwen3.5's doubled q split into query and gate), q/k RMSNorm (per head or
/// over the whole projection), OLMoE's `clip_qkv`, RoPE.
pub fn attention_inputs<B: Backend>(
    b: &mut B,
    cfg: &ModelConfig,
    w: &AttentionWeights,
    xn: &B::Act,
) -> Result<AttentionInputs<B::Act>> {
    let d = cfg.head_dim;
    let (mut q, gate) = if cfg.attention_output_gate {
        let q_and_gate = b.linear(xn, &w.q_proj)?;
        let (q, gate) = b.split_query_gate(&q_and_gate, d)?;
        (q, Some(gate))
    } else {
        (b.linear(xn, &w.q_proj)?, None)
    };
    let mut k = b.linear(xn, &w.k_proj)?;
    let mut v = b.linear(xn, &w.v_proj)?;
    match cfg.qk_norm {
        QkNorm::None => {}
        // Norm weights are head_dim wide (per head) or projection wide (OLMoE): rms_norm takes
        // the row width from the weight.
        QkNorm::PerHead | QkNorm::WholeProjection => {
            let (qn, kn) = (w.q_norm.as_ref(), w.k_norm.as_ref());
            q = b.rms_norm(&q, qn.expect("q_norm loaded"), cfg.rms_norm_eps)?;
            k = b.rms_norm(&k, kn.expect("k_norm loaded"), cfg.rms_norm_eps)?;
        }
    }
    if let Some(c) = cfg.clip_qkv {
        b.clamp(&mut q, c)?;
        b.clamp(&mut k, c)?;
        b.clamp(&mut v, c)?;
    }
    b.rope(&mut q, cfg.num_heads, d)?;
    b.rope(&mut k, cfg.num_kv_heads, d)?;
    Ok(AttentionInputs { q, k, v, gate })
}
