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
//! - [`GemvLayout::Staged`] (sm_90, one row of x): grid at most one block per SM, each block's
//!   whole slice of weight rows handed to the bulk copy engine before the kernel waits for the
//!   one before it, so under programmatic dependent launch the weights stream into shared memory
//!   during that kernel (the decode attention before o_proj, the norms before q/k/v and the
//!   router) instead of after it. It computes exactly as `BlockPerRows` does, so the bits are the
//!   same; [`CudaDevice::gemv`] takes it for every batch of one row where the slice fits.
//!
//! A batch of m rows runs as launches of 8, 4, 2 and 1 rows (m = 3 is a 2-row and a 1-row
//! launch), each reading the weights once. Each output is summed in an order fixed by k and the
//! layout, never by m or the other rows, so GEMV results are batch invariant among themselves (but
//! not bit-equal to the CPU's or to the cuBLAS GEMM's).

use std::sync::OnceLock;

use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{blocks, to_i32};
use crate::device::{dtype_slot, GEMV_ROWS};
use crate::error::{ensure, CudaError, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix};

/// How the GEMV kernel maps weight rows to threads (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvLayout {
    WarpPerRow,
    BlockPerRows,
    Staged,
}

impl GemvLayout {
    /// The layout [`CudaDevice::gemv`] uses where [`GemvLayout::Staged`] does not apply: the
    /// faster of the other two on every shape measured (docs/perf/cuda-ops.md).
    pub const DEFAULT: GemvLayout = GemvLayout::BlockPerRows;

    /// Weight rows per block of the streaming layouts.
    fn rows_per_block(self) -> usize {
        match self {
            GemvLayout::WarpPerRow => 8,
            GemvLayout::BlockPerRows | GemvLayout::Staged => 4,
        }
    }

    /// Index of the layout's kernels in the device's table.
    fn slot(self) -> usize {
        match self {
            GemvLayout::WarpPerRow => 0,
            GemvLayout::BlockPerRows | GemvLayout::Staged => 1,
        }
    }
}

/// Most dynamic shared memory one staged GEMV block takes. Its point is to be resident beside
/// the kernel it waits behind (a decode attention block takes ~20 KiB, a norm none), inside the
/// SM's 228 KiB.
pub(crate) const STAGED_SMEM_MAX: usize = 192 << 10;

/// Groups of 4 rows a staged block may hold (`STAGED_MAX_GROUPS` in gemv.cu: one mbarrier each).
const STAGED_MAX_GROUPS: usize = 64;

/// `f` opted in to [`STAGED_SMEM_MAX`] bytes of dynamic shared memory, or `None` where the device
/// does not allow that much (then the staged layout never runs there).
pub(crate) fn staged_gemv_kernel(f: CudaFunction) -> Option<CudaFunction> {
    super::with_dynamic_smem(f, STAGED_SMEM_MAX)
}

/// Rows per block and dynamic shared memory of a staged GEMV over `n` rows of `row_bytes`, in at
/// most `blocks` blocks: the fewest rows (a multiple of 4) that keep the grid within them, or
/// `None` where that slice passes [`STAGED_SMEM_MAX`].
pub(crate) fn staged_plan(n: usize, row_bytes: usize, blocks: usize) -> Option<(usize, usize)> {
    let rpb = n.div_ceil(blocks.max(1)).next_multiple_of(4);
    let smem = rpb * row_bytes;
    (rpb / 4 <= STAGED_MAX_GROUPS && smem <= STAGED_SMEM_MAX).then_some((rpb, smem))
}

