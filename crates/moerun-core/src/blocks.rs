//! Paged KV cache bookkeeping, as pure policy: a [`BlockAllocator`] owns a fixed number of
//! fixed-size blocks; a sequence owns a [`BlockTable`] mapping its token positions to blocks.
//! Blocks are reference counted so that a later prefix cache can share them between sequences.
//! The storage the blocks index lives in a backend (`moerun-cpu`'s KV pools, later CUDA memory).

use crate::{Error, Result};

/// Hands out and takes back KV blocks. Block ids index the backend's KV pools.
#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    free: Vec<u32>,
    ref_counts: Vec<u32>,
}

impl BlockAllocator {
    /// An allocator over `num_blocks` blocks of `block_size` tokens each.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        // Pop from the end, so hand out low ids first: easier to read in traces.
        let free = (0..num_blocks as u32).rev().collect();
        BlockAllocator {
            block_size,
            free,
            ref_counts: vec![0; num_blocks],
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Take one free block.
    pub fn allocate(&mut self) -> Result<u32> {
        let id = self
            .free
            .pop()
            .ok_or(Error::OutOfKvBlocks { needed: 1, free: 0 })?;
        self.ref_counts[id as usize] = 1;
        Ok(id)
    }

    /// Add a reference to a block already in use (prefix sharing).
    pub fn retain(&mut self, id: u32) {
        let rc = &mut self.ref_counts[id as usize];
        assert!(*rc > 0, "retain of free block {id}");
        *rc += 1;
    }

    /// Drop a reference; the block returns to the free list when none is left.
    pub fn release(&mut self, id: u32) {
        let rc = &mut self.ref_counts[id as usize];
        assert!(*rc > 0, "double release of block {id}");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(id);
        }
    }

    /// Grow `table` so that it can hold `num_tokens` tokens; all or nothing.
    pub fn reserve(&mut self, table: &mut BlockTable, num_tokens: usize) -> Result<()> {
        let needed = num_tokens.div_ceil(self.block_size);
        let missing = needed.saturating_sub(table.blocks.len());
        if missing > self.free.len() {
            return Err(Error::OutOfKvBlocks {
                needed: missing,
                free: self.free.len(),
            });
        }
        for _ in 0..missing {
            let id = self.allocate()?;
            table.blocks.push(id);
        }
        Ok(())
    }

    /// Release every block of `table` and empty it.
    pub fn free_table(&mut self, table: &mut BlockTable) {
        for id in table.blocks.drain(..).filter(|&b| b != RELEASED_BLOCK) {
            self.release(id);
        }
    }

    /// Release the blocks of `table` that hold only positions before `pos` (a sliding
    /// window's KV that no later query can see), leaving [`RELEASED_BLOCK`] in their entries.
    pub fn release_before(&mut self, table: &mut BlockTable, pos: usize) {
        for id in table.take_blocks_before(pos, self.block_size) {
            self.release(id);
        }
    }
}

/// A block-table entry whose block was given back because every position in it had left the
/// sliding window of the layers the table serves ([`BlockTable::take_blocks_before`]). Entries
/// stay indexed by position, so a table only ever grows; no kernel reads a position before its
/// window, so none reads such an entry.
pub const RELEASED_BLOCK: u32 = u32::MAX;

/// The blocks of one sequence, in position order: token at position `p` lives in block
/// `blocks[p / block_size]`, slot `p % block_size`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
}

impl BlockTable {
    /// The (block, slot) of position `pos`.
    pub fn slot(&self, pos: usize, block_size: usize) -> (u32, usize) {
        (self.blocks[pos / block_size], pos % block_size)
    }

    /// How many tokens the table can hold.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// The blocks still held (entries other than [`RELEASED_BLOCK`]), in position order.
    pub fn held(&self) -> impl Iterator<Item = u32> + '_ {
        self.blocks.iter().copied().filter(|&b| b != RELEASED_BLOCK)
    }

    /// Take out the held blocks whose every position is before `pos`, marking their entries
    /// [`RELEASED_BLOCK`]; returns them, last first (the order a pool should get them back).
    pub fn take_blocks_before(&mut self, pos: usize, block_size: usize) -> Vec<u32> {
        let whole = (pos / block_size).min(self.blocks.len());
        let mut taken = Vec::new();
        for entry in self.blocks[..whole].iter_mut().rev() {
            if *entry == RELEASED_BLOCK {
                break; // everything before was released by an earlier call
            }
            taken.push(std::mem::replace(entry, RELEASED_BLOCK));
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_allocates_whole_blocks_and_free_returns_them() {
        let mut a = BlockAllocator::new(4, 16);
        let mut t = BlockTable::default();
        a.reserve(&mut t, 17).unwrap();
        assert_eq!(t.blocks.len(), 2);
        assert_eq!(a.num_free(), 2);
        a.reserve(&mut t, 32).unwrap();
        assert_eq!(t.blocks.len(), 2, "32 tokens still fit in two blocks");
        a.free_table(&mut t);
        assert_eq!(a.num_free(), 4);
        assert!(t.blocks.is_empty());
    }

    #[test]
    fn release_before_gives_back_only_whole_blocks_before_the_position() {
        let mut a = BlockAllocator::new(8, 4);
        let mut t = BlockTable::default();
        a.reserve(&mut t, 14).unwrap(); // blocks for positions 0-3, 4-7, 8-11, 12-15
        let ids = t.blocks.clone();
        a.release_before(&mut t, 7); // position 7 still visible: only the first block goes
        assert_eq!(t.blocks, [RELEASED_BLOCK, ids[1], ids[2], ids[3]]);
        assert_eq!(a.num_free(), 5);
        a.release_before(&mut t, 12);
        assert_eq!(t.held().collect::<Vec<_>>(), [ids[3]]);
        assert_eq!(a.num_free(), 7);
        a.release_before(&mut t, 12); // nothing more to give back
        assert_eq!(a.num_free(), 7);
        // The table keeps its length (entries are by position) and grows from there.
        a.reserve(&mut t, 20).unwrap();
        assert_eq!(t.blocks.len(), 5);
        assert_eq!(t.capacity(4), 20);
        a.free_table(&mut t);
        assert_eq!(a.num_free(), 8);
    }

    #[test]
    fn reserve_is_all_or_nothing_when_blocks_run_out() {
        let mut a = BlockAllocator::new(2, 4);
        let mut t = BlockTable::default();
        let err = a.reserve(&mut t, 9).unwrap_err();
        assert!(matches!(err, Error::OutOfKvBlocks { needed: 3, free: 2 }));
        assert_eq!(a.num_free(), 2);
        assert!(t.blocks.is_empty());
    }

    #[test]
    fn shared_block_is_freed_only_after_last_release() {
        let mut a = BlockAllocator::new(1, 4);
        let id = a.allocate().unwrap();
        a.retain(id);
        a.release(id);
        assert_eq!(a.num_free(), 0);
        a.release(id);
        assert_eq!(a.num_free(), 1);
    }

    #[test]
    fn slot_maps_positions_through_the_table() {
        let t = BlockTable { blocks: vec![7, 3] };
        assert_eq!(t.slot(0, 4), (7, 0));
        assert_eq!(t.slot(5, 4), (3, 1));
    }
}
