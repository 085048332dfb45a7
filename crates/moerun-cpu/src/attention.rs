//! Paged KV storage and causal attention over it, for a flat batch of tokens.
//!
//! A [`KvPool`] holds one layer's keys and values in fixed-size blocks, laid out
//! `[block][slot][kv_head][head_dim]`, in f32 or in bf16 (half the memory; a value is rounded to
//! nearest even once, when written, and widened exactly when read, so attention over a bf16 pool
//! is bit for bit attention over an f32 pool holding the rounded values). A token at position `p` of a sequence attends to
//! that sequence's positions `lo..=p` (`lo > 0` under a sliding window), found through the
//! sequence's block table. Scores are summed in a fixed order per (token, head), so a token's
//! output does not depend on which other tokens share the batch.

use half::bf16;
use moerun_core::DType;
use rayon::prelude::*;

#[cfg(doc)]
use crate::ops::{axpy, dot};
use crate::ops::{reduce_lanes, LANES};

/// Largest head_dim a pool takes (a bf16 key row is widened into a stack buffer this long).
pub const MAX_KV_HEAD_DIM: usize = 512;

/// One layer's paged keys and values.
pub struct KvPool {
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
    k: KvValues,
    v: KvValues,
}

/// The stored values of K or V.
enum KvValues {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
}

impl KvValues {
    fn zeros(dtype: DType, n: usize) -> KvValues {
        match dtype {
            DType::F32 => KvValues::F32(vec![0.0; n]),
            DType::BF16 => KvValues::Bf16(vec![0; n]),
            DType::F16 => panic!("KV pools hold f32 or bf16 (the model refuses f16 by name)"),
        }
    }

    fn len(&self) -> usize {
        match self {
            KvValues::F32(v) => v.len(),
            KvValues::Bf16(v) => v.len(),
        }
    }

    /// Every value, widened (exactly) to f32.
    fn to_f32(&self) -> Vec<f32> {
        match self {
            KvValues::F32(v) => v.clone(),
            KvValues::Bf16(v) => v
                .iter()
                .map(|&h| f32::from_bits((h as u32) << 16))
                .collect(),
        }
    }

    fn store(&mut self, at: usize, values: &[f32]) {
        match self {
            KvValues::F32(v) => v[at..at + values.len()].copy_from_slice(values),
            KvValues::Bf16(v) => {
                for (d, &x) in v[at..at + values.len()].iter_mut().zip(values) {
                    *d = bf16::from_f32(x).to_bits();
                }
            }
        }
    }
}

/// Stored K or V values read as f32, one type per storage dtype so that attention is compiled
/// once for each (the f32 pool's loop stays the plain slice loop it was, with no scratch).
trait KvRead {
    /// Where a widened row goes: nothing for f32, a row's worth of f32 for bf16.
    type Scratch;
    fn scratch() -> Self::Scratch;
    /// `len` (at most [`MAX_KV_HEAD_DIM`]) values from `at`: in place for f32, widened
    /// (exactly) into `buf` for bf16.
    fn read<'a>(&'a self, at: usize, len: usize, buf: &'a mut Self::Scratch) -> &'a [f32];
    /// Ask the cache for the `len` values from `at` (a hint: no effect on any result).
    fn prefetch(&self, at: usize, len: usize);
}

/// Bytes per cache line, the prefetch step.
const LINE: usize = 64;