/// Staged blocks per SM the plan aims at (`MOERUN_CUDA_GEMV_STAGED=<n>`; 0 turns the layout off:
/// an A/B switch without a rebuild).
fn staged_blocks_per_sm() -> usize {
    static PER_SM: OnceLock<usize> = OnceLock::new();
    *PER_SM.get_or_init(|| {
        std::env::var("MOERUN_CUDA_GEMV_STAGED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
    })
}

impl CudaDevice {
    /// `out[m, w.rows()] = x[m, w.cols()] · wᵀ`, streaming the weights once per launch of up to 8
    /// rows of x, in [`GemvLayout::DEFAULT`]. Needs `w.cols()` to be a multiple of 8 (bf16/f16)
    /// or 4 (f32), true of every real model's projection.
    pub fn gemv(
        &self,
        x: &impl DevicePtr<f32>,
        m: usize,
        w: &DeviceMatrix,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let layout = if self.staged_gemv(m, w).is_some() {
            GemvLayout::Staged
        } else {
            GemvLayout::DEFAULT
        };
        self.gemv_with(layout, x, m, w, out)
    }

    /// The staged kernel and its plan for `m` rows of x against `w`, where that layout applies:
    /// one row, compute capability 9.0, and a slice per block that fits (see [`staged_plan`]).
    fn staged_gemv(&self, m: usize, w: &DeviceMatrix) -> Option<(&CudaFunction, usize, usize)> {
        let f = self.kernels.gemv_staged[dtype_slot(w.dtype())].as_ref()?;
        let per_sm = staged_blocks_per_sm();
        if m != 1 || self.info().compute_capability != (9, 0) || per_sm == 0 {
            return None;
        }
        let row_bytes = w.cols() * w.dtype().size();
        let blocks = self.info().multiprocessors as usize * per_sm;
        let (rpb, smem) = staged_plan(w.rows(), row_bytes, blocks)?;
        Some((f, rpb, smem))
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
        let wp = self.ptr(w.data(), "gemv w")?;
        let op = self.ptr_mut(out, "gemv out")?;
        ensure(xp.is_multiple_of(16) && wp.is_multiple_of(16), || {
            "gemv: x and w must start 16-byte aligned".to_string()
        })?;
        let (n_i, k_i) = (to_i32(n, "n")?, to_i32(k, "k")?);
        if layout == GemvLayout::Staged {
            let Some((f, rpb, smem)) = self.staged_gemv(m, w) else {
                return Err(CudaError::Unsupported(format!(
                    "the staged GEMV for {m} rows of x against {n} x {k} {} weights on {} \
                     (one row, sm_90, at most {} KiB of weights per SM)",
                    w.dtype(),
                    self.info().arch,
                    STAGED_SMEM_MAX >> 10
                )));
            };
            if crate::skip::gemv_skipped(n) {
                return Ok(());
            }
            let cfg = LaunchConfig {
                grid_dim: (blocks(n, rpb)?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let rpb_i = to_i32(rpb, "rows per block")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(&wp).arg(&xp).arg(&op).arg(&n_i).arg(&k_i).arg(&rpb_i);
            // SAFETY: w holds n * k elements of the kernel's dtype with k a multiple of the
            // 16-byte chunk, 16-byte aligned (checked above), so every block's bulk copies of
            // its rows (row0 .. row0 + rpb, clipped to n) stay inside w and inside the rpb rows
            // of dynamic shared memory given; x holds one row of k f32 and out n f32 (m == 1).
            unsafe { b.launch(cfg) }.ctx("gemv staged")?;
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks(n, layout.rows_per_block())?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let kernels = &self.kernels.gemv[layout.slot()][dtype_slot(w.dtype())];
        if crate::skip::gemv_skipped(n) {
            return Ok(());
        }
        let mut row = 0;
        while row < m {
            let slot = GEMV_ROWS.iter().rposition(|&r| r <= m - row).unwrap_or(0);
            let xr = xp + (row * k * 4) as u64;
            let or = op + (row * n * 4) as u64;
            let mut b = self.stream.launch_builder(&kernels[slot]);
            b.arg(&wp).arg(&xr).arg(&or).arg(&n_i).arg(&k_i);
            // SAFETY: w holds n * k elements of the kernel's dtype with k a multiple of the
            // 16-byte chunk; rows row..row + GEMV_ROWS[slot] of x (k f32 each, 16-byte aligned as
            // k is a multiple of 4) and of out (n f32 each) are in bounds since that is <= m; the
            // grid covers n rows at the layout's rows per block.
            unsafe { b.launch(cfg) }.ctx("gemv")?;
            row += GEMV_ROWS[slot];
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_plan_keeps_one_block_per_sm_and_refuses_what_does_not_fit() {
        // Qwen3-30B-A3B on an H200's 132 SMs: q/k/v 5120 rows of 2048 bf16, o_proj 2048 of 4096.
        assert_eq!(staged_plan(5120, 4096, 132), Some((40, 160 << 10)));
        assert_eq!(staged_plan(2048, 8192, 132), Some((16, 128 << 10)));
        assert_eq!(staged_plan(128, 4096, 132), Some((4, 16 << 10)));
        assert_eq!(staged_plan(1001, 4112, 132), Some((8, 8 * 4112)));
        // The lm_head (151936 rows) passes both the shared memory and the barriers.
        assert_eq!(staged_plan(151_936, 4096, 132), None);
        // 48 rows of 4 KiB would be 192 KiB (fits); 52 would not.
        assert!(staged_plan(48 * 132, 4096, 132).is_some());
        assert!(staged_plan(52 * 132, 4096, 132).is_none());
    }
}
