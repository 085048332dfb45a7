//! No request is lost or corrupted under random load: 200 random requests sharing a few system
//! prompts, random arrival, random EOS, random aborts, a KV cache small enough to force
//! preemption, run with a fake model until everything finishes.
//!
//! The fake model keeps a KV store: each slot records a fingerprint of the whole prefix up to
//! its position. Before computing a chunk it checks that every earlier position of the sequence
//! holds exactly that sequence's prefix, so a block shared wrongly, overwritten while shared, or
//! reused from the cache with the wrong content fails the test at once.

use std::collections::BTreeMap;

use moerun_core::RELEASED_BLOCK;
use moerun_engine::block_manager::{BlockHasher, Fnv1a64};
use moerun_engine::scheduler::{
    AddError, FinishReason, Finished, KvWindowGroup, Request, Scheduler, SchedulerConfig,
};

/// Every block hashes alike, so every prefix-cache lookup is a collision.
struct ConstantHasher;

impl BlockHasher for ConstantHasher {
    fn hash_block(&self, _parent: Option<u64>, _tokens: &[u32]) -> u64 {
        7
    }
}

/// SplitMix64, seeded.
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

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

const BLOCK_SIZE: usize = 4;

fn config(enable_prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 24,
        max_model_len: 80,
        block_size: BLOCK_SIZE,
        num_blocks: 40,
        enable_prefix_caching,
        max_waiting: 24,
        kv_window: None,
    }
}

/// Sliding-window layers with blocks of their own: a window of 10 positions (not a multiple of
/// the block size), their pool smaller than the other one.
const WINDOW: KvWindowGroup = KvWindowGroup {
    window: 10,
    num_blocks: 30,
};

/// The token the fake model samples for request `id` at position `pos`.
fn fake_token(id: u64, pos: usize) -> u32 {
    (id * 1000 + pos as u64) as u32
}

/// A fingerprint of a whole prefix: what the KV at its last position depends on.
fn fingerprint(prefix: &[u32]) -> u64 {
    prefix.iter().fold(0x1234_5678_9abc_def1, |h, &t| {
        (h ^ u64::from(t))
            .wrapping_mul(0x2545_f491_4f6c_dd1d)
            .rotate_left(17)
    })
}

fn random_requests(rng: &mut Rng, n: u64) -> Vec<Request> {
    let systems: Vec<Vec<u32>> = (0..3)
        .map(|s| {
            (0..9 + 4 * s)
                .map(|i| 10_000 + 100 * s as u32 + i as u32)
                .collect()
        })
        .collect();
    (0..n)
        .map(|id| {
            let mut prompt = if rng.chance(70) {
                systems[rng.below(systems.len())].clone()
            } else {
                Vec::new()
            };
            // A small vocabulary makes partial matches and equal suffixes common.
            let suffix = 1 + rng.below(30);
            prompt.extend((0..suffix).map(|_| rng.below(4) as u32));
            let max_new_tokens = 1 + rng.below(20);
            Request {
                id,
                prompt_tokens: prompt,
                max_new_tokens,
            }
        })
        .collect()
}

