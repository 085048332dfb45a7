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
//! Qwen3.5's Gated DeltaNet layers keep their per-sequence state in device buffers of a
//! [`crate::LinearStateCache`] made by [`crate::Model::new_linear_state`] (see [`deltanet`]).
//! Gemma 4 runs its own device forward (`crate::gemma4::cuda`), not [`CudaPass`].

pub(crate) mod ahead;
pub mod deltanet;
#[cfg(test)]
mod gemma4_tests;
pub(crate) mod graph;
mod pass;
pub mod profile;
pub(crate) mod route_ahead;
#[cfg(test)]
mod tests;
pub(crate) mod upload;

use std::collections::HashMap;

use moerun_core::{DType, Error, Result, Tensor};
use moerun_cuda::{
    ActivationArena, AttentionPrefill, AttentionScratch, BatchKvBf16, CudaDevice, CudaError,
    CudaSlice, DeviceBuffer, DeviceExperts, DeviceKvPool, DeviceMatrix, DevicePtr, DeviceRepr,
    DeviceRope, KvDtype, MoeScratch,
};

use crate::config::{ModelConfig, QkNorm};

pub(crate) use pass::placement;
pub use pass::{CudaPass, Placement, Tokens, GEMV_MAX_ROWS};
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
/// Whether a model of bf16 weights (`bf16`) has its prefill norms write bf16 GEMM inputs
/// ([`CudaModel::bf16_gemm_inputs`]): yes, unless `MOERUN_CUDA_BF16_INPUTS=0` asks for the
/// conversions instead (an A/B switch; the results are the same bits either way).
pub(crate) fn bf16_gemm_inputs(bf16: bool) -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    bf16 && *ALLOWED
        .get_or_init(|| std::env::var_os("MOERUN_CUDA_BF16_INPUTS").is_none_or(|v| v != "0"))
}

pub struct CudaModel {
    pub(crate) dev: CudaDevice,
    pub(crate) mats: HashMap<(usize, usize), DeviceMatrix>,
    pub(crate) vecs: HashMap<(usize, usize), CudaSlice<f32>>,
    /// Each attention layer's `[q; k; v]` projection stacked into one matrix (and bias), by its
    /// q_proj's key, where the fused prologue applies (see [`pass::CudaPass`]).
    pub(crate) qkv: HashMap<(usize, usize), StackedQkv>,
    /// Each MoE layer's stacked experts, by its router's key.
    pub(crate) experts: HashMap<(usize, usize), DeviceExperts>,
    /// Zeros, one hidden row: the residual the first layer's folded add+norm adds its input to.
    pub(crate) zero_row: CudaSlice<f32>,
    /// The layers that route ahead (see [`route_ahead`]), by layer index.
    pub(crate) route_ahead: HashMap<usize, route_ahead::LayerRouteAhead>,
    pub(crate) rope: DeviceRope,
    /// The kernel of prefill attention tiles: bf16 tensor cores for bf16 models (head_dim 64 or
    /// 128), exact f32 otherwise.
    pub(crate) prefill_attention: AttentionPrefill,
    /// A bf16 model: its prefill norms also write their output rounded to bf16, which the bf16
    /// GEMMs that read it (q/k/v, router, the MoE's wgmma path) take instead of converting.
    pub(crate) bf16_gemm_inputs: bool,
    /// Bytes of weights resident on the device.
    pub(crate) weight_bytes: usize,
    /// Gemma 4's extras (its two RoPEs, unit norm weights), when the model is Gemma 4.
    pub(crate) gemma4: Option<crate::gemma4::cuda::Gemma4Device>,
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

/// What a pass hands back of its device logits.
pub(crate) enum Fetched {
    Logits(Vec<f32>),
    /// Each row's greedy pick (`argmax_rows` on the device).
    Tokens(Vec<u32>),
}

/// Download `logits` (`[rows, vocab]`) or, when `greedy`, only each row's arg-max, picked on the
/// device: at 128 sequences that is 512 bytes a step instead of 78 MB of logits and a host pass
/// over them.
pub(crate) fn fetch(
    dev: &CudaDevice,
    logits: &impl DevicePtr<f32>,
    vocab: usize,
    greedy: bool,
) -> Result<Fetched> {
    if !greedy {
        return Ok(Fetched::Logits(match logits.len() {
            0 => Vec::new(),
            _ => dev.download(logits).map_err(dev_err)?,
        }));
    }
    let rows = logits.len() / vocab.max(1);
    if rows == 0 {
        return Ok(Fetched::Tokens(Vec::new()));
    }
    let mut ids = dev.alloc_u32(rows).map_err(dev_err)?;
    dev.argmax_rows(logits, vocab, &mut ids).map_err(dev_err)?;
    Ok(Fetched::Tokens(dev.download(&ids).map_err(dev_err)?))
}

/// Decode batches up to this many tokens get the full split-K parallelism in attention; larger
/// ones run with fewer splits (they fill the GPU anyway).
const ATTENTION_SCRATCH_TOKENS: usize = 256;

/// Scratch buffers of a pass, kept with the KV cache they serve: a CUDA graph captured over this
/// cache bakes their addresses in, so they live exactly as long as its graphs.
pub(crate) struct PassScratch {
    pub(crate) attention: AttentionScratch,
    /// The fused MoE op's scratch and the token count it holds, grown to the largest batch seen.
    moe: Option<(usize, MoeScratch)>,
    /// Set when a buffer was replaced: graphs captured before must not be replayed.
    pub(crate) replaced: bool,
    /// Where a captured decode step's activations live (no allocation nodes in its graph).
    pub(crate) arena: ActivationArena,
    /// A prefill's own K/V in bf16 for the tensor-core attention tiles (written by the q/k/v
    /// prologue or kv_write, read by the same layer's attention), grown to the largest batch.
    pub(crate) batch_kv: Option<BatchKvBf16>,
}

impl PassScratch {
    /// An output buffer of `len` values that the op about to run writes in full: from the arena
    /// while a decode step is being captured (see `graph.rs`), else allocated.
    pub(crate) fn activation<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        dev.activation(Some(&self.arena), len).map_err(dev_err)
    }

