//! The CPU backend: activations are `Vec<f32>` rows, weights are read where they are mapped
//! (bf16 widened inside the kernels), K/V live in the host [`KvCache`], Gated DeltaNet state in
//! the host [`LinearStateCache`]. Each op is the moerun-cpu kernel of the same name.

use std::ops::Range;

use moerun_core::{Error, Result, Tensor};
use moerun_cpu::attention::{paged_attention, AttentionShape, TokenSlot};
use moerun_cpu::ops::{rms_norm_rows, sigmoid};

use super::{AttentionSpec, Backend};
use crate::attention::{split_query_gate, Rope};
use crate::batch::Batch;
use crate::config::{ModelConfig, MoeConfig};
use crate::ffn::{ffn_block, mlp};
use crate::gated_deltanet::gated_deltanet_block;
use crate::kv::KvCache;
use crate::linear::{apply, embed_rows, linear};
use crate::linear_state::LinearStateCache;
use crate::weights::{GatedDeltaNetWeights, Linear, MlpWeights, MoeWeights};

/// One forward pass on the CPU: the batch's token placement and the caches it writes.
pub struct CpuPass<'a> {
    cfg: &'a ModelConfig,
    rope: &'a Rope,
    slots: Vec<TokenSlot<'a>>,
    /// The same tokens placed by their sequences' window tables, which the sliding-window
    /// layers use when the cache keeps them apart (empty otherwise).
    window_slots: Vec<TokenSlot<'a>>,
    kv: &'a mut KvCache,
    /// Linear-attention state and the batch it is laid out for (hybrid models only).
    linear: Option<(&'a mut LinearStateCache, &'a Batch<'a>)>,
    /// Rows of each sequence in the flat batch.
    spans: Vec<Range<usize>>,
}

impl<'a> CpuPass<'a> {
    pub fn new(
        cfg: &'a ModelConfig,
        rope: &'a Rope,
        batch: &'a Batch<'a>,
        kv: &'a mut KvCache,
        linear: Option<&'a mut LinearStateCache>,
    ) -> CpuPass<'a> {
        let mut spans: Vec<Range<usize>> = Vec::with_capacity(batch.seqs.len());
        for seq in &batch.seqs {
            let start = spans.last().map_or(0, |r| r.end);
            spans.push(start..start + seq.tokens.len());
        }
        let window_slots = if batch.window_tables.is_empty() {
            Vec::new()
        } else {
            token_slots(batch, true)
        };
        CpuPass {
            cfg,
            rope,
            slots: token_slots(batch, false),
            window_slots,
            kv,
            linear: linear.map(|s| (s, batch)),
            spans,
        }
    }
}

/// Each token of the batch at its position in its sequence's block table of the window group
/// (`windowed`) or of the other layers.
pub(crate) fn token_slots<'a>(batch: &Batch<'a>, windowed: bool) -> Vec<TokenSlot<'a>> {
    let mut slots = Vec::with_capacity(batch.num_tokens());
    for (i, seq) in batch.seqs.iter().enumerate() {
        let table = &batch.table(i, windowed).blocks;
        slots.extend((0..seq.tokens.len()).map(|j| TokenSlot {
            block_table: table,
            position: seq.start_pos + j,
        }));
    }
    slots
}

impl<'a> CpuPass<'a> {
    /// End the pass, handing back the linear-attention state it advanced.
    pub fn into_linear_state(self) -> Option<(&'a mut LinearStateCache, &'a Batch<'a>)> {
        self.linear
    }
}

