//! The scheduler's policy, step by step, with a fake model that "samples" a token derived from
//! the request and its position, so that every generated token can be checked afterwards.

use moerun_engine::scheduler::{
    AddError, ConfigError, FinishReason, Finished, Request, Scheduler, SchedulerConfig,
    SchedulerOutput, UpdateError,
};

fn config() -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 8,
        max_model_len: 64,
        block_size: 4,
        num_blocks: 64,
        enable_prefix_caching: true,
        max_waiting: 16,
        kv_window: None,
    }
}

fn scheduler(cfg: SchedulerConfig) -> Scheduler {
    Scheduler::new(cfg).unwrap()
}

fn request(id: u64, prompt_len: usize, max_new_tokens: usize) -> Request {
    Request {
        id,
        prompt_tokens: (0..prompt_len as u32)
            .map(|t| t + 1000 * id as u32)
            .collect(),
        max_new_tokens,
    }
}

/// The token the fake model samples for request `id` at position `pos`.
fn fake_token(id: u64, pos: usize) -> u32 {
    (id * 100_000 + pos as u64) as u32
}

/// One schedule + fake forward + update; checks invariants around it.
fn step(s: &mut Scheduler) -> (SchedulerOutput, Vec<Finished>) {
    let out = s.schedule();
    s.check_invariants().unwrap();
    let results: Vec<_> = out
        .chunks
        .iter()
        .map(|c| {
            let sampled = c
                .needs_logits
                .then(|| fake_token(c.id, c.start_pos + c.num_tokens));
            (c.id, sampled)
        })
        .collect();
    let finished = s.update(&results).unwrap();
    s.check_invariants().unwrap();
    (out, finished)
}

/// (id, start_pos, num_tokens, needs_logits) of each chunk, for compact assertions.
fn plan(out: &SchedulerOutput) -> Vec<(u64, usize, usize, bool)> {
    out.chunks
        .iter()
        .map(|c| (c.id, c.start_pos, c.num_tokens, c.needs_logits))
        .collect()
}

fn expected_output(id: u64, prompt_len: usize, max_new_tokens: usize) -> Vec<u32> {
    (prompt_len..prompt_len + max_new_tokens)
        .map(|p| fake_token(id, p))
        .collect()
}

#[test]
fn requests_that_break_a_limit_are_refused_naming_that_limit() {
    let mut s = scheduler(SchedulerConfig {
        num_blocks: 8,
        ..config()
    });
    assert_eq!(s.add_request(request(1, 0, 4)), Err(AddError::EmptyPrompt));
    assert_eq!(
        s.add_request(request(1, 4, 0)),
        Err(AddError::ZeroMaxNewTokens)
    );
    assert_eq!(
        s.add_request(request(1, 64, 1)),
        Err(AddError::PromptTooLong {
            prompt_len: 64,
            max_model_len: 64
        })
    );
    assert_eq!(
        s.add_request(request(1, 60, 5)),
        Err(AddError::ContextTooLong {
            prompt_len: 60,
            max_new_tokens: 5,
            max_model_len: 64
        })
    );
    // 30 + 3 - 1 = 32 KV slots fit in 8 blocks of 4; one more token does not.
    assert_eq!(s.add_request(request(1, 30, 3)), Ok(()));
    assert_eq!(
        s.add_request(request(2, 30, 4)),
        Err(AddError::ExceedsKvCapacity {
            needed_blocks: 9,
            num_blocks: 8
        })
    );
    assert_eq!(
        s.add_request(request(1, 3, 1)),
        Err(AddError::DuplicateId(1))
    );
    assert_eq!(s.num_waiting(), 1);
    assert!(!AddError::EmptyPrompt.is_overload());
}

#[test]
fn a_full_waiting_queue_refuses_new_requests_as_overload() {
    let mut s = scheduler(SchedulerConfig {
        max_waiting: 2,
        ..config()
    });
    s.add_request(request(1, 4, 1)).unwrap();
    s.add_request(request(2, 4, 1)).unwrap();
    let err = s.add_request(request(3, 4, 1)).unwrap_err();
    assert_eq!(err, AddError::QueueFull { max_waiting: 2 });
    assert!(err.is_overload());
    step(&mut s); // both admitted: the queue has room again
    assert_eq!(s.add_request(request(3, 4, 1)), Ok(()));
}

