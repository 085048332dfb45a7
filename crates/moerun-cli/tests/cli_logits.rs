//! End-to-end: the `moerun logits` binary against transformers' reference, and its refusal of bad
//! input with one clear line and a non-zero exit (never a panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn moerun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moerun"))
        .args(args)
        .output()
        .expect("run moerun")
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moerun-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Asserts a clean failure: non-zero exit, no panic, one `error:` line containing `needle`.
fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {stderr}");
    assert!(
        !stderr.contains("panicked"),
        "panic instead of an error: {stderr}"
    );
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "one line expected: {stderr}"
    );
    assert!(stderr.contains(needle), "'{needle}' not in: {stderr}");
}

fn reference_tokens(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<String> = json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    ids.join(",")
}

#[test]
fn logits_command_writes_transformers_logits_both_ways() {
    let dir = fixture("qwen2_moe_shared_tied_linear");
    let tokens = reference_tokens(&dir);
    let (want_shape, want) = moerun_model::npy::read_npy_f32(dir.join("logits.npy")).unwrap();
    let tmp = temp_dir("logits");
    for incremental in [false, true] {
        let out_path = tmp.join(format!("out-{incremental}.npy"));
        let mut args = vec![
            "logits",
            "--model",
            dir.to_str().unwrap(),
            "--tokens",
            &tokens,
        ];
        if incremental {
            args.push("--incremental");
        }
        args.extend(["--out", out_path.to_str().unwrap()]);
        let out = moerun(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (shape, got) = moerun_model::npy::read_npy_f32(&out_path).unwrap();
        assert_eq!(shape, want_shape);
        assert_eq!(shape[0], tokens.split(',').count());
        let err: f64 = got
            .iter()
            .zip(&want)
            .map(|(g, w)| ((g - w) as f64).powi(2))
            .sum::<f64>()
            .sqrt()
            / want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>().sqrt();
        assert!(err < 1e-4, "relative error {err}");
    }
}

#[test]
fn missing_model_directory_is_named() {
    let out = moerun(&[
        "logits",
        "--model",
        "/nonexistent/model",
        "--tokens",
        "1",
        "--out",
        "/tmp/x.npy",
    ]);
    assert_clean_error(&out, "/nonexistent/model");
}

#[test]
fn missing_config_json_is_named() {
    let tmp = temp_dir("noconfig");
    std::fs::copy(
        fixture("qwen3_moe_f32").join("model.safetensors"),
        tmp.join("model.safetensors"),
    )
    .unwrap();
    let out = moerun(&["inspect", "--model", tmp.to_str().unwrap()]);
    assert_clean_error(&out, "config.json");
}

fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let tmp = temp_dir(tag);
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let e = entry.unwrap();
        std::fs::copy(e.path(), tmp.join(e.file_name())).unwrap();
    }
    tmp
}

#[test]
fn truncated_safetensors_is_refused() {
    let tmp = copy_fixture("qwen3_moe_f32", "trunc");
    let path = tmp.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let out = moerun(&[
        "logits",
        "--model",
        tmp.to_str().unwrap(),
        "--tokens",
        "1,2",
        "--out",
        tmp.join("o.npy").to_str().unwrap(),
    ]);
    assert_clean_error(&out, "model.safetensors");
}

#[test]
fn garbage_safetensors_is_refused() {
    let tmp = copy_fixture("qwen3_moe_f32", "garbage");
    std::fs::write(
        tmp.join("model.safetensors"),
        b"this is not a safetensors file at all",
    )
    .unwrap();
    let out = moerun(&["inspect", "--model", tmp.to_str().unwrap()]);
    assert_clean_error(&out, "model.safetensors");
}

#[test]
fn header_claiming_more_bytes_than_the_file_is_refused() {
    let tmp = copy_fixture("qwen3_moe_f32", "header");
    let path = tmp.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let out = moerun(&["inspect", "--model", tmp.to_str().unwrap()]);
    assert_clean_error(&out, "header");
}

#[test]
fn unknown_model_type_lists_the_supported_ones() {
    let tmp = copy_fixture("qwen3_moe_f32", "arch");
    let cfg = std::fs::read_to_string(tmp.join("config.json")).unwrap();
    std::fs::write(
        tmp.join("config.json"),
        cfg.replace("\"qwen3_moe\"", "\"falcon_h1\""),
    )
    .unwrap();
    let out = moerun(&["inspect", "--model", tmp.to_str().unwrap()]);
    assert_clean_error(&out, "falcon_h1");
    assert_clean_error(&out, "qwen3_moe, qwen2_moe, mixtral");
}

#[test]
fn unsupported_option_in_config_is_refused_by_name() {
    let tmp = copy_fixture("qwen3_moe_f32", "option");
    let cfg = std::fs::read_to_string(tmp.join("config.json")).unwrap();
    std::fs::write(
        tmp.join("config.json"),
        cfg.replace("\"rope_type\": \"default\"", "\"rope_type\": \"longrope\""),
    )
    .unwrap();
    let out = moerun(&["inspect", "--model", tmp.to_str().unwrap()]);
    assert_clean_error(&out, "longrope");
}

#[test]
fn token_ids_out_of_range_are_refused() {
    let dir = fixture("qwen3_moe_f32");
    let out = moerun(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        "1,99999",
        "--out",
        "/tmp/never.npy",
    ]);
    assert_clean_error(&out, "99999");
}

#[test]
fn malformed_token_list_is_refused() {
    let dir = fixture("qwen3_moe_f32");
    let out = moerun(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        "1,two",
        "--out",
        "/tmp/never.npy",
    ]);
    assert_clean_error(&out, "two");
}

#[test]
fn unknown_flag_is_refused_without_panic() {
    let out = moerun(&["logits", "--modle", "x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--modle"));
}

#[test]
fn zero_threads_is_refused() {
    let out = moerun(&[
        "--threads",
        "0",
        "inspect",
        "--model",
        fixture("qwen3_moe_f32").to_str().unwrap(),
    ]);
    assert_clean_error(&out, "--threads");
}

#[test]
fn device_flag_names_a_bad_device_and_cuda_without_a_gpu_says_what_is_missing() {
    let dir = temp_dir("device");
    let out_file = dir.join("l.npy");
    let model = fixture("qwen3_moe_f32");
    let base = [
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--out",
        out_file.to_str().unwrap(),
    ];
    let mut args = base.to_vec();
    args.extend(["--device", "tpu"]);
    let out = moerun(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("'tpu'"),
        "{stderr}"
    );
    assert!(stderr.contains("cpu, cuda or cuda:N"), "{stderr}");

    let mut args = base.to_vec();
    args.extend(["--device", "cuda"]);
    let out = moerun(&args);
    if out.status.success() {
        // A machine with a GPU: the logits were written.
        assert!(out_file.exists());
    } else {
        assert_clean_error(&out, "CUDA is unavailable");
    }
}
