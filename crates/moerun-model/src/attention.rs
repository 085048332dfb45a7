//! CPU pieces of the attention block (the block itself is written once in [`crate::forward`]):
//! rotary embedding on the leading `rotary_dim` dims of each head, and Qwen3.5's query/gate
//! split.

use moerun_cpu::attention::TokenSlot;
use moerun_cpu::ops::rope_rotate_half;

use crate::config::ModelConfig;

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

    /// `(inv_freq, attention_factor)`, for backends that compute cos/sin themselves.
    pub fn parts(&self) -> (&[f32], f32) {
        (&self.inv_freq, self.attention_factor)
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
    pub(crate) fn apply(&self, x: &mut [f32], slots: &[TokenSlot], heads: usize, head_dim: usize) {
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

/// Qwen3.5's doubled `q_proj` output: each head's `2 * head_dim` values are its query then its
/// output gate (`view(..., heads, 2 * head_dim).chunk(2, -1)`). Returns (queries, gates), each
/// `[rows, heads * head_dim]`.
pub(crate) fn split_query_gate(q_and_gate: &[f32], head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let mut q = Vec::with_capacity(q_and_gate.len() / 2);
    let mut gate = Vec::with_capacity(q_and_gate.len() / 2);
    for head in q_and_gate.chunks_exact(2 * head_dim) {
        q.extend_from_slice(&head[..head_dim]);
        gate.extend_from_slice(&head[head_dim..]);
    }
    (q, gate)
}
