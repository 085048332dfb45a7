//! `generation_config.json` becomes typed token ids and default sampling parameters; absent
//! fields and files fall back to documented defaults, bad fields are refused by name.

use std::path::Path;

use moerun_engine::generation_config::GenerationConfig;
use moerun_engine::sampling::SamplingParams;
use serde_json::json;

fn parse(v: serde_json::Value) -> GenerationConfig {
    GenerationConfig::from_json(&v).unwrap()
}

#[test]
fn a_sampling_config_with_an_eos_list_becomes_its_sampling_params() {
    // The shape Qwen3 ships.
    let cfg = parse(json!({
        "bos_token_id": 151643,
        "do_sample": true,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "4.51.0"
    }));
    assert_eq!(cfg.bos_token_id, Some(151643));
    assert_eq!(cfg.eos_token_ids, [151645, 151643]);
    assert_eq!(cfg.pad_token_id, Some(151643));
    assert_eq!(
        cfg.sampling_params(),
        SamplingParams {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            ..Default::default()
        }
    );
}

#[test]
fn a_config_without_do_sample_decodes_greedily() {
    // The shape Mixtral ships: token ids only.
    let cfg = parse(json!({"bos_token_id": 1, "eos_token_id": 2, "_from_model_config": true}));
    assert_eq!(cfg.eos_token_ids, [2]);
    assert!(!cfg.do_sample);
    assert_eq!(cfg.sampling_params(), SamplingParams::greedy());
}

#[test]
fn do_sample_false_is_greedy_but_keeps_the_repetition_penalty_and_the_written_fields() {
    let cfg = parse(json!({
        "do_sample": false, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05
    }));
    assert_eq!(cfg.temperature, Some(0.7));
    let p = cfg.sampling_params();
    assert!(p.is_greedy());
    assert_eq!(p.repetition_penalty, 1.05);
    assert_eq!(p.top_p, 1.0);
}

#[test]
fn fields_the_file_omits_keep_the_openai_defaults_not_transformers_top_k_50() {
    let p = parse(json!({"do_sample": true, "temperature": 0.8})).sampling_params();
    assert_eq!(
        p,
        SamplingParams {
            temperature: 0.8,
            ..Default::default()
        }
    );
    assert_eq!(p.top_k, 0);
}

#[test]
fn null_fields_count_as_absent() {
    let cfg = parse(json!({"pad_token_id": null, "eos_token_id": null, "temperature": null}));
    assert_eq!(cfg, GenerationConfig::default());
}

#[test]
fn max_new_tokens_wins_over_max_length_which_counts_the_prompt() {
    let both = parse(json!({"max_new_tokens": 64, "max_length": 100}));
    assert_eq!(both.max_new_tokens_after(90), Some(64));
    let length = parse(json!({"max_length": 100}));
    assert_eq!(length.max_new_tokens_after(30), Some(70));
    assert_eq!(length.max_new_tokens_after(130), Some(0));
    assert_eq!(GenerationConfig::default().max_new_tokens_after(5), None);
}

#[test]
fn bad_fields_are_refused_by_name() {
    let cases = [
        ("eos_token_id", json!({"eos_token_id": "two"})),
        ("eos_token_id", json!({"eos_token_id": [1, -2]})),
        ("bos_token_id", json!({"bos_token_id": 1.5})),
        ("do_sample", json!({"do_sample": "yes"})),
        ("top_k", json!({"top_k": -1})),
        ("temperature", json!({"temperature": "hot"})),
        ("temperature", json!({"temperature": -1.0})),
        ("top_p", json!({"do_sample": true, "top_p": 1.5})),
        ("min_p", json!({"min_p": 2})),
        ("repetition_penalty", json!({"repetition_penalty": 0})),
        ("max_new_tokens", json!({"max_new_tokens": -5})),
    ];
    for (field, v) in cases {
        let err = GenerationConfig::from_json(&v).unwrap_err();
        assert!(err.starts_with(field), "{err:?} should name {field}");
    }
    assert!(GenerationConfig::from_json(&json!([1, 2])).is_err());
}

#[test]
fn a_directory_without_the_file_gives_the_defaults() {
    let cfg = GenerationConfig::load(Path::new("/nonexistent/moerun/model")).unwrap();
    assert_eq!(cfg, GenerationConfig::default());
}

#[test]
fn the_committed_fixtures_load_as_greedy_without_token_ids() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut loaded = 0;
    for entry in std::fs::read_dir(fixtures).unwrap() {
        let dir = entry.unwrap().path();
        if dir.join("generation_config.json").is_file() {
            let cfg = GenerationConfig::load(&dir).unwrap();
            assert_eq!(cfg, GenerationConfig::default(), "{}", dir.display());
            loaded += 1;
        }
    }
    assert!(loaded > 0);
}

#[test]
fn a_malformed_file_is_refused_with_its_path() {
    let dir = std::env::temp_dir().join(format!("moerun-genconfig-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("generation_config.json"), "{\"top_p\": 2}").unwrap();
    let err = GenerationConfig::load(&dir).unwrap_err().to_string();
    std::fs::write(dir.join("generation_config.json"), "{not json").unwrap();
    let syntax = GenerationConfig::load(&dir).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        err.contains("generation_config.json") && err.contains("top_p"),
        "{err}"
    );
    assert!(syntax.contains("generation_config.json"), "{syntax}");
}
