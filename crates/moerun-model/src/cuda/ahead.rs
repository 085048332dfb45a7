//! Greedy decode at batch 1 with the next step already launched: between two decode steps the
//! device used to wait for the host (the token's download, the sampler and scheduler, the input
//! copies and the graph launch). On the H200 that was ~1% of a ~2.7 ms Qwen3-30B-A3B step
//! (366-370 → 369-370 tok/s, docs/perf/cuda-model.md v11); on a slower host it is more.
//!
//! When a greedy decode step of one sequence runs from its CUDA graph, its pick (the arg-max) is
//! written to a device buffer, and before the host waits for it, the *next* step is launched
//! from the same graph: its token id copied on the device from that pick, its position one
//! further, the same block table. On the next call, if the batch is exactly that step (the same
//! sequence at that position with the picked token, its block table unchanged over the positions
//! it reads), its pick is already computed or in flight: the host launches the step after it and
//! reads the pick. Anything else discards the step launched ahead. It has written only what a
//! later step rewrites first, in stream order: the K/V of its position (beyond the sequence's
//! length, in a block the sequence holds alone: only full blocks are shared), the graph's logits
//! and one of the two pick buffers.
//!
//! Not for models with recurrent state (a step launched ahead would advance it), sliding-window
//! tables (the window moves every step) or Gemma 4 (its own flow); a step whose position needs a
//! block the sequence does not hold yet is not launched ahead either (one step in each block runs
//! without overlap). The results are those of the step run alone: the same graph, the same
//! inputs. `MOERUN_CUDA_DECODE_AHEAD=0` switches it off.

use moerun_core::{Error, Result};
use moerun_cuda::{
    ArgmaxScratch, CudaDevice, CudaEvent, CudaSlice, CudaView, MappedHostU32, NextStepInputs,
};

use super::graph::{self, StepTokens};
use super::{dev_err, CudaModel, DeviceKv};
use crate::batch::{Batch, SeqChunk};
use crate::config::ModelConfig;
use crate::weights::ModelWeights;

/// The two pick buffers steps alternate between, on the device and in page-locked host memory,
/// and the events recorded after each copy to the host.
pub(crate) struct Picks {
    device: [CudaSlice<u32>; 2],
    host: [MappedHostU32; 2],
    copied: [CudaEvent; 2],
    scratch: ArgmaxScratch,
}

impl Picks {
    fn new(dev: &CudaDevice) -> Result<Picks> {
        Ok(Picks {
            device: [
                dev.zeros(1).map_err(dev_err)?,
                dev.zeros(1).map_err(dev_err)?,
            ],
            host: [
                dev.mapped_u32(1).map_err(dev_err)?,
                dev.mapped_u32(1).map_err(dev_err)?,
            ],
            copied: [
                dev.new_event().map_err(dev_err)?,
                dev.new_event().map_err(dev_err)?,
            ],
            scratch: ArgmaxScratch::new(dev, 1).map_err(dev_err)?,
        })
    }

    /// Pick buffer `slot` on the device.
    pub(crate) fn device(&self, slot: usize) -> &CudaSlice<u32> {
        &self.device[slot]
    }

    /// The arg-max of `logits` (one row of `vocab`) into buffer `slot`, on the device and on the
    /// host; `next`, the graph's inputs, move on to the step that decodes it. The kernel writes
    /// the host's copy itself (mapped page-locked memory), so no copy sits on the stream between
    /// this step and the one launched after it; `MOERUN_CUDA_PICK_COPY=1` copies it instead (a
    /// measuring knob).
    pub(crate) fn pick(
        &mut self,
        dev: &CudaDevice,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        slot: usize,
        next: NextStepInputs<'_>,
    ) -> Result<()> {
        let copy = copy_picks();
        let NextStepInputs {
            tokens,
            positions,
            positions_u32,
            ..
        } = next;
        let next = NextStepInputs {
            tokens,
            positions,
            positions_u32,
            host_picks: (!copy).then_some(&mut self.host[slot]),
        };
        dev.argmax_rows_advancing(
            logits,
            vocab,
            &mut self.device[slot],
            &mut self.scratch,
            next,
        )
        .map_err(dev_err)?;
        if copy {
            dev.copy_to_host_async(
                &self.device[slot],
                self.host[slot].pinned_mut(),
                &self.copied[slot],
            )
            .map_err(dev_err)
        } else {
            dev.record(&self.copied[slot]).map_err(dev_err)
        }
    }

