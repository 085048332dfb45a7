//! Gemma 4's tensors, by the names transformers gives them (`Gemma4ForCausalLM`: `model.`;
//! `Gemma4ForConditionalGeneration`: `model.language_model.`, its vision/audio towers skipped),
//! checked against the shapes the resolved config implies. Matrices stay views into the mmap in
//! their stored dtype; norm vectors, router scales and `layer_scalar` are widened to f32.
//!
//! Experts are fused as transformers keeps them (`experts.gate_up_proj` `[E, 2I, H]`, gate rows
//! first, and `experts.down_proj` `[E, H, I]`); the router is `router.proj` plus its learned
//! `router.scale` `[H]` and `router.per_expert_scale` `[E]`. KV-shared layers have no `k_proj`,
//! `v_proj`, `k_norm` (a checkpoint may still carry them: transformers ignores them, so do we);
//! full layers with `attention_k_eq_v` have no `v_proj`.

use moerun_core::{DType, Result, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::{Gemma4Config, ModelConfig};
use crate::weights::{Linear, Loader, MlpWeights};

use super::attention::LayerRopes;

/// Every weight of a Gemma 4 text model.
pub struct Gemma4Weights {
    pub embed_tokens: Tensor,
    /// `sqrt(hidden)` rounded to the embedding's dtype, as `Gemma4TextScaledWordEmbedding` does.
    pub embed_scale: f32,
    pub per_layer_input: Option<PerLayerInputWeights>,
    pub layers: Vec<Gemma4LayerWeights>,
    pub norm: Vec<f32>,
    /// `lm_head.weight`, or the embedding when tied.
    pub lm_head: Tensor,
    /// RoPE inverse frequencies of each layer type.
    pub ropes: LayerRopes,
}

/// The model-level half of per-layer input embeddings (PLE).
pub struct PerLayerInputWeights {
    /// `embed_tokens_per_layer` `[vocab_per_layer, layers * width]`.
    pub embed_tokens_per_layer: Tensor,
    /// `sqrt(width)` rounded to that table's dtype.
    pub embed_scale: f32,
    /// `per_layer_model_projection` `[layers * width, H]`.
    pub model_projection: Tensor,
    /// `per_layer_projection_norm` `[width]`.
    pub projection_norm: Vec<f32>,
}

/// One decoder layer.
pub struct Gemma4LayerWeights {
    pub input_layernorm: Vec<f32>,
    pub self_attn: Gemma4AttentionWeights,
    pub post_attention_layernorm: Vec<f32>,
    pub pre_feedforward_layernorm: Vec<f32>,
    pub mlp: MlpWeights,
    pub moe: Option<Gemma4MoeWeights>,
    pub post_feedforward_layernorm: Vec<f32>,
    pub per_layer_input: Option<LayerInputWeights>,
    /// `layer_scalar`: the whole residual stream is multiplied by it at the end of the layer.
    pub layer_scalar: f32,
}

/// `q_proj`/`q_norm`/`o_proj`, and the layer's own K/V projections unless it shares K/V.
pub struct Gemma4AttentionWeights {
    pub q_proj: Linear,
    pub q_norm: Vec<f32>,
    pub kv: Option<OwnKvWeights>,
    pub o_proj: Linear,
}

pub struct OwnKvWeights {
    pub k_proj: Linear,
    /// `None` with `attention_k_eq_v` on full layers: values are the raw `k_proj` output.
    pub v_proj: Option<Linear>,
    pub k_norm: Vec<f32>,
}

/// The routed experts of one layer and the norms around them.
pub struct Gemma4MoeWeights {
    /// `router.proj.weight` `[E, H]`.
    pub router_proj: Tensor,
    /// `router.scale` `[H]`.
    pub router_scale: Vec<f32>,
    /// `router.per_expert_scale` `[E]`.
    pub per_expert_scale: Vec<f32>,
    /// Per expert: `gate_up_proj[e]` `[2I, H]` (gate rows first) and `down_proj[e]` `[H, I]`.
    pub experts: Vec<(Tensor, Tensor)>,
    pub pre_feedforward_layernorm_2: Vec<f32>,
    pub post_feedforward_layernorm_1: Vec<f32>,
    pub post_feedforward_layernorm_2: Vec<f32>,
}

/// The layer-level half of PLE: `per_layer_input_gate` `[P, H]`, `per_layer_projection`
/// `[H, P]`, `post_per_layer_input_norm` `[H]`.
pub struct LayerInputWeights {
    pub gate: Tensor,
    pub projection: Tensor,
    pub post_norm: Vec<f32>,
}

/// `sqrt(width)` as `Gemma4TextScaledWordEmbedding` applies it: an f32 buffer cast to the table's
/// dtype before the multiply (so 53.066 becomes 53.0 for a bf16 table of width 2816).
pub fn embed_scale(width: usize, dtype: DType) -> f32 {
    let scale = (width as f64).sqrt() as f32;
    match dtype {
        DType::F32 => scale,
        DType::BF16 => half::bf16::from_f32(scale).to_f32(),
        DType::F16 => half::f16::from_f32(scale).to_f32(),
    }
}

/// Where the text model's tensors live: `model`, or `model.language_model` in checkpoints saved
/// from `Gemma4ForConditionalGeneration`.
fn text_prefix(ckpt: &Checkpoint) -> &'static str {
    if ckpt.contains("model.language_model.embed_tokens.weight") {
        "model.language_model"
    } else {
        "model"
    }
}

