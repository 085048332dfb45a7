//! Kernels of the Gated DeltaNet (Qwen3.5's linear attention), one sequence and one value head at
//! a time so that callers can spread (sequence, head) pairs over threads.
//!
//! The gated delta rule keeps a `[key_dim, value_dim]` state `S` per head. For each token, with
//! unit-norm `q`, `k`, decay `g ≤ 0` (log space) and learning rate `β`:
//!
//! ```text
//! S ← S·e^g;  S ← S + k ⊗ β(v − kᵀS);  o = (q/√key_dim)ᵀ S
//! ```
//!
//! [`gated_delta_rule_recurrent`] is that loop (decode). [`gated_delta_rule_chunked`] computes the
//! same thing 64 tokens at a time with dense products, following transformers'
//! `torch_chunk_gated_delta_rule`: per chunk, the UT system `(I + A)` with
//! `A[i][j] = (β_i k_i · k_j)·e^(G_i − G_j)` for `j < i` (`G` the cumulative decay) is solved by
//! forward substitution for the corrected values `U = (I + A)⁻¹ βv` and the decayed keys
//! `W = (I + A)⁻¹ βk·e^G`; then `v_new = U − W S`, `o_i = e^(G_i) q_i S + Σ_{j≤i} (q_i·k_j)
//! e^(G_i − G_j) v_new_j`, and `S ← e^(G_last) S + Σ_j e^(G_last − G_j) k_j ⊗ v_new_j`. Products
//! are formed and summed in the same grouping as there (each partial result complete before it is
//! added), in f32, so both forms agree with transformers' to f32 rounding.
//!
//! Everything here sums in an order fixed by the sequence's own tokens, so a sequence's result
//! does not depend on what else shares the batch.

use crate::ops::{axpy, dot, silu};

/// Tokens per chunk of [`gated_delta_rule_chunked`]: transformers' `chunk_size`, which
/// `Qwen3_5MoeGatedDeltaNet` never changes.
pub const CHUNK_SIZE: usize = 64;

/// One value head's inputs over a run of `T` consecutive tokens of one sequence.
#[derive(Clone, Copy, Debug)]
pub struct DeltaHead<'a> {
    /// `[T, key_dim]`, each row of unit L2 norm (not yet scaled by `key_dim^-1/2`).
    pub q: &'a [f32],
    /// `[T, key_dim]`, each row of unit L2 norm.
    pub k: &'a [f32],
    /// `[T, value_dim]`.
    pub v: &'a [f32],
    /// `[T]` log decays (`≤ 0`).
    pub g: &'a [f32],
    /// `[T]` learning rates in `(0, 1)`.
    pub beta: &'a [f32],
    pub key_dim: usize,
    pub value_dim: usize,
}

impl DeltaHead<'_> {
    fn tokens(&self) -> usize {
        self.g.len()
    }

    fn check(&self, state: &[f32], out: &[f32]) {
        let (t, dk, dv) = (self.tokens(), self.key_dim, self.value_dim);
        assert_eq!(self.beta.len(), t);
        assert_eq!(
            (self.q.len(), self.k.len(), self.v.len()),
            (t * dk, t * dk, t * dv)
        );
        assert_eq!(state.len(), dk * dv, "state must be [key_dim, value_dim]");
        assert_eq!(out.len(), t * dv, "out must be [T, value_dim]");
    }
}

/// Token by token, as transformers' `torch_recurrent_gated_delta_rule` (its one-token decode
/// path): `out[t]` gets token `t`'s output; `state` (`[key_dim, value_dim]`) is advanced past
/// every token.
pub fn gated_delta_rule_recurrent(x: &DeltaHead, state: &mut [f32], out: &mut [f32]) {
    x.check(state, out);
    let (dk, dv) = (x.key_dim, x.value_dim);
    // transformers divides the queries by sqrt(key_dim) here (the chunked form multiplies).
    let root = (dk as f64).sqrt() as f32;
    let mut q = vec![0.0f32; dk];
    let mut delta = vec![0.0f32; dv];
    for t in 0..x.tokens() {
        for (qd, &v) in q.iter_mut().zip(&x.q[t * dk..(t + 1) * dk]) {
            *qd = v / root;
        }
        let k = &x.k[t * dk..(t + 1) * dk];
        let decay = x.g[t].exp();
        // kv_mem = kᵀ (S·e^g): what the decayed state already predicts for this key.
        delta.fill(0.0);
        for (row, &kk) in state.chunks_exact_mut(dv).zip(k) {
            for s in row.iter_mut() {
                *s *= decay;
            }
            axpy(kk, row, &mut delta);
        }
        for (d, &v) in delta.iter_mut().zip(&x.v[t * dv..(t + 1) * dv]) {
            *d = (v - *d) * x.beta[t];
        }
        let o = &mut out[t * dv..(t + 1) * dv];
        o.fill(0.0);
        for ((row, &kk), &qk) in state.chunks_exact_mut(dv).zip(k).zip(&q) {
            axpy(kk, &delta, row);
            axpy(qk, row, o);
        }
    }
}

