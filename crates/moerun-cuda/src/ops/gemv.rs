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
//! A batch of m rows runs as launches of 8, 4, 2 and 1 rows (m = 3 is a 2-row and a 1-row
//! launch), each reading the weights once. Each output is summed in an order fixed by k and the
//! layout, never by m or the other rows, so GEMV results are batch invariant among themselves (but
//! not bit-equal to the CPU's or to the cuBLAS GEMM's).
//!
//! [`CudaDevice::gemv_add_norm`] is one token's GEMV with the residual add and RMSNorm before it
//! folded in (block per rows; the norm's scale applied after the sums): a decode step's q/k/v
//! projection without the add+norm launch before it.

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
}

impl GemvLayout {
    /// The layout [`CudaDevice::gemv`] uses: the faster of the two on every shape measured
    /// (docs/perf/cuda-ops.md).
    pub const DEFAULT: GemvLayout = GemvLayout::BlockPerRows;

    /// Weight rows per block.
    fn rows_per_block(self) -> usize {
        match self {
            GemvLayout::WarpPerRow => 8,
            GemvLayout::BlockPerRows => 4,
        }
    }

    /// Index of the layout's kernels in the device's table.
    fn slot(self) -> usize {
        match self {
            GemvLayout::WarpPerRow => 0,
            GemvLayout::BlockPerRows => 1,
        }
    }
}

