//! Conformance with Hugging Face transformers: every fixture in `tests/fixtures/` (tiny random
//! models built and scored by `tools/fixtures/make_fixtures.py` with transformers' own classes)
//! must give the same logits, through one prefill and token by token through the paged KV cache,
//! and the same greedy continuation. Mixed flat batches must equal lone runs bitwise. Hybrid
//! models (Qwen3.5's Gated DeltaNet layers) go through the same `run_step`, whose `SequenceKv`
//! keeps each sequence's linear-attention state.

mod reference;

use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::{LogitsFor, Model};
use reference::{
    fixture_names, fixtures_dir, greedy, incremental_logits, load_reference, prefill_logits,
    relative_error,
};

#[test]
fn every_fixture_matches_transformers_prefill_incremental_and_greedy() {
    let mut failures = Vec::new();
    let names = fixture_names();
    assert!(
        names.len() >= 7,
        "expected the fixture set, found {names:?}"
    );
    for name in names {
        let dir = fixtures_dir().join(&name);
        let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = load_reference(&dir);
        let prefill = relative_error(&prefill_logits(&model, &r.tokens), &r.logits);
        let incremental = relative_error(&incremental_logits(&model, &r.tokens), &r.logits);
        let continuation = greedy(&model, &r.tokens, r.greedy.len());
        println!(
            "{name:36} prefill {prefill:.2e}  incremental {incremental:.2e}  tol {:.0e}",
            r.tolerance()
        );
        if prefill > r.tolerance() || incremental > r.tolerance() {
            failures.push(format!(
                "{name}: prefill {prefill:.3e}, incremental {incremental:.3e} > {}",
                r.tolerance()
            ));
        }
        if continuation != r.greedy {
            failures.push(format!(
                "{name}: greedy {continuation:?} != transformers {:?}",
                r.greedy
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn mixed_flat_batch_equals_each_sequence_alone_bitwise() {
    // Gemma 4: sliding windows shorter than the sequences, KV shared across layers, per-layer
    // inputs; the flat batch must not change any of it.
    for name in [
        "qwen3_moe_f32",
        "gemma4_moe_f32",
        "gemma4_moe_kv_shared_ple_f32",
    ] {
        mixed_batch_equals_alone(name);
    }
}

fn mixed_batch_equals_alone(name: &str) {
    let dir = fixtures_dir().join(name);
    let model = Model::load(&dir).unwrap();
    let r = load_reference(&dir);
    // Three sequences of different lengths; the third is mid-decode when batched with prefills.
    let prompts: Vec<Vec<u32>> = vec![
        r.tokens[..37].to_vec(),
        r.tokens[5..12].to_vec(),
        r.tokens[20..].to_vec(),
    ];
    let alone: Vec<Vec<f32>> = prompts.iter().map(|p| prefill_logits(&model, p)).collect();

    let mut kv = SequenceKv::with_capacity(&model.config, 256);
    let mut seqs: Vec<Sequence> = prompts.iter().map(|p| Sequence::new(p.clone())).collect();
    // Give the third sequence a head start so the batch mixes decode-like and prefill chunks.
    let head_start = run_step(
        &model,
        &mut kv,
        &mut [&mut seqs[2]],
        &[prompts[2].len() - 1],
        LogitsFor::AllTokens,
    )
    .unwrap();
    let [a, b, c] = &mut seqs[..] else {
        unreachable!()
    };
    let batched = run_step(
        &model,
        &mut kv,
        &mut [a, b, c],
        &[usize::MAX; 3],
        LogitsFor::AllTokens,
    )
    .unwrap();

    let v = model.config.vocab_size;
    let n0 = prompts[0].len();
    let n1 = prompts[1].len();
    assert_eq!(
        &batched.logits[..n0 * v],
        &alone[0][..],
        "{name}: sequence 0 differs when batched"
    );
    assert_eq!(
        &batched.logits[n0 * v..(n0 + n1) * v],
        &alone[1][..],
        "{name}: sequence 1 differs when batched"
    );
    let mut third = head_start.logits;
    third.extend_from_slice(&batched.logits[(n0 + n1) * v..]);
    assert_eq!(
        third, alone[2],
        "{name}: sequence 2 (chunked across steps) differs"
    );
}
