//! What a model directory says about its tokenizer besides `tokenizer.json`: the named special
//! tokens and `add_bos_token` from `tokenizer_config.json` (and the legacy
//! `special_tokens_map.json`), and the chat templates, read the way transformers 5 reads them.
//!
//! Template sources, in transformers' order of precedence: `chat_template.jinja` (the default
//! template) and `additional_chat_templates/<name>.jinja` beside it replace whatever
//! `tokenizer_config.json` holds; otherwise its `chat_template` is used, either one string or the
//! list form `[{"name": ..., "template": ...}]`.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Result, TextError};

/// The named special tokens transformers passes to every chat template (its
/// `SPECIAL_TOKENS_ATTRIBUTES`), in the order it lists them.
pub const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The parts of `tokenizer_config.json` (and `special_tokens_map.json`) the engine needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenizerConfig {
    /// Named special tokens as strings, e.g. `("bos_token", "<s>")`; absent or `null` ones are
    /// left out. Order follows [`SPECIAL_TOKEN_NAMES`].
    pub special_tokens: Vec<(String, String)>,
    /// `add_bos_token` as written. transformers 5 ignores it when `tokenizer.json` exists (its
    /// post-processor decides), and so does [`crate::Tokenizer::encode`]; it is kept for callers
    /// that build prompts by hand.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token` as written; see `add_bos_token`.
    pub add_eos_token: Option<bool>,
    /// The chat templates found for this tokenizer.
    pub chat_templates: ChatTemplates,
}

impl TokenizerConfig {
    /// The string of a named special token (`"bos_token"`, `"eos_token"`, ...), if set.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// Reads the configuration files of a model directory. Every file is optional.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join("tokenizer_config.json");
        let raw = read_json_if_exists(&config_path)?.unwrap_or(Value::Null);
        let mut config = Self::from_json(&raw, &config_path)?;

        // transformers reads special_tokens_map.json only for configs saved before
        // `added_tokens_decoder` existed, and then lets it override the config's values.
        if raw.get("added_tokens_decoder").is_none() {
            let map_path = dir.join("special_tokens_map.json");
            if let Some(map) = read_json_if_exists(&map_path)? {
                for name in SPECIAL_TOKEN_NAMES {
                    if let Some(value) = map.get(name) {
                        let token = token_string(value, name, &map_path)?;
                        config.set_special_token(name, token);
                    }
                }
            }
        }

        if let Some(templates) = ChatTemplates::from_jinja_files(dir)? {
            config.chat_templates = templates;
        }
        Ok(config)
    }

    /// Parses the JSON of a `tokenizer_config.json`; `path` only names it in errors.
    pub fn from_json(raw: &Value, path: &Path) -> Result<Self> {
        let mut config = TokenizerConfig::default();
        if raw.is_null() {
            return Ok(config);
        }
        if !raw.is_object() {
            return Err(json_error(path, "the top level is not an object"));
        }
        for name in SPECIAL_TOKEN_NAMES {
            if let Some(value) = raw.get(name) {
                config.set_special_token(name, token_string(value, name, path)?);
            }
        }
        config.add_bos_token = optional_bool(raw, "add_bos_token", path)?;
        config.add_eos_token = optional_bool(raw, "add_eos_token", path)?;
        if let Some(template) = raw.get("chat_template") {
            config.chat_templates = ChatTemplates::from_config_value(template, path)?;
        }
        Ok(config)
    }

    fn set_special_token(&mut self, name: &str, token: Option<String>) {
        self.special_tokens.retain(|(n, _)| n != name);
        if let Some(token) = token {
            self.special_tokens.push((name.to_string(), token));
        }
        let rank = |n: &str| SPECIAL_TOKEN_NAMES.iter().position(|k| *k == n);
        self.special_tokens.sort_by_key(|(n, _)| rank(n));
    }
}

/// A model's chat templates by name; a single template is named `"default"`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatTemplates {
    entries: Vec<(String, String)>,
}

impl ChatTemplates {
    /// One unnamed template, stored as `"default"`.
    pub fn single(source: impl Into<String>) -> Self {
        Self {
            entries: vec![("default".to_string(), source.into())],
        }
    }

    /// Named templates, in the given order.
    pub fn named(entries: Vec<(String, String)>) -> Self {
        Self { entries }
    }

