//! The fixtures of `conformance.rs` on the GPU (`--device cuda`): every fixture (every family)
//! must match transformers and the CPU path, through one prefill and token by token, and
//! give transformers' greedy continuation; a mixed flat batch must equal lone runs. Without a GPU every test
//! prints "skipped: <reason>" and passes (scripts/gpu-check.sh treats a skip on the GPU machine
//! as a failure).
//!
//! Tolerances (norm-wise relative error of the logits), against transformers and against the CPU:
//! - f32 weights: 1e-4, the CPU's own bar. Both GPU paths stay in f32 (the GEMV, and an f32
//!   SGEMM for prefill), so only summation order separates them from the CPU (~1e-6 seen).
//! - bf16 weights: 1e-3 token by token (the GEMV widens bf16 weights and keeps f32
//!   activations, like the CPU); 2e-2 for prefill, where cuBLAS multiplies on tensor cores and
//!   rounds the activations to bf16 first (2⁻⁹ relative per element, compounded over layers).
//!   Greedy continuations are compared for f32 fixtures only.

mod reference;

use std::path::Path;

use moerun_core::{DType, Device};
use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::{LogitsFor, Model};
use reference::{
    batched_and_alone, chunked_logits, fixture_names, fixtures_dir, greedy, incremental_logits,
    load_reference, logits_with_kv, model_picks_and_logit_argmax, prefill_logits, relative_error,
    WINDOWED_FIXTURES,
};

/// The model on GPU 0, or `None` (with the skip line printed) when CUDA is unavailable here.
fn on_gpu(dir: &Path) -> Option<Result<Model, String>> {
    match Model::load_on(dir, Device::Cuda(0)) {
        Ok(m) => Some(Ok(m)),
        Err(e) if e.to_string().contains("CUDA is unavailable") => {
            println!("skipped: {e}");
            None
        }
        Err(e) => Some(Err(e.to_string())),
    }
}

/// The qwen3_moe_f32 fixture's directory, model on GPU 0 and reference (`None`: skipped).
fn qwen3_moe_f32_on_gpu() -> Option<(std::path::PathBuf, Model, reference::Reference)> {
    let dir = fixtures_dir().join("qwen3_moe_f32");
    let model = on_gpu(&dir)?.unwrap();
    let r = load_reference(&dir);
    Some((dir, model, r))
}

