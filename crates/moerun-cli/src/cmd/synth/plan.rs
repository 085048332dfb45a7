//! What a synthetic checkpoint holds: the rewritten `config.json` (layers cut, dtype set) and the
//! list of tensors with the exact names and shapes `moerun_model::weights` loads, in the order Hub
//! checkpoints lay them out (embedding, then layer by layer, then the final norm and lm_head).
//! Multimodal configs (`qwen3_5_moe`) get their language model only, under
//! `model.language_model.` as the Hub checkpoints name it.

use moerun_core::DType;
use moerun_model::config::{Family, FfnKind, LinearAttentionConfig, Mixer, ModelConfig, QkNorm};
use serde_json::Value;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform in `[-a, a]`.
    Uniform(f32),
    /// Every element 1.0 (RMSNorm weights: the identity scale, as freshly initialised models have).
    Ones,
    /// Every element 0.0 (zero-centred RMSNorm weights, applied as `1 + w`: the identity scale).
    Zeros,
}

/// Standard deviation of weight matrices: transformers' usual `initializer_range`, which keeps
/// activations of a random model in a sane range (logits of order 1).
const MATRIX_STD: f32 = 0.02;
/// Biases are small next to the products they are added to.
const BIAS_STD: f32 = 0.01;

/// Uniform bound giving standard deviation `std` (a uniform on `[-a, a]` has std `a / √3`).
fn uniform(std: f32) -> Init {
    Init::Uniform(std * 3f32.sqrt())
}

/// One tensor to write.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// Progress label of the part of the model it belongs to (`layer 3`, `embeddings`...).
    pub group: String,
}

impl Planned {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Builds the list, tagging each tensor with the current group.
struct Plan {
    out: Vec<Planned>,
    group: String,
    /// The identity init of an RMSNorm weight in this family.
    norm_init: Init,
}

impl Plan {
    fn push(&mut self, name: String, shape: Vec<usize>, init: Init) {
        self.out.push(Planned {
            name,
            shape,
            init,
            group: self.group.clone(),
        });
    }

    fn matrix(&mut self, name: String, rows: usize, cols: usize) {
        self.push(name, vec![rows, cols], uniform(MATRIX_STD));
    }

    fn norm(&mut self, name: String, len: usize) {
        self.push(name, vec![len], self.norm_init);
    }

    /// `{prefix}.weight` `[out, inp]`, and `{prefix}.bias` `[out]` when `bias`.
    fn linear(&mut self, prefix: &str, out: usize, inp: usize, bias: bool) {
        self.matrix(format!("{prefix}.weight"), out, inp);
        if bias {
            self.push(format!("{prefix}.bias"), vec![out], uniform(BIAS_STD));
        }
    }

