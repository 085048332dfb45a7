//! Paged KV block management with prefix caching, for the serving engine (vLLM v1's design,
//! written for this engine). Pure bookkeeping: block ids index the model's KV pools, which this
//! module never touches.
//!
//! A [`BlockManager`] owns `num_blocks` blocks of `block_size` tokens and, per sequence, the
//! [`BlockTable`] its KV lives in. With prefix caching on, a *full* block whose KV has been
//! computed is registered under a hash chain (see [`BlockHasher`]); a later sequence whose prompt
//! starts with the same full blocks reuses them instead of recomputing them.
//!
//! What it promises:
//! - every block is in exactly one of three states: in use (referenced by some table), evictable
//!   (unreferenced but still cached, so reusable by hash until recycled) or free; their counts
//!   always add up to `num_blocks`, and a block's reference count equals the number of tables
//!   holding it ([`BlockManager::check_invariants`] verifies all of this);
//! - allocations are all or nothing: on [`BlockError::OutOfBlocks`] nothing changed;
//! - a prefix-cache hit is confirmed by comparing token ids and the parent's identity, so a hash
//!   collision is a miss, never another sequence's KV;
//! - only blocks whose every token the engine reported computed are ever registered, and the
//!   block holding a prompt's last token is never reused (the model must compute at least one
//!   token to produce logits);
//! - when no block is free, the least recently released cached block is recycled; a sequence's
//!   blocks are released last-to-first, so a shared prefix outlives the tails hanging off it.
//!
//! **Window group.** A model whose sliding-window layers keep their K/V apart
//! ([`BlockManager::with_window_group`]) has a second pool of blocks for them, and each sequence a
//! second table, indexed by position like the first. [`BlockManager::slide_window`] gives back
//! the blocks whose every position has left the window of the sequence's next token, leaving
//! [`RELEASED_BLOCK`] in their entries, so a sequence holds window blocks for its last `window`
//! positions plus the chunk being computed, however long it grows. Allocations are all or nothing
//! across both pools. Prefix caching is off with a window group: a cached prefix would also need
//! the window blocks before its end, which are given back as the sequence moves on.

mod hash;
mod pool;

use std::collections::BTreeMap;
use std::fmt;

use moerun_core::{BlockTable, RELEASED_BLOCK};

pub use hash::{BlockHasher, Fnv1a64};
use pool::{BlockPool, RegId};

/// Identifies a sequence to the block manager (the scheduler uses its request id).
pub type SeqId = u64;

/// Why a block-manager call failed. Nothing changed when it returns one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockError {
    /// Not enough free or evictable blocks for the request.
    OutOfBlocks { needed: usize, available: usize },
    /// No sequence with this id holds blocks.
    UnknownSequence(SeqId),
    /// [`BlockManager::allocate_prompt`] for a sequence that already holds blocks.
    SequenceExists(SeqId),
}

impl fmt::Display for BlockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockError::OutOfBlocks { needed, available } => write!(
                f,
                "out of KV blocks: needed {needed}, available {available}"
            ),
            BlockError::UnknownSequence(id) => write!(f, "sequence {id} holds no KV blocks"),
            BlockError::SequenceExists(id) => write!(f, "sequence {id} already holds KV blocks"),
        }
    }
}

impl std::error::Error for BlockError {}

/// A broken internal invariant, described for a test failure or a debug log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvariantViolation(pub String);

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block manager invariant violated: {}", self.0)
    }
}

impl std::error::Error for InvariantViolation {}

/// Prefix-cache counters for `/metrics`, in tokens since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up (every successful [`BlockManager::allocate_prompt`]).
    pub queried_tokens: u64,
    /// Of those, tokens whose KV came from the cache.
    pub hit_tokens: u64,
}

impl PrefixCacheStats {
    /// `hit_tokens / queried_tokens`, 0 before any query.
    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.queried_tokens as f64
        }
    }
}

/// What [`BlockManager::allocate_prompt`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptAllocation {
    /// Leading prompt tokens whose KV was reused from the cache (a multiple of the block size).
    pub num_cached_tokens: usize,
    /// Tokens after those that now have slots and must be computed.
    pub num_new_tokens: usize,
}