/// The GEMV kernels stream rows in 16-byte chunks: `w`'s rows must be whole chunks (`op` names
/// the caller in the refusal).
fn whole_chunks(op: &str, w: &DeviceMatrix) -> Result<()> {
    let (k, per_chunk) = (w.cols(), 16 / w.dtype().size());
    ensure(k.is_multiple_of(per_chunk), || {
        format!(
            "{op}: k = {k} must be a multiple of {per_chunk} for {} weights",
            w.dtype()
        )
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
        self.gemv_with(GemvLayout::DEFAULT, x, m, w, out)
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
        whole_chunks("gemv", w)?;
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

impl CudaDevice {
    /// Whether a forward pass should fold one token's add+norm into the GEMV after it
    /// ([`CudaDevice::gemv_add_norm`]): yes, but for `MOERUN_CUDA_NORM_QKV=0` (a measuring
    /// knob).
    pub fn gemv_add_norm_wanted(&self) -> bool {
        static OFF: OnceLock<bool> = OnceLock::new();
        !*OFF.get_or_init(|| std::env::var_os("MOERUN_CUDA_NORM_QKV").is_some_and(|v| v == "0"))
    }

    /// One token's [`CudaDevice::add_rms_norm`] then [`CudaDevice::gemv`] in one launch
    /// (`gemv_rows_norm_<dt>`): `x_out = x + r` and `out = w · (norm ⊙ s / sqrt(mean(s²) +
    /// eps))` with `s = x + r`. The norm's scale comes out of the sums (each block squares the
    /// values it reads anyway), so `out` differs from the two launches' by a few ulp and `x_out`
    /// not at all. `x`, `r`, `norm` and `x_out` hold `w.cols()` values, `out` `w.rows()`.
    /// Under programmatic launch `x` and `norm` are read before the kernel waits: no kernel right
    /// before it may write them (graph::EARLY_ACTIVATION_READERS).
    /// The grid is [`AddNormGrid::Auto`]'s.
    pub fn gemv_add_norm(
        &self,
        args: (
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
            f32,
        ),
        w: &DeviceMatrix,
        x_out: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.gemv_add_norm_in(AddNormGrid::Auto, args, w, x_out, out)
    }

    /// [`CudaDevice::gemv_add_norm`] in an explicit grid (tests compare them; the bits are the
    /// same). [`AddNormGrid::Strided`] on rows it cannot take is refused by name.
    pub fn gemv_add_norm_in(
        &self,
        grid: AddNormGrid,
        (x, r, norm, eps): (
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
            f32,
        ),
        w: &DeviceMatrix,
        x_out: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (n, k) = (w.rows(), w.cols());
        ensure(
            x.len() == k && r.len() == k && norm.len() == k && x_out.len() == k,
            || {
                format!(
                    "gemv_add_norm: x {}, r {}, norm {}, x_out {} for a matrix of {k} columns",
                    x.len(),
                    r.len(),
                    norm.len(),
                    x_out.len()
                )
            },
        )?;
        ensure(out.len() == n, || {
            format!(
                "gemv_add_norm: out holds {}, the matrix has {n} rows",
                out.len()
            )
        })?;
        whole_chunks("gemv_add_norm", w)?;
        if n == 0 || k == 0 {
            return Ok(());
        }
        let wp = w.device_ptr(self, "gemv_add_norm w")?;
        let xp = self.ptr(x, "gemv_add_norm x")?;
        let rp = self.ptr(r, "gemv_add_norm r")?;
        let np = self.ptr(norm, "gemv_add_norm norm")?;
        let xo = self.ptr_mut(x_out, "gemv_add_norm x_out")?;
        let op = self.ptr_mut(out, "gemv_add_norm out")?;
        ensure(
            [wp, xp, rp, np, xo].iter().all(|p| p.is_multiple_of(16)),
            || "gemv_add_norm: w, x, r, norm and x_out must start 16-byte aligned".to_string(),
        )?;
        let (n_i, k_i) = (to_i32(n, "n")?, to_i32(k, "k")?);
        let groups = blocks(n, GemvLayout::BlockPerRows.rows_per_block())?;
        let fits = AddNormGrid::strided_fits(w);
        let strided = match grid {
            AddNormGrid::Auto => fits && n <= strided_rows_bound(),
            AddNormGrid::PerGroup => false,
            AddNormGrid::Strided => {
                ensure(fits, || {
                    format!(
                        "gemv_add_norm: the strided grid takes rows of {STRIDED_CHUNKS} chunks \
                         (one a thread), not {k} {} values",
                        w.dtype()
                    )
                })?;
                true
            }
        };
        let (grid_x, func, name) = if strided {
            let wave = STRIDED_BLOCKS_PER_SM * self.info().multiprocessors;
            (
                groups.min(wave.max(1)),
                &self.kernels.gemv_rows_norm_strided[dtype_slot(w.dtype())],
                "gemv_rows_norm_strided",
            )
        } else {
            (
                groups,
                &self.kernels.gemv_rows_norm[dtype_slot(w.dtype())],
                "gemv_rows_norm",
            )
        };
        let cfg = LaunchConfig {
            grid_dim: (grid_x, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        if crate::skip::gemv_skipped(n) {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(func);
        b.arg(&wp)
            .arg(&xp)
            .arg(&rp)
            .arg(&np)
            .arg(&eps)
            .arg(&xo)
            .arg(&op);
        b.arg(&n_i).arg(&k_i);
        // SAFETY: w holds n * k elements of the kernel's dtype with k a multiple of the 16-byte
        // chunk (for the strided kernel exactly 256 chunks, checked above); x, r, norm and
        // x_out hold k f32 each, out n (checked above), all vectors 16-byte aligned; the grid
        // covers n rows at 4 a block, or the strided kernel's blocks stride over all of them.
        unsafe { b.launch(cfg) }.ctx(name)?;
        Ok(())
    }
}

/// The grid of [`CudaDevice::gemv_add_norm_in`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddNormGrid {
    /// `Strided` where the rows allow it (unless `MOERUN_CUDA_STRIDED_ROWS` bounds the rows it
    /// takes), else `PerGroup`.
    Auto,
    /// `gemv_rows_norm_<dt>`: a block per 4 rows.
    PerGroup,
    /// `gemv_rows_norm_strided_<dt>`: one wave of at most 4 blocks an SM, each striding over
    /// the 4-row groups with two groups' weights in flight a thread (kernels/gemv.cu). Rows of
    /// exactly 256 16-byte chunks (2,048 bf16/f16 values, 1,024 f32): a decode q/k/v projection
    /// of Qwen3-30B-A3B's and Qwen3.5's hidden size.
    Strided,
}

/// Chunks a row the strided kernel takes: one a thread of its 256.
const STRIDED_CHUNKS: usize = 256;
/// Blocks an SM of the strided kernel (its `__launch_bounds__`), so the grid is one wave.
const STRIDED_BLOCKS_PER_SM: u32 = 4;

impl AddNormGrid {
    /// Whether `w`'s rows are the strided kernel's.
    fn strided_fits(w: &DeviceMatrix) -> bool {
        w.cols() * w.dtype().size() == STRIDED_CHUNKS * 16
    }
}

/// The most rows [`AddNormGrid::Auto`] takes strided: any number (the LM head's too: batch-1
/// decode +0.9% with the q/k/v projections strided, +1.1% with the LM head as well; H200,
/// docs/perf/cuda-model.md v24), unless `MOERUN_CUDA_STRIDED_ROWS=N` bounds it (0: never), a
/// measuring knob.
fn strided_rows_bound() -> usize {
    static BOUND: OnceLock<usize> = OnceLock::new();
    *BOUND.get_or_init(|| {
        std::env::var("MOERUN_CUDA_STRIDED_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(usize::MAX)
    })
}
