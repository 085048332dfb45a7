//! The CUDA backend of moerun: one GPU ([`CudaDevice`]), its buffers, weights uploaded once in
//! their stored dtype ([`DeviceMatrix`]), and the ops of the forward pass as methods: RMSNorm,
//! RoPE, SwiGLU, embedding gather, MoE routing, the decode GEMV and the cuBLAS prefill GEMM.
//!
//! Nothing is linked at build time: cudarc loads the driver, NVRTC and cuBLAS when a device is
//! opened, and [`CudaDevice::open`] first checks that each can be loaded, so on a machine without
//! CUDA it returns [`CudaError::Unavailable`] naming what is missing instead of panicking. The
//! crate builds and its tests pass (by skipping) where there is no GPU.
//!
//! Kernels live in `kernels/*.cu`, one family per file, embedded with `include_str!`, compiled
//! with NVRTC for the device's own architecture (`sm_90` on Hopper) into cubins that are cached on
//! disk (see [`compile`] for where and why cubin). Ops enqueue work on the device's one stream;
//! [`CudaDevice::download`] waits for it. The CPU kernels of `moerun-cpu` are the reference these
//! ops are tested against (`tests/`).

pub mod arena;
mod bandwidth;
pub mod compile;
mod device;
pub mod error;
pub mod graph;
pub mod ops;
pub mod probe;
mod skip;

pub use arena::{ActivationArena, DeviceBuffer};
pub use cudarc::driver::{
    CudaEvent, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
    PinnedHostSlice,
};
pub use device::{CudaDevice, DeviceInfo, DeviceMatrix, MappedHostU32};
pub use error::{CudaError, Result};
pub use graph::DeviceGraph;
pub use ops::FUSED_MAX_HEAD_DIM;
pub use ops::{
    AddNormGrid, DeviceRope, FoldedPrologue, GemmOut, GemvLayout, QkvShape, RouteAhead,
    RouteInputs, RouterShape, ROUTE_AHEAD_MAX_TOP_K,
};
pub use ops::{ArgmaxScratch, NextStepInputs};
pub use ops::{
    AttentionPrefill, AttentionScratch, AttentionShape, BatchKvBf16, DeviceKvPool, KvBuffers,
    KvBuffersMut, KvDtype, TokenPlacement,
};
pub use ops::{AttnTailNorms, AttnTailOut, FfnTail, RouterNorms, GEMMA_TAIL_MAX_WIDTH};
pub use ops::{DecodePass, DeviceExperts, ExpertActivation, MoePath, MoeScratch, WgmmaTile};
pub use ops::{DeltaSeqs, DeltaShape};