#[derive(Debug, Default)]
struct SeqBlocks {
    table: BlockTable,
    /// Chain hash of full blocks `0..hashes.len()`; computed once, extended as blocks fill.
    hashes: Vec<u64>,
    /// Cache registration of the prefix ending at each committed full block. It may name
    /// another sequence's block: when two sequences computed the same block, the first to
    /// commit is registered and the other keeps its copy private (but chains on the first).
    chain: Vec<RegId>,
    /// The window group's blocks (empty without one).
    window_table: BlockTable,
}

/// The blocks of the sliding-window layers, and the window they are kept for.
#[derive(Debug)]
struct WindowGroup {
    window: usize,
    pool: BlockPool,
}

/// Paged KV blocks for many sequences, with an optional prefix cache. `H` computes block hashes;
/// tests inject a deliberately weak one to prove collisions are harmless.
#[derive(Debug)]
pub struct BlockManager<H = Fnv1a64> {
    block_size: usize,
    enable_prefix_caching: bool,
    hasher: H,
    pool: BlockPool,
    window: Option<WindowGroup>,
    seqs: BTreeMap<SeqId, SeqBlocks>,
    stats: PrefixCacheStats,
}

impl BlockManager<Fnv1a64> {
    /// A manager of `num_blocks` blocks of `block_size` tokens with the default hasher.
    ///
    /// # Panics
    /// If `block_size` is 0 or `num_blocks` exceeds `u32::MAX` (operator configuration, which
    /// the scheduler validates first).
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        Self::with_hasher(num_blocks, block_size, enable_prefix_caching, Fnv1a64)
    }
}

