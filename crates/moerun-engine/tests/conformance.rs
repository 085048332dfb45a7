//! Conformance with Hugging Face transformers: every fixture in `tests/fixtures/` (tiny random
//! models built and scored by `tools/fixtures/make_fixtures.py` with transformers' own classes)
//! must give the same logits, through one prefill and token by token through the paged KV cache,
//! and the same greedy continuation. Mixed flat batches must equal lone runs bitwise. Hybrid
//! models (Qwen3.5's Gated DeltaNet layers) go through the same `run_step`, whose `SequenceKv`
//! keeps each sequence's linear-attention state.

mod reference;

use moerun_model::Model;
use reference::{
    batched_and_alone, fixture_names, fixtures_dir, greedy, incremental_logits, load_reference,
    model_picks_and_logit_argmax, prefill_logits, relative_error,
};

/// `LogitsFor::GreedyOfEachSeq` picks, for each sequence of a batch, the argmax of the logits
/// `LastOfEachSeq` returns, for every fixture.
#[test]
fn the_greedy_pick_is_the_argmax_of_the_logits() {
    for name in fixture_names() {
        let dir = fixtures_dir().join(&name);
        let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = load_reference(&dir);
        let (picked, argmax) = model_picks_and_logit_argmax(&model, &r.tokens);
        assert_eq!(picked.len(), 3, "{name}");
        assert_eq!(picked, argmax, "{name}");
    }
}

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
    let (batched, alone) = batched_and_alone(&model, &r.tokens);
    for (i, (got, want)) in batched.iter().zip(&alone).enumerate() {
        assert_eq!(got, want, "{name}: sequence {i} differs when batched");
    }
}
