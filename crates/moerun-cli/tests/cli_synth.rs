//! End-to-end: `moerun synth` writes checkpoints that `Model::load` reads and runs, for every
//! family (using the small configs of the transformers fixtures as `--like`), deterministically
//! per seed, with `--layers` cutting per-layer lists consistently, and refuses bad input with one
//! clear line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::config::FfnKind;
use moerun_model::stats::ParamStats;
use moerun_model::{LogitsFor, Model};

fn fixture_config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .join("config.json")
}

fn moerun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moerun"))
        .args(args)
        .output()
        .expect("run moerun")
}

fn synth(like: &Path, out: &Path, extra: &[&str]) {
    let mut args = vec![
        "synth",
        "--like",
        like.to_str().expect("utf-8 path"),
        "--out",
        out.to_str().expect("utf-8 path"),
    ];
    args.extend_from_slice(extra);
    let o = moerun(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Non-zero exit, no panic, one `error:` line containing `needle`.
fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "one line expected: {stderr}"
    );
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains(needle), "'{needle}' not in: {stderr}");
}

/// Last-position logits of a 5-token prefill followed by one decode step.
fn run_forward(model: &Model) -> Vec<f32> {
    let mut kv = SequenceKv::with_capacity(&model.config, 6);
    let mut seq = Sequence::new(vec![1, 2, 3, 4, 5]);
    run_step(
        model,
        &mut kv,
        &mut [&mut seq],
        &[usize::MAX],
        LogitsFor::LastOfEachSeq,
    )
    .expect("prefill");
    seq.tokens.push(6);
    let out = run_step(
        model,
        &mut kv,
        &mut [&mut seq],
        &[1],
        LogitsFor::LastOfEachSeq,
    )
    .expect("decode");
    out.logits
}

#[test]
fn every_family_synthesises_loads_and_runs() {
    let fixtures = [
        "llama_bf16_bias_dynamic_v4",
        "mixtral_bf16_swa_llama3_v4",
        "olmoe_clip_sharded",
        "qwen2_dense_swa_yarn",
        "qwen2_moe_shared_tied_linear",
        "qwen3_dense_tied_llama3",
        "qwen3_moe_bf16_yarn_v4",
        "qwen3_moe_f32",
    ];
    let tmp = tempfile::tempdir().expect("tempdir");
    for (i, name) in fixtures.iter().enumerate() {
        let dtype = ["bf16", "f16", "f32"][i % 3];
        let out = tmp.path().join(name);
        synth(
            &fixture_config(name),
            &out,
            &["--dtype", dtype, "--seed", "3"],
        );
        let model = Model::load(&out).unwrap_or_else(|e| panic!("{name}: {e}"));
        let stats = ParamStats::from_config(&model.config);
        let size = if dtype == "f32" { 4 } else { 2 };
        assert_eq!(
            model.checkpoint().weight_bytes(),
            stats.total * size,
            "{name}"
        );
        let logits = run_forward(&model);
        assert_eq!(logits.len(), model.config.vocab_size, "{name}");
        assert!(
            logits.iter().all(|v| v.is_finite()),
            "{name}: non-finite logits"
        );
        // Random weights of std 0.02 keep logits of order one, neither vanishing nor exploding.
        let max = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max > 1e-3 && max < 100.0, "{name}: max |logit| {max}");
    }
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let like = fixture_config("qwen3_moe_f32");
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    synth(&like, &a, &["--seed", "42"]);
    synth(&like, &b, &["--seed", "42"]);
    synth(&like, &c, &["--seed", "43"]);
    for file in ["config.json", "generation_config.json", "model.safetensors"] {
        let read = |dir: &Path| std::fs::read(dir.join(file)).expect("file written");
        assert_eq!(read(&a), read(&b), "{file} differs for the same seed");
    }
    let weights = |dir: &Path| std::fs::read(dir.join("model.safetensors")).expect("weights");
    assert_ne!(
        weights(&a),
        weights(&c),
        "a different seed gave the same weights"
    );
}

