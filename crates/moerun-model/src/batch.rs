//! The unit of work: a flat batch of tokens from one or more sequences. Each sequence contributes
//! a contiguous run of new tokens starting at some position (a whole prompt, a prefill chunk, or a
//! single decode token), the block table its KV lives in and, for models with linear-attention
//! layers, the slot of its state in a [`crate::LinearStateCache`]. Prefill, decode and mixtures
//! of both are the same call.

use moerun_core::BlockTable;

/// New tokens of one sequence in this step.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; the sequence's KV already holds positions `0..start_pos`.
    pub start_pos: usize,
    /// Blocks for positions `0..start_pos + tokens.len()` at least.
    pub block_table: &'a BlockTable,
}

/// Which rows of the batch need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every token (teacher-forced scoring, conformance tests).
    AllTokens,
    /// The last token of each sequence (generation).
    LastOfEachSeq,
    /// The greedy pick (arg-max of the logits) of the last token of each sequence, and no
    /// logits: on the GPU only the ids cross to the host ([`crate::ForwardOutput::tokens`]).
    GreedyOfEachSeq,
}

/// A flat batch of sequence chunks.
#[derive(Clone, Debug, Default)]
pub struct Batch<'a> {
    pub seqs: Vec<SeqChunk<'a>>,
    /// Per sequence, in `seqs` order, its slot in the [`crate::LinearStateCache`]; empty for
    /// models without linear-attention layers. (Kept beside `seqs` rather than in [`SeqChunk`]
    /// until every caller that builds chunks carries a slot.)
    pub state_slots: Vec<usize>,
    /// Per sequence, in `seqs` order, the block table of its sliding-window layers' K/V when the
    /// KV cache keeps that group apart ([`crate::KvCache::with_window_group`]): indexed by
    /// position like `block_table`, with the entries before the window of the sequence's
    /// first new token possibly [`moerun_core::RELEASED_BLOCK`]. Empty when the cache keeps
    /// every layer in the same blocks.
    pub window_tables: Vec<&'a BlockTable>,
}

impl<'a> Batch<'a> {
    pub fn new(seqs: Vec<SeqChunk<'a>>) -> Self {
        Batch {
            seqs,
            state_slots: Vec::new(),
            window_tables: Vec::new(),
        }
    }

    /// The same batch, the K/V of each sequence's sliding-window layers in `tables[i]`.
    pub fn with_window_tables(mut self, tables: Vec<&'a BlockTable>) -> Self {
        self.window_tables = tables;
        self
    }

    /// The block table of sequence `i`'s layers in the window group (`windowed`) or the others.
    pub fn table(&self, i: usize, windowed: bool) -> &'a BlockTable {
        match self.window_tables.get(i) {
            Some(t) if windowed => t,
            _ => self.seqs[i].block_table,
        }
    }

    /// The same batch, each sequence's linear-attention state in `slots[i]` (one per sequence).
    pub fn with_state_slots(mut self, slots: Vec<usize>) -> Self {
        self.state_slots = slots;
        self
    }

    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Row indices (into the flat batch) that `which` selects, in batch order.
    pub fn logit_rows(&self, which: LogitsFor) -> Vec<usize> {
        match which {
            LogitsFor::AllTokens => (0..self.num_tokens()).collect(),
            LogitsFor::LastOfEachSeq | LogitsFor::GreedyOfEachSeq => {
                let mut end = 0;
                self.seqs
                    .iter()
                    .filter_map(|s| {
                        end += s.tokens.len();
                        (!s.tokens.is_empty()).then_some(end - 1)
                    })
                    .collect()
            }
        }
    }
}
