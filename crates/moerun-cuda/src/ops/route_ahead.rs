//! A MoE layer's routing from o_proj's input, at one token ("route ahead"; an experiment,
//! `MOERUN_CUDA_ROUTE_AHEAD=1` in moerun-model).
//!
//! The router reads the post-attention norm of `h = x + Wo a` (x the residual stream, a the
//! attention output): `logits = Wr (g * h / rms(h))`. By linearity that is
//! `(R x + M a) / rms(h)` with `R = Wr diag(g)` and `M = R Wo`, two products that need neither
//! o_proj's output nor the norm. [`CudaDevice::gemv_route_ahead`] makes them in o_proj's launch
//! (`kernels/gemv.cu` gemv_route_ahead: three GEMVs' blocks in one grid), and
//! [`CudaDevice::add_rms_norm_route`] (`kernels/fused.cu` add_rms_norm_route_f32) is the
//! add+RMSNorm before the MoE block whose last warp also routes from them: the experts by
//! `R x + M a` (whose order is the logits', as rms > 0) while the other warps finish the norm,
//! their weights once it has the rms.
//! The router GEMV launch and its L2 round trip leave the decode chain.
//!
//! [`CudaDevice::route_ahead_weights`] makes R and M once, at upload, summing in f64: f32 as is,
//! bf16 as hi and lo halves (two stacked copies of the rows, summed by the routing warp), within
//! ~2^-17 of the f64 products, where one bf16 rounding (2^-9) would move the logits enough to
//! change near-tied choices. The logits then differ from the router GEMV's in the last bits only,
//! like any other summation order.

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use moerun_core::DType;

use super::{blocks, to_i32, RouterShape};
use crate::error::{ensure, CudaError, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix};

/// Threads of add_rms_norm_route_f32 (`NORM_ROUTE_THREADS`): add_rms_norm's 1,024, the last
/// warp also routing.
const NORM_THREADS: u32 = 1024;
/// Weight rows of each gemv_route_ahead block (the block-rows layout's 4).
const ROWS_PER_BLOCK: usize = 4;
/// Experts the routing warp holds: 4 a lane (`add_rms_norm_route_f32_l4`).
pub const ROUTE_AHEAD_MAX_EXPERTS: usize = 128;
/// Choices a token makes at most: the rank of each is held by one lane.
const MAX_TOP_K: usize = 32;

pub(crate) struct RouteAheadKernels {
    /// route_ahead_weights_{bf16,f32}.
    weights: [CudaFunction; 2],
    /// gemv_route_ahead_{bf16,f32}.
    gemv: [CudaFunction; 2],
    /// add_rms_norm_route_f32_l{1,2,4}.
    norm: [CudaFunction; 3],
}

impl RouteAheadKernels {
    pub(crate) fn load(get: impl Fn(&str, &str) -> Result<CudaFunction>) -> Result<Self> {
        Ok(RouteAheadKernels {
            weights: [
                get("router", "route_ahead_weights_bf16")?,
                get("router", "route_ahead_weights_f32")?,
            ],
            gemv: [
                get("gemv", "gemv_route_ahead_bf16")?,
                get("gemv", "gemv_route_ahead_f32")?,
            ],
            norm: [
                get("fused", "add_rms_norm_route_f32_l1")?,
                get("fused", "add_rms_norm_route_f32_l2")?,
                get("fused", "add_rms_norm_route_f32_l4")?,
            ],
        })
    }
}

/// The route-ahead matrices of one MoE layer: `r` = R (`[parts * experts, hidden]`) and `m` = M
/// (`[parts * experts, attention width]`), each `parts` stacked copies (bf16: hi, lo; f32: one).
pub struct RouteAhead {
    r: DeviceMatrix,
    m: DeviceMatrix,
    experts: usize,
    parts: usize,
}

impl RouteAhead {
    /// Experts of the router it was made from.
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.r.byte_len() + self.m.byte_len()
    }
    /// Length of the products [`CudaDevice::gemv_route_ahead`] writes: `[M a; R x]`.
    pub fn z_len(&self) -> usize {
        2 * self.parts * self.experts
    }
}

/// gemv_route_ahead's arguments (`RouteAheadGemv` in kernels/gemv.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct RouteAheadGemv {
    wo: u64,
    a: u64,
    y: u64,
    n: i32,
    k: i32,
    m: u64,
    za: u64,
    nm: i32,
    r: u64,
    x: u64,
    zx: u64,
    nr: i32,
    kx: i32,
    br: i32,
    bm: i32,
}

// SAFETY: repr(C), plain integers and device addresses, laid out as the kernel's struct.
unsafe impl DeviceRepr for RouteAheadGemv {}

/// The slot of the route-ahead kernels for weights of `dtype`: bf16 (hi and lo rows) or f32;
/// f16 is refused (its lo halves would fall below f16's normal range).
fn slot(dtype: DType) -> Option<(usize, usize)> {
    match dtype {
        DType::BF16 => Some((0, 2)),
        DType::F32 => Some((1, 1)),
        _ => None,
    }
}

