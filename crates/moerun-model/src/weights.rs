//! The weights of a model, found by the names each family's checkpoints use and checked against
//! the shapes the config implies. Nothing is copied: matrices stay views into the mmapped files in
//! their stored dtype; only the small vectors (norms, biases) are widened to f32 at load.

use moerun_core::{Error, Result, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::{Family, FfnKind, ModelConfig, QkNorm};

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

pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    pub self_attn: AttentionWeights,
    pub post_attention_layernorm: Vec<f32>,
    pub ffn: FfnWeights,
}

pub struct ModelWeights {
    pub embed_tokens: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `lm_head.weight`, or the embedding when tied.
    pub lm_head: Tensor,
}

/// Fetches tensors with shape checks.
struct Loader<'a> {
    ckpt: &'a Checkpoint,
}

impl Loader<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
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

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.tensor(name, &[len])?.to_f32_vec())
    }

    fn linear(&self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
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
        let ld = Loader { ckpt };
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_tokens = ld.tensor("model.embed_tokens.weight", &[v, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (i, spec) in cfg.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let bias = cfg.attention_bias;
            let (q_norm, k_norm) = match cfg.qk_norm {
                QkNorm::None => (None, None),
                QkNorm::PerHead => (
                    Some(ld.vector(&format!("{p}.self_attn.q_norm.weight"), cfg.head_dim)?),
                    Some(ld.vector(&format!("{p}.self_attn.k_norm.weight"), cfg.head_dim)?),
                ),
                QkNorm::WholeProjection => (
                    Some(ld.vector(&format!("{p}.self_attn.q_norm.weight"), cfg.q_dim())?),
                    Some(ld.vector(&format!("{p}.self_attn.k_norm.weight"), cfg.kv_dim())?),
                ),
            };
            let self_attn = AttentionWeights {
                q_proj: ld.linear(&format!("{p}.self_attn.q_proj"), cfg.q_dim(), h, bias.qkv)?,
                k_proj: ld.linear(&format!("{p}.self_attn.k_proj"), cfg.kv_dim(), h, bias.qkv)?,
                v_proj: ld.linear(&format!("{p}.self_attn.v_proj"), cfg.kv_dim(), h, bias.qkv)?,
                o_proj: ld.linear(&format!("{p}.self_attn.o_proj"), h, cfg.q_dim(), bias.o)?,
                q_norm,
                k_norm,
            };
            let ffn = match spec.ffn {
                FfnKind::Dense { intermediate } => {
                    FfnWeights::Dense(ld.mlp(&format!("{p}.mlp"), h, intermediate, cfg.mlp_bias)?)
                }
                FfnKind::Moe => FfnWeights::Moe(load_moe(&ld, cfg, &p)?),
            };
            layers.push(LayerWeights {
                input_layernorm: ld.vector(&format!("{p}.input_layernorm.weight"), h)?,
                self_attn,
                post_attention_layernorm: ld
                    .vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                ffn,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            ld.tensor("lm_head.weight", &[v, h])?
        };
        Ok(ModelWeights {
            embed_tokens,
            layers,
            norm: ld.vector("model.norm.weight", h)?,
            lm_head,
        })
    }
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