/// Scratch of one chunk (`c` rows at most).
struct ChunkBuffers {
    /// Queries scaled by `key_dim^-1/2`.
    q: Vec<f32>,
    /// `β k`.
    k_beta: Vec<f32>,
    /// `(I + A)⁻¹ β k e^G`, then consumed row by row.
    w: Vec<f32>,
    /// `(I + A)⁻¹ β v`, turned into `v_new` in place.
    u: Vec<f32>,
    /// Cumulative log decay within the chunk.
    cum: Vec<f32>,
    /// `[value_dim]` accumulator.
    acc: Vec<f32>,
    /// `[key_dim, value_dim]` state update of the chunk.
    update: Vec<f32>,
}

/// The whole run at once, in chunks of [`CHUNK_SIZE`] tokens, as transformers'
/// `torch_chunk_gated_delta_rule` (its prefill path). Same contract as
/// [`gated_delta_rule_recurrent`]; the results agree to f32 rounding.
pub fn gated_delta_rule_chunked(x: &DeltaHead, state: &mut [f32], out: &mut [f32]) {
    x.check(state, out);
    let (dk, dv, c) = (x.key_dim, x.value_dim, CHUNK_SIZE);
    let scale = (dk as f64).powf(-0.5) as f32;
    let mut b = ChunkBuffers {
        q: vec![0.0; c * dk],
        k_beta: vec![0.0; c * dk],
        w: vec![0.0; c * dk],
        u: vec![0.0; c * dv],
        cum: vec![0.0; c],
        acc: vec![0.0; dv],
        update: vec![0.0; dk * dv],
    };
    let mut start = 0;
    while start < x.tokens() {
        let n = c.min(x.tokens() - start);
        chunk(x, start, n, scale, &mut b, state, out);
        start += n;
    }
}

