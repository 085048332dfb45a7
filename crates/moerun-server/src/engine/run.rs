//! The engine loop. Each iteration: take in new requests, drop those whose clients left, ask the
//! scheduler for a step, run it as one flat batch, sample one token for every sequence whose
//! chunk reached its end, and report the step back to the scheduler. Requests join and leave the
//! batch between any two steps.
//!
//! Greedy output does not depend on the batch: the forward pass is bitwise batch-invariant, each
//! request samples from its own logits row with its own sampler, and prefix-cache hits reuse KV
//! computed by the same arithmetic.

use std::collections::{HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use moerun_engine::scheduler::{
    FinishReason as SchedReason, Request, RequestId, Scheduler, SchedulerOutput,
};
use moerun_model::{Batch, KvCache, LinearStateCache, LogitsFor, SeqChunk};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;

use super::live::Live;
use super::{Command, EngineConfig, FinishReason};
use crate::metrics::Metrics;
use crate::served::ServedModel;

/// Run until every [`super::EngineHandle`] is dropped and no request is left.
pub(super) fn engine_loop(
    model: &ServedModel,
    config: &EngineConfig,
    mut kv: KvCache,
    mut commands: mpsc::Receiver<Command>,
    metrics: &Metrics,
) {
    let sched_config = &config.scheduler;
    let mut scheduler = match Scheduler::new(sched_config.clone()) {
        Ok(s) => s,
        // Validated in `Engine::start`; nothing to serve with otherwise.
        Err(_) => return,
    };
    // Linear-attention state (Gated DeltaNet layers), one slot per running sequence: the slot is
    // the sequence's first KV block, unique while prefix caching is off for such models. A
    // sequence (re)starting at position 0 starts from a zero state, so preemption needs nothing.
    let mut states = SlotStates {
        cache: model.model.new_linear_state(sched_config.num_blocks),
        in_use: HashSet::new(),
    };
    let mut live: HashMap<RequestId, Live<'_>> = HashMap::new();
    let mut next_id: RequestId = 0;
    let mut open = true;
    while open || scheduler.has_unfinished() {
        if !scheduler.has_unfinished() {
            // Idle: sleep until a request (or the end) comes.
            match commands.blocking_recv() {
                Some(c) => admit(c, model, &mut scheduler, &mut live, &mut next_id, metrics),
                None => open = false,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => admit(c, model, &mut scheduler, &mut live, &mut next_id, metrics),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        cancel_departed(&mut scheduler, &mut live, metrics);
        if scheduler.has_unfinished() {
            step(
                model,
                &mut kv,
                &mut states,
                &mut scheduler,
                &mut live,
                metrics,
            );
            states.release_departed(&scheduler, &live);
        }
        metrics.set_scheduler_stats(&scheduler.stats());
    }
}

/// Hand a new request to the scheduler and answer the submitter.
fn admit<'m>(
    command: Command,
    model: &'m ServedModel,
    scheduler: &mut Scheduler,
    live: &mut HashMap<RequestId, Live<'m>>,
    next_id: &mut RequestId,
    metrics: &Metrics,
) {
    let Command::Add {
        request,
        events,
        accepted,
    } = command;
    let state = match Live::new(model, &request, events) {
        Ok(s) => s,
        Err((message, events)) => {
            // Validated by the HTTP layer; report rather than trust that.
            let _ = accepted.send(Ok(()));
            let _ = events.send(super::Event::Failed(message));
            metrics.count_failed();
            return;
        }
    };
    let prompt_len = request.prompt_tokens.len();
    let id = *next_id;
    *next_id += 1;
    let added = scheduler.add_request(Request {
        id,
        prompt_tokens: request.prompt_tokens,
        max_new_tokens: request.max_new_tokens,
    });
    match added {
        Ok(()) => {
            // A submitter that stopped waiting is a client gone; the next step aborts it.
            let _ = accepted.send(Ok(()));
            metrics.add_prompt_tokens(prompt_len);
            live.insert(id, state);
        }
        Err(e) => {
            metrics.count_rejected(e.is_overload());
            let _ = accepted.send(Err(e));
        }
    }
}

/// Abort every request whose client went away: its blocks are freed now, not at its end.
fn cancel_departed(
    scheduler: &mut Scheduler,
    live: &mut HashMap<RequestId, Live<'_>>,
    metrics: &Metrics,
) {
    let gone: Vec<RequestId> = live
        .iter()
        .filter(|(_, l)| l.is_cancelled())
        .map(|(&id, _)| id)
        .collect();
    for id in gone {
        scheduler.abort(id);
        live.remove(&id);
        metrics.count_aborted();
    }
}

/// One scheduler step: forward, sample, update, stream.
/// The linear-attention state slots and which of them hold memory.
struct SlotStates {
    cache: LinearStateCache,
    in_use: HashSet<usize>,
}

impl SlotStates {
    /// Free the slots of sequences that no longer hold KV blocks (finished, aborted, preempted),
    /// so a slot's memory (tens of MB on real shapes) lives only as long as its sequence.
    fn release_departed(&mut self, scheduler: &Scheduler, live: &HashMap<RequestId, Live<'_>>) {
        if self.in_use.is_empty() {
            return;
        }
        let current: HashSet<usize> = live
            .keys()
            .filter_map(|&id| scheduler.block_table(id))
            .filter_map(|t| t.blocks.first().map(|&b| b as usize))
            .collect();
        let cache = &mut self.cache;
        self.in_use.retain(|slot| {
            let keep = current.contains(slot);
            if !keep {
                cache.release(*slot);
            }
            keep
        });
    }
}

fn step<'m>(
    model: &'m ServedModel,
    kv: &mut KvCache,
    states: &mut SlotStates,
    scheduler: &mut Scheduler,
    live: &mut HashMap<RequestId, Live<'m>>,
    metrics: &Metrics,
) {
    let plan = scheduler.schedule();
    if plan.is_empty() {
        // Cannot happen with a live request (the oldest always fits); do not spin if it does.
        std::thread::sleep(Duration::from_millis(1));
        return;
    }
    // Every request that samples this step picks the raw argmax: the model picks it where the
    // logits are and only the ids come back.
    let greedy = plan.chunks.iter().filter(|c| c.needs_logits).all(|c| {
        live.get(&c.id)
            .is_none_or(|state| state.takes_plain_greedy())
    });
    let picked = match forward(model, kv, states, scheduler, &plan, greedy) {
        Ok(p) => p,
        Err(message) => return fail_step(&plan, scheduler, live, metrics, &message),
    };
    let vocab = model.vocab_size();
    let now = Instant::now();
    let mut results = Vec::with_capacity(plan.chunks.len());
    let mut done = Vec::new(); // finished requests, told after the stats are published
    let mut sampled = Vec::new();
    let mut stopped_by_token = Vec::new();
    for (row, chunk) in plan.chunks.iter().enumerate() {
        if !chunk.needs_logits {
            continue;
        }
        let (Some(state), Some(history)) = (live.get_mut(&chunk.id), scheduler.tokens(chunk.id))
        else {
            continue;
        };
        let drawn = match &picked {
            Picked::Tokens(tokens) => Ok((tokens[row], None)),
            Picked::Logits(logits) => {
                let mut row_logits = logits[row * vocab..(row + 1) * vocab].to_vec();
                catch_unwind(AssertUnwindSafe(|| state.sample(&mut row_logits, history)))
            }
        };
        let Ok((token, logprobs)) = drawn else {
            stopped_by_token.push((chunk.id, None));
            continue;
        };
        state.record_timing(now, metrics);
        if state.is_stop_token(token) {
            stopped_by_token.push((chunk.id, Some(FinishReason::Stop)));
        } else {
            results.push((chunk.id, Some(token)));
            sampled.push((chunk.id, token, logprobs));
        }
    }
    // Sequences that sampled EOS end now, without the token: the scheduler never sees it.
    for (id, reason) in stopped_by_token {
        scheduler.finish(id, SchedReason::Stop);
        if let Some(state) = live.remove(&id) {
            match reason {
                Some(r) => done.push((state, r)),
                None => {
                    metrics.count_failed();
                    state.fail("internal error while sampling".into());
                }
            }
        }
    }
    let finished_by_length = match scheduler.update(&results) {
        Ok(f) => f,
        Err(e) => return fail_step(&plan, scheduler, live, metrics, &e.to_string()),
    };
    metrics.add_generated_tokens(sampled.len());
    // Text first: a stop string completed by the last allowed token still reports "stop".
    for (id, token, logprobs) in sampled {
        let Some(state) = live.get_mut(&id) else {
            continue;
        };
        match state.accept(token, logprobs) {
            Ok(false) => {}
            Ok(true) => {
                scheduler.finish(id, SchedReason::Stop);
                if let Some(state) = live.remove(&id) {
                    done.push((state, FinishReason::Stop));
                }
            }
            Err(message) => {
                scheduler.abort(id);
                if let Some(state) = live.remove(&id) {
                    metrics.count_failed();
                    state.fail(message);
                }
            }
        }
    }
    for f in finished_by_length {
        if let Some(state) = live.remove(&f.id) {
            done.push((state, FinishReason::Length));
        }
    }
    // The finished requests' blocks are free in the published stats before their clients hear
    // that they ended (a client reading /metrics right after its last event sees them freed).
    metrics.set_scheduler_stats(&scheduler.stats());
    for (state, reason) in done {
        state.finish(reason, metrics);
    }
}

/// What a step's forward pass hands back, one row per chunk in plan order.
enum Picked {
    /// The logits of each chunk's last token.
    Logits(Vec<f32>),
    /// The argmax of each chunk's last-token logits, picked by the model (every request of the
    /// step samples plain greedy).
    Tokens(Vec<u32>),
}

/// Run the planned chunks as one flat batch; logits of each chunk's last token (or, `greedy`,
/// their argmax), in plan order. A panic in the model is caught and reported like an error.
fn forward(
    model: &ServedModel,
    kv: &mut KvCache,
    states: &mut SlotStates,
    scheduler: &Scheduler,
    plan: &SchedulerOutput,
    greedy: bool,
) -> Result<Picked, String> {
    let mut chunks = Vec::with_capacity(plan.chunks.len());
    let mut slots = Vec::with_capacity(plan.chunks.len());
    let mut window_tables = Vec::new();
    for c in &plan.chunks {
        let tokens = scheduler.chunk_tokens(c);
        let table = scheduler.block_table(c.id);
        let (Some(tokens), Some(block_table)) = (tokens, table) else {
            return Err(format!(
                "request {} was scheduled without tokens or blocks",
                c.id
            ));
        };
        let slot = block_table.blocks.first().map_or(0, |&b| b as usize);
        slots.push(slot);
        chunks.push(SeqChunk {
            tokens,
            start_pos: c.start_pos,
            block_table,
        });
        if scheduler.config().kv_window.is_some() {
            let table = scheduler.window_table(c.id);
            window_tables.push(
                table.ok_or_else(|| {
                    format!("request {} was scheduled without window blocks", c.id)
                })?,
            );
        }
    }
    if model.model.config.linear_attention.is_some() {
        states.in_use.extend(slots.iter().copied());
    }
    let batch = Batch::new(chunks)
        .with_state_slots(slots)
        .with_window_tables(window_tables);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let which = match greedy {
            true => LogitsFor::GreedyOfEachSeq,
            false => LogitsFor::LastOfEachSeq,
        };
        model
            .model
            .forward_with_state(&batch, kv, &mut states.cache, which)
    }));
    match result {
        Ok(Ok(out)) if greedy => Ok(Picked::Tokens(out.tokens)),
        Ok(Ok(out)) => Ok(Picked::Logits(out.logits)),
        Ok(Err(e)) => Err(format!("forward pass failed: {e}")),
        Err(_) => Err("forward pass panicked".into()),
    }
}

/// A step failed as a whole: fail the requests it involved (their KV may be half written) and
/// keep serving the others.
fn fail_step(
    plan: &SchedulerOutput,
    scheduler: &mut Scheduler,
    live: &mut HashMap<RequestId, Live<'_>>,
    metrics: &Metrics,
    message: &str,
) {
    for chunk in &plan.chunks {
        scheduler.abort(chunk.id);
        if let Some(state) = live.remove(&chunk.id) {
            metrics.count_failed();
            state.fail(format!("internal error: {message}"));
        }
    }
}
