//! Qwen3.5's Gated DeltaNet layer over a flat batch, as `Qwen3_5MoeGatedDeltaNet.forward`:
//!
//! ```text
//! q|k|v = silu(causal_conv1d(in_proj_qkv(x)))      per sequence, from its conv window
//! q, k  = l2norm(q), l2norm(k)                     per key head, eps 1e-6
//! β     = sigmoid(in_proj_b(x))
//! g     = -exp(A_log) · softplus(in_proj_a(x) + dt_bias)
//! o     = gated_delta_rule(q, k, v, g, β)          per (sequence, value head), from its state
//! out   = out_proj(rmsnorm(o) · norm.weight · silu(in_proj_z(x)))   per value head
//! ```
//!
//! Key head `h / (num_value_heads / num_key_heads)` serves value head `h`. A sequence's run of
//! new tokens goes through the chunked form of the delta rule when it has several tokens and the
//! recurrent form when it has one (decode), as transformers picks `torch_chunk_gated_delta_rule`
//! and `torch_recurrent_gated_delta_rule`. Sequences and heads run in parallel; each one's result
//! depends only on its own tokens and state, so batching never changes it.

use std::ops::Range;

use moerun_cpu::gated_delta::{
    causal_conv1d_silu, gated_delta_rule_chunked, gated_delta_rule_recurrent, DeltaHead,
};
use moerun_cpu::ops::{l2_normalize_rows, rms_norm_gated_rows, sigmoid, softplus};
use rayon::prelude::*;

use crate::config::LinearAttentionConfig;
use crate::linear::apply;
use crate::linear_state::SlotState;
use crate::weights::GatedDeltaNetWeights;

/// `l2norm`'s epsilon in transformers' delta-rule fallbacks (not the config's rms_norm_eps).
const L2_NORM_EPS: f32 = 1e-6;

/// The layer's output (`[rows, hidden]`) for the normed input `xn`. `seqs[i]` are the batch rows
/// of sequence `i` and `states[i]` its state in this layer, advanced past those rows.
pub fn gated_deltanet_block(
    la: &LinearAttentionConfig,
    rms_norm_eps: f32,
    w: &GatedDeltaNetWeights,
    xn: &[f32],
    seqs: &[Range<usize>],
    states: &mut [SlotState<'_>],
) -> Vec<f32> {
    let n = seqs.last().map_or(0, |r| r.end);
    let (key_dim, value_dim, conv_dim) = (la.key_dim(), la.value_dim(), la.conv_dim());
    let heads = la.num_value_heads;

    let mut qkv = apply(xn, n, &w.in_proj_qkv);
    let z = apply(xn, n, &w.in_proj_z);
    let b = apply(xn, n, &w.in_proj_b);
    let a = apply(xn, n, &w.in_proj_a);

    split_rows_mut(&mut qkv, conv_dim, seqs)
        .into_par_iter()
        .zip(states.par_iter_mut())
        .for_each(|(x, state)| causal_conv1d_silu(x, state.conv, &w.conv1d_taps, conv_dim));

    let mut q = Vec::with_capacity(n * key_dim);
    let mut k = Vec::with_capacity(n * key_dim);
    let mut v = Vec::with_capacity(n * value_dim);
    for row in qkv.chunks_exact(conv_dim) {
        q.extend_from_slice(&row[..key_dim]);
        k.extend_from_slice(&row[key_dim..2 * key_dim]);
        v.extend_from_slice(&row[2 * key_dim..]);
    }
    l2_normalize_rows(&mut q, la.key_head_dim, L2_NORM_EPS);
    l2_normalize_rows(&mut k, la.key_head_dim, L2_NORM_EPS);

    let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
    let g: Vec<f32> = a
        .chunks_exact(heads)
        .flat_map(|row| {
            row.iter()
                .zip(w.a_log.iter().zip(&w.dt_bias))
                .map(|(&a, (&a_log, &dt))| -a_log.exp() * softplus(a + dt))
        })
        .collect();

    let inputs = Inputs {
        la,
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
    };
    let mut core = vec![0.0f32; n * value_dim];
    let tasks: Vec<(usize, usize, &mut [f32])> = states
        .iter_mut()
        .enumerate()
        .flat_map(|(s, state)| {
            let per_head = la.key_head_dim * la.value_head_dim;
            state
                .recurrent
                .chunks_exact_mut(per_head)
                .enumerate()
                .map(move |(h, st)| (s, h, st))
        })
        .collect();
    let outputs: Vec<(usize, usize, Vec<f32>)> = tasks
        .into_par_iter()
        .map(|(s, h, state)| (s, h, inputs.run_head(seqs[s].clone(), h, state)))
        .collect();
    let dv = la.value_head_dim;
    for (s, h, out) in outputs {
        for (t, o) in seqs[s].clone().zip(out.chunks_exact(dv)) {
            core[t * value_dim + h * dv..][..dv].copy_from_slice(o);
        }
    }

    rms_norm_gated_rows(&mut core, &z, &w.norm, rms_norm_eps);
    apply(&core, n, &w.out_proj)
}

/// The batch's delta-rule inputs, `[rows, heads * head_dim]` each (`g` and `beta`: `[rows, heads]`).
struct Inputs<'a> {
    la: &'a LinearAttentionConfig,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
}

impl Inputs<'_> {
    /// Value head `h` over `rows` (one sequence): gathers its columns, runs the delta rule from
    /// `state`, and returns `[rows.len(), value_head_dim]`.
    fn run_head(&self, rows: Range<usize>, h: usize, state: &mut [f32]) -> Vec<f32> {
        let la = self.la;
        let (dk, dv, heads) = (la.key_head_dim, la.value_head_dim, la.num_value_heads);
        let kh = h / (heads / la.num_key_heads);
        // Head `head`'s `width` columns of `src`, whose rows are `width * count` wide.
        let column = |src: &[f32], count: usize, width: usize, head: usize| -> Vec<f32> {
            rows.clone()
                .flat_map(|t| &src[(t * count + head) * width..][..width])
                .copied()
                .collect()
        };
        let q = column(self.q, la.num_key_heads, dk, kh);
        let k = column(self.k, la.num_key_heads, dk, kh);
        let v = column(self.v, heads, dv, h);
        let g: Vec<f32> = rows.clone().map(|t| self.g[t * heads + h]).collect();
        let beta: Vec<f32> = rows.clone().map(|t| self.beta[t * heads + h]).collect();
        let head = DeltaHead {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            key_dim: dk,
            value_dim: dv,
        };
        let mut out = vec![0.0f32; rows.len() * dv];
        if rows.len() == 1 {
            gated_delta_rule_recurrent(&head, state, &mut out);
        } else {
            gated_delta_rule_chunked(&head, state, &mut out);
        }
        out
    }
}

/// `x` (`[rows, width]`) cut into the consecutive row ranges `seqs`.
fn split_rows_mut<'a>(
    mut x: &'a mut [f32],
    width: usize,
    seqs: &[Range<usize>],
) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(seqs.len());
    for r in seqs {
        let (head, tail) = x.split_at_mut(r.len() * width);
        out.push(head);
        x = tail;
    }
    out
}