    /// Whether the model ships no template.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The template names, in file or config order.
    pub fn names(&self) -> Vec<String> {
        self.entries.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The source of the template called `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.as_str())
    }

    /// Picks a template as transformers' `get_chat_template` does: the one named, else
    /// `"tool_use"` when tools are passed and it exists, else `"default"`.
    pub fn select(&self, name: Option<&str>, has_tools: bool) -> Result<&str> {
        if self.entries.is_empty() {
            return Err(TextError::NoChatTemplate);
        }
        let wanted = match name {
            Some(name) => name,
            None if has_tools && self.get("tool_use").is_some() => "tool_use",
            None => "default",
        };
        self.get(wanted).ok_or_else(|| TextError::UnknownTemplate {
            name: wanted.to_string(),
            available: self.names(),
        })
    }

    fn from_config_value(value: &Value, path: &Path) -> Result<Self> {
        match value {
            Value::Null => Ok(Self::default()),
            Value::String(source) => Ok(Self::single(source.clone())),
            Value::Array(items) => {
                let mut entries = Vec::with_capacity(items.len());
                for item in items {
                    let name = item.get("name").and_then(Value::as_str);
                    let template = item.get("template").and_then(Value::as_str);
                    let (Some(name), Some(template)) = (name, template) else {
                        return Err(json_error(
                            path,
                            "each chat_template entry needs string \"name\" and \"template\"",
                        ));
                    };
                    entries.push((name.to_string(), template.to_string()));
                }
                Ok(Self::named(entries))
            }
            _ => Err(json_error(
                path,
                "chat_template is neither a string nor a list of named templates",
            )),
        }
    }

    /// `chat_template.jinja` and `additional_chat_templates/*.jinja`, if any exist.
    fn from_jinja_files(dir: &Path) -> Result<Option<Self>> {
        let mut entries = Vec::new();
        let default = dir.join("chat_template.jinja");
        if default.is_file() {
            entries.push(("default".to_string(), read_text(&default)?));
        }
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let listing = fs::read_dir(&extra_dir).map_err(|source| TextError::Io {
                path: extra_dir.clone(),
                source,
            })?;
            let mut files: Vec<PathBuf> = listing
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "jinja") && p.is_file())
                .collect();
            // Directory order is arbitrary; sort so that `names()` is stable.
            files.sort();
            for file in files {
                let Some(name) = file.file_stem().and_then(|s| s.to_str()) else {
                    continue;
                };
                entries.push((name.to_string(), read_text(&file)?));
            }
        }
        Ok((!entries.is_empty()).then(|| Self::named(entries)))
    }
}

/// A special token written as a string, as an AddedToken object (`{"content": ...}`) or `null`.
fn token_string(value: &Value, name: &str, path: &Path) -> Result<Option<String>> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Object(obj) => match obj.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(json_error(
                path,
                &format!("{name} has no string \"content\""),
            )),
        },
        _ => Err(json_error(
            path,
            &format!("{name} is neither a string nor a token object"),
        )),
    }
}

fn optional_bool(raw: &Value, key: &str, path: &Path) -> Result<Option<bool>> {
    match raw.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(json_error(path, &format!("{key} is not a boolean"))),
    }
}

pub(crate) fn read_text(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|source| TextError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json_if_exists(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = read_text(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| json_error(path, &e.to_string()))
}

fn json_error(path: &Path, message: &str) -> TextError {
    TextError::Json {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(raw: Value) -> TokenizerConfig {
        TokenizerConfig::from_json(&raw, Path::new("tokenizer_config.json")).unwrap()
    }

    #[test]
    fn special_tokens_are_read_from_strings_and_added_token_objects() {
        let config = parse(json!({
            "bos_token": {"content": "<s>", "lstrip": false, "special": true},
            "eos_token": "</s>",
            "pad_token": null,
        }));
        assert_eq!(config.special_token("bos_token"), Some("<s>"));
        assert_eq!(config.special_token("eos_token"), Some("</s>"));
        assert_eq!(config.special_token("pad_token"), None);
    }

    #[test]
    fn list_form_chat_templates_keep_their_names() {
        let config = parse(json!({
            "chat_template": [
                {"name": "default", "template": "D"},
                {"name": "tool_use", "template": "T"},
            ],
        }));
        let templates = &config.chat_templates;
        assert_eq!(templates.names(), vec!["default", "tool_use"]);
        assert_eq!(templates.select(None, false).unwrap(), "D");
        assert_eq!(templates.select(None, true).unwrap(), "T");
        assert_eq!(templates.select(Some("tool_use"), false).unwrap(), "T");
    }

    #[test]
    fn asking_for_an_unknown_template_names_the_available_ones() {
        let templates = ChatTemplates::single("x");
        let err = templates.select(Some("rag"), false).unwrap_err();
        assert!(
            matches!(err, TextError::UnknownTemplate { ref available, .. } if available == &["default"])
        );
    }

    #[test]
    fn a_non_boolean_add_bos_token_is_an_error_not_a_guess() {
        let raw = json!({"add_bos_token": "yes"});
        let err = TokenizerConfig::from_json(&raw, Path::new("c.json")).unwrap_err();
        assert!(err.to_string().contains("add_bos_token"));
    }
}
