//! Gemma 4 configs (`Gemma4TextConfig` / `Gemma4Config` of transformers 5.24,
//! `configuration_gemma4.py`): the multimodal `gemma4` wrapper whose `text_config` holds the
//! language model, or a bare `gemma4_text`.
//!
//! What is particular to the family and resolved here, once:
//! - per-layer attention shapes: `sliding_attention` layers use `head_dim` and
//!   `num_key_value_heads`; `full_attention` layers are overridden by `per_layer_config` (what
//!   transformers 5.24 saves) or, in Hub configs, by `global_head_dim` (default 512) and, only when
//!   `attention_k_eq_v`, `num_global_key_value_heads` (`Gemma4TextConfig.__post_init__`);
//! - `layer_types` (default: every 6th layer full), the last layer forced to `full_attention` as
//!   the config class forces it;
//! - RoPE per layer type (`rope_parameters.{sliding_attention, full_attention}`): `default`, or
//!   `proportional`, whose rotated angles are the first `int(partial_rotary_factor * head_dim // 2)`
//!   of `head_dim / 2`, with exponents over the whole `head_dim`;
//! - KV sharing (`kv_sharing_modes`): each of the last `num_kv_shared_layers` layers attends over
//!   the K/V of the last earlier non-shared layer of its own type;
//! - the MoE block beside the dense MLP (`enable_moe_block`), per-layer input embeddings
//!   (`hidden_size_per_layer_input` > 0), final logit soft-capping.
//!
//! Options the modeling code does not run the way moerun would need (bidirectional attention,
//! other activations, other RoPE types, per-layer overrides of other fields) are refused by name.

use moerun_core::{Error, Result};
use serde_json::{Map, Value};

use super::raw::Fields;
use super::{
    AttentionBias, Family, FfnKind, LayerSpec, Mixer, ModelConfig, MoeConfig, QkNorm, RopeConfig,
    RopeScaling,
};

/// What a Gemma 4 model needs beyond [`ModelConfig`]'s common fields.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4Config {
    /// Per decoder layer: attention shape, K/V source, MLP width.
    pub layers: Vec<Gemma4Layer>,
    /// RoPE of the `sliding_attention` layers.
    pub sliding_rope: Gemma4Rope,
    /// RoPE of the `full_attention` layers.
    pub full_rope: Gemma4Rope,
    /// Tokens a sliding layer's query sees, itself included.
    pub sliding_window: usize,
    /// The last this many layers reuse an earlier layer's K/V.
    pub num_kv_shared_layers: usize,
    /// `logits = cap * tanh(logits / cap)` when set.
    pub final_logit_softcapping: Option<f32>,
    /// Per-layer input embeddings (PLE), when the model has them.
    pub per_layer_input: Option<PerLayerInputConfig>,
    /// The sparse MoE block runs beside the dense MLP in every layer.
    pub enable_moe_block: bool,
    /// Towers of a multimodal checkpoint (`vision`, `audio`) that moerun does not run.
    pub towers: Vec<&'static str>,
}

/// Per-layer input embeddings: a `[vocab_size_per_layer_input, layers * width]` table plus a
/// projection of the main embedding, fed to each layer through a gated `width`-wide bottleneck.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerLayerInputConfig {
    /// `hidden_size_per_layer_input`.
    pub width: usize,
    /// `vocab_size_per_layer_input`: rows of `embed_tokens_per_layer`.
    pub vocab: usize,
}

/// One decoder layer's attention and MLP shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemma4Layer {
    /// `sliding_attention` (else `full_attention`).
    pub sliding: bool,
    pub head_dim: usize,
    pub num_kv_heads: usize,
    /// The layer whose K/V this one attends over: itself, or for a KV-shared layer the last
    /// earlier non-shared layer of the same type.
    pub kv_source: usize,
    /// Keys and values come from one projection (`k_proj`; no `v_proj`): full layers when
    /// `attention_k_eq_v`.
    pub k_eq_v: bool,
    /// Intermediate size of the dense MLP (doubled on KV-shared layers with `use_double_wide_mlp`).
    pub mlp_intermediate: usize,
}

