//! Matrix products against stored weights: `out = x · wᵀ` with f32 activations, weights kept in
//! their stored dtype (f32, bf16, f16) and widened in registers, f32 accumulation.
//!
//! This module decides the work split; the arithmetic lives in [`crate::simd`]. Small batches
//! (decode) take the streaming GEMV path, which reads every weight byte once and is bound by
//! memory bandwidth; larger batches (prefill) take the packed GEMM path, which widens each block
//! of weight rows once and reuses it for all rows of `x`. Work is split over output features
//! (weight rows) across rayon's current pool.
//!
//! Results are *batch invariant*: `out[i, j]` depends only on `x[i, ..]`, `w[j, ..]` and the SIMD
//! path, never on `m`, on the other rows of `x`, on the path chosen for the batch, or on the
//! thread count, because every driver sums each dot product in the same order (see
//! [`crate::simd::kernels`]). Batched and one-at-a-time decoding therefore agree bit for bit.

use moerun_core::MatRef;
use rayon::prelude::*;

use crate::simd::{self, Isa, Mode};

/// Batches up to this many rows stream the weights (each tile covers all of them, so weights are
/// read once); larger ones pack weight panels, whose widening cost is then shared by enough rows.
const STREAM_MAX_M: usize = 4;

/// Weight bytes a streaming task should cover at least, so rayon's per-task cost (a few
/// microseconds) stays small next to the time spent reading them.
const STREAM_MIN_TASK_BYTES: usize = 256 << 10;

/// Streaming tasks per thread: a few, so a thread slowed by something else does not hold up the
/// whole product, but not so many that the per-task overhead shows.
const STREAM_TASKS_PER_THREAD: usize = 4;

/// Weight rows per packed task: its widened panels (`rows * k * 4` bytes, 384 KiB at k = 2048)
/// stay in L2 while every tile of `x` runs against them.
const PACKED_TASK_ROWS: usize = 48;

/// Task row counts are multiples of this (a common multiple of every ISA's tile widths), so only
/// the last task of a product has a ragged row group.
const ROW_GRANULE: usize = 24;

/// `out[m, w.rows] = x[m, w.cols] · wᵀ` on the active SIMD path ([`simd::active`]), in parallel
/// over rayon's current thread pool.
///
/// Panics if `x.len() != m * w.cols`, `out.len() != m * w.rows`, or `w.data` has the wrong size.
pub fn matmul_t(x: &[f32], m: usize, w: MatRef<'_>, out: &mut [f32]) {
    matmul_t_isa(simd::active(), x, m, w, out);
}

/// [`matmul_t`] on an explicit SIMD path (tests use it to cover every path the CPU supports).
///
/// Panics if the CPU does not support `isa`, or on the length mismatches [`matmul_t`] rejects.
pub fn matmul_t_isa(isa: Isa, x: &[f32], m: usize, w: MatRef<'_>, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert!(isa.is_supported(), "SIMD path {isa} is not supported here");
    assert_eq!(x.len(), m * k, "x must hold m * w.cols values");
    assert_eq!(out.len(), m * n, "out must hold m * w.rows values");
    assert_eq!(w.data.len(), n * k * w.dtype.size(), "w.data size");
    if m == 0 || n == 0 {
        return;
    }
    let mode = if m <= STREAM_MAX_M {
        Mode::Stream
    } else {
        Mode::Packed
    };
    let rows = task_rows(mode, n, k * w.dtype.size());
    if m == 1 {
        // For one row, out and its transpose are the same buffer.
        run_tasks(isa, mode, x, m, w, out, rows);
    } else {
        // The kernels write `out_t[j * m + i]` so that each task owns one contiguous slice
        // (its weight rows); transposing afterwards costs m * n moves, nothing next to the
        // m * n * k multiply-adds.
        let mut out_t = vec![0.0; m * n];
        run_tasks(isa, mode, x, m, w, &mut out_t, rows);
        for (j, col) in out_t.chunks_exact(m).enumerate() {
            for (i, &v) in col.iter().enumerate() {
                out[i * n + j] = v;
            }
        }
    }
}

/// Weight rows per task for an `n`-row matrix whose rows are `row_bytes` long.
fn task_rows(mode: Mode, n: usize, row_bytes: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let rows = match mode {
        Mode::Stream => {
            let by_balance = n.div_ceil(threads * knob("TPT", STREAM_TASKS_PER_THREAD));
            let by_overhead = knob("MINB", STREAM_MIN_TASK_BYTES).div_ceil(row_bytes.max(1));
            by_balance.max(by_overhead)
        }
        // Fewer rows than the panel target when that is what it takes to give every thread
        // some work.
        Mode::Packed => PACKED_TASK_ROWS.min(n.div_ceil(threads)),
    };
    rows.div_ceil(ROW_GRANULE) * ROW_GRANULE
}

/// Run the product in tasks of `rows` weight rows, each writing its own slice of `out_t`.
fn run_tasks(
    isa: Isa,
    mode: Mode,
    x: &[f32],
    m: usize,
    w: MatRef<'_>,
    out_t: &mut [f32],
    rows: usize,
) {
    if rows >= w.rows {
        simd::matmul_t_block(isa, mode, x, m, w, out_t);
        return;
    }
    out_t
        .par_chunks_mut(rows * m)
        .enumerate()
        .for_each(|(t, out_t)| {
            let block = w.rows_range(t * rows, out_t.len() / m);
            simd::matmul_t_block(isa, mode, x, m, block, out_t);
        });
}

// TEMP knob
pub(crate) fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
