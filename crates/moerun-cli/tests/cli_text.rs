//! End-to-end text commands against transformers: `generate` (plain and `--chat`), `chat` over a
//! pipe, and `perplexity`, on a fixture whose references come from transformers' own
//! `generate()` and log-softmax (tools/fixtures/make_text_fixture.py). Plus the refusals.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures_text/qwen3_moe_chat")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("text_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn moerun(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moerun"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run moerun");
    let mut pipe = child.stdin.take().unwrap();
    if let Some(input) = stdin {
        pipe.write_all(input.as_bytes()).unwrap();
    }
    drop(pipe);
    child.wait_with_output().unwrap()
}

fn case(kind: &str) -> serde_json::Value {
    reference()["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == kind)
        .unwrap()
        .clone()
}

fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains(needle), "'{needle}' not in: {stderr}");
}

#[test]
fn greedy_generate_matches_transformers_generate() {
    let dir = fixture();
    for (kind, chat) in [("text", false), ("chat", true)] {
        let c = case(kind);
        let mut args = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "--json",
        ];
        if chat {
            args.push("--chat");
        }
        args.push(c["prompt"].as_str().unwrap());
        let out = moerun(&args, None);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            json["text"], c["text"],
            "{kind}: text differs from transformers"
        );
        assert_eq!(
            json["completion_tokens"].as_u64().unwrap() as usize,
            c["greedy_ids"].as_array().unwrap().len()
        );
        assert_eq!(
            json["prompt_tokens"].as_u64().unwrap() as usize,
            c["prompt_ids"].as_array().unwrap().len()
        );
    }
}

#[test]
fn streamed_generate_prints_the_same_text_and_a_stats_line() {
    let c = case("text");
    let dir = fixture();
    let out = moerun(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            c["prompt"].as_str().unwrap(),
        ],
        None,
    );
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{}\n", c["text"].as_str().unwrap())
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("prompt tokens") && stderr.contains("decode") && stderr.contains("tok/s"),
        "{stderr}"
    );
}

#[test]
fn prompt_is_read_from_stdin_when_not_given() {
    let c = case("text");
    let dir = fixture();
    let out = moerun(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "--json",
        ],
        Some(c["prompt"].as_str().unwrap()),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["text"], c["text"]);
}

#[test]
fn seeded_sampling_repeats_exactly_and_seeds_differ() {
    let dir = fixture();
    let run = |seed: &str| {
        let out = moerun(
            &[
                "generate",
                "--model",
                dir.to_str().unwrap(),
                "--temperature",
                "1.0",
                "--seed",
                seed,
                "--max-tokens",
                "24",
                "--json",
                "Once",
            ],
            None,
        );
        assert!(out.status.success());
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json["text"].as_str().unwrap().to_string()
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
}

#[test]
fn chat_over_a_pipe_answers_like_transformers_and_handles_commands() {
    let c = case("chat");
    let dir = fixture();
    let input = format!(
        "{}\n/reset\n{}\n/exit\nnever read\n",
        c["prompt"].as_str().unwrap(),
        c["prompt"].as_str().unwrap()
    );
    let out = moerun(
        &[
            "chat",
            "--model",
            dir.to_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "24",
        ],
        Some(&input),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = format!("{}\n", c["text"].as_str().unwrap());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{want}{want}"),
        "same answer before and after /reset"
    );
}

#[test]
fn chat_second_turn_reuses_the_cached_prefix_and_matches_a_fresh_render() {
    // Two turns through `chat` must equal what `generate --chat` gives for the second turn's
    // whole conversation rendered fresh: the KV prefix reuse may not change a token.
    let dir = fixture();
    let c = case("chat");
    let first = c["text"].as_str().unwrap();
    let out = moerun(
        &[
            "chat",
            "--model",
            dir.to_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "24",
        ],
        Some("Tell me about the owl.\nAnd the fox?\n"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(stdout.starts_with(&format!("{first}\n")));
    assert!(
        stdout.len() > first.len() + 1,
        "a second answer was printed"
    );
}

#[test]
fn perplexity_matches_transformers() {
    let r = reference();
    let want = r["perplexity"]["value"].as_f64().unwrap();
    let context = r["perplexity"]["context"].to_string();
    let dir = fixture();
    let file = dir.join("perplexity.txt");
    let out = moerun(
        &[
            "perplexity",
            "--model",
            dir.to_str().unwrap(),
            "--file",
            file.to_str().unwrap(),
            "--context",
            &context,
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap();
    let got: f64 = last.strip_prefix("perplexity: ").unwrap().parse().unwrap();
    assert!(
        ((got - want) / want).abs() < 1e-4,
        "moerun {got} vs transformers {want}"
    );
}

#[test]
fn text_commands_refuse_bad_input_by_name() {
    let dir = fixture();
    let model = dir.to_str().unwrap();
    // A checkpoint without tokenizer.json: the missing file is named.
    let no_tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe_f32");
    assert_clean_error(
        &moerun(
            &["generate", "--model", no_tok.to_str().unwrap(), "hi"],
            None,
        ),
        "tokenizer.json",
    );
    assert_clean_error(
        &moerun(&["generate", "--model", model, "   "], None),
        "empty",
    );
    assert_clean_error(&moerun(&["generate", "--model", model], Some("")), "empty");
    assert_clean_error(
        &moerun(&["generate", "--model", model, "--system", "s", "hi"], None),
        "--chat",
    );
    assert_clean_error(
        &moerun(
            &["generate", "--model", model, "--top-p", "1.5", "hi"],
            None,
        ),
        "top_p",
    );
    assert_clean_error(
        &moerun(
            &["generate", "--model", model, "--temperature=-1", "hi"],
            None,
        ),
        "temperature",
    );
    assert_clean_error(
        &moerun(&["generate", "--model", model, "--stop", "", "hi"], None),
        "stop",
    );
    assert_clean_error(
        &moerun(
            &["generate", "--model", model, "--max-tokens", "0", "hi"],
            None,
        ),
        "--max-tokens",
    );
    // No input: the flag is refused before chat reads any (piped text could meet a closed pipe).
    assert_clean_error(
        &moerun(&["chat", "--model", model, "--max-tokens", "0"], None),
        "at least 1",
    );
    assert_clean_error(
        &moerun(&["generate", "--model", model, "--bogus", "hi"], None),
        "--bogus",
    );
    assert_clean_error(
        &moerun(
            &["perplexity", "--model", model, "--file", "/nonexistent.txt"],
            None,
        ),
        "/nonexistent.txt",
    );
    let long = "the fox ran to the river and ".repeat(600);
    assert_clean_error(
        &moerun(&["generate", "--model", model, &long], None),
        "context",
    );
}