/// Rotary embedding of one layer type: pair `j` (dims `j` and `j + head_dim / 2`) rotates with
/// `inv_freq[j] = 1 / theta^(2j / head_dim) / factor` for `j < rotated_pairs`; the other pairs
/// have frequency 0 (transformers rotates them by angle 0, which leaves them as they are).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemma4Rope {
    pub theta: f32,
    pub head_dim: usize,
    pub rotated_pairs: usize,
    pub factor: f32,
    /// `proportional` (else `default`), for display.
    pub proportional: bool,
}

impl Gemma4Rope {
    /// The `head_dim / 2` inverse frequencies, computed in f32 as torch does.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f32;
        (0..self.head_dim / 2)
            .map(|j| {
                if j < self.rotated_pairs {
                    1.0 / self.theta.powf((2 * j) as f32 / d) / self.factor
                } else {
                    0.0
                }
            })
            .collect()
    }
}

impl Gemma4Layer {
    /// Whether this layer attends over another layer's K/V (and so keeps none of its own).
    pub fn shares_kv(&self, index: usize) -> bool {
        self.kv_source != index
    }
}

impl Gemma4Config {
    /// The RoPE of layer `l`'s type.
    pub fn rope(&self, l: usize) -> &Gemma4Rope {
        if self.layers[l].sliding {
            &self.sliding_rope
        } else {
            &self.full_rope
        }
    }

    /// K/V heads and width of layer `l`'s own cache, `None` when it reuses another layer's.
    pub fn kv_shape(&self, l: usize) -> Option<(usize, usize)> {
        let layer = &self.layers[l];
        (!layer.shares_kv(l)).then_some((layer.num_kv_heads, layer.head_dim))
    }
}

/// `Gemma4TextConfig`'s default `global_head_dim` (popped from kwargs with this default).
const DEFAULT_GLOBAL_HEAD_DIM: usize = 512;

