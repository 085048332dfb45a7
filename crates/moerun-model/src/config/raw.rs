//! From `config.json` to [`ModelConfig`]: field lookup with both spellings, per-family defaults
//! (transformers 5.24's config classes), and per-layer decisions exactly as each family's
//! `modeling_*.py` makes them.

use moerun_core::{Error, Result};
use serde_json::Value;

use super::{gemma4, qwen3_5};
use super::{
    AttentionBias, Family, FfnKind, LayerSpec, Mixer, ModelConfig, MoeConfig, QkNorm, RopeConfig,
    SharedExpertConfig,
};

/// Typed accessors over the JSON object, with messages that name the field.
pub(super) struct Fields<'a>(pub(super) &'a Value);

impl Fields<'_> {
    pub(super) fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                Error::Config(format!("'{key}' must be a non-negative integer, got {v}"))
            }),
        }
    }

    pub(super) fn usize(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?
            .ok_or_else(|| Error::Config(format!("missing required field '{key}'")))
    }

    pub(super) fn positive(&self, key: &str) -> Result<usize> {
        let n = self.usize(key)?;
        if n == 0 {
            return Err(Error::Config(format!("'{key}' must be positive")));
        }
        Ok(n)
    }

    pub(super) fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| Error::Config(format!("'{key}' must be a number, got {v}"))),
        }
    }

    pub(super) fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Error::Config(format!("'{key}' must be true or false, got {v}"))),
        }
    }

    pub(super) fn str_opt(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    pub(super) fn token_ids(&self, key: &str) -> Vec<u32> {
        match self.get(key) {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => Vec::new(),
        }
    }

    pub(super) fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().map(|n| n as usize).ok_or_else(|| {
                        Error::Config(format!("'{key}' must be a list of integers, got {v}"))
                    })
                })
                .collect(),
            Some(v) => Err(Error::Config(format!("'{key}' must be a list, got {v}"))),
        }
    }
}

