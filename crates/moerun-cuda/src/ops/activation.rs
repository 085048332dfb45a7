//! Elementwise kernels: SwiGLU's `silu(gate) * up` (`kernels/activation.cu`) and the f32 -> bf16
//! conversion of activations for the bf16 GEMM (`kernels/convert.cu`).
//!
//! Launch (both): 1-D grid-stride loop, block 256, grid ceil(n / 256) capped at 32 blocks per SM.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::elementwise_grid;
use crate::error::{ensure, DriverContext, Result};
use crate::CudaDevice;

impl CudaDevice {
    /// The launch of a 1-D grid-stride elementwise kernel of 256 threads over `n` values.
    pub(crate) fn elementwise_cfg(&self, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (elementwise_grid(n, self.info().multiprocessors), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `gate[i] = silu(gate[i]) * up[i]`, with `silu(x) = x / (1 + exp(-x))`.
    pub fn silu_mul(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        up: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let n = gate.len();
        ensure(up.len() == n, || {
            format!("silu_mul: gate holds {n}, up {}", up.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let g = self.ptr_mut(gate, "silu_mul gate")?;
        let u = self.ptr(up, "silu_mul up")?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.silu_mul);
        b.arg(&g).arg(&u).arg(&n64);
        // SAFETY: gate and up both hold n f32; the argument list matches the kernel's.
        unsafe { b.launch(self.elementwise_cfg(n)) }.ctx("silu_mul_f32")?;
        Ok(())
    }

    /// Round f32 values to bf16 (nearest even), as bit patterns.
    pub fn to_bf16(&self, x: &impl DevicePtr<f32>, out: &mut impl DevicePtrMut<u16>) -> Result<()> {
        let n = x.len();
        ensure(out.len() == n, || {
            format!("to_bf16: x holds {n}, out {}", out.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let xp = self.ptr(x, "to_bf16 x")?;
        let o = self.ptr_mut(out, "to_bf16 out")?;
        // SAFETY: x holds n f32 and out n u16 (checked above).
        unsafe { self.to_bf16_at(xp, o, n) }
    }

    /// [`CudaDevice::to_bf16`] of `n` values at raw device addresses.
    ///
    /// # Safety
    /// `x` must address `n` f32 and `out` `n` u16 of live device memory of this device.
    pub(crate) unsafe fn to_bf16_at(&self, x: u64, out: u64, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.f32_to_bf16);
        b.arg(&x).arg(&out).arg(&n64);
        // SAFETY: the caller vouches for the n values at x and out; the arguments match.
        unsafe { b.launch(self.elementwise_cfg(n)) }.ctx("f32_to_bf16")?;
        Ok(())
    }

    /// `x` as two bf16 halves: `hi = bf16(x)`, `lo = bf16(x - hi)` (round to nearest even each).
    pub fn to_bf16_split(
        &self,
        x: &impl DevicePtr<f32>,
        hi: &mut impl DevicePtrMut<u16>,
        lo: &mut impl DevicePtrMut<u16>,
    ) -> Result<()> {
        let n = x.len();
        ensure(hi.len() == n && lo.len() == n, || {
            format!(
                "to_bf16_split: x holds {n}, hi {}, lo {}",
                hi.len(),
                lo.len()
            )
        })?;
        if n == 0 {
            return Ok(());
        }
        let xp = self.ptr(x, "to_bf16_split x")?;
        let h = self.ptr_mut(hi, "to_bf16_split hi")?;
        let l = self.ptr_mut(lo, "to_bf16_split lo")?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.f32_to_bf16_split);
        b.arg(&xp).arg(&h).arg(&l).arg(&n64);
        // SAFETY: x holds n f32, hi and lo n u16 each; the argument list matches the kernel's.
        unsafe { b.launch(self.elementwise_cfg(n)) }.ctx("f32_to_bf16_split")?;
        Ok(())
    }
}
