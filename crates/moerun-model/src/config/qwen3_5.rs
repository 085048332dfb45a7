//! What is particular to Qwen3.5-MoE configs (`Qwen3_5MoeConfig` / `Qwen3_5MoeTextConfig` of
//! transformers 5.24): the multimodal wrapper whose `text_config` holds the language model, the
//! per-layer choice between Gated DeltaNet and full attention (`layer_types`, else every
//! `full_attention_interval`-th layer is full), the `linear_*` shape fields with the config
//! class's defaults, and the options this family's modeling code does not have, refused by name
//! rather than silently ignored as transformers would.

use moerun_core::{Error, Result};
use serde_json::Value;

use super::raw::Fields;
use super::{LinearAttentionConfig, Mixer};

/// A `qwen3_5_moe` config: the text model's fields, and what only the wrapper says.
#[derive(Clone, Copy)]
pub(super) struct Wrapper<'a> {
    pub text: &'a Value,
    /// `text_config.model_type`, `qwen3_5_moe_text` when absent.
    pub text_model_type: &'a str,
    pub has_vision_tower: bool,
    /// `Qwen3_5MoeForConditionalGeneration` ties its `lm_head` by the wrapper's flag.
    pub tie_word_embeddings: bool,
}

/// The text part of a multimodal `qwen3_5_moe` config, or `None` for any other `model_type`.
pub(super) fn text_config<'a>(value: &'a Value, model_type: &str) -> Result<Option<Wrapper<'a>>> {
    if model_type != "qwen3_5_moe" {
        return Ok(None);
    }
    let text = value
        .get("text_config")
        .filter(|t| t.is_object())
        .ok_or_else(|| Error::Config("qwen3_5_moe needs a 'text_config' object".into()))?;
    let text_model_type = text
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("qwen3_5_moe_text");
    if text_model_type != "qwen3_5_moe_text" {
        return Err(Error::Unsupported(format!(
            "text_config.model_type '{text_model_type}' inside qwen3_5_moe (expected qwen3_5_moe_text)"
        )));
    }
    let outer = Fields(value);
    let inner = Fields(text);
    let tie = outer.bool_or("tie_word_embeddings", false)?;
    if inner.get("tie_word_embeddings").is_some()
        && inner.bool_or("tie_word_embeddings", tie)? != tie
    {
        return Err(Error::Config(
            "'tie_word_embeddings' differs between qwen3_5_moe and its text_config".into(),
        ));
    }
    Ok(Some(Wrapper {
        text,
        text_model_type,
        has_vision_tower: outer.get("vision_config").is_some(),
        tie_word_embeddings: tie,
    }))
}

/// Options that other Qwen MoE configs have but `Qwen3_5MoeTextConfig` does not: transformers
/// would ignore them (and load a checkpoint that does not match them); moerun says so instead.
pub(super) fn check_refused_options(f: &Fields) -> Result<()> {
    if !f.bool_or("attn_output_gate", true)? {
        return Err(Error::Unsupported(
            "attn_output_gate false in qwen3_5_moe (transformers always gates the attention output)"
                .into(),
        ));
    }
    let mlp_only = f.usize_list("mlp_only_layers")?;
    if !mlp_only.is_empty() {
        return Err(Error::Unsupported(format!(
            "mlp_only_layers {mlp_only:?} in qwen3_5_moe (every layer of transformers' Qwen3.5-MoE is MoE)"
        )));
    }
    if f.usize_opt("decoder_sparse_step")?.is_some_and(|s| s != 1) {
        return Err(Error::Unsupported(
            "decoder_sparse_step other than 1 in qwen3_5_moe (every layer is MoE)".into(),
        ));
    }
    if !f.bool_or("norm_topk_prob", true)? {
        return Err(Error::Unsupported(
            "norm_topk_prob false in qwen3_5_moe (its router always renormalises the top-k)".into(),
        ));
    }
    if f.get("sliding_window").is_some() || f.bool_or("use_sliding_window", false)? {
        return Err(Error::Unsupported(
            "sliding_window in qwen3_5_moe (its attention has no window)".into(),
        ));
    }
    Ok(())
}

/// Each layer's mixer: `layer_types` when given, else `Qwen3_5MoeTextConfig.__post_init__`'s
/// rule, full attention on every `full_attention_interval`-th layer (default 4), linear elsewhere.
pub(super) fn mixers(f: &Fields, num_layers: usize) -> Result<Vec<Mixer>> {
    let Some(types) = f.get("layer_types") else {
        let interval = f.usize_opt("full_attention_interval")?.unwrap_or(4);
        if interval == 0 {
            return Err(Error::Config(
                "'full_attention_interval' must be positive".into(),
            ));
        }
        return Ok((0..num_layers)
            .map(|i| {
                if (i + 1) % interval == 0 {
                    Mixer::Attention
                } else {
                    Mixer::GatedDeltaNet
                }
            })
            .collect());
    };
    let Value::Array(items) = types else {
        return Err(Error::Config(format!(
            "'layer_types' must be a list, got {types}"
        )));
    };
    if items.len() != num_layers {
        return Err(Error::Config(format!(
            "'layer_types' has {} entries for {num_layers} layers",
            items.len()
        )));
    }
    items
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(Mixer::Attention),
            Some("linear_attention") => Ok(Mixer::GatedDeltaNet),
            _ => Err(Error::Unsupported(format!(
                "layer type {t} in qwen3_5_moe (supported: full_attention, linear_attention)"
            ))),
        })
        .collect()
}

/// The Gated DeltaNet shape, with `Qwen3_5MoeTextConfig`'s defaults (16 key heads, 32 value
/// heads, 128-wide heads, conv kernel 4).
pub(super) fn linear_attention(f: &Fields) -> Result<LinearAttentionConfig> {
    let field = |key: &str, default: usize| -> Result<usize> {
        match f.usize_opt(key)?.unwrap_or(default) {
            0 => Err(Error::Config(format!("'{key}' must be positive"))),
            n => Ok(n),
        }
    };
    let la = LinearAttentionConfig {
        num_key_heads: field("linear_num_key_heads", 16)?,
        num_value_heads: field("linear_num_value_heads", 32)?,
        key_head_dim: field("linear_key_head_dim", 128)?,
        value_head_dim: field("linear_value_head_dim", 128)?,
        conv_kernel: field("linear_conv_kernel_dim", 4)?,
    };
    if !la.num_value_heads.is_multiple_of(la.num_key_heads) {
        return Err(Error::Config(format!(
            "linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
            la.num_value_heads, la.num_key_heads
        )));
    }
    Ok(la)
}
