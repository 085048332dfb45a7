//! A sequence being processed, and one forward step over several of them.

use moerun_core::{BlockTable, Result};
use moerun_model::{Batch, ForwardOutput, KvCache, LogitsFor, Model, SeqChunk};

/// A sequence whose first `cached` tokens are in the KV cache.
#[derive(Debug, Default)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub table: BlockTable,
    pub cached: usize,
}

impl Sequence {
    pub fn new(tokens: Vec<u32>) -> Self {
        Sequence {
            tokens,
            ..Default::default()
        }
    }

    /// Tokens not yet in the KV cache.
    pub fn pending(&self) -> &[u32] {
        &self.tokens[self.cached..]
    }

    /// Give the sequence's blocks back to the cache.
    pub fn release(&mut self, kv: &mut KvCache) {
        kv.free(&mut self.table);
        self.cached = 0;
    }
}

/// Run up to `max_tokens[i]` pending tokens of each sequence as one flat batch, then mark them
/// cached. Blocks are reserved first, all or nothing per sequence.
pub fn run_step(
    model: &Model,
    kv: &mut KvCache,
    seqs: &mut [&mut Sequence],
    max_tokens: &[usize],
    which: LogitsFor,
) -> Result<ForwardOutput> {
    let mut counts = Vec::with_capacity(seqs.len());
    for (s, &limit) in seqs.iter_mut().zip(max_tokens) {
        let n = s.pending().len().min(limit);
        kv.reserve(&mut s.table, s.cached + n)?;
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
        model.forward(&Batch::new(chunks), kv, which)?
    };
    for (s, n) in seqs.iter_mut().zip(counts) {
        s.cached += n;
    }
    Ok(out)
}