/// Resolve a `gemma4` / `gemma4_text` config; `None` for any other `model_type`.
pub(super) fn resolve(value: &Value) -> Result<Option<ModelConfig>> {
    let outer = Fields(value);
    let (text, towers, tie) = match outer.str_opt("model_type") {
        Some("gemma4_text") => (value, Vec::new(), None),
        Some("gemma4") => {
            let text = value
                .get("text_config")
                .filter(|t| t.is_object())
                .ok_or_else(|| Error::Config("gemma4 needs a 'text_config' object".into()))?;
            match text.get("model_type").and_then(Value::as_str) {
                None | Some("gemma4_text") => {}
                Some(other) => {
                    return Err(Error::Unsupported(format!(
                        "text_config.model_type '{other}' inside gemma4 (expected gemma4_text)"
                    )))
                }
            }
            let towers = [("vision_config", "vision"), ("audio_config", "audio")]
                .into_iter()
                .filter(|(key, _)| outer.get(key).is_some())
                .map(|(_, name)| name)
                .collect();
            // Gemma4ForConditionalGeneration ties its lm_head by the wrapper's flag (default true).
            (
                text,
                towers,
                Some(outer.bool_or("tie_word_embeddings", true)?),
            )
        }
        _ => return Ok(None),
    };
    let f = Fields(text);
    if let Some(tie) = tie {
        if f.get("tie_word_embeddings").is_some() && f.bool_or("tie_word_embeddings", tie)? != tie {
            return Err(Error::Config(
                "'tie_word_embeddings' differs between gemma4 and its text_config".into(),
            ));
        }
    }
    refuse_options(&f)?;

    let hidden_size = f.positive("hidden_size")?;
    let num_heads = f.positive("num_attention_heads")?;
    let num_layers = f.positive("num_hidden_layers")?;
    let num_kv_heads = positive_or(&f, "num_key_value_heads", 4)?;
    let head_dim = positive_or(&f, "head_dim", 256)?;
    let max_position_embeddings = f.usize_opt("max_position_embeddings")?.unwrap_or(131_072);
    let sliding_types = layer_types(&f, num_layers)?;
    let window = positive_or(&f, "sliding_window", 512)?;
    let k_eq_v = f.bool_or("attention_k_eq_v", false)?;
    let shapes = attention_shapes(&f, &sliding_types, head_dim, num_kv_heads, k_eq_v)?;
    for &(_, kv) in &shapes {
        if num_heads % kv != 0 {
            return Err(Error::Config(format!(
                "num_attention_heads ({num_heads}) must be a multiple of every layer's key/value heads ({kv})"
            )));
        }
    }
    let sources = kv_sources(&f, &sliding_types)?;
    let intermediate = f.positive("intermediate_size")?;
    let double_wide = f.bool_or("use_double_wide_mlp", false)?;
    let layers: Vec<Gemma4Layer> = (0..num_layers)
        .map(|l| {
            let shared = sources[l] != l;
            Gemma4Layer {
                sliding: sliding_types[l],
                head_dim: shapes[l].0,
                num_kv_heads: shapes[l].1,
                kv_source: sources[l],
                k_eq_v: k_eq_v && !sliding_types[l],
                mlp_intermediate: intermediate * if double_wide && shared { 2 } else { 1 },
            }
        })
        .collect();
    for (l, layer) in layers.iter().enumerate() {
        let src = &layers[layer.kv_source];
        if (src.head_dim, src.num_kv_heads) != (layer.head_dim, layer.num_kv_heads) {
            return Err(Error::Unsupported(format!(
                "layer {l} shares the K/V of layer {} but their attention shapes differ",
                layer.kv_source
            )));
        }
    }
    let (sliding_rope, full_rope) = ropes(&f, &layers)?;

    let enable_moe_block = f.bool_or("enable_moe_block", false)?;
    let moe = if enable_moe_block {
        let num_experts = f.positive("num_experts")?;
        let top_k = f.positive("top_k_experts")?;
        if top_k > num_experts {
            return Err(Error::Config(format!(
                "top_k_experts ({top_k}) must not exceed num_experts ({num_experts})"
            )));
        }
        Some(MoeConfig {
            num_experts,
            top_k,
            expert_intermediate: f.positive("moe_intermediate_size")?,
            // Gemma4TextRouter always renormalises the top-k (then scales per expert).
            norm_topk_prob: true,
            shared_expert: None,
        })
    } else {
        None
    };
    let per_layer_input = match positive_or_zero(&f, "hidden_size_per_layer_input", 256)? {
        0 => None,
        width => Some(PerLayerInputConfig {
            width,
            vocab: positive_or(&f, "vocab_size_per_layer_input", 262_144)?,
        }),
    };
    let final_logit_softcapping = match f.get("final_logit_softcapping") {
        None => None,
        Some(v) => match v.as_f64() {
            Some(c) if c > 0.0 => Some(c as f32),
            _ => {
                return Err(Error::Config(format!(
                    "'final_logit_softcapping' must be a positive number or null, got {v}"
                )))
            }
        },
    };

    let bias = f.bool_or("attention_bias", false)?;
    let spec_layers = layers
        .iter()
        .map(|l| LayerSpec {
            mixer: Mixer::Attention,
            sliding_window: l.sliding.then_some(window),
            ffn: if enable_moe_block {
                FfnKind::Moe
            } else {
                FfnKind::Dense {
                    intermediate: l.mlp_intermediate,
                }
            },
        })
        .collect();
    Ok(Some(ModelConfig {
        family: Family::Gemma4,
        vocab_size: positive_or(&f, "vocab_size", 262_144)?,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
        // Gemma4RMSNorm multiplies by the stored weight (no `1 +`, unlike Gemma 3).
        rms_norm_unit_offset: false,
        rope: RopeConfig {
            theta: sliding_rope.theta,
            scaling: RopeScaling::Default,
            rotary_dim: head_dim,
        },
        attention_bias: AttentionBias { qkv: bias, o: bias },
        mlp_bias: false,
        qk_norm: QkNorm::PerHead,
        clip_qkv: None,
        attention_output_gate: false,
        linear_attention: None,
        // The towers are reported by `Gemma4Config::towers` (their tensors have other names).
        has_vision_tower: false,
        tie_word_embeddings: match tie {
            Some(t) => t,
            None => f.bool_or("tie_word_embeddings", true)?,
        },
        max_position_embeddings,
        layers: spec_layers,
        moe,
        bos_token_id: special_ids(&f, &outer, "bos_token_id", 2).first().copied(),
        eos_token_ids: special_ids(&f, &outer, "eos_token_id", 1),
        gemma4: Some(Gemma4Config {
            layers,
            sliding_rope,
            full_rope,
            sliding_window: window,
            num_kv_shared_layers: f.usize_opt("num_kv_shared_layers")?.unwrap_or(0),
            final_logit_softcapping,
            per_layer_input,
            enable_moe_block,
            towers,
        }),
    }))
}