impl Gemma4Weights {
    /// Find and check every tensor `cfg` calls for.
    pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, g: &Gemma4Config) -> Result<Gemma4Weights> {
        let ld = Loader {
            ckpt,
            norm_offset: false,
        };
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let base = text_prefix(ckpt);
        announce_skipped_towers(ckpt, g);
        let embed_tokens = ld.tensor(&format!("{base}.embed_tokens.weight"), &[v, h])?;
        let per_layer_input = match g.per_layer_input {
            None => None,
            Some(ple) => {
                let packed = cfg.num_layers() * ple.width;
                let table = ld.tensor(
                    &format!("{base}.embed_tokens_per_layer.weight"),
                    &[ple.vocab, packed],
                )?;
                Some(PerLayerInputWeights {
                    embed_scale: embed_scale(ple.width, table.dtype),
                    embed_tokens_per_layer: table,
                    model_projection: ld.tensor(
                        &format!("{base}.per_layer_model_projection.weight"),
                        &[packed, h],
                    )?,
                    projection_norm: ld.vector(
                        &format!("{base}.per_layer_projection_norm.weight"),
                        ple.width,
                    )?,
                })
            }
        };
        let layers = (0..cfg.num_layers())
            .map(|l| load_layer(&ld, cfg, g, &format!("{base}.layers.{l}"), l))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            ld.tensor("lm_head.weight", &[v, h])?
        };
        Ok(Gemma4Weights {
            embed_scale: embed_scale(h, embed_tokens.dtype),
            embed_tokens,
            per_layer_input,
            layers,
            norm: ld.vector(&format!("{base}.norm.weight"), h)?,
            lm_head,
            ropes: LayerRopes::new(g),
        })
    }
}

/// One line on stderr for each multimodal tower the checkpoint carries but moerun does not run.
fn announce_skipped_towers(ckpt: &Checkpoint, g: &Gemma4Config) {
    for tower in &g.towers {
        let prefixes = [
            format!("model.{tower}_tower."),
            format!("model.embed_{tower}."),
        ];
        let n = ckpt
            .names()
            .filter(|name| prefixes.iter().any(|p| name.starts_with(p.as_str())))
            .count();
        let what = match n {
            0 => "the checkpoint has none of its tensors".to_string(),
            n => format!("{n} tensors under model.{tower}_tower. and model.embed_{tower}."),
        };
        eprintln!(
            "moerun: {}: text model only; the {tower} tower ({what}) is not loaded",
            ckpt.dir().display()
        );
    }
}