pub(super) fn resolve(value: &Value) -> Result<ModelConfig> {
    if !value.is_object() {
        return Err(Error::Config("must be a JSON object".into()));
    }
    // Gemma 4 resolves whole in its own module: per-layer shapes, RoPE per layer type.
    if let Some(cfg) = gemma4::resolve(value)? {
        return Ok(cfg);
    }
    let outer = Fields(value);
    let model_type = outer
        .str_opt("model_type")
        .ok_or_else(|| Error::Config("missing 'model_type'".into()))?;
    // A multimodal wrapper: everything the text model needs is in its `text_config`.
    let wrapper = qwen3_5::text_config(value, model_type)?;
    let value = wrapper.map_or(value, |w| w.text);
    let f = Fields(value);
    let model_type = match wrapper {
        Some(w) => w.text_model_type,
        None => model_type,
    };
    let family =
        Family::from_model_type(model_type).ok_or_else(|| Error::UnsupportedArchitecture {
            found: model_type.to_string(),
            supported: Family::supported_list(),
        })?;

    let act = f.str_opt("hidden_act").unwrap_or("silu");
    if act != "silu" {
        return Err(Error::Unsupported(format!(
            "hidden_act '{act}' for {family} (only 'silu' is implemented)"
        )));
    }

    let hidden_size = f.positive("hidden_size")?;
    let num_heads = f.positive("num_attention_heads")?;
    let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(Error::Config(format!(
            "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )));
    }
    let head_dim = match f.usize_opt("head_dim")? {
        Some(d) if d > 0 => d,
        // Qwen3Config declares `head_dim: int = 128`, Qwen3_5MoeTextConfig 256; the others
        // derive it.
        _ if family == Family::Qwen3 => 128,
        _ if family == Family::Qwen35Moe => 256,
        _ => {
            if hidden_size % num_heads != 0 {
                return Err(Error::Config(format!(
                    "hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads} and no head_dim is given"
                )));
            }
            hidden_size / num_heads
        }
    };
    let num_layers = f.positive("num_hidden_layers")?;
    let max_position_embeddings = f.usize_opt("max_position_embeddings")?.unwrap_or(4096);
    let default_eps = if matches!(family, Family::Mixtral | Family::Olmoe) {
        1e-5
    } else {
        1e-6
    };
    let rms_norm_eps = f.f64_or("rms_norm_eps", default_eps)? as f32;
    // Qwen3_5MoeTextConfig sets partial_rotary_factor 0.25 when the config has none.
    let default_partial = if family == Family::Qwen35Moe {
        0.25
    } else {
        1.0
    };
    let rope = RopeConfig::parse(value, head_dim, max_position_embeddings, default_partial)?;

    let attention_bias = match family {
        Family::Qwen2 => AttentionBias {
            qkv: true,
            o: false,
        },
        Family::Qwen2Moe => AttentionBias {
            qkv: f.bool_or("qkv_bias", true)?,
            o: false,
        },
        Family::Mixtral => AttentionBias {
            qkv: false,
            o: false,
        },
        Family::Qwen3
        | Family::Qwen3Moe
        | Family::Olmoe
        | Family::Llama
        | Family::Qwen35Moe
        | Family::Gemma4 => {
            let b = f.bool_or("attention_bias", false)?;
            AttentionBias { qkv: b, o: b }
        }
    };
    let mlp_bias = family == Family::Llama && f.bool_or("mlp_bias", false)?;
    let qk_norm = match family {
        Family::Qwen3 | Family::Qwen3Moe | Family::Qwen35Moe => QkNorm::PerHead,
        Family::Olmoe => QkNorm::WholeProjection,
        _ => QkNorm::None,
    };
    let clip_qkv = if family == Family::Olmoe {
        f.get("clip_qkv")
            .map(|v| {
                v.as_f64()
                    .map(|c| c as f32)
                    .ok_or_else(|| Error::Config(format!("'clip_qkv' must be a number, got {v}")))
            })
            .transpose()?
    } else {
        None
    };

    let windows = sliding_windows(&f, family, num_layers)?;
    let (mixers, linear_attention) = if family == Family::Qwen35Moe {
        qwen3_5::check_refused_options(&f)?;
        let mixers = qwen3_5::mixers(&f, num_layers)?;
        (mixers, Some(qwen3_5::linear_attention(&f)?))
    } else {
        (vec![Mixer::Attention; num_layers], None)
    };
    let (moe, moe_layers) = moe_config(&f, family, num_layers)?;
    let dense_intermediate = if moe_layers.iter().all(|&m| m) {
        0
    } else {
        f.positive("intermediate_size")?
    };
    let layers = (0..num_layers)
        .map(|i| LayerSpec {
            mixer: mixers[i],
            sliding_window: windows[i],
            ffn: if moe_layers[i] {
                FfnKind::Moe
            } else {
                FfnKind::Dense {
                    intermediate: dense_intermediate,
                }
            },
        })
        .collect();

    Ok(ModelConfig {
        family,
        vocab_size: f.positive("vocab_size")?,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps,
        rope,
        attention_bias,
        mlp_bias,
        qk_norm,
        clip_qkv,
        rms_norm_unit_offset: family == Family::Qwen35Moe,
        attention_output_gate: family == Family::Qwen35Moe,
        linear_attention,
        has_vision_tower: wrapper.is_some_and(|w| w.has_vision_tower),
        tie_word_embeddings: match wrapper {
            Some(w) => w.tie_word_embeddings,
            None => f.bool_or("tie_word_embeddings", false)?,
        },
        max_position_embeddings,
        layers,
        moe,
        bos_token_id: special_ids(&f, &outer, "bos_token_id").first().copied(),
        eos_token_ids: special_ids(&f, &outer, "eos_token_id"),
        gemma4: None,
    })
}

/// Special token ids of the text config, else of a multimodal wrapper (where `outer` is it).
fn special_ids(f: &Fields, outer: &Fields, key: &str) -> Vec<u32> {
    let ids = f.token_ids(key);
    if ids.is_empty() && !std::ptr::eq(f.0, outer.0) {
        outer.token_ids(key)
    } else {
        ids
    }
}

/// Per-layer sliding windows, following each family's config class and attention module.
fn sliding_windows(f: &Fields, family: Family, num_layers: usize) -> Result<Vec<Option<usize>>> {
    let window = f.usize_opt("sliding_window")?.filter(|&w| w > 0);
    let use_sliding = f.bool_or("use_sliding_window", false)?;
    let none = vec![None; num_layers];
    Ok(match family {
        Family::Olmoe | Family::Llama | Family::Qwen35Moe | Family::Gemma4 => none,
        // Mixtral slides on every layer whenever sliding_window is set.
        Family::Mixtral => vec![window; num_layers],
        // Qwen3-MoE's attention takes config.sliding_window on every layer, and its config
        // clears it unless use_sliding_window.
        Family::Qwen3Moe => vec![window.filter(|_| use_sliding); num_layers],
        Family::Qwen2 | Family::Qwen3 | Family::Qwen2Moe => {
            let Some(w) = window.filter(|_| use_sliding) else {
                return Ok(none);
            };
            let types: Vec<String> = match f.get("layer_types") {
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| v.as_str().unwrap_or_default().to_string())
                    .collect(),
                Some(v) => {
                    return Err(Error::Config(format!(
                        "'layer_types' must be a list, got {v}"
                    )))
                }
                None => {
                    let max_window_layers = f.usize_opt("max_window_layers")?.unwrap_or(28);
                    (0..num_layers)
                        .map(|i| {
                            let slides = if family == Family::Qwen2Moe {
                                (i + 1) % 2 == 1 && i < max_window_layers
                            } else {
                                i >= max_window_layers
                            };
                            if slides {
                                "sliding_attention"
                            } else {
                                "full_attention"
                            }
                            .to_string()
                        })
                        .collect()
                }
            };
            if types.len() != num_layers {
                return Err(Error::Config(format!(
                    "'layer_types' has {} entries for {num_layers} layers",
                    types.len()
                )));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(Some(w)),
                    "full_attention" => Ok(None),
                    other => Err(Error::Unsupported(format!(
                        "layer type '{other}' in {family}"
                    ))),
                })
                .collect::<Result<_>>()?
        }
    })
}

