//! A Hugging Face `generation_config.json`, typed: the special token ids `generate` stops and
//! pads with, and the sampling defaults the model's authors recommend.
//!
//! What it promises: every field is optional; a missing file, a missing field and a `null` all
//! mean "not set" (see [`GenerationConfig::sampling_params`] for what that becomes); a field of
//! the wrong type or out of range is refused with its name. Fields the engine does not implement
//! (`num_beams`, `typical_p`, ...) are ignored: they are options of other decoding strategies,
//! not defaults of this one.

use std::path::Path;

use serde_json::Value;

use crate::sampling::SamplingParams;

/// The file name inside a checkpoint directory.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// The fields of `generation_config.json` the engine uses; `None` where the file is silent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`, a single id or a list (chat models often end turns with several).
    pub eos_token_ids: Vec<u32>,
    /// `pad_token_id`.
    pub pad_token_id: Option<u32>,
    /// `do_sample`; absent means false, as in transformers: greedy decoding.
    pub do_sample: bool,
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_k` (0 disables it).
    pub top_k: Option<i32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
    /// `max_new_tokens`: generated tokens, not counting the prompt.
    pub max_new_tokens: Option<usize>,
    /// `max_length`: prompt plus generated tokens.
    pub max_length: Option<usize>,
}

impl GenerationConfig {
    /// Read `dir/generation_config.json`; a directory without one gives the defaults.
    pub fn load(dir: &Path) -> moerun_core::Result<Self> {
        let path = dir.join(GENERATION_CONFIG_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(moerun_core::Error::io(path, e)),
        };
        let bad = |reason: String| moerun_core::Error::BadFile {
            path: path.clone(),
            reason,
        };
        let json: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        Self::from_json(&json).map_err(bad)
    }

    /// Type the parsed JSON. The error names the offending field.
    pub fn from_json(json: &Value) -> Result<Self, String> {
        let Some(object) = json.as_object() else {
            return Err(format!("expected a JSON object, got {json}"));
        };
        // `null` is how Python writes "unset"; treat it as absent.
        let field = |name: &str| object.get(name).filter(|v| !v.is_null());
        let token_id = |name: &str| field(name).map(|v| as_u32(name, v)).transpose();
        let float = |name: &str| field(name).map(|v| as_f32(name, v)).transpose();
        let count = |name: &str| {
            field(name)
                .map(|v| as_u32(name, v).map(|n| n as usize))
                .transpose()
        };

        let eos_token_ids = match field("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|v| as_u32("eos_token_id", v))
                .collect::<Result<_, _>>()?,
            Some(v) => vec![as_u32("eos_token_id", v)?],
        };
        let do_sample = match field("do_sample") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| format!("do_sample must be true or false, got {v}"))?,
        };
        let top_k = match field("top_k") {
            None => None,
            // A top_k beyond any vocabulary keeps everything, like 0.
            Some(v) => Some(i32::try_from(as_u32("top_k", v)?).unwrap_or(0)),
        };

        let config = GenerationConfig {
            bos_token_id: token_id("bos_token_id")?,
            eos_token_ids,
            pad_token_id: token_id("pad_token_id")?,
            do_sample,
            temperature: float("temperature")?,
            top_k,
            top_p: float("top_p")?,
            min_p: float("min_p")?,
            repetition_penalty: float("repetition_penalty")?,
            max_new_tokens: count("max_new_tokens")?,
            max_length: count("max_length")?,
        };
        // Range checks are SamplingParams' (one place decides what is valid), but as if sampling
        // were on, so that a bad temperature is caught even in a greedy config.
        config.sampling_params_when_sampling().validate()?;
        Ok(config)
    }

    /// The model's default sampling parameters. With `do_sample` false (or absent) that is
    /// greedy decoding, keeping the repetition penalty, as transformers' `generate` does. With
    /// `do_sample` true, the fields the file sets; fields it omits keep [`SamplingParams`]'
    /// defaults (temperature 1, no top-k, top-p 1, min-p 0) rather than transformers' implicit
    /// `top_k = 50`: like vLLM, only what the authors wrote down is taken as their advice.
    pub fn sampling_params(&self) -> SamplingParams {
        if self.do_sample {
            self.sampling_params_when_sampling()
        } else {
            SamplingParams {
                repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
                ..SamplingParams::greedy()
            }
        }
    }

    /// The ids that end generation: this file's `eos_token_id`, else `config.json`'s, else the
    /// tokenizer's EOS token. One rule for every front end, so the CLI and the server stop alike.
    pub fn resolve_eos_token_ids(
        &self,
        config_ids: &[u32],
        tokenizer_eos: Option<u32>,
    ) -> Vec<u32> {
        if !self.eos_token_ids.is_empty() {
            self.eos_token_ids.clone()
        } else if !config_ids.is_empty() {
            config_ids.to_vec()
        } else {
            tokenizer_eos.into_iter().collect()
        }
    }

    /// How many tokens to generate after a prompt of `prompt_len` tokens: `max_new_tokens`
    /// if set (it wins over `max_length`, as in transformers), else what `max_length` leaves,
    /// else `None` (no limit from the model; the caller's own limit applies).
    pub fn max_new_tokens_after(&self, prompt_len: usize) -> Option<usize> {
        self.max_new_tokens
            .or_else(|| self.max_length.map(|n| n.saturating_sub(prompt_len)))
    }

    fn sampling_params_when_sampling(&self) -> SamplingParams {
        let d = SamplingParams::default();
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            ..d
        }
    }
}

fn as_u32(name: &str, v: &Value) -> Result<u32, String> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| format!("{name} must be a non-negative integer, got {v}"))
}

fn as_f32(name: &str, v: &Value) -> Result<f32, String> {
    v.as_f64()
        .map(|x| x as f32)
        .ok_or_else(|| format!("{name} must be a number, got {v}"))
}
