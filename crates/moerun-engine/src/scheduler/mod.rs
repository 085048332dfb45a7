//! Iteration-level continuous batching for the serving engine: which tokens of which requests
//! the model computes in each step. Pure policy over a [`BlockManager`]: no model, no device.
//!
//! The loop the engine runs: [`Scheduler::add_request`] as requests arrive; then per step
//! [`Scheduler::schedule`], one forward pass over the chunks it returns, [`Scheduler::update`]
//! with the sampled tokens, and [`Scheduler::finish`] for sequences that hit EOS or a stop
//! string. [`Scheduler::abort`] drops a request at any time.
//!
//! Policy of one step, under a budget of `max_num_batched_tokens` tokens:
//! 1. running sequences that decode (one pending token) each get their token, so inter-token
//!    latency stays steady whatever prompts arrive;
//! 2. running sequences part-way through their prompt get the next chunk (chunked prefill);
//! 3. waiting requests are admitted first come, first served while fewer than `max_num_seqs`
//!    run and budget is left; a prompt longer than the budget left is split across steps, and
//!    cached prefix blocks are skipped without costing budget. The queue is never reordered: a
//!    request that does not fit blocks those behind it, so no request starves. No request is
//!    admitted in a step that preempted one, which would only thrash.
//!
//! KV blocks are allocated for exactly the tokens scheduled. When a running sequence needs a
//! block and none is free, the most recently admitted running sequence is preempted by
//! recompute: its blocks are freed (its committed full blocks stay in the prefix cache, so the
//! recompute is often cheap) and it returns to the front of the queue with its generated tokens
//! kept, to be recomputed as part of its prompt. The oldest running request is therefore never
//! preempted for another, and add-time checks guarantee it fits alone, so every request
//! finishes.
//!
//! Promises: no input a client controls makes it panic; every request added ends exactly once
//! (as a [`Finished`] from `update`, `finish` or `abort`) with all its tokens; all blocks are
//! released when nothing is live; the same sequence of calls gives the same schedules.

mod config;
mod output;
mod request;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use moerun_core::BlockTable;

use crate::block_manager::{BlockError, BlockHasher, BlockManager, Fnv1a64, InvariantViolation};
pub use config::{ConfigError, KvWindowGroup, SchedulerConfig};
pub use output::{ScheduledChunk, SchedulerOutput, SchedulerStats};
pub use request::{AddError, FinishReason, Finished, Request, RequestId, UpdateError};
use request::{SeqState, Status};

/// The continuous-batching scheduler. `H` hashes KV blocks for the prefix cache.
#[derive(Debug)]
pub struct Scheduler<H = Fnv1a64> {
    config: SchedulerConfig,
    blocks: BlockManager<H>,
    /// Every live request, waiting or running.
    seqs: BTreeMap<RequestId, SeqState>,
    /// Waiting requests in arrival order, preempted ones included.
    waiting: VecDeque<RequestId>,
    /// Running requests in admission order (which is also arrival order, see `preempt`).
    running: Vec<RequestId>,
    /// The chunks of the last `schedule`, which the next `update` reports on.
    in_flight: Vec<ScheduledChunk>,
    next_arrival: u64,
    num_preemptions: u64,
}

/// Which running sequences a pass over the running list serves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Decode,
    Prefill,
}

impl Scheduler<Fnv1a64> {
    /// A scheduler with an empty queue and an empty KV cache.
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        Self::with_hasher(config, Fnv1a64)
    }
}

