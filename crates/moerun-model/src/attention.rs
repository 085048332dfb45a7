//! The self-attention block of the supported families: q/k/v projections (with biases where the
//! family has them), q/k RMSNorm (per head or over the whole projection), OLMoE's `clip_qkv`,
//! rotary embedding (on the leading `rotary_dim` dims of each head), the paged-KV write,
//! attention, Qwen3.5's sigmoid output gate, and `o_proj`.

use moerun_cpu::attention::{paged_attention, AttentionShape, KvPool, TokenSlot};
use moerun_cpu::ops::{rms_norm_rows, rope_rotate_half, sigmoid};

use crate::config::{ModelConfig, QkNorm};
use crate::linear::apply;
use crate::weights::AttentionWeights;

/// Precomputed rotary frequencies of a model.
pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Rope {
        let (inv_freq, attention_factor) = cfg.rope.inv_freq();
        Rope {
            inv_freq,
            attention_factor,
        }
    }

    /// cos and sin (`rotary_dim / 2` each) at `pos`, as transformers computes them: the angle is
    /// the f32 product `inv_freq * pos`, and both are scaled by the attention factor.
    fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for ((f, c), s) in self.inv_freq.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
            let angle = f * pos as f32;
            *c = angle.cos() * self.attention_factor;
            *s = angle.sin() * self.attention_factor;
        }
    }

    /// Rotate every head of each row in `x` (`[slots.len(), heads * head_dim]`).
    fn apply(&self, x: &mut [f32], slots: &[TokenSlot], heads: usize, head_dim: usize) {
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (vec![0.0; half], vec![0.0; half]);
        for (row, slot) in x.chunks_exact_mut(heads * head_dim).zip(slots) {
            self.cos_sin(slot.position, &mut cos, &mut sin);
            for head in row.chunks_exact_mut(head_dim) {
                rope_rotate_half(&mut head[..2 * half], &cos, &sin);
            }
        }
    }
}

/// Attention of layer `l` over the normed input `xn` (`[slots.len(), hidden]`); returns the
/// `o_proj` output `[slots.len(), hidden]`, having written the batch's K/V into `pool`.
pub fn attention_block(
    cfg: &ModelConfig,
    w: &AttentionWeights,
    rope: &Rope,
    sliding_window: Option<usize>,
    xn: &[f32],
    slots: &[TokenSlot],
    pool: &mut KvPool,
) -> Vec<f32> {
    let n = slots.len();
    let d = cfg.head_dim;
    let (mut q, gate) = if cfg.attention_output_gate {
        let (q, gate) = split_query_gate(&apply(xn, n, &w.q_proj), d);
        (q, Some(gate))
    } else {
        (apply(xn, n, &w.q_proj), None)
    };
    let mut k = apply(xn, n, &w.k_proj);
    let mut v = apply(xn, n, &w.v_proj);
    match cfg.qk_norm {
        QkNorm::None => {}
        // Norm weights are head_dim wide: rms_norm_rows walks every head as a row.
        QkNorm::PerHead | QkNorm::WholeProjection => {
            let (qn, kn) = (w.q_norm.as_ref(), w.k_norm.as_ref());
            rms_norm_rows(&mut q, qn.expect("q_norm loaded"), cfg.rms_norm_eps);
            rms_norm_rows(&mut k, kn.expect("k_norm loaded"), cfg.rms_norm_eps);
        }
    }
    if let Some(c) = cfg.clip_qkv {
        for t in [&mut q, &mut k, &mut v] {
            for x in t.iter_mut() {
                *x = x.clamp(-c, c);
            }
        }
    }
    rope.apply(&mut q, slots, cfg.num_heads, d);
    rope.apply(&mut k, slots, cfg.num_kv_heads, d);
    let kv_w = cfg.kv_dim();
    for (i, slot) in slots.iter().enumerate() {
        pool.write(
            slot.block_table,
            slot.position,
            &k[i * kv_w..(i + 1) * kv_w],
            &v[i * kv_w..(i + 1) * kv_w],
        );
    }
    let shape = AttentionShape {
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: d,
        scale: (d as f64).powf(-0.5) as f32,
        sliding_window,
    };
    let mut out = vec![0.0f32; n * cfg.q_dim()];
    paged_attention(&q, slots, pool, &shape, &mut out);
    if let Some(gate) = gate {
        for (o, g) in out.iter_mut().zip(&gate) {
            *o *= sigmoid(*g);
        }
    }
    apply(&out, n, &w.o_proj)
}

/// Qwen3.5's doubled `q_proj` output: each head's `2 * head_dim` values are its query then its
/// output gate (`view(..., heads, 2 * head_dim).chunk(2, -1)`). Returns (queries, gates), each
/// `[rows, heads * head_dim]`.
fn split_query_gate(q_and_gate: &[f32], head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let mut q = Vec::with_capacity(q_and_gate.len() / 2);
    let mut gate = Vec::with_capacity(q_and_gate.len() / 2);
    for head in q_and_gate.chunks_exact(2 * head_dim) {
        q.extend_from_slice(&head[..head_dim]);
        gate.extend_from_slice(&head[head_dim..]);
    }
    (q, gate)
}
