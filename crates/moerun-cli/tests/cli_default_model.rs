//! The embedded default model (models/default, built into the binary by build.rs): commands run
//! without `--model`, write a story, repeat exactly under a seed, and score the held-out text
//! with transformers' perplexity.

use std::path::Path;
use std::process::{Command, Output};

fn moerun(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moerun"))
        .args(args)
        .env("MOERUN_CACHE_DIR", cache)
        .output()
        .expect("run moerun")
}

fn cache_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("moerun-default-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn models_default() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/default")
}

#[test]
fn generate_without_model_writes_a_story_and_repeats_under_a_seed() {
    let cache = cache_dir("gen");
    let run = || {
        let out = moerun(
            &[
                "generate",
                "Once upon a time",
                "--seed",
                "3",
                "--max-tokens",
                "48",
                "--json",
            ],
            &cache,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json["text"].as_str().unwrap().to_string()
    };
    let first = run();
    assert_eq!(first, run(), "same seed, same story");
    let words = first.split_whitespace().count();
    assert!(words >= 20, "a story of some length: {first:?}");
    // The embedded copy is unpacked once, under a content-hash name.
    let unpacked: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
    assert_eq!(unpacked.len(), 1);
}

#[test]
fn default_model_perplexity_matches_transformers() {
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/default_model/reference.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let want = reference["perplexity"].as_f64().unwrap();
    let file = models_default().join("heldout.txt");
    let out = moerun(
        &[
            "perplexity",
            "--file",
            file.to_str().unwrap(),
            "--context",
            "512",
        ],
        &cache_dir("ppl"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("tokens: {}", reference["tokens"])),
        "{stdout}"
    );
    let got: f64 = stdout
        .lines()
        .last()
        .unwrap()
        .strip_prefix("perplexity: ")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        ((got - want) / want).abs() < 1e-4,
        "moerun {got} vs transformers {want}"
    );
}

#[test]
fn chat_without_model_answers_over_a_pipe() {
    use std::io::Write;
    let cache = cache_dir("chat");
    let mut child = Command::new(env!("CARGO_BIN_EXE_moerun"))
        .args(["chat", "--temperature", "0", "--max-tokens", "32"])
        .env("MOERUN_CACHE_DIR", &cache)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Write a story about a brave mouse.\n/exit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .count()
            >= 10
    );
}
