//! The weights of a model, found by the names each family's checkpoints use and checked against
//! the shapes the config implies. Nothing is copied: matrices stay views into the mmapped files in
//! their stored dtype; only the small vectors (norms, biases, the Gated DeltaNet's conv taps and
//! per-head decay parameters) are widened to f32 at load.
//!
//! Qwen3.5 checkpoints differ in three ways: multimodal ones keep the language model under
//! `model.language_model.` (the vision tower under `model.visual.` is not loaded); zero-centred
//! RMSNorm weights get their `1 +` here, once; and a multi-token-prediction head (`mtp.*`), when
//! present, is kept as named tensors for speculative decoding.

use std::collections::BTreeMap;

use moerun_core::{Error, Result, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::{Family, FfnKind, LinearAttentionConfig, Mixer, ModelConfig, QkNorm};

/// A linear layer `y = x·Wᵀ (+ b)`; `weight` is `[out, in]`.
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn out_features(&self) -> usize {
        self.weight.shape[0]
    }
}

/// Self-attention projections and optional q/k norms.
pub struct AttentionWeights {
    /// `[num_heads * head_dim, H]`, or `[num_heads * 2 * head_dim, H]` with an output gate
    /// (per head: the query, then its gate).
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

/// A SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
pub struct MlpWeights {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

/// One routed expert's matrices, `[I, H]`, `[I, H]`, `[H, I]`, views into their storage (either
/// per-expert tensors or slices of fused 3-D tensors).
#[derive(Clone)]
pub struct ExpertWeights {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

/// A sparse MoE block.
pub struct MoeWeights {
    /// Router `[num_experts, hidden]` (`mlp.gate.weight`).
    pub router: Tensor,
    pub experts: Vec<ExpertWeights>,
    pub shared_expert: Option<MlpWeights>,
    /// `shared_expert_gate.weight`, `[1, hidden]`.
    pub shared_expert_gate: Option<Tensor>,
}

pub enum FfnWeights {
    Dense(MlpWeights),
    Moe(MoeWeights),
}

/// Qwen3.5's Gated DeltaNet (`linear_attn`).
pub struct GatedDeltaNetWeights {
    /// `[2 * key_dim + value_dim, H]`: q, k and v, which go through the conv together.
    pub in_proj_qkv: Linear,
    /// `[value_dim, H]`: the gate of the output norm.
    pub in_proj_z: Linear,
    /// `[num_value_heads, H]`: `β = sigmoid(b)`.
    pub in_proj_b: Linear,
    /// `[num_value_heads, H]`: the decay's input, `g = -exp(A_log) * softplus(a + dt_bias)`.
    pub in_proj_a: Linear,
    /// `conv1d.weight` (`[conv_dim, 1, kernel]` in the file) transposed to `[kernel, conv_dim]`,
    /// so that each tap is a contiguous row.
    pub conv1d_taps: Vec<f32>,
    /// `A_log`, `[num_value_heads]`.
    pub a_log: Vec<f32>,
    /// `dt_bias`, `[num_value_heads]`.
    pub dt_bias: Vec<f32>,
    /// The gated RMSNorm's weight, `[value_head_dim]`, applied as stored (no `1 +`).
    pub norm: Vec<f32>,
    /// `[H, value_dim]`.
    pub out_proj: Linear,
}

/// What mixes positions in a layer.
pub enum MixerWeights {
    Attention(AttentionWeights),
    GatedDeltaNet(GatedDeltaNetWeights),
}

pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    /// `self_attn` or `linear_attn`.
    pub mixer: MixerWeights,
    pub post_attention_layernorm: Vec<f32>,
    pub ffn: FfnWeights,
}

pub struct ModelWeights {
    pub embed_tokens: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `lm_head.weight`, or the embedding when tied.
    pub lm_head: Tensor,
    /// The multi-token-prediction head (`mtp.*`) by name, when the checkpoint has one: kept for
    /// speculative decoding, not used by the forward pass.
    pub mtp: BTreeMap<String, Tensor>,
    /// Gemma 4's layers, whose shape is its own (`layers` is then empty).
    pub gemma4: Option<crate::gemma4::Gemma4Weights>,
}

/// Fetches tensors with shape checks (also Gemma 4's loader, with no norm offset).
pub(crate) struct Loader<'a> {
    pub(crate) ckpt: &'a Checkpoint,
    /// Add one to RMSNorm weights (zero-centred storage).
    pub(crate) norm_offset: bool,
}

impl Loader<'_> {
    pub(crate) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.ckpt.tensor(name)?;
        if t.shape != shape {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.tensor(name, &[len])?.to_f32_vec())
    }

    /// An RMSNorm weight as the forward pass multiplies by it: `1 + w` (in f32, as transformers'
    /// `1.0 + weight.float()`) for zero-centred storage, else `w`.
    fn norm(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let mut w = self.vector(name, len)?;
        if self.norm_offset {
            for v in &mut w {
                *v += 1.0;
            }
        }
        Ok(w)
    }

    pub(crate) fn linear(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: self.tensor(&format!("{prefix}.weight"), &[out, inp])?,
            bias: if bias {
                Some(self.vector(&format!("{prefix}.bias"), out)?)
            } else {
                None
            },
        })
    }

    fn mlp(&self, prefix: &str, hidden: usize, inter: usize, bias: bool) -> Result<MlpWeights> {
        Ok(MlpWeights {
            gate_proj: self.linear(&format!("{prefix}.gate_proj"), inter, hidden, bias)?,
            up_proj: self.linear(&format!("{prefix}.up_proj"), inter, hidden, bias)?,
            down_proj: self.linear(&format!("{prefix}.down_proj"), hidden, inter, bias)?,
        })
    }
}

