//! End-to-end: `moerun inspect` on the Gemma 4 fixtures, which transformers wrote. Their stored
//! parameters are the config's count plus one `layer_scalar` per layer (a buffer, which
//! configs/README.md does not count), so the stats arithmetic (per-layer shapes, KV sharing,
//! `attention_k_eq_v`, per-layer inputs, double-wide MLPs) is checked against transformers' own
//! modules.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn moerun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moerun"))
        .args(args)
        .output()
        .expect("run moerun")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn inspect(name: &str) -> (String, String) {
    let dir = fixture(name);
    let out = moerun(&["inspect", "--model", dir.to_str().expect("utf-8 path")]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    (String::from_utf8(out.stdout).expect("utf-8 output"), stderr)
}

/// The value column of the row called `key`.
fn row<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .lines()
        .find_map(|l| l.strip_prefix(key).filter(|rest| rest.starts_with(' ')))
        .unwrap_or_else(|| panic!("no '{key}' row in:\n{report}"))
        .trim()
}

#[test]
fn parameter_counts_are_transformers_checkpoints_less_the_layer_scalars() {
    for (name, layers, implied) in [
        ("gemma4_moe_f32", 6, 309_088),
        ("gemma4_moe_kv_shared_ple_f32", 5, 198_430),
        ("gemma4_dense_defaults_f32", 7, 99_744),
    ] {
        let (report, _) = inspect(name);
        assert_eq!(
            row(&report, "note"),
            format!(
                "the checkpoint stores {} parameters; the config implies {implied}",
                implied + layers
            ),
            "{name}"
        );
        assert_eq!(row(&report, "family"), "gemma4");
    }
}

#[test]
fn shapes_sharing_and_windows_are_described() {
    let (report, _) = inspect("gemma4_moe_kv_shared_ple_f32");
    assert_eq!(
        row(&report, "heads"),
        "4 q; sliding: 2 kv × 16; full: 2 kv × 24"
    );
    // Layers 0 and 2 (sliding, 2·2·16 f32) and 1 (full, 2·2·24 f32); 3 and 4 keep none.
    assert_eq!(
        row(&report, "kv cache"),
        "896 B per token (896 bytes, f32; half with --kv-dtype bf16)"
    );
    assert!(
        row(&report, "kv layers").ends_with("2 reuse an earlier layer's (3→2, 4→1)"),
        "{report}"
    );
    assert_eq!(
        row(&report, "rope"),
        "sliding: default, theta 10000; full: proportional, theta 500000, 6 of 12 pairs rotate, \
         factor 2"
    );
    assert_eq!(
        row(&report, "per-layer input"),
        "8 per layer (table 320 × 40)"
    );
    assert_eq!(row(&report, "sliding window"), "10 tokens on 3 of 5 layers");
}

#[test]
fn multimodal_towers_are_announced_once_each_and_not_loaded() {
    let (report, stderr) = inspect("gemma4_vl_bf16");
    assert_eq!(row(&report, "not run"), "vision, audio tower(s)");
    assert_eq!(
        row(&report, "heads"),
        "4 q; sliding: 2 kv × 16; full: 1 kv × 32, K = V projection"
    );
    let lines: Vec<&str> = stderr.trim().lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines[0].contains("vision tower (16 tensors"), "{stderr}");
    assert!(lines[1].contains("audio tower (70 tensors"), "{stderr}");
}
