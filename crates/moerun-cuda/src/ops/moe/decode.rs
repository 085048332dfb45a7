//! The decode path of [`CudaDevice::moe_experts`] (`kernels/moe.cu`): three launches whose grids
//! come from host-known bounds only, no host synchronisation, no allocation, so it can be
//! captured in a CUDA graph. With P = n · k pairs and S = min(E + 1, P) expert slots:
//!
//! 1. `moe_align`: grid 1, block 1024, 8 (E + 1) bytes of shared memory. Groups the pairs by
//!    expert (offsets, pair lists, the ascending list of non-empty groups) and zeroes the arrival
//!    counters of step 3.
//! 2. `moe_gate_up_<dt>_m<M>`: grid (ceil(I / 8), S), block 256. A warp per intermediate index
//!    streams its gate and up rows once per pass of up to M of the expert's tokens and writes
//!    `silu(gate · x) · (up · x)` (f32) per pair. Slots past the non-empty groups exit at once.
//! 3. `moe_down_<dt>_m<M>`: grid (ceil(H / 32), S), block 256. A warp per 4 down rows writes each
//!    pair's expert output rows, then counts an arrival per token and row tile; the block with a
//!    token's k-th arrival sums that tile of `out[t]` over ranks 0..k in order.
//!
//! At most 32 pairs ([`DecodePass::Tiny`], batch 1-4 at top-8) skip step 1:
//!
//! - `moe_tiny_gate_up_<dt>`: grid (ceil(I / 16), min(E, P)), block 256. Every warp finds its
//!   slot's expert among the ≤ 32 ids with one match/ballot (one token: slot s is pair s, read
//!   straight from the ids, unless `MOERUN_CUDA_TINY_DIRECT=0`), then works as
//!   step 2 for two intermediate indices (one wave of blocks for Qwen3-30B-A3B's 8 experts x 768).
//! - `moe_tiny_down_<dt>`: grid (ceil(H / 4), n), block 256. Block (bx, t) computes token t's 4
//!   rows for all k ranks (a warp per rank) into shared memory and sums them in rank order.
//!
//! Each output is one f32 fmaf chain per lane in a fixed order plus a butterfly, and the ranks
//! are summed by one fmaf chain in rank order, the same in every variant and independent of how
//! many tokens an expert has: a token's result does not depend on the rest of the batch, bit for
//! bit. Against the f32 CPU reference: ~1e-7 relative (summation order only).

use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{
    decode_kernel, DecodePass, DeviceExperts, MoeCall, MoeScratch, DOWN_TILE, GATE_UP_TILE,
    TINY_DOWN_ROWS, TINY_GATE_UP_TILE,
};
use crate::device::dtype_slot;
use crate::error::{ensure, DriverContext, Result};
use crate::ops::route_ahead::ROUTE_AHEAD_MAX_HIDDEN;
use crate::ops::router::GEMV_ROUTE_MAX_EXPERTS;
use crate::ops::{blocks, to_i32};
use crate::CudaDevice;

/// Whether the tiny gate_up takes one token's pairs straight from the ids, a block row per pair
/// (`direct`, kernels/moe.cu), instead of grouping them by expert with a warp match: batch 1
/// decoded 415.7-418.3 tok/s against 411.0-413.3 grouping (H200, docs/perf/cuda-model.md v18).
/// `MOERUN_CUDA_TINY_DIRECT=0` groups (an A/B knob). The same h either way.
fn tiny_direct_wanted() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("MOERUN_CUDA_TINY_DIRECT").is_none_or(|v| v != "0"))
}