fn positive_or(f: &Fields, key: &str, default: usize) -> Result<usize> {
    match f.usize_opt(key)?.unwrap_or(default) {
        0 => Err(Error::Config(format!("'{key}' must be positive"))),
        n => Ok(n),
    }
}

fn positive_or_zero(f: &Fields, key: &str, default: usize) -> Result<usize> {
    Ok(f.usize_opt(key)?.unwrap_or(default))
}

/// Special token ids with `Gemma4TextConfig`'s defaults when the key is absent everywhere
/// (an explicit `null` means none).
fn special_ids(f: &Fields, outer: &Fields, key: &str, default: u32) -> Vec<u32> {
    if f.0.get(key).is_some() {
        return f.token_ids(key);
    }
    if !std::ptr::eq(f.0, outer.0) && outer.0.get(key).is_some() {
        return outer.token_ids(key);
    }
    vec![default]
}

/// Options whose transformers behaviour moerun does not implement.
fn refuse_options(f: &Fields) -> Result<()> {
    let act = f
        .str_opt("hidden_activation")
        .unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(Error::Unsupported(format!(
            "hidden_activation '{act}' in gemma4 (only 'gelu_pytorch_tanh' is implemented)"
        )));
    }
    match f.get("use_bidirectional_attention") {
        None => {}
        Some(Value::String(s)) if s == "vision" => {}
        Some(v) => {
            return Err(Error::Unsupported(format!(
                "use_bidirectional_attention {v} in gemma4 (text attention must be causal; \
                 only null and \"vision\" keep it so)"
            )))
        }
    }
    Ok(())
}

/// Per layer, whether it slides: `layer_types`, else every 6th layer full; the last layer is
/// always full (`Gemma4TextConfig.__post_init__` forces it, with a warning).
fn layer_types(f: &Fields, num_layers: usize) -> Result<Vec<bool>> {
    let mut sliding: Vec<bool> = match f.get("layer_types") {
        None => (0..num_layers).map(|i| (i + 1) % 6 != 0).collect(),
        Some(Value::Array(items)) => {
            if items.len() != num_layers {
                return Err(Error::Config(format!(
                    "'layer_types' has {} entries for {num_layers} layers",
                    items.len()
                )));
            }
            items
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(Error::Unsupported(format!(
                        "layer type {t} in gemma4 (supported: sliding_attention, full_attention)"
                    ))),
                })
                .collect::<Result<_>>()?
        }
        Some(v) => {
            return Err(Error::Config(format!(
                "'layer_types' must be a list, got {v}"
            )))
        }
    };
    if let Some(last) = sliding.last_mut() {
        *last = false;
    }
    Ok(sliding)
}