impl CudaDevice {
    /// Whether [`CudaDevice::route_ahead_weights`] takes a router of `experts` rows choosing
    /// `top_k`, with weights of `dtype`.
    pub fn route_ahead_supported(&self, experts: usize, top_k: usize, dtype: DType) -> bool {
        (1..=ROUTE_AHEAD_MAX_EXPERTS).contains(&experts)
            && (1..=MAX_TOP_K.min(experts)).contains(&top_k)
            && slot(dtype).is_some()
    }

    /// R = `router` diag(`norm`) and M = R `o_proj` of one MoE layer (see the module doc), from
    /// its router (`[experts, hidden]`), post-attention norm weights (`hidden`) and o_proj
    /// (`[hidden, width]`), in the weights' dtype.
    pub fn route_ahead_weights(
        &self,
        router: &DeviceMatrix,
        norm: &CudaSlice<f32>,
        o_proj: &DeviceMatrix,
    ) -> Result<RouteAhead> {
        let (experts, hidden, width) = (router.rows(), router.cols(), o_proj.cols());
        let dtype = router.dtype();
        let Some((s, parts)) = slot(dtype).filter(|_| o_proj.dtype() == dtype) else {
            return Err(CudaError::Unsupported(format!(
                "route ahead: a {} router with a {} o_proj (bf16 or f32, both alike)",
                dtype,
                o_proj.dtype()
            )));
        };
        ensure(
            o_proj.rows() == hidden && norm.len() == hidden && experts > 0,
            || {
                format!(
                    "route ahead: router [{experts}, {hidden}], norm {}, o_proj [{}, {width}]",
                    norm.len(),
                    o_proj.rows()
                )
            },
        )?;
        let make = |cols: usize, wo: Option<&DeviceMatrix>| -> Result<DeviceMatrix> {
            let mut out = self
                .stream
                .alloc_zeros::<u8>(parts * experts * cols * dtype.size())
                .ctx("allocating route-ahead weights")?;
            let rp = router.device_ptr(self, "route ahead router")?;
            let gp = self.ptr(norm, "route ahead norm")?;
            let wp = match wo {
                Some(w) => w.device_ptr(self, "route ahead o_proj")?,
                None => 0,
            };
            let op = self.ptr_mut(&mut out, "route ahead out")?;
            let (e_i, h_i, c_i) = (
                to_i32(experts, "experts")?,
                to_i32(hidden, "hidden")?,
                to_i32(cols, "cols")?,
            );
            let cfg = LaunchConfig {
                grid_dim: (blocks(cols, 256)?, experts as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self
                .stream
                .launch_builder(&self.kernels.route_ahead.weights[s]);
            b.arg(&rp)
                .arg(&gp)
                .arg(&wp)
                .arg(&e_i)
                .arg(&h_i)
                .arg(&c_i)
                .arg(&op);
            // SAFETY: router holds experts x hidden values of dtype, norm hidden f32, o_proj
            // (when given) hidden x cols, out parts x experts x cols; args match.
            unsafe { b.launch(cfg) }.ctx("route_ahead_weights")?;
            DeviceMatrix::from_parts(dtype, parts * experts, cols, out)
        };
        Ok(RouteAhead {
            r: make(hidden, None)?,
            m: make(width, Some(o_proj))?,
            experts,
            parts,
        })
    }

    /// One token's o_proj, `y = a · o_projᵀ` (the bits of [`CudaDevice::gemv`]), and the
    /// products its routing is made of, `z = [M a; R x]` (`ra.z_len()` values), in one launch.
    /// `x` is the residual stream before the attention block (`hidden` values).
    pub fn gemv_route_ahead(
        &self,
        a: &impl DevicePtr<f32>,
        x: &impl DevicePtr<f32>,
        o_proj: &DeviceMatrix,
        ra: &RouteAhead,
        y: &mut impl DevicePtrMut<f32>,
        z: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (hidden, width) = (o_proj.rows(), o_proj.cols());
        ensure(
            o_proj.dtype() == ra.m.dtype()
                && ra.m.cols() == width
                && ra.r.cols() == hidden
                && a.len() == width
                && x.len() == hidden
                && y.len() == hidden
                && z.len() == ra.z_len(),
            || {
                format!(
                    "gemv_route_ahead: a {}, x {}, y {}, z {} against o_proj [{hidden}, {width}] \
                     and route-ahead weights of {} experts",
                    a.len(),
                    x.len(),
                    y.len(),
                    z.len(),
                    ra.experts
                )
            },
        )?;
        let (s, _) = slot(o_proj.dtype()).ok_or_else(|| {
            CudaError::Unsupported(format!("gemv_route_ahead: {} weights", o_proj.dtype()))
        })?;
        let per_chunk = 16 / o_proj.dtype().size();
        ensure(
            width.is_multiple_of(per_chunk) && hidden.is_multiple_of(per_chunk),
            || format!("gemv_route_ahead: widths {width}, {hidden} not multiples of {per_chunk}"),
        )?;
        let ap = self.ptr(a, "gemv_route_ahead a")?;
        let xp = self.ptr(x, "gemv_route_ahead x")?;
        ensure(ap.is_multiple_of(16) && xp.is_multiple_of(16), || {
            "gemv_route_ahead: a and x must start 16-byte aligned".to_string()
        })?;
        let zp = self.ptr_mut(z, "gemv_route_ahead z")?;
        let rows = ra.parts * ra.experts;
        let (br, bm, bo) = (
            blocks(rows, ROWS_PER_BLOCK)?,
            blocks(rows, ROWS_PER_BLOCK)?,
            blocks(hidden, ROWS_PER_BLOCK)?,
        );
        let args = RouteAheadGemv {
            wo: o_proj.device_ptr(self, "gemv_route_ahead o_proj")?,
            a: ap,
            y: self.ptr_mut(y, "gemv_route_ahead y")?,
            n: to_i32(hidden, "hidden")?,
            k: to_i32(width, "width")?,
            m: ra.m.device_ptr(self, "gemv_route_ahead M")?,
            za: zp,
            nm: to_i32(rows, "rows")?,
            r: ra.r.device_ptr(self, "gemv_route_ahead R")?,
            x: xp,
            zx: zp + (rows * 4) as u64,
            nr: to_i32(rows, "rows")?,
            kx: to_i32(hidden, "hidden")?,
            br: br as i32,
            bm: bm as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (br + bm + bo, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(&self.kernels.route_ahead.gemv[s]);
        b.arg(&args);
        // SAFETY: every matrix and vector has the lengths checked above (M and R made for this
        // o_proj and router), rows 16-byte aligned; the grid covers the three GEMVs' rows.
        unsafe { b.launch(cfg) }.ctx("gemv_route_ahead")?;
        Ok(())
    }

    /// One token's `x += y; out = weight * x / rms(x)` (the bits of
    /// [`CudaDevice::add_rms_norm`]) and its MoE routing from `z` (made by
    /// [`CudaDevice::gemv_route_ahead`] for `ra`): the experts of the largest `R x + M a`, ties to
    /// the lower index, weighed by the softmax of `(R x + M a) / rms(x)` as
    /// [`CudaDevice::route_topk`] weighs logits.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_route(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        out: &mut impl DevicePtrMut<f32>,
        (z, ra): (&impl DevicePtr<f32>, &RouteAhead),
        shape: RouterShape,
        out_experts: &mut impl DevicePtrMut<u32>,
        out_weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let width = weight.len();
        ensure(
            width > 0
                && x.len() == width
                && y.len() == width
                && out.len() == width
                && z.len() == ra.z_len()
                && shape.experts == ra.experts
                && self.route_ahead_supported(shape.experts, shape.top_k, ra.m.dtype())
                && out_experts.len() == shape.top_k
                && out_weights.len() == shape.top_k,
            || {
                format!(
                    "add_rms_norm_route: one row of {width} (x {}, y {}, out {}), z {} for {} \
                     experts, {shape:?}, outputs {} / {}",
                    x.len(),
                    y.len(),
                    out.len(),
                    z.len(),
                    ra.experts,
                    out_experts.len(),
                    out_weights.len()
                )
            },
        )?;
        let xp = self.ptr_mut(x, "add_rms_norm_route x")?;
        let yp = self.ptr(y, "add_rms_norm_route y")?;
        let wp = self.ptr(weight, "add_rms_norm_route weight")?;
        let op = self.ptr_mut(out, "add_rms_norm_route out")?;
        let zp = self.ptr(z, "add_rms_norm_route z")?;
        let ep = self.ptr_mut(out_experts, "add_rms_norm_route experts")?;
        let gp = self.ptr_mut(out_weights, "add_rms_norm_route weights")?;
        let (width_i, experts_i, parts_i, k_i) = (
            to_i32(width, "width")?,
            to_i32(shape.experts, "experts")?,
            to_i32(ra.parts, "parts")?,
            to_i32(shape.top_k, "top_k")?,
        );
        let renorm_i = shape.renormalise as i32;
        // 1, 2 or 4 experts a lane: the fewest that hold them.
        let lane_slot = shape
            .experts
            .div_ceil(32)
            .next_power_of_two()
            .trailing_zeros() as usize;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(&self.kernels.route_ahead.norm[lane_slot]);
        b.arg(&xp)
            .arg(&yp)
            .arg(&wp)
            .arg(&op)
            .arg(&width_i)
            .arg(&eps)
            .arg(&zp)
            .arg(&experts_i)
            .arg(&parts_i)
            .arg(&k_i)
            .arg(&renorm_i)
            .arg(&ep)
            .arg(&gp);
        // SAFETY: x, y, out and weight hold width f32, z 2 x parts x experts, the outputs top_k
        // (checked); experts <= 128 (4 a lane in the widest build), top_k <= 32; args match.
        unsafe { b.launch(cfg) }.ctx("add_rms_norm_route_f32")?;
        Ok(())
    }
}
