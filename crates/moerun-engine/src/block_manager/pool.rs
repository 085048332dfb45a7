//! The pool of KV blocks behind [`super::BlockManager`]: reference counts, the free list, the
//! LRU list of evictable cached blocks and the hash index of cached blocks.
//!
//! Every block is in exactly one state:
//! - **in use**: referenced by at least one sequence (`ref_count > 0`);
//! - **evictable**: unreferenced but registered in the prefix cache, so its KV can still be
//!   reused by hash; it sits in the LRU list and is recycled only when no free block is left;
//! - **free**: unreferenced and unregistered, on the free list.
//!
//! [`BlockPool::check`] verifies exactly that, and that the hash index and the per-block cache
//! entries agree.

use std::collections::{BTreeMap, HashMap};

/// The identity of one registration in the prefix cache. Unlike a block id it is never reused:
/// when a cached block is evicted and later registered with other content, its children (which
/// name their parent by this id) can no longer match, even if their hashes collide.
pub(super) type RegId = u64;

/// What the prefix cache knows about a registered block.
#[derive(Debug)]
struct CacheEntry {
    hash: u64,
    reg: RegId,
    /// The registration of the previous block of the prefix, `None` for a first block.
    parent: Option<RegId>,
    /// The block's token ids, compared on every hit so that a hash collision is only a miss.
    tokens: Box<[u32]>,
}

#[derive(Debug, Default)]
struct BlockMeta {
    ref_count: u32,
    cached: Option<CacheEntry>,
    /// Key in the LRU list while the block is evictable.
    lru_tick: Option<u64>,
}

/// A cached block that matches a lookup: its id and its registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Hit {
    pub block: u32,
    pub reg: RegId,
}

#[derive(Debug)]
pub(super) struct BlockPool {
    metas: Vec<BlockMeta>,
    /// A stack: freed blocks are reused first, which keeps the working set small.
    free: Vec<u32>,
    /// Evictable blocks by the tick at which they became unreferenced: the first is the least
    /// recently used. A BTreeMap removes from the middle (a revived block) in O(log n).
    lru: BTreeMap<u64, u32>,
    next_tick: u64,
    /// Registered blocks by chain hash; more than one only when hashes collide.
    by_hash: HashMap<u64, Vec<u32>>,
    next_reg: RegId,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks.
    pub fn new(num_blocks: u32) -> BlockPool {
        BlockPool {
            metas: (0..num_blocks).map(|_| BlockMeta::default()).collect(),
            // Popped from the end: low ids are handed out first, easier to read in traces.
            free: (0..num_blocks).rev().collect(),
            lru: BTreeMap::new(),
            next_tick: 0,
            by_hash: HashMap::new(),
            next_reg: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.metas.len()
    }

    /// Blocks that [`BlockPool::take`] can hand out: free plus evictable.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn num_evictable(&self) -> usize {
        self.lru.len()
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.metas[block as usize].ref_count
    }

