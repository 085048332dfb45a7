//! The CUDA backend of the forward pass: a model's weights resident on one GPU, its paged KV in
//! device memory, and [`pass::CudaPass`], the [`crate::backend::Backend`] ops as device kernels.
//!
//! Weights are uploaded once, in their stored dtype, and found again by the address and length
//! of the host tensor they came from: the family code keeps naming weights by their host
//! description (`&Linear`, `&[f32]`), exactly as on the CPU, and tied weights (an LM head that
//! is the embedding) are one device copy. A layer's routed experts are stacked into one
//! [`DeviceExperts`] (gate and up rows of all experts in one buffer, down in another), keyed by
//! the layer's router, so the fused MoE op can reach any expert by index without host work.
//!
//! Not yet on this backend, refused by name: Qwen3.5's Gated DeltaNet layers and attention
//! output gate.

mod pass;
mod pending;
pub(crate) mod upload;

use std::collections::HashMap;
use std::sync::Mutex;

use moerun_core::{Error, Result, Tensor};
use moerun_cuda::{CudaDevice, CudaError, CudaSlice, DeviceMatrix, DeviceRope};
#[allow(unused_imports)]
use pending::PendingOps;
use pending::{DeviceExperts, DeviceKvPool, MoeScratch};

use crate::config::{Mixer, ModelConfig};

pub use pass::CudaPass;
pub use upload::WeightSource;

/// A device error as the library's error.
pub(crate) fn dev_err(e: CudaError) -> Error {
    Error::Device(e.to_string())
}

/// The key of a host weight: where its bytes are and how many.
pub(crate) fn tensor_key(t: &Tensor) -> (usize, usize) {
    let b = t.bytes();
    (b.as_ptr() as usize, b.len())
}

pub(crate) fn vec_key(v: &[f32]) -> (usize, usize) {
    (v.as_ptr() as usize, v.len())
}

/// A model's weights on one GPU.
pub struct CudaModel {
    pub(crate) dev: CudaDevice,
    pub(crate) mats: HashMap<(usize, usize), DeviceMatrix>,
    pub(crate) vecs: HashMap<(usize, usize), CudaSlice<f32>>,
    /// Each MoE layer's stacked experts, by its router's key.
    pub(crate) experts: HashMap<(usize, usize), DeviceExperts>,
    pub(crate) rope: DeviceRope,
    /// Scratch of the fused MoE op, grown to the largest batch seen.
    pub(crate) moe_scratch: Mutex<Option<(usize, MoeScratch)>>,
    /// Bytes of weights resident on the device.
    pub(crate) weight_bytes: usize,
}

impl CudaModel {
    /// The device the model lives on.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Bytes of weights uploaded.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    pub(crate) fn mat(&self, t: &Tensor) -> Result<&DeviceMatrix> {
        self.mats.get(&tensor_key(t)).ok_or_else(|| {
            Error::Device(format!(
                "internal: a weight of shape {:?} was not uploaded to the device",
                t.shape
            ))
        })
    }

    pub(crate) fn vec(&self, v: &[f32]) -> Result<&CudaSlice<f32>> {
        self.vecs.get(&vec_key(v)).ok_or_else(|| {
            Error::Device(format!(
                "internal: a vector of {} values was not uploaded to the device",
                v.len()
            ))
        })
    }
}

/// Paged K/V of every attention layer in device memory (`None` for layers without KV).
pub struct DeviceKv {
    pub(crate) pools: Vec<Option<DeviceKvPool>>,
}

impl DeviceKv {
    pub(crate) fn new(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<DeviceKv> {
        let pools = cfg
            .layers
            .iter()
            .map(|spec| match spec.mixer {
                Mixer::Attention => dev
                    .kv_pool(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
                    .map(Some)
                    .map_err(dev_err),
                Mixer::GatedDeltaNet => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceKv { pools })
    }

    pub fn bytes(&self) -> usize {
        self.pools.iter().flatten().map(DeviceKvPool::bytes).sum()
    }
}

/// Refuse what this backend does not run yet, by name.
pub(crate) fn check_supported(cfg: &ModelConfig) -> Result<()> {
    if cfg.linear_attention.is_some() || cfg.attention_output_gate {
        return Err(Error::Unsupported(format!(
            "{} on the CUDA backend (Gated DeltaNet layers and gated attention run on the CPU \
             only so far; use --device cpu)",
            cfg.family
        )));
    }
    Ok(())
}
