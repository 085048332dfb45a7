//! MoE routing on the device (`kernels/router.cu`): softmax of the router logits in f32, top-k by
//! probability with ties to the lower expert index, optional renormalisation of the k weights,
//! exactly the steps of moerun-model's `route`.
//!
//! Launch: block (32, 4), grid ceil(tokens / 4); one warp per token holding its experts'
//! probabilities in registers (the build with the fewest per lane that hold them all: 1, 2, 4,
//! 8 or 16), k rounds of a warp arg-max (two redux.sync each).
//!
//! [`CudaDevice::gemv_route`] is the router GEMV of one token and its routing in one launch
//! (`kernels/gemv.cu`'s `gemv_route`, one thread-block cluster on Hopper): the bits of
//! [`CudaDevice::gemv`] then [`CudaDevice::route_topk`], one launch and no L2 round trip fewer
//! on every MoE layer of a batch-1 decode step. [`CudaDevice::gemv_route_norm`] also folds in
//! the add+RMSNorm before the MoE layer (the norm's scale applied after the sums, as
//! [`CudaDevice::gemv_add_norm`] does), one more launch and wait fewer.

use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{blocks, to_i32};
use crate::device::dtype_slot;
use crate::error::{ensure, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix};

const ROWS_PER_BLOCK: usize = 4;

/// Experts a routing warp can rank: 16 in each lane's registers (the widest build in
/// router.cu). The largest published MoE (Qwen3-Next) has 512.
pub const MAX_EXPERTS: usize = 512;

/// Experts [`CudaDevice::gemv_route`] covers: 16 router rows in each of a cluster's 8 blocks.
pub const GEMV_ROUTE_MAX_EXPERTS: usize = 128;

/// The gemv_route kernels' launch: one cluster of 8 blocks of 256 (their `__cluster_dims__`).
const ROUTE_CLUSTER_LAUNCH: LaunchConfig = LaunchConfig {
    grid_dim: (8, 1, 1),
    block_dim: (256, 1, 1),
    shared_mem_bytes: 0,
};

/// The arguments after the router's and the row's that every gemv_route kernel takes.
struct RouteArgs {
    w: u64,
    experts: i32,
    k: i32,
    top_k: i32,
    renormalise: i32,
    out_experts: u64,
    out_weights: u64,
}

impl RouteArgs {
    /// Push the arguments after the row's: experts, k, top-k, renormalise, the two outputs.
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.experts)
            .arg(&self.k)
            .arg(&self.top_k)
            .arg(&self.renormalise)
            .arg(&self.out_experts)
            .arg(&self.out_weights);
    }
}

/// How a family routes: number of experts, how many each token takes, and whether the chosen
/// weights are renormalised to sum to one (`norm_topk_prob`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterShape {
    pub experts: usize,
    pub top_k: usize,
    pub renormalise: bool,
}

impl RouterShape {
    /// Refuses a `top_k` outside 1..=experts, naming the op.
    fn check_top_k(&self, op: &str) -> Result<()> {
        let (experts, top_k) = (self.experts, self.top_k);
        ensure((1..=experts).contains(&top_k), || {
            format!("{op}: top_k {top_k} must be in 1..={experts}")
        })
    }

    /// The routing warp's build: 2^slot experts per lane, the fewest that hold them all.
    pub(crate) fn lane_slot(&self) -> usize {
        self.experts
            .div_ceil(32)
            .next_power_of_two()
            .trailing_zeros() as usize
    }
}

impl CudaDevice {
    /// Route every token row of `logits` (`[tokens, experts]`): `out_experts` and `out_weights`
    /// (`[tokens, top_k]`) receive the chosen experts and their weights in rank order.
    pub fn route_topk(
        &self,
        logits: &impl DevicePtr<f32>,
        shape: RouterShape,
        out_experts: &mut impl DevicePtrMut<u32>,
        out_weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.route_topk_with(logits, shape, 0, out_experts, out_weights)
    }

    /// [`CudaDevice::route_topk`], each chosen weight then times `expert_scale[id]` (Gemma 4's
    /// learned per-expert scale, after the renormalisation) in the same launch; an id out of
    /// range gives NaN, as [`CudaDevice::expert_scale`] does.
    pub fn route_topk_scaled(
        &self,
        logits: &impl DevicePtr<f32>,
        shape: RouterShape,
        expert_scale: &impl DevicePtr<f32>,
        out_experts: &mut impl DevicePtrMut<u32>,
        out_weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        ensure(expert_scale.len() == shape.experts, || {
            format!(
                "route_topk: {} per-expert scales for {} experts",
                expert_scale.len(),
                shape.experts
            )
        })?;
        let scale = self.ptr(expert_scale, "route_topk expert_scale")?;
        self.route_topk_with(logits, shape, scale, out_experts, out_weights)
    }

