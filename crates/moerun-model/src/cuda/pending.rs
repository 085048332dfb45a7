//! TEMPORARY stand-ins for the paged-attention and fused-MoE ops being written in moerun-cuda
//! (same names and signatures); removed when they land. Every op is refused by name.
#![allow(dead_code, unused_variables)]

use moerun_core::{DType, MatRef};
use moerun_cuda::{CudaDevice, CudaError, CudaSlice, DevicePtr, DevicePtrMut};

type R<T> = Result<T, CudaError>;

fn pending<T>() -> R<T> {
    Err(CudaError::Unsupported("attention and MoE ops on CUDA (not built yet)".into()))
}

pub struct DeviceKvPool;
impl DeviceKvPool {
    pub fn bytes(&self) -> usize {
        0
    }
}
pub struct DeviceExperts;
impl DeviceExperts {
    pub fn bytes(&self) -> usize {
        0
    }
}
pub struct MoeScratch;
pub struct TokenPlacement<'a> {
    pub positions: &'a CudaSlice<i32>,
    pub table_start: &'a CudaSlice<i32>,
    pub block_tables: &'a CudaSlice<i32>,
    pub max_context: usize,
}
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
}

pub trait PendingOps {
    fn kv_pool(&self, blocks: usize, bs: usize, kvh: usize, d: usize) -> R<DeviceKvPool> {
        pending()
    }
    fn kv_write(
        &self,
        pool: &mut DeviceKvPool,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        at: &TokenPlacement,
    ) -> R<()> {
        pending()
    }
    fn paged_attention(
        &self,
        q: &impl DevicePtr<f32>,
        pool: &DeviceKvPool,
        at: &TokenPlacement,
        shape: &AttentionShape,
        out: &mut impl DevicePtrMut<f32>,
    ) -> R<()> {
        pending()
    }
    fn upload_experts(&self, e: &[(MatRef<'_>, MatRef<'_>, MatRef<'_>)]) -> R<DeviceExperts> {
        pending()
    }
    fn experts_from_parts(
        &self,
        dtype: DType,
        experts: usize,
        hidden: usize,
        intermediate: usize,
        gate_up: CudaSlice<u8>,
        down: CudaSlice<u8>,
    ) -> R<DeviceExperts> {
        pending()
    }
    fn moe_scratch(&self, e: &DeviceExperts, max_tokens: usize, top_k: usize) -> R<MoeScratch> {
        pending()
    }
    #[allow(clippy::too_many_arguments)]
    fn moe_experts(
        &self,
        x: &impl DevicePtr<f32>,
        ids: &impl DevicePtr<u32>,
        weights: &impl DevicePtr<f32>,
        top_k: usize,
        experts: &DeviceExperts,
        scratch: &mut MoeScratch,
        out: &mut impl DevicePtrMut<f32>,
    ) -> R<()> {
        pending()
    }
}
impl PendingOps for CudaDevice {}
