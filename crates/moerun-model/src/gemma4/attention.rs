//! Gemma 4's self-attention (`Gemma4TextAttention.forward`): `q_proj`, per-head `q_norm`, RoPE of
//! the layer's type; unless the layer shares K/V, `k_proj`, per-head `k_norm` then RoPE for keys,
//! and for values `v_proj` (or, with `attention_k_eq_v`, the raw `k_proj` output) normed by an
//! RMSNorm without a scale; K/V written to the layer's paged pool; attention with scaling 1.0 (the
//! q/k norms replace `head_dim ** -0.5`) over the pool of the layer that produced the K/V, inside
//! the sliding window on `sliding_attention` layers; `o_proj`.

use moerun_cpu::attention::{paged_attention, AttentionShape, TokenSlot};
use moerun_cpu::ops::rms_norm_rows;

use crate::config::{Gemma4Config, ModelConfig};
use crate::kv::KvCache;
use crate::linear::apply;

use super::weights::Gemma4AttentionWeights;

/// Inverse frequencies of each layer type, computed once at load.
pub struct LayerRopes {
    sliding: Vec<f32>,
    full: Vec<f32>,
}

impl LayerRopes {
    pub fn new(g: &Gemma4Config) -> LayerRopes {
        LayerRopes {
            sliding: g.sliding_rope.inv_freq(),
            full: g.full_rope.inv_freq(),
        }
    }

    /// Rotate every `head_dim`-wide head of each row of `x` (`[slots.len(), heads * head_dim]`):
    /// dims `j` and `j + head_dim / 2` turn by `inv_freq[j] * position`, as `rotate_half` pairs
    /// them; pairs of frequency 0 are left as they are (transformers turns them by angle 0).
    fn apply(&self, sliding: bool, x: &mut [f32], slots: &[TokenSlot], head_dim: usize) {
        let inv_freq = if sliding { &self.sliding } else { &self.full };
        debug_assert_eq!(inv_freq.len(), head_dim / 2);
        let rotated = inv_freq.iter().take_while(|&&f| f != 0.0).count();
        let half = head_dim / 2;
        let (mut cos, mut sin) = (vec![0.0f32; rotated], vec![0.0f32; rotated]);
        let width = x.len() / slots.len().max(1);
        for (row, slot) in x.chunks_exact_mut(width).zip(slots) {
            for j in 0..rotated {
                // torch: freqs = position.float() * inv_freq, in f32.
                let angle = slot.position as f32 * inv_freq[j];
                cos[j] = angle.cos();
                sin[j] = angle.sin();
            }
            for head in row.chunks_exact_mut(head_dim) {
                let (x1, x2) = head.split_at_mut(half);
                for j in 0..rotated {
                    let (a, b) = (x1[j], x2[j]);
                    x1[j] = a * cos[j] - b * sin[j];
                    x2[j] = b * cos[j] + a * sin[j];
                }
            }
        }
    }
}

/// What every layer of one forward pass shares.
pub struct Pass<'a> {
    pub cfg: &'a ModelConfig,
    pub g: &'a Gemma4Config,
    pub ropes: &'a LayerRopes,
    /// Each token's block table and position, in batch order.
    pub slots: &'a [TokenSlot<'a>],
    /// The same by the sequences' window tables, for the sliding layers when the KV cache keeps
    /// them apart (empty otherwise).
    pub window_slots: &'a [TokenSlot<'a>],
}

/// Attention of layer `l` over the normed input `xn` (`[slots.len(), hidden]`): writes this
/// layer's K/V for the batch (unless it shares another layer's) and returns the `o_proj` output.
pub fn attention(
    pass: &Pass,
    l: usize,
    w: &Gemma4AttentionWeights,
    xn: &[f32],
    kv: &mut KvCache,
) -> Vec<f32> {
    let Pass { cfg, g, ropes, .. } = *pass;
    let spec = &g.layers[l];
    let slots = match spec.sliding && !pass.window_slots.is_empty() {
        true => pass.window_slots,
        false => pass.slots,
    };
    let n = slots.len();
    let d = spec.head_dim;
    let eps = cfg.rms_norm_eps;

    let mut q = apply(xn, n, &w.q_proj);
    rms_norm_rows(&mut q, &w.q_norm, eps);
    ropes.apply(spec.sliding, &mut q, slots, d);

    if let Some(own) = &w.kv {
        let mut k = apply(xn, n, &own.k_proj);
        let mut v = match &own.v_proj {
            Some(v_proj) => apply(xn, n, v_proj),
            // attention_k_eq_v: the values are the keys before k_norm and RoPE.
            None => k.clone(),
        };
        rms_norm_rows(&mut k, &own.k_norm, eps);
        ropes.apply(spec.sliding, &mut k, slots, d);
        // v_norm: RMSNorm without a learned scale (multiplying by 1.0 is exact).
        rms_norm_rows(&mut v, &vec![1.0; d], eps);
        let width = spec.num_kv_heads * d;
        let pool = &mut kv.pools[l];
        for (i, slot) in slots.iter().enumerate() {
            pool.write(
                slot.block_table,
                slot.position,
                &k[i * width..(i + 1) * width],
                &v[i * width..(i + 1) * width],
            );
        }
    }

    let shape = AttentionShape {
        num_heads: cfg.num_heads,
        num_kv_heads: spec.num_kv_heads,
        head_dim: d,
        scale: 1.0,
        sliding_window: spec.sliding.then_some(g.sliding_window),
    };
    let mut out = vec![0.0f32; n * cfg.num_heads * d];
    paged_attention(&q, slots, &kv.pools[spec.kv_source], &shape, &mut out);
    apply(&out, n, &w.o_proj)
}
