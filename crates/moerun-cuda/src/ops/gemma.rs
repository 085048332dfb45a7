//! Gemma 4's elementwise ops (`kernels/gemma.cu`): GELU-tanh-and-multiply (dense MLP and the
//! per-layer-input gate), scale by a scalar and logit soft-capping (the router's per-column scale
//! is part of the attention tail, ops/gemma_tail.rs, its per-expert scale part of
//! `route_topk_scaled`). Each is the f32 arithmetic of the CPU reference in the same order.
//!
//! Launch (all): 1-D grid-stride, block 256, grid ceil(n / 256) capped at 32 blocks per SM.

use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, PushKernelArg};

use super::to_i32;
use crate::error::{ensure, DriverContext, Result};
use crate::CudaDevice;

/// Handles of `kernels/gemma.cu`.
pub(crate) struct GemmaKernels {
    gelu_tanh_mul: CudaFunction,
    scale: CudaFunction,
    softcap: CudaFunction,
    /// `gemma4_attn_tail_f32` and `gemma4_ffn_tail_f32` (ops/gemma_tail.rs).
    pub(super) attn_tail: CudaFunction,
    pub(super) ffn_tail: CudaFunction,
}

impl GemmaKernels {
    pub(crate) fn load(get: impl Fn(&str) -> Result<CudaFunction>) -> Result<Self> {
        Ok(GemmaKernels {
            gelu_tanh_mul: get("gelu_tanh_mul_f32")?,
            scale: get("scale_f32")?,
            softcap: get("softcap_f32")?,
            attn_tail: get("gemma4_attn_tail_f32")?,
            ffn_tail: get("gemma4_ffn_tail_f32")?,
        })
    }
}

impl CudaDevice {
    /// `gate[i] = gelu_tanh(gate[i]) * up[i]` (Gemma's MLP).
    pub fn gelu_tanh_mul(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        up: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let n = gate.len();
        ensure(up.len() == n, || {
            format!("gelu_tanh_mul: gate holds {n}, up {}", up.len())
        })?;
        self.gelu_tanh_mul_strided(gate, n.max(1), up, n.max(1), 0)
    }

    /// `gate[r, c] = gelu_tanh(gate[r, c]) * up[r * up_stride + up_offset + c]` over rows of
    /// `width`: with `up` a token's packed per-layer inputs (`[rows, layers * width]`), layer `l`'s
    /// slice is `up_stride = layers * width`, `up_offset = l * width`.
    pub fn gelu_tanh_mul_strided(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        width: usize,
        up: &impl DevicePtr<f32>,
        up_stride: usize,
        up_offset: usize,
    ) -> Result<()> {
        let n = gate.len();
        ensure(width > 0 && n.is_multiple_of(width), || {
            format!("gelu_tanh_mul: gate holds {n}, not rows of {width}")
        })?;
        let rows = n / width;
        ensure(
            up_offset + width <= up_stride && up.len() == rows * up_stride,
            || {
                format!(
                    "gelu_tanh_mul: up holds {}, expected {rows} rows of {up_stride} with {width} \
                     at offset {up_offset}",
                    up.len()
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        let g = self.ptr_mut(gate, "gelu_tanh_mul gate")?;
        let u = self.ptr(up, "gelu_tanh_mul up")?;
        let (n64, w, st, off) = (
            n as u64,
            to_i32(width, "width")?,
            up_stride as u64,
            up_offset as u64,
        );
        let mut b = self
            .stream
            .launch_builder(&self.kernels.gemma.gelu_tanh_mul);
        b.arg(&g).arg(&u).arg(&n64).arg(&w).arg(&st).arg(&off);
        // SAFETY: gate holds rows x width f32, up rows x up_stride with the slice inside each
        // row; the argument list matches the kernel's.
        unsafe { b.launch(self.elementwise_cfg(n)) }.ctx("gelu_tanh_mul_f32")?;
        Ok(())
    }

    /// `x *= s`.
    pub fn scale(&self, x: &mut impl DevicePtrMut<f32>, s: f32) -> Result<()> {
        self.scalar_op(&self.kernels.gemma.scale, "scale_f32", x, s)
    }

    /// `x = tanh(x / cap) * cap` (final logit soft-capping); `cap` must be positive.
    pub fn softcap(&self, x: &mut impl DevicePtrMut<f32>, cap: f32) -> Result<()> {
        ensure(cap.is_finite() && cap > 0.0, || {
            format!("softcap: cap {cap} must be positive")
        })?;
        self.scalar_op(&self.kernels.gemma.softcap, "softcap_f32", x, cap)
    }

    fn scalar_op(
        &self,
        func: &CudaFunction,
        name: &str,
        x: &mut impl DevicePtrMut<f32>,
        s: f32,
    ) -> Result<()> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, name)?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(func);
        b.arg(&xp).arg(&s).arg(&n64);
        // SAFETY: x holds n f32; the argument list matches the kernel's.
        unsafe { b.launch(self.elementwise_cfg(n)) }.ctx(name)?;
        Ok(())
    }
}
