//! The scheduler's limits, validated once so that the scheduling loop can rely on them.

use std::fmt;

/// Limits of the serving engine. All are operator settings (CLI flags), not client input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences running (holding KV) at once.
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Most tokens (prompt plus completion) one sequence may reach.
    pub max_model_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool (sized by the engine from the memory it has).
    pub num_blocks: usize,
    /// Whether full blocks of computed KV are reused by later requests with the same prefix.
    pub enable_prefix_caching: bool,
    /// Most requests waiting for admission; more are refused so the server can answer 429/503
    /// instead of letting latency grow without bound.
    pub max_waiting: usize,
    /// The sliding-window layers' K/V in blocks of their own, kept only for the window (models
    /// with such layers; see [`crate::block_manager::BlockManager::with_window_group`]).
    pub kv_window: Option<KvWindowGroup>,
}

/// The window group of the KV cache: blocks for the sliding-window layers, which keep each
/// sequence's last `window` positions only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvWindowGroup {
    /// Positions a sliding layer's query sees, itself included.
    pub window: usize,
    /// Blocks of the group's pool.
    pub num_blocks: usize,
}

/// A [`SchedulerConfig`] the scheduler cannot run with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigError {
    /// A limit that must be at least 1 is 0 (the field's name).
    Zero(&'static str),
    /// `max_model_len` must leave room for a prompt token and a generated one.
    MaxModelLenTooSmall(usize),
    /// Every running sequence must be able to decode in every step, so the token budget must
    /// be at least `max_num_seqs`.
    BudgetBelowMaxNumSeqs {
        max_num_batched_tokens: usize,
        max_num_seqs: usize,
    },
    /// Block ids are `u32`.
    TooManyBlocks(usize),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Zero(field) => write!(f, "scheduler: {field} must be at least 1"),
            ConfigError::MaxModelLenTooSmall(n) => {
                write!(f, "scheduler: max_model_len {n} must be at least 2")
            }
            ConfigError::BudgetBelowMaxNumSeqs {
                max_num_batched_tokens,
                max_num_seqs,
            } => write!(
                f,
                "scheduler: max_num_batched_tokens {max_num_batched_tokens} is below \
                 max_num_seqs {max_num_seqs}; every running sequence must fit in one step"
            ),
            ConfigError::TooManyBlocks(n) => {
                write!(f, "scheduler: num_blocks {n} exceeds {}", u32::MAX)
            }
        }
    }
}

impl std::error::Error for ConfigError {}

impl SchedulerConfig {
    /// Check the limits against each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_waiting", self.max_waiting),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::Zero(field));
        }
        if self.max_model_len < 2 {
            return Err(ConfigError::MaxModelLenTooSmall(self.max_model_len));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(ConfigError::BudgetBelowMaxNumSeqs {
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_num_seqs: self.max_num_seqs,
            });
        }
        if u32::try_from(self.num_blocks).is_err() {
            return Err(ConfigError::TooManyBlocks(self.num_blocks));
        }
        if let Some(w) = self.kv_window {
            if w.window == 0 {
                return Err(ConfigError::Zero("kv_window.window"));
            }
            if w.num_blocks == 0 {
                return Err(ConfigError::Zero("kv_window.num_blocks"));
            }
            if u32::try_from(w.num_blocks).is_err() {
                return Err(ConfigError::TooManyBlocks(w.num_blocks));
            }
        }
        Ok(())
    }
}