    /// A SwiGLU MLP under `prefix`.
    fn mlp(&mut self, prefix: &str, hidden: usize, inter: usize, bias: bool) {
        self.linear(&format!("{prefix}.gate_proj"), inter, hidden, bias);
        self.linear(&format!("{prefix}.up_proj"), inter, hidden, bias);
        self.linear(&format!("{prefix}.down_proj"), hidden, inter, bias);
    }
}

mod gemma4;

/// Every tensor of a checkpoint of `cfg`, named as the family's Hub checkpoints name them.
pub fn tensors(cfg: &ModelConfig) -> Vec<Planned> {
    if let Some(g) = &cfg.gemma4 {
        return gemma4::tensors(cfg, g);
    }
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut p = Plan {
        out: Vec::new(),
        group: "embeddings".into(),
        norm_init: if cfg.rms_norm_unit_offset {
            Init::Zeros
        } else {
            Init::Ones
        },
    };
    let base = if cfg.has_vision_tower {
        "model.language_model"
    } else {
        "model"
    };
    p.matrix(format!("{base}.embed_tokens.weight"), v, h);
    let n = cfg.num_layers();
    for (l, spec) in cfg.layers.iter().enumerate() {
        p.group = format!("layer {}/{n}", l + 1);
        let pre = format!("{base}.layers.{l}");
        p.norm(format!("{pre}.input_layernorm.weight"), h);
        match (spec.mixer, &cfg.linear_attention) {
            (Mixer::GatedDeltaNet, Some(la)) => gated_deltanet(&mut p, la, h, &pre),
            _ => attention(&mut p, cfg, &pre),
        }
        p.norm(format!("{pre}.post_attention_layernorm.weight"), h);
        match spec.ffn {
            FfnKind::Dense { intermediate } => {
                p.mlp(&format!("{pre}.mlp"), h, intermediate, cfg.mlp_bias)
            }
            FfnKind::Moe => moe(&mut p, cfg, &pre),
        }
    }
    p.group = "final norm and lm_head".into();
    p.norm(format!("{base}.norm.weight"), h);
    if !cfg.tie_word_embeddings {
        p.matrix("lm_head.weight".into(), v, h);
    }
    p.out
}

/// Self-attention of layer prefix `pre` (q_proj doubled when it also yields an output gate).
fn attention(p: &mut Plan, cfg: &ModelConfig, pre: &str) {
    let h = cfg.hidden_size;
    let a = format!("{pre}.self_attn");
    let bias = cfg.attention_bias;
    let q_out = cfg.q_dim() * if cfg.attention_output_gate { 2 } else { 1 };
    p.linear(&format!("{a}.q_proj"), q_out, h, bias.qkv);
    p.linear(&format!("{a}.k_proj"), cfg.kv_dim(), h, bias.qkv);
    p.linear(&format!("{a}.v_proj"), cfg.kv_dim(), h, bias.qkv);
    p.linear(&format!("{a}.o_proj"), h, cfg.q_dim(), bias.o);
    match cfg.qk_norm {
        QkNorm::None => {}
        QkNorm::PerHead => {
            p.norm(format!("{a}.q_norm.weight"), cfg.head_dim);
            p.norm(format!("{a}.k_norm.weight"), cfg.head_dim);
        }
        QkNorm::WholeProjection => {
            p.norm(format!("{a}.q_norm.weight"), cfg.q_dim());
            p.norm(format!("{a}.k_norm.weight"), cfg.kv_dim());
        }
    }
}

/// Qwen3.5's Gated DeltaNet of layer prefix `pre`. `A_log` and `dt_bias` are drawn like biases
/// (small, so decays stay near `e^-0.7` per token); the gated norm's weight is plain (ones).
fn gated_deltanet(p: &mut Plan, la: &LinearAttentionConfig, h: usize, pre: &str) {
    let a = format!("{pre}.linear_attn");
    let heads = la.num_value_heads;
    p.matrix(format!("{a}.in_proj_qkv.weight"), la.conv_dim(), h);
    p.matrix(format!("{a}.in_proj_z.weight"), la.value_dim(), h);
    p.matrix(format!("{a}.in_proj_b.weight"), heads, h);
    p.matrix(format!("{a}.in_proj_a.weight"), heads, h);
    p.push(
        format!("{a}.conv1d.weight"),
        vec![la.conv_dim(), 1, la.conv_kernel],
        uniform(MATRIX_STD),
    );
    p.push(format!("{a}.A_log"), vec![heads], uniform(BIAS_STD));
    p.push(format!("{a}.dt_bias"), vec![heads], uniform(BIAS_STD));
    p.push(
        format!("{a}.norm.weight"),
        vec![la.value_head_dim],
        Init::Ones,
    );
    p.matrix(format!("{a}.out_proj.weight"), h, la.value_dim());
}

/// The MoE block of layer prefix `pre`: per-expert tensors, as the Hub checkpoints store them
/// (Mixtral's under `block_sparse_moe` with `w1`/`w3`/`w2`, the others under `mlp`).
fn moe(p: &mut Plan, cfg: &ModelConfig, pre: &str) {
    let Some(moe) = &cfg.moe else { return };
    let (h, i) = (cfg.hidden_size, moe.expert_intermediate);
    let (block, [gate, up, down]) = if cfg.family == Family::Mixtral {
        (format!("{pre}.block_sparse_moe"), ["w1", "w3", "w2"])
    } else {
        (format!("{pre}.mlp"), ["gate_proj", "up_proj", "down_proj"])
    };
    p.matrix(format!("{block}.gate.weight"), moe.num_experts, h);
    for e in 0..moe.num_experts {
        let ep = format!("{block}.experts.{e}");
        p.matrix(format!("{ep}.{gate}.weight"), i, h);
        p.matrix(format!("{ep}.{up}.weight"), i, h);
        p.matrix(format!("{ep}.{down}.weight"), h, i);
    }
    if let Some(shared) = &moe.shared_expert {
        p.mlp(
            &format!("{block}.shared_expert"),
            h,
            shared.intermediate,
            false,
        );
        if shared.gated {
            p.matrix(format!("{block}.shared_expert_gate.weight"), 1, h);
        }
    }
}

/// `num_hidden_layers` of a raw config (before resolution), if present; a multimodal config's is
/// in its `text_config`.
pub fn raw_num_layers(config: &Value) -> Option<usize> {
    config
        .get("text_config")
        .unwrap_or(config)
        .get("num_hidden_layers")?
        .as_u64()
        .map(|n| n as usize)
}

/// The config to write: `layers` kept (per-layer lists cut to match, in `text_config` for a
/// multimodal config) and the dtype recorded, under the key the source uses (`dtype` in
/// transformers 5 configs, else `torch_dtype`).
pub fn rewrite_config(config: &Value, layers: usize, dtype: DType) -> Value {
    let mut out = config.clone();
    let Some(obj) = out.as_object_mut() else {
        return out;
    };
    let text = match obj.get_mut("text_config") {
        Some(Value::Object(text)) => text,
        _ => &mut *obj,
    };
    text.insert("num_hidden_layers".into(), layers.into());
    // Layer indices beyond the cut no longer exist; keep those that do.
    if let Some(Value::Array(list)) = text.get_mut("mlp_only_layers") {
        list.retain(|v| v.as_u64().is_some_and(|i| (i as usize) < layers));
    }
    // One entry per layer: keep the first `layers`.
    if let Some(Value::Array(list)) = text.get_mut("layer_types") {
        list.truncate(layers);
    }
    // Gemma 4's per-layer overrides, keyed by layer index.
    if let Some(Value::Object(map)) = text.get_mut("per_layer_config") {
        map.retain(|k, _| k.parse::<usize>().is_ok_and(|i| i < layers));
    }
    let torch_name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F32 => "float32",
    };
    let key = if obj.contains_key("dtype") {
        "dtype"
    } else {
        "torch_dtype"
    };
    obj.insert(key.into(), torch_name.into());
    out
}