#[test]
fn every_fixture_matches_transformers_and_the_cpu_on_the_gpu() {
    let mut failures = Vec::new();
    let mut ran = 0;
    for name in fixture_names() {
        let dir = fixtures_dir().join(&name);
        let Some(gpu) = on_gpu(&dir) else { return };
        let gpu = match gpu {
            Ok(m) => m,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let cpu = Model::load(&dir).unwrap();
        let r = load_reference(&dir);
        let (tol_prefill, tol_step) = if r.f32_weights {
            (1e-4, 1e-4)
        } else {
            (2e-2, 1e-3)
        };
        let prefill = prefill_logits(&gpu, &r.tokens);
        let steps = incremental_logits(&gpu, &r.tokens);
        let cpu_prefill = prefill_logits(&cpu, &r.tokens);
        let errs = [
            (
                "prefill vs transformers",
                relative_error(&prefill, &r.logits),
                tol_prefill,
            ),
            (
                "incremental vs transformers",
                relative_error(&steps, &r.logits),
                tol_step,
            ),
            (
                "prefill vs cpu",
                relative_error(&prefill, &cpu_prefill),
                tol_prefill,
            ),
            (
                "incremental vs cpu",
                relative_error(&steps, &cpu_prefill),
                tol_step,
            ),
        ];
        println!(
            "{name:36} {}",
            errs.iter()
                .map(|(what, e, _)| format!("{what} {e:.2e}"))
                .collect::<Vec<_>>()
                .join("  ")
        );
        for (what, e, tol) in errs {
            println!(
                "RESULT|gpu {name} {what}|{e:.2e}|{tol:.0e}|{}",
                if e <= tol { "ok" } else { "FAIL" }
            );
            if e > tol {
                failures.push(format!("{name}: {what} {e:.3e} > {tol:.0e}"));
            }
        }
        if r.f32_weights {
            let continuation = greedy(&gpu, &r.tokens, r.greedy.len());
            if continuation != r.greedy {
                failures.push(format!(
                    "{name}: greedy {continuation:?} != transformers {:?}",
                    r.greedy
                ));
            }
        }
        ran += 1;
    }
    assert!(ran >= 7, "only {ran} fixtures ran on the GPU");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Logits of a run over `tokens` (one prefill, or token by token) and every layer's K/V after it.
fn logits_and_kv(model: &Model, tokens: &[u32], prefill: bool) -> (Vec<f32>, Vec<LayerKv>) {
    let (logits, mut kv) = logits_with_kv(model, tokens, prefill);
    let layers = (0..model.config.num_layers())
        .map(|l| kv.cache_mut().layer_kv(l).unwrap())
        .collect();
    (logits, layers)
}

/// One layer's K and V widened to f32, or `None` without K/V.
type LayerKv = Option<(Vec<f32>, Vec<f32>)>;

/// How two bf16 caches' layers differ: values not bit-equal over every layer, values compared,
/// and at the first layer with K/V the values more than one bf16 step (plus the f32 noise of
/// the two computations: 1e-5 of the layer's largest value) apart. The first layer's K/V come
/// from the embeddings through one norm and one projection on both sides, so they agree to
/// f32 rounding before the bf16 rounding and can only land one step apart; deeper layers
/// inherit what earlier differences did to the activations.
fn bf16_differences(name: &str, a: &[LayerKv], b: &[LayerKv]) -> (usize, usize, usize) {
    let (mut differ, mut compared, mut first_far) = (0, 0, 0);
    let mut first = true;
    for (l, pair) in a.iter().zip(b).enumerate() {
        let (Some((ak, av)), Some((bk, bv))) = pair else {
            continue;
        };
        assert_eq!(
            (ak.len(), av.len()),
            (bk.len(), bv.len()),
            "{name} layer {l}"
        );
        let largest = ak.iter().chain(av).fold(0.0f32, |m, x| m.max(x.abs()));
        for (x, y) in ak.iter().chain(av).zip(bk.iter().chain(bv)) {
            compared += 1;
            if x.to_bits() == y.to_bits() {
                continue;
            }
            differ += 1;
            // One bf16 step at the larger magnitude: 2^-7 of its power of two.
            let big = x.abs().max(y.abs());
            let step = f32::from_bits(big.to_bits() & 0x7f80_0000) / 128.0;
            if first && (x - y).abs() > step + 1e-5 * largest {
                first_far += 1;
            }
        }
        first = false;
    }
    (differ, compared, first_far)
}

/// A bf16 KV cache on the GPU (`Model::set_kv_dtype`, `--kv-dtype bf16`) against the CPU's, for
/// every fixture, through one prefill and token by token:
/// - the caches hold the same values: where both sides compute the K/V in f32 (f32 weights, or
///   token by token), they round each value to nearest even from f32 results orders of
///   summation apart, so at the first layer a value differs only where the two straddle a
///   rounding boundary, by one bf16 step; deeper layers inherit what those differences did to
///   the activations (on the H200: 0-3.7% of all values differ, 8% in one prefill of Gemma 4's
///   small MoE; none more than a step at the first layer). The rounding itself is checked bit
///   for bit by tests/attention.rs (kv_write, the q/k/v prologue);
/// - where no value differs, the logits agree within the bars of the f32 caches; where some
///   do (Gemma 4's small random models: sharp attention and routing amplify one step of 2^-8
///   to 1e-4..4e-2 in later positions, while their logits move 1.6e-2..1.8e-1 between an f32
///   and a bf16 cache on the CPU), within that movement;
/// - the bf16 pools hold half the bytes of the f32 ones; the attention scratch is unchanged.
#[test]
fn a_bf16_kv_cache_on_the_gpu_matches_the_cpus_bf16_cache() {
    let mut failures = Vec::new();
    for name in fixture_names() {
        let dir = fixtures_dir().join(&name);
        let Some(gpu) = on_gpu(&dir) else { return };
        let mut gpu = gpu.unwrap();
        let cpu_f32 = Model::load(&dir).unwrap();
        let mut cpu = Model::load(&dir).unwrap();
        let r = load_reference(&dir);
        let f32_cache = gpu.new_kv_cache(4, 16).unwrap();
        gpu.set_kv_dtype(DType::BF16).unwrap();
        cpu.set_kv_dtype(DType::BF16).unwrap();
        let bf16_cache = gpu.new_kv_cache(4, 16).unwrap();
        assert_eq!(bf16_cache.dtype(), DType::BF16, "{name}");
        assert_eq!(
            2 * bf16_cache.pool_bytes(),
            f32_cache.pool_bytes(),
            "{name}: the bf16 pools hold half the bytes"
        );
        assert_eq!(
            bf16_cache.bytes() - bf16_cache.pool_bytes(),
            f32_cache.bytes() - f32_cache.pool_bytes(),
            "{name}: the same scratch"
        );
        let (tol_prefill, tol_step) = if r.f32_weights {
            (1e-4, 1e-4)
        } else {
            (2e-2, 1e-3)
        };
        let (cpu_steps, _) = logits_and_kv(&cpu_f32, &r.tokens, false);
        for (what, prefill, tol) in [
            ("prefill", true, tol_prefill),
            ("incremental", false, tol_step),
        ] {
            let (got, got_kv) = logits_and_kv(&gpu, &r.tokens, prefill);
            let (want, want_kv) = logits_and_kv(&cpu, &r.tokens, prefill);
            let (differ, compared, first_far) = bf16_differences(&name, &got_kv, &want_kv);
            assert!(compared > 0, "{name}: no K/V compared");
            let e = relative_error(&got, &want);
            // Where values differ: the logits' own movement between an f32 and a bf16 cache.
            let bar = if differ == 0 {
                tol
            } else {
                relative_error(&want, &cpu_steps).max(tol)
            };
            println!(
                "RESULT|gpu {name} bf16 KV {what} vs cpu ({differ} of {compared} K/V values \
                 differ, {first_far} of the first layer's by more than a step)|{e:.2e}|{bar:.0e}|{}",
                if e <= bar { "ok" } else { "FAIL" }
            );
            // A bf16 model's prefill multiplies bf16-rounded activations on tensor cores (the
            // CPU keeps them f32): its K/V differ by more than rounding from the first layer on
            // (its logits' 2e-2 bar). Elsewhere both sides compute the first layer's K/V in f32.
            let f32_activations = r.f32_weights || !prefill;
            if e > bar || (f32_activations && first_far > 0) {
                failures.push(format!(
                    "{name}: bf16 KV {what} {e:.3e} (bar {bar:.0e}), {differ} of {compared} \
                     values differ, {first_far} far at the first layer"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The token the GPU picks for each sequence of a batch (argmax on the device, only the ids
/// downloaded) is the argmax of the logits it returns, for every fixture.
#[test]
fn the_gpu_greedy_pick_is_the_argmax_of_its_logits() {
    for name in fixture_names() {
        let dir = fixtures_dir().join(&name);
        let Some(model) = on_gpu(&dir) else { return };
        let Ok(model) = model else { continue };
        let r = load_reference(&dir);
        let (picked, argmax) = model_picks_and_logit_argmax(&model, &r.tokens);
        println!(
            "RESULT|gpu {name} greedy pick vs logits argmax|{}|-|{}",
            picked.len(),
            if picked == argmax { "ok" } else { "FAIL" }
        );
        assert_eq!(picked, argmax, "{name}");
    }
}

#[test]
fn mixed_flat_batch_equals_each_sequence_alone_on_the_gpu() {
    // qwen3_5: the Gated DeltaNet layers' per-sequence device state in a mixed batch.
    for name in ["qwen3_moe_f32", "qwen3_5_moe_text_f32"] {
        let dir = fixtures_dir().join(name);
        let Some(model) = on_gpu(&dir) else { return };
        let model = model.unwrap();
        let r = load_reference(&dir);
        let (batched, alone) = batched_and_alone(&model, &r.tokens);
        // Batched rows may take cuBLAS where lone decode rows take the GEMV: both f32 here, so
        // the summation order is all that differs.
        for (i, (got, want)) in batched.iter().zip(&alone).enumerate() {
            let e = relative_error(got, want);
            println!(
                "RESULT|gpu {name} batched seq {i} vs alone|{e:.2e}|1e-5|{}",
                if e <= 1e-5 { "ok" } else { "FAIL" }
            );
            assert!(e <= 1e-5, "{name} sequence {i}: batched vs alone {e:.3e}");
        }
    }
}

/// Two models on the same GPU, each driven by its own thread at the same time (each with its
/// own stream, KV cache and graphs), must give what one alone gives.
#[test]
fn two_models_decoding_at_once_in_two_threads_agree_with_one_alone() {
    let Some((dir, first, r)) = qwen3_moe_f32_on_gpu() else {
        return;
    };
    let alone = incremental_logits(&first, &r.tokens);
    let second = on_gpu(&dir).unwrap().unwrap();
    let (a, b) = std::thread::scope(|s| {
        let ta = s.spawn(|| incremental_logits(&first, &r.tokens));
        let tb = s.spawn(|| incremental_logits(&second, &r.tokens));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    for (what, got) in [("thread a", a), ("thread b", b)] {
        let e = relative_error(&got, &alone);
        println!(
            "RESULT|gpu two models at once: {what} vs alone|{e:.2e}|1e-6|{}",
            if e <= 1e-6 { "ok" } else { "FAIL" }
        );
        assert!(e <= 1e-6, "{what}: {e:.3e} against the lone run");
    }
}

/// Opening or dropping a device synchronises the whole GPU (cuBLAS handles, kernel modules): done
/// while another thread captured a decode graph, it once invalidated that capture, and the failed
/// capture's error then surfaced in the thread's next, unrelated call. Now captures and device
/// lifecycles exclude each other: a thread decoding two tokens at a time with fresh KV caches (a
/// capture each, so the thread is capturing most of the time) while another opens and drops
/// models gives the logits of the lone run every time.
#[test]
fn graphs_captured_while_another_thread_opens_and_drops_devices_give_the_lone_logits() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some((dir, model, r)) = qwen3_moe_f32_on_gpu() else {
        return;
    };
    let tokens = &r.tokens[..2];
    let alone = incremental_logits(&model, tokens);
    // incremental_logits, and whether its steps ran from a captured graph (not the eager
    // fallback a failed capture leaves: that would pass the logits check too).
    let run = || {
        let (logits, mut kv) = logits_with_kv(&model, tokens, false);
        (logits, kv.cache_mut().decode_graphs())
    };
    let done = AtomicBool::new(false);
    let (runs, churned) = std::thread::scope(|s| {
        let churn = s.spawn(|| {
            let mut opened = 0usize;
            while !done.load(Ordering::Relaxed) {
                drop(on_gpu(&dir).unwrap().unwrap());
                opened += 1;
            }
            opened
        });
        let runs: Vec<(Vec<f32>, Result<usize, String>)> = (0..150).map(|_| run()).collect();
        done.store(true, Ordering::Relaxed);
        (runs, churn.join().unwrap())
    });
    assert!(churned > 0, "the other thread never opened a device");
    for (i, (_, graphs)) in runs.iter().enumerate() {
        assert!(
            matches!(graphs, Ok(n) if *n >= 1),
            "run {i}: its decode steps did not run from a graph: {graphs:?}"
        );
    }
    let runs: Vec<Vec<f32>> = runs.into_iter().map(|(logits, _)| logits).collect();
    let worst = runs
        .iter()
        .map(|got| relative_error(got, &alone))
        .fold(0.0f64, f64::max);
    println!(
        "RESULT|gpu {} decodes while {churned} devices came and went|{worst:.2e}|1e-6|{}",
        runs.len(),
        if worst <= 1e-6 { "ok" } else { "FAIL" }
    );
    assert!(worst <= 1e-6, "{worst:.3e} against the lone run");
}

#[test]
fn windowed_kv_gives_the_logits_of_the_full_cache_on_the_gpu() {
    let mut failures = Vec::new();
    for name in WINDOWED_FIXTURES {
        let dir = fixtures_dir().join(name);
        let gpu = match on_gpu(&dir) {
            None => return,
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let r = load_reference(&dir);
        // Chunks of at most 5 tokens run the GEMV: the token-by-token bar applies.
        let plain = chunked_logits(&gpu, &r.tokens, 5, false);
        let windowed = chunked_logits(&gpu, &r.tokens, 5, true);
        let err = relative_error(&windowed, &r.logits);
        println!("{name:36} windowed KV on the GPU: {err:.1e} from transformers");
        if plain != windowed {
            let diff = relative_error(&windowed, &plain);
            failures.push(format!(
                "{name}: windowed KV changed the logits ({diff:.2e})"
            ));
        }
        if err >= r.tolerance() {
            failures.push(format!("{name}: {err:.2e} from transformers"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Decode steps of more than 32 sequences run from CUDA graphs on Hopper: the MoE layers take the
/// wgmma prefill path there, which never waits for the host. 40 sequences decoding together (a
/// first step that captures the bucket's graph, a second that replays it) give each sequence's
/// logits as the same steps alone give them, within the bf16 prefill bar: the batch's MoE rounds
/// to bf16 around the tensor cores, a lone decode step's does not. A capture that fails falls
/// back to eager steps (with the reason on stderr) and passes too: `MOERUN_CUDA_GRAPH_INFO=1`
/// shows whether bucket 48 was captured.
#[test]
fn forty_sequences_decode_from_a_graph_as_each_alone_on_the_gpu() {
    let name = "mixtral_bf16_swa_llama3_v4";
    let dir = fixtures_dir().join(name);
    let Some(model) = on_gpu(&dir) else { return };
    let model = model.unwrap();
    let t = load_reference(&dir).tokens;
    assert!(t.len() >= 6, "{name}: {} tokens", t.len());
    // Prompts of 4.. tokens from three starts, so the contexts differ; each ends with the two
    // tokens the decode steps feed.
    let prompts: Vec<Vec<u32>> = (0..40)
        .map(|i| {
            let start = i % 3;
            let len = 4 + i % (t.len() - 5);
            t[start..start + len].to_vec()
        })
        .collect();
    // Prefill all but the last two tokens, then two single-token steps; the decode logits (the
    // steps must run from a captured graph, not the eager fallback).
    let decode = |seqs: &mut Vec<Sequence>| -> Vec<Vec<f32>> {
        let total: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let mut kv = SequenceKv::for_model(&model, total + 16 * seqs.len()).unwrap();
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let heads: Vec<usize> = refs.iter().map(|s| s.tokens.len() - 2).collect();
        run_step(&model, &mut kv, &mut refs, &heads, LogitsFor::LastOfEachSeq).unwrap();
        let ones = vec![1; refs.len()];
        let logits = (0..2)
            .map(|_| {
                run_step(&model, &mut kv, &mut refs, &ones, LogitsFor::LastOfEachSeq)
                    .unwrap()
                    .logits
            })
            .collect();
        let graphs = kv.cache_mut().decode_graphs();
        assert!(
            matches!(graphs, Ok(n) if n >= 1),
            "{} sequences: decode steps not from a graph: {graphs:?}",
            refs.len()
        );
        logits
    };
    let mut batch: Vec<Sequence> = prompts.iter().map(|p| Sequence::new(p.clone())).collect();
    let batched = decode(&mut batch);
    let v = model.config.vocab_size;
    for (i, p) in prompts.iter().enumerate() {
        let alone = decode(&mut vec![Sequence::new(p.clone())]);
        for (step, (b, a)) in batched.iter().zip(&alone).enumerate() {
            let e = relative_error(&b[i * v..(i + 1) * v], a);
            println!(
                "RESULT|gpu {name} 40 decoding, seq {i} step {step} vs alone|{e:.2e}|2e-2|{}",
                if e <= 2e-2 { "ok" } else { "FAIL" }
            );
            assert!(e <= 2e-2, "{name} sequence {i} step {step}: {e:.3e}");
        }
    }
}

/// Greedy decode at batch 1 launches the next step before the host reads a step's pick
/// (moerun-model's cuda/ahead.rs). Whatever the caller does next, the tokens are those of steps
/// run one at a time (`LastOfEachSeq`: the logits come back, the host takes the arg-max, nothing
/// is launched ahead), for every fixture over 40 steps (crossing blocks, where no step is launched
/// ahead): one sequence fed its own picks; two sequences in one cache, decoded in turns (each
/// call discards the step launched for the other); and a sequence fed a token other than its
/// pick every fifth step (the step launched ahead decoded the pick, so it is discarded).
#[test]
fn greedy_steps_launched_ahead_give_the_tokens_of_steps_run_alone() {
    const STEPS: usize = 40;
    // The pick of each step through `which`; `feed(step, pick)` is the token the caller appends.
    let decode =
        |model: &Model, kv: &mut SequenceKv, seq: &mut Sequence, which: LogitsFor| -> u32 {
            let out = run_step(model, kv, &mut [seq], &[usize::MAX], which).unwrap();
            match which {
                LogitsFor::GreedyOfEachSeq => out.tokens[0],
                _ => moerun_model::argmax(&out.logits),
            }
        };
    for name in fixture_names() {
        let dir = fixtures_dir().join(&name);
        let Some(model) = on_gpu(&dir) else { return };
        let Ok(model) = model else { continue };
        let t = load_reference(&dir).tokens;
        let prompts = [t[..t.len().min(9)].to_vec(), t[t.len() / 2..].to_vec()];
        let vocab = model.config.vocab_size as u32;
        // Alone and in turns, each way.
        let run = |which: LogitsFor, turns: bool, forced: bool| -> Vec<Vec<u32>> {
            let room = prompts.iter().map(|p| p.len() + STEPS + 1).sum();
            let mut kv = SequenceKv::for_model(&model, room).unwrap();
            let mut seqs: Vec<Sequence> =
                prompts.iter().map(|p| Sequence::new(p.clone())).collect();
            let mut out = vec![Vec::new(); seqs.len()];
            let order: Vec<usize> = match turns {
                true => (0..STEPS).flat_map(|_| [0, 1]).collect(),
                false => vec![0; STEPS],
            };
            for (step, &i) in order.iter().enumerate() {
                let pick = decode(&model, &mut kv, &mut seqs[i], which);
                out[i].push(pick);
                let fed = match forced && step % 5 == 4 {
                    true => (pick + 1) % vocab,
                    false => pick,
                };
                seqs[i].tokens.push(fed);
            }
            out
        };
        for (turns, forced, what) in [
            (false, false, "alone"),
            (true, false, "in turns"),
            (false, true, "fed other tokens"),
        ] {
            let ahead = run(LogitsFor::GreedyOfEachSeq, turns, forced);
            let alone = run(LogitsFor::LastOfEachSeq, turns, forced);
            let same = ahead == alone;
            println!(
                "RESULT|gpu {name} greedy steps launched ahead, {what}|{}|-|{}",
                ahead.iter().map(Vec::len).sum::<usize>(),
                if same { "ok" } else { "FAIL" }
            );
            assert_eq!(ahead, alone, "{name}: {what}");
        }
    }
}
