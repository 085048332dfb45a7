//! The committed transformers fixtures (`tests/fixtures/`) and what the conformance tests do with
//! them: read the reference logits and greedy continuation, run a model through `run_step` by
//! one prefill, token by token, or greedily, and compare logits by norm-wise relative error.
//! KV caches come from `SequenceKv::for_model`, so the same helpers drive a CPU or a GPU model.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::npy::read_npy_f32;
use moerun_model::{LogitsFor, Model};

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every fixture directory with a `reference.json`, sorted.
pub fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures exists")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("reference.json").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// What transformers computed for a fixture.
pub struct Reference {
    pub tokens: Vec<u32>,
    pub greedy: Vec<u32>,
    pub logits: Vec<f32>,
    pub f32_weights: bool,
}

impl Reference {
    /// The bar against transformers: 1e-4 for f32 weights, 1e-3 for bf16 weights.
    pub fn tolerance(&self) -> f64 {
        if self.f32_weights {
            1e-4
        } else {
            1e-3
        }
    }
}

pub fn load_reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (_, logits) = read_npy_f32(dir.join("logits.npy")).unwrap();
    Reference {
        tokens: ids("tokens"),
        greedy: ids("greedy"),
        logits,
        f32_weights: json["dtype"].as_str() == Some("float32"),
    }
}

/// `‖got − want‖ / ‖want‖`, in f64.
pub fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// The greedy pick of a row (moerun-model's: the lowest index among equal maxima).
pub fn argmax(row: &[f32]) -> u32 {
    moerun_model::argmax(row)
}

/// Logits of every position through one prefill, or (`prefill` false) one token per step
/// through the KV cache, and the cache after it.
pub fn logits_with_kv(model: &Model, tokens: &[u32], prefill: bool) -> (Vec<f32>, SequenceKv) {
    let mut kv = SequenceKv::for_model(model, tokens.len()).unwrap();
    let mut seq = Sequence::new(tokens.to_vec());
    let (chunk, logits_for, steps) = if prefill {
        (usize::MAX, LogitsFor::AllTokens, 1)
    } else {
        (1, LogitsFor::LastOfEachSeq, tokens.len())
    };
    let mut all = Vec::new();
    for _ in 0..steps {
        let out = run_step(model, &mut kv, &mut [&mut seq], &[chunk], logits_for);
        all.extend(out.unwrap().logits);
    }
    (all, kv)
}

/// Logits of every position through one prefill.
pub fn prefill_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    logits_with_kv(model, tokens, true).0
}

/// Logits of every position, one token per step through the KV cache.
pub fn incremental_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    logits_with_kv(model, tokens, false).0
}

/// `n` greedy tokens after `prompt`.
pub fn greedy(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut kv = SequenceKv::for_model(model, prompt.len() + n).unwrap();
    let mut seq = Sequence::new(prompt.to_vec());
    let mut out = Vec::new();
    for _ in 0..n {
        // The model's own pick (on the GPU: picked on the device; only the id comes back).
        let step = run_step(
            model,
            &mut kv,
            &mut [&mut seq],
            &[usize::MAX],
            LogitsFor::GreedyOfEachSeq,
        );
        let next = step.unwrap().tokens[0];
        out.push(next);
        seq.tokens.push(next);
    }
    out
}

/// Three sequences of different lengths cut from `tokens`, prefilled as one batch twice: the
/// tokens the model picks (`GreedyOfEachSeq`) and the argmax of the logits it returns
/// (`LastOfEachSeq`), per sequence.
pub fn model_picks_and_logit_argmax(model: &Model, tokens: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let prompts = [&tokens[..37], &tokens[5..12], &tokens[20..]];
    let run = |which| {
        let mut kv = SequenceKv::for_model(model, 256).unwrap();
        let mut seqs: Vec<Sequence> = prompts.iter().map(|p| Sequence::new(p.to_vec())).collect();
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        run_step(model, &mut kv, &mut refs, &[usize::MAX; 3], which).unwrap()
    };
    let picked = run(LogitsFor::GreedyOfEachSeq);
    assert!(picked.logits.is_empty(), "a greedy pass returns no logits");
    let logits = run(LogitsFor::LastOfEachSeq).logits;
    let vocab = model.config.vocab_size;
    (
        picked.tokens,
        logits.chunks_exact(vocab).map(argmax).collect(),
    )
}

