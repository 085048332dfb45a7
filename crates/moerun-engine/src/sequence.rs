//! A sequence being processed, and one forward step over several of them, for callers that drive
//! a few sequences by hand (generate, chat, perplexity, logits, bench, the conformance tests).
//! Their KV lives in a [`SequenceKv`]: storage plus the one simple allocator that decides its
//! blocks. The serving engine does not use this path: its scheduler's block manager is the only
//! allocator of its storage.

use moerun_core::{BlockAllocator, BlockTable, Result};
use moerun_model::kv::DEFAULT_BLOCK_SIZE;
use moerun_model::linear_state::LinearStateCache;
use moerun_model::{Batch, ForwardOutput, KvCache, LogitsFor, Model, ModelConfig, SeqChunk};

/// KV storage whose blocks are handed out by its own [`BlockAllocator`], and only by it.
pub struct SequenceKv {
    cache: KvCache,
    /// Linear-attention state (Gated DeltaNet layers), one slot per sequence: the slot of a
    /// sequence is its first block id, unique on this path since blocks are never shared here.
    states: LinearStateCache,
    allocator: BlockAllocator,
    /// The sliding-window layers' own blocks, when the cache keeps them apart
    /// ([`SequenceKv::for_one_sequence`]).
    window: Option<WindowBlocks>,
}

/// The window group of a [`SequenceKv`]: its allocator, the window, and the most tokens a step
/// may feed (what the pool was sized for).
struct WindowBlocks {
    allocator: BlockAllocator,
    window: usize,
    max_chunk: usize,
}

/// Tokens per step [`SequenceKv::for_one_sequence`] sizes the window group for.
pub const WINDOWED_MAX_CHUNK: usize = 2048;

impl SequenceKv {
    /// `num_blocks` blocks of `block_size` tokens for every layer of `cfg`.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Self {
        let cache = KvCache::new(cfg, num_blocks, block_size);
        let states = LinearStateCache::new(cfg, cache.num_blocks());
        Self::from_parts(cache, states)
    }

    /// Room for `tokens` tokens (rounded up to whole blocks).
    pub fn with_capacity(cfg: &ModelConfig, tokens: usize) -> Self {
        let cache = KvCache::with_capacity(cfg, tokens);
        let states = LinearStateCache::new(cfg, cache.num_blocks());
        Self::from_parts(cache, states)
    }

    /// Room for `tokens` tokens where `model` runs (host memory, or the GPU's for a model on
    /// the CUDA backend).
    pub fn for_model(model: &Model, tokens: usize) -> Result<Self> {
        let blocks = tokens.div_ceil(DEFAULT_BLOCK_SIZE).max(1);
        let cache = model.new_kv_cache(blocks, DEFAULT_BLOCK_SIZE)?;
        // Linear-attention state where the model runs (GPU memory for a CUDA model).
        let states = model.new_linear_state(cache.num_blocks());
        Ok(Self::from_parts(cache, states))
    }

    /// Room for one sequence of up to `max_len` tokens, fed at most `max_chunk` at a time.
    /// When the model has sliding-window layers whose window is shorter than `max_len`, their K/V
    /// goes to a window group sized for the window plus one chunk, and blocks that leave the
    /// window are reused: a long generation's KV for those layers stays bounded. `run_step`
    /// then feeds at most `max_chunk` tokens per step ([`SequenceKv::max_chunk`]).
    pub fn for_one_sequence(model: &Model, max_len: usize, max_chunk: usize) -> Result<Self> {
        let bs = DEFAULT_BLOCK_SIZE;
        let blocks = max_len.div_ceil(bs).max(1);
        let window = model.config.kv_window().filter(|&w| w < max_len);
        let Some(window) = window else {
            return Self::for_model(model, max_len);
        };
        let max_chunk = max_chunk.max(1);
        let window_blocks = blocks.min((window - 1 + max_chunk).div_ceil(bs) + 1);
        let cache = model.new_kv_cache_with_window_group(blocks, window_blocks, bs)?;
        let states = model.new_linear_state(cache.num_blocks());
        let mut kv = Self::from_parts(cache, states);
        kv.window = Some(WindowBlocks {
            allocator: BlockAllocator::new(window_blocks, bs),
            window,
            max_chunk,
        });
        Ok(kv)
    }

    fn from_parts(cache: KvCache, states: LinearStateCache) -> Self {
        let allocator = BlockAllocator::new(cache.num_blocks(), cache.block_size());
        SequenceKv {
            cache,
            states,
            allocator,
            window: None,
        }
    }

    /// The most tokens of one sequence a step feeds (`usize::MAX` without a window group).
    pub fn max_chunk(&self) -> usize {
        self.window.as_ref().map_or(usize::MAX, |w| w.max_chunk)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.cache.block_size()
    }

    /// Grow `table` to hold `num_tokens` tokens; all or nothing.
    pub fn reserve(&mut self, table: &mut BlockTable, num_tokens: usize) -> Result<()> {
        self.allocator.reserve(table, num_tokens)
    }

    /// Grow `table` to hold `num_tokens` tokens if the free blocks allow it, else leave it as it
    /// is (reserve is all or nothing): a lookahead that must never make a step fail. Whether the
    /// table holds them now.
    pub fn reserve_if_free(&mut self, table: &mut BlockTable, num_tokens: usize) -> bool {
        self.allocator.reserve(table, num_tokens).is_ok()
    }

    /// Return a sequence's blocks.
    pub fn free(&mut self, table: &mut BlockTable) {
        if let Some(&first) = table.blocks.first() {
            self.states.release(first as usize);
        }
        self.allocator.free_table(table)
    }

    /// Blocks not held by any sequence.
    pub fn num_free_blocks(&self) -> usize {
        self.allocator.num_free()
    }

    /// The storage, for a forward pass.
    pub fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// Bytes of KV storage.
    pub fn bytes(&self) -> usize {
        self.cache.bytes() + self.states.bytes()
    }
}

