//! The KV storage of a model on the CPU: one [`KvPool`] per layer, all indexed by the same block
//! ids. Storage only: which blocks a sequence owns is decided by exactly one allocator outside
//! this type (the serving engine's block manager, or the single-sequence path's
//! `BlockAllocator`), so two allocators never hand out the same pool's blocks.

use moerun_core::DType;
use moerun_cpu::attention::KvPool;

use crate::config::ModelConfig;

/// Default tokens per KV block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Bytes per stored K or V value in the default (f32) cache; a bf16 cache (`Model::set_kv_dtype`)
/// takes half.
pub const KV_BYTES_PER_VALUE: usize = 4;

/// Paged K/V for every layer of a model: `num_blocks` blocks of `block_size` tokens.
pub struct KvCache {
    block_size: usize,
    num_blocks: usize,
    /// Blocks of the window group's pools when that group has its own blocks
    /// ([`KvCache::with_window_group`]); `None` when every layer uses the same block ids.
    num_window_blocks: Option<usize>,
    pub(crate) pools: Vec<KvPool>,
    /// The pools in GPU memory when the model runs on the CUDA backend (the host pools are then
    /// empty).
    pub(crate) device: Option<crate::cuda::DeviceKv>,
}

/// The refusal of an f16 KV cache (`Model::set_kv_dtype`, the device pools).
pub(crate) fn f16_kv_refused() -> moerun_core::Error {
    moerun_core::Error::Unsupported("an f16 KV cache (use f32, the default, or bf16)".into())
}

impl KvCache {
    /// Storage for `num_blocks` blocks of `block_size` tokens for every attention layer of
    /// `cfg`. Linear-attention layers keep no KV (their state lives in a `LinearStateCache`):
    /// they get an empty pool, so pools stay indexed by layer and the bytes match
    /// `ModelConfig::kv_bytes_per_token`, which is what servers size the cache by.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> KvCache {
        KvCache::of_dtype(cfg, num_blocks, None, block_size, DType::F32)
    }

    /// Storage in which the sliding-window layers ([`ModelConfig::layer_kv_windowed`]) keep their
    /// K/V in blocks of their own, `num_window_blocks` of them, named by each sequence's window
    /// table ([`crate::Batch::window_tables`]); a sequence then holds window-group blocks only for
    /// its window (plus the chunk being computed), whatever its length. The other layers have
    /// `num_blocks` blocks as in [`KvCache::new`].
    pub fn with_window_group(
        cfg: &ModelConfig,
        num_blocks: usize,
        num_window_blocks: usize,
        block_size: usize,
    ) -> KvCache {
        KvCache::of_dtype(
            cfg,
            num_blocks,
            Some(num_window_blocks),
            block_size,
            DType::F32,
        )
    }

    /// [`KvCache::new`] (or, given `num_window_blocks`, [`KvCache::with_window_group`]) storing
    /// `dtype`: f32, or bf16 in half the memory (each value rounded to nearest even when written).
    pub fn of_dtype(
        cfg: &ModelConfig,
        num_blocks: usize,
        num_window_blocks: Option<usize>,
        block_size: usize,
        dtype: DType,
    ) -> KvCache {
        KvCache {
            block_size,
            num_blocks,
            num_window_blocks,
            pools: (0..cfg.num_layers())
                .map(|l| match cfg.layer_kv_shape(l) {
                    Some((heads, dim)) => {
                        let blocks = match num_window_blocks {
                            Some(w) if cfg.layer_kv_windowed(l) => w,
                            _ => num_blocks,
                        };
                        KvPool::with_dtype(blocks, block_size, heads, dim, dtype)
                    }
                    // Gated DeltaNet and KV-shared layers keep no K/V of their own.
                    None => {
                        KvPool::with_dtype(0, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
                    }
                })
                .collect(),
            device: None,
        }
    }

    /// Device-resident storage for a model on the CUDA backend: the same block ids, paged the
    /// same way, in GPU memory.
    pub(crate) fn on_device(
        cfg: &ModelConfig,
        device: crate::cuda::DeviceKv,
        num_blocks: usize,
        num_window_blocks: Option<usize>,
        block_size: usize,
    ) -> KvCache {
        let mut cache = KvCache::new(cfg, 0, block_size);
        cache.num_blocks = num_blocks;
        cache.num_window_blocks = num_window_blocks;
        cache.device = Some(device);
        cache
    }

    /// Storage with room for `tokens` tokens (rounded up to whole blocks of the default size).
    pub fn with_capacity(cfg: &ModelConfig, tokens: usize) -> KvCache {
        KvCache::new(
            cfg,
            tokens.div_ceil(DEFAULT_BLOCK_SIZE).max(1),
            DEFAULT_BLOCK_SIZE,
        )
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in every layer's pool (the window group's aside, when it has its own); valid
    /// block ids are `0..num_blocks`.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks of the window group's pools when it has blocks of its own.
    pub fn num_window_blocks(&self) -> Option<usize> {
        self.num_window_blocks
    }

    /// What the pools store (the host's or the device's).
    pub fn dtype(&self) -> DType {
        match &self.device {
            Some(d) => d.dtype(),
            None => self.pools.first().map_or(DType::F32, KvPool::dtype),
        }
    }

    /// Bytes of KV storage (on a GPU with its passes' attention scratch).
    pub fn bytes(&self) -> usize {
        self.pools.iter().map(KvPool::bytes).sum::<usize>()
            + self.device.as_ref().map_or(0, |d| d.bytes())
    }

    /// The CUDA decode-step graphs captured for this cache (`Ok(0)` on the CPU), or why graphs
    /// are off for it (a capture failed; its steps then run eagerly, with the same results).
    pub fn decode_graphs(&self) -> std::result::Result<usize, String> {
        self.device.as_ref().map_or(Ok(0), |d| d.graphs.state())
    }

    /// Layer `layer`'s keys and values as stored, widened to f32, `[blocks][block_size][kv_heads]
    /// [head_dim]` each over the cache's `num_blocks` blocks (the window group's for a windowed
    /// layer with blocks of its own); downloaded from the GPU for a device cache. `None` for a
    /// layer without K/V (linear attention, Gemma 4's shared-KV layers on the GPU). For tests and
    /// tools that compare caches.
    pub fn layer_kv(&self, layer: usize) -> moerun_core::Result<Option<(Vec<f32>, Vec<f32>)>> {
        match &self.device {
            Some(d) => d.layer_kv(layer),
            None => Ok(self
                .pools
                .get(layer)
                .filter(|p| p.bytes() > 0)
                .map(KvPool::to_f32)),
        }
    }

    /// Bytes of the K/V values alone (what the dtype halves).
    pub fn pool_bytes(&self) -> usize {
        self.pools.iter().map(KvPool::bytes).sum::<usize>()
            + self.device.as_ref().map_or(0, |d| d.pool_bytes())
    }
}