    /// The MoE scratch, (re)made to hold `rows` tokens routed to `top_k` experts.
    pub(crate) fn moe(
        &mut self,
        dev: &CudaDevice,
        experts: &DeviceExperts,
        rows: usize,
        top_k: usize,
    ) -> Result<&mut MoeScratch> {
        let fits = matches!(&self.moe, Some((cap, _)) if *cap >= rows);
        if !fits {
            let cap = rows.next_power_of_two().max(128);
            let scratch = dev.moe_scratch(experts, cap, top_k).map_err(dev_err)?;
            self.moe = Some((cap, scratch));
            self.replaced = true;
        }
        Ok(&mut self.moe.as_mut().expect("made above").1)
    }
}

/// A layer's q, k and v projections as one matrix: one GEMV instead of three.
pub(crate) struct StackedQkv {
    pub(crate) weight: DeviceMatrix,
    pub(crate) bias: Option<CudaSlice<f32>>,
}

/// Whether the fused attention prologue (stacked q/k/v, per-head q/k norm, RoPE, Qwen3.5's output
/// gate split off, in one kernel) computes this family's attention inputs: no whole-projection
/// norm, no clip, heads that fit the kernel.
pub(crate) fn fused_prologue(cfg: &ModelConfig) -> bool {
    matches!(cfg.qk_norm, QkNorm::None | QkNorm::PerHead)
        && cfg.clip_qkv.is_none()
        && cfg.head_dim <= moerun_cuda::FUSED_MAX_HEAD_DIM
}

/// Paged K/V of every attention layer in device memory (`None` for layers without KV), the
/// scratch of passes over it, and the decode steps captured as CUDA graphs. Each pool has one
/// block more than the cache hands out: the padding rows of a graph's batch-size bucket write
/// there.
pub struct DeviceKv {
    pub(crate) pools: Vec<Option<DeviceKvPool>>,
    pub(crate) scratch: PassScratch,
    pub(crate) graphs: graph::DecodeGraphs,
    /// The block no sequence owns.
    pub(crate) trash_block: usize,
    /// The window group's block no sequence owns, when that group has blocks of its own.
    pub(crate) window_trash_block: Option<usize>,
}