impl<H: BlockHasher> BlockManager<H> {
    /// Like [`BlockManager::new`], hashing blocks with `hasher`.
    pub fn with_hasher(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        hasher: H,
    ) -> Self {
        assert!(block_size > 0, "block size must be positive");
        let num_blocks = u32::try_from(num_blocks).expect("block ids must fit in u32");
        BlockManager {
            block_size,
            enable_prefix_caching,
            hasher,
            pool: BlockPool::new(num_blocks),
            window: None,
            seqs: BTreeMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    /// The same manager with a window group of `num_window_blocks` blocks kept for the last
    /// `window` positions of each sequence (see the module documentation); prefix caching off.
    ///
    /// # Panics
    /// If `window` is 0 or `num_window_blocks` exceeds `u32::MAX` (validated by the scheduler).
    pub fn with_window_group(mut self, window: usize, num_window_blocks: usize) -> Self {
        assert!(window > 0, "a sliding window holds at least one position");
        let n = u32::try_from(num_window_blocks).expect("block ids must fit in u32");
        self.enable_prefix_caching = false;
        self.window = Some(WindowGroup {
            window,
            pool: BlockPool::new(n),
        });
        self
    }

    /// The window group's window, if there is one.
    pub fn window(&self) -> Option<usize> {
        self.window.as_ref().map(|w| w.window)
    }

    /// The window group's blocks, all of them and those free now.
    pub fn window_blocks(&self) -> Option<(usize, usize)> {
        self.window
            .as_ref()
            .map(|w| (w.pool.num_blocks(), w.pool.num_available()))
    }

    /// The window-group blocks of `seq`, by position (entries before its window released).
    pub fn window_table(&self, seq: SeqId) -> Option<&BlockTable> {
        self.window.as_ref()?;
        self.seqs.get(&seq).map(|s| &s.window_table)
    }

    /// The most window-group blocks a sequence of `len` tokens computed in chunks of at most
    /// `chunk` tokens ever holds at once: its window before the chunk's first token plus the
    /// chunk, over at most one partial block at each end.
    pub fn window_blocks_for(&self, len: usize, chunk: usize) -> usize {
        let Some(w) = &self.window else { return 0 };
        let span = (w.window - 1 + chunk.max(1)).div_ceil(self.block_size) + 1;
        self.blocks_for(len).min(span)
    }

    /// Give back the window-group blocks of `seq` that no token from `next_pos` on can see (all
    /// their positions are before `next_pos + 1 - window`). No-op without a window group.
    pub fn slide_window(&mut self, seq: SeqId, next_pos: usize) -> Result<(), BlockError> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(BlockError::UnknownSequence(seq))?;
        if let Some(w) = &mut self.window {
            let first_visible = (next_pos + 1).saturating_sub(w.window);
            for b in s
                .window_table
                .take_blocks_before(first_visible, self.block_size)
            {
                w.pool.release(b);
            }
        }
        Ok(())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether full blocks are cached and reused.
    pub fn prefix_caching_enabled(&self) -> bool {
        self.enable_prefix_caching
    }

    /// All blocks, whatever their state.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks an allocation can use now: free ones plus evictable cached ones.
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_available()
    }

    /// Unreferenced blocks still holding reusable cached KV (part of [`Self::num_free_blocks`]).
    pub fn num_evictable_blocks(&self) -> usize {
        self.pool.num_evictable()
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used_blocks(&self) -> usize {
        self.num_blocks() - self.num_free_blocks()
    }

    /// Fraction of blocks in use, in `[0, 1]` (0 for an empty pool).
    pub fn usage(&self) -> f64 {
        if self.num_blocks() == 0 {
            0.0
        } else {
            self.num_used_blocks() as f64 / self.num_blocks() as f64
        }
    }

    /// Whether `n` more blocks could be allocated now.
    pub fn can_allocate(&self, n: usize) -> bool {
        n <= self.num_free_blocks()
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Prefix-cache counters.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Whether `seq` holds blocks.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// The blocks of `seq`, in position order.
    pub fn block_table(&self, seq: SeqId) -> Option<&BlockTable> {
        self.seqs.get(&seq).map(|s| &s.table)
    }

    /// How many leading tokens of `tokens` [`Self::allocate_prompt`] would reuse from the cache
    /// now (a multiple of the block size, below `tokens.len()`); changes nothing.
    pub fn num_cached_prefix_tokens(&self, tokens: &[u32]) -> usize {
        self.match_prefix(tokens).1.len() * self.block_size
    }

    /// Start a sequence: reuse every leading full block of `tokens` that is cached, then give
    /// slots to at most `max_new_tokens` of the remaining tokens (`usize::MAX` for the whole
    /// prompt; less for a prefill chunk, the rest coming later through [`Self::append_slots`]).
    /// At most `(len - 1) / block_size` blocks are reused, so at least the last token is new.
    pub fn allocate_prompt(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        max_new_tokens: usize,
    ) -> Result<PromptAllocation, BlockError> {
        if self.seqs.contains_key(&seq) {
            return Err(BlockError::SequenceExists(seq));
        }
        let (hashes, hits) = self.match_prefix(tokens);
        let num_cached_tokens = hits.len() * self.block_size;
        let num_new_tokens = (tokens.len() - num_cached_tokens).min(max_new_tokens);
        let fresh = self.blocks_for(num_cached_tokens + num_new_tokens) - hits.len();
        // Reusing an evictable block takes it out of the pool that fresh blocks come from.
        let revived = hits
            .iter()
            .filter(|h| self.pool.ref_count(h.block) == 0)
            .count();
        let available = self.pool.num_available() - revived;
        if fresh > available {
            return Err(BlockError::OutOfBlocks {
                needed: fresh,
                available,
            });
        }
        // No prefix hits with a window group: its table covers the same new positions.
        let window_fresh = self.blocks_for(num_cached_tokens + num_new_tokens);
        if let Some(w) = &self.window {
            let available = w.pool.num_available();
            if window_fresh > available {
                return Err(BlockError::OutOfBlocks {
                    needed: window_fresh,
                    available,
                });
            }
        }
        // Retain the hits before taking fresh blocks, so that eviction cannot pick them.
        let mut table = BlockTable::default();
        for hit in &hits {
            self.pool.retain(hit.block);
            table.blocks.push(hit.block);
        }
        if let Err(e) = grow(&mut self.pool, &mut table, fresh) {
            release_all(&mut self.pool, &mut table);
            return Err(e);
        }
        let mut window_table = BlockTable::default();
        if let Some(w) = &mut self.window {
            if let Err(e) = grow(&mut w.pool, &mut window_table, window_fresh) {
                release_all(&mut self.pool, &mut table);
                return Err(e);
            }
        }
        if self.enable_prefix_caching {
            self.stats.queried_tokens += tokens.len() as u64;
            self.stats.hit_tokens += num_cached_tokens as u64;
        }
        let chain = hits.iter().map(|h| h.reg).collect();
        self.seqs.insert(
            seq,
            SeqBlocks {
                table,
                hashes,
                chain,
                window_table,
            },
        );
        Ok(PromptAllocation {
            num_cached_tokens,
            num_new_tokens,
        })
    }

    /// Hashes of the leading reusable full blocks of `tokens` (up to and including the first
    /// miss) and the cached blocks matching them, in order.
    fn match_prefix(&self, tokens: &[u32]) -> (Vec<u64>, Vec<pool::Hit>) {
        let (mut hashes, mut hits) = (Vec::new(), Vec::new());
        if !self.enable_prefix_caching || tokens.is_empty() {
            return (hashes, hits);
        }
        let reusable = (tokens.len() - 1) / self.block_size;
        let (mut parent_hash, mut parent_reg) = (None, None);
        for block_tokens in tokens.chunks_exact(self.block_size).take(reusable) {
            let hash = self.hasher.hash_block(parent_hash, block_tokens);
            hashes.push(hash);
            parent_hash = Some(hash);
            match self.pool.lookup(hash, parent_reg, block_tokens) {
                Some(hit) => {
                    parent_reg = Some(hit.reg);
                    hits.push(hit);
                }
                None => break,
            }
        }
        (hashes, hits)
    }

    /// Grow the table of `seq` to hold `new_total_len` tokens; all or nothing.
    pub fn append_slots(&mut self, seq: SeqId, new_total_len: usize) -> Result<(), BlockError> {
        let needed_blocks = self.blocks_for(new_total_len);
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(BlockError::UnknownSequence(seq))?;
        let missing = needed_blocks.saturating_sub(s.table.blocks.len());
        let Some(w) = &mut self.window else {
            return grow(&mut self.pool, &mut s.table, missing);
        };
        // Both pools or neither: check the window group before taking from the first.
        let window_missing = needed_blocks.saturating_sub(s.window_table.blocks.len());
        let available = w.pool.num_available();
        if window_missing > available {
            return Err(BlockError::OutOfBlocks {
                needed: window_missing,
                available,
            });
        }
        grow(&mut self.pool, &mut s.table, missing)?;
        grow(&mut w.pool, &mut s.window_table, window_missing)
    }

    /// Grow the table of `seq` to hold `new_total_len` tokens from blocks that are free and hold
    /// no cached prefix, else leave it as it is: a lookahead (the block of a decoding sequence's
    /// next position, into which a backend may launch that step ahead) that never evicts, never
    /// preempts and never fails. Not with a window group (its steps are not launched ahead).
    /// Whether the table grew.
    pub fn append_slots_if_free(&mut self, seq: SeqId, new_total_len: usize) -> bool {
        if self.window.is_some() {
            return false;
        }
        let needed_blocks = self.blocks_for(new_total_len);
        let Some(s) = self.seqs.get_mut(&seq) else {
            return false;
        };
        let missing = needed_blocks.saturating_sub(s.table.blocks.len());
        let free = self.pool.num_available() - self.pool.num_evictable();
        missing > 0 && missing <= free && grow(&mut self.pool, &mut s.table, missing).is_ok()
    }

    /// Tell the manager that the KV of `computed_tokens` (the sequence's first tokens) has been
    /// written: every full block among them becomes reusable by later sequences. Blocks already
    /// committed are skipped, so calling this after every step costs only the new blocks.
    pub fn commit_full_blocks(
        &mut self,
        seq: SeqId,
        computed_tokens: &[u32],
    ) -> Result<(), BlockError> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(BlockError::UnknownSequence(seq))?;
        if !self.enable_prefix_caching {
            return Ok(());
        }
        let bs = self.block_size;
        let full = (computed_tokens.len() / bs).min(s.table.blocks.len());
        while s.chain.len() < full {
            let i = s.chain.len();
            let block_tokens = &computed_tokens[i * bs..(i + 1) * bs];
            if s.hashes.len() == i {
                let parent = s.hashes.last().copied();
                s.hashes.push(self.hasher.hash_block(parent, block_tokens));
            }
            let hash = s.hashes[i];
            let parent = s.chain.last().copied();
            let reg = match self.pool.lookup(hash, parent, block_tokens) {
                // Someone else committed the same prefix first: keep theirs as the cached copy.
                Some(hit) => hit.reg,
                None => self
                    .pool
                    .register(s.table.blocks[i], hash, parent, block_tokens),
            };
            s.chain.push(reg);
        }
        Ok(())
    }

    /// Release every block of `seq`: shared ones lose a reference, cached ones become
    /// evictable, the rest free. Returns whether the sequence held blocks.
    pub fn free(&mut self, seq: SeqId) -> bool {
        match self.seqs.remove(&seq) {
            Some(mut s) => {
                release_all(&mut self.pool, &mut s.table);
                if let Some(w) = &mut self.window {
                    release_all(&mut w.pool, &mut s.window_table);
                }
                true
            }
            None => false,
        }
    }

    /// Check every invariant listed in the module documentation.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let mut held = vec![0u32; self.num_blocks()];
        for (id, s) in &self.seqs {
            if s.chain.len() > s.table.blocks.len() || s.chain.len() > s.hashes.len() {
                return Err(InvariantViolation(format!(
                    "sequence {id}: {} committed blocks, {} hashed, {} held",
                    s.chain.len(),
                    s.hashes.len(),
                    s.table.blocks.len()
                )));
            }
            for &b in &s.table.blocks {
                let slot = held.get_mut(b as usize).ok_or_else(|| {
                    InvariantViolation(format!("sequence {id} holds unknown block {b}"))
                })?;
                *slot += 1;
            }
        }
        self.pool.check(&held).map_err(InvariantViolation)?;
        let Some(w) = &self.window else {
            return Ok(());
        };
        let mut held = vec![0u32; w.pool.num_blocks()];
        for (id, s) in &self.seqs {
            if s.window_table.blocks.len() != s.table.blocks.len() {
                return Err(InvariantViolation(format!(
                    "sequence {id}: window table of {} entries beside a table of {}",
                    s.window_table.blocks.len(),
                    s.table.blocks.len()
                )));
            }
            for b in s.window_table.held() {
                let slot = held.get_mut(b as usize).ok_or_else(|| {
                    InvariantViolation(format!("sequence {id} holds unknown window block {b}"))
                })?;
                *slot += 1;
            }
        }
        w.pool
            .check(&held)
            .map_err(|e| InvariantViolation(format!("window group: {e}")))
    }
}

/// Append `n` fresh blocks to `table`, all or nothing.
fn grow(pool: &mut BlockPool, table: &mut BlockTable, n: usize) -> Result<(), BlockError> {
    let available = pool.num_available();
    if n > available {
        return Err(BlockError::OutOfBlocks {
            needed: n,
            available,
        });
    }
    let start = table.blocks.len();
    for _ in 0..n {
        match pool.take() {
            Some(b) => table.blocks.push(b),
            None => {
                // Unreachable after the check above; undo rather than panic if it ever is.
                for b in table.blocks.drain(start..).rev() {
                    pool.release(b);
                }
                return Err(BlockError::OutOfBlocks {
                    needed: n,
                    available,
                });
            }
        }
    }
    Ok(())
}

/// Release `table`'s blocks last to first and empty it. Last to first because the LRU list then
/// recycles a sequence's tail before its prefix, which other sequences are likelier to share.
fn release_all(pool: &mut BlockPool, table: &mut BlockTable) {
    for b in table
        .blocks
        .drain(..)
        .rev()
        .filter(|&b| b != RELEASED_BLOCK)
    {
        pool.release(b);
    }
}
