//! [`Tokenizer`]: a Hugging Face `tokenizer.json` (through the `tokenizers` crate, pure Rust:
//! fancy-regex instead of Oniguruma, no hub download, no progress bars) together with the model
//! directory's `tokenizer_config.json`, so that special tokens and chat templates are at hand.
//!
//! Encoding follows transformers 5: with a `tokenizer.json`, its post-processor alone decides
//! whether BOS/EOS are added when `add_special_tokens` is true; `add_bos_token` in the config is
//! only reported. End-of-generation ids from `generation_config.json` are the engine's concern.

use std::path::Path;

use crate::config::{read_text, TokenizerConfig};
use crate::error::{Result, TextError};
use crate::stream::{DecodeStream, TokenDecoder};
use crate::template::ChatTemplate;

/// A loaded tokenizer with its configuration.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    config: TokenizerConfig,
    /// Ids of added tokens flagged `special`, ascending.
    special_ids: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.config.special_tokens)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` plus the optional `tokenizer_config.json`,
    /// `special_tokens_map.json`, `chat_template.jinja` and `additional_chat_templates/`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = TokenizerConfig::from_dir(dir)?;
        Self::from_file_with_config(dir.join("tokenizer.json"), config)
    }

    /// Loads a `tokenizer.json` alone, with an empty configuration.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_file_with_config(path, TokenizerConfig::default())
    }

    /// Loads a `tokenizer.json` and pairs it with an already parsed configuration.
    pub fn from_file_with_config(path: impl AsRef<Path>, config: TokenizerConfig) -> Result<Self> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(TextError::MissingFile {
                path: path.to_path_buf(),
            });
        }
        let json = read_text(path)?;
        let inner =
            json.parse::<tokenizers::Tokenizer>()
                .map_err(|e| TextError::TokenizerLoad {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
        Ok(Self::from_parts(inner, config))
    }

    /// Wraps a `tokenizers::Tokenizer` built elsewhere.
    pub fn from_parts(inner: tokenizers::Tokenizer, config: TokenizerConfig) -> Self {
        let mut special_ids: Vec<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| *id)
            .collect();
        special_ids.sort_unstable();
        Self {
            inner,
            config,
            special_ids,
        }
    }

    /// Token ids of `text`. With `add_special_tokens`, the tokenizer's post-processor adds what
    /// the model expects (e.g. `<s>` for Llama-style vocabularies, nothing for Qwen).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| TextError::Tokenize(e.to_string()))
    }

    /// The text of `ids`, leaving out special tokens if asked. Bytes that do not form a
    /// character decode to U+FFFD, as in Python. Ids the vocabulary does not have (models pad
    /// their embedding past the tokenizer's vocabulary, e.g. Qwen's 151936 rows for 151669
    /// tokens) decode to nothing, exactly as Hugging Face `tokenizers` does.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Tokenize(e.to_string()))
    }

    /// A streaming detokenizer over this tokenizer.
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream<'_, Self> {
        DecodeStream::new(self, skip_special_tokens)
    }

    /// The id of a token string (including added tokens), if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of a token id (e.g. `"Ġthe"`, `"<0xE2>"`, `"<|im_end|>"`), if it exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included (transformers' `len(tokenizer)`). The model's
    /// embedding may be larger (padded); ids past this have no text.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of the configured `bos_token`, if it is set and in the vocabulary.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.named_token_id("bos_token")
    }

    /// Id of the configured `eos_token`, if it is set and in the vocabulary.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.named_token_id("eos_token")
    }

    /// Id of the configured `pad_token`, if it is set and in the vocabulary.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.named_token_id("pad_token")
    }

    /// Id of a named special token (`"bos_token"`, `"unk_token"`, ...).
    pub fn named_token_id(&self, name: &str) -> Option<u32> {
        self.config
            .special_token(name)
            .and_then(|t| self.token_to_id(t))
    }

    /// Ids of all added tokens flagged special (those `decode(.., true)` leaves out), ascending.
    pub fn special_token_ids(&self) -> &[u32] {
        &self.special_ids
    }

    /// Whether `id` is a special token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.binary_search(&id).is_ok()
    }

    /// The configuration read beside `tokenizer.json`.
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// The model's chat template (`name`, or as transformers picks it: `"tool_use"` when
    /// `has_tools` and present, else `"default"`), compiled, with this tokenizer's special tokens.
    pub fn chat_template(&self, name: Option<&str>, has_tools: bool) -> Result<ChatTemplate> {
        let source = self.config.chat_templates.select(name, has_tools)?;
        Ok(ChatTemplate::new(source)?.with_special_tokens(self.config.special_tokens.clone()))
    }

    /// The underlying `tokenizers` tokenizer, for what this wrapper does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl TokenDecoder for Tokenizer {
    fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.decode(ids, skip_special_tokens)
    }
}