/// `(head_dim, num_key_value_heads)` of every layer.
fn attention_shapes(
    f: &Fields,
    sliding: &[bool],
    head_dim: usize,
    num_kv_heads: usize,
    k_eq_v: bool,
) -> Result<Vec<(usize, usize)>> {
    let mut shapes = vec![(head_dim, num_kv_heads); sliding.len()];
    match f.0.get("per_layer_config") {
        // What transformers 5.24 saves: sparse overrides by layer index (zero-padded strings).
        Some(Value::Object(overrides)) => {
            for (key, layer) in overrides {
                let l = key
                    .parse::<usize>()
                    .ok()
                    .filter(|&l| l < sliding.len())
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "per_layer_config key '{key}' is not a layer index below {}",
                            sliding.len()
                        ))
                    })?;
                apply_overrides(key, layer, &mut shapes[l])?;
            }
        }
        // An explicit null: no overrides at all.
        Some(Value::Null) => {}
        Some(v) => {
            return Err(Error::Config(format!(
                "'per_layer_config' must be an object, got {v}"
            )))
        }
        // Hub configs: full layers take global_head_dim, and num_global_key_value_heads only
        // when attention_k_eq_v.
        None => {
            let global_dim = positive_or(f, "global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)?;
            let global_kv = if k_eq_v {
                f.usize_opt("num_global_key_value_heads")?
            } else {
                None
            };
            for (shape, &slides) in shapes.iter_mut().zip(sliding) {
                if !slides {
                    shape.0 = global_dim;
                    if let Some(kv) = global_kv {
                        shape.1 = kv;
                    }
                }
            }
        }
    }
    if shapes
        .iter()
        .any(|&(d, kv)| d == 0 || kv == 0 || d % 2 != 0)
    {
        return Err(Error::Config(
            "every layer needs an even head_dim and at least one key/value head".into(),
        ));
    }
    Ok(shapes)
}

/// One `per_layer_config` entry: only the fields Gemma 4's attention reads per layer.
fn apply_overrides(key: &str, layer: &Value, shape: &mut (usize, usize)) -> Result<()> {
    let Value::Object(fields) = layer else {
        return Err(Error::Config(format!(
            "per_layer_config.{key} must be an object, got {layer}"
        )));
    };
    for (name, v) in fields {
        let n = v.as_u64().map(|n| n as usize).ok_or_else(|| {
            Error::Config(format!(
                "per_layer_config.{key}.{name} must be an integer, got {v}"
            ))
        })?;
        match name.as_str() {
            "head_dim" => shape.0 = n,
            "num_key_value_heads" => shape.1 = n,
            _ => {
                return Err(Error::Unsupported(format!(
                    "per_layer_config.{key}.{name} in gemma4 (only head_dim and \
                     num_key_value_heads may vary by layer)"
                )))
            }
        }
    }
    Ok(())
}

/// Per layer, the layer whose K/V it attends over (`Gemma4TextConfig.kv_sharing_modes`).
fn kv_sources(f: &Fields, sliding: &[bool]) -> Result<Vec<usize>> {
    let n = sliding.len();
    let shared = f.usize_opt("num_kv_shared_layers")?.unwrap_or(0);
    if shared >= n && shared > 0 {
        return Err(Error::Unsupported(format!(
            "num_kv_shared_layers {shared} of {n} layers: no layer would produce the K/V to share"
        )));
    }
    let first_shared = n - shared;
    (0..n)
        .map(|l| {
            if l < first_shared {
                return Ok(l);
            }
            (0..first_shared)
                .rev()
                .find(|&p| sliding[p] == sliding[l])
                .ok_or_else(|| {
                    Error::Config(format!(
                        "layer {l} shares K/V but no earlier unshared layer has its type \
                         (num_kv_shared_layers {shared})"
                    ))
                })
        })
        .collect()
}

