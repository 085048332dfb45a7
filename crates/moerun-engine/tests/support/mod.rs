//! Driving hybrid models with state slots the test chooses. `run_step` picks each sequence's
//! linear-attention slot itself (its first block id); [`step`] does what `run_step` does but with
//! the slots the caller gives, so tests can show that results do not depend on which slot a
//! sequence's state lives in (`Batch::with_state_slots`, `Model::forward_with_state`).

use moerun_core::Result;
use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::{Batch, ForwardOutput, LinearStateCache, LogitsFor, Model, SeqChunk};

/// Paged KV plus the linear-attention state slots of a few sequences.
pub struct Caches {
    pub kv: SequenceKv,
    pub states: LinearStateCache,
}

impl Caches {
    /// Room for `tokens` tokens of KV and `sequences` state slots, where `model` runs.
    pub fn with_capacity(model: &Model, tokens: usize, sequences: usize) -> Caches {
        Caches {
            kv: SequenceKv::for_model(model, tokens).expect("KV cache for the model"),
            states: model.new_linear_state(sequences),
        }
    }
}

/// `run_step(model, kv, seqs, max_tokens, which)`, sequence `i` keeping its linear-attention
/// state in slot `slots[i]` (ignored for attention-only models, which go through `run_step`).
pub fn step(
    model: &Model,
    caches: &mut Caches,
    seqs: &mut [&mut Sequence],
    slots: &[usize],
    max_tokens: &[usize],
    which: LogitsFor,
) -> Result<ForwardOutput> {
    if model.config.linear_attention.is_none() {
        return run_step(model, &mut caches.kv, seqs, max_tokens, which);
    }
    let mut counts = Vec::with_capacity(seqs.len());
    for (s, &limit) in seqs.iter_mut().zip(max_tokens) {
        let n = s.pending().len().min(limit);
        caches.kv.reserve(&mut s.table, s.cached + n)?;
        counts.push(n);
    }
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
        let batch = Batch::new(chunks).with_state_slots(slots.to_vec());
        model.forward_with_state(&batch, caches.kv.cache_mut(), &mut caches.states, which)?
    };
    for (s, n) in seqs.iter_mut().zip(counts) {
        s.cached += n;
    }
    Ok(out)
}
