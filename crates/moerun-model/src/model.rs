//! A loaded model and its forward pass over a flat batch. The decoder layer of every supported
//! family reads top to bottom as in transformers' `modeling_*.py`:
//! `x = x + mixer(input_layernorm(x))`, where the mixer is attention,
//! `o_proj(attn(rope(norm_qk(qkv(·)))))`, or (Qwen3.5's `linear_attention` layers) the Gated
//! DeltaNet; then `x = x + ffn(post_attention_layernorm(x))` where `ffn` is a dense SwiGLU MLP or
//! the MoE block.

use std::ops::Range;
use std::path::Path;

use moerun_core::{Error, Result};
use moerun_cpu::attention::TokenSlot;
use moerun_cpu::ops::rms_norm_rows;

use crate::attention::{attention_block, Rope};
use crate::batch::{Batch, LogitsFor};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::ffn::ffn_block;
use crate::gated_deltanet::gated_deltanet_block;
use crate::kv::KvCache;
use crate::linear::{embed_rows, linear};
use crate::linear_state::LinearStateCache;
use crate::weights::{FfnWeights, MixerWeights, ModelWeights};

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
        let n = batch.num_tokens();
        let mut tokens = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
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
            for (i, &t) in seq.tokens.iter().enumerate() {
                if t as usize >= cfg.vocab_size {
                    return Err(Error::TokenOutOfRange {
                        id: t,
                        vocab: cfg.vocab_size,
                    });
                }
                tokens.push(t);
                slots.push(TokenSlot {
                    block_table: &seq.block_table.blocks,
                    position: seq.start_pos + i,
                });
            }
        }
        // Linear-attention state: every slot is checked before any is touched.
        let mut linear_state = match (&cfg.linear_attention, states) {
            (None, _) => None,
            (Some(_), Some(states)) => {
                states.begin(batch)?;
                Some(states)
            }
            (Some(_), None) => unreachable!("forward refuses hybrid models without state"),
        };
        let mut spans: Vec<Range<usize>> = Vec::with_capacity(batch.seqs.len());
        for seq in &batch.seqs {
            let start = spans.last().map_or(0, |r| r.end);
            spans.push(start..start + seq.tokens.len());
        }

        let h = cfg.hidden_size;
        let mut x = vec![0.0f32; n * h];
        embed_rows(&self.weights.embed_tokens, &tokens, &mut x);
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let mut xn = x.clone();
            rms_norm_rows(&mut xn, &layer.input_layernorm, cfg.rms_norm_eps);
            let mixed = match &layer.mixer {
                MixerWeights::Attention(w) => attention_block(
                    cfg,
                    w,
                    &self.rope,
                    cfg.layers[l].sliding_window,
                    &xn,
                    &slots,
                    &mut kv.pools[l],
                ),
                MixerWeights::GatedDeltaNet(w) => {
                    let (Some(la), Some(state)) = (&cfg.linear_attention, &mut linear_state) else {
                        unreachable!("Gated DeltaNet layers imply their config and state");
                    };
                    let mut seq_states = state.layer_slots_mut(l, &batch.state_slots);
                    gated_deltanet_block(la, cfg.rms_norm_eps, w, &xn, &spans, &mut seq_states)
                }
            };
            add_in_place(&mut x, &mixed);
            let mut xn = x.clone();
            rms_norm_rows(&mut xn, &layer.post_attention_layernorm, cfg.rms_norm_eps);
            let ffn_out = match &layer.ffn {
                FfnWeights::Dense(mlp) => crate::ffn::mlp(mlp, &xn, n),
                FfnWeights::Moe(moe) => {
                    let moe_cfg = cfg.moe.as_ref().expect("MoE weights imply a MoE config");
                    ffn_block(moe_cfg, moe, &xn, n)
                }
            };
            add_in_place(&mut x, &ffn_out);
        }
        if let Some(state) = linear_state {
            state.finish(batch);
        }
        let rows = batch.logit_rows(which);
        let mut last = Vec::with_capacity(rows.len() * h);
        for &r in &rows {
            last.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        rms_norm_rows(&mut last, &self.weights.norm, cfg.rms_norm_eps);
        let logits = linear(&last, rows.len(), &self.weights.lm_head, None);
        Ok(ForwardOutput { rows, logits })
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