    /// `scale`: the per-expert scales' device address, or 0 for none.
    fn route_topk_with(
        &self,
        logits: &impl DevicePtr<f32>,
        shape: RouterShape,
        scale: u64,
        out_experts: &mut impl DevicePtrMut<u32>,
        out_weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let RouterShape {
            experts,
            top_k,
            renormalise,
        } = shape;
        ensure((1..=MAX_EXPERTS).contains(&experts), || {
            format!("route_topk: {experts} experts, supported 1..={MAX_EXPERTS}")
        })?;
        shape.check_top_k("route_topk")?;
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
            .launch_builder(&self.kernels.route_topk[shape.lane_slot()]);
        b.arg(&l)
            .arg(&rows_i)
            .arg(&experts_i)
            .arg(&k_i)
            .arg(&renorm_i);
        b.arg(&e).arg(&w).arg(&scale);
        // SAFETY: logits hold tokens * experts f32 (experts <= MAX_EXPERTS, what a warp holds),
        // both outputs tokens * top_k, the scales (when not null) experts f32; the argument list
        // matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("route_topk_f32_l<L>")?;
        Ok(())
    }

    /// Whether [`CudaDevice::gemv_route`] takes a router of `experts` rows here: on Hopper
    /// (thread-block clusters) and for at most `GEMV_ROUTE_MAX_EXPERTS`; never with
    /// `MOERUN_CUDA_GEMV_ROUTE=0` (a measuring knob: the GEMV and route_topk instead).
    pub fn gemv_route_supported(&self, experts: usize) -> bool {
        static OFF: OnceLock<bool> = OnceLock::new();
        let off = *OFF
            .get_or_init(|| std::env::var_os("MOERUN_CUDA_GEMV_ROUTE").is_some_and(|v| v == "0"));
        !off && self.info().compute_capability.0 >= 9
            && (1..=GEMV_ROUTE_MAX_EXPERTS).contains(&experts)
    }

    /// The router logits of one token, `x` (`w.cols()` f32) · `w`ᵀ (`w`: `[experts, hidden]`),
    /// routed as [`CudaDevice::route_topk`] routes them, in one launch: `out_experts` and
    /// `out_weights` (`top_k` each) get exactly what [`CudaDevice::gemv`] then `route_topk` give.
    /// Refused where [`CudaDevice::gemv_route_supported`] is false.
    pub fn gemv_route(
        &self,
        x: &impl DevicePtr<f32>,
        w: &DeviceMatrix,
        shape: RouterShape,
        out_experts: &mut impl DevicePtrMut<u32>,
        out_weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let a = self.route_args("gemv_route", x.len(), w, shape, out_experts, out_weights)?;
        let xp = self.ptr(x, "gemv_route x")?;
        ensure(xp.is_multiple_of(16), || {
            "gemv_route: x must start 16-byte aligned".to_string()
        })?;
        if crate::skip::skipped("gemv_route") {
            return Ok(());
        }
        let func = &self.kernels.gemv_route[dtype_slot(w.dtype())][shape.lane_slot()];
        let mut b = self.stream.launch_builder(func);
        b.arg(&a.w).arg(&xp);
        a.push(&mut b);
        // SAFETY: w holds experts (<= 128, the cluster's 8 x 16 rows) x k elements of its dtype, k
        // a multiple of the 16-byte chunk; x holds k f32; both outputs top_k (route_args checked
        // them); the argument list matches the kernel's.
        unsafe { b.launch(ROUTE_CLUSTER_LAUNCH) }.ctx("gemv_route_<dt>_l<L>")?;
        Ok(())
    }

    /// Whether a forward pass should fold one token's add+norm before a MoE layer into its
    /// routing ([`CudaDevice::gemv_route_norm`]) where [`CudaDevice::gemv_route_supported`]: yes,
    /// but for `MOERUN_CUDA_NORM_ROUTE=0` (a measuring knob).
    pub fn norm_route_wanted(&self) -> bool {
        static OFF: OnceLock<bool> = OnceLock::new();
        !*OFF.get_or_init(|| std::env::var_os("MOERUN_CUDA_NORM_ROUTE").is_some_and(|v| v == "0"))
    }

