//! The block manager's promises, without a model: conservation of blocks, all-or-nothing
//! allocation, prefix reuse only of committed full blocks, LRU eviction, and that a hash
//! collision can never hand one sequence another's KV.

use moerun_engine::block_manager::{BlockError, BlockHasher, BlockManager, PromptAllocation};

/// Every block hashes alike: every lookup is a collision, so only the token and parent
/// comparisons stand between a sequence and someone else's KV.
struct ConstantHasher;

impl BlockHasher for ConstantHasher {
    fn hash_block(&self, _parent: Option<u64>, _tokens: &[u32]) -> u64 {
        7
    }
}

fn whole(bm: &mut BlockManager, seq: u64, tokens: &[u32]) -> PromptAllocation {
    let alloc = bm.allocate_prompt(seq, tokens, usize::MAX).unwrap();
    bm.check_invariants().unwrap();
    alloc
}

fn held_blocks<H: BlockHasher>(bm: &BlockManager<H>, seq: u64) -> Vec<u32> {
    bm.block_table(seq).unwrap().blocks.clone()
}

#[test]
fn a_prompt_takes_whole_blocks_and_free_returns_every_one() {
    let mut bm = BlockManager::new(8, 4, true);
    let alloc = whole(&mut bm, 1, &[1, 2, 3, 4, 5]);
    assert_eq!(alloc.num_cached_tokens, 0);
    assert_eq!(alloc.num_new_tokens, 5);
    assert_eq!(held_blocks(&bm, 1).len(), 2);
    assert_eq!(bm.num_free_blocks(), 6);
    assert_eq!(bm.usage(), 0.25);
    bm.append_slots(1, 8).unwrap();
    assert_eq!(
        held_blocks(&bm, 1).len(),
        2,
        "8 tokens still fit in two blocks"
    );
    bm.append_slots(1, 9).unwrap();
    assert_eq!(held_blocks(&bm, 1).len(), 3);
    assert!(bm.free(1));
    assert!(!bm.free(1), "a second free is a no-op");
    assert_eq!(bm.num_free_blocks(), 8);
    bm.check_invariants().unwrap();
}

#[test]
fn allocation_is_all_or_nothing_when_blocks_run_out() {
    let mut bm = BlockManager::new(3, 4, true);
    let err = bm.allocate_prompt(1, &[0; 13], usize::MAX).unwrap_err();
    assert_eq!(
        err,
        BlockError::OutOfBlocks {
            needed: 4,
            available: 3
        }
    );
    assert!(!bm.contains(1));
    whole(&mut bm, 1, &[0; 8]);
    let err = bm.append_slots(1, 17).unwrap_err();
    assert!(matches!(err, BlockError::OutOfBlocks { needed: 3, .. }));
    assert_eq!(held_blocks(&bm, 1).len(), 2, "a failed append adds nothing");
    assert_eq!(bm.num_free_blocks(), 1);
    assert!(bm.can_allocate(1) && !bm.can_allocate(2));
    bm.check_invariants().unwrap();
}

#[test]
fn a_prompt_chunk_gets_slots_only_for_the_tokens_asked_for() {
    let mut bm = BlockManager::new(8, 4, true);
    let alloc = bm.allocate_prompt(1, &[0; 20], 6).unwrap();
    assert_eq!(alloc.num_new_tokens, 6);
    assert_eq!(held_blocks(&bm, 1).len(), 2);
}

#[test]
fn misuse_by_sequence_id_is_an_error_not_a_panic() {
    let mut bm = BlockManager::new(4, 4, true);
    assert_eq!(bm.append_slots(9, 4), Err(BlockError::UnknownSequence(9)));
    assert_eq!(
        bm.commit_full_blocks(9, &[1, 2, 3, 4]),
        Err(BlockError::UnknownSequence(9))
    );
    whole(&mut bm, 9, &[1]);
    assert_eq!(
        bm.allocate_prompt(9, &[1], usize::MAX),
        Err(BlockError::SequenceExists(9))
    );
    assert!(bm.block_table(10).is_none());
}