/// Prefetch `values[at..at + len]` into the first-level cache, a line at a time.
#[inline(always)]
fn prefetch_range<T>(values: &[T], at: usize, len: usize) {
    let range = &values[at..at + len];
    #[cfg(target_arch = "x86_64")]
    for o in (0..std::mem::size_of_val(range)).step_by(LINE) {
        // SAFETY: a prefetch reads nothing architecturally and cannot fault; `o` stays within
        // `range`'s bytes.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                range.as_ptr().cast::<u8>().add(o).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = range;
}

impl KvRead for [f32] {
    type Scratch = ();
    #[inline(always)]
    fn scratch() {}
    #[inline(always)]
    fn read<'a>(&'a self, at: usize, len: usize, _buf: &'a mut ()) -> &'a [f32] {
        &self[at..at + len]
    }
    #[inline(always)]
    fn prefetch(&self, at: usize, len: usize) {
        prefetch_range(self, at, len);
    }
}

impl KvRead for [u16] {
    type Scratch = [f32; MAX_KV_HEAD_DIM];
    #[inline(always)]
    fn scratch() -> Self::Scratch {
        [0.0; MAX_KV_HEAD_DIM]
    }
    #[inline(always)]
    fn prefetch(&self, at: usize, len: usize) {
        prefetch_range(self, at, len);
    }
    #[inline(always)]
    fn read<'a>(&'a self, at: usize, len: usize, buf: &'a mut Self::Scratch) -> &'a [f32] {
        for (d, &h) in buf[..len].iter_mut().zip(&self[at..at + len]) {
            *d = f32::from_bits((h as u32) << 16);
        }
        &buf[..len]
    }
}

impl KvPool {
    /// A zeroed f32 pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize, block_size: usize, kv_heads: usize, head_dim: usize) -> Self {
        KvPool::with_dtype(num_blocks, block_size, kv_heads, head_dim, DType::F32)
    }

    /// A zeroed pool of `num_blocks` blocks storing `dtype` (f32 or bf16; head_dim at most
    /// [`MAX_KV_HEAD_DIM`]).
    pub fn with_dtype(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
    ) -> Self {
        assert!(
            head_dim <= MAX_KV_HEAD_DIM,
            "head_dim {head_dim} over {MAX_KV_HEAD_DIM}"
        );
        let n = num_blocks * block_size * kv_heads * head_dim;
        KvPool {
            block_size,
            kv_heads,
            head_dim,
            k: KvValues::zeros(dtype, n),
            v: KvValues::zeros(dtype, n),
        }
    }

    /// The keys and values as stored, widened to f32: `[blocks][block_size][kv_heads][head_dim]`
    /// each (for tests and tools that compare caches).
    pub fn to_f32(&self) -> (Vec<f32>, Vec<f32>) {
        (self.k.to_f32(), self.v.to_f32())
    }

    /// What the pool stores.
    pub fn dtype(&self) -> DType {
        match self.k {
            KvValues::F32(_) => DType::F32,
            KvValues::Bf16(_) => DType::BF16,
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
        assert!(k.len() == w && v.len() == w, "a K/V row is {w} values");
        let o = self.offset(table, pos);
        self.k.store(o, k);
        self.v.store(o, v);
    }

    /// Bytes held by this pool.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * self.dtype().size()
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
    // One task per (token, KV head): the query heads of a KV head are contiguous in a row, so a
    // task's q and out are one slice each. A decode step (one token) still has a task per KV
    // head for every thread; a head's arithmetic does not depend on the split.
    let piece = width / shape.num_kv_heads;
    out.par_chunks_mut(piece)
        .zip(q.par_chunks(piece))
        .enumerate()
        .for_each(|(j, (out_heads, q_heads))| {
            let slot = &tokens[j / shape.num_kv_heads];
            let kvh = j % shape.num_kv_heads;
            attend_kv_head(q_heads, slot, kvh, pool, shape, out_heads)
        });
}

/// One token's attention for the query heads of KV head `kvh` (`q` and `out` hold just those).
fn attend_kv_head(
    q: &[f32],
    slot: &TokenSlot,
    kvh: usize,
    pool: &KvPool,
    s: &AttentionShape,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            unsafe { attend_kv_head_avx512(q, slot, kvh, pool, s, out) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { attend_kv_head_avx2(q, slot, kvh, pool, s, out) };
            return;
        }
    }
    attend_kv_head_generic(q, slot, kvh, pool, s, out)
}

/// The same code as [`attend_kv_head_generic`], compiled with AVX2 so the lane loops vectorise
/// wider. Results are bitwise identical: no contraction or reassociation is enabled.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_kv_head_avx2(
    q: &[f32],
    slot: &TokenSlot,
    kvh: usize,
    pool: &KvPool,
    s: &AttentionShape,
    out: &mut [f32],
) {
    attend_kv_head_generic(q, slot, kvh, pool, s, out)
}

/// The same again with AVX-512: a lane array of 16 f32 is one register, so a block of 8 heads'
/// accumulators fits the register file. Bitwise identical to the others.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_kv_head_avx512(
    q: &[f32],
    slot: &TokenSlot,
    kvh: usize,
    pool: &KvPool,
    s: &AttentionShape,
    out: &mut [f32],
) {
    attend_kv_head_generic(q, slot, kvh, pool, s, out)
}

