//! End-to-end: `moerun inspect` reports the numbers of a small synthetic checkpoint exactly, and
//! its parameter count agrees with every transformers-made fixture (which checks the stats
//! arithmetic against checkpoints transformers itself wrote).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn moerun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moerun"))
        .args(args)
        .output()
        .expect("run moerun")
}

fn inspect(dir: &Path) -> String {
    let out = moerun(&["inspect", "--model", dir.to_str().expect("utf-8 path")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// The value column of the row called `key`.
fn row<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .lines()
        .find_map(|l| l.strip_prefix(key).filter(|rest| rest.starts_with(' ')))
        .unwrap_or_else(|| panic!("no '{key}' row in:\n{report}"))
        .trim()
}

/// A 2-layer qwen3_moe whose every figure is worked out by hand below.
const TINY: &str = r#"{
  "model_type": "qwen3_moe", "hidden_size": 32, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2, "vocab_size": 100,
  "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 6,
  "num_experts_per_tok": 2, "norm_topk_prob": true, "rope_theta": 5000.0,
  "tie_word_embeddings": false
}"#;

#[test]
fn inspect_reports_a_one_layer_synthetic_model_exactly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = tmp.path().join("tiny.json");
    std::fs::write(&config, TINY).expect("write config");
    let model = tmp.path().join("model");
    let out = moerun(&[
        "synth",
        "--like",
        config.to_str().expect("utf-8"),
        "--layers",
        "1",
        "--out",
        model.to_str().expect("utf-8"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = inspect(&model);

    // Per layer: attention q 32·32 + k,v 2·32·16 + o 32·32 + q/k norms 2·8 = 3,088;
    // router 6·32 = 192; one expert 3·32·16 = 1,536; norms 2·32 = 64. Plus final norm 32,
    // embedding 100·32 = 3,200 and lm_head 3,200.
    // total  = 3,088 + 192 + 6·1,536 + 64 + 32 + 3,200 + 3,200 = 18,992
    // active = 3,088 + 192 + 2·1,536 + 64 + 32 + 32 (one embedding row) + 3,200 = 9,680
    assert_eq!(row(&report, "family"), "qwen3_moe");
    assert_eq!(row(&report, "layers"), "1 (1 MoE, 0 dense)");
    assert_eq!(row(&report, "sliding window"), "none");
    assert_eq!(row(&report, "hidden size"), "32");
    assert_eq!(row(&report, "heads"), "4 q / 2 kv, head_dim 8");
    assert_eq!(
        row(&report, "experts"),
        "6 routed, 2 active per token (intermediate 16)"
    );
    assert_eq!(row(&report, "vocab"), "100");
    assert_eq!(
        row(&report, "parameters"),
        "19.0K total, 9.7K active per token"
    );
    assert_eq!(row(&report, "dtype"), "bf16");
    assert_eq!(row(&report, "weight bytes"), "37.09 KiB (37984 bytes)");
    assert_eq!(
        row(&report, "active bytes"),
        "18.91 KiB per token (19360 bytes, at bf16)"
    );
    // K and V, 2 kv heads × 8 dims, one layer, f32.
    assert_eq!(
        row(&report, "kv cache"),
        "128 B per token (128 bytes, f32; half with --kv-dtype bf16)"
    );
    assert_eq!(row(&report, "rope"), "default, theta 5000");
    assert_eq!(row(&report, "tied embeddings"), "no");
    assert!(!report.contains("note"), "{report}");
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

#[test]
fn stats_agree_with_transformers_checkpoints() {
    // inspect prints a note when the stored parameters differ from what the config implies.
    for (name, family, layers, dtype) in [
        (
            "llama_bf16_bias_dynamic_v4",
            "llama",
            "3 (0 MoE, 3 dense)",
            "bf16",
        ),
        (
            "mixtral_bf16_swa_llama3_v4",
            "mixtral",
            "3 (3 MoE, 0 dense)",
            "bf16",
        ),
        ("olmoe_clip_sharded", "olmoe", "3 (3 MoE, 0 dense)", "f32"),
        ("qwen2_dense_swa_yarn", "qwen2", "4 (0 MoE, 4 dense)", "f32"),
        (
            "qwen2_moe_shared_tied_linear",
            "qwen2_moe",
            "4 (3 MoE, 1 dense)",
            "f32",
        ),
        (
            "qwen3_dense_tied_llama3",
            "qwen3",
            "3 (0 MoE, 3 dense)",
            "f32",
        ),
        (
            "qwen3_moe_bf16_yarn_v4",
            "qwen3_moe",
            "6 (2 MoE, 4 dense)",
            "bf16",
        ),
        ("qwen3_moe_f32", "qwen3_moe", "3 (3 MoE, 0 dense)", "f32"),
        (
            "qwen3_moe_f32_fused",
            "qwen3_moe",
            "3 (3 MoE, 0 dense)",
            "f32",
        ),
        (
            "qwen3_5_moe_text_f32",
            "qwen3_5_moe",
            "4 (4 MoE, 0 dense)",
            "f32",
        ),
        (
            "qwen3_5_moe_text_f32_fused",
            "qwen3_5_moe",
            "4 (4 MoE, 0 dense)",
            "f32",
        ),
    ] {
        let report = inspect(&fixture(name));
        assert!(!report.contains("note"), "{name}:\n{report}");
        assert_eq!(row(&report, "family"), family, "{name}");
        assert_eq!(row(&report, "layers"), layers, "{name}");
        assert_eq!(row(&report, "dtype"), dtype, "{name}");
    }
}

#[test]
fn sliding_window_and_shared_expert_are_described() {
    let report = inspect(&fixture("mixtral_bf16_swa_llama3_v4"));
    assert_eq!(row(&report, "sliding window"), "12 tokens on 3 of 3 layers");
    assert!(
        row(&report, "rope").starts_with("llama3 (factor 8"),
        "{report}"
    );
    let report = inspect(&fixture("qwen2_moe_shared_tied_linear"));
    assert!(
        row(&report, "experts").ends_with("shared expert (intermediate 80, gated)"),
        "{report}"
    );
    assert_eq!(row(&report, "tied embeddings"), "yes");
}

#[test]
fn hybrid_layers_state_and_ignored_vision_tower_are_described() {
    let report = inspect(&fixture("qwen3_5_moe_text_f32"));
    assert_eq!(
        row(&report, "token mixers"),
        "3 Gated DeltaNet (2 key / 4 value heads of 16/24, conv 4), 1 full attention (gated output)"
    );
    // K/V of the one attention layer; (3 * 160 + 4 * 16 * 24) f32 per Gated DeltaNet layer.
    assert_eq!(
        row(&report, "kv cache"),
        "512 B per token (512 bytes, f32; half with --kv-dtype bf16); linear-attention state 23.62 KiB per sequence"
    );
    assert_eq!(
        row(&report, "rope"),
        "default, theta 10000, rotating 8 of 32 dims"
    );
    // The multimodal checkpoint also stores a vision tower and an MTP head, which are not run.
    let out = moerun(&[
        "inspect",
        "--model",
        fixture("qwen3_5_moe_vl_bf16").to_str().expect("utf-8"),
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        row(&stdout, "note").contains("the config implies"),
        "{stdout}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("vision tower (21 tensors under model.visual.) is not loaded"),
        "{stderr}"
    );
}

#[test]
fn a_missing_checkpoint_is_one_line() {
    let out = moerun(&["inspect", "--model", "/nonexistent/ckpt"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("/nonexistent/ckpt"), "{stderr}");
}