/// A sequence whose first `cached` tokens are in the KV cache.
#[derive(Debug, Default)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub table: BlockTable,
    /// Its sliding-window layers' blocks, when the cache keeps them apart.
    pub window_table: BlockTable,
    pub cached: usize,
}

impl Sequence {
    pub fn new(tokens: Vec<u32>) -> Self {
        Sequence {
            tokens,
            ..Default::default()
        }
    }

    /// Tokens not yet in the KV cache.
    pub fn pending(&self) -> &[u32] {
        &self.tokens[self.cached..]
    }

    /// Give the sequence's blocks back to the cache.
    pub fn release(&mut self, kv: &mut SequenceKv) {
        kv.free(&mut self.table);
        if let Some(w) = &mut kv.window {
            w.allocator.free_table(&mut self.window_table);
        }
        self.cached = 0;
    }
}

/// Run up to `max_tokens[i]` pending tokens of each sequence (and at most
/// [`SequenceKv::max_chunk`]) as one flat batch, then mark them cached. Blocks are reserved
/// first, all or nothing per sequence; with a window group, each sequence first gives back the
/// window blocks its chunk can no longer see. A one-token step of a sequence without a window
/// group also takes the block of its next position where one is free: the CUDA backend launches
/// a greedy sequence's next step ahead only into a block the sequence already holds, so without
/// the lookahead the first step of each block waited for the host (~770 µs of idle GPU every 16
/// tokens of a Qwen3-30B-A3B decode on the H200, ~2% of its time).
pub fn run_step(
    model: &Model,
    kv: &mut SequenceKv,
    seqs: &mut [&mut Sequence],
    max_tokens: &[usize],
    which: LogitsFor,
) -> Result<ForwardOutput> {
    let mut counts = Vec::with_capacity(seqs.len());
    for (s, &limit) in seqs.iter_mut().zip(max_tokens) {
        let n = s.pending().len().min(limit).min(kv.max_chunk());
        kv.reserve(&mut s.table, s.cached + n)?;
        if n == 1 && kv.window.is_none() {
            // Best effort: without the block the next step is only not launched ahead.
            let _ = kv.reserve_if_free(&mut s.table, s.cached + 2);
        }
        if let Some(w) = &mut kv.window {
            let first_visible = (s.cached + 1).saturating_sub(w.window);
            w.allocator
                .release_before(&mut s.window_table, first_visible);
            w.allocator.reserve(&mut s.window_table, s.cached + n)?;
        }
        counts.push(n);
    }
    let slots: Vec<usize> = seqs
        .iter()
        .map(|s| s.table.blocks.first().map_or(0, |&b| b as usize))
        .collect();
    let out = {
        let chunks = seqs
            .iter()
            .zip(&counts)
            .map(|(s, &n)| SeqChunk {
                tokens: &s.tokens[s.cached..s.cached + n],
                start_pos: s.cached,
                block_table: &s.table,
            })
            .collect();
        let windows = match kv.window {
            Some(_) => seqs.iter().map(|s| &s.window_table).collect(),
            None => Vec::new(),
        };
        let batch = Batch::new(chunks)
            .with_state_slots(slots)
            .with_window_tables(windows);
        model.forward_with_state(&batch, &mut kv.cache, &mut kv.states, which)?
    };
    for (s, n) in seqs.iter_mut().zip(counts) {
        s.cached += n;
    }
    Ok(out)
}
