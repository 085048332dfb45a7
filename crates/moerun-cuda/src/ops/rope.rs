//! Rotary position embedding, rotate-half convention, partial rotary, attention factor
//! (`kernels/rope.cu`); the same arithmetic as moerun-model's `Rope` with
//! `moerun_cpu::ops::rope_rotate_half`.
//!
//! Launch: grid (tokens), block 128. Each block computes its token's cos/sin into shared memory
//! once, then rotates every (head, pair) of the token's row.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::to_i32;
use crate::error::{ensure, DriverContext, Result};
use crate::CudaDevice;

/// The kernel keeps one token's cos and sin in shared memory.
const MAX_HALF: usize = 512;

/// A model's rotary frequencies on the device: `inv_freq` (`rotary_dim / 2` values) and the
/// attention factor both cos and sin are scaled by (1 unless YaRN-style scaling says otherwise).
pub struct DeviceRope {
    inv_freq: CudaSlice<f32>,
    attention_factor: f32,
}

impl DeviceRope {
    /// `rotary_dim / 2`.
    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }

    pub(crate) fn inv_freq(&self) -> &CudaSlice<f32> {
        &self.inv_freq
    }

    pub(crate) fn attention_factor(&self) -> f32 {
        self.attention_factor
    }
}

impl CudaDevice {
    /// Upload a model's rotary frequencies once.
    pub fn upload_rope(&self, inv_freq: &[f32], attention_factor: f32) -> Result<DeviceRope> {
        ensure(!inv_freq.is_empty() && inv_freq.len() <= MAX_HALF, || {
            format!(
                "rope: rotary_dim / 2 = {} must be in 1..={MAX_HALF}",
                inv_freq.len()
            )
        })?;
        Ok(DeviceRope {
            inv_freq: self.upload(inv_freq)?,
            attention_factor,
        })
    }

    /// Rotate, in place, every head of each token row of `x` (`[tokens, heads * head_dim]`) by the
    /// angle of its position (`positions[t]`). Dimensions past `2 * rope.half()` pass through.
    pub fn rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        positions: &impl DevicePtr<u32>,
        rope: &DeviceRope,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let tokens = positions.len();
        let half = rope.half();
        ensure(x.len() == tokens * heads * head_dim, || {
            format!(
                "rope: x holds {}, expected {tokens} tokens x {heads} heads x {head_dim}",
                x.len()
            )
        })?;
        ensure(2 * half <= head_dim, || {
            format!("rope: rotary_dim {} exceeds head_dim {head_dim}", 2 * half)
        })?;
        if tokens == 0 || heads == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, "rope x")?;
        let pos = self.ptr(positions, "rope positions")?;
        let freq = self.ptr(&rope.inv_freq, "rope inv_freq")?;
        let (heads_i, dim_i, half_i) = (
            to_i32(heads, "heads")?,
            to_i32(head_dim, "head_dim")?,
            to_i32(half, "half")?,
        );
        to_i32(tokens * heads * head_dim, "rope elements")?;
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.kernels.rope);
        b.arg(&xp).arg(&pos).arg(&freq);
        b.arg(&heads_i)
            .arg(&dim_i)
            .arg(&half_i)
            .arg(&rope.attention_factor);
        // SAFETY: x holds tokens * heads * head_dim f32, positions tokens u32, inv_freq half f32
        // with half <= MAX_HALF (the kernel's shared arrays) and 2 * half <= head_dim; the
        // argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("rope_rotate_half_f32")?;
        Ok(())
    }
}
