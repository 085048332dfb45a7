//! The KV cache of a model on the CPU: one [`KvPool`] per layer, all indexed by the same block ids
//! that a [`BlockAllocator`] hands out to sequences.

use moerun_core::{BlockAllocator, BlockTable, Result};
use moerun_cpu::attention::KvPool;

use crate::config::ModelConfig;

/// Default tokens per KV block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

pub struct KvCache {
    pub allocator: BlockAllocator,
    pub(crate) pools: Vec<KvPool>,
}

impl KvCache {
    /// A cache of `num_blocks` blocks of `block_size` tokens for every layer of `cfg`.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> KvCache {
        KvCache {
            allocator: BlockAllocator::new(num_blocks, block_size),
            pools: (0..cfg.num_layers())
                .map(|_| KvPool::new(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim))
                .collect(),
        }
    }

    /// A cache with room for `tokens` tokens (rounded up to whole blocks).
    pub fn with_capacity(cfg: &ModelConfig, tokens: usize) -> KvCache {
        KvCache::new(
            cfg,
            tokens.div_ceil(DEFAULT_BLOCK_SIZE).max(1),
            DEFAULT_BLOCK_SIZE,
        )
    }

    pub fn block_size(&self) -> usize {
        self.allocator.block_size()
    }

    /// Grow `table` to hold `num_tokens` tokens.
    pub fn reserve(&mut self, table: &mut BlockTable, num_tokens: usize) -> Result<()> {
        self.allocator.reserve(table, num_tokens)
    }

    /// Return a sequence's blocks.
    pub fn free(&mut self, table: &mut BlockTable) {
        self.allocator.free_table(table)
    }

    /// Bytes of KV storage.
    pub fn bytes(&self) -> usize {
        self.pools.iter().map(KvPool::bytes).sum()
    }
}
