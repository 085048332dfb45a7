//! MoE routing on the device (`kernels/router.cu`): softmax of the router logits in f32, top-k by
//! probability with ties to the lower expert index, optional renormalisation of the k weights,
//! exactly the steps of moerun-model's `route`.
//!
//! Launch: block (32, 4), grid ceil(tokens / 4); one warp per token holding its experts'
//! probabilities in registers (the build with the fewest per lane that hold them all: 1, 2, 4,
//! 8 or 16), k rounds of a warp arg-max (two redux.sync each).
//!
//! [`CudaDevice::add_rms_norm_route`] is one token's whole post-attention step before the experts
//! in one launch (`add_rms_norm_route_<dt>_l<L>`, grid ceil(experts / 16), block 1024): the
//! residual add and RMSNorm, the router GEMV and the top-k, with the bits of `add_rms_norm`,
//! `gemv` and `route_topk` (router.cu says how). A batch-1 decode step waits for three dependent
//! launches per MoE layer there otherwise.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::fused::ROW_BLOCK;
use super::{blocks, to_i32};
use crate::device::dtype_slot;
use crate::error::{ensure, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix};

/// Router rows per block of `add_rms_norm_route` (`ROUTE_ROWS`: four groups of 4).
const FUSED_ROUTE_ROWS: usize = 16;

/// Where [`CudaDevice::add_rms_norm_route`] writes: the router logits (`[experts]`, which its
/// last block reads back) and the choices (`[top_k]` each).
pub struct RouteOut<'a, L, E, W> {
    pub logits: &'a mut L,
    pub experts: &'a mut E,
    pub weights: &'a mut W,
}

/// The route_topk build holding 2^slot experts per lane, the fewest that hold them all.
fn lanes_slot(experts: usize) -> usize {
    experts.div_ceil(32).next_power_of_two().trailing_zeros() as usize
}

const ROWS_PER_BLOCK: usize = 4;

/// Experts a routing warp can rank: 16 in each lane's registers (the widest build in
/// router.cu). The largest published MoE (Qwen3-Next) has 512.
pub const MAX_EXPERTS: usize = 512;

/// How a family routes: number of experts, how many each token takes, and whether the chosen
/// weights are renormalised to sum to one (`norm_topk_prob`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterShape {
    pub experts: usize,
    pub top_k: usize,
    pub renormalise: bool,
}

/// Shared memory `add_rms_norm_route` may take without opting in (the launch's default cap).
const FUSED_ROUTE_SMEM: usize = 48 << 10;

/// The shape checks every routing op makes.
fn check_shape(op: &str, shape: RouterShape) -> Result<()> {
    let RouterShape { experts, top_k, .. } = shape;
    ensure((1..=MAX_EXPERTS).contains(&experts), || {
        format!("{op}: {experts} experts, supported 1..={MAX_EXPERTS}")
    })?;
    ensure((1..=experts).contains(&top_k), || {
        format!("{op}: top_k {top_k} must be in 1..={experts}")
    })
}

/// Dynamic shared memory of `add_rms_norm_route` for a row of `width` and `experts` logits.
fn fused_route_smem(width: usize, experts: usize) -> usize {
    (2 * width + experts) * 4
}

impl CudaDevice {
    /// Whether [`CudaDevice::add_rms_norm_route`] takes a row of `width` and a router of
    /// `experts` rows: its shared memory (two rows and the logits) fits the default 48 KiB, i.e.
    /// hidden sizes up to ~6000.
    pub fn add_rms_norm_route_fits(&self, width: usize, experts: usize) -> bool {
        fused_route_smem(width, experts) <= FUSED_ROUTE_SMEM
    }