    /// Take an unreferenced block for a sequence's exclusive use: a free one if any, else the
    /// least recently used evictable one, whose cache entry is dropped.
    pub fn take(&mut self) -> Option<u32> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.lru.pop_first()?;
                self.metas[b as usize].lru_tick = None;
                self.unregister(b);
                b
            }
        };
        self.metas[block as usize].ref_count = 1;
        Some(block)
    }

    /// Add a reference to a registered block (a prefix-cache hit); an evictable block leaves
    /// the LRU list.
    pub fn retain(&mut self, block: u32) {
        let meta = &mut self.metas[block as usize];
        if let Some(tick) = meta.lru_tick.take() {
            self.lru.remove(&tick);
        }
        meta.ref_count += 1;
    }

    /// Drop a reference. The last one sends a registered block to the most recently used end
    /// of the LRU list and an unregistered one to the free list.
    pub fn release(&mut self, block: u32) {
        let meta = &mut self.metas[block as usize];
        debug_assert!(meta.ref_count > 0, "release of unreferenced block {block}");
        // The manager only releases blocks its tables hold, so a count at zero never happens;
        // if it ever did, ignoring the release is safer than wrapping or listing a block twice.
        if meta.ref_count == 0 {
            return;
        }
        meta.ref_count -= 1;
        if meta.ref_count > 0 {
            return;
        }
        if meta.cached.is_some() {
            let tick = self.next_tick;
            self.next_tick += 1;
            meta.lru_tick = Some(tick);
            self.lru.insert(tick, block);
        } else {
            self.free.push(block);
        }
    }

    /// The registered block holding `tokens` after the prefix registered as `parent`.
    pub fn lookup(&self, hash: u64, parent: Option<RegId>, tokens: &[u32]) -> Option<Hit> {
        self.by_hash.get(&hash)?.iter().find_map(|&b| {
            let e = self.metas[b as usize].cached.as_ref()?;
            (e.parent == parent && *e.tokens == *tokens).then_some(Hit {
                block: b,
                reg: e.reg,
            })
        })
    }

    /// Register an in-use, unregistered block as holding `tokens` after `parent`.
    pub fn register(
        &mut self,
        block: u32,
        hash: u64,
        parent: Option<RegId>,
        tokens: &[u32],
    ) -> RegId {
        let reg = self.next_reg;
        self.next_reg += 1;
        let meta = &mut self.metas[block as usize];
        debug_assert!(meta.ref_count > 0 && meta.cached.is_none());
        meta.cached = Some(CacheEntry {
            hash,
            reg,
            parent,
            tokens: tokens.into(),
        });
        self.by_hash.entry(hash).or_default().push(block);
        reg
    }

    fn unregister(&mut self, block: u32) {
        let Some(entry) = self.metas[block as usize].cached.take() else {
            return;
        };
        if let Some(list) = self.by_hash.get_mut(&entry.hash) {
            list.retain(|&b| b != block);
            if list.is_empty() {
                self.by_hash.remove(&entry.hash);
            }
        }
    }

    /// Check the pool's own invariants given how many references the sequences' tables hold
    /// to each block (`held[b]`).
    pub fn check(&self, held: &[u32]) -> Result<(), String> {
        let n = self.metas.len();
        let mut on_free = vec![false; n];
        for &b in &self.free {
            let slot = on_free
                .get_mut(b as usize)
                .ok_or(format!("free list holds unknown block {b}"))?;
            if std::mem::replace(slot, true) {
                return Err(format!("block {b} is on the free list twice"));
            }
        }
        let mut on_lru = vec![false; n];
        for (&tick, &b) in &self.lru {
            if self.metas[b as usize].lru_tick != Some(tick) {
                return Err(format!("LRU entry {tick} -> {b} disagrees with the block"));
            }
            on_lru[b as usize] = true;
        }
        let (mut in_use, mut evictable, mut free) = (0, 0, 0);
        for (b, m) in self.metas.iter().enumerate() {
            if m.ref_count != held[b] {
                return Err(format!(
                    "block {b}: ref count {} but tables hold {}",
                    m.ref_count, held[b]
                ));
            }
            match (m.ref_count > 0, on_lru[b], on_free[b]) {
                (true, false, false) => in_use += 1,
                (false, true, false) if m.cached.is_some() => evictable += 1,
                (false, false, true) if m.cached.is_none() => free += 1,
                state => return Err(format!("block {b} is in state {state:?}, {m:?}")),
            }
            if let Some(e) = &m.cached {
                let listed = self
                    .by_hash
                    .get(&e.hash)
                    .is_some_and(|l| l.contains(&(b as u32)));
                if !listed {
                    return Err(format!("cached block {b} missing from the hash index"));
                }
            }
        }
        for (h, list) in &self.by_hash {
            for &b in list {
                if self.metas[b as usize].cached.as_ref().map(|e| e.hash) != Some(*h) {
                    return Err(format!("hash index entry {h:x} -> {b} is stale"));
                }
            }
        }
        if in_use + evictable + free != n {
            return Err(format!("{in_use} + {evictable} + {free} blocks != {n}"));
        }
        Ok(())
    }
}
