//! End-to-end: `moerun bench` runs on a tiny synthetic model and reports positive figures, as JSON
//! and as a table. No speed is asserted: test machines vary too much.

use std::path::Path;
use std::process::{Command, Output};

fn moerun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moerun"))
        .args(args)
        .output()
        .expect("run moerun")
}

/// A tiny synthetic qwen3_moe checkpoint in `dir`.
fn tiny_model(dir: &Path) -> String {
    let like = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe_f32");
    let out = dir.join("model");
    let o = moerun(&[
        "synth",
        "--like",
        like.to_str().expect("utf-8"),
        "--out",
        out.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out.to_str().expect("utf-8").to_string()
}

#[test]
fn bench_json_has_positive_figures() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(tmp.path());
    let out = moerun(&[
        "--threads",
        "1",
        "bench",
        "--model",
        &model,
        "--prompt",
        "8",
        "--gen",
        "4",
        "--repeat",
        "2",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    for key in [
        "read_bandwidth_bytes_per_s",
        "prefill_seconds",
        "prefill_tok_per_s",
        "decode_seconds",
        "decode_tok_per_s",
        "active_bytes_per_token",
        "decode_weight_bytes_per_s",
        "decode_bandwidth_pct",
        "decode_roofline_tok_per_s",
        "params_total",
        "params_active",
    ] {
        let v = json[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {json}"));
        assert!(v > 0.0 && v.is_finite(), "{key} = {v}");
    }
    assert_eq!(json["threads"], 1);
    assert_eq!(json["prompt_tokens"], 8);
    assert_eq!(json["gen_tokens"], 4);
    assert_eq!(json["family"], "qwen3_moe");
    assert_eq!(json["dtype"], "bf16");
    assert!(json["isa"].as_str().is_some_and(|s| !s.is_empty()));
}

#[test]
fn bench_table_names_the_phases() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(tmp.path());
    let out = moerun(&["bench", "--model", &model, "--prompt", "4", "--gen", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "prefill",
        "decode (batch 1)",
        "GB/s",
        "% of measured bandwidth",
    ] {
        assert!(text.contains(needle), "'{needle}' not in:\n{text}");
    }
}

#[test]
fn zero_tokens_are_refused() {
    for flag in ["--prompt", "--gen", "--repeat"] {
        let out = moerun(&["bench", "--model", "/nonexistent", flag, "0"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert_eq!(stderr.trim(), format!("error: {flag} must be at least 1"));
    }
}

#[test]
fn like_names_are_checked_before_the_device() {
    // On the CPU an in-memory synthetic model is refused, but an unknown name is said first.
    let out = moerun(&["bench", "--like", "no-such-model"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("'no-such-model': not a known model"),
        "{stderr}"
    );
    let out = moerun(&["bench", "--like", "qwen3-30b-a3b"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("moerun synth --like qwen3-30b-a3b"),
        "{stderr}"
    );
}