/// `generation_config.json` as transformers derives it from a model config: the special tokens.
pub fn generation_config(config: &Value) -> Value {
    let mut out = serde_json::Map::new();
    out.insert("_from_model_config".into(), true.into());
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = config.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use moerun_model::stats::ParamStats;

    fn config(name: &str) -> ModelConfig {
        let known = super::super::known::find(name).expect("known");
        ModelConfig::from_json_str(known.json).expect("supported")
    }

    #[test]
    fn planned_parameters_match_the_stats() {
        for name in [
            "qwen3-30b-a3b",
            "qwen2-57b-a14b",
            "mixtral-8x7b",
            "olmoe-1b-7b-0924",
            "smollm2-135m-instruct",
            "qwen3.5-35b-a3b",
        ] {
            let cfg = config(name);
            let planned: u64 = tensors(&cfg).iter().map(|t| t.numel() as u64).sum();
            assert_eq!(planned, ParamStats::from_config(&cfg).total, "{name}");
        }
    }

    #[test]
    fn mixtral_uses_its_hub_names() {
        let names: Vec<String> = tensors(&config("mixtral-8x7b"))
            .into_iter()
            .map(|t| t.name)
            .collect();
        assert!(names.contains(&"model.layers.0.block_sparse_moe.experts.7.w2.weight".to_string()));
        assert!(names.contains(&"model.layers.31.block_sparse_moe.gate.weight".to_string()));
    }

    #[test]
    fn rewrite_cuts_per_layer_lists() {
        let raw = serde_json::json!({
            "num_hidden_layers": 4,
            "mlp_only_layers": [1, 3],
            "layer_types": ["a", "b", "c", "d"],
            "dtype": "float32",
        });
        let out = rewrite_config(&raw, 2, DType::BF16);
        assert_eq!(out["num_hidden_layers"], 2);
        assert_eq!(out["mlp_only_layers"], serde_json::json!([1]));
        assert_eq!(out["layer_types"], serde_json::json!(["a", "b"]));
        assert_eq!(out["dtype"], "bfloat16");
        assert!(out.get("torch_dtype").is_none());
    }
}