#[test]
fn configs_the_scheduler_cannot_run_with_are_refused_by_name() {
    let zero_blocks = SchedulerConfig {
        num_blocks: 0,
        ..config()
    };
    assert_eq!(
        Scheduler::new(zero_blocks).unwrap_err(),
        ConfigError::Zero("num_blocks")
    );
    let small_budget = SchedulerConfig {
        max_num_seqs: 16,
        ..config()
    };
    assert!(matches!(
        Scheduler::new(small_budget).unwrap_err(),
        ConfigError::BudgetBelowMaxNumSeqs { .. }
    ));
}

#[test]
fn a_short_prompt_is_prefilled_in_one_step_then_decodes_one_token_per_step() {
    let mut s = scheduler(config());
    s.add_request(request(1, 5, 3)).unwrap();
    let (out, done) = step(&mut s);
    assert_eq!(plan(&out), [(1, 0, 5, true)]);
    assert!(done.is_empty());
    assert_eq!(plan(&step(&mut s).0), [(1, 5, 1, true)]);
    let (out, done) = step(&mut s);
    assert_eq!(plan(&out), [(1, 6, 1, true)]);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].reason, FinishReason::Length);
    assert_eq!(done[0].output_tokens, expected_output(1, 5, 3));
    assert!(!s.has_unfinished());
    assert!(step(&mut s).0.is_empty());
    assert_eq!(s.stats().kv_blocks_used, 0);
}

#[test]
fn decodes_and_a_prefill_chunk_share_one_step_within_the_token_budget() {
    let mut s = scheduler(config());
    s.add_request(request(1, 3, 10)).unwrap();
    s.add_request(request(2, 2, 10)).unwrap();
    step(&mut s);
    s.add_request(request(3, 20, 2)).unwrap();
    let (out, _) = step(&mut s);
    // Both decodes first, then as much of the new prompt as the 8-token budget leaves.
    assert_eq!(
        plan(&out),
        [(1, 3, 1, true), (2, 2, 1, true), (3, 0, 6, false)]
    );
    assert_eq!(out.num_batched_tokens, 8);
    let (out, _) = step(&mut s);
    assert_eq!(
        plan(&out),
        [(1, 4, 1, true), (2, 3, 1, true), (3, 6, 6, false)]
    );
}

#[test]
fn a_long_prompt_is_chunked_across_steps() {
    let mut s = scheduler(config());
    s.add_request(request(1, 20, 1)).unwrap();
    assert_eq!(plan(&step(&mut s).0), [(1, 0, 8, false)]);
    assert_eq!(
        s.block_table(1).unwrap().blocks.len(),
        2,
        "blocks for 8 tokens only"
    );
    assert_eq!(plan(&step(&mut s).0), [(1, 8, 8, false)]);
    let (out, done) = step(&mut s);
    assert_eq!(plan(&out), [(1, 16, 4, true)]);
    assert_eq!(done[0].output_tokens, expected_output(1, 20, 1));
}

