//! The route ahead: one token's MoE routing beside the attention's output projection instead of
//! after it (`kernels/gemv.cu`'s `gemv_rows_route`, `kernels/moe.cu`'s `moe_tiny_gate_up_norm`).
//!
//! A MoE layer after attention routes `n(x + W_o a)`: `x` the residual, `a` the attention's
//! output, `n` the post-attention RMSNorm with weight `nw` and scale `inv = 1 / rms(x + W_o a)`.
//! The router's logits are `inv · u` with
//!
//! `u = R (nw ⊙ x) + F a`, `F = R diag(nw) W_o`,
//!
//! and `inv > 0` ranks nothing: the experts follow from `u`, which needs neither o_proj's output
//! nor the norm. [`CudaDevice::route_fold`] makes `F` once (f32, summed in f64) when a model is
//! uploaded; [`CudaDevice::gemv_route_ahead`] is then o_proj's GEMV with extra blocks that make
//! `u` and rank it (the ids); [`CudaDevice::moe_experts_norm_routed`] runs the experts with the
//! residual add and the norm folded into gate_up, whose spare block also makes the routing
//! weights from `u` and `inv` (softmax and renormalisation as the router's). On a batch-1 decode
//! step the router and its top-k left the layer's chain, where they were ~3.1 µs with DRAM idle
//! (H200, docs/perf/cuda-model.md v25).
//!
//! The logits differ from the router's `R · n(x + o)` by f32 rounding only (`F` is exact to one
//! f32 rounding; the sums run in another order), so the experts are the router's but where two
//! logits tie to within a few ulp.

use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::router::{RouterShape, GEMV_ROUTE_MAX_EXPERTS};
use super::{blocks, to_i32};
use crate::device::dtype_slot;
use crate::error::{ensure, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix};

/// Experts a route-ahead block makes `u` for (`RA_ROWS` in gemv.cu).
const ROUTE_ROWS_PER_BLOCK: usize = 2;
/// o_proj's rows per block (gemv_rows' layout).
const GEMV_ROWS_PER_BLOCK: usize = 4;
/// The most experts a token takes that the route ahead ranks: one lane each (`ranked[32]`).
pub const ROUTE_AHEAD_MAX_TOP_K: usize = 32;
/// The widest hidden size that routes ahead: the experts' gate_up
/// ([`CudaDevice::moe_experts_norm_routed`]) stages the normed row in shared memory, 48 KiB
/// without an opt-in.
pub const ROUTE_AHEAD_MAX_HIDDEN: usize = 12 * 1024;

/// One MoE layer's fold `F = R diag(nw) W_o` (`experts × width` f32) and the count its route
/// ahead's blocks arrive on (zero between launches: the last block resets it).
pub struct RouteAhead {
    fold: CudaSlice<f32>,
    arrived: CudaSlice<u32>,
    experts: usize,
    hidden: usize,
    width: usize,
}

impl RouteAhead {
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Device bytes the fold takes.
    pub fn byte_len(&self) -> usize {
        self.fold.len() * std::mem::size_of::<f32>()
    }
}

/// The router, the post-attention norm's weights and the residual a route ahead reads.
pub struct RouteInputs<'a, X: DevicePtr<f32>> {
    pub router: &'a DeviceMatrix,
    pub norm: &'a CudaSlice<f32>,
    pub x: &'a X,
}

impl CudaDevice {
    /// Whether forward passes route ahead where a layer allows it: yes, but for
    /// `MOERUN_CUDA_ROUTE_AHEAD=0` (a measuring knob: the router after the norm instead).
    pub fn route_ahead_wanted(&self) -> bool {
        static OFF: OnceLock<bool> = OnceLock::new();
        !*OFF.get_or_init(|| std::env::var_os("MOERUN_CUDA_ROUTE_AHEAD").is_some_and(|v| v == "0"))
    }

