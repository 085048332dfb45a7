//! Real chat templates (tests/chat_templates/*.jinja) must render byte for byte what
//! transformers' `apply_chat_template(..., tokenize=False)` renders, and refuse with the same
//! message where the template raises (goldens by tools/chat_templates/make_goldens.py).

mod common;

use std::collections::BTreeMap;
use std::fs;

use moerun_text::{ChatArgs, ChatTemplate, TemplateValue, TextError, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Goldens {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    template: String,
    special_tokens: Vec<(String, String)>,
    messages_json: String,
    tools_json: Option<String>,
    add_generation_prompt: bool,
    extra_json: String,
    expected: Option<String>,
    expected_error: Option<String>,
}

fn templates_dir() -> std::path::PathBuf {
    common::repo_root().join("tests/chat_templates")
}

/// A JSON list, kept in written key order, as template values.
fn list(json: &str) -> Vec<TemplateValue> {
    let value = TemplateValue::from_json(json).unwrap();
    value
        .as_value()
        .try_iter()
        .unwrap()
        .map(TemplateValue::from)
        .collect()
}

fn args(case: &Case) -> ChatArgs {
    let extra = TemplateValue::from_json(&case.extra_json).unwrap();
    let extra = extra.as_value();
    ChatArgs {
        messages: list(&case.messages_json),
        tools: case.tools_json.as_deref().map(list),
        documents: None,
        add_generation_prompt: case.add_generation_prompt,
        extra: extra
            .try_iter()
            .unwrap()
            .map(|key| (key.to_string(), extra.get_item(&key).unwrap().into()))
            .collect(),
    }
}

#[test]
fn every_real_template_renders_byte_identically_to_transformers() {
    let path = templates_dir().join("goldens.json");
    let goldens: Goldens = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    let mut sources: BTreeMap<String, String> = BTreeMap::new();
    let mut per_template: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for case in &goldens.cases {
        let source = sources
            .entry(case.template.clone())
            .or_insert_with(|| fs::read_to_string(templates_dir().join(&case.template)).unwrap());
        let template = ChatTemplate::new(source)
            .unwrap()
            .with_special_tokens(case.special_tokens.clone());
        let got = template.render(&args(case));
        *per_template.entry(case.template.clone()).or_default() += 1;
        match (&case.expected, &case.expected_error, got) {
            (Some(want), _, Ok(got)) if *want == got => {}
            (_, Some(want), Err(TextError::TemplateRaised(got))) if *want == got => {}
            (want, want_err, got) => failures.push(format!(
                "{}\n  want: {:?}\n  want error: {:?}\n  got: {:?}",
                case.name, want, want_err, got
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        goldens.cases.len(),
        failures.join("\n")
    );
    // Every committed template is covered.
    for entry in fs::read_dir(templates_dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".jinja") {
            assert!(
                per_template.get(&name).copied().unwrap_or(0) >= 8,
                "{name} has too few goldens"
            );
        }
    }
}

#[test]
fn the_smollm2_template_is_found_in_chat_template_jinja_and_renders() {
    let tok = common::tokenizer("smollm2-135m-instruct");
    let template = tok.chat_template(None, false).unwrap();
    let mut args = ChatArgs::new(vec![TemplateValue::message("user", "Hi")]);
    args.add_generation_prompt = true;
    assert_eq!(
        template.render(&args).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn the_qwen3_template_inline_in_tokenizer_config_disables_thinking_on_request() {
    let tok = common::tokenizer("qwen3");
    let template = tok.chat_template(None, false).unwrap();
    let mut args = ChatArgs::new(vec![TemplateValue::message("user", "Hi")]);
    args.add_generation_prompt = true;
    args.extra.push(("enable_thinking".into(), false.into()));
    let prompt = template.render(&args).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // The prompt's control tokens encode to single special ids.
    let ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(ids[0], 151644);
    assert!(ids.contains(&151667) && ids.contains(&151668));
}

#[test]
fn a_tokenizer_config_with_a_string_template_loads_with_its_special_tokens() {
    for (dir, bos) in [("mixtral", "<s>"), ("mistral_7b_instruct", "<s>")] {
        let config_dir = templates_dir().join("configs").join(dir);
        let config = moerun_text::TokenizerConfig::from_dir(&config_dir).unwrap();
        assert_eq!(config.special_token("bos_token"), Some(bos));
        assert_eq!(config.add_bos_token, Some(true));
        let source = config.chat_templates.select(None, false).unwrap();
        let jinja = fs::read_to_string(templates_dir().join(format!("{dir}.jinja"))).unwrap();
        assert_eq!(source, jinja);
        // No tokenizer.json beside it: loading a Tokenizer names the missing file.
        let err = Tokenizer::from_dir(&config_dir).unwrap_err();
        assert!(
            matches!(err, TextError::MissingFile { ref path } if path.ends_with("tokenizer.json"))
        );
    }
}