impl Backend for CpuPass<'_> {
    type Act = Vec<f32>;

    fn embed(&mut self, table: &Tensor, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut x = vec![0.0f32; tokens.len() * table.shape[1]];
        embed_rows(table, tokens, &mut x);
        Ok(x)
    }

    fn rms_norm(&mut self, x: &Vec<f32>, weight: &[f32], eps: f32) -> Result<Vec<f32>> {
        let mut out = x.clone();
        rms_norm_rows(&mut out, weight, eps);
        Ok(out)
    }

    fn add_assign(&mut self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
        Ok(())
    }

    fn linear(&mut self, x: &Vec<f32>, l: &Linear) -> Result<Vec<f32>> {
        Ok(apply(x, rows(x, l.weight.shape[1]), l))
    }

    fn matmul(&mut self, x: &Vec<f32>, w: &Tensor) -> Result<Vec<f32>> {
        Ok(linear(x, rows(x, w.shape[1]), w, None))
    }

    fn clamp(&mut self, x: &mut Vec<f32>, c: f32) -> Result<()> {
        for v in x.iter_mut() {
            *v = v.clamp(-c, c);
        }
        Ok(())
    }

    fn rope(&mut self, x: &mut Vec<f32>, heads: usize, head_dim: usize) -> Result<()> {
        self.rope.apply(x, &self.slots, heads, head_dim);
        Ok(())
    }

    fn split_query_gate(
        &mut self,
        q_and_gate: &Vec<f32>,
        head_dim: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok(split_query_gate(q_and_gate, head_dim))
    }

    fn sigmoid_gate(&mut self, x: &mut Vec<f32>, gate: &Vec<f32>) -> Result<()> {
        for (o, g) in x.iter_mut().zip(gate) {
            *o *= sigmoid(*g);
        }
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        spec: &AttentionSpec,
    ) -> Result<Vec<f32>> {
        let pool = &mut self.kv.pools[layer];
        let kv_w = spec.num_kv_heads * spec.head_dim;
        let slots = match spec.sliding_window {
            Some(_) if !self.window_slots.is_empty() => &self.window_slots,
            _ => &self.slots,
        };
        for (i, slot) in slots.iter().enumerate() {
            pool.write(
                slot.block_table,
                slot.position,
                &k[i * kv_w..(i + 1) * kv_w],
                &v[i * kv_w..(i + 1) * kv_w],
            );
        }
        let shape = AttentionShape {
            num_heads: spec.num_heads,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            scale: spec.scale,
            sliding_window: spec.sliding_window,
        };
        let mut out = vec![0.0f32; slots.len() * spec.num_heads * spec.head_dim];
        paged_attention(q, slots, pool, &shape, &mut out);
        Ok(out)
    }

    fn mlp(&mut self, x: &Vec<f32>, w: &MlpWeights) -> Result<Vec<f32>> {
        Ok(mlp(w, x, rows(x, w.gate_proj.weight.shape[1])))
    }

    fn moe(&mut self, x: &Vec<f32>, cfg: &MoeConfig, w: &MoeWeights) -> Result<Vec<f32>> {
        Ok(ffn_block(cfg, w, x, rows(x, w.router.shape[1])))
    }

    fn gated_deltanet(
        &mut self,
        layer: usize,
        w: &GatedDeltaNetWeights,
        xn: &Vec<f32>,
    ) -> Result<Vec<f32>> {
        let (Some(la), Some((states, batch))) = (&self.cfg.linear_attention, &mut self.linear)
        else {
            return Err(Error::Unsupported(format!(
                "{} keeps per-sequence linear-attention state: run it with \
                 Model::forward_with_state and a state slot per sequence",
                self.cfg.family
            )));
        };
        let mut seq_states = states.layer_slots_mut(layer, &batch.state_slots);
        Ok(gated_deltanet_block(
            la,
            self.cfg.rms_norm_eps,
            w,
            xn,
            &self.spans,
            &mut seq_states,
        ))
    }

    fn select_rows(&mut self, x: &Vec<f32>, width: usize, rows: &[usize]) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(rows.len() * width);
        for &r in rows {
            out.extend_from_slice(&x[r * width..(r + 1) * width]);
        }
        Ok(out)
    }

    fn to_host(&mut self, x: Vec<f32>) -> Result<Vec<f32>> {
        Ok(x)
    }

    fn upload(&mut self, x: &[f32]) -> Result<Vec<f32>> {
        Ok(x.to_vec())
    }
}

/// Rows of `x` at `width` values each.
fn rows(x: &[f32], width: usize) -> usize {
    x.len() / width.max(1)
}
