//! The model a server serves: weights, tokenizer, chat template, generation defaults and stop
//! tokens, loaded once and shared read-only by the HTTP handlers (prompt encoding) and the engine
//! thread (forward pass, detokenization).

use std::path::{Path, PathBuf};

use moerun_core::Device;
use moerun_engine::generation_config::GenerationConfig;
use moerun_engine::sampling::SamplingParams;
use moerun_model::Model;
use moerun_text::{ChatArgs, ChatTemplate, TemplateValue, TextError, Tokenizer};
use serde_json::Value;

use crate::api::request::{Prompt, SamplingOverrides};
use crate::error::ApiError;

/// A loaded checkpoint ready to serve.
pub struct ServedModel {
    /// The name clients put in `model`.
    pub name: String,
    pub dir: PathBuf,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub generation: GenerationConfig,
    /// `None` when the tokenizer ships no usable template: chat requests then get a 400.
    pub chat_template: Option<ChatTemplate>,
    /// Why there is no chat template, for that 400.
    chat_template_error: Option<String>,
    /// EOS ids, from generation_config.json, else config.json, else the tokenizer.
    pub eos_token_ids: Vec<u32>,
}

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Model(#[from] moerun_core::Error),
    #[error("{0}")]
    Text(#[from] TextError),
}

impl ServedModel {
    /// Load the checkpoint in `dir`, served under `name`, on the CPU.
    pub fn load(dir: &Path, name: String) -> Result<ServedModel, LoadError> {
        ServedModel::load_on(dir, name, Device::Cpu)
    }

    /// Load the checkpoint in `dir`, served under `name`, running on `device`.
    pub fn load_on(dir: &Path, name: String, device: Device) -> Result<ServedModel, LoadError> {
        let model = Model::load_on(dir, device)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let generation = GenerationConfig::load(dir)?;
        let (chat_template, chat_template_error) = match tokenizer.chat_template(None, false) {
            Ok(t) => (Some(t), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let eos_token_ids =
            generation.resolve_eos_token_ids(&model.config.eos_token_ids, tokenizer.eos_token_id());
        Ok(ServedModel {
            name,
            dir: dir.to_path_buf(),
            model,
            tokenizer,
            generation,
            chat_template,
            chat_template_error,
            eos_token_ids,
        })
    }

    /// Longest sequence (prompt + completion) the model itself takes.
    pub fn context_len(&self) -> usize {
        self.model.config.max_position_embeddings
    }

    /// Rows of the model's logits (the embedding may be padded past the tokenizer).
    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    /// Token ids of a prompt: a chat rendered with the template (generation prompt on) and
    /// tokenized without adding special tokens again, as transformers' `apply_chat_template`
    /// does; completion text tokenized with them; token ids checked against the vocabulary.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
        let ids = match prompt {
            Prompt::Chat {
                messages,
                template_kwargs,
            } => {
                let Some(template) = &self.chat_template else {
                    return Err(ApiError::invalid(
                        "messages",
                        "chat_template_missing",
                        format!(
                            "this model has no usable chat template ({}); use /v1/completions",
                            self.chat_template_error.as_deref().unwrap_or("none")
                        ),
                    ));
                };
                let mut args = ChatArgs::new(messages.iter().map(template_value).collect());
                args.add_generation_prompt = true;
                args.extra = template_kwargs
                    .iter()
                    .map(|(k, v)| (k.clone(), template_value(v)))
                    .collect();
                let text = template.render(&args).map_err(|e| match e {
                    TextError::TemplateRaised(_) | TextError::TemplateInput(_) => {
                        ApiError::invalid("messages", "invalid_value", e.to_string())
                    }
                    other => ApiError::internal(other.to_string()),
                })?;
                self.tokenizer
                    .encode(&text, false)
                    .map_err(|e| ApiError::internal(e.to_string()))?
            }
            Prompt::Text(text) => self
                .tokenizer
                .encode(text, true)
                .map_err(|e| ApiError::internal(e.to_string()))?,
            Prompt::Tokens(ids) => {
                let vocab = self.vocab_size();
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(ApiError::invalid(
                        "prompt",
                        "invalid_value",
                        format!("token id {bad} is outside the vocabulary of {vocab} ids"),
                    ));
                }
                ids.clone()
            }
        };
        if ids.is_empty() {
            let param = match prompt {
                Prompt::Chat { .. } => "messages",
                _ => "prompt",
            };
            return Err(ApiError::invalid(
                param,
                "invalid_value",
                "the prompt has no tokens",
            ));
        }
        Ok(ids)
    }

    /// The model's defaults (generation_config.json) with the request's fields on top, as vLLM
    /// does; validated, a bad value named in a 400.
    pub fn sampling_params(&self, o: &SamplingOverrides) -> Result<SamplingParams, ApiError> {
        let mut p = self.generation.sampling_params();
        let fields = [
            (&mut p.temperature, o.temperature),
            (&mut p.top_p, o.top_p),
            (&mut p.min_p, o.min_p),
            (&mut p.repetition_penalty, o.repetition_penalty),
            (&mut p.presence_penalty, o.presence_penalty),
            (&mut p.frequency_penalty, o.frequency_penalty),
        ];
        for (field, value) in fields {
            if let Some(v) = value {
                *field = v;
            }
        }
        if let Some(k) = o.top_k {
            p.top_k = k;
        }
        p.seed = o.seed;
        p.validate().map_err(|message| {
            // The sampler's messages start with the field's name.
            let param = message.split_whitespace().next().unwrap_or("").to_string();
            ApiError::invalid(&param, "invalid_value", message)
        })?;
        Ok(p)
    }

    /// How many tokens to generate when the request does not say: generation_config.json's
    /// limit if it has one, else the rest of the context (vLLM's rule).
    pub fn default_max_tokens(&self, prompt_len: usize, max_model_len: usize) -> usize {
        let room = max_model_len.saturating_sub(prompt_len);
        self.generation
            .max_new_tokens_after(prompt_len)
            .map_or(room, |n| n.min(room))
            .max(1)
    }
}

/// A JSON value as the chat template sees it.
fn template_value(v: &Value) -> TemplateValue {
    TemplateValue::from_serialize(v)
}
