//! Which files of a model directory decide what, in transformers 5's order of precedence.

use std::fs;
use std::path::Path;

use moerun_text::{TextError, Tokenizer, TokenizerConfig};

fn write(dir: &Path, name: &str, text: &str) {
    let path = dir.join(name);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

#[test]
fn chat_template_jinja_takes_precedence_over_the_config_template() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "tokenizer_config.json",
        r#"{"chat_template": "from config"}"#,
    );
    write(dir.path(), "chat_template.jinja", "from file");
    let config = TokenizerConfig::from_dir(dir.path()).unwrap();
    assert_eq!(
        config.chat_templates.select(None, false).unwrap(),
        "from file"
    );
    assert_eq!(config.chat_templates.names(), ["default"]);
}

#[test]
fn additional_chat_templates_are_named_by_file_and_tool_use_is_picked_for_tools() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "chat_template.jinja", "default");
    write(
        dir.path(),
        "additional_chat_templates/tool_use.jinja",
        "tools",
    );
    write(dir.path(), "additional_chat_templates/rag.jinja", "rag");
    let templates = TokenizerConfig::from_dir(dir.path())
        .unwrap()
        .chat_templates;
    assert_eq!(templates.names(), ["default", "rag", "tool_use"]);
    assert_eq!(templates.select(None, false).unwrap(), "default");
    assert_eq!(templates.select(None, true).unwrap(), "tools");
    assert_eq!(templates.select(Some("rag"), true).unwrap(), "rag");
}

#[test]
fn special_tokens_map_overrides_only_configs_without_added_tokens_decoder() {
    let legacy = tempfile::tempdir().unwrap();
    write(
        legacy.path(),
        "tokenizer_config.json",
        r#"{"eos_token": "</s>"}"#,
    );
    write(
        legacy.path(),
        "special_tokens_map.json",
        r#"{"eos_token": {"content": "<|eot|>", "special": true}, "bos_token": "<s>"}"#,
    );
    let config = TokenizerConfig::from_dir(legacy.path()).unwrap();
    assert_eq!(config.special_token("eos_token"), Some("<|eot|>"));
    assert_eq!(config.special_token("bos_token"), Some("<s>"));

    let modern = tempfile::tempdir().unwrap();
    write(
        modern.path(),
        "tokenizer_config.json",
        r#"{"eos_token": "</s>", "added_tokens_decoder": {}}"#,
    );
    write(
        modern.path(),
        "special_tokens_map.json",
        r#"{"eos_token": "<|eot|>"}"#,
    );
    let config = TokenizerConfig::from_dir(modern.path()).unwrap();
    assert_eq!(config.special_token("eos_token"), Some("</s>"));
}

#[test]
fn a_directory_without_tokenizer_json_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    let expected = dir.path().join("tokenizer.json");
    assert!(matches!(err, TextError::MissingFile { ref path } if *path == expected));
    assert_eq!(
        err.to_string(),
        format!("missing file: {}", expected.display())
    );
}

#[test]
fn a_malformed_tokenizer_json_is_an_error_value() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "tokenizer.json", "{\"model\": 3}");
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, TextError::TokenizerLoad { .. }), "{err}");
}

#[test]
fn a_malformed_tokenizer_config_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "tokenizer_config.json", "{not json");
    let err = TokenizerConfig::from_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn a_model_without_any_chat_template_says_so() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "tokenizer_config.json",
        r#"{"bos_token": null}"#,
    );
    let config = TokenizerConfig::from_dir(dir.path()).unwrap();
    assert!(matches!(
        config.chat_templates.select(None, false),
        Err(TextError::NoChatTemplate)
    ));
}
