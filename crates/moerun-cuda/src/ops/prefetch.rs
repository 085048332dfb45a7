//! Prefetch into L2 by the bulk copy engine (`cp.async.bulk.prefetch.L2`, sm_90+;
//! `prefetch_l2_share` in kernels/common.cuh): while a latency-bound step of a decode layer runs
//! (attention, a norm, routing), DRAM idles; a kernel launched early under programmatic
//! dependent launch can have the weights of what comes next pulled into L2 meanwhile, one
//! instruction per 64 KiB from one thread per block, without holding registers or waiting.
//!
//! Which prefetches run is a set of flags, [`L2Prefetch`], process-wide; the default is
//! [`DEFAULT_L2_PREFETCH`], `MOERUN_CUDA_L2_PREFETCH=<bits>` or [`CudaDevice::set_l2_prefetch`]
//! choose others (to measure them against each other). A prefetch is only a hint: results are
//! the same bits with any flags.

use std::sync::atomic::Ordering;

use crate::CudaDevice;

/// The bits of `MOERUN_CUDA_L2_PREFETCH` (`PREFETCH_*` in kernels/common.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L2Prefetch(pub u32);

impl L2Prefetch {
    /// A decode GEMV's first blocks pull its whole matrix (when it fits in half of L2) before
    /// their wait: q/k/v during the input norm, o_proj during attention, the router during the
    /// post-attention norm.
    pub const GEMV: u32 = 1;
    /// Each block of the tiny MoE gate_up kernel pulls a piece of its expert's down matrix once
    /// routing is known, so the down kernel reads L2 while gate_up streams its own rows.
    pub const EXPERT_DOWN: u32 = 2;
    /// The prefetched lines take the evict_last priority (the gate_up stream passing through L2
    /// meanwhile then evicts its own lines first).
    pub const KEEP: u32 = 4;
    const ALL: u32 = Self::GEMV | Self::EXPERT_DOWN | Self::KEEP;
}

/// The flags a device opens with when `MOERUN_CUDA_L2_PREFETCH` is not set.
pub const DEFAULT_L2_PREFETCH: L2Prefetch = L2Prefetch(L2Prefetch::GEMV | L2Prefetch::EXPERT_DOWN);

/// The flags of `MOERUN_CUDA_L2_PREFETCH` (a number, bits of [`L2Prefetch`]; unknown bits are
/// dropped), else the default.
pub(crate) fn l2_prefetch_from_env() -> L2Prefetch {
    std::env::var("MOERUN_CUDA_L2_PREFETCH")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .map(|bits| L2Prefetch(bits & L2Prefetch::ALL))
        .unwrap_or(DEFAULT_L2_PREFETCH)
}

impl CudaDevice {
    /// Which L2 prefetches the decode kernels issue from now on (see the module doc).
    pub fn set_l2_prefetch(&self, flags: L2Prefetch) {
        self.l2_prefetch
            .store(flags.0 & L2Prefetch::ALL, Ordering::Relaxed);
    }

    /// The L2 prefetch flags in force.
    pub fn l2_prefetch(&self) -> L2Prefetch {
        L2Prefetch(self.l2_prefetch.load(Ordering::Relaxed))
    }

    /// A GEMV's `(prefetch, pf_parts)` kernel arguments for a matrix of `bytes` in a grid of
    /// `blocks`: a piece per SM (at most one per block), only for matrices up to half of L2 (a
    /// bigger one, the LM head, would evict its own lines before they are read).
    pub(crate) fn gemv_prefetch_args(&self, bytes: usize, blocks: u32) -> (u32, i32) {
        let flags = self.l2_prefetch().0;
        if flags & L2Prefetch::GEMV == 0 || bytes > self.info().l2_bytes / 2 {
            return (0, 0);
        }
        let parts = self.info().multiprocessors.min(blocks).max(1);
        (flags, parts as i32)
    }

    /// The tiny gate_up kernel's `prefetch` argument.
    pub(crate) fn expert_down_prefetch_arg(&self) -> u32 {
        let flags = self.l2_prefetch().0;
        if flags & L2Prefetch::EXPERT_DOWN == 0 {
            0
        } else {
            flags
        }
    }
}