impl<H: BlockHasher> Scheduler<H> {
    /// Like [`Scheduler::new`], hashing prefix-cache blocks with `hasher`.
    pub fn with_hasher(config: SchedulerConfig, hasher: H) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut blocks = BlockManager::with_hasher(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            hasher,
        );
        if let Some(w) = config.kv_window {
            blocks = blocks.with_window_group(w.window, w.num_blocks);
        }
        Ok(Scheduler {
            config,
            blocks,
            seqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            in_flight: Vec::new(),
            next_arrival: 0,
            num_preemptions: 0,
        })
    }

    /// The limits it runs with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV blocks, read-only (for metrics and invariant checks).
    pub fn block_manager(&self) -> &BlockManager<H> {
        &self.blocks
    }

    /// Queue a request, or refuse it with the limit it breaks.
    pub fn add_request(&mut self, request: Request) -> Result<(), AddError> {
        let prompt_len = request.prompt_tokens.len();
        let max_model_len = self.config.max_model_len;
        if prompt_len == 0 {
            return Err(AddError::EmptyPrompt);
        }
        if request.max_new_tokens == 0 {
            return Err(AddError::ZeroMaxNewTokens);
        }
        if prompt_len >= max_model_len {
            return Err(AddError::PromptTooLong {
                prompt_len,
                max_model_len,
            });
        }
        if request.max_new_tokens > max_model_len - prompt_len {
            return Err(AddError::ContextTooLong {
                prompt_len,
                max_new_tokens: request.max_new_tokens,
                max_model_len,
            });
        }
        // The last generated token is never fed back, so the longest a live sequence's KV gets
        // is prompt + max_new_tokens - 1. Refusing here is what lets preemption always succeed.
        let needed_blocks = self
            .blocks
            .blocks_for(prompt_len + request.max_new_tokens - 1);
        if needed_blocks > self.config.num_blocks {
            return Err(AddError::ExceedsKvCapacity {
                needed_blocks,
                num_blocks: self.config.num_blocks,
            });
        }
        if let Some(w) = self.config.kv_window {
            let needed_blocks = self.blocks.window_blocks_for(
                prompt_len + request.max_new_tokens - 1,
                self.config.max_num_batched_tokens,
            );
            if needed_blocks > w.num_blocks {
                return Err(AddError::ExceedsKvCapacity {
                    needed_blocks,
                    num_blocks: w.num_blocks,
                });
            }
        }
        if self.seqs.contains_key(&request.id) {
            return Err(AddError::DuplicateId(request.id));
        }
        if self.waiting.len() >= self.config.max_waiting {
            return Err(AddError::QueueFull {
                max_waiting: self.config.max_waiting,
            });
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        self.seqs.insert(
            request.id,
            SeqState {
                arrival,
                status: Status::Waiting,
                tokens: request.prompt_tokens,
                prompt_len,
                max_new_tokens: request.max_new_tokens,
                num_computed: 0,
            },
        );
        self.waiting.push_back(request.id);
        Ok(())
    }

    /// Decide the next step's batch (see the module documentation for the policy). Only
    /// [`Scheduler::update`] advances what counts as computed, so calling this again without
    /// it plans from the same state: a step whose forward pass failed is planned anew, and the
    /// previous plan is forgotten.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;
        self.schedule_running(Pass::Decode, &mut budget, &mut out);
        self.schedule_running(Pass::Prefill, &mut budget, &mut out);
        if out.preempted.is_empty() {
            self.admit_waiting(&mut budget, &mut out);
        }
        out.num_batched_tokens = out.chunks.iter().map(|c| c.num_tokens).sum();
        self.in_flight = out.chunks.clone();
        out
    }

    fn schedule_running(&mut self, pass: Pass, budget: &mut usize, out: &mut SchedulerOutput) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                i += 1;
                continue;
            };
            let pending = seq.pending();
            let wanted = match pass {
                Pass::Decode => pending == 1,
                Pass::Prefill => pending > 1,
            };
            if !wanted {
                i += 1;
                continue;
            }
            let start_pos = seq.num_computed;
            let num_tokens = pending.min(*budget);
            let needs_logits = num_tokens == pending;
            if self.reserve_or_preempt(i, start_pos + num_tokens, budget, out) {
                // A lone decoding sequence also takes its next position's block where one is
                // free: the CUDA backend launches a lone greedy sequence's next step ahead only
                // into a block it holds (without it, the first step of every block waited for the
                // host: ~770 µs of idle GPU every 16 tokens on the H200).
                if pass == Pass::Decode && self.running.len() == 1 {
                    self.blocks
                        .append_slots_if_free(id, start_pos + num_tokens + 1);
                }
                out.chunks.push(ScheduledChunk {
                    id,
                    start_pos,
                    num_tokens,
                    needs_logits,
                });
                *budget -= num_tokens;
                i += 1;
            }
            // Otherwise `running[i]` itself was preempted and removed: look at the same index.
        }
    }

    /// Give `running[i]` slots for `total_len` tokens, preempting the most recently admitted
    /// running sequences while blocks are short. False if `running[i]` itself was preempted.
    fn reserve_or_preempt(
        &mut self,
        i: usize,
        total_len: usize,
        budget: &mut usize,
        out: &mut SchedulerOutput,
    ) -> bool {
        let id = self.running[i];
        loop {
            match self.blocks.append_slots(id, total_len) {
                Ok(()) => return true,
                Err(BlockError::OutOfBlocks { .. }) => {
                    // `i` is in range, so the list is not empty; its tail is never before `i`.
                    let victim_index = self.running.len() - 1;
                    self.preempt(victim_index, budget, out);
                    if victim_index == i {
                        return false;
                    }
                }
                Err(_) => {
                    // A running sequence without blocks would be a bug here; recomputing it
                    // from scratch is always a correct recovery.
                    self.preempt(i, budget, out);
                    return false;
                }
            }
        }
    }

    /// Preempt `running[index]` by recompute: free its KV, withdraw its chunk from this step,
    /// and queue it again at its arrival position (the front, in practice: every running
    /// request arrived before every waiting one, since admission is in arrival order).
    fn preempt(&mut self, index: usize, budget: &mut usize, out: &mut SchedulerOutput) {
        let id = self.running.remove(index);
        self.blocks.free(id);
        if let Some(pos) = out.chunks.iter().position(|c| c.id == id) {
            *budget += out.chunks.remove(pos).num_tokens;
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.num_computed = 0;
            seq.status = Status::Waiting;
            let arrival = seq.arrival;
            let seqs = &self.seqs;
            let at = self
                .waiting
                .partition_point(|w| seqs.get(w).is_some_and(|s| s.arrival < arrival));
            self.waiting.insert(at, id);
        }
        out.preempted.push(id);
        self.num_preemptions += 1;
    }

    fn admit_waiting(&mut self, budget: &mut usize, out: &mut SchedulerOutput) {
        while let Some(&id) = self.waiting.front() {
            if self.running.len() >= self.config.max_num_seqs || *budget == 0 {
                break;
            }
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let alloc = match self.blocks.allocate_prompt(id, &seq.tokens, *budget) {
                Ok(alloc) => alloc,
                // Not enough KV now: wait for running requests to finish, keeping FCFS.
                Err(_) => break,
            };
            seq.num_computed = alloc.num_cached_tokens;
            seq.status = Status::Running;
            out.chunks.push(ScheduledChunk {
                id,
                start_pos: alloc.num_cached_tokens,
                num_tokens: alloc.num_new_tokens,
                needs_logits: alloc.num_cached_tokens + alloc.num_new_tokens == seq.tokens.len(),
            });
            *budget -= alloc.num_new_tokens;
            self.waiting.pop_front();
            self.running.push(id);
        }
    }

    /// Apply the results of the step planned by the last [`Scheduler::schedule`]: `(request,
    /// sampled token)` for every chunk with `needs_logits` (others may be listed with `None`
    /// or left out). Marks the chunks' KV computed, appends the tokens, registers newly full
    /// blocks in the prefix cache and finishes requests that reached `max_new_tokens`.
    /// Requests aborted or finished since `schedule` are ignored. On error nothing changes.
    pub fn update(
        &mut self,
        results: &[(RequestId, Option<u32>)],
    ) -> Result<Vec<Finished>, UpdateError> {
        let mut sampled: BTreeMap<RequestId, Option<u32>> = BTreeMap::new();
        for &(id, token) in results {
            if sampled.insert(id, token).is_some() {
                return Err(UpdateError::DuplicateResult(id));
            }
        }
        // Validate everything against the plan before changing anything.
        for chunk in self.in_flight.iter().filter(|c| self.is_running(c.id)) {
            match (
                chunk.needs_logits,
                sampled.get(&chunk.id).copied().flatten(),
            ) {
                (true, None) => return Err(UpdateError::MissingToken(chunk.id)),
                (false, Some(_)) => return Err(UpdateError::UnexpectedToken(chunk.id)),
                _ => {}
            }
        }
        let planned: BTreeSet<RequestId> = self.in_flight.iter().map(|c| c.id).collect();
        for (&id, token) in &sampled {
            if token.is_some() && self.is_running(id) && !planned.contains(&id) {
                return Err(UpdateError::UnexpectedToken(id));
            }
        }

        let mut finished = Vec::new();
        for chunk in std::mem::take(&mut self.in_flight) {
            if !self.is_running(chunk.id) {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(&chunk.id) else {
                continue;
            };
            seq.num_computed = chunk.start_pos + chunk.num_tokens;
            if let Some(Some(token)) = sampled.get(&chunk.id) {
                seq.tokens.push(*token);
            }
            // The id is running, so it holds blocks; nothing to report if that ever failed.
            let _ = self
                .blocks
                .commit_full_blocks(chunk.id, &seq.tokens[..seq.num_computed]);
            // The window group's blocks that the next token's window has left go back now.
            let _ = self.blocks.slide_window(chunk.id, seq.num_computed);
            if seq.num_generated() >= seq.max_new_tokens {
                finished.extend(self.finish(chunk.id, FinishReason::Length));
            }
        }
        Ok(finished)
    }

    fn is_running(&self, id: RequestId) -> bool {
        self.seqs
            .get(&id)
            .is_some_and(|s| s.status == Status::Running)
    }

    /// End a live request now (EOS, a stop string, or any other reason), releasing its blocks.
    /// `None` if no live request has this id (for instance it already finished by length).
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> Option<Finished> {
        let seq = self.seqs.remove(&id)?;
        match seq.status {
            Status::Waiting => self.waiting.retain(|&w| w != id),
            Status::Running => self.running.retain(|&r| r != id),
        }
        self.blocks.free(id);
        let mut tokens = seq.tokens;
        Some(Finished {
            id,
            reason,
            prompt_len: seq.prompt_len,
            output_tokens: tokens.split_off(seq.prompt_len),
        })
    }

    /// Drop a request whose client went away, waiting or running; its blocks are free at once.
    pub fn abort(&mut self, id: RequestId) -> Option<Finished> {
        self.finish(id, FinishReason::Aborted)
    }

    /// Every token of a live request: prompt, then generated.
    pub fn tokens(&self, id: RequestId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.tokens.as_slice())
    }

    /// The token ids a chunk computes, for building the model's batch.
    pub fn chunk_tokens(&self, chunk: &ScheduledChunk) -> Option<&[u32]> {
        self.tokens(chunk.id)?
            .get(chunk.start_pos..chunk.start_pos + chunk.num_tokens)
    }

    /// The KV blocks of a running request.
    pub fn block_table(&self, id: RequestId) -> Option<&BlockTable> {
        self.blocks.block_table(id)
    }

    /// The window-group KV blocks of a running request, when the cache has a window group.
    pub fn window_table(&self, id: RequestId) -> Option<&BlockTable> {
        self.blocks.window_table(id)
    }

    /// Requests holding KV.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests queued for admission, preempted ones included.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether any request is live.
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Counters for `/metrics`.
    pub fn stats(&self) -> SchedulerStats {
        let (window_total, window_free) = self.blocks.window_blocks().unwrap_or((0, 0));
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            kv_blocks_used: self.blocks.num_used_blocks(),
            kv_blocks_total: self.blocks.num_blocks(),
            kv_window_blocks_used: window_total - window_free,
            kv_window_blocks_total: window_total,
            prefix_cache: self.blocks.prefix_cache_stats(),
            num_preemptions: self.num_preemptions,
        }
    }

    /// Check that every live request is in exactly one list matching its status, that both
    /// lists are in arrival order, that exactly the running requests hold blocks covering
    /// their computed tokens, and the block manager's own invariants.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let fail = |msg: String| Err(InvariantViolation(msg));
        if self.waiting.len() + self.running.len() != self.seqs.len() {
            return fail(format!(
                "{} waiting + {} running != {} live",
                self.waiting.len(),
                self.running.len(),
                self.seqs.len()
            ));
        }
        let lists = [
            (
                Status::Waiting,
                self.waiting.iter().copied().collect::<Vec<_>>(),
            ),
            (Status::Running, self.running.clone()),
        ];
        for (status, ids) in lists {
            let mut last_arrival = None;
            for id in ids {
                let Some(seq) = self.seqs.get(&id) else {
                    return fail(format!("listed request {id} is not live"));
                };
                if seq.status != status {
                    return fail(format!("request {id} is listed as {status:?}"));
                }
                if last_arrival.is_some_and(|a| a >= seq.arrival) {
                    return fail(format!("{status:?} list is out of arrival order at {id}"));
                }
                last_arrival = Some(seq.arrival);
                let capacity = self
                    .blocks
                    .block_table(id)
                    .map(|t| t.capacity(self.config.block_size));
                match (status, capacity) {
                    (Status::Waiting, None) => {}
                    (Status::Running, Some(c)) if c >= seq.num_computed => {}
                    _ => return fail(format!("request {id} ({status:?}) holds {capacity:?}")),
                }
            }
        }
        if self.running.len() > self.config.max_num_seqs {
            return fail(format!("{} running", self.running.len()));
        }
        self.blocks.check_invariants()
    }
}
