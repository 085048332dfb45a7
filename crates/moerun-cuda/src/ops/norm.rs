//! RMSNorm over rows (`kernels/norm.cu`), the same formula as `moerun_cpu::ops::rms_norm_rows`.
//!
//! Launch: block (32, 4), grid ceil(rows / 4): one warp per row, lanes stride over the row, one
//! warp reduction for the sum of squares.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{blocks, to_i32};
use crate::error::{ensure, DriverContext, Result};
use crate::CudaDevice;

const ROWS_PER_BLOCK: usize = 4;
/// Rows at least this wide get a block each instead of a warp.
const WIDE_ROW: usize = 512;

impl CudaDevice {
    /// `out[r, :] = weight * (x[r, :] / sqrt(mean(x[r, :]²) + eps))` for every `weight.len()`-wide
    /// row of `x`.
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let len = x.len();
        ensure(out.len() == len, || {
            format!("rms_norm: out holds {}, x {len}", out.len())
        })?;
        let x = self.ptr(x, "rms_norm x")?;
        let out = self.ptr_mut(out, "rms_norm out")?;
        self.launch_rms_norm(x, out, len, weight, eps)
    }

    /// [`CudaDevice::rms_norm`] in place.
    pub fn rms_norm_in_place(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
    ) -> Result<()> {
        let len = x.len();
        let p = self.ptr_mut(x, "rms_norm x")?;
        self.launch_rms_norm(p, p, len, weight, eps)
    }

    fn launch_rms_norm(
        &self,
        x: u64,
        out: u64,
        len: usize,
        weight: &impl DevicePtr<f32>,
        eps: f32,
    ) -> Result<()> {
        let width = weight.len();
        ensure(width > 0 && len.is_multiple_of(width), || {
            format!("rms_norm: {len} values are not rows of the weight's width {width}")
        })?;
        let rows = len / width;
        if rows == 0 {
            return Ok(());
        }
        let w = self.ptr(weight, "rms_norm weight")?;
        if width >= WIDE_ROW {
            // A block per row: one warp walking a hidden-size row is latency bound.
            let width_i = to_i32(width, "width")?;
            let cfg = LaunchConfig {
                grid_dim: (blocks(rows, 1)?, 1, 1),
                block_dim: (crate::ops::fused::ROW_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self
                .stream
                .launch_builder(&self.kernels.fused.rms_norm_block);
            b.arg(&x).arg(&w).arg(&out).arg(&width_i).arg(&eps);
            // SAFETY: as below; the block kernel takes one row per block.
            unsafe { b.launch(cfg) }.ctx("rms_norm_block_f32")?;
            return Ok(());
        }
        let (rows_i, width_i) = (to_i32(rows, "rows")?, to_i32(width, "width")?);
        let cfg = LaunchConfig {
            grid_dim: (blocks(rows, ROWS_PER_BLOCK)?, 1, 1),
            block_dim: (32, ROWS_PER_BLOCK as u32, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.kernels.rms_norm);
        b.arg(&x)
            .arg(&w)
            .arg(&out)
            .arg(&rows_i)
            .arg(&width_i)
            .arg(&eps);
        // SAFETY: x and out hold rows * width f32 (checked above, same buffer when in place,
        // which the kernel allows), weight holds width; the argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("rms_norm_f32")?;
        Ok(())
    }
}