/// Positions ahead of the one being read whose K (or V) row is prefetched: a KV head's rows lie
/// a whole position's K/V apart (2 KB at 4 heads of 128 f32), which the hardware prefetchers
/// follow late.
const PREFETCH_ROWS: usize = 16;

/// Output columns per pass of the P·V accumulation (one lane array).
const PV_COLS: usize = LANES;

/// One token's attention for the query heads of one KV head, taken together: each K and V row of
/// the token's visible positions is read once for the whole group (GQA groups are 4-8 heads in
/// the supported families).
/// Heads go in blocks of up to 8 (the largest power of two dividing the group) whose per-head
/// accumulators stay in registers across the positions: a score is [`dot`]'s lane sums and tree,
/// an output element the sum over positions in order of `weight * v` (as [`axpy`] adds it), so
/// the arithmetic per head is the one-head-at-a-time loop's and the results are bitwise the same.
#[inline(always)]
fn attend_kv_head_generic(
    q: &[f32],
    slot: &TokenSlot,
    kvh: usize,
    pool: &KvPool,
    s: &AttentionShape,
    out: &mut [f32],
) {
    match (&pool.k, &pool.v) {
        (KvValues::F32(k), KvValues::F32(v)) => {
            attend_kv_head_of(q, slot, kvh, pool, &k[..], &v[..], s, out)
        }
        (KvValues::Bf16(k), KvValues::Bf16(v)) => {
            attend_kv_head_of(q, slot, kvh, pool, &k[..], &v[..], s, out)
        }
        _ => unreachable!("a pool's K and V share their dtype"),
    }
}

/// [`attend_kv_head_generic`] over K and V stored as `R`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_kv_head_of<R: KvRead + ?Sized>(
    q: &[f32],
    slot: &TokenSlot,
    kvh: usize,
    pool: &KvPool,
    k: &R,
    v: &R,
    s: &AttentionShape,
    out: &mut [f32],
) {
    let group = s.num_heads / s.num_kv_heads;
    match group {
        g if g % 8 == 0 => attend_kv_head_blocks::<8, R>(q, slot, kvh, pool, k, v, s, out),
        g if g % 4 == 0 => attend_kv_head_blocks::<4, R>(q, slot, kvh, pool, k, v, s, out),
        g if g % 2 == 0 => attend_kv_head_blocks::<2, R>(q, slot, kvh, pool, k, v, s, out),
        _ => attend_kv_head_blocks::<1, R>(q, slot, kvh, pool, k, v, s, out),
    }
}

/// [`attend_kv_head_generic`] with heads in blocks of `HB` (which divides the group).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_kv_head_blocks<const HB: usize, R: KvRead + ?Sized>(
    q: &[f32],
    slot: &TokenSlot,
    kvh: usize,
    pool: &KvPool,
    k: &R,
    v: &R,
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
    // scores[g * n + i]: head g of the group, position lo + i; then the softmax weights.
    let mut scores = vec![0.0f32; group * n];
    let mut buf = R::scratch();
    for b0 in (0..group).step_by(HB) {
        let qs: [&[f32]; HB] = std::array::from_fn(|g| &q[(b0 + g) * d..][..d]);
        for (i, &row) in rows.iter().enumerate() {
            if let Some(&ahead) = rows.get(i + PREFETCH_ROWS) {
                k.prefetch(ahead + kvh * d, d);
            }
            let dots = dot_heads(&qs, k.read(row + kvh * d, d, &mut buf));
            for (g, dg) in dots.iter().enumerate() {
                scores[(b0 + g) * n + i] = dg * s.scale;
            }
        }
    }
    for head_scores in scores.chunks_exact_mut(n) {
        let max = head_scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0f32;
        for score in head_scores.iter_mut() {
            *score = (*score - max).exp();
            sum += *score;
        }
        let inv = 1.0 / sum;
        for score in head_scores.iter_mut() {
            *score *= inv;
        }
    }
    let group_out = &mut out[..group * d];
    for b0 in (0..group).step_by(HB) {
        for c0 in (0..d).step_by(PV_COLS) {
            let cols = PV_COLS.min(d - c0);
            let mut acc = [[0.0f32; PV_COLS]; HB];
            for (i, &row) in rows.iter().enumerate() {
                if let Some(&ahead) = rows.get(i + PREFETCH_ROWS) {
                    v.prefetch(ahead + kvh * d + c0, cols);
                }
                let src = v.read(row + kvh * d + c0, cols, &mut buf);
                // A whole lane array is read in place (a copy through the stack stalls on
                // store forwarding); only a head_dim that is not a multiple of 16 pads.
                let mut padded = [0.0f32; PV_COLS];
                let v: &[f32; PV_COLS] = match src.try_into() {
                    Ok(whole) => whole,
                    Err(_) => {
                        padded[..cols].copy_from_slice(src);
                        &padded
                    }
                };
                for (g, a) in acc.iter_mut().enumerate() {
                    let w = scores[(b0 + g) * n + i];
                    for l in 0..PV_COLS {
                        a[l] += w * v[l];
                    }
                }
            }
            for (g, a) in acc.iter().enumerate() {
                group_out[(b0 + g) * d + c0..][..cols].copy_from_slice(&a[..cols]);
            }
        }
    }
}