    /// The pick in buffer `slot`, once it has reached the host.
    fn read(&self, slot: usize) -> Result<u32> {
        self.copied[slot]
            .synchronize()
            .map_err(|e| Error::Device(format!("waiting for the decode step's pick: {e}")))?;
        let host = self.host[slot]
            .as_slice()
            .map_err(|e| Error::Device(format!("reading the decode step's pick: {e}")))?;
        Ok(host[0])
    }
}

/// A decode step launched ahead of the call that will ask for it.
pub(crate) struct Ahead {
    /// The position it decodes.
    start_pos: usize,
    /// Its sequence's blocks when it was launched.
    blocks: Vec<u32>,
    /// The token it decodes: the pick of the step before, known once that was read.
    token: u32,
    /// The pick buffer its arg-max goes to.
    slot: usize,
}

impl Ahead {
    /// Whether `batch` is exactly this step.
    fn is(&self, batch: &Batch, block_size: usize) -> bool {
        let [seq] = batch.seqs.as_slice() else {
            return false;
        };
        // The blocks of the positions it read, 0..=start_pos.
        let read = ..self.start_pos / block_size + 1;
        seq.start_pos == self.start_pos
            && seq.tokens == [self.token]
            && seq
                .block_table
                .blocks
                .get(read)
                .is_some_and(|b| Some(b) == self.blocks.get(read))
    }
}

/// The position of the step after `seq`'s, if the sequence already holds its block (a step
/// launched ahead must not need one the host has not reserved).
fn next_position(seq: &SeqChunk<'_>, block_size: usize) -> Option<usize> {
    let next = seq.start_pos + seq.tokens.len();
    (next < seq.block_table.blocks.len() * block_size).then_some(next)
}

/// Whether picks reach the host by a copy on the stream (`MOERUN_CUDA_PICK_COPY=1`, read once)
/// rather than written there by the arg-max kernel.
fn copy_picks() -> bool {
    static COPY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *COPY.get_or_init(|| std::env::var_os("MOERUN_CUDA_PICK_COPY").is_some_and(|v| v == "1"))
}

/// Whether steps may be launched ahead (`MOERUN_CUDA_DECODE_AHEAD`, read once; `0`: never).
fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var_os("MOERUN_CUDA_DECODE_AHEAD").is_none_or(|v| v != "0"))
}

/// Run `batch` as a greedy decode step of one sequence (its one row's pick wanted) with the next
/// step launched ahead, and return its pick; `None` where this does not apply (the caller runs
/// the step as usual). Any step launched ahead before this call is either this step or discarded.
pub(crate) fn greedy_step(
    m: &CudaModel,
    (cfg, w): (&ModelConfig, &ModelWeights),
    kv: &mut DeviceKv,
    batch: &Batch,
) -> Result<Option<u32>> {
    let ahead = kv.graphs.ahead.take();
    let applies = enabled()
        && cfg.linear_attention.is_none()
        && w.gemma4.is_none()
        && batch.window_tables.is_empty()
        && batch.seqs.len() == 1
        && batch.seqs[0].tokens.len() == 1;
    if !applies {
        return Ok(None);
    }
    let Some(bucket) = graph::prepare(m, cfg, w, kv, batch, &[0], None)? else {
        return Ok(None);
    };
    let block_size = kv.block_size()?;
    if kv.graphs.picks.is_none() {
        kv.graphs.picks = Some(Picks::new(&m.dev)?);
    }
    let slot = match ahead {
        Some(a) if a.is(batch, block_size) => a.slot,
        _ => {
            let token = [batch.seqs[0].tokens[0]];
            graph::replay(m, kv, bucket, batch, StepTokens::Host(&token), None)?;
            graph::pick(m, cfg.vocab_size, kv, bucket, 0)?;
            0
        }
    };
    let seq = &batch.seqs[0];
    if let Some(next) = next_position(seq, block_size) {
        let next_batch = Batch::new(vec![SeqChunk {
            start_pos: next,
            ..*seq
        }]);
        graph::replay(m, kv, bucket, &next_batch, StepTokens::Pick(slot), None)?;
        graph::pick(m, cfg.vocab_size, kv, bucket, 1 - slot)?;
        kv.graphs.ahead = Some(Ahead {
            start_pos: next,
            blocks: seq.block_table.blocks.clone(),
            token: u32::MAX, // set below, once this step's pick is read
            slot: 1 - slot,
        });
    }
    let picks = kv.graphs.picks.as_ref().expect("made above");
    let token = picks.read(slot)?;
    if let Some(a) = &mut kv.graphs.ahead {
        a.token = token;
    }
    Ok(Some(token))
}

