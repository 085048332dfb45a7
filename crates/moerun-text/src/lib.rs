//! Text in and out of the engine: [`Tokenizer`] (a Hugging Face `tokenizer.json` plus its
//! `tokenizer_config.json`), [`DecodeStream`] (token-by-token detokenization whose deltas are
//! valid UTF-8 and add up to the full decode) and [`ChatTemplate`] (HF Jinja chat templates
//! rendered byte-identically to transformers' `apply_chat_template(..., tokenize=False)`).
//!
//! Nothing here touches the network or a model's weights; tests run on real tokenizers and
//! templates committed under `tests/tokenizers/` and `tests/chat_templates/`.

pub mod config;
pub mod error;
pub mod stream;
pub mod template;
pub mod tokenizer;

pub use config::{ChatTemplates, TokenizerConfig};
pub use error::{Result, TextError};
pub use stream::{DecodeStream, TokenDecoder};
pub use template::{ChatArgs, ChatTemplate, TemplateValue};
pub use tokenizer::Tokenizer;
