//! The per-sequence state of linear-attention (Gated DeltaNet) layers, beside the paged KV of the
//! attention layers.
//!
//! Unlike K/V, this state does not grow with the sequence: per layer it is the last
//! `conv_kernel - 1` inputs of the causal conv and one `[key_head_dim, value_head_dim]` matrix
//! per value head. A [`LinearStateCache`] has a fixed number of *slots*, each the whole state of
//! one sequence across all such layers; a batch names each sequence's slot
//! ([`crate::Batch::with_state_slots`]) the way its block table names its KV blocks. Which
//! sequence owns which slot is decided outside (like blocks, by exactly one owner). A slot's
//! memory is allocated when a sequence first uses it and returned by [`LinearStateCache::release`],
//! so a cache sized for the most sequences that could ever run costs only what runs.
//!
//! Each slot remembers how many positions it has absorbed. A chunk starting at position 0 starts
//! from a zero state (so a slot is reused without clearing); any other chunk must start exactly
//! where its slot stopped: the state cannot be rewound, and a mismatch is an error rather than
//! silently wrong logits.
//!
//! For a model on the CUDA backend ([`crate::Model::new_linear_state`]) each slot's state is one
//! device buffer instead, allocated at a slot's first use and zeroed on the device (stream
//! ordered) when a chunk starts at position 0; the bookkeeping (positions, checks) is the same
//! host code. The kernels reach a sequence's slot through a device table of slot addresses
//! uploaded with the batch, so a captured decode graph can be replayed with other slots.

use moerun_core::{Error, Result};
use moerun_cuda::{CudaDevice, CudaSlice};

use crate::batch::Batch;
use crate::config::{Mixer, ModelConfig};

/// Conv windows and recurrent states of the Gated DeltaNet layers, one slot per sequence.
pub struct LinearStateCache {
    /// Per model layer: where its state sits in a slot, `None` for attention layers.
    layers: Vec<Option<LayerLayout>>,
    /// f32 values of one slot.
    slot_len: usize,
    slots: Vec<Option<Slot>>,
    /// Per slot, its device memory when the cache is on the GPU (the host `Slot::state` is then
    /// empty).
    device: Option<Vec<Option<CudaSlice<f32>>>>,
}

/// One layer's part of a slot: `[conv_kernel - 1][conv_dim]` (oldest input first), then
/// `[num_value_heads][key_head_dim][value_head_dim]` (transformers' layout).
#[derive(Clone, Copy)]
struct LayerLayout {
    offset: usize,
    conv_len: usize,
    recurrent_len: usize,
}

struct Slot {
    state: Vec<f32>,
    /// Positions this state has absorbed.
    positions: usize,
}

/// One sequence's state in one layer, borrowed for a forward pass.
pub struct SlotState<'a> {
    pub conv: &'a mut [f32],
    pub recurrent: &'a mut [f32],
}

impl LinearStateCache {
    /// Room for `num_slots` sequences of a model described by `cfg` (nothing is allocated yet).
    pub fn new(cfg: &ModelConfig, num_slots: usize) -> LinearStateCache {
        let mut slot_len = 0;
        let layers = cfg
            .layers
            .iter()
            .map(|spec| match (spec.mixer, cfg.linear_attention) {
                (Mixer::GatedDeltaNet, Some(la)) => {
                    let layout = LayerLayout {
                        offset: slot_len,
                        conv_len: (la.conv_kernel - 1) * la.conv_dim(),
                        recurrent_len: la.num_value_heads * la.key_head_dim * la.value_head_dim,
                    };
                    slot_len += layout.conv_len + layout.recurrent_len;
                    Some(layout)
                }
                _ => None,
            })
            .collect();
        LinearStateCache {
            layers,
            slot_len,
            slots: (0..num_slots).map(|_| None).collect(),
            device: None,
        }
    }

    /// The same slots with their state in GPU memory (for a model on the CUDA backend).
    pub(crate) fn on_device(mut self) -> LinearStateCache {
        self.device = Some((0..self.slots.len()).map(|_| None).collect());
        self
    }

    /// Whether the state lives in GPU memory.
    pub fn is_on_device(&self) -> bool {
        self.device.is_some()
    }

    /// f32 values of one slot's state.
    pub(crate) fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Where layer `l`'s conv window and recurrent state start in a slot (f32 offsets), `None`
    /// for an attention layer.
    pub(crate) fn layer_offsets(&self, l: usize) -> Option<(usize, usize)> {
        self.layers
            .get(l)
            .copied()
            .flatten()
            .map(|lay| (lay.offset, lay.offset + lay.conv_len))
    }

    /// After [`LinearStateCache::begin`] on a device cache: give each sequence's slot device
    /// memory (zeros at first use), zero the slots of chunks that start a sequence, and return
    /// each sequence's slot address (0 for an empty chunk whose slot has no memory yet).
    pub(crate) fn device_slots(&mut self, dev: &CudaDevice, batch: &Batch) -> Result<Vec<u64>> {
        let slot_len = self.slot_len;
        let mem = self.device.as_mut().ok_or_else(|| {
            Error::InvalidArgument(
                "the model runs on CUDA but its linear-attention state is in host memory: make \
                 it with Model::new_linear_state"
                    .into(),
            )
        })?;
        let dev_err = |e: moerun_cuda::CudaError| Error::Device(e.to_string());
        let mut addrs = Vec::with_capacity(batch.seqs.len());
        for (seq, &slot) in batch.seqs.iter().zip(&batch.state_slots) {
            let fresh = !seq.tokens.is_empty() && seq.start_pos == 0;
            match &mut mem[slot] {
                Some(buf) if fresh => dev.stream().memset_zeros(buf).map_err(|e| {
                    Error::Device(format!("zeroing a linear-attention state slot: {e}"))
                })?,
                Some(_) => {}
                empty if !seq.tokens.is_empty() => {
                    *empty = Some(dev.zeros::<f32>(slot_len.max(1)).map_err(dev_err)?)
                }
                _ => {}
            }
            addrs.push(match &mem[slot] {
                Some(buf) => dev.state_address(buf).map_err(dev_err)?,
                None => 0,
            });
        }
        Ok(addrs)
    }