fn run_workload<H: BlockHasher>(mut s: Scheduler<H>, seed: u64) {
    let cfg = s.config().clone();
    let mut rng = Rng(seed);
    let requests = random_requests(&mut rng, 200);
    let by_id: BTreeMap<u64, Request> = requests.iter().map(|r| (r.id, r.clone())).collect();
    let mut to_add = requests.into_iter().peekable();
    let mut finished: BTreeMap<u64, Finished> = BTreeMap::new();
    let mut kv: Vec<Vec<Option<u64>>> = vec![vec![None; BLOCK_SIZE]; cfg.num_blocks];
    let window_blocks = cfg.kv_window.map_or(0, |w| w.num_blocks);
    let mut window_kv: Vec<Vec<Option<u64>>> = vec![vec![None; BLOCK_SIZE]; window_blocks];
    let record = |f: Finished, finished: &mut BTreeMap<u64, Finished>| {
        let r = &by_id[&f.id];
        let expected: Vec<u32> = (0..r.max_new_tokens)
            .map(|k| fake_token(f.id, r.prompt_tokens.len() + k))
            .collect();
        match f.reason {
            FinishReason::Length => assert_eq!(f.output_tokens, expected, "request {}", f.id),
            _ => assert_eq!(f.output_tokens, expected[..f.output_tokens.len()]),
        }
        assert!(finished.insert(f.id, f).is_none(), "finished twice");
    };

    let (mut steps, mut added, mut refused) = (0, 0u64, 0);
    while to_add.peek().is_some() || s.has_unfinished() {
        steps += 1;
        assert!(steps < 20_000, "no progress");
        // Clients arrive; a refused one (queue full) retries at a later step.
        for _ in 0..rng.below(3) {
            let Some(r) = to_add.peek() else { break };
            match s.add_request(r.clone()) {
                Ok(()) => {
                    to_add.next();
                    added += 1;
                }
                Err(AddError::QueueFull { .. }) => {
                    refused += 1;
                    break;
                }
                Err(e) => panic!("request {} refused: {e}", r.id),
            }
        }
        // Clients disconnect, waiting or running.
        if rng.chance(8) {
            let live: Vec<u64> = (0..added).filter(|id| !finished.contains_key(id)).collect();
            let victim = live
                .get(rng.below(live.len().max(1)))
                .copied()
                .unwrap_or(u64::MAX);
            if let Some(f) = s.abort(victim) {
                assert_eq!(f.reason, FinishReason::Aborted);
                record(f, &mut finished);
            }
        }

        let out = s.schedule();
        s.check_invariants().unwrap();
        assert!(out.num_batched_tokens <= cfg.max_num_batched_tokens);
        assert!(out.chunks.len() <= cfg.max_num_seqs);
        let mut results = Vec::new();
        for c in &out.chunks {
            assert!(c.num_tokens > 0);
            assert_eq!(out.chunks.iter().filter(|d| d.id == c.id).count(), 1);
            let all = s.tokens(c.id).unwrap();
            let table = s.block_table(c.id).unwrap();
            for pos in 0..c.start_pos + c.num_tokens {
                let (block, slot) = table.slot(pos, BLOCK_SIZE);
                let cell = &mut kv[block as usize][slot];
                let want = fingerprint(&all[..=pos]);
                if pos < c.start_pos {
                    assert_eq!(*cell, Some(want), "request {} position {pos}", c.id);
                } else {
                    *cell = Some(want);
                }
            }
            if let Some(w) = cfg.kv_window {
                // The window group: every position the chunk's queries can see is intact, the
                // new ones are written, and nothing before the window is still held.
                let table = s.window_table(c.id).unwrap();
                let first_visible = (c.start_pos + 1).saturating_sub(w.window);
                for pos in first_visible..c.start_pos + c.num_tokens {
                    let (block, slot) = table.slot(pos, BLOCK_SIZE);
                    let cell = &mut window_kv[block as usize][slot];
                    let want = fingerprint(&all[..=pos]);
                    if pos < c.start_pos {
                        assert_eq!(*cell, Some(want), "request {} window position {pos}", c.id);
                    } else {
                        *cell = Some(want);
                    }
                }
                let held = table.held().count();
                let bound = s
                    .block_manager()
                    .window_blocks_for(c.start_pos + c.num_tokens, cfg.max_num_batched_tokens);
                assert!(held <= bound, "request {} holds {held} window blocks", c.id);
                assert!(
                    table.blocks[..first_visible / BLOCK_SIZE]
                        .iter()
                        .all(|&b| b == RELEASED_BLOCK),
                    "request {}: a block before the window is still held",
                    c.id
                );
            }
            let sampled = c
                .needs_logits
                .then(|| fake_token(c.id, c.start_pos + c.num_tokens));
            results.push((c.id, sampled));
        }
        for f in s.update(&results).unwrap() {
            record(f, &mut finished);
        }
        // Some sampled tokens are EOS.
        for (id, token) in results {
            if token.is_some() && rng.chance(3) {
                if let Some(f) = s.finish(id, FinishReason::Stop) {
                    record(f, &mut finished);
                }
            }
        }
        s.check_invariants().unwrap();
    }

    assert_eq!(finished.len(), 200, "every request ends exactly once");
    let stats = s.stats();
    assert_eq!(
        (stats.num_running, stats.num_waiting, stats.kv_blocks_used),
        (0, 0, 0)
    );
    let bm = s.block_manager();
    assert_eq!(bm.num_free_blocks(), bm.num_blocks(), "all blocks returned");
    if let Some((total, free)) = bm.window_blocks() {
        assert_eq!(free, total, "all window blocks returned");
    }
    assert!(
        stats.num_preemptions > 0,
        "the workload should exercise preemption"
    );
    if cfg.enable_prefix_caching {
        assert!(
            stats.prefix_cache.hit_tokens > 0,
            "shared prompts should hit"
        );
    }
    let by_reason = |r| finished.values().filter(|f| f.reason == r).count();
    assert!(by_reason(FinishReason::Length) > 0 && by_reason(FinishReason::Stop) > 0);
    assert!(by_reason(FinishReason::Aborted) > 0 && refused > 0);
}

#[test]
fn no_request_is_lost_or_corrupted_under_random_load_with_prefix_caching() {
    for seed in 0..4 {
        run_workload(Scheduler::with_hasher(config(true), Fnv1a64).unwrap(), seed);
    }
}

#[test]
fn no_request_is_lost_or_corrupted_under_random_load_without_prefix_caching() {
    for seed in 10..14 {
        run_workload(Scheduler::new(config(false)).unwrap(), seed);
    }
}

#[test]
fn no_request_is_lost_or_corrupted_when_every_block_hash_collides() {
    for seed in 20..24 {
        run_workload(
            Scheduler::with_hasher(config(true), ConstantHasher).unwrap(),
            seed,
        );
    }
}

#[test]
fn no_request_is_lost_or_corrupted_with_a_window_group() {
    for seed in 30..34 {
        let cfg = SchedulerConfig {
            kv_window: Some(WINDOW),
            ..config(false)
        };
        run_workload(Scheduler::new(cfg).unwrap(), seed);
    }
}

#[test]
fn a_window_group_turns_prefix_caching_off() {
    let cfg = SchedulerConfig {
        kv_window: Some(WINDOW),
        ..config(true)
    };
    let s = Scheduler::new(cfg).unwrap();
    assert!(!s.block_manager().prefix_caching_enabled());
    assert_eq!(s.block_manager().window(), Some(10));
}
