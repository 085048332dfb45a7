//! The Gemma 4 layer stack over a flat batch, top to bottom as `Gemma4TextModel.forward` and
//! `Gemma4ForCausalLM.forward` read.

use moerun_core::{Error, Result};
use moerun_cpu::ops::{gelu_tanh_mul_in_place, rms_norm_rows};

use crate::backend::cpu::token_slots;
use crate::batch::Batch;
use crate::config::{ModelConfig, PerLayerInputConfig};
use crate::kv::KvCache;
use crate::linear::{embed_rows, linear};

use super::attention::{attention, Pass};
use super::moe::{experts, mlp};
use super::weights::{Gemma4LayerWeights, Gemma4Weights, PerLayerInputWeights};

/// Run `tokens` (the batch's tokens in order, already checked against the vocabulary) through
/// the model, writing K/V into `kv`, and return the soft-capped logits of `rows`
/// (`[rows.len(), vocab]`).
pub fn forward(
    cfg: &ModelConfig,
    w: &Gemma4Weights,
    batch: &Batch,
    kv: &mut KvCache,
    tokens: &[u32],
    rows: &[usize],
) -> Result<Vec<f32>> {
    let g = cfg
        .gemma4
        .as_ref()
        .ok_or_else(|| Error::InvalidArgument("Gemma 4 weights without a Gemma 4 config".into()))?;
    if let Some(ple) = g.per_layer_input {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= ple.vocab) {
            return Err(Error::TokenOutOfRange {
                id: t,
                vocab: ple.vocab,
            });
        }
    }
    let slots = token_slots(batch, false);
    let window_slots = if batch.window_tables.is_empty() {
        Vec::new()
    } else {
        token_slots(batch, true)
    };
    let n = tokens.len();
    let h = cfg.hidden_size;
    let eps = cfg.rms_norm_eps;

    let mut x = vec![0.0f32; n * h];
    embed_rows(&w.embed_tokens, tokens, &mut x);
    scale_in_place(&mut x, w.embed_scale);
    let per_layer_inputs = match (&g.per_layer_input, &w.per_layer_input) {
        (Some(ple), Some(pw)) => Some(per_layer_inputs(cfg, *ple, pw, tokens, &x)),
        _ => None,
    };

    let pass = Pass {
        cfg,
        g,
        ropes: &w.ropes,
        slots: &slots,
        window_slots: &window_slots,
    };
    for (l, lw) in w.layers.iter().enumerate() {
        let ple = per_layer_inputs
            .as_ref()
            .zip(g.per_layer_input)
            .map(|(all, cfg)| (all.as_slice(), cfg.width));
        layer(&pass, l, lw, &mut x, ple, kv);
    }

    let mut last = Vec::with_capacity(rows.len() * h);
    for &r in rows {
        last.extend_from_slice(&x[r * h..(r + 1) * h]);
    }
    rms_norm_rows(&mut last, &w.norm, eps);
    let mut logits = linear(&last, rows.len(), &w.lm_head, None);
    if let Some(cap) = g.final_logit_softcapping {
        for v in &mut logits {
            *v = (*v / cap).tanh() * cap;
        }
    }
    Ok(logits)
}

/// Decoder layer `l` alone over `batch` (positions and block tables), in place on `x`: the
/// reference the CUDA backend's layer is tested against (`crate::cuda`'s Gemma 4 tests).
#[cfg(test)]
pub(crate) fn layer_alone(
    cfg: &ModelConfig,
    w: &Gemma4Weights,
    batch: &Batch,
    kv: &mut KvCache,
    l: usize,
    x: &mut [f32],
    ple: Option<(&[f32], usize)>,
) {
    let g = cfg.gemma4.as_ref().expect("a Gemma 4 config");
    let slots = token_slots(batch, false);
    let pass = Pass {
        cfg,
        g,
        ropes: &w.ropes,
        slots: &slots,
        window_slots: &[],
    };
    layer(&pass, l, &w.layers[l], x, ple, kv);
}

/// One decoder layer on the residual stream `x` (`[n, hidden]`), in place. `ple` is every
/// token's per-layer inputs (`[n, layers * width]`) and `width`, when the model has them.
fn layer(
    pass: &Pass,
    l: usize,
    lw: &Gemma4LayerWeights,
    x: &mut [f32],
    ple: Option<(&[f32], usize)>,
    kv: &mut KvCache,
) {
    let (cfg, g) = (pass.cfg, pass.g);
    let n = pass.slots.len();
    let eps = cfg.rms_norm_eps;

    let mut xn = x.to_vec();
    rms_norm_rows(&mut xn, &lw.input_layernorm, eps);
    let mut attn = attention(pass, l, &lw.self_attn, &xn, kv);
    rms_norm_rows(&mut attn, &lw.post_attention_layernorm, eps);
    add_in_place(x, &attn);

    // The residual is `x` from here until the feed-forward output is added back.
    let mut xn = x.to_vec();
    rms_norm_rows(&mut xn, &lw.pre_feedforward_layernorm, eps);
    let mut ffn = mlp(&lw.mlp, &xn, n);
    if let (Some(moe), Some(moe_cfg)) = (&lw.moe, &cfg.moe) {
        rms_norm_rows(&mut ffn, &moe.post_feedforward_layernorm_1, eps);
        let mut routed = experts(moe, moe_cfg.top_k, x, n, eps);
        rms_norm_rows(&mut routed, &moe.post_feedforward_layernorm_2, eps);
        add_in_place(&mut ffn, &routed);
    }
    rms_norm_rows(&mut ffn, &lw.post_feedforward_layernorm, eps);
    add_in_place(x, &ffn);

    if let (Some(li), Some((inputs, width))) = (&lw.per_layer_input, ple) {
        let packed = g.layers.len() * width;
        let mut gate = linear(x, n, &li.gate, None);
        for (t, row) in gate.chunks_exact_mut(width).enumerate() {
            gelu_tanh_mul_in_place(row, &inputs[t * packed + l * width..][..width]);
        }
        let mut proj = linear(&gate, n, &li.projection, None);
        rms_norm_rows(&mut proj, &li.post_norm, eps);
        add_in_place(x, &proj);
    }
    scale_in_place(x, lw.layer_scalar);
}

/// Per-layer inputs of every token, `[n, layers * width]` (`get_per_layer_inputs` then
/// `project_per_layer_inputs`): `(norm(proj(embedded) * hidden^-0.5) + table[token] * sqrt(width))
/// * 2^-0.5`, where `embedded` is the scaled main embedding.
fn per_layer_inputs(
    cfg: &ModelConfig,
    ple: PerLayerInputConfig,
    w: &PerLayerInputWeights,
    tokens: &[u32],
    embedded: &[f32],
) -> Vec<f32> {
    let n = tokens.len();
    let packed = cfg.num_layers() * ple.width;
    let mut identity = vec![0.0f32; n * packed];
    embed_rows(&w.embed_tokens_per_layer, tokens, &mut identity);
    scale_in_place(&mut identity, w.embed_scale);
    let mut context = linear(embedded, n, &w.model_projection, None);
    scale_in_place(&mut context, (cfg.hidden_size as f64).powf(-0.5) as f32);
    rms_norm_rows(&mut context, &w.projection_norm, cfg.rms_norm_eps);
    let half_root = 2f64.powf(-0.5) as f32;
    for (c, i) in context.iter_mut().zip(&identity) {
        *c = (*c + i) * half_root;
    }
    context
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn scale_in_place(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
    }
}