fn load_layer(
    ld: &Loader,
    cfg: &ModelConfig,
    g: &Gemma4Config,
    p: &str,
    l: usize,
) -> Result<Gemma4LayerWeights> {
    let h = cfg.hidden_size;
    let spec = &g.layers[l];
    let (d, q_dim, kv_dim) = (
        spec.head_dim,
        cfg.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
    );
    let bias = cfg.attention_bias.qkv;
    let a = format!("{p}.self_attn");
    let kv = if spec.shares_kv(l) {
        None
    } else {
        Some(OwnKvWeights {
            k_proj: ld.linear(&format!("{a}.k_proj"), kv_dim, h, bias)?,
            v_proj: if spec.k_eq_v {
                None
            } else {
                Some(ld.linear(&format!("{a}.v_proj"), kv_dim, h, bias)?)
            },
            k_norm: ld.vector(&format!("{a}.k_norm.weight"), d)?,
        })
    };
    let self_attn = Gemma4AttentionWeights {
        q_proj: ld.linear(&format!("{a}.q_proj"), q_dim, h, bias)?,
        q_norm: ld.vector(&format!("{a}.q_norm.weight"), d)?,
        kv,
        o_proj: ld.linear(&format!("{a}.o_proj"), h, q_dim, cfg.attention_bias.o)?,
    };
    let inter = spec.mlp_intermediate;
    let mlp = MlpWeights {
        gate_proj: ld.linear(&format!("{p}.mlp.gate_proj"), inter, h, false)?,
        up_proj: ld.linear(&format!("{p}.mlp.up_proj"), inter, h, false)?,
        down_proj: ld.linear(&format!("{p}.mlp.down_proj"), h, inter, false)?,
    };
    let moe = match &cfg.moe {
        Some(moe) if g.enable_moe_block => {
            let (e, i) = (moe.num_experts, moe.expert_intermediate);
            let gate_up = ld.tensor(&format!("{p}.experts.gate_up_proj"), &[e, 2 * i, h])?;
            let down = ld.tensor(&format!("{p}.experts.down_proj"), &[e, h, i])?;
            let experts = (0..e)
                .map(|x| Ok((gate_up.index0(x)?, down.index0(x)?)))
                .collect::<Result<Vec<_>>>()?;
            Some(Gemma4MoeWeights {
                router_proj: ld.tensor(&format!("{p}.router.proj.weight"), &[e, h])?,
                router_scale: ld.vector(&format!("{p}.router.scale"), h)?,
                per_expert_scale: ld.vector(&format!("{p}.router.per_expert_scale"), e)?,
                experts,
                pre_feedforward_layernorm_2: ld
                    .vector(&format!("{p}.pre_feedforward_layernorm_2.weight"), h)?,
                post_feedforward_layernorm_1: ld
                    .vector(&format!("{p}.post_feedforward_layernorm_1.weight"), h)?,
                post_feedforward_layernorm_2: ld
                    .vector(&format!("{p}.post_feedforward_layernorm_2.weight"), h)?,
            })
        }
        _ => None,
    };
    let per_layer_input = match g.per_layer_input {
        None => None,
        Some(ple) => Some(LayerInputWeights {
            gate: ld.tensor(&format!("{p}.per_layer_input_gate.weight"), &[ple.width, h])?,
            projection: ld.tensor(&format!("{p}.per_layer_projection.weight"), &[h, ple.width])?,
            post_norm: ld.vector(&format!("{p}.post_per_layer_input_norm.weight"), h)?,
        }),
    };
    Ok(Gemma4LayerWeights {
        input_layernorm: ld.vector(&format!("{p}.input_layernorm.weight"), h)?,
        self_attn,
        post_attention_layernorm: ld.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
        pre_feedforward_layernorm: ld
            .vector(&format!("{p}.pre_feedforward_layernorm.weight"), h)?,
        mlp,
        moe,
        post_feedforward_layernorm: ld
            .vector(&format!("{p}.post_feedforward_layernorm.weight"), h)?,
        per_layer_input,
        layer_scalar: ld.vector(&format!("{p}.layer_scalar"), 1)?[0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embed_scale_is_rounded_to_the_table_dtype_as_transformers_does() {
        // transformers' comment: sqrt(3072) = 55.4256 becomes 55.5 in bfloat16.
        assert_eq!(embed_scale(3072, DType::BF16), 55.5);
        assert_eq!(embed_scale(2816, DType::BF16), 53.0);
        assert_eq!(embed_scale(2816, DType::F32), 2816f64.sqrt() as f32);
        assert_eq!(embed_scale(64, DType::BF16), 8.0);
    }
}