#[test]
fn max_num_seqs_bounds_the_running_set() {
    let mut s = scheduler(SchedulerConfig {
        max_num_seqs: 2,
        ..config()
    });
    for id in 1..=3 {
        s.add_request(request(id, 2, 2)).unwrap();
    }
    let (out, _) = step(&mut s);
    assert_eq!(plan(&out), [(1, 0, 2, true), (2, 0, 2, true)]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    let (out, done) = step(&mut s);
    assert_eq!(done.len(), 2);
    assert!(
        out.chunks.iter().all(|c| c.id != 3),
        "admitted only after a slot frees"
    );
    assert_eq!(plan(&step(&mut s).0), [(3, 0, 2, true)]);
}

#[test]
fn waiting_requests_are_admitted_first_come_first_served() {
    // Request 1 holds three of four blocks; request 2's first chunk needs two blocks and
    // request 3 would fit in the last one, but must not overtake request 2.
    let mut s = scheduler(SchedulerConfig {
        num_blocks: 4,
        ..config()
    });
    s.add_request(request(1, 8, 5)).unwrap();
    step(&mut s);
    step(&mut s); // decode at position 8 takes a third block
    s.add_request(request(2, 8, 1)).unwrap();
    s.add_request(request(3, 2, 1)).unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(plan(&out), [(1, 9, 1, true)]);
    assert_eq!(s.num_waiting(), 2);
    let mut order = Vec::new();
    while s.has_unfinished() {
        order.extend(step(&mut s).1.into_iter().map(|f| f.id));
    }
    assert_eq!(order, [1, 2, 3]);
}

#[test]
fn preemption_recomputes_the_newest_request_which_then_completes_with_its_tokens_intact() {
    // Six blocks of 4: two requests of 8-token prompts growing to 19 tokens cannot both fit.
    let mut s = scheduler(SchedulerConfig {
        num_blocks: 6,
        max_num_batched_tokens: 16,
        enable_prefix_caching: false,
        ..config()
    });
    s.add_request(request(1, 8, 12)).unwrap();
    s.add_request(request(2, 8, 12)).unwrap();
    let mut finished = Vec::new();
    let mut preempted_at = None;
    for n in 0..100 {
        let (out, done) = step(&mut s);
        if !out.preempted.is_empty() && preempted_at.is_none() {
            assert_eq!(out.preempted, [2], "the most recently admitted goes");
            assert!(out.chunks.iter().all(|c| c.id != 2));
            assert_eq!(s.num_waiting(), 1);
            assert!(s.block_table(2).is_none(), "its blocks are released");
            preempted_at = Some(n);
        }
        finished.extend(done);
        if !s.has_unfinished() {
            break;
        }
    }
    assert!(preempted_at.is_some());
    assert!(s.stats().num_preemptions >= 1);
    let ids: Vec<u64> = finished.iter().map(|f| f.id).collect();
    assert_eq!(ids, [1, 2]);
    for f in &finished {
        assert_eq!(f.reason, FinishReason::Length);
        assert_eq!(
            f.output_tokens,
            expected_output(f.id, 8, 12),
            "request {}",
            f.id
        );
    }
    assert_eq!(s.stats().kv_blocks_used, 0);
}

#[test]
fn a_preempted_request_recomputes_its_generated_tokens_as_prompt() {
    let mut s = scheduler(SchedulerConfig {
        num_blocks: 5,
        max_num_batched_tokens: 32,
        enable_prefix_caching: false,
        ..config()
    });
    s.add_request(request(1, 8, 12)).unwrap();
    s.add_request(request(2, 8, 12)).unwrap();
    for _ in 0..100 {
        let before: Vec<usize> = [1, 2].map(|id| s.tokens(id).unwrap().len()).to_vec();
        let (out, _) = step(&mut s);
        if out.preempted == [2] {
            // Next step request 1 decodes alone; request 2 comes back once blocks allow,
            // recomputing its prompt and everything it generated in one chunk.
            let len2 = before[1];
            assert_eq!(s.tokens(2).unwrap().len(), len2);
            let resumed = (0..40)
                .map(|_| step(&mut s).0)
                .find(|o| o.chunks.iter().any(|c| c.id == 2))
                .unwrap();
            let c = resumed.chunks.iter().find(|c| c.id == 2).unwrap();
            assert_eq!((c.start_pos, c.num_tokens, c.needs_logits), (0, len2, true));
            return;
        }
    }
    panic!("no preemption happened");
}

#[test]
fn a_preempted_request_resumes_from_its_blocks_still_in_the_prefix_cache() {
    let mut s = scheduler(SchedulerConfig {
        num_blocks: 5,
        max_num_batched_tokens: 32,
        ..config()
    });
    s.add_request(request(1, 8, 6)).unwrap();
    s.add_request(request(2, 8, 12)).unwrap();
    step(&mut s);
    let (out, _) = step(&mut s);
    assert_eq!(
        out.preempted,
        [2],
        "two decodes need a third block each; one is free"
    );
    // Request 1 grows to a fourth block, recycling request 2's tail block (released first);
    // request 2's first block is still cached when it comes back.
    let mut resumed = None;
    for _ in 0..20 {
        let (out, _) = step(&mut s);
        if let Some(c) = out.chunks.iter().find(|c| c.id == 2) {
            resumed = Some(*c);
            break;
        }
    }
    let c = resumed.unwrap();
    assert_eq!((c.start_pos, c.num_tokens, c.needs_logits), (4, 5, true));
    let mut done = Vec::new();
    while s.has_unfinished() {
        done.extend(step(&mut s).1);
    }
    assert_eq!(
        done.last().unwrap().output_tokens,
        expected_output(2, 8, 12)
    );
}

#[test]
fn a_second_request_skips_the_full_blocks_of_a_shared_system_prompt() {
    let mut s = scheduler(SchedulerConfig {
        max_num_batched_tokens: 64,
        ..config()
    });
    let system: Vec<u32> = (500..522).collect(); // 22 tokens: five full blocks
    let with_question = |q: &[u32]| system.iter().chain(q).copied().collect::<Vec<u32>>();
    s.add_request(Request {
        id: 1,
        prompt_tokens: with_question(&[1, 2, 3]),
        max_new_tokens: 3,
    })
    .unwrap();
    step(&mut s);
    s.add_request(Request {
        id: 2,
        prompt_tokens: with_question(&[7, 8]),
        max_new_tokens: 2,
    })
    .unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(plan(&out), [(1, 25, 1, true), (2, 20, 4, true)]);
    let shared = s.block_table(1).unwrap().blocks[..5].to_vec();
    assert_eq!(s.block_table(2).unwrap().blocks[..5], shared[..]);
    let stats = s.stats().prefix_cache;
    assert_eq!((stats.queried_tokens, stats.hit_tokens), (25 + 24, 20));
    while s.has_unfinished() {
        step(&mut s);
    }
    // After both finish, a third request still finds the prefix cached.
    s.add_request(Request {
        id: 3,
        prompt_tokens: with_question(&[9]),
        max_new_tokens: 1,
    })
    .unwrap();
    assert_eq!(plan(&step(&mut s).0), [(3, 20, 3, true)]);
}

#[test]
fn abort_frees_blocks_at_once_whether_waiting_or_running() {
    let mut s = scheduler(SchedulerConfig {
        max_num_seqs: 1,
        ..config()
    });
    s.add_request(request(1, 10, 5)).unwrap();
    s.add_request(request(2, 10, 5)).unwrap();
    step(&mut s);
    assert!(s.stats().kv_blocks_used > 0);
    let aborted = s.abort(1).unwrap();
    assert_eq!(aborted.reason, FinishReason::Aborted);
    assert_eq!(s.stats().kv_blocks_used, 0);
    assert_eq!(s.abort(2).unwrap().output_tokens, Vec::<u32>::new());
    assert!(s.abort(2).is_none(), "only once");
    assert!(!s.has_unfinished());
    s.check_invariants().unwrap();
}

#[test]
fn a_request_aborted_between_schedule_and_update_is_ignored_by_update() {
    let mut s = scheduler(config());
    s.add_request(request(1, 3, 5)).unwrap();
    s.add_request(request(2, 3, 5)).unwrap();
    let out = s.schedule();
    assert_eq!(out.chunks.len(), 2);
    s.abort(2).unwrap();
    let done = s
        .update(&[(1, Some(fake_token(1, 3))), (2, Some(fake_token(2, 3)))])
        .unwrap();
    assert!(done.is_empty());
    assert_eq!(s.tokens(1).unwrap().len(), 4);
    s.check_invariants().unwrap();
}

#[test]
fn finish_ends_a_request_early_with_the_reason_given() {
    let mut s = scheduler(config());
    s.add_request(request(1, 3, 50)).unwrap();
    step(&mut s);
    step(&mut s);
    let f = s.finish(1, FinishReason::Stop).unwrap();
    assert_eq!(f.reason, FinishReason::Stop);
    assert_eq!(f.output_tokens, expected_output(1, 3, 2));
    assert_eq!(s.stats().kv_blocks_used, 0);
}

#[test]
fn update_refuses_results_that_do_not_match_the_plan_and_changes_nothing() {
    let mut s = scheduler(config());
    s.add_request(request(1, 3, 5)).unwrap();
    s.add_request(request(2, 20, 5)).unwrap();
    let out = s.schedule();
    assert_eq!(plan(&out), [(1, 0, 3, true), (2, 0, 5, false)]);
    assert_eq!(s.update(&[]), Err(UpdateError::MissingToken(1)));
    assert_eq!(
        s.update(&[(1, Some(7)), (2, Some(8))]),
        Err(UpdateError::UnexpectedToken(2))
    );
    assert_eq!(
        s.update(&[(1, Some(7)), (1, Some(7))]),
        Err(UpdateError::DuplicateResult(1))
    );
    assert_eq!(s.tokens(1).unwrap().len(), 3, "nothing applied");
    assert!(s.update(&[(1, Some(7)), (2, None)]).unwrap().is_empty());
    assert_eq!(s.tokens(1).unwrap().last(), Some(&7));
    assert_eq!(
        s.update(&[(1, Some(7))]),
        Err(UpdateError::UnexpectedToken(1)),
        "the plan was consumed"
    );
}

#[test]
fn scheduling_again_without_update_replans_from_the_same_state() {
    let mut s = scheduler(config());
    s.add_request(request(1, 20, 2)).unwrap();
    s.add_request(request(2, 3, 2)).unwrap();
    let first = s.schedule();
    let again = s.schedule();
    assert_eq!(first, again);
    s.check_invariants().unwrap();
}

#[test]
fn the_same_calls_give_the_same_schedules() {
    let run = || {
        let mut s = scheduler(SchedulerConfig {
            num_blocks: 12,
            ..config()
        });
        let mut log = Vec::new();
        for id in 0..12u64 {
            s.add_request(request(
                id % 5,
                3 + (id as usize * 7) % 13,
                1 + id as usize % 6,
            ))
            .ok();
            let (out, done) = step(&mut s);
            log.push((plan(&out), out.preempted, done));
        }
        while s.has_unfinished() {
            let (out, done) = step(&mut s);
            log.push((plan(&out), out.preempted, done));
        }
        log
    };
    assert_eq!(run(), run());
}

#[test]
fn a_lone_decoding_request_holds_its_next_positions_block_when_one_is_free() {
    // Blocks of 4: a prompt of 3, then decode steps at positions 3, 4, 5, ...
    let mut s = scheduler(config());
    s.add_request(request(1, 3, 8)).unwrap();
    let blocks = |s: &Scheduler| s.block_table(1).unwrap().blocks.len();
    step(&mut s); // the prompt: one block
    assert_eq!(blocks(&s), 1);
    let (out, _) = step(&mut s); // decodes position 3, the block's last slot
    assert_eq!(plan(&out), [(1, 3, 1, true)]);
    assert_eq!(blocks(&s), 2, "position 4's block, ahead of its step");
    step(&mut s); // position 4: nothing new to take
    assert_eq!(blocks(&s), 2);

    // Two running requests: no lookahead (only a lone sequence's step is launched ahead).
    let mut s = scheduler(config());
    s.add_request(request(1, 3, 8)).unwrap();
    s.add_request(request(2, 3, 8)).unwrap();
    step(&mut s);
    step(&mut s); // both decode position 3
    assert_eq!(s.block_table(1).unwrap().blocks.len(), 1);
    assert_eq!(s.block_table(2).unwrap().blocks.len(), 1);

    // No free block: the step runs without it (a cache of exactly one block).
    let mut s = scheduler(SchedulerConfig {
        num_blocks: 1,
        max_model_len: 5,
        ..config()
    });
    s.add_request(request(1, 3, 2)).unwrap();
    step(&mut s);
    let (out, finished) = step(&mut s);
    assert_eq!(plan(&out), [(1, 3, 1, true)]);
    assert_eq!(finished.len(), 1, "two tokens generated");
    assert_eq!(finished[0].output_tokens, expected_output(1, 3, 2));
}