/// The RoPE of each layer type, from `rope_parameters` (nested by layer type) or the config
/// class's defaults: sliding `default` θ 1e4, full `proportional` 0.25 θ 1e6.
fn ropes(f: &Fields, layers: &[Gemma4Layer]) -> Result<(Gemma4Rope, Gemma4Rope)> {
    let defaults = serde_json::json!({
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0},
    });
    let params = match f.get("rope_parameters") {
        None => defaults.as_object().expect("literal object"),
        Some(Value::Object(p)) => p,
        Some(v) => {
            return Err(Error::Config(format!(
                "'rope_parameters' must be an object, got {v}"
            )))
        }
    };
    let one = |name: &str, sliding: bool| -> Result<Gemma4Rope> {
        // rope inv_freq depends on the head dim of the type: all its layers must agree.
        let dims: Vec<usize> = layers
            .iter()
            .filter(|l| l.sliding == sliding)
            .map(|l| l.head_dim)
            .collect();
        let head_dim = dims.first().copied().unwrap_or(0);
        if dims.iter().any(|&d| d != head_dim) {
            return Err(Error::Unsupported(format!(
                "{name} layers with different head dims (their RoPE is one per layer type)"
            )));
        }
        match params.get(name) {
            Some(Value::Object(p)) => rope(name, p, head_dim),
            // A type no layer has needs no RoPE.
            None if dims.is_empty() => Ok(Gemma4Rope {
                theta: 10_000.0,
                head_dim: 0,
                rotated_pairs: 0,
                factor: 1.0,
                proportional: false,
            }),
            _ => Err(Error::Config(format!(
                "rope_parameters.{name} must be an object (gemma4 has RoPE per layer type)"
            ))),
        }
    };
    Ok((
        one("sliding_attention", true)?,
        one("full_attention", false)?,
    ))
}

fn rope(name: &str, p: &Map<String, Value>, head_dim: usize) -> Result<Gemma4Rope> {
    let num = |key: &str| -> Result<Option<f64>> {
        p.get(key)
            .filter(|v| !v.is_null())
            .map(|v| {
                v.as_f64().ok_or_else(|| {
                    Error::Config(format!("rope_parameters.{name}.{key} must be a number"))
                })
            })
            .transpose()
    };
    for key in p.keys() {
        if !matches!(
            key.as_str(),
            "rope_type" | "rope_theta" | "partial_rotary_factor" | "factor"
        ) {
            return Err(Error::Unsupported(format!(
                "rope_parameters.{name}.{key} in gemma4"
            )));
        }
    }
    let theta = num("rope_theta")?
        .ok_or_else(|| Error::Config(format!("rope_parameters.{name} needs 'rope_theta'")))?
        as f32;
    let kind = p
        .get("rope_type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::Config(format!("rope_parameters.{name} needs 'rope_type'")))?;
    match kind {
        // Gemma4TextRotaryEmbedding.compute_default_rope_parameters: every pair rotates; it reads
        // neither partial_rotary_factor nor factor.
        "default" => Ok(Gemma4Rope {
            theta,
            head_dim,
            rotated_pairs: head_dim / 2,
            factor: 1.0,
            proportional: false,
        }),
        // _compute_proportional_rope_parameters: int(partial * head_dim // 2) rotated pairs.
        "proportional" => {
            let partial = num("partial_rotary_factor")?.unwrap_or(1.0);
            let pairs = (partial * head_dim as f64 / 2.0).floor();
            if !(0.0..=(head_dim / 2) as f64).contains(&pairs) {
                return Err(Error::Config(format!(
                    "rope_parameters.{name}.partial_rotary_factor {partial} is out of range"
                )));
            }
            Ok(Gemma4Rope {
                theta,
                head_dim,
                rotated_pairs: pairs as usize,
                factor: num("factor")?.unwrap_or(1.0) as f32,
                proportional: true,
            })
        }
        other => Err(Error::Unsupported(format!(
            "rope type '{other}' for {name} in gemma4 (supported: default, proportional)"
        ))),
    }
}

#[cfg(test)]
mod tests;