    /// Slots; valid slot ids are `0..num_slots`.
    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of the slots in use (host or device memory).
    pub fn bytes(&self) -> usize {
        match &self.device {
            Some(mem) => mem.iter().flatten().count() * self.slot_len * 4,
            None => self.slots.iter().flatten().count() * self.slot_len * 4,
        }
    }

    /// Positions the state in `slot` has absorbed (0 for a slot not in use).
    pub fn positions(&self, slot: usize) -> usize {
        self.slots[slot].as_ref().map_or(0, |s| s.positions)
    }

    /// Free `slot`'s memory (its sequence finished or was preempted).
    pub fn release(&mut self, slot: usize) {
        self.slots[slot] = None;
        if let Some(mem) = &mut self.device {
            mem[slot] = None;
        }
    }

    /// Check every sequence's slot against its chunk, then give each slot memory and zero those
    /// of chunks that start a sequence. Nothing changes when any check fails. Empty chunks keep
    /// their slot as it is.
    pub(crate) fn begin(&mut self, batch: &Batch) -> Result<()> {
        if batch.state_slots.len() != batch.seqs.len() {
            return Err(Error::InvalidArgument(format!(
                "the model has linear-attention layers: the batch needs one state slot per sequence, \
                 got {} for {} sequences",
                batch.state_slots.len(),
                batch.seqs.len()
            )));
        }
        let mut seen = vec![false; self.slots.len()];
        for (seq, &slot) in batch.seqs.iter().zip(&batch.state_slots) {
            if slot >= self.slots.len() {
                return Err(Error::InvalidArgument(format!(
                    "state slot {slot} out of range ({} slots)",
                    self.slots.len()
                )));
            }
            if std::mem::replace(&mut seen[slot], true) {
                return Err(Error::InvalidArgument(format!(
                    "state slot {slot} given to two sequences of one batch"
                )));
            }
            let held = self.positions(slot);
            if !seq.tokens.is_empty() && seq.start_pos != 0 && seq.start_pos != held {
                return Err(Error::InvalidArgument(format!(
                    "state slot {slot} holds {held} positions but its chunk starts at position {} \
                     (linear-attention state cannot be rewound or skipped)",
                    seq.start_pos
                )));
            }
        }
        for (seq, &slot) in batch.seqs.iter().zip(&batch.state_slots) {
            let fresh = !seq.tokens.is_empty() && seq.start_pos == 0;
            match &mut self.slots[slot] {
                Some(s) if fresh => {
                    s.state.fill(0.0);
                    s.positions = 0;
                }
                Some(_) => {}
                empty => {
                    // A device cache keeps the state in `device` (see device_slots).
                    let len = if self.device.is_some() {
                        0
                    } else {
                        self.slot_len
                    };
                    *empty = Some(Slot {
                        state: vec![0.0; len],
                        positions: 0,
                    })
                }
            }
        }
        Ok(())
    }

    /// Record that every sequence of `batch` has absorbed its chunk.
    pub(crate) fn finish(&mut self, batch: &Batch) {
        for (seq, &slot) in batch.seqs.iter().zip(&batch.state_slots) {
            if let Some(s) = self.slots[slot].as_mut().filter(|_| !seq.tokens.is_empty()) {
                s.positions = seq.start_pos + seq.tokens.len();
            }
        }
    }

    /// Layer `l`'s state of each of `slots` (distinct, in use: `begin` saw to both), in order.
    pub(crate) fn layer_slots_mut(&mut self, l: usize, slots: &[usize]) -> Vec<SlotState<'_>> {
        let layout = self.layers[l].expect("state exists for every Gated DeltaNet layer");
        let mut all: Vec<Option<&mut Slot>> = self.slots.iter_mut().map(Option::as_mut).collect();
        slots
            .iter()
            .map(|&s| {
                let slot = all[s].take().expect("distinct slots in use");
                let part = &mut slot.state[layout.offset..];
                let (conv, rest) = part.split_at_mut(layout.conv_len);
                SlotState {
                    conv,
                    recurrent: &mut rest[..layout.recurrent_len],
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SeqChunk;
    use moerun_core::BlockTable;

    fn config() -> ModelConfig {
        ModelConfig::from_json_str(
            r#"{"model_type": "qwen3_5_moe_text", "hidden_size": 16, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 4, "vocab_size": 10,
                "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, "num_experts": 2,
                "num_experts_per_tok": 1, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                "linear_key_head_dim": 4, "linear_value_head_dim": 4}"#,
        )
        .unwrap()
    }

    #[test]
    fn slots_take_memory_when_used_and_give_it_back_on_release() {
        let cfg = config();
        let mut cache = LinearStateCache::new(&cfg, 1000);
        assert_eq!(cache.bytes(), 0, "nothing allocated up front");
        let table = BlockTable::default();
        let tokens = [1u32, 2, 3];
        let chunk = SeqChunk {
            tokens: &tokens,
            start_pos: 0,
            block_table: &table,
        };
        let batch = Batch::new(vec![chunk]).with_state_slots(vec![7]);
        cache.begin(&batch).unwrap();
        cache.finish(&batch);
        assert_eq!(cache.positions(7), 3);
        assert_eq!(cache.bytes(), cfg.linear_state_bytes_per_sequence());
        cache.release(7);
        assert_eq!((cache.bytes(), cache.positions(7)), (0, 0));
    }
}