/// Tokens `start..start + n` (one chunk; a shorter last chunk equals transformers' zero-padded
/// one, whose padding adds exact zeros).
fn chunk(
    x: &DeltaHead,
    start: usize,
    n: usize,
    scale: f32,
    b: &mut ChunkBuffers,
    state: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv) = (x.key_dim, x.value_dim);
    let key = |j: usize| &x.k[(start + j) * dk..(start + j + 1) * dk];
    let mut run = 0.0f32;
    for i in 0..n {
        run += x.g[start + i];
        b.cum[i] = run;
    }
    for i in 0..n {
        let t = start + i;
        let beta = x.beta[t];
        let e = b.cum[i].exp();
        for d in 0..dk {
            b.q[i * dk + d] = x.q[t * dk + d] * scale;
            b.k_beta[i * dk + d] = x.k[t * dk + d] * beta;
            b.w[i * dk + d] = b.k_beta[i * dk + d] * e;
        }
        for d in 0..dv {
            b.u[i * dv + d] = x.v[t * dv + d] * beta;
        }
    }
    // Forward substitution through the unit lower-triangular (I + A): row i uses rows j < i.
    for i in 1..n {
        let (done_u, rest_u) = b.u.split_at_mut(i * dv);
        let (done_w, rest_w) = b.w.split_at_mut(i * dk);
        for j in 0..i {
            let a = dot(&b.k_beta[i * dk..(i + 1) * dk], key(j)) * (b.cum[i] - b.cum[j]).exp();
            axpy(-a, &done_u[j * dv..(j + 1) * dv], &mut rest_u[..dv]);
            axpy(-a, &done_w[j * dk..(j + 1) * dk], &mut rest_w[..dk]);
        }
    }
    // Read of the state carried in: v_new = U − W S, and the inter-chunk output e^G q S.
    for i in 0..n {
        b.acc.fill(0.0);
        for (row, &w) in state.chunks_exact(dv).zip(&b.w[i * dk..(i + 1) * dk]) {
            axpy(w, row, &mut b.acc);
        }
        for (u, a) in b.u[i * dv..(i + 1) * dv].iter_mut().zip(&b.acc) {
            *u -= a;
        }
        let e = b.cum[i].exp();
        let o = &mut out[(start + i) * dv..(start + i + 1) * dv];
        o.fill(0.0);
        for (row, &q) in state.chunks_exact(dv).zip(&b.q[i * dk..(i + 1) * dk]) {
            axpy(q * e, row, o);
        }
    }
    // Within the chunk: causal attention of the queries over v_new, diagonal included.
    for i in 0..n {
        b.acc.fill(0.0);
        for j in 0..=i {
            let s = dot(&b.q[i * dk..(i + 1) * dk], key(j)) * (b.cum[i] - b.cum[j]).exp();
            axpy(s, &b.u[j * dv..(j + 1) * dv], &mut b.acc);
        }
        let o = &mut out[(start + i) * dv..(start + i + 1) * dv];
        for (o, a) in o.iter_mut().zip(&b.acc) {
            *o += a;
        }
    }
    // S ← e^(G_last) S + Σ_j (e^(G_last − G_j) k_j) ⊗ v_new_j.
    let last = b.cum[n - 1];
    b.update.fill(0.0);
    for j in 0..n {
        let f = (last - b.cum[j]).exp();
        for (row, &k) in b.update.chunks_exact_mut(dv).zip(key(j)) {
            axpy(k * f, &b.u[j * dv..(j + 1) * dv], row);
        }
    }
    let decay = last.exp();
    for (s, u) in state.iter_mut().zip(&b.update) {
        *s = *s * decay + u;
    }
}