#[cfg(test)]
mod tests {
    use moerun_core::BlockTable;

    use super::*;

    fn step(start_pos: usize, token: u32, blocks: &[u32], slot: usize) -> Ahead {
        Ahead {
            start_pos,
            blocks: blocks.to_vec(),
            token,
            slot,
        }
    }

    /// A batch of one sequence's one token.
    fn one<'a>(tokens: &'a [u32], start_pos: usize, table: &'a BlockTable) -> Batch<'a> {
        Batch::new(vec![SeqChunk {
            tokens,
            start_pos,
            block_table: table,
        }])
    }

    #[test]
    fn a_step_launched_ahead_is_taken_only_by_exactly_that_step() {
        let bs = 16;
        // Launched at position 20 (block 1) with token 7 over blocks [4, 9].
        let a = step(20, 7, &[4, 9], 1);
        let table = BlockTable { blocks: vec![4, 9] };
        assert!(a.is(&one(&[7], 20, &table), bs));
        // A block appended since (reserved for later positions) does not matter.
        let grown = BlockTable {
            blocks: vec![4, 9, 2],
        };
        assert!(a.is(&one(&[7], 20, &grown), bs));
        // Another token, position or block under a position it read: another step.
        assert!(!a.is(&one(&[8], 20, &table), bs), "token");
        assert!(!a.is(&one(&[7], 21, &table), bs), "position");
        assert!(!a.is(&one(&[7], 19, &table), bs), "position");
        let moved = BlockTable { blocks: vec![4, 3] };
        assert!(
            !a.is(&one(&[7], 20, &moved), bs),
            "the block of its own position"
        );
        let moved = BlockTable { blocks: vec![5, 9] };
        assert!(!a.is(&one(&[7], 20, &moved), bs), "an earlier block");
        let short = BlockTable { blocks: vec![4] };
        assert!(
            !a.is(&one(&[7], 20, &short), bs),
            "a table without its block"
        );
        // Two tokens of the sequence, or two sequences: not a step of one token.
        assert!(!a.is(&one(&[7, 7], 20, &table), bs), "two tokens");
        let two = Batch::new(vec![
            SeqChunk {
                tokens: &[7],
                start_pos: 20,
                block_table: &table,
            },
            SeqChunk {
                tokens: &[7],
                start_pos: 20,
                block_table: &table,
            },
        ]);
        assert!(!a.is(&two, bs), "two sequences");
    }

    #[test]
    fn the_next_step_is_launched_ahead_only_within_the_blocks_held() {
        let bs = 16;
        let one_block = BlockTable { blocks: vec![4] };
        let seq = |start_pos, table| SeqChunk {
            tokens: &[7],
            start_pos,
            block_table: table,
        };
        assert_eq!(next_position(&seq(0, &one_block), bs), Some(1));
        assert_eq!(next_position(&seq(14, &one_block), bs), Some(15));
        assert_eq!(
            next_position(&seq(15, &one_block), bs),
            None,
            "needs block 1"
        );
        let two_blocks = BlockTable { blocks: vec![4, 9] };
        assert_eq!(next_position(&seq(15, &two_blocks), bs), Some(16));
        assert_eq!(next_position(&seq(31, &two_blocks), bs), None);
    }
}
