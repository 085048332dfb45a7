//! A Gemma 4 layer's norm chains in one launch each (`kernels/gemma.cu`'s
//! `gemma4_attn_tail_f32` and `gemma4_ffn_tail_f32`): the sandwich norms, adds and scales
//! between its attention, dense MLP and experts, which were eight RMSNorm launches, three adds, two
//! scales and a copy a layer. Each is the CPU reference's f32 arithmetic in the same order
//! (crates/moerun-model/src/gemma4/forward.rs).
//!
//! Launch (both): grid (rows), block 1024: a row a block, 6 of its values a thread.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{blocks, to_i32};
use crate::error::{ensure, DriverContext, Result};
use crate::CudaDevice;

/// The widest row the tails take: 1024 threads keep 6 values each in registers, and as many of
/// each norm weight (loaded before the programmatic wait). Every published Gemma 4 is narrower
/// (the widest, Gemma-4-31B, has 5,376).
pub const GEMMA_TAIL_MAX_WIDTH: usize = 6144;
const TAIL_THREADS: u32 = 1024;

/// The attention tail's norm weights: `x += post_attention(a)`, then of the new residual the
/// dense MLP's input `pre_feedforward(x)` and, for a layer with experts, `router`'s two inputs.
pub struct AttnTailNorms<'a, W> {
    pub post_attention: &'a W,
    pub pre_feedforward: &'a W,
    pub router: Option<RouterNorms<'a, W>>,
    pub eps: f32,
}

/// A layer's routed experts' inputs from the residual `x`: the router's `norm(x) * scale *
/// root` (a norm without a learned scale) and the experts' `pre_feedforward_2(x)`.
pub struct RouterNorms<'a, W> {
    pub scale: &'a W,
    pub root: f32,
    pub pre_feedforward_2: &'a W,
}

/// Where the attention tail writes: the dense MLP's input and (with [`RouterNorms`]) the
/// router's and the experts' inputs, each `[rows, width]`.
pub struct AttnTailOut<'a, O> {
    pub normed: &'a mut O,
    pub router_in: Option<(&'a mut O, &'a mut O)>,
}

/// The feed-forward tail: `f = post_feedforward_1(dense) + post_feedforward_2(routed)` (with
/// experts; else `dense` alone), `x = (x + post_feedforward(f)) * layer_scalar`.
pub struct FfnTail<'a, W, I> {
    pub dense: &'a I,
    /// The experts' output and the norms of the dense and the routed branch.
    pub routed: Option<(&'a I, &'a W, &'a W)>,
    pub post_feedforward: &'a W,
    pub layer_scalar: f32,
    pub eps: f32,
}