/// Causal depthwise conv1d then SiLU over one sequence's new rows, continuing from the inputs
/// that preceded them (transformers' `causal_conv1d_fn` / `causal_conv1d_update`, no bias).
///
/// `x` is `[T, channels]`, replaced by the outputs; `window` is `[kernel - 1, channels]`, the
/// previous inputs oldest first (zeros for a new sequence), replaced by the last `kernel - 1`
/// inputs; `weight_t` is the conv weight transposed to `[kernel, channels]`. Output `t` of
/// channel `c` is `silu(Σ_j weight[c][j] · input[t − kernel + 1 + j][c])`, summed over `j` in order.
pub fn causal_conv1d_silu(x: &mut [f32], window: &mut [f32], weight_t: &[f32], channels: usize) {
    let taps = weight_t.len() / channels;
    assert_eq!(weight_t.len(), taps * channels);
    assert_eq!(window.len(), (taps - 1) * channels);
    assert_eq!(x.len() % channels, 0);
    let t_len = x.len() / channels;
    let mut history = Vec::with_capacity(window.len() + x.len());
    history.extend_from_slice(window);
    history.extend_from_slice(x);
    for (t, out) in x.chunks_exact_mut(channels).enumerate() {
        out.fill(0.0);
        for (j, w) in weight_t.chunks_exact(channels).enumerate() {
            let input = &history[(t + j) * channels..(t + j + 1) * channels];
            for ((o, w), v) in out.iter_mut().zip(w).zip(input) {
                *o += w * v;
            }
        }
        for o in out.iter_mut() {
            *o = silu(*o);
        }
    }
    window.copy_from_slice(&history[t_len * channels..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit_rows(v: &mut [f32], width: usize) {
        for row in v.chunks_exact_mut(width) {
            let n = row.iter().map(|x| x * x).sum::<f32>().sqrt();
            row.iter_mut().for_each(|x| *x /= n);
        }
    }

    struct Run {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
    }

    fn run(t: usize, dk: usize, dv: usize) -> Run {
        let f = |i: usize, s: f32| ((i as f32 + 1.0) * s).sin();
        let mut q: Vec<f32> = (0..t * dk).map(|i| f(i, 0.37)).collect();
        let mut k: Vec<f32> = (0..t * dk).map(|i| f(i, 0.53)).collect();
        unit_rows(&mut q, dk);
        unit_rows(&mut k, dk);
        Run {
            q,
            k,
            v: (0..t * dv).map(|i| f(i, 0.71)).collect(),
            g: (0..t).map(|i| -0.02 - 0.3 * f(i, 0.9).abs()).collect(),
            beta: (0..t).map(|i| 0.2 + 0.6 * f(i, 1.3).abs()).collect(),
        }
    }

    fn head<'a>(r: &'a Run, dk: usize, dv: usize) -> DeltaHead<'a> {
        DeltaHead {
            q: &r.q,
            k: &r.k,
            v: &r.v,
            g: &r.g,
            beta: &r.beta,
            key_dim: dk,
            value_dim: dv,
        }
    }

    /// The rule written out in f64, one token at a time.
    fn reference(r: &Run, dk: usize, dv: usize, state: &mut [f64]) -> Vec<f64> {
        let t_len = r.g.len();
        let mut out = vec![0.0; t_len * dv];
        for t in 0..t_len {
            let decay = (r.g[t] as f64).exp();
            state.iter_mut().for_each(|s| *s *= decay);
            let k = &r.k[t * dk..(t + 1) * dk];
            for c in 0..dv {
                let mem: f64 = (0..dk).map(|a| state[a * dv + c] * k[a] as f64).sum();
                let delta = (r.v[t * dv + c] as f64 - mem) * r.beta[t] as f64;
                for a in 0..dk {
                    state[a * dv + c] += k[a] as f64 * delta;
                }
                out[t * dv + c] = (0..dk)
                    .map(|a| state[a * dv + c] * r.q[t * dk + a] as f64 / (dk as f64).sqrt())
                    .sum();
            }
        }
        out
    }

    fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
        let err: f64 = got
            .iter()
            .zip(want)
            .map(|(g, w)| (*g as f64 - w).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = want.iter().map(|w| w * w).sum::<f64>().sqrt();
        assert!(err / norm < tol, "{what}: relative error {}", err / norm);
    }

    #[test]
    fn chunked_and_recurrent_forms_match_the_rule_across_chunks_and_from_a_carried_state() {
        let (dk, dv) = (16, 24);
        // 150 tokens: two full chunks and a partial one; start from a non-zero state.
        let r = run(150, dk, dv);
        let init: Vec<f32> = (0..dk * dv)
            .map(|i| 0.1 * (i as f32 * 0.11).cos())
            .collect();
        let mut want_state: Vec<f64> = init.iter().map(|&v| v as f64).collect();
        let want = reference(&r, dk, dv, &mut want_state);
        for chunked in [false, true] {
            let mut state = init.clone();
            let mut out = vec![0.0; 150 * dv];
            if chunked {
                gated_delta_rule_chunked(&head(&r, dk, dv), &mut state, &mut out);
            } else {
                gated_delta_rule_recurrent(&head(&r, dk, dv), &mut state, &mut out);
            }
            assert_close(&out, &want, 1e-5, "outputs");
            assert_close(&state, &want_state, 1e-5, "final state");
        }
    }

    #[test]
    fn conv_continues_from_its_window_exactly() {
        let (c, taps, t) = (5, 4, 9);
        let weight_t: Vec<f32> = (0..taps * c).map(|i| (i as f32 * 0.3).sin()).collect();
        let x: Vec<f32> = (0..t * c).map(|i| (i as f32 * 0.7).cos()).collect();
        let mut whole = x.clone();
        let mut window = vec![0.0; (taps - 1) * c];
        causal_conv1d_silu(&mut whole, &mut window, &weight_t, c);
        // The same inputs fed 4, 1, then 4 rows at a time.
        let mut parts = Vec::new();
        let mut window2 = vec![0.0; (taps - 1) * c];
        for (lo, hi) in [(0, 4), (4, 5), (5, 9)] {
            let mut piece = x[lo * c..hi * c].to_vec();
            causal_conv1d_silu(&mut piece, &mut window2, &weight_t, c);
            parts.extend(piece);
        }
        assert_eq!(parts, whole);
        assert_eq!(window, window2);
        assert_eq!(
            &window[..],
            &x[(t - 3) * c..],
            "window keeps the last kernel-1 inputs"
        );
        // First output of channel 0 sees only x[0] (zero history) through the last tap.
        let expect = silu(weight_t[(taps - 1) * c] * x[0]);
        assert_eq!(whole[0], expect);
    }
}