/// `dot(q[g], k)` for every head of a block at once, each with [`dot`]'s own lane sums and
/// reduction tree (so each equals `dot(q[g], k)` bit for bit); `k` is read once for all.
#[inline(always)]
fn dot_heads<const HB: usize>(q: &[&[f32]; HB], k: &[f32]) -> [f32; HB] {
    let mut acc = [[0.0f32; LANES]; HB];
    let chunks = k.len() / LANES;
    for c in 0..chunks {
        let kc = &k[c * LANES..][..LANES];
        for (g, a) in acc.iter_mut().enumerate() {
            let qc = &q[g][c * LANES..][..LANES];
            for l in 0..LANES {
                a[l] += qc[l] * kc[l];
            }
        }
    }
    for i in chunks * LANES..k.len() {
        for (g, a) in acc.iter_mut().enumerate() {
            a[i % LANES] += q[g][i] * k[i];
        }
    }
    acc.map(reduce_lanes)
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

    /// A bf16 pool is an f32 pool of the bf16-rounded values: the same outputs bit for bit (GQA
    /// group of 8 with head_dim 80, which pads the last lane array of V; two tokens, a window),
    /// in half the bytes; values round to nearest even when written.
    #[test]
    fn a_bf16_pool_is_an_f32_pool_of_rounded_values_bit_for_bit() {
        let (bs, d, kvh, heads) = (4, 80, 2, 16);
        let table = [3u32, 0, 6, 1];
        let val = |p: usize, j: usize, salt: f32| ((p * 131 + j * 17) as f32 * salt).sin() * 3.0;
        let round = |x: f32| bf16::from_f32(x).to_f32();
        let mut half = KvPool::with_dtype(8, bs, kvh, d, DType::BF16);
        let mut rounded = KvPool::new(8, bs, kvh, d);
        let mut exact = KvPool::new(8, bs, kvh, d);
        assert_eq!(half.dtype(), DType::BF16);
        assert_eq!(2 * half.bytes(), rounded.bytes());
        for p in 0..14 {
            let k: Vec<f32> = (0..kvh * d).map(|j| val(p, j, 0.011)).collect();
            let v: Vec<f32> = (0..kvh * d).map(|j| val(p, j, 0.023)).collect();
            half.write(&table, p, &k, &v);
            let (kr, vr): (Vec<f32>, Vec<f32>) = (
                k.iter().map(|&x| round(x)).collect(),
                v.iter().map(|&x| round(x)).collect(),
            );
            rounded.write(&table, p, &kr, &vr);
            exact.write(&table, p, &k, &v);
        }
        let q: Vec<f32> = (0..2 * heads * d)
            .map(|j| (j as f32 * 0.37).cos())
            .collect();
        for window in [None, Some(5)] {
            let shape = AttentionShape {
                num_heads: heads,
                num_kv_heads: kvh,
                head_dim: d,
                scale: 0.1,
                sliding_window: window,
            };
            let slots = [
                TokenSlot {
                    block_table: &table,
                    position: 13,
                },
                TokenSlot {
                    block_table: &table,
                    position: 6,
                },
            ];
            let run = |pool: &KvPool| {
                let mut out = vec![0.0; q.len()];
                paged_attention(&q, &slots, pool, &shape, &mut out);
                out
            };
            let (h, r, e) = (run(&half), run(&rounded), run(&exact));
            assert_eq!(h, r, "window {window:?}");
            // Rounding K and V to bf16 moves the output, but by bf16's rounding only.
            let diff = h
                .iter()
                .zip(&e)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(diff > 0.0 && diff < 2e-2, "window {window:?}: {diff}");
        }
    }
}