#[test]
fn a_second_sequence_reuses_the_committed_full_blocks_of_a_shared_prefix() {
    let mut bm = BlockManager::new(16, 4, true);
    let system: Vec<u32> = (100..112).collect(); // three full blocks
    let first: Vec<u32> = system.iter().copied().chain([1, 2]).collect();
    let second: Vec<u32> = system.iter().copied().chain([3, 4, 5]).collect();
    whole(&mut bm, 1, &first);
    bm.commit_full_blocks(1, &first).unwrap();
    let alloc = whole(&mut bm, 2, &second);
    assert_eq!(alloc.num_cached_tokens, 12);
    assert_eq!(alloc.num_new_tokens, 3);
    let (a, b) = (held_blocks(&bm, 1), held_blocks(&bm, 2));
    assert_eq!(a[..3], b[..3], "the shared blocks are the same blocks");
    assert_ne!(a[3], b[3]);
    assert_eq!(bm.num_used_blocks(), 5, "3 shared + 1 + 1");
    let stats = bm.prefix_cache_stats();
    assert_eq!((stats.queried_tokens, stats.hit_tokens), (14 + 15, 12));
}

#[test]
fn the_block_holding_the_last_prompt_token_is_never_reused() {
    let mut bm = BlockManager::new(16, 4, true);
    let prompt: Vec<u32> = (0..8).collect();
    whole(&mut bm, 1, &prompt);
    bm.commit_full_blocks(1, &prompt).unwrap();
    assert_eq!(bm.num_cached_prefix_tokens(&prompt), 4, "capped at len - 1");
    let alloc = whole(&mut bm, 2, &prompt);
    assert_eq!((alloc.num_cached_tokens, alloc.num_new_tokens), (4, 4));
    let longer: Vec<u32> = (0..9).collect();
    assert_eq!(bm.num_cached_prefix_tokens(&longer), 8);
}

#[test]
fn blocks_are_reused_only_after_they_are_committed() {
    let mut bm = BlockManager::new(16, 4, true);
    let prompt: Vec<u32> = (0..13).collect();
    whole(&mut bm, 1, &prompt);
    assert_eq!(
        bm.num_cached_prefix_tokens(&prompt),
        0,
        "nothing computed yet"
    );
    bm.commit_full_blocks(1, &prompt[..7]).unwrap();
    assert_eq!(
        bm.num_cached_prefix_tokens(&prompt),
        4,
        "only the full computed block"
    );
    bm.commit_full_blocks(1, &prompt).unwrap();
    assert_eq!(bm.num_cached_prefix_tokens(&prompt), 12);
    bm.check_invariants().unwrap();
}

#[test]
fn a_prefix_computed_twice_is_cached_once_and_both_copies_are_released() {
    let mut bm = BlockManager::new(8, 4, true);
    let prompt: Vec<u32> = (0..9).collect();
    // Both arrive before either has computed anything, so neither can share.
    whole(&mut bm, 1, &prompt);
    whole(&mut bm, 2, &prompt);
    bm.commit_full_blocks(1, &prompt).unwrap();
    bm.commit_full_blocks(2, &prompt).unwrap();
    bm.check_invariants().unwrap();
    let alloc = whole(&mut bm, 3, &prompt);
    assert_eq!(alloc.num_cached_tokens, 8);
    assert_eq!(held_blocks(&bm, 3)[..2], held_blocks(&bm, 1)[..2]);
    for seq in 1..=3 {
        bm.free(seq);
    }
    assert_eq!(bm.num_free_blocks(), 8);
    assert_eq!(
        bm.num_evictable_blocks(),
        2,
        "only the first copy is cached"
    );
    bm.check_invariants().unwrap();
}

#[test]
fn a_freed_shared_prefix_stays_reusable_until_evicted() {
    let mut bm = BlockManager::new(4, 4, true);
    let prompt: Vec<u32> = (0..9).collect();
    whole(&mut bm, 1, &prompt);
    bm.commit_full_blocks(1, &prompt).unwrap();
    bm.free(1);
    assert_eq!(bm.num_free_blocks(), 4, "evictable blocks count as free");
    assert_eq!(bm.num_evictable_blocks(), 2);
    assert_eq!(bm.num_used_blocks(), 0);
    let alloc = whole(&mut bm, 2, &prompt);
    assert_eq!(alloc.num_cached_tokens, 8);
    assert_eq!(bm.num_evictable_blocks(), 0, "the hits are in use again");
    bm.free(2);
    // Four fresh blocks of other content need every block: the cached ones are evicted.
    whole(&mut bm, 3, &[50; 16]);
    assert_eq!(bm.num_evictable_blocks(), 0);
    assert_eq!(bm.num_cached_prefix_tokens(&prompt), 0);
}