impl ModelWeights {
    /// Find and check every tensor the config calls for.
    pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<ModelWeights> {
        if let Some(g) = &cfg.gemma4 {
            let w = crate::gemma4::Gemma4Weights::load(ckpt, cfg, g)?;
            return Ok(ModelWeights {
                embed_tokens: w.embed_tokens.clone(),
                layers: Vec::new(),
                norm: w.norm.clone(),
                lm_head: w.lm_head.clone(),
                mtp: BTreeMap::new(),
                gemma4: Some(w),
            });
        }
        let ld = Loader {
            ckpt,
            norm_offset: cfg.rms_norm_unit_offset,
        };
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let base = text_model_prefix(ckpt, cfg);
        let embed_tokens = ld.tensor(&format!("{base}.embed_tokens.weight"), &[v, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (i, spec) in cfg.layers.iter().enumerate() {
            let p = format!("{base}.layers.{i}");
            let mixer = match (spec.mixer, &cfg.linear_attention) {
                (Mixer::Attention, _) => {
                    MixerWeights::Attention(load_attention(&ld, cfg, &format!("{p}.self_attn"))?)
                }
                (Mixer::GatedDeltaNet, Some(la)) => MixerWeights::GatedDeltaNet(
                    load_gated_deltanet(&ld, la, h, &format!("{p}.linear_attn"))?,
                ),
                (Mixer::GatedDeltaNet, None) => {
                    unreachable!("config resolution gives linear layers their shape")
                }
            };
            let ffn = match spec.ffn {
                FfnKind::Dense { intermediate } => {
                    FfnWeights::Dense(ld.mlp(&format!("{p}.mlp"), h, intermediate, cfg.mlp_bias)?)
                }
                FfnKind::Moe => FfnWeights::Moe(load_moe(&ld, cfg, &p)?),
            };
            layers.push(LayerWeights {
                input_layernorm: ld.norm(&format!("{p}.input_layernorm.weight"), h)?,
                mixer,
                post_attention_layernorm: ld
                    .norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
                ffn,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            ld.tensor("lm_head.weight", &[v, h])?
        };
        let mtp = ckpt
            .names()
            .filter(|n| n.starts_with("mtp."))
            .map(|n| Ok((n.to_string(), ckpt.tensor(n)?)))
            .collect::<Result<_>>()?;
        Ok(ModelWeights {
            embed_tokens,
            layers,
            norm: ld.norm(&format!("{base}.norm.weight"), h)?,
            lm_head,
            mtp,
            gemma4: None,
        })
    }
}

/// Where the decoder's tensors live: `model`, or `model.language_model` in Qwen3.5 checkpoints
/// saved from the multimodal class (a storage difference, like transformers' `PrefixChange`).
fn text_model_prefix(ckpt: &Checkpoint, cfg: &ModelConfig) -> &'static str {
    if cfg.family == Family::Qwen35Moe && ckpt.contains("model.language_model.embed_tokens.weight")
    {
        "model.language_model"
    } else {
        "model"
    }
}

/// Self-attention under prefix `a` (`...self_attn`).
fn load_attention(ld: &Loader, cfg: &ModelConfig, a: &str) -> Result<AttentionWeights> {
    let h = cfg.hidden_size;
    let bias = cfg.attention_bias;
    let (q_norm, k_norm) = match cfg.qk_norm {
        QkNorm::None => (None, None),
        QkNorm::PerHead => (
            Some(ld.norm(&format!("{a}.q_norm.weight"), cfg.head_dim)?),
            Some(ld.norm(&format!("{a}.k_norm.weight"), cfg.head_dim)?),
        ),
        QkNorm::WholeProjection => (
            Some(ld.norm(&format!("{a}.q_norm.weight"), cfg.q_dim())?),
            Some(ld.norm(&format!("{a}.k_norm.weight"), cfg.kv_dim())?),
        ),
    };
    let q_out = if cfg.attention_output_gate {
        2 * cfg.q_dim()
    } else {
        cfg.q_dim()
    };
    Ok(AttentionWeights {
        q_proj: ld.linear(&format!("{a}.q_proj"), q_out, h, bias.qkv)?,
        k_proj: ld.linear(&format!("{a}.k_proj"), cfg.kv_dim(), h, bias.qkv)?,
        v_proj: ld.linear(&format!("{a}.v_proj"), cfg.kv_dim(), h, bias.qkv)?,
        o_proj: ld.linear(&format!("{a}.o_proj"), h, cfg.q_dim(), bias.o)?,
        q_norm,
        k_norm,
    })
}

/// A Gated DeltaNet under prefix `p` (`...linear_attn`): Qwen3.5's separate `in_proj_qkv`,
/// `in_proj_z`, `in_proj_b`, `in_proj_a` (Qwen3-Next fuses them into `in_proj_qkvz`/`in_proj_ba`).
fn load_gated_deltanet(
    ld: &Loader,
    la: &LinearAttentionConfig,
    h: usize,
    p: &str,
) -> Result<GatedDeltaNetWeights> {
    let (conv_dim, taps, heads) = (la.conv_dim(), la.conv_kernel, la.num_value_heads);
    let conv = ld
        .tensor(&format!("{p}.conv1d.weight"), &[conv_dim, 1, taps])?
        .to_f32_vec();
    let mut conv1d_taps = vec![0.0f32; taps * conv_dim];
    for (c, row) in conv.chunks_exact(taps).enumerate() {
        for (j, &w) in row.iter().enumerate() {
            conv1d_taps[j * conv_dim + c] = w;
        }
    }
    Ok(GatedDeltaNetWeights {
        in_proj_qkv: ld.linear(&format!("{p}.in_proj_qkv"), conv_dim, h, false)?,
        in_proj_z: ld.linear(&format!("{p}.in_proj_z"), la.value_dim(), h, false)?,
        in_proj_b: ld.linear(&format!("{p}.in_proj_b"), heads, h, false)?,
        in_proj_a: ld.linear(&format!("{p}.in_proj_a"), heads, h, false)?,
        conv1d_taps,
        a_log: ld.vector(&format!("{p}.A_log"), heads)?,
        dt_bias: ld.vector(&format!("{p}.dt_bias"), heads)?,
        norm: ld.vector(&format!("{p}.norm.weight"), la.value_head_dim)?,
        out_proj: ld.linear(&format!("{p}.out_proj"), h, la.value_dim(), false)?,
    })
}

/// The MoE block of layer prefix `p`. Experts may be stored per expert (Hub checkpoints:
/// `mlp.experts.N.{gate,up,down}_proj`, or Mixtral's `block_sparse_moe.experts.N.{w1,w3,w2}`)
/// or fused as transformers 5 holds them (`mlp.experts.gate_up_proj` `[E, 2I, H]` with the gate
/// rows first, `mlp.experts.down_proj` `[E, H, I]`).
fn load_moe(ld: &Loader, cfg: &ModelConfig, p: &str) -> Result<MoeWeights> {
    let moe = cfg.moe.as_ref().expect("MoE layer implies a MoE config");
    let (h, e, i) = (cfg.hidden_size, moe.num_experts, moe.expert_intermediate);
    let ckpt = ld.ckpt;
    let block = if cfg.family == Family::Mixtral
        && ckpt.contains(&format!("{p}.block_sparse_moe.gate.weight"))
    {
        format!("{p}.block_sparse_moe")
    } else {
        format!("{p}.mlp")
    };
    let router = ld.tensor(&format!("{block}.gate.weight"), &[e, h])?;
    let fused = format!("{block}.experts.gate_up_proj");
    let experts = if ckpt.contains(&fused) {
        let gate_up = ld.tensor(&fused, &[e, 2 * i, h])?;
        let down = ld.tensor(&format!("{block}.experts.down_proj"), &[e, h, i])?;
        (0..e)
            .map(|x| {
                let gu = gate_up.index0(x)?;
                Ok(ExpertWeights {
                    gate: gu.narrow0(0, i)?,
                    up: gu.narrow0(i, i)?,
                    down: down.index0(x)?,
                })
            })
            .collect::<Result<Vec<_>>>()?
    } else {
        let names = if block.ends_with("block_sparse_moe") {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        };
        (0..e)
            .map(|x| {
                let ep = format!("{block}.experts.{x}");
                Ok(ExpertWeights {
                    gate: ld.tensor(&format!("{ep}.{}.weight", names[0]), &[i, h])?,
                    up: ld.tensor(&format!("{ep}.{}.weight", names[1]), &[i, h])?,
                    down: ld.tensor(&format!("{ep}.{}.weight", names[2]), &[h, i])?,
                })
            })
            .collect::<Result<Vec<_>>>()?
    };
    let (shared_expert, shared_expert_gate) = match &moe.shared_expert {
        None => (None, None),
        Some(s) => (
            Some(ld.mlp(&format!("{block}.shared_expert"), h, s.intermediate, false)?),
            if s.gated {
                Some(ld.tensor(&format!("{block}.shared_expert_gate.weight"), &[1, h])?)
            } else {
                None
            },
        ),
    };
    Ok(MoeWeights {
        router,
        experts,
        shared_expert,
        shared_expert_gate,
    })
}
