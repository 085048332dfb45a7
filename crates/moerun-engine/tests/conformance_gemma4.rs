//! Gemma 4 beyond the shared conformance checks (`conformance.rs` runs every Gemma 4 fixture
//! against transformers): a prompt fed in uneven steps that cross KV blocks and the sliding window
//! gives the logits of one prefill bitwise, and the KV cache keeps pools only for layers that
//! produce K/V, each with its own shape.

use std::path::{Path, PathBuf};

use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::kv::KV_BYTES_PER_VALUE;
use moerun_model::{KvCache, LogitsFor, Model};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn prompt(dir: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Logits of every position, the prompt fed `steps[i]` tokens at a time.
fn stepped_logits(model: &Model, tokens: &[u32], steps: &[usize]) -> Vec<f32> {
    let mut kv = SequenceKv::with_capacity(&model.config, tokens.len());
    let mut seq = Sequence::new(tokens.to_vec());
    let mut all = Vec::new();
    for &n in steps {
        let out = run_step(model, &mut kv, &mut [&mut seq], &[n], LogitsFor::AllTokens).unwrap();
        all.extend(out.logits);
    }
    assert_eq!(seq.cached, tokens.len());
    all
}

#[test]
fn prompt_in_uneven_steps_across_blocks_and_window_equals_one_prefill_bitwise() {
    for name in [
        "gemma4_moe_f32",
        "gemma4_moe_kv_shared_ple_f32",
        "gemma4_vl_bf16",
    ] {
        let dir = fixture(name);
        let model = Model::load(&dir).unwrap();
        let tokens = prompt(&dir);
        let one = stepped_logits(&model, &tokens, &[usize::MAX]);
        // 5 | 16 (crosses the first block boundary and the window) | 1 | the rest.
        let rest = tokens.len() - 22;
        let stepped = stepped_logits(&model, &tokens, &[5, 16, 1, rest]);
        assert_eq!(stepped, one, "{name}");
    }
}

#[test]
fn kv_pools_follow_each_layers_shape_and_shared_layers_keep_none() {
    let model = Model::load(&fixture("gemma4_moe_kv_shared_ple_f32")).unwrap();
    let cfg = &model.config;
    // Layers 3 and 4 read layers 2 and 1; sliding layers 2 kv × 16, full 2 kv × 24.
    let shapes: Vec<Option<(usize, usize)>> = (0..cfg.num_layers())
        .map(|l| cfg.layer_kv_shape(l))
        .collect();
    assert_eq!(
        shapes,
        vec![Some((2, 16)), Some((2, 24)), Some((2, 16)), None, None]
    );
    let per_token = cfg.kv_bytes_per_token(KV_BYTES_PER_VALUE);
    assert_eq!(
        per_token,
        2 * (2 * 16 + 2 * 24 + 2 * 16) * KV_BYTES_PER_VALUE
    );
    let cache = KvCache::new(cfg, 4, 16);
    assert_eq!(cache.bytes(), per_token * 4 * 16);
}
