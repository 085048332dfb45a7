//! What one [`super::Scheduler::schedule`] decided, and the counters `/metrics` reports.

use super::RequestId;
use crate::block_manager::PrefixCacheStats;

/// One sequence's part of a step: compute tokens `start_pos..start_pos + num_tokens` of its
/// token list (see [`super::Scheduler::chunk_tokens`]) with its block table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub id: RequestId,
    /// Position of the first token; the KV of every earlier position is already computed.
    pub start_pos: usize,
    /// Tokens to compute: 1 for a decode, up to the token budget for a prefill chunk.
    pub num_tokens: usize,
    /// Whether the chunk reaches the sequence's last known token, so its last row needs logits
    /// and [`super::Scheduler::update`] expects a sampled token. False only for a prefill chunk
    /// that leaves part of the prompt for later steps.
    pub needs_logits: bool,
}

/// A step's flat batch, in batch order: decodes, then continued prefills, then newly admitted
/// requests (each group in arrival order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub chunks: Vec<ScheduledChunk>,
    /// Requests preempted during this step: their KV is gone and they wait to be recomputed.
    pub preempted: Vec<RequestId>,
    /// Sum of `num_tokens` over `chunks`, at most `max_num_batched_tokens`.
    pub num_batched_tokens: usize,
}

impl SchedulerOutput {
    /// Whether there is nothing to run.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

/// Scheduler state for `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Blocks referenced by running requests.
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// The window group's blocks in use and in all (0 and 0 without one).
    pub kv_window_blocks_used: usize,
    pub kv_window_blocks_total: usize,
    pub prefix_cache: PrefixCacheStats,
    /// Preemptions since start.
    pub num_preemptions: u64,
}

impl SchedulerStats {
    /// `kv_blocks_used / kv_blocks_total`.
    pub fn kv_usage(&self) -> f64 {
        if self.kv_blocks_total == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / self.kv_blocks_total as f64
        }
    }
}
