//! Paged KV storage and causal attention over it, for a flat batch of tokens.
//!
//! A [`KvPool`] holds one layer's keys and values in fixed-size blocks, laid out
//! `[block][slot][kv_head][head_dim]` in f32. A token at position `p` of a sequence attends to
//! that sequence's positions `lo..=p` (`lo > 0` under a sliding window), found through the
//! sequence's block table. Scores are summed in a fixed order per (token, head), so a token's
//! output does not depend on which other tokens share the batch.

use rayon::prelude::*;

use crate::ops::{axpy, dot};

/// One layer's paged keys and values.
pub struct KvPool {
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvPool {
    /// A zeroed pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize, block_size: usize, kv_heads: usize, head_dim: usize) -> Self {
        let n = num_blocks * block_size * kv_heads * head_dim;
        KvPool {
            block_size,
            kv_heads,
            head_dim,
            k: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    fn row_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn offset(&self, table: &[u32], pos: usize) -> usize {
        let block = table[pos / self.block_size] as usize;
        (block * self.block_size + pos % self.block_size) * self.row_width()
    }

    /// Store the keys and values (`kv_heads * head_dim` each) of position `pos`.
    pub fn write(&mut self, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let w = self.row_width();
        let o = self.offset(table, pos);
        self.k[o..o + w].copy_from_slice(k);
        self.v[o..o + w].copy_from_slice(v);
    }

    /// Bytes held by this pool.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 4
    }
}

/// Shape of one attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k (transformers: `head_dim ** -0.5` unless the family says otherwise).
    pub scale: f32,
    /// Attend to at most this many positions, the current one included.
    pub sliding_window: Option<usize>,
}

/// Where one token of the flat batch sits: its sequence's block table and its position.
#[derive(Clone, Copy, Debug)]
pub struct TokenSlot<'a> {
    pub block_table: &'a [u32],
    pub position: usize,
}

/// `out[t] = softmax(q[t] · Kᵀ · scale) · V` per head over each token's visible positions.
/// `q` and `out` are `[tokens.len(), num_heads * head_dim]`. The pool must already hold K/V of
/// every visible position (including the token's own).
pub fn paged_attention(
    q: &[f32],
    tokens: &[TokenSlot<'_>],
    pool: &KvPool,
    shape: &AttentionShape,
    out: &mut [f32],
) {
    let width = shape.num_heads * shape.head_dim;
    assert_eq!(q.len(), tokens.len() * width);
    assert_eq!(out.len(), q.len());
    assert_eq!(pool.head_dim, shape.head_dim);
    assert_eq!(pool.kv_heads, shape.num_kv_heads);
    out.par_chunks_mut(width)
        .zip(q.par_chunks(width))
        .zip(tokens.par_iter())
        .for_each(|((out_row, q_row), slot)| attend_token(q_row, slot, pool, shape, out_row));
}

fn attend_token(q: &[f32], slot: &TokenSlot, pool: &KvPool, s: &AttentionShape, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { attend_token_avx2(q, slot, pool, s, out) };
            return;
        }
    }
    attend_token_generic(q, slot, pool, s, out)
}

/// The same code as [`attend_token_generic`], compiled with AVX2 so the lane loops vectorise
/// wider. Results are bitwise identical: no contraction or reassociation is enabled.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_token_avx2(
    q: &[f32],
    slot: &TokenSlot,
    pool: &KvPool,
    s: &AttentionShape,
    out: &mut [f32],
) {
    attend_token_generic(q, slot, pool, s, out)
}