    /// One token's [`CudaDevice::add_rms_norm`] then [`CudaDevice::gemv_route`] of its output, in
    /// one launch: `x_out = x + y` (add_rms_norm's bits), `xn` = `norm` ⊙ s / rms(s) and the
    /// routing of `w · xn`, with the norm's scale applied after the router's sums (each block
    /// squares the values it reads anyway; a few ulp from the two launches' `xn` and logits).
    /// Refused where [`CudaDevice::gemv_route_supported`] is false. Under programmatic launch
    /// `x` and `norm` are read before the kernel waits (graph::EARLY_ACTIVATION_READERS).
    #[allow(clippy::too_many_arguments)] // add_rms_norm's arguments, then gemv_route's
    pub fn gemv_route_norm(
        &self,
        (x, y, norm, eps): (
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
            &CudaSlice<f32>,
            f32,
        ),
        (x_out, xn): (&mut impl DevicePtrMut<f32>, &mut impl DevicePtrMut<f32>),
        w: &DeviceMatrix,
        shape: RouterShape,
        out_experts: &mut impl DevicePtrMut<u32>,
        out_weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let width = w.cols();
        ensure(self.gemv_route_supported(shape.experts), || {
            format!(
                "gemv_route_norm: {} experts on compute capability {:?}; it needs sm_90+ and \
                 at most {GEMV_ROUTE_MAX_EXPERTS} experts",
                shape.experts,
                self.info().compute_capability
            )
        })?;
        ensure(
            y.len() == width
                && norm.len() == width
                && x_out.len() == width
                && xn.len() == width
                && eps.is_finite(),
            || {
                format!(
                    "gemv_route_norm: y {}, norm {}, x_out {}, xn {} for rows of {width} (eps \
                     {eps})",
                    y.len(),
                    norm.len(),
                    x_out.len(),
                    xn.len()
                )
            },
        )?;
        let a = self.route_args(
            "gemv_route_norm",
            x.len(),
            w,
            shape,
            out_experts,
            out_weights,
        )?;
        let xp = self.ptr(x, "gemv_route_norm x")?;
        let yp = self.ptr(y, "gemv_route_norm y")?;
        let np = self.ptr(norm, "gemv_route_norm norm")?;
        let xo = self.ptr_mut(x_out, "gemv_route_norm x_out")?;
        let op = self.ptr_mut(xn, "gemv_route_norm xn")?;
        ensure(
            [xp, yp, np, xo, op].iter().all(|p| p.is_multiple_of(16)),
            || "gemv_route_norm: x, y, norm, x_out and xn must start 16-byte aligned".to_string(),
        )?;
        if crate::skip::skipped("gemv_route") {
            return Ok(());
        }
        let func = &self.kernels.gemv_route_norm[dtype_slot(w.dtype())][shape.lane_slot()];
        let mut b = self.stream.launch_builder(func);
        b.arg(&a.w)
            .arg(&xp)
            .arg(&yp)
            .arg(&np)
            .arg(&eps)
            .arg(&xo)
            .arg(&op);
        a.push(&mut b);
        // SAFETY: as gemv_route's; x, y, norm, x_out and xn hold `width` f32 each (a multiple of
        // 4: route_args' chunk check), 16-byte aligned (checked); the argument list matches the
        // kernel's.
        unsafe { b.launch(ROUTE_CLUSTER_LAUNCH) }.ctx("gemv_route_norm_<dt>_l<L>")?;
        Ok(())
    }

    /// The checks and scalar arguments the gemv_route kernels share (`op` names the caller in
    /// its refusals): x of `x_len` values for the router `w`, `shape`'s experts and top-k, and
    /// outputs of top-k.
    fn route_args(
        &self,
        op: &str,
        x_len: usize,
        w: &DeviceMatrix,
        shape: RouterShape,
        out_experts: &mut impl DevicePtrMut<u32>,
        out_weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<RouteArgs> {
        let RouterShape {
            experts,
            top_k,
            renormalise,
        } = shape;
        ensure(self.gemv_route_supported(experts), || {
            format!(
                "{op}: {experts} experts on compute capability {:?}; it needs sm_90+ and at \
                 most {GEMV_ROUTE_MAX_EXPERTS} (route_topk takes the others)",
                self.info().compute_capability
            )
        })?;
        ensure(w.rows() == experts, || {
            format!("{op}: the router has {} rows, not {experts}", w.rows())
        })?;
        let k = w.cols();
        let per_chunk = 16 / w.dtype().size();
        ensure(x_len == k && k.is_multiple_of(per_chunk), || {
            format!(
                "{op}: x holds {x_len} values for a router of {k} columns (a multiple of \
                 {per_chunk} for {} weights)",
                w.dtype()
            )
        })?;
        shape.check_top_k(op)?;
        ensure(
            out_experts.len() == top_k && out_weights.len() == top_k,
            || format!("{op}: outputs must hold {top_k}"),
        )?;
        let wp = w.device_ptr(self, "gemv_route w")?;
        ensure(wp.is_multiple_of(16), || {
            format!("{op}: w must start 16-byte aligned")
        })?;
        Ok(RouteArgs {
            w: wp,
            experts: to_i32(experts, "experts")?,
            k: to_i32(k, "k")?,
            top_k: to_i32(top_k, "top_k")?,
            renormalise: renormalise as i32,
            out_experts: self.ptr_mut(out_experts, "gemv_route experts")?,
            out_weights: self.ptr_mut(out_weights, "gemv_route weights")?,
        })
    }
}