#[test]
fn eviction_recycles_the_least_recently_released_blocks_first() {
    let mut bm = BlockManager::new(6, 4, true);
    let prompts: Vec<Vec<u32>> = (0..3u32).map(|s| vec![s * 10; 5]).collect();
    for (seq, p) in prompts.iter().enumerate() {
        whole(&mut bm, seq as u64, p);
        bm.commit_full_blocks(seq as u64, p).unwrap();
    }
    for seq in 0..3 {
        bm.free(seq);
    }
    // Three free tail blocks plus three cached first blocks; four fresh blocks evict one,
    // the first released.
    whole(&mut bm, 9, &[7; 16]);
    assert_eq!(bm.num_cached_prefix_tokens(&prompts[0]), 0);
    assert_eq!(bm.num_cached_prefix_tokens(&prompts[1]), 4);
    assert_eq!(bm.num_cached_prefix_tokens(&prompts[2]), 4);
    // A hit refreshes a block: reuse sequence 1's prefix, release it, then evict one more.
    whole(&mut bm, 10, &prompts[1]);
    bm.free(10);
    bm.free(9);
    whole(&mut bm, 11, &[8; 20]);
    assert_eq!(
        bm.num_cached_prefix_tokens(&prompts[1]),
        4,
        "refreshed, kept"
    );
    assert_eq!(
        bm.num_cached_prefix_tokens(&prompts[2]),
        0,
        "older, evicted"
    );
    bm.check_invariants().unwrap();
}

#[test]
fn a_sequence_releases_its_tail_before_its_prefix() {
    let mut bm = BlockManager::new(4, 4, true);
    let prompt: Vec<u32> = (0..13).collect();
    whole(&mut bm, 1, &prompt);
    bm.commit_full_blocks(1, &prompt).unwrap();
    bm.free(1);
    // The tail block is free, three are cached; two fresh blocks evict exactly one of those.
    whole(&mut bm, 2, &[99; 8]);
    assert_eq!(
        bm.num_cached_prefix_tokens(&prompt),
        8,
        "the tail went first"
    );
}

#[test]
fn colliding_hashes_never_return_another_sequences_blocks() {
    let mut bm = BlockManager::with_hasher(16, 4, true, ConstantHasher);
    let a = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    bm.allocate_prompt(1, &a, usize::MAX).unwrap();
    bm.commit_full_blocks(1, &a).unwrap();
    // Same first block, different second block: only the first may be shared.
    assert_eq!(
        bm.num_cached_prefix_tokens(&[1, 2, 3, 4, 50, 60, 70, 80, 9]),
        4
    );
    // Same second block after a different first block: the chain differs, nothing shared.
    assert_eq!(bm.num_cached_prefix_tokens(&[0, 2, 3, 4, 5, 6, 7, 8, 9]), 0);
    assert_eq!(bm.num_cached_prefix_tokens(&[9; 9]), 0);
    assert_eq!(bm.num_cached_prefix_tokens(&a), 8);
    bm.check_invariants().unwrap();
}

#[test]
fn a_cached_block_never_matches_after_its_parent_was_evicted_and_its_id_reused() {
    let mut bm = BlockManager::with_hasher(4, 2, true, ConstantHasher);
    let a = [1, 2];
    let g = [1, 2, 3, 4, 9];
    bm.allocate_prompt(1, &a, usize::MAX).unwrap();
    bm.allocate_prompt(2, &g, usize::MAX).unwrap();
    bm.commit_full_blocks(1, &a).unwrap();
    // Sequence 2's copy of [1, 2] stays private; its [3, 4] block chains on sequence 1's.
    bm.commit_full_blocks(2, &g[..4]).unwrap();
    let a0 = held_blocks(&bm, 1)[0];
    bm.free(1);
    // The only unreferenced block is a0: this evicts it and registers it as [5, 6].
    bm.allocate_prompt(3, &[5, 6], usize::MAX).unwrap();
    assert_eq!(held_blocks(&bm, 3), [a0]);
    bm.commit_full_blocks(3, &[5, 6]).unwrap();
    bm.free(2);
    bm.check_invariants().unwrap();
    // [3, 4] was computed after [1, 2], not after [5, 6], though its recorded parent block id
    // now holds [5, 6]: only the first block may be reused.
    assert_eq!(bm.num_cached_prefix_tokens(&[5, 6, 3, 4, 9]), 2);
    assert_eq!(
        bm.num_cached_prefix_tokens(&[1, 2, 3, 4, 9]),
        0,
        "parent gone"
    );
}