    /// Whether a layer of this router and output projection can route ahead: at most
    /// [`GEMV_ROUTE_MAX_EXPERTS`] experts (one routing warp of 4 a lane) and
    /// [`ROUTE_AHEAD_MAX_HIDDEN`] hidden values, the router's columns
    /// the projection's rows, whole 16-byte chunks of both, and `F`'s rows of whole float4s.
    pub fn route_ahead_supported(&self, router: &DeviceMatrix, o_proj: &DeviceMatrix) -> bool {
        let chunk = |m: &DeviceMatrix| 16 / m.dtype().size();
        router.rows() <= GEMV_ROUTE_MAX_EXPERTS
            && router.cols() <= ROUTE_AHEAD_MAX_HIDDEN
            && router.cols() == o_proj.rows()
            && router.dtype() == o_proj.dtype()
            && router.cols().is_multiple_of(chunk(router))
            && o_proj.cols().is_multiple_of(chunk(o_proj))
    }

    /// `F = R diag(norm) W_o` for a layer's route ahead (`route_fold_<dt>`: grid
    /// (ceil(width / 256), experts), block 256; each value summed in f64 over the hidden size in
    /// ascending order, rounded to f32 once). Refused where
    /// [`CudaDevice::route_ahead_supported`] is false.
    pub fn route_fold(
        &self,
        router: &DeviceMatrix,
        norm: &CudaSlice<f32>,
        o_proj: &DeviceMatrix,
    ) -> Result<RouteAhead> {
        ensure(self.route_ahead_supported(router, o_proj), || {
            format!(
                "route_fold: a router of {} x {} ({}) and an output projection of {} x {} ({}) \
                 cannot route ahead",
                router.rows(),
                router.cols(),
                router.dtype(),
                o_proj.rows(),
                o_proj.cols(),
                o_proj.dtype()
            )
        })?;
        let (experts, hidden, width) = (router.rows(), router.cols(), o_proj.cols());
        ensure(norm.len() == hidden, || {
            format!(
                "route_fold: {} norm weights for a hidden size of {hidden}",
                norm.len()
            )
        })?;
        let mut fold = self.alloc_f32(experts * width)?;
        let arrived = self.zeros::<u32>(1)?;
        let rp = router.device_ptr(self, "route_fold router")?;
        let op = o_proj.device_ptr(self, "route_fold o_proj")?;
        let np = self.ptr(norm, "route_fold norm")?;
        let fp = self.ptr_mut(&mut fold, "route_fold fold")?;
        let (hidden_i, width_i) = (to_i32(hidden, "hidden")?, to_i32(width, "width")?);
        let cfg = LaunchConfig {
            grid_dim: (blocks(width, 256)?, experts as u32, 1), // experts <= 128
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let func = &self.kernels.route_fold[dtype_slot(router.dtype())];
        let mut b = self.stream.launch_builder(func);
        b.arg(&rp)
            .arg(&np)
            .arg(&op)
            .arg(&hidden_i)
            .arg(&width_i)
            .arg(&fp);
        // SAFETY: the router holds experts x hidden and o_proj hidden x width elements of the
        // kernel's dtype (checked equal), norm hidden f32, fold experts x width f32; the grid
        // covers width columns and the experts rows.
        unsafe { b.launch(cfg) }.ctx("route_fold_<dt>")?;
        Ok(RouteAhead {
            fold,
            arrived,
            experts,
            hidden,
            width,
        })
    }

    /// One token's `y = o_proj · a` (gemv_rows' bits) and, in the same launch, the route ahead of
    /// the MoE layer after it: `u` (experts f32, the logits up to the norm's scale) and `ids`
    /// (top-k, rank order; set to u32::MAX until they are ranked: the experts' launch after this
    /// one polls them to start streaming early) from `u = R (nw ⊙ x) + F a`. Launch: grid ceil(E / 2) + ceil(H / 4),
    /// block 256 (the route blocks first). Under programmatic launch `x` and `norm` are read
    /// before the kernel waits (graph::EARLY_ACTIVATION_READERS).
    pub fn gemv_route_ahead<X: DevicePtr<f32>>(
        &self,
        a: &impl DevicePtr<f32>,
        o_proj: &DeviceMatrix,
        y: &mut impl DevicePtrMut<f32>,
        inputs: RouteInputs<'_, X>,
        (ahead, shape): (&RouteAhead, RouterShape),
        (u, ids): (&mut impl DevicePtrMut<f32>, &mut impl DevicePtrMut<u32>),
    ) -> Result<()> {
        let RouteInputs { router, norm, x } = inputs;
        let (experts, hidden, width) = (ahead.experts, ahead.hidden, ahead.width);
        ensure(
            router.rows() == experts
                && router.cols() == hidden
                && o_proj.rows() == hidden
                && o_proj.cols() == width
                && shape.experts == experts,
            || {
                format!(
                    "gemv_route_ahead: a fold of {experts} experts, hidden {hidden}, width \
                     {width} for a router of {} x {}, an o_proj of {} x {} and {} experts",
                    router.rows(),
                    router.cols(),
                    o_proj.rows(),
                    o_proj.cols(),
                    shape.experts
                )
            },
        )?;
        let most = experts.min(ROUTE_AHEAD_MAX_TOP_K);
        ensure((1..=most).contains(&shape.top_k), || {
            format!(
                "gemv_route_ahead: top_k {} must be in 1..={most} ({experts} experts; the last \
                 block's warp ranks at most {ROUTE_AHEAD_MAX_TOP_K})",
                shape.top_k
            )
        })?;
        ensure(
            a.len() == width
                && x.len() == hidden
                && norm.len() == hidden
                && y.len() == hidden
                && u.len() == experts
                && ids.len() == shape.top_k,
            || {
                format!(
                    "gemv_route_ahead: a {}, x {}, norm {}, y {}, u {}, ids {} for width \
                     {width}, hidden {hidden}, {experts} experts, top-{}",
                    a.len(),
                    x.len(),
                    norm.len(),
                    y.len(),
                    u.len(),
                    ids.len(),
                    shape.top_k
                )
            },
        )?;
        let wp = o_proj.device_ptr(self, "gemv_route_ahead o_proj")?;
        let rp = router.device_ptr(self, "gemv_route_ahead router")?;
        let ap = self.ptr(a, "gemv_route_ahead a")?;
        let xp = self.ptr(x, "gemv_route_ahead x")?;
        let np = self.ptr(norm, "gemv_route_ahead norm")?;
        let fp = self.ptr(&ahead.fold, "gemv_route_ahead fold")?;
        // The count is zero before and after every launch (its last block resets it).
        let cp = self.ptr(&ahead.arrived, "gemv_route_ahead count")?;
        let yp = self.ptr_mut(y, "gemv_route_ahead y")?;
        let up = self.ptr_mut(u, "gemv_route_ahead u")?;
        let ip = self.ptr_mut(ids, "gemv_route_ahead ids")?;
        ensure(
            [wp, rp, ap, xp, np, fp]
                .iter()
                .all(|p| p.is_multiple_of(16)),
            || {
                "gemv_route_ahead: o_proj, router, a, x, norm and the fold must start 16-byte aligned".to_string()
            },
        )?;
        if crate::skip::skipped("gemv_route") {
            return Ok(());
        }
        let route_blocks = experts.div_ceil(ROUTE_ROWS_PER_BLOCK);
        let cfg = LaunchConfig {
            grid_dim: (
                (route_blocks as u32) + blocks(hidden, GEMV_ROWS_PER_BLOCK)?,
                1,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, k_i) = (to_i32(hidden, "hidden")?, to_i32(width, "width")?);
        let (experts_i, top_k_i) = (to_i32(experts, "experts")?, to_i32(shape.top_k, "top_k")?);
        let func = &self.kernels.gemv_rows_route[dtype_slot(o_proj.dtype())][shape.lane_slot()];
        let mut b = self.stream.launch_builder(func);
        b.arg(&wp).arg(&ap).arg(&yp).arg(&n_i).arg(&k_i);
        b.arg(&rp).arg(&fp).arg(&xp).arg(&np);
        b.arg(&experts_i).arg(&n_i).arg(&top_k_i);
        b.arg(&up).arg(&ip).arg(&cp);
        // SAFETY: o_proj holds hidden x width and the router experts x hidden elements of one
        // dtype, whole 16-byte chunks (route_ahead_supported, checked by route_fold); the fold
        // experts x width f32 (width a multiple of 4: whole chunks); a width, x, norm and y
        // hidden, u experts f32, ids top_k u32 (checked); the count one u32, zero on entry; the
        // grid is the route blocks then o_proj's; the argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("gemv_rows_route_<dt>_l<L>")?;
        Ok(())
    }
}
