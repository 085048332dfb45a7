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
        for id in table.blocks.drain(..) {
            self.release(id);
        }
    }
}

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
