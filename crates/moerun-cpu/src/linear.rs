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
//! thread count, because every driver sums each dot product in the same order (see the
//! `simd::kernels` module). Batched and one-at-a-time decoding therefore agree bit for bit.
//!
//! Call it from a thread of the pool when calls are many and small: a forward pass run inside
//! `ThreadPool::install` lets each product's tasks start and finish without handing work across
//! threads and waking the caller, which costs tens of microseconds per call otherwise (on the
//! development machine a 3 MiB decode GEMV ran at 65% of read bandwidth from outside the pool and
//! at 88% from inside).

use std::cell::Cell;

use moerun_core::MatRef;
use rayon::prelude::*;

use crate::simd::{self, Isa, Mode};

/// Batches up to this many rows stream the weights: each group of weight rows is read from memory
/// once and widened in registers once per 4 rows of `x` while it sits in L1. Larger batches pack
/// weight panels, widening them once for all rows (measured crossover: between 16 and 24 rows).
const STREAM_MAX_M: usize = 16;

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
    if rows >= n {
        simd::matmul_t_block(isa, mode, x, m, w, out);
    } else if m == 1 {
        // One row: the tasks' outputs are disjoint slices of `out` itself.
        out.par_chunks_mut(rows).enumerate().for_each(|(t, out)| {
            let block = w.rows_range(t * rows, out.len());
            simd::matmul_t_block(isa, mode, x, 1, block, out);
        });
    } else {
        // Several rows: a task's outputs are a column block of `out`, not a slice of it. Each
        // task fills its own `[m, rows]` block of a scratch buffer instead, and the blocks are
        // then copied into place one contiguous row segment at a time.
        let mut blocks = BLOCKS.take();
        if blocks.len() < m * n {
            blocks = vec![0.0; m * n];
        }
        let blocks_used = &mut blocks[..m * n];
        blocks_used
            .par_chunks_mut(rows * m)
            .enumerate()
            .for_each(|(t, block_out)| {
                let block = w.rows_range(t * rows, block_out.len() / m);
                simd::matmul_t_block(isa, mode, x, m, block, block_out);
            });
        let blocks_used = &*blocks_used;
        out.par_chunks_mut(n)
            .with_min_len(SCATTER_MIN_VALUES.div_ceil(n))
            .enumerate()
            .for_each(|(i, out_row)| {
                for (t, dst) in out_row.chunks_mut(rows).enumerate() {
                    let start = t * rows * m + i * dst.len();
                    dst.copy_from_slice(&blocks_used[start..start + dst.len()]);
                }
            });
        if blocks.len() <= BLOCKS_KEEP_MAX {
            BLOCKS.set(blocks);
        }
    }
}

thread_local! {
    /// The calling thread's block buffer for multi-row products, kept so that prefill does not
    /// allocate (and fault in) a fresh `m * n` buffer on every call.
    static BLOCKS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Largest block buffer (in values, 16 MiB) kept for the next call; a rare huge product (say the
/// LM head over a whole prompt) should not pin its buffer for the life of the thread.
const BLOCKS_KEEP_MAX: usize = 4 << 20;

/// Output values per parallel copy task when scattering blocks into place.
const SCATTER_MIN_VALUES: usize = 1 << 15;

/// Weight rows per task for an `n`-row matrix whose rows are `row_bytes` long.
fn task_rows(mode: Mode, n: usize, row_bytes: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let rows = match mode {
        Mode::Stream => {
            let by_balance = n.div_ceil(threads * STREAM_TASKS_PER_THREAD);
            let by_overhead = STREAM_MIN_TASK_BYTES.div_ceil(row_bytes.max(1));
            by_balance.max(by_overhead)
        }
        // Fewer rows than the panel target when that is what it takes to give every thread
        // some work.
        Mode::Packed => PACKED_TASK_ROWS.min(n.div_ceil(threads)),
    };
    rows.div_ceil(ROW_GRANULE) * ROW_GRANULE
}
