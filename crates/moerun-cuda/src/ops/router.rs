//! MoE routing on the device (`kernels/router.cu`): softmax of the router logits in f32, top-k by
//! probability with ties to the lower expert index, optional renormalisation of the k weights,
//! exactly the steps of moerun-model's `route`.
//!
//! Launch: block (32, 4), grid ceil(tokens / 4); one warp per token holding its experts'
//! probabilities in registers (the build with the fewest per lane that hold them all: 1, 2, 4,
//! 8 or 16), k rounds of a warp arg-max (two redux.sync each).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{blocks, to_i32};
use crate::error::{ensure, DriverContext, Result};
use crate::CudaDevice;

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
        let RouterShape {
            experts,
            top_k,
            renormalise,
        } = shape;
        ensure((1..=MAX_EXPERTS).contains(&experts), || {
            format!("route_topk: {experts} experts, supported 1..={MAX_EXPERTS}")
        })?;
        ensure((1..=experts).contains(&top_k), || {
            format!("route_topk: top_k {top_k} must be in 1..={experts}")
        })?;
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
        // The build holding 2^slot experts per lane, the fewest that hold them all.
        let slot = experts.div_ceil(32).next_power_of_two().trailing_zeros() as usize;
        let mut b = self.stream.launch_builder(&self.kernels.route_topk[slot]);
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