#[test]
fn with_caching_disabled_nothing_is_reused_or_counted() {
    let mut bm = BlockManager::new(8, 4, false);
    let prompt: Vec<u32> = (0..9).collect();
    whole(&mut bm, 1, &prompt);
    bm.commit_full_blocks(1, &prompt).unwrap();
    assert_eq!(whole(&mut bm, 2, &prompt).num_cached_tokens, 0);
    bm.free(1);
    bm.free(2);
    assert_eq!(bm.num_evictable_blocks(), 0);
    assert_eq!(bm.prefix_cache_stats().queried_tokens, 0);
}

/// SplitMix64: a seeded generator small enough to keep the test self-contained.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn random_operations_keep_every_invariant<H: BlockHasher>(mut bm: BlockManager<H>, seed: u64) {
    let mut rng = Rng(seed);
    let mut live: Vec<(u64, Vec<u32>, usize)> = Vec::new(); // id, tokens, computed
    for next_id in 0..3000u64 {
        match rng.below(4) {
            0 => {
                // A prompt from a few shared prefixes and a small vocabulary, so that hits,
                // near misses and duplicates all happen.
                let len = 1 + rng.below(24);
                let family = rng.below(3) as u32;
                let tokens: Vec<u32> = (0..len)
                    .map(|i| if i < 10 { family } else { rng.below(3) as u32 })
                    .collect();
                let chunk = 1 + rng.below(len);
                if let Ok(a) = bm.allocate_prompt(next_id, &tokens, chunk) {
                    assert!(a.num_cached_tokens < tokens.len());
                    live.push((next_id, tokens, a.num_cached_tokens));
                }
            }
            1 if !live.is_empty() => {
                let i = rng.below(live.len());
                let (id, tokens, computed) = &mut live[i];
                let held = bm.block_table(*id).unwrap().capacity(4).min(tokens.len());
                *computed = (*computed).max(held);
                bm.commit_full_blocks(*id, &tokens[..*computed]).unwrap();
                if *computed == tokens.len() {
                    tokens.push(rng.below(3) as u32);
                }
                let _ = bm.append_slots(*id, (*computed + 1 + rng.below(6)).min(tokens.len()));
            }
            2 if !live.is_empty() => {
                let (id, _, _) = live.swap_remove(rng.below(live.len()));
                assert!(bm.free(id));
            }
            _ => {}
        }
        bm.check_invariants().unwrap();
    }
    for (id, _, _) in live {
        bm.free(id);
    }
    bm.check_invariants().unwrap();
    assert_eq!(bm.num_free_blocks(), bm.num_blocks());
}

#[test]
fn random_allocations_commits_and_frees_keep_every_invariant() {
    random_operations_keep_every_invariant(BlockManager::new(24, 4, true), 1);
    random_operations_keep_every_invariant(
        BlockManager::with_hasher(24, 4, true, ConstantHasher),
        2,
    );
    random_operations_keep_every_invariant(BlockManager::new(24, 4, false), 3);
}

#[test]
fn a_lookahead_takes_only_free_blocks_and_never_fails() {
    let mut bm = BlockManager::new(3, 4, true);
    whole(&mut bm, 1, &[1, 2, 3, 4]);
    bm.commit_full_blocks(1, &[1, 2, 3, 4]).unwrap();
    assert!(bm.free(1)); // its block stays cached, evictable
    whole(&mut bm, 2, &[9, 9, 9]);
    assert!(bm.append_slots_if_free(2, 5), "a free block");
    assert_eq!(held_blocks(&bm, 2).len(), 2);
    assert!(!bm.append_slots_if_free(2, 6), "nothing missing");
    // What is left is the cached block: the lookahead does not evict it.
    assert_eq!(bm.num_evictable_blocks(), 1);
    assert!(!bm.append_slots_if_free(2, 9));
    assert_eq!(bm.num_evictable_blocks(), 1);
    assert_eq!(held_blocks(&bm, 2).len(), 2);
    assert!(
        !bm.append_slots_if_free(7, 4),
        "an unknown sequence is left alone"
    );
    bm.check_invariants().unwrap();
}