/// The MoE block settings and which layers use it.
fn moe_config(
    f: &Fields,
    family: Family,
    num_layers: usize,
) -> Result<(Option<MoeConfig>, Vec<bool>)> {
    if !family.is_moe() {
        return Ok((None, vec![false; num_layers]));
    }
    let num_experts = match f.usize_opt("num_experts")? {
        Some(n) => n,
        None => f.usize("num_local_experts")?,
    };
    let top_k = f.positive("num_experts_per_tok")?;
    if num_experts == 0 || top_k > num_experts {
        return Err(Error::Config(format!(
            "num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})"
        )));
    }
    let (expert_intermediate, norm_topk_prob, shared_expert, moe_layers) = match family {
        Family::Qwen3Moe | Family::Qwen2Moe => {
            let step = f.usize_opt("decoder_sparse_step")?.unwrap_or(1).max(1);
            let mlp_only = f.usize_list("mlp_only_layers")?;
            let layers = (0..num_layers)
                .map(|i| !mlp_only.contains(&i) && (i + 1) % step == 0)
                .collect();
            let shared = if family == Family::Qwen2Moe {
                Some(SharedExpertConfig {
                    intermediate: f.positive("shared_expert_intermediate_size")?,
                    gated: true,
                })
            } else {
                None
            };
            (
                f.positive("moe_intermediate_size")?,
                f.bool_or("norm_topk_prob", false)?,
                shared,
                layers,
            )
        }
        // Qwen3_5MoeTopKRouter always renormalises; every decoder layer is a sparse MoE block
        // with a sigmoid-gated shared expert.
        Family::Qwen35Moe => (
            f.positive("moe_intermediate_size")?,
            true,
            Some(SharedExpertConfig {
                intermediate: f.positive("shared_expert_intermediate_size")?,
                gated: true,
            }),
            vec![true; num_layers],
        ),
        // Mixtral always renormalises the top-k weights.
        Family::Mixtral => (
            f.positive("intermediate_size")?,
            true,
            None,
            vec![true; num_layers],
        ),
        Family::Olmoe => (
            f.positive("intermediate_size")?,
            f.bool_or("norm_topk_prob", false)?,
            None,
            vec![true; num_layers],
        ),
        _ => unreachable!("dense families return early"),
    };
    Ok((
        Some(MoeConfig {
            num_experts,
            top_k,
            expert_intermediate,
            norm_topk_prob,
            shared_expert,
        }),
        moe_layers,
    ))
}
