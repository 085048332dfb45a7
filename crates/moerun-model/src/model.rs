//! A loaded model and its forward pass over a flat batch. The decoder layer of every supported
//! family reads top to bottom as in transformers' `modeling_*.py`:
//! `x = x + o_proj(attn(rope(norm_qk(qkv(input_layernorm(x))))))`, then
//! `x = x + ffn(post_attention_layernorm(x))` where `ffn` is a dense SwiGLU MLP or the MoE block.

use std::path::Path;

use moerun_core::{Error, Result};
use moerun_cpu::attention::TokenSlot;
use moerun_cpu::ops::rms_norm_rows;

use crate::attention::{attention_block, Rope};
use crate::batch::{Batch, LogitsFor};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::ffn::{ffn_block, FfnScratch};
use crate::kv::KvCache;
use crate::linear::{embed_rows, linear};
use crate::weights::{FfnWeights, ModelWeights};

/// A model ready to run: its resolved config, its weights, precomputed RoPE frequencies.
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    rope: Rope,
    checkpoint: Checkpoint,
}

/// What a forward pass returns: logits for the requested rows, `[rows.len(), vocab]`.
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
    pub fn forward(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
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
        let h = cfg.hidden_size;
        let mut x = vec![0.0f32; n * h];
        embed_rows(&self.weights.embed_tokens, &tokens, &mut x);
        let mut scratch = FfnScratch::default();
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let mut xn = x.clone();
            rms_norm_rows(&mut xn, &layer.input_layernorm, cfg.rms_norm_eps);
            let attn_out = attention_block(
                cfg,
                &layer.self_attn,
                &self.rope,
                cfg.layers[l].sliding_window,
                &xn,
                &slots,
                &mut kv.pools[l],
            );
            add_in_place(&mut x, &attn_out);
            let mut xn = x.clone();
            rms_norm_rows(&mut xn, &layer.post_attention_layernorm, cfg.rms_norm_eps);
            let ffn_out = match &layer.ffn {
                FfnWeights::Dense(mlp) => crate::ffn::mlp(mlp, &xn, n, &mut scratch),
                FfnWeights::Moe(moe) => {
                    let moe_cfg = cfg.moe.as_ref().expect("MoE weights imply a MoE config");
                    ffn_block(moe_cfg, moe, &xn, n, &mut scratch)
                }
            };
            add_in_place(&mut x, &ffn_out);
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