/// The mixed-batch scenario: three sequences of different lengths cut from `tokens`, the third a
/// step ahead (all but its last token already run) so the batch mixes prefill and decode-like
/// chunks. Returns, per sequence, its logits from the flat batch (the third's joined across its
/// two steps) and from a lone prefill.
pub fn batched_and_alone(model: &Model, tokens: &[u32]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let prompts: Vec<Vec<u32>> = vec![
        tokens[..37].to_vec(),
        tokens[5..12].to_vec(),
        tokens[20..].to_vec(),
    ];
    let alone: Vec<Vec<f32>> = prompts.iter().map(|p| prefill_logits(model, p)).collect();
    let mut kv = SequenceKv::for_model(model, 256).unwrap();
    let mut seqs: Vec<Sequence> = prompts.iter().map(|p| Sequence::new(p.clone())).collect();
    let head_start = run_step(
        model,
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
        model,
        &mut kv,
        &mut [a, b, c],
        &[usize::MAX; 3],
        LogitsFor::AllTokens,
    )
    .unwrap()
    .logits;
    let v = model.config.vocab_size;
    let (n0, n1) = (prompts[0].len() * v, prompts[1].len() * v);
    let mut third = head_start.logits;
    third.extend_from_slice(&batched[n0 + n1..]);
    let per_seq = vec![batched[..n0].to_vec(), batched[n0..n0 + n1].to_vec(), third];
    (per_seq, alone)
}

/// Fixtures whose sliding-window layers see fewer positions than the fixture has tokens.
pub const WINDOWED_FIXTURES: &[&str] = &[
    "gemma4_dense_defaults_f32",
    "gemma4_moe_f32",
    "gemma4_moe_kv_shared_ple_f32",
    "mixtral_bf16_swa_llama3_v4",
    "qwen2_dense_swa_yarn",
];

/// Block size of [`chunked_logits`]: small, so windows cross several blocks.
const WINDOW_TEST_BLOCK_SIZE: usize = 4;

/// Logits of every position of `tokens` run as a prefill chunk of `first_chunk` tokens, then
/// chunks of 3, then one token at a time. With `window_group`, the KV cache keeps the
/// sliding-window layers in a pool of exactly the blocks one sequence can hold at once (its
/// window before a chunk plus the chunk), and after every step the blocks that have left the
/// window are released and recycled: a pool any smaller would run out, so this also proves the
/// bound. Without, one ordinary cache (the reference the windowed run must equal bitwise).
pub fn chunked_logits(
    model: &Model,
    tokens: &[u32],
    first_chunk: usize,
    window_group: bool,
) -> Vec<f32> {
    use moerun_core::{BlockAllocator, BlockTable};
    use moerun_model::{Batch, SeqChunk};
    let bs = WINDOW_TEST_BLOCK_SIZE;
    let window = model.config.kv_window().expect("a windowed fixture");
    let full_blocks = tokens.len().div_ceil(bs);
    let window_blocks = (window - 1 + first_chunk).div_ceil(bs) + 1;
    let mut kv = if window_group {
        model
            .new_kv_cache_with_window_group(full_blocks, window_blocks, bs)
            .unwrap()
    } else {
        model.new_kv_cache(full_blocks, bs).unwrap()
    };
    let mut full = BlockAllocator::new(full_blocks, bs);
    let mut windowed = BlockAllocator::new(window_blocks, bs);
    let (mut table, mut window_table) = (BlockTable::default(), BlockTable::default());
    let mut all = Vec::new();
    let mut start = 0;
    while start < tokens.len() {
        let n = match start {
            0 => first_chunk,
            s if s < first_chunk + 6 => 3,
            _ => 1,
        }
        .min(tokens.len() - start);
        let end = start + n;
        full.reserve(&mut table, end).unwrap();
        let mut batch = Batch::new(vec![SeqChunk {
            tokens: &tokens[start..end],
            start_pos: start,
            block_table: &table,
        }]);
        if window_group {
            windowed.release_before(&mut window_table, (start + 1).saturating_sub(window));
            windowed.reserve(&mut window_table, end).unwrap();
            batch = batch.with_window_tables(vec![&window_table]);
        }
        let out = model
            .forward(&batch, &mut kv, LogitsFor::AllTokens)
            .unwrap();
        all.extend(out.logits);
        start = end;
    }
    all
}
