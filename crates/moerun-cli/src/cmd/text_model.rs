//! A model with its tokenizer, generation defaults and KV sizing: what the text commands
//! (generate, chat, perplexity) share.

use std::path::{Path, PathBuf};

use moerun_engine::generation_config::GenerationConfig;
use moerun_engine::stop::StopTokens;
use moerun_engine::SequenceKv;
use moerun_model::cuda::WeightSource;
use moerun_model::{Model, WeightsIn};
use moerun_text::Tokenizer;

use super::CliResult;
use crate::DeviceFlag;

/// A loaded checkpoint ready for text in, text out.
pub struct TextModel {
    pub dir: PathBuf,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub generation: GenerationConfig,
}

impl TextModel {
    /// Load the checkpoint at `--model`, or the embedded default model when none is given.
    pub fn load(model: Option<&Path>, run: DeviceFlag) -> CliResult<TextModel> {
        let device = run.device;
        let dir = super::default_model::resolve(model)?;
        let mut model = Model::load_with(&dir, WeightsIn::for_device(device))?;
        // The tokenizer first: a missing file is reported before any slow paging in.
        let tokenizer = Tokenizer::from_dir(&dir)?;
        // Before placing: a combination the device refuses is refused before any upload.
        model.set_kv_dtype(run.kv_dtype)?;
        super::progress::load_weights_with_progress(&model);
        model.place(device, WeightSource::Host)?;
        let generation = GenerationConfig::load(&dir)?;
        Ok(TextModel {
            dir,
            model,
            tokenizer,
            generation,
        })
    }

    /// Longest sequence (prompt + generated) this model takes.
    pub fn context_len(&self) -> usize {
        self.model.config.max_position_embeddings
    }

    /// EOS ids from generation_config.json, else the config's, else the tokenizer's.
    pub fn stop_tokens(&self) -> StopTokens {
        let ids = self.generation.resolve_eos_token_ids(
            &self.model.config.eos_token_ids,
            self.tokenizer.eos_token_id(),
        );
        StopTokens::new(&ids, &[], false)
    }

    /// A KV cache for sequences of up to `tokens` tokens.
    pub fn kv_cache(&self, tokens: usize) -> CliResult<SequenceKv> {
        Ok(SequenceKv::for_model(&self.model, tokens)?)
    }

    /// A KV cache for one generated sequence of up to `tokens` tokens: sliding-window layers keep
    /// only their window (plus one prefill chunk), however long the generation.
    pub fn generation_kv_cache(&self, tokens: usize) -> CliResult<SequenceKv> {
        Ok(SequenceKv::for_one_sequence(
            &self.model,
            tokens,
            moerun_engine::sequence::WINDOWED_MAX_CHUNK,
        )?)
    }

    /// Refuse a prompt that leaves no room to generate.
    pub fn check_prompt_len(&self, prompt_tokens: usize) -> CliResult {
        if prompt_tokens == 0 {
            return Err("the prompt is empty".into());
        }
        if prompt_tokens >= self.context_len() {
            return Err(format!(
                "the prompt has {prompt_tokens} tokens but the model's context is {} tokens",
                self.context_len()
            )
            .into());
        }
        Ok(())
    }
}
