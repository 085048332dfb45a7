//! Hybrid models (Qwen3.5-MoE: Gated DeltaNet layers beside full attention) keep a fixed-size
//! state per sequence next to its paged KV. These tests check what `conformance.rs` does not:
//! a prompt prefilled in several steps continues from its saved state and equals a one-shot
//! prefill, a flat batch mixing a prefill with another sequence's decode step equals each
//! sequence run alone bitwise, and misuse of state slots is refused instead of answered wrongly.

mod support;

use std::path::{Path, PathBuf};

use moerun_engine::Sequence;
use moerun_model::npy::read_npy_f32;
use moerun_model::{argmax, Batch, LogitsFor, Model, SeqChunk};
use support::{step, Caches};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn reference_tokens(dir: &Path, key: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// Logits of every prompt token, fed in steps of `chunks` tokens (the last step takes the rest),
/// then `n` greedy tokens; the sequence keeps state slot `slot` of a 4-slot cache.
fn chunked_prefill_then_greedy(
    model: &Model,
    prompt: &[u32],
    chunks: &[usize],
    slot: usize,
    n: usize,
) -> (Vec<f32>, Vec<u32>) {
    let mut caches = Caches::with_capacity(model, prompt.len() + n, 4);
    let mut seq = Sequence::new(prompt.to_vec());
    let mut logits = Vec::new();
    for &c in chunks.iter().chain(std::iter::once(&usize::MAX)) {
        let out = step(
            model,
            &mut caches,
            &mut [&mut seq],
            &[slot],
            &[c],
            LogitsFor::AllTokens,
        )
        .unwrap();
        logits.extend(out.logits);
    }
    assert_eq!(seq.cached, prompt.len());
    assert_eq!(caches.states.positions(slot), prompt.len());
    let v = model.config.vocab_size;
    let mut next = argmax(&logits[logits.len() - v..]);
    let mut greedy = vec![next];
    while greedy.len() < n {
        seq.tokens.push(next);
        let out = step(
            model,
            &mut caches,
            &mut [&mut seq],
            &[slot],
            &[usize::MAX],
            LogitsFor::LastOfEachSeq,
        )
        .unwrap();
        next = argmax(&out.logits);
        greedy.push(next);
    }
    (logits, greedy)
}

#[test]
fn prefill_split_in_three_steps_equals_one_shot_prefill_and_transformers() {
    for name in ["qwen3_5_moe_text_f32", "qwen3_5_moe_vl_bf16"] {
        let dir = fixture(name);
        let model = Model::load(&dir).unwrap();
        let prompt = reference_tokens(&dir, "tokens");
        let want_greedy = reference_tokens(&dir, "greedy");
        let (_, reference) = read_npy_f32(dir.join("logits.npy")).unwrap();

        let (one_shot, greedy_one_shot) =
            chunked_prefill_then_greedy(&model, &prompt, &[], 0, want_greedy.len());
        // Step boundaries that fall inside delta-rule chunks and KV blocks, and a one-token step
        // (the recurrent form) in the middle of the prompt.
        let (chunked, greedy_chunked) =
            chunked_prefill_then_greedy(&model, &prompt, &[23, 1, 40], 2, want_greedy.len());

        let vs_one_shot = relative_error(&chunked, &one_shot);
        let vs_transformers = relative_error(&chunked, &reference);
        println!(
            "{name}: chunked vs one-shot {vs_one_shot:.2e}, vs transformers {vs_transformers:.2e}"
        );
        assert!(vs_one_shot < 1e-5, "{name}: {vs_one_shot}");
        assert!(vs_transformers < 1e-4, "{name}: {vs_transformers}");
        assert_eq!(greedy_one_shot, want_greedy, "{name}: one-shot greedy");
        assert_eq!(greedy_chunked, want_greedy, "{name}: chunked greedy");
    }
}

#[test]
fn mixed_batch_of_a_prefill_and_a_decode_equals_each_sequence_alone_bitwise() {
    let dir = fixture("qwen3_5_moe_text_f32");
    let model = Model::load(&dir).unwrap();
    let tokens = reference_tokens(&dir, "tokens");
    let (a, b) = (tokens[..70].to_vec(), tokens[30..].to_vec());
    let v = model.config.vocab_size;

    // Alone: `a` in one prefill; `b` prefilled up to its last token, then that token decoded.
    let mut alone = Caches::with_capacity(&model, 256, 4);
    let mut sa = Sequence::new(a.clone());
    let a_alone = step(
        &model,
        &mut alone,
        &mut [&mut sa],
        &[3],
        &[usize::MAX],
        LogitsFor::AllTokens,
    )
    .unwrap()
    .logits;
    let mut sb = Sequence::new(b.clone());
    let b_head = step(
        &model,
        &mut alone,
        &mut [&mut sb],
        &[1],
        &[b.len() - 1],
        LogitsFor::AllTokens,
    )
    .unwrap()
    .logits;
    let b_last_alone = step(
        &model,
        &mut alone,
        &mut [&mut sb],
        &[1],
        &[1],
        LogitsFor::AllTokens,
    )
    .unwrap()
    .logits;

    // Together: `b` gets the same head start, then its decode step shares a batch with `a`'s
    // whole prefill; the slots differ from the lone run's on purpose.
    let mut shared = Caches::with_capacity(&model, 256, 4);
    let mut sb2 = Sequence::new(b.clone());
    let b_head2 = step(
        &model,
        &mut shared,
        &mut [&mut sb2],
        &[2],
        &[b.len() - 1],
        LogitsFor::AllTokens,
    )
    .unwrap()
    .logits;
    let mut sa2 = Sequence::new(a.clone());
    let batched = step(
        &model,
        &mut shared,
        &mut [&mut sb2, &mut sa2],
        &[2, 0],
        &[usize::MAX, usize::MAX],
        LogitsFor::AllTokens,
    )
    .unwrap()
    .logits;

    assert_eq!(b_head2, b_head);
    assert_eq!(
        &batched[..v],
        &b_last_alone[..],
        "decode step differs when batched"
    );
    assert_eq!(&batched[v..], &a_alone[..], "prefill differs when batched");
}

#[test]
fn state_slots_that_do_not_match_their_chunks_are_refused() {
    let dir = fixture("qwen3_5_moe_text_f32");
    let model = Model::load(&dir).unwrap();
    let tokens = reference_tokens(&dir, "tokens");
    let mut caches = Caches::with_capacity(&model, 64, 2);
    let mut seq = Sequence::new(tokens[..20].to_vec());
    step(
        &model,
        &mut caches,
        &mut [&mut seq],
        &[0],
        &[10],
        LogitsFor::LastOfEachSeq,
    )
    .unwrap();

    // The sequence's state is in slot 0; continuing it from slot 1 is caught, not computed.
    let err = step(
        &model,
        &mut caches,
        &mut [&mut seq],
        &[1],
        &[5],
        LogitsFor::LastOfEachSeq,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("slot 1 holds 0 positions") && err.contains("position 10"),
        "{err}"
    );

    // Two sequences may not share a slot, and every sequence needs one.
    let mut other = Sequence::new(tokens[..4].to_vec());
    let err = step(
        &model,
        &mut caches,
        &mut [&mut seq, &mut other],
        &[0, 0],
        &[1, 1],
        LogitsFor::LastOfEachSeq,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("two sequences"), "{err}");

    // The plain forward cannot reach the state and says so by name.
    let chunk = SeqChunk {
        tokens: &tokens[..1],
        start_pos: 0,
        block_table: &seq.table,
    };
    let err = model
        .forward(
            &Batch::new(vec![chunk]),
            caches.kv.cache_mut(),
            LogitsFor::AllTokens,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("qwen3_5_moe") && err.contains("forward_with_state"),
        "{err}"
    );
    let err = model
        .forward_with_state(
            &Batch::new(vec![chunk]),
            caches.kv.cache_mut(),
            &mut model.new_linear_state(1),
            LogitsFor::AllTokens,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("one state slot per sequence"), "{err}");
}

#[test]
fn multimodal_checkpoint_runs_its_language_model_and_keeps_the_mtp_head() {
    let model = Model::load(&fixture("qwen3_5_moe_vl_bf16")).unwrap();
    assert!(model.config.has_vision_tower);
    let mtp: Vec<&str> = model.weights.mtp.keys().map(String::as_str).collect();
    assert_eq!(mtp.len(), 8, "{mtp:?}");
    assert!(mtp.contains(&"mtp.fc.weight"), "{mtp:?}");
    assert_eq!(model.weights.mtp["mtp.fc.weight"].shape, vec![48, 96]);
    // full_attention_interval 2 with no layer_types: linear, full, linear, full.
    let mixers: Vec<String> = model
        .config
        .layers
        .iter()
        .map(|l| format!("{:?}", l.mixer))
        .collect();
    assert_eq!(
        mixers,
        ["GatedDeltaNet", "Attention", "GatedDeltaNet", "Attention"]
    );
}
