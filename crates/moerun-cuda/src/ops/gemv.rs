//! Decode GEMV (`kernels/gemv.cu`): `out[m, n] = x[m, k] · wᵀ` for a few rows of f32 activations
//! against a weight matrix in its stored dtype (bf16, f16 or f32), f32 accumulation.
//!
//! Bound by reading the weights once. Two launch layouts, both block 256:
//! - [`GemvLayout::WarpPerRow`]: grid ceil(n / 8); one warp per weight row, each lane streaming
//!   16-byte chunks, 4 in flight, each chunk applied to up to 8 rows of x.
//! - [`GemvLayout::BlockPerRows`]: grid ceil(n / 4); one block per 4 weight rows, its 256 threads
//!   striding over the chunks of all four (8 or 4 in flight per thread), so each x chunk read from
//!   L1 serves four rows and rows of a few KiB need no serial loop; partial sums meet in shared
//!   memory.
//!
//! - [`GemvLayout::BlockPerRowsBulk`]: block per rows, but a one-row launch (batch 1) on Hopper
//!   has the TMA copy each block's rows into shared memory before the programmatic wait
//!   (`gemv_rows_bulk_<dt>_m1`, the same sums) instead of loading them into registers: the early
//!   stream then leaves the load/store pipeline of the SMs it shares with the kernel before it
//!   free. `MOERUN_CUDA_GEMV_BULK=1` makes it [`CudaDevice::gemv`]'s layout (an experiment until
//!   measured: docs/perf/cuda-model.md v18).
//!
//! A batch of m rows runs as launches of 8, 4, 2 and 1 rows (m = 3 is a 2-row and a 1-row
//! launch), each reading the weights once. Each output is summed in an order fixed by k and the
//! layout, never by m or the other rows, so GEMV results are batch invariant among themselves (but
//! not bit-equal to the CPU's or to the cuBLAS GEMM's).

use std::sync::OnceLock;

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{blocks, to_i32};
use crate::device::{dtype_slot, GEMV_ROWS};
use crate::error::{ensure, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix};

/// How the GEMV kernel maps weight rows to threads (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvLayout {
    WarpPerRow,
    BlockPerRows,
    BlockPerRowsBulk,
}

/// The most dynamic shared memory a bulk GEMV block takes (4 rows of k elements): the limit a
/// kernel gets without opting in to more. Longer rows run `gemv_rows` (the same sums).
const BULK_MAX_BYTES: usize = 48 * 1024;

impl GemvLayout {
    /// The layout [`CudaDevice::gemv`] uses: block per rows, the faster of the first two on every
    /// shape measured (docs/perf/cuda-ops.md); its bulk variant with `MOERUN_CUDA_GEMV_BULK=1`.
    pub fn preferred() -> GemvLayout {
        static BULK: OnceLock<bool> = OnceLock::new();
        if *BULK.get_or_init(|| std::env::var_os("MOERUN_CUDA_GEMV_BULK").is_some_and(|v| v == "1"))
        {
            GemvLayout::BlockPerRowsBulk
        } else {
            GemvLayout::BlockPerRows
        }
    }

    /// Weight rows per block.
    fn rows_per_block(self) -> usize {
        match self {
            GemvLayout::WarpPerRow => 8,
            GemvLayout::BlockPerRows | GemvLayout::BlockPerRowsBulk => 4,
        }
    }

    /// Index of the layout's kernels in the device's table (the bulk layout's launches of more
    /// than one row are block per rows').
    fn slot(self) -> usize {
        match self {
            GemvLayout::WarpPerRow => 0,
            GemvLayout::BlockPerRows | GemvLayout::BlockPerRowsBulk => 1,
        }
    }
}

impl CudaDevice {
    /// `out[m, w.rows()] = x[m, w.cols()] · wᵀ`, streaming the weights once per launch of up to 8
    /// rows of x, in [`GemvLayout::preferred`]. Needs `w.cols()` to be a multiple of 8 (bf16/f16)
    /// or 4 (f32), true of every real model's projection.
    pub fn gemv(
        &self,
        x: &impl DevicePtr<f32>,
        m: usize,
        w: &DeviceMatrix,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.gemv_with(GemvLayout::preferred(), x, m, w, out)
    }

    /// [`CudaDevice::gemv`] in an explicit layout (tests and the bench cover both).
    pub fn gemv_with(
        &self,
        layout: GemvLayout,
        x: &impl DevicePtr<f32>,
        m: usize,
        w: &DeviceMatrix,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (n, k) = super::gemm::gemm_shapes("gemv", x.len(), m, w, out.len())?;
        let per_chunk = 16 / w.dtype().size();
        ensure(k.is_multiple_of(per_chunk), || {
            format!(
                "gemv: k = {k} must be a multiple of {per_chunk} for {} weights",
                w.dtype()
            )
        })?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let xp = self.ptr(x, "gemv x")?;
        let wp = w.device_ptr(self, "gemv w")?;
        let op = self.ptr_mut(out, "gemv out")?;
        ensure(xp.is_multiple_of(16) && wp.is_multiple_of(16), || {
            "gemv: x and w must start 16-byte aligned".to_string()
        })?;
        let (n_i, k_i) = (to_i32(n, "n")?, to_i32(k, "k")?);
        let cfg = LaunchConfig {
            grid_dim: (blocks(n, layout.rows_per_block())?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let kernels = &self.kernels.gemv[layout.slot()][dtype_slot(w.dtype())];
        // The bulk kernel's block copies its rows, rows_per_block * k elements, into shared
        // memory; it is built for sm_90 only (kernels/gemv.cu).
        let bulk_bytes = layout.rows_per_block() * k * w.dtype().size();
        let bulk = (layout == GemvLayout::BlockPerRowsBulk
            && self.info().compute_capability.0 >= 9
            && bulk_bytes <= BULK_MAX_BYTES)
            .then(|| &self.kernels.gemv_bulk[dtype_slot(w.dtype())]);
        if crate::skip::gemv_skipped(n) {
            return Ok(());
        }
        let mut row = 0;
        while row < m {
            let slot = GEMV_ROWS.iter().rposition(|&r| r <= m - row).unwrap_or(0);
            let xr = xp + (row * k * 4) as u64;
            let or = op + (row * n * 4) as u64;
            let (kernel, cfg) = match bulk {
                Some(f) if GEMV_ROWS[slot] == 1 => (
                    f,
                    LaunchConfig {
                        shared_mem_bytes: bulk_bytes as u32,
                        ..cfg
                    },
                ),
                _ => (&kernels[slot], cfg),
            };
            let mut b = self.stream.launch_builder(kernel);
            b.arg(&wp).arg(&xr).arg(&or).arg(&n_i).arg(&k_i);
            // SAFETY: w holds n * k elements of the kernel's dtype with k a multiple of the
            // 16-byte chunk; rows row..row + GEMV_ROWS[slot] of x (k f32 each, 16-byte aligned as
            // k is a multiple of 4) and of out (n f32 each) are in bounds since that is <= m; the
            // grid covers n rows at the layout's rows per block; the bulk kernel gets the shared
            // memory for its block's rows (it copies only the rows < n).
            unsafe { b.launch(cfg) }.ctx("gemv")?;
            row += GEMV_ROWS[slot];
        }
        Ok(())
    }
}