impl CudaDevice {
    /// A Gemma 4 layer's steps from attention's output `attn` to the dense MLP's input (see
    /// [`AttnTailNorms`]), on the residual `x` in place; rows of the weights' width.
    pub fn gemma4_attn_tail<W, I, O>(
        &self,
        x: &mut O,
        attn: &I,
        norms: &AttnTailNorms<W>,
        out: AttnTailOut<O>,
    ) -> Result<()>
    where
        W: DevicePtr<f32>,
        I: DevicePtr<f32>,
        O: DevicePtrMut<f32>,
    {
        let (rows, width) = tail_rows("gemma4_attn_tail", x.len(), norms.post_attention.len())?;
        let mut widths = vec![norms.pre_feedforward.len()];
        let mut lens = vec![attn.len(), out.normed.len()];
        if let Some(r) = &norms.router {
            widths.extend([r.scale.len(), r.pre_feedforward_2.len()]);
        }
        ensure(norms.router.is_some() == out.router_in.is_some(), || {
            "gemma4_attn_tail: the router's norms and its outputs go together".into()
        })?;
        if let Some((xr, xe)) = &out.router_in {
            lens.extend([xr.len(), xe.len()]);
        }
        same_shape("gemma4_attn_tail", width, &widths, rows * width, &lens)?;
        if rows == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, "gemma4_attn_tail x")?;
        let ap = self.ptr(attn, "gemma4_attn_tail attn")?;
        let wpost = self.ptr(norms.post_attention, "gemma4_attn_tail post_attention")?;
        let wpre = self.ptr(norms.pre_feedforward, "gemma4_attn_tail pre_feedforward")?;
        let xn = self.ptr_mut(out.normed, "gemma4_attn_tail normed")?;
        let (mut rs, mut root, mut wpre2, mut xr, mut xe) = (0u64, 0.0f32, 0u64, 0u64, 0u64);
        if let (Some(r), Some((r_in, e_in))) = (&norms.router, out.router_in) {
            rs = self.ptr(r.scale, "gemma4_attn_tail router scale")?;
            root = r.root;
            wpre2 = self.ptr(r.pre_feedforward_2, "gemma4_attn_tail pre_feedforward_2")?;
            xr = self.ptr_mut(r_in, "gemma4_attn_tail router input")?;
            xe = self.ptr_mut(e_in, "gemma4_attn_tail experts' input")?;
        }
        let w = to_i32(width, "width")?;
        let mut b = self.stream.launch_builder(&self.kernels.gemma.attn_tail);
        b.arg(&xp).arg(&ap).arg(&wpost).arg(&wpre).arg(&xn);
        b.arg(&rs).arg(&root).arg(&wpre2).arg(&xr).arg(&xe);
        b.arg(&w).arg(&norms.eps);
        // SAFETY: x, attn and every output hold rows x width f32, every weight width f32 (checked
        // above; the router's pointers all null or all set); the argument list matches.
        unsafe { b.launch(tail_cfg(rows)?) }.ctx("gemma4_attn_tail_f32")?;
        Ok(())
    }

    /// A Gemma 4 layer's steps from its feed-forward outputs to the end of the layer (see
    /// [`FfnTail`]), on the residual `x` in place; given `next` (a norm's weights and an output),
    /// also that norm of the new `x` (the next layer's input norm, or the final norm).
    pub fn gemma4_ffn_tail<W, I, O>(
        &self,
        x: &mut O,
        tail: &FfnTail<W, I>,
        next: Option<(&W, &mut O)>,
    ) -> Result<()>
    where
        W: DevicePtr<f32>,
        I: DevicePtr<f32>,
        O: DevicePtrMut<f32>,
    {
        let (rows, width) = tail_rows("gemma4_ffn_tail", x.len(), tail.post_feedforward.len())?;
        let mut widths = Vec::new();
        let mut lens = vec![tail.dense.len()];
        if let Some((r, w1, w2)) = &tail.routed {
            widths.extend([w1.len(), w2.len()]);
            lens.push(r.len());
        }
        if let Some((w, out)) = &next {
            widths.push(w.len());
            lens.push(out.len());
        }
        same_shape("gemma4_ffn_tail", width, &widths, rows * width, &lens)?;
        if rows == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, "gemma4_ffn_tail x")?;
        let fp = self.ptr(tail.dense, "gemma4_ffn_tail dense")?;
        let (mut w1, mut rp, mut w2) = (0u64, 0u64, 0u64);
        if let Some((r, n1, n2)) = &tail.routed {
            w1 = self.ptr(*n1, "gemma4_ffn_tail post_feedforward_1")?;
            rp = self.ptr(*r, "gemma4_ffn_tail routed")?;
            w2 = self.ptr(*n2, "gemma4_ffn_tail post_feedforward_2")?;
        }
        let wpost = self.ptr(tail.post_feedforward, "gemma4_ffn_tail post_feedforward")?;
        let (mut wn, mut xn) = (0u64, 0u64);
        if let Some((w, out)) = next {
            wn = self.ptr(w, "gemma4_ffn_tail next norm")?;
            xn = self.ptr_mut(out, "gemma4_ffn_tail next normed")?;
        }
        let w = to_i32(width, "width")?;
        let mut b = self.stream.launch_builder(&self.kernels.gemma.ffn_tail);
        b.arg(&xp).arg(&fp).arg(&w1).arg(&rp).arg(&w2).arg(&wpost);
        b.arg(&tail.layer_scalar)
            .arg(&wn)
            .arg(&xn)
            .arg(&w)
            .arg(&tail.eps);
        // SAFETY: x, the branches and the output hold rows x width f32, every weight width f32
        // (checked above; routed and its norms null together, as the next norm and its output);
        // the argument list matches the kernel's.
        unsafe { b.launch(tail_cfg(rows)?) }.ctx("gemma4_ffn_tail_f32")?;
        Ok(())
    }
}

/// Rows of `width` in `len` values, the width within [`GEMMA_TAIL_MAX_WIDTH`].
fn tail_rows(op: &str, len: usize, width: usize) -> Result<(usize, usize)> {
    ensure(width > 0 && width <= GEMMA_TAIL_MAX_WIDTH, || {
        format!("{op}: rows of {width} values; it takes 1..={GEMMA_TAIL_MAX_WIDTH}")
    })?;
    ensure(len.is_multiple_of(width), || {
        format!("{op}: x holds {len} values, not rows of {width}")
    })?;
    Ok((len / width, width))
}

/// Every weight `width` long and every row buffer `len`.
fn same_shape(op: &str, width: usize, widths: &[usize], len: usize, lens: &[usize]) -> Result<()> {
    ensure(widths.iter().all(|&w| w == width), || {
        format!("{op}: norm weights of {widths:?} values for rows of {width}")
    })?;
    ensure(lens.iter().all(|&l| l == len), || {
        format!("{op}: buffers of {lens:?} values where x holds {len}")
    })
}

fn tail_cfg(rows: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (blocks(rows, 1)?, 1, 1),
        block_dim: (TAIL_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}