    /// One token's post-attention step in one launch: `x += y`; `out` = the RMSNorm of the new
    /// x times `norm` (eps `eps`); the router logits `out · routerᵀ` into `dst.logits`; their
    /// softmax top-k into `dst.experts` / `dst.weights`. The same bits as `add_rms_norm`, `gemv`
    /// (one row) and `route_topk` in turn.
    #[allow(clippy::too_many_arguments)] // add_rms_norm's five, the router and its shape
    pub fn add_rms_norm_route<L, E, W>(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
        norm: &impl DevicePtr<f32>,
        eps: f32,
        router: &DeviceMatrix,
        shape: RouterShape,
        out: &mut impl DevicePtrMut<f32>,
        dst: RouteOut<'_, L, E, W>,
    ) -> Result<()>
    where
        L: DevicePtrMut<f32>,
        E: DevicePtrMut<u32>,
        W: DevicePtrMut<f32>,
    {
        const OP: &str = "add_rms_norm_route";
        check_shape(OP, shape)?;
        let RouterShape {
            experts,
            top_k,
            renormalise,
        } = shape;
        let width = norm.len();
        ensure(
            width > 0 && x.len() == width && y.len() == width && out.len() == width,
            || {
                format!(
                    "{OP}: one token: x {}, y {}, out {} must each hold the norm's {width}",
                    x.len(),
                    y.len(),
                    out.len()
                )
            },
        )?;
        ensure(router.rows() == experts && router.cols() == width, || {
            format!(
                "{OP}: the router is {} x {}, not {experts} experts x {width}",
                router.rows(),
                router.cols()
            )
        })?;
        let per_chunk = 16 / router.dtype().size();
        ensure(width.is_multiple_of(per_chunk), || {
            format!(
                "{OP}: width {width} must be a multiple of {per_chunk} for {} weights",
                router.dtype()
            )
        })?;
        ensure(
            dst.logits.len() == experts && dst.experts.len() == top_k && dst.weights.len() == top_k,
            || format!("{OP}: outputs must hold {experts} logits and {top_k} choices"),
        )?;
        ensure(self.add_rms_norm_route_fits(width, experts), || {
            format!("{OP}: a row of {width} with {experts} experts needs more than 48 KiB of shared memory")
        })?;
        let xp = self.ptr_mut(x, "add_rms_norm_route x")?;
        let yp = self.ptr(y, "add_rms_norm_route y")?;
        let np = self.ptr(norm, "add_rms_norm_route norm")?;
        let op = self.ptr_mut(out, "add_rms_norm_route out")?;
        let rp = self.ptr(router.data(), "add_rms_norm_route router")?;
        let lp = self.ptr_mut(dst.logits, "add_rms_norm_route logits")?;
        let ep = self.ptr_mut(dst.experts, "add_rms_norm_route experts")?;
        let wp = self.ptr_mut(dst.weights, "add_rms_norm_route weights")?;
        // Written by the kernel through its address: the counter is the device's own, and only
        // this op's launches (ordered on the one stream) touch it.
        let cp = self.ptr(&self.route_counter, "add_rms_norm_route counter")?;
        ensure(rp.is_multiple_of(16), || {
            format!("{OP}: the router must start 16-byte aligned")
        })?;
        let (width_i, experts_i, k_i) = (
            to_i32(width, "width")?,
            to_i32(experts, "experts")?,
            to_i32(top_k, "top_k")?,
        );
        let renorm_i = renormalise as i32;
        let cfg = LaunchConfig {
            grid_dim: (blocks(experts, FUSED_ROUTE_ROWS)?, 1, 1),
            block_dim: (ROW_BLOCK, 1, 1),
            shared_mem_bytes: fused_route_smem(width, experts) as u32,
        };
        let kernel =
            &self.kernels.add_rms_norm_route[dtype_slot(router.dtype())][lanes_slot(experts)];
        let mut b = self.stream.launch_builder(kernel);
        b.arg(&xp)
            .arg(&yp)
            .arg(&np)
            .arg(&op)
            .arg(&width_i)
            .arg(&eps);
        b.arg(&rp).arg(&lp).arg(&experts_i).arg(&k_i).arg(&renorm_i);
        b.arg(&ep).arg(&wp).arg(&cp);
        // SAFETY: x, y, out and norm hold one row of `width` f32; the router experts x width
        // elements of its dtype (width a multiple of the 16-byte chunk, 16-byte aligned); logits
        // `experts` f32, the choices top_k each; the dynamic shared memory holds two rows and the
        // logits; the counter is the device's, zero between launches (the last block resets it).
        unsafe { b.launch(cfg) }.ctx("add_rms_norm_route")?;
        Ok(())
    }

    /// Route every token row of `logits` (`[tokens, experts]`): `out_experts` and `out_weights`
    /// (`[tokens, top_k]`) receive the chosen experts and their weights in rank order.
    pub fn route_topk(
        &self,
        logits: &impl DevicePtr<f32>,
        shape: RouterShape,
        out_experts: &mut impl DevicePtrMut<u32>,
        out_weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let RouterShape {
            experts,
            top_k,
            renormalise,
        } = shape;
        check_shape("route_topk", shape)?;
        ensure(logits.len().is_multiple_of(experts), || {
            format!(
                "route_topk: {} logits are not rows of {experts}",
                logits.len()
            )
        })?;
        let tokens = logits.len() / experts;
        ensure(
            out_experts.len() == tokens * top_k && out_weights.len() == tokens * top_k,
            || format!("route_topk: outputs must hold {tokens} x {top_k}"),
        )?;
        if tokens == 0 {
            return Ok(());
        }
        let l = self.ptr(logits, "route_topk logits")?;
        let e = self.ptr_mut(out_experts, "route_topk experts")?;
        let w = self.ptr_mut(out_weights, "route_topk weights")?;
        let (rows_i, experts_i, k_i) = (
            to_i32(tokens, "tokens")?,
            to_i32(experts, "experts")?,
            to_i32(top_k, "top_k")?,
        );
        let renorm_i = renormalise as i32;
        let cfg = LaunchConfig {
            grid_dim: (blocks(tokens, ROWS_PER_BLOCK)?, 1, 1),
            block_dim: (32, ROWS_PER_BLOCK as u32, 1),
            shared_mem_bytes: 0,
        };
        if crate::skip::skipped("route_topk") {
            return Ok(());
        }
        let mut b = self
            .stream
            .launch_builder(&self.kernels.route_topk[lanes_slot(experts)]);
        b.arg(&l)
            .arg(&rows_i)
            .arg(&experts_i)
            .arg(&k_i)
            .arg(&renorm_i);
        b.arg(&e).arg(&w);
        // SAFETY: logits hold tokens * experts f32 (experts <= MAX_EXPERTS, what a warp holds),
        // both outputs tokens * top_k; the argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("route_topk_f32_l<L>")?;
        Ok(())
    }
}
