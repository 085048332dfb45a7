//! The ops of the forward pass on a [`CudaDevice`](crate::CudaDevice), one file per kernel family,
//! each a thin wrapper that checks shapes, then launches the kernel of the same name under
//! `kernels/`. Activations are f32 buffers; weights are [`DeviceMatrix`](crate::DeviceMatrix)es in
//! their stored dtype. Every op only enqueues work on the device's stream; nothing waits.
//!
//! Each wrapper documents its kernel's launch shape; the `.cu` file repeats it beside the kernel.

mod activation;
mod attention;
mod attention_fold;
mod attention_wgmma;
mod elementwise;
mod embedding;
pub(crate) mod fused;
mod gated_delta;
mod gemm;
mod gemma;
mod gemma_tail;
mod gemv;
mod moe;
mod norm;
mod rope;
pub(crate) mod route_ahead;
mod router;
mod tma;

pub(crate) use attention::AttentionKernels;
pub use attention::{
    AttentionPrefill, AttentionScratch, AttentionShape, BatchKvBf16, DeviceKvPool, KvBuffers,
    KvBuffersMut, KvDtype, TokenPlacement,
};
pub use attention_fold::FoldedPrologue;
pub(crate) use elementwise::ElementwiseKernels;
pub use elementwise::{ArgmaxScratch, NextStepInputs};
pub(crate) use fused::FusedKernels;
pub use fused::{QkvShape, FUSED_MAX_HEAD_DIM};
pub(crate) use gated_delta::GatedDeltaKernels;
pub use gated_delta::{DeltaSeqs, DeltaShape, DELTA_MAX_KEY_DIM, DELTA_MAX_TAPS};
pub use gemm::GemmOut;
pub(crate) use gemma::GemmaKernels;
pub use gemma_tail::{AttnTailNorms, AttnTailOut, FfnTail, RouterNorms, GEMMA_TAIL_MAX_WIDTH};
pub use gemv::{AddNormGrid, GemvLayout};
pub(crate) use moe::MoeKernels;
pub use moe::{DecodePass, DeviceExperts, ExpertActivation, MoePath, MoeScratch, WgmmaTile};
pub use rope::DeviceRope;
pub use route_ahead::{RouteAhead, RouteInputs, ROUTE_AHEAD_MAX_TOP_K};
pub use router::RouterShape;

use crate::error::{CudaError, Result};

/// `v` as a kernel's `int` argument, or an error naming what overflowed.
pub(crate) fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::InvalidArgument(format!("{what} ({v}) exceeds i32")))
}

/// Blocks of `per` items covering `n`.
pub(crate) fn blocks(n: usize, per: usize) -> Result<u32> {
    u32::try_from(n.div_ceil(per))
        .map_err(|_| CudaError::InvalidArgument(format!("{n} items need too many blocks")))
}

/// Grid of a grid-stride elementwise kernel of 256 threads: enough blocks to fill the device a
/// few times over, no more.
pub(crate) fn elementwise_grid(n: usize, multiprocessors: u32) -> u32 {
    let cap = multiprocessors.max(1) as usize * 32;
    n.div_ceil(256).clamp(1, cap) as u32
}