/// One token's attention. The query heads that share a KV head are taken together: each K and V
/// row of the token's visible positions is read once for the whole group (GQA groups are 4-8
/// heads in the supported families) instead of once per head, and each position's row offset is
/// found once per token. Per head the arithmetic is the one-head-at-a-time loop's, in the same
/// order (scores by position, softmax, `axpy` by position), so the results are bitwise the same.
#[inline(always)]
fn attend_token_generic(
    q: &[f32],
    slot: &TokenSlot,
    pool: &KvPool,
    s: &AttentionShape,
    out: &mut [f32],
) {
    let d = s.head_dim;
    let group = s.num_heads / s.num_kv_heads;
    let pos = slot.position;
    let lo = s
        .sliding_window
        .map(|w| (pos + 1).saturating_sub(w))
        .unwrap_or(0);
    let n = pos + 1 - lo;
    let rows: Vec<usize> = (lo..=pos)
        .map(|p| pool.offset(slot.block_table, p))
        .collect();
    // scores[g * n + i]: head g of the group, position lo + i.
    let mut scores = vec![0.0f32; group * n];
    let mut inv = vec![0.0f32; group];
    out.fill(0.0);
    for kvh in 0..s.num_kv_heads {
        let heads = kvh * group..(kvh + 1) * group;
        for (i, &row) in rows.iter().enumerate() {
            let k = &pool.k[row + kvh * d..][..d];
            for (g, h) in heads.clone().enumerate() {
                scores[g * n + i] = dot(&q[h * d..(h + 1) * d], k) * s.scale;
            }
        }
        for (g, head_scores) in scores.chunks_exact_mut(n).enumerate() {
            let max = head_scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let mut sum = 0.0f32;
            for score in head_scores.iter_mut() {
                *score = (*score - max).exp();
                sum += *score;
            }
            inv[g] = 1.0 / sum;
        }
        let group_out = &mut out[heads.start * d..heads.end * d];
        for (i, &row) in rows.iter().enumerate() {
            let v = &pool.v[row + kvh * d..][..d];
            for (g, oh) in group_out.chunks_exact_mut(d).enumerate() {
                axpy(scores[g * n + i] * inv[g], v, oh);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>], scale: f32) -> Vec<f32> {
        let scores: Vec<f64> = ks
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| (*a * *b) as f64).sum::<f64>() * scale as f64)
            .collect();
        let max = scores.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        (0..q.len())
            .map(|j| (e.iter().zip(vs).map(|(p, v)| p * v[j] as f64).sum::<f64>() / sum) as f32)
            .collect()
    }

    #[test]
    fn paged_attention_matches_dense_reference_across_blocks_and_windows() {
        let (bs, d) = (4, 8);
        let mut pool = KvPool::new(8, bs, 1, d);
        // Non-contiguous, out-of-order blocks on purpose.
        let table = [5u32, 2, 7];
        let val = |p: usize, j: usize, salt: f32| ((p * 31 + j * 7) as f32 * salt).sin();
        let ks: Vec<Vec<f32>> = (0..10)
            .map(|p| (0..d).map(|j| val(p, j, 0.13)).collect())
            .collect();
        let vs: Vec<Vec<f32>> = (0..10)
            .map(|p| (0..d).map(|j| val(p, j, 0.29)).collect())
            .collect();
        for p in 0..10 {
            pool.write(&table, p, &ks[p], &vs[p]);
        }
        let q: Vec<f32> = (0..2 * d).map(|j| (j as f32 * 0.7).cos()).collect();
        for window in [None, Some(3)] {
            let shape = AttentionShape {
                num_heads: 2,
                num_kv_heads: 1,
                head_dim: d,
                scale: 0.5,
                sliding_window: window,
            };
            let slot = TokenSlot {
                block_table: &table,
                position: 9,
            };
            let mut out = vec![0.0; 2 * d];
            paged_attention(&q, &[slot], &pool, &shape, &mut out);
            let lo = window.map(|w| 10 - w).unwrap_or(0);
            for h in 0..2 {
                let want = naive(&q[h * d..(h + 1) * d], &ks[lo..], &vs[lo..], 0.5);
                for (g, w) in out[h * d..(h + 1) * d].iter().zip(&want) {
                    assert!(
                        (g - w).abs() < 1e-5,
                        "window {window:?} head {h}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