#[test]
fn layers_truncates_config_and_weights() {
    // 4 layers, layer 2 MLP-only, one layer_types entry per layer.
    let like = fixture_config("qwen2_moe_shared_tied_linear");
    let tmp = tempfile::tempdir().expect("tempdir");
    for (layers, mlp_only) in [(2usize, vec![]), (3, vec![2u64])] {
        let out = tmp.path().join(format!("l{layers}"));
        synth(&like, &out, &["--layers", &layers.to_string()]);
        let text = std::fs::read_to_string(out.join("config.json")).expect("config");
        let cfg: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(cfg["num_hidden_layers"], layers);
        assert_eq!(cfg["layer_types"].as_array().expect("list").len(), layers);
        assert_eq!(cfg["mlp_only_layers"], serde_json::json!(mlp_only));
        assert_eq!(cfg["dtype"], "bfloat16");
        let model = Model::load(&out).expect("loads");
        assert_eq!(model.config.num_layers(), layers);
        let dense: Vec<usize> = (0..layers)
            .filter(|&l| matches!(model.config.layers[l].ffn, FfnKind::Dense { .. }))
            .collect();
        assert_eq!(
            dense,
            mlp_only.iter().map(|&l| l as usize).collect::<Vec<_>>()
        );
        assert!(!model
            .checkpoint()
            .contains(&format!("model.layers.{layers}.input_layernorm.weight")));
        run_forward(&model);
    }
}

#[test]
fn like_accepts_a_checkpoint_directory() {
    let dir = fixture_config("mixtral_bf16_swa_llama3_v4");
    let dir = dir.parent().expect("fixture dir");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("m");
    synth(dir, &out, &["--layers", "1"]);
    let model = Model::load(&out).expect("loads");
    // Mixtral keeps its Hub naming.
    assert!(model
        .checkpoint()
        .contains("model.layers.0.block_sparse_moe.experts.0.w1.weight"));
}

#[test]
fn list_shows_families_and_support() {
    let out = moerun(&["synth", "--list"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} not listed: {text}"))
            .to_string()
    };
    let qwen = line("qwen3-30b-a3b");
    assert!(
        qwen.contains("qwen3_moe") && qwen.contains("yes") && qwen.contains("30.53B total"),
        "{qwen}"
    );
    let deepseek = line("deepseek-v3");
    assert!(
        deepseek.contains("deepseek_v3") && deepseek.contains(" no "),
        "{deepseek}"
    );
    assert!(line("smollm2-135m-instruct").contains("llama"));
}

#[test]
fn bad_input_is_refused_with_one_line() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("out");
    let out_s = out.to_str().expect("utf-8");
    let run = |extra: &[&str]| {
        let mut args = vec!["synth", "--out", out_s];
        args.extend_from_slice(extra);
        moerun(&args)
    };
    let o = run(&["--like", "no-such-model"]);
    assert_clean_error(&o, "no-such-model");
    assert_clean_error(&o, "qwen3-30b-a3b");
    assert_clean_error(
        &run(&["--like", "deepseek-v3"]),
        "unsupported model_type 'deepseek_v3'",
    );
    assert_clean_error(
        &run(&["--like", "qwen3-30b-a3b", "--layers", "0"]),
        "--layers",
    );
    assert_clean_error(
        &run(&["--like", "qwen3-30b-a3b", "--layers", "49"]),
        "only 48 layers",
    );
    assert_clean_error(
        &run(&["--like", "qwen3-30b-a3b", "--dtype", "int4"]),
        "--dtype 'int4'",
    );
    assert!(!out.exists(), "a refused synth must not create --out");

    std::fs::create_dir_all(&out).expect("mkdir");
    std::fs::write(out.join("keep.txt"), "precious").expect("write");
    assert_clean_error(
        &run(&["--like", "qwen3-30b-a3b", "--layers", "1"]),
        "not empty",
    );
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).expect("kept"),
        "precious"
    );

    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, "{ not json").expect("write");
    let empty = tmp.path().join("empty");
    let o = moerun(&[
        "synth",
        "--like",
        bad.to_str().expect("utf-8"),
        "--out",
        empty.to_str().expect("utf-8"),
    ]);
    assert_clean_error(&o, "not valid JSON");
}
