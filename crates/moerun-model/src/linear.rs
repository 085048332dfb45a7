//! Thin wrappers that apply stored weights to f32 activations: linear layers with optional bias
//! and embedding lookups.

use moerun_core::Tensor;
use moerun_cpu::linear::matmul_t;

/// `x[m, in] · Wᵀ (+ b)` → `[m, out]`.
pub fn linear(x: &[f32], m: usize, weight: &Tensor, bias: Option<&[f32]>) -> Vec<f32> {
    let w = weight.mat();
    let mut out = vec![0.0f32; m * w.rows];
    if m == 0 {
        return out;
    }
    matmul_t(x, m, w, &mut out);
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(w.rows) {
            for (o, bi) in row.iter_mut().zip(b) {
                *o += bi;
            }
        }
    }
    out
}

/// Apply a [`crate::weights::Linear`].
pub fn apply(x: &[f32], m: usize, l: &crate::weights::Linear) -> Vec<f32> {
    linear(x, m, &l.weight, l.bias.as_deref())
}

/// Copy (widened) embedding rows for `tokens` into `out` (`[tokens.len(), hidden]`).
/// Token ids must already be checked against the vocabulary.
pub fn embed_rows(table: &Tensor, tokens: &[u32], out: &mut [f32]) {
    let m = table.mat();
    for (row, &t) in out.chunks_exact_mut(m.cols).zip(tokens) {
        moerun_core::tensor::widen_into(m.dtype, m.row(t as usize), row);
    }
}
