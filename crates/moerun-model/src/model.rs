//! A loaded model and its forward pass over a flat batch (the flow itself is
//! [`crate::forward::decoder`], run here on the CPU backend).

use std::path::Path;

use moerun_core::{Error, Result};

use crate::attention::Rope;
use crate::backend::cpu::CpuPass;
use crate::batch::{Batch, LogitsFor};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::forward;
use crate::kv::KvCache;
use crate::linear_state::LinearStateCache;
use crate::weights::ModelWeights;

/// A model ready to run: its resolved config, its weights, precomputed RoPE frequencies.
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    rope: Rope,
    checkpoint: Checkpoint,
}

/// What a forward pass returns: logits for the requested rows, `[rows.len(), vocab]`.
#[derive(Debug)]
pub struct ForwardOutput {
    pub rows: Vec<usize>,
    pub logits: Vec<f32>,
}

impl Model {
    /// Open a Hugging Face checkpoint directory and map its weights.
    pub fn load(dir: &Path) -> Result<Model> {
        let checkpoint = Checkpoint::open(dir)?;
        let config_json = checkpoint
            .read_json("config.json")?
            .ok_or_else(|| Error::Config(format!("{}/config.json not found", dir.display())))?;
        let config = ModelConfig::from_json(&config_json)?;
        let weights = ModelWeights::load(&checkpoint, &config)?;
        if config.has_vision_tower {
            let skipped = checkpoint
                .names()
                .filter(|n| n.starts_with("model.visual."))
                .count();
            let what = match skipped {
                0 => "the checkpoint has none".to_string(),
                n => format!("{n} tensors under model.visual."),
            };
            eprintln!(
                "moerun: {}: text model only; the vision tower ({what}) is not loaded",
                dir.display()
            );
        }
        Ok(Model {
            rope: Rope::new(&config),
            config,
            weights,
            checkpoint,
        })
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// Run the batch: write its K/V into `kv` at each token's position and return logits for
    /// the rows `which` selects. Every sequence's block table must cover its new positions.
    /// Models with linear-attention layers are refused: they need [`Model::forward_with_state`].
    pub fn forward(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        if self.config.linear_attention.is_some() {
            return Err(Error::Unsupported(format!(
                "{} keeps per-sequence linear-attention state: run it with \
                 Model::forward_with_state and a state slot per sequence",
                self.config.family
            )));
        }
        self.run(batch, kv, None, which)
    }

    /// [`Model::forward`] for every model, hybrid ones included: each sequence's Gated DeltaNet
    /// layers start from its state in `states` (slot `batch.state_slots[i]`; zero when its
    /// chunk starts at position 0) and leave it advanced past the chunk.
    pub fn forward_with_state(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        states: &mut LinearStateCache,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        self.run(batch, kv, Some(states), which)
    }

    /// Run the pass on a thread of rayon's pool: every matrix product inside then starts and
    /// joins its tasks without handing work across threads and waking the caller, which costs
    /// tens of microseconds per product otherwise (measured: a 3 MiB expert GEMV at 65% of read
    /// bandwidth from outside the pool, 88% from inside).
    fn run(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        states: Option<&mut LinearStateCache>,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        if rayon::current_thread_index().is_some() {
            return self.run_in_pool(batch, kv, states, which);
        }
        rayon::scope(|_| self.run_in_pool(batch, kv, states, which))
    }

    fn run_in_pool(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        states: Option<&mut LinearStateCache>,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        let cfg = &self.config;
        let mut tokens = Vec::with_capacity(batch.num_tokens());
        for seq in &batch.seqs {
            let end = seq.start_pos + seq.tokens.len();
            if seq.block_table.capacity(kv.block_size()) < end {
                return Err(Error::InvalidArgument(format!(
                    "block table holds {} positions but the batch writes up to {end}",
                    seq.block_table.capacity(kv.block_size())
                )));
            }
            if let Some(limit) = cfg.rope.position_limit().filter(|&l| end > l) {
                return Err(Error::Unsupported(format!(
                    "position {} with dynamic NTK rope: positions past max_position_embeddings ({limit}) \
                     rescale with batch history in transformers",
                    end - 1
                )));
            }
            for &t in seq.tokens {
                if t as usize >= cfg.vocab_size {
                    return Err(Error::TokenOutOfRange {
                        id: t,
                        vocab: cfg.vocab_size,
                    });
                }
                tokens.push(t);
            }
        }
        let rows = batch.logit_rows(which);
        // Linear-attention state: every slot is checked before any is touched.
        let linear_state = match (&cfg.linear_attention, states) {
            (Some(_), Some(states)) => {
                states.begin(batch)?;
                Some(states)
            }
            _ => None,
        };
        let hybrid = linear_state.is_some();
        let mut pass = CpuPass::new(cfg, &self.rope, batch, kv, linear_state);
        let logits = forward::decoder(&mut pass, cfg, &self.weights, &tokens, &rows)?;
        if hybrid {
            if let Some((states, _)) = pass.into_linear_state() {
                states.finish(batch);
            }
        }
        Ok(ForwardOutput { rows, logits })
    }
}