impl CudaDevice {
    pub(super) fn moe_decode(
        &self,
        c: &MoeCall,
        w: &DeviceExperts,
        s: &mut MoeScratch,
    ) -> Result<()> {
        let pairs = c.tokens * c.top_k;
        let pass = s
            .pass
            .unwrap_or_else(|| DecodePass::for_pairs(pairs, w.experts));
        if pass == DecodePass::Tiny {
            return self.moe_decode_tiny(c, w, s);
        }
        let groups = w.experts + 1;
        let slots = groups.min(pairs);
        let tiles = w.hidden.div_ceil(DOWN_TILE);
        self.moe_align(c, w, s, c.tokens * tiles)?;

        let k = &self.kernels.moe;
        let offsets = self.ptr(&s.offsets, "moe offsets")?;
        let pair_list = self.ptr(&s.pairs, "moe pairs")?;
        let active = self.ptr(&s.active, "moe active")?;
        let h = self.ptr_mut(&mut s.inner, "moe h")?;
        let y = self.ptr_mut(&mut s.outer, "moe y")?;
        let arrivals = self.ptr_mut(&mut s.arrivals, "moe arrivals")?;
        let gate_up = self.ptr(&w.gate_up, "moe gate_up")?;
        let down = self.ptr(&w.down, "moe down")?;
        let (experts_i, hidden_i, inter_i, k_i) = (
            to_i32(w.experts, "experts")?,
            to_i32(w.hidden, "hidden")?,
            to_i32(w.intermediate, "intermediate")?,
            to_i32(c.top_k, "top_k")?,
        );
        let slots_u = slots as u32; // <= E + 1 <= MAX_EXPERTS + 1

        let cfg = LaunchConfig {
            grid_dim: (blocks(w.intermediate, GATE_UP_TILE)?, slots_u, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(decode_kernel(&k.gate_up, w.dtype, pass));
        b.arg(&gate_up).arg(&c.x).arg(&offsets).arg(&pair_list);
        b.arg(&active).arg(&h);
        b.arg(&experts_i).arg(&hidden_i).arg(&inter_i).arg(&k_i);
        let act = w.activation().code();
        b.arg(&act);
        // SAFETY: gate_up holds E · 2I · H elements of the kernel's dtype with H a multiple of its
        // 16-byte chunk; x holds n · H f32 (16-byte aligned); offsets, pairs and active were
        // written by moe_align for these P pairs (pair indices < P, so tokens < n); h holds
        // P_max · I f32 >= P · I; the grid's y dimension is the slots moe_align filled.
        unsafe { b.launch(cfg) }.ctx("moe_gate_up")?;

        let cfg = LaunchConfig {
            grid_dim: (blocks(w.hidden, DOWN_TILE)?, slots_u, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(decode_kernel(&k.down, w.dtype, pass));
        b.arg(&down).arg(&h).arg(&offsets).arg(&pair_list);
        b.arg(&active)
            .arg(&c.weights)
            .arg(&y)
            .arg(&c.out)
            .arg(&arrivals);
        b.arg(&experts_i).arg(&hidden_i).arg(&inter_i).arg(&k_i);
        // SAFETY: down holds E · H · I elements (I a multiple of the chunk); h was written for
        // every valid pair by the launch above; weights hold n · k f32, y P_max · H f32, out
        // n · H f32; arrivals hold max_tokens · tiles counters, zeroed by moe_align for the n
        // tokens, and gridDim.x = tiles.
        unsafe { b.launch(cfg) }.ctx("moe_down")?;
        Ok(())
    }

    /// [`DecodePass::Tiny`]: two launches, no alignment (see the module doc).
    fn moe_decode_tiny(&self, c: &MoeCall, w: &DeviceExperts, s: &mut MoeScratch) -> Result<()> {
        let pairs = c.tokens * c.top_k;
        ensure(pairs <= DecodePass::TINY_PAIRS, || {
            format!(
                "moe_experts: the tiny decode pass takes at most {} pairs, not {pairs}",
                DecodePass::TINY_PAIRS
            )
        })?;
        let k = &self.kernels.moe;
        let slot = dtype_slot(w.dtype);
        let h = self.ptr_mut(&mut s.inner, "moe h")?;
        let gate_up = self.ptr(&w.gate_up, "moe gate_up")?;
        let down = self.ptr(&w.down, "moe down")?;
        let (pairs_i, experts_i, hidden_i, inter_i, k_i) = (
            to_i32(pairs, "pairs")?,
            to_i32(w.experts, "experts")?,
            to_i32(w.hidden, "hidden")?,
            to_i32(w.intermediate, "intermediate")?,
            to_i32(c.top_k, "top_k")?,
        );

        let cfg = LaunchConfig {
            grid_dim: (
                blocks(w.intermediate, TINY_GATE_UP_TILE)?,
                w.experts.min(pairs) as u32, // <= 32
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&k.tiny_gate_up[slot]);
        b.arg(&gate_up).arg(&c.x).arg(&c.ids).arg(&pairs_i).arg(&h);
        b.arg(&experts_i).arg(&hidden_i).arg(&inter_i).arg(&k_i);
        let act = w.activation().code();
        let direct = i32::from(tiny_direct_wanted() && c.tokens == 1 && pairs <= w.experts);
        b.arg(&act).arg(&direct);
        if !crate::skip::skipped("moe_gate_up") {
            // SAFETY: gate_up holds E · 2I · H elements (H a multiple of the 16-byte chunk); x holds
            // n · H f32, 16-byte aligned; ids hold P <= 32 u32 (only ids < E index the weights); h
            // holds P_max · I >= P · I f32; `direct` only with one token's P <= E pairs, so the
            // grid's min(E, P) = P rows of blocks take pairs 0..P.
            unsafe { b.launch(cfg) }.ctx("moe_tiny_gate_up")?;
        }

        let cfg = LaunchConfig {
            grid_dim: (blocks(w.hidden, TINY_DOWN_ROWS)?, c.tokens as u32, 1), // n <= 32
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&k.tiny_down[slot]);
        b.arg(&down).arg(&h).arg(&c.ids).arg(&c.weights).arg(&c.out);
        b.arg(&experts_i).arg(&hidden_i).arg(&inter_i).arg(&k_i);
        if !crate::skip::skipped("moe_down") {
            // SAFETY: down holds E · H · I elements (I a multiple of the chunk); h was written above
            // for every pair with an in-range id (the others are never read: their rows are NaN);
            // ids and weights hold n · k <= 32 entries (k <= 32, the kernel's shared rows), out n · H
            // f32.
            unsafe { b.launch(cfg) }.ctx("moe_tiny_down")?;
        }
        Ok(())
    }

    /// One token's routed experts behind the route ahead ([`CudaDevice::gemv_route_ahead`]), with
    /// the residual add and the post-attention RMSNorm folded in: `x_out = x + r`, the experts
    /// `ids` (rank order) run on `norm ⊙ x_out / rms(x_out)`, their
    /// routing weights (written to `weights`, top-k of them) made from the route ahead's `u` and
    /// the norm's scale as the router makes
    /// them (softmax over all experts, renormalised where `renormalise`), `out` their weighted
    /// sum in rank order. Two launches: `moe_tiny_gate_up_norm_<dt>` (grid (ceil(I / 16),
    /// k + 1): block row k makes x_out and the weights) and `moe_tiny_down_late_<dt>` (the
    /// tiny down, reading the weights after its wait).
    #[allow(clippy::too_many_arguments)] // the add+norm's arguments, then the route's
    pub fn moe_experts_norm_routed(
        &self,
        (x, r, norm, eps): (
            &impl DevicePtr<f32>,
            &impl DevicePtr<f32>,
            &CudaSlice<f32>,
            f32,
        ),
        x_out: &mut impl DevicePtrMut<f32>,
        (u, ids, renormalise): (&impl DevicePtr<f32>, &impl DevicePtr<u32>, bool),
        weights: &mut impl DevicePtrMut<f32>,
        experts: &DeviceExperts,
        scratch: &mut MoeScratch,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (e, h, i) = (experts.experts, experts.hidden, experts.intermediate);
        let k = weights.len();
        ensure(
            (scratch.experts, scratch.hidden, scratch.intermediate) == (e, h, i),
            || {
                format!(
                    "moe_experts_norm_routed: scratch made for {} experts of H {}, I {}; these \
                     are {e} of H {h}, I {i}",
                    scratch.experts, scratch.hidden, scratch.intermediate
                )
            },
        )?;
        ensure(h <= ROUTE_AHEAD_MAX_HIDDEN, || {
            format!(
                "moe_experts_norm_routed: a hidden size of {h}; its gate_up stages at most \
                 {ROUTE_AHEAD_MAX_HIDDEN} values in shared memory"
            )
        })?;
        ensure(
            (1..=scratch.top_k.min(e).min(DecodePass::TINY_PAIRS)).contains(&k)
                && e <= GEMV_ROUTE_MAX_EXPERTS,
            || {
                format!(
                    "moe_experts_norm_routed: top-{k} of {e} experts (one token's pass takes \
                     1..={} of at most {GEMV_ROUTE_MAX_EXPERTS})",
                    scratch.top_k.min(e).min(DecodePass::TINY_PAIRS)
                )
            },
        )?;
        ensure(
            [x.len(), r.len(), norm.len(), x_out.len(), out.len()] == [h; 5]
                && u.len() == e
                && ids.len() == k
                && eps.is_finite(),
            || {
                format!(
                    "moe_experts_norm_routed: x {}, r {}, norm {}, x_out {}, out {} for H {h}; \
                     u {} for {e} experts, ids {} for top-{k} (eps {eps})",
                    x.len(),
                    r.len(),
                    norm.len(),
                    x_out.len(),
                    out.len(),
                    u.len(),
                    ids.len()
                )
            },
        )?;
        let xp = self.ptr(x, "moe_experts_norm_routed x")?;
        let rp = self.ptr(r, "moe_experts_norm_routed r")?;
        let np = self.ptr(norm, "moe_experts_norm_routed norm")?;
        let xo = self.ptr_mut(x_out, "moe_experts_norm_routed x_out")?;
        let up = self.ptr(u, "moe_experts_norm_routed u")?;
        let ip = self.ptr(ids, "moe_experts_norm_routed ids")?;
        let wp = self.ptr_mut(weights, "moe_experts_norm_routed weights")?;
        let op = self.ptr_mut(out, "moe_experts_norm_routed out")?;
        ensure(
            [xp, rp, np, xo].iter().all(|p| p.is_multiple_of(16)),
            || {
                "moe_experts_norm_routed: x, r, norm and x_out must start 16-byte aligned"
                    .to_string()
            },
        )?;
        let kernels = &self.kernels.moe;
        let slot = dtype_slot(experts.dtype);
        let hp = self.ptr_mut(&mut scratch.inner, "moe h")?;
        let gate_up = self.ptr(&experts.gate_up, "moe gate_up")?;
        let down = self.ptr(&experts.down, "moe down")?;
        let (experts_i, hidden_i, inter_i, k_i) = (
            to_i32(e, "experts")?,
            to_i32(h, "hidden")?,
            to_i32(i, "intermediate")?,
            to_i32(k, "top_k")?,
        );
        let act = experts.activation().code();
        let renormalise = i32::from(renormalise);
        let cfg = LaunchConfig {
            grid_dim: (blocks(i, TINY_GATE_UP_TILE)?, k as u32 + 1, 1), // k <= 32
            block_dim: (256, 1, 1),
            // The staged s * nw: H f32 (<= ROUTE_AHEAD_MAX_HIDDEN: within the 48 KiB default).
            shared_mem_bytes: (h * 4) as u32,
        };
        let mut b = self.stream.launch_builder(&kernels.tiny_gate_up_norm[slot]);
        b.arg(&gate_up)
            .arg(&xp)
            .arg(&rp)
            .arg(&np)
            .arg(&eps)
            .arg(&xo);
        b.arg(&up).arg(&ip).arg(&hp).arg(&wp);
        b.arg(&experts_i).arg(&hidden_i).arg(&inter_i).arg(&k_i);
        b.arg(&act).arg(&renormalise);
        if !crate::skip::skipped("moe_gate_up") {
            // SAFETY: gate_up holds E · 2I · H elements (H a multiple of the 16-byte chunk); x, r,
            // norm and x_out hold H f32, 16-byte aligned; u holds E <= 128 f32 and ids k u32
            // (only ids < E index the weights); h holds P_max · I >= k · I f32; weights k f32;
            // block rows 0..k take pairs 0..k, row k the norm and the weights.
            unsafe { b.launch(cfg) }.ctx("moe_tiny_gate_up_norm")?;
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks(h, TINY_DOWN_ROWS)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&kernels.tiny_down_late[slot]);
        b.arg(&down).arg(&hp).arg(&ip).arg(&wp).arg(&op);
        b.arg(&experts_i).arg(&hidden_i).arg(&inter_i).arg(&k_i);
        if !crate::skip::skipped("moe_down") {
            // SAFETY: as moe_tiny_down's in moe_decode_tiny, for one token of k <= 32 pairs; the
            // weights come from the launch above, read after the wait.
            unsafe { b.launch(cfg) }.ctx("moe_tiny_down_late")?;
        }
        Ok(())
    }

    /// Launch `moe_align` for the call's pairs, zeroing `clear` arrival counters.
    pub(super) fn moe_align(
        &self,
        c: &MoeCall,
        w: &DeviceExperts,
        s: &mut MoeScratch,
        clear: usize,
    ) -> Result<()> {
        let pairs = c.tokens * c.top_k;
        let groups = w.experts + 1;
        let (pairs_i, experts_i, slots_i, clear_i) = (
            to_i32(pairs, "pairs")?,
            to_i32(w.experts, "experts")?,
            to_i32(groups.min(pairs), "slots")?,
            to_i32(clear, "arrival counters")?,
        );
        let offsets = self.ptr_mut(&mut s.offsets, "moe offsets")?;
        let pair_list = self.ptr_mut(&mut s.pairs, "moe pairs")?;
        let pos = self.ptr_mut(&mut s.pos, "moe pos")?;
        let active = self.ptr_mut(&mut s.active, "moe active")?;
        let arrivals = self.ptr_mut(&mut s.arrivals, "moe arrivals")?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: (8 * groups) as u32, // <= 16 KiB for MAX_EXPERTS
        };
        let mut b = self.stream.launch_builder(&self.kernels.moe.align);
        b.arg(&c.ids)
            .arg(&pairs_i)
            .arg(&experts_i)
            .arg(&slots_i)
            .arg(&clear_i);
        b.arg(&offsets)
            .arg(&pair_list)
            .arg(&pos)
            .arg(&active)
            .arg(&arrivals);
        // SAFETY: ids hold P u32; offsets E + 2, pairs and pos P_max >= P, active
        // min(E + 1, P_max) >= slots, arrivals max_tokens · tiles >= clear; shared memory holds
        // two u32 per group; the argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("moe_align")?;
        Ok(())
    }
}