impl DeviceKv {
    /// Pools of `num_blocks` blocks, or `num_window_blocks` for the sliding-window layers when
    /// they are kept apart (see `KvCache::with_window_group`), each with its trash block.
    /// `dtype`: what the pools store (f32 or bf16; [`crate::Model::set_kv_dtype`]).
    pub(crate) fn new(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        (num_blocks, num_window_blocks, block_size): (usize, Option<usize>, usize),
        dtype: DType,
    ) -> Result<DeviceKv> {
        let dtype = match dtype {
            DType::F32 => KvDtype::F32,
            DType::BF16 => KvDtype::Bf16,
            DType::F16 => return Err(crate::kv::f16_kv_refused()),
        };
        // Each layer's own shape (Gemma 4's sliding and full layers differ); none for Gated
        // DeltaNet layers and Gemma 4's KV-shared ones. Sliding-window layers get the window
        // group's blocks when it has its own.
        let pools = (0..cfg.num_layers())
            .map(|l| match cfg.layer_kv_shape(l) {
                Some((kv_heads, head_dim)) => {
                    let blocks = match num_window_blocks {
                        Some(w) if cfg.layer_kv_windowed(l) => w,
                        _ => num_blocks,
                    };
                    dev.kv_pool_of(dtype, blocks + 1, block_size, kv_heads, head_dim)
                        .map(Some)
                        .map_err(dev_err)
                }
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let widest = (0..cfg.num_layers())
            .filter_map(|l| cfg.layer_kv_shape(l))
            .map(|(_, d)| d)
            .max()
            .unwrap_or(cfg.head_dim);
        let attention = dev
            .attention_scratch(
                ATTENTION_SCRATCH_TOKENS,
                cfg.num_heads,
                widest,
                cfg.max_position_embeddings,
            )
            .map_err(dev_err)?;
        Ok(DeviceKv {
            pools,
            scratch: PassScratch {
                attention,
                moe: None,
                replaced: false,
                arena: ActivationArena::new(),
                batch_kv: None,
            },
            graphs: graph::DecodeGraphs::default(),
            trash_block: num_blocks,
            window_trash_block: num_window_blocks,
        })
    }

    /// Tokens per KV block (every pool's).
    pub(crate) fn block_size(&self) -> Result<usize> {
        self.pools
            .iter()
            .flatten()
            .next()
            .map(|p| p.block_size())
            .ok_or_else(|| Error::Device("a model without attention layers".into()))
    }

    /// What the pools store.
    pub(crate) fn dtype(&self) -> DType {
        match self.pools.iter().flatten().next().map(DeviceKvPool::dtype) {
            Some(KvDtype::Bf16) => DType::BF16,
            _ => DType::F32,
        }
    }

    pub fn bytes(&self) -> usize {
        self.pool_bytes() + self.scratch.attention.bytes()
    }

    /// Layer `layer`'s K and V widened to f32, without the trash block (`KvCache::layer_kv`).
    pub(crate) fn layer_kv(&self, layer: usize) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        let Some(Some(pool)) = self.pools.get(layer) else {
            return Ok(None);
        };
        let keep = (pool.blocks() - 1) * pool.block_size() * pool.kv_heads() * pool.head_dim();
        let (mut k, mut v) = pool.download_f32().map_err(dev_err)?;
        k.truncate(keep);
        v.truncate(keep);
        Ok(Some((k, v)))
    }

    /// Bytes of the pools' K/V values.
    pub fn pool_bytes(&self) -> usize {
        self.pools
            .iter()
            .flatten()
            .map(DeviceKvPool::bytes)
            .sum::<usize>()
    }
}

/// Refuse what this backend does not run yet, by name.
pub(crate) fn check_supported(cfg: &ModelConfig) -> Result<()> {
    if let Some(la) = cfg.linear_attention {
        let shape = moerun_cuda::DeltaShape {
            key_heads: la.num_key_heads,
            value_heads: la.num_value_heads,
            key_dim: la.key_head_dim,
            value_dim: la.value_head_dim,
            conv_kernel: la.conv_kernel,
        };
        shape.check().map_err(|e| {
            Error::Unsupported(format!(
                "{} on the CUDA backend: {e} (use --device cpu)",
                cfg.family
            ))
        })?;
    }
    Ok(())
}
