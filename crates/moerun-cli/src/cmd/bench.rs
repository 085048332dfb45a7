//! `moerun bench`: prefill and decode speed, judged against the machine's measured memory
//! bandwidth: on the CPU the read bandwidth of this many threads, on a GPU the device-to-device
//! copy bandwidth (bytes read + written). Decode at batch 1 reads every active weight byte once
//! per token, so `active bytes per token × decode tok/s` is the weight traffic decode achieves,
//! and its share of the measured bandwidth says how close the kernels are to the roofline. With
//! `--concurrency`, decode also runs N sequences at once (aggregate tok/s).
//!
//! The weights are resident before anything is timed (mmapped pages touched on the CPU; uploaded
//! or drawn on the GPU) and a short forward runs first. Each of `--repeat` runs uses a fresh KV
//! cache; the best prefill and the best decode are reported. The decode figures are steady
//! state: the first decode step after a prefill runs untimed, because on the GPU it captures the
//! CUDA graph of its batch size into the fresh cache (~7 ms, once per cache and batch size, as a
//! server's long-lived cache pays it once), and the `--gen` steps after it are timed.

use std::time::Instant;

use moerun_core::{DType, Device};
use moerun_cpu::bandwidth::measure_read_bandwidth;
use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::cuda::WeightSource;
use moerun_model::stats::{human_count, ParamStats};
use moerun_model::{LogitsFor, Model, WeightsIn};
use serde_json::json;

use super::inspect::StoredDtypes;
use super::synth::SplitMix64;
use super::CliResult;
use crate::BenchArgs;

/// Bandwidth probe buffer: far above any last-level cache, so DRAM is what gets measured.
const PROBE_BYTES: usize = 1 << 30;
/// Seed of the random prompt: the same prompt on every run and every machine.
const PROMPT_SEED: u64 = 0x0062_656e_6368;
/// Seed of synthetic weights drawn on the device.
const WEIGHT_SEED: u64 = 0x6d6f_6572_756e;

/// Wall-clock times of one prefill and the decode steps that follow it.
#[derive(Clone, Copy)]
struct Timing {
    prefill_s: f64,
    decode_s: f64,
}

/// Decode of `seqs` sequences at once.
#[derive(Clone, Copy)]
struct Concurrent {
    seqs: usize,
    decode_s: f64,
    tok_per_s: f64,
}

pub fn run(args: &BenchArgs, threads: Option<usize>) -> CliResult {
    for (flag, v) in [
        ("--prompt", args.prompt),
        ("--gen", args.gen),
        ("--repeat", args.repeat),
    ] {
        if v == 0 {
            return Err(format!("{flag} must be at least 1").into());
        }
    }
    let concurrency = parse_concurrency(args.concurrency.as_deref())?;
    let device = args.device.device;
    let (label, model) = load(args, device)?;
    let cfg = &model.config;
    let stats = ParamStats::from_config(cfg);
    let dtype = StoredDtypes::of(&model)
        .main()
        .unwrap_or(model.weights.embed_tokens.dtype);
    let workers = rayon::current_num_threads();

    let bandwidth = match model.cuda() {
        None => {
            eprintln!("bench: measuring read bandwidth with {workers} thread(s)...");
            measure_read_bandwidth(PROBE_BYTES, workers)
        }
        Some(c) => {
            eprintln!("bench: measuring device copy bandwidth...");
            c.device()
                .measure_copy_bandwidth(4 * PROBE_BYTES, 5)
                .map_err(|e| e.to_string())?
        }
    };
    let prompt = random_prompt(args.prompt, cfg.vocab_size, 0);
    // The whole prompt and a decode step, untimed: warms threads, allocator and caches, and runs
    // every kernel the timed runs use once (the GPU loads a kernel's module on its first launch,
    // cuBLAS's GEMMs included: a prompt of 16 tokens took other paths than a long one, and the
    // first long prefill paid that loading inside its time).
    measure(&model, &prompt, 1)?;

    let mut best: Option<Timing> = None;
    for r in 1..=args.repeat {
        let t = measure(&model, &prompt, args.gen)?;
        eprintln!(
            "bench: run {r}/{}: prefill {:.2} tok/s, decode {:.2} tok/s",
            args.repeat,
            args.prompt as f64 / t.prefill_s,
            args.gen as f64 / t.decode_s
        );
        best = Some(match best {
            None => t,
            Some(b) => Timing {
                prefill_s: b.prefill_s.min(t.prefill_s),
                decode_s: b.decode_s.min(t.decode_s),
            },
        });
    }
    let best = best.ok_or("no run completed")?;
    let mut concurrent = Vec::new();
    for &n in &concurrency {
        let mut fastest: Option<Concurrent> = None;
        for _ in 0..args.repeat {
            let c = measure_concurrent(&model, n, args.prompt, args.gen)?;
            eprintln!(
                "bench: {n} sequences: decode {:.1} tok/s (aggregate)",
                c.tok_per_s
            );
            if fastest.is_none_or(|f| c.decode_s < f.decode_s) {
                fastest = Some(c);
            }
        }
        concurrent.extend(fastest);
    }

    let prefill_tps = args.prompt as f64 / best.prefill_s;
    let decode_tps = args.gen as f64 / best.decode_s;
    let active_bytes = stats.active_bytes(dtype);
    let achieved = active_bytes as f64 * decode_tps;
    let report = Report {
        args,
        label,
        device,
        threads,
        workers,
        dtype,
        stats,
        bandwidth,
        best,
        prefill_tps,
        decode_tps,
        active_bytes,
        achieved,
        pct: 100.0 * achieved / bandwidth,
        roofline_tps: bandwidth / active_bytes as f64,
        concurrent,
    };
    if args.json {
        println!("{}", report.json(&model));
    } else {
        report.print(&model);
    }
    let profile = moerun_model::cuda::profile::report();
    if !profile.is_empty() {
        eprintln!("bench: device time per op (MOERUN_CUDA_PROFILE=1, all passes):\n{profile}");
    }
    Ok(())
}

/// The model to measure, resident where it runs, and how to name it.
fn load(args: &BenchArgs, device: Device) -> CliResult<(String, Model)> {
    match (&args.model, &args.like) {
        (Some(dir), None) => {
            let mut model = Model::load_with(dir, WeightsIn::for_device(device))?;
            eprintln!(
                "bench: touching {} of mapped weights...",
                decimal_bytes(model.checkpoint().weight_bytes() as f64)
            );
            model.checkpoint().prefault(|_| {});
            model.set_kv_dtype(args.device.kv_dtype)?;
            if device != Device::Cpu {
                eprintln!("bench: uploading the weights to {device}...");
            }
            model.place(device, WeightSource::Host)?;
            Ok((dir.display().to_string(), model))
        }
        (None, Some(like)) => {
            if device == Device::Cpu {
                // An unknown name is the first thing to say.
                super::synth::source(like)?;
                return Err(format!(
                    "--like {like}: synthetic in-memory models draw their weights on the GPU \
                     (--device cuda); for the CPU write one with `moerun synth --like {like} \
                     --out DIR` and pass --model DIR"
                )
                .into());
            }
            let (name, mut model) = super::synth::in_memory(like, args.layers, DType::BF16)?;
            model.set_kv_dtype(args.device.kv_dtype)?;
            eprintln!("bench: drawing random bf16 weights of {name} on {device}...");
            model.place(device, WeightSource::Random { seed: WEIGHT_SEED })?;
            let layers = model.config.num_layers();
            Ok((
                format!("synthetic {name} ({layers} layers, random bf16 weights)"),
                model,
            ))
        }
        _ => Err("bench needs --model DIR or --like NAME".into()),
    }
}

/// `--concurrency 8,32,128`: the batch sizes to decode at, besides 1.
fn parse_concurrency(list: Option<&str>) -> CliResult<Vec<usize>> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(|s| match s.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(format!(
                "--concurrency '{list}': expected a list of counts >= 1, e.g. 8,32,128"
            )
            .into()),
        })
        .collect()
}

/// One prefill of `prompt` (logits of its last position only, as generation needs), then `gen`
/// decode steps at batch 1 feeding back the argmax, in a KV cache sized for both, after one
/// untimed decode step (the module doc says why).
fn measure(model: &Model, prompt: &[u32], gen: usize) -> CliResult<Timing> {
    let mut kv = SequenceKv::for_model(model, prompt.len() + 1 + gen)?;
    let mut seq = Sequence::new(prompt.to_vec());
    let start = Instant::now();
    let out = run_step(
        model,
        &mut kv,
        &mut [&mut seq],
        &[usize::MAX],
        LogitsFor::GreedyOfEachSeq,
    )?;
    let prefill_s = start.elapsed().as_secs_f64();
    let mut next = out.tokens[0];
    let mut decode_step = |next: &mut u32| -> CliResult {
        seq.tokens.push(*next);
        let out = run_step(
            model,
            &mut kv,
            &mut [&mut seq],
            &[1],
            LogitsFor::GreedyOfEachSeq,
        )?;
        *next = out.tokens[0];
        Ok(())
    };
    decode_step(&mut next)?;
    let start = Instant::now();
    for _ in 0..gen {
        decode_step(&mut next)?;
    }
    let decode_s = start.elapsed().as_secs_f64();
    Ok(Timing {
        prefill_s,
        decode_s,
    })
}

/// `n` sequences with distinct random prompts of `prompt` tokens, prefilled (untimed, a few
/// sequences per step), then one untimed decode step of all `n` (it captures their batch size's
/// graph) and `gen` decode steps of all `n` at once, timed.
fn measure_concurrent(model: &Model, n: usize, prompt: usize, gen: usize) -> CliResult<Concurrent> {
    let vocab = model.config.vocab_size;
    let mut kv = SequenceKv::for_model(model, n * (prompt + 1 + gen + 16))?;
    let mut seqs: Vec<Sequence> = (0..n)
        .map(|i| Sequence::new(random_prompt(prompt, vocab, i as u64 + 1)))
        .collect();
    let per_step = (8192 / prompt).clamp(1, n);
    let mut next = vec![0u32; n];
    for (c, chunk) in seqs.chunks_mut(per_step).enumerate() {
        let mut refs: Vec<&mut Sequence> = chunk.iter_mut().collect();
        let limits = vec![usize::MAX; refs.len()];
        let out = run_step(
            model,
            &mut kv,
            &mut refs,
            &limits,
            LogitsFor::GreedyOfEachSeq,
        )?;
        next[c * per_step..][..out.tokens.len()].copy_from_slice(&out.tokens);
    }
    let mut decode_step = |next: &mut [u32]| -> CliResult {
        for (s, &t) in seqs.iter_mut().zip(next.iter()) {
            s.tokens.push(t);
        }
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let out = run_step(
            model,
            &mut kv,
            &mut refs,
            &vec![1; n],
            LogitsFor::GreedyOfEachSeq,
        )?;
        next.copy_from_slice(&out.tokens);
        Ok(())
    };
    decode_step(&mut next)?;
    let start = Instant::now();
    for _ in 0..gen {
        decode_step(&mut next)?;
    }
    let decode_s = start.elapsed().as_secs_f64();
    Ok(Concurrent {
        seqs: n,
        decode_s,
        tok_per_s: (n * gen) as f64 / decode_s,
    })
}

/// `n` token ids below `vocab`, the same for a given `n`, `vocab` and `stream` every time.
fn random_prompt(n: usize, vocab: usize, stream: u64) -> Vec<u32> {
    let mut rng = SplitMix64::new(PROMPT_SEED ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// A byte count in decimal units, matching the GB/s of bandwidth figures: `6.08 GB`, `332.8 KB`.
fn decimal_bytes(n: f64) -> String {
    match n {
        n if n >= 1e9 => format!("{:.3} GB", n / 1e9),
        n if n >= 1e6 => format!("{:.1} MB", n / 1e6),
        n if n >= 1e3 => format!("{:.1} KB", n / 1e3),
        n => format!("{n} B"),
    }
}

/// Every figure of a bench, for either output form.
struct Report<'a> {
    args: &'a BenchArgs,
    label: String,
    device: Device,
    threads: Option<usize>,
    workers: usize,
    dtype: DType,
    stats: ParamStats,
    bandwidth: f64,
    best: Timing,
    prefill_tps: f64,
    decode_tps: f64,
    active_bytes: u64,
    /// Weight bytes per second decode streams.
    achieved: f64,
    /// `achieved` as a percentage of `bandwidth`.
    pct: f64,
    /// Decode tok/s if weights streamed at the measured bandwidth.
    roofline_tps: f64,
    concurrent: Vec<Concurrent>,
}

impl Report<'_> {
    fn json(&self, model: &Model) -> serde_json::Value {
        let cfg = &model.config;
        json!({
            "model": self.label,
            "device": self.device.to_string(),
            "gpu": model.cuda().map(|c| c.device().info().to_string()),
            "gpu_weight_bytes": model.cuda().map(|c| c.weight_bytes()),
            "kv_dtype": model.kv_dtype().to_string(),
            "family": cfg.family.to_string(),
            "layers": cfg.num_layers(),
            "dtype": self.dtype.to_string(),
            "isa": moerun_cpu::simd::active_isa(),
            "threads": self.workers,
            "params_total": self.stats.total,
            "params_active": self.stats.active,
            "active_bytes_per_token": self.active_bytes,
            "read_bandwidth_bytes_per_s": self.bandwidth,
            "prompt_tokens": self.args.prompt,
            "prefill_seconds": self.best.prefill_s,
            "prefill_tok_per_s": self.prefill_tps,
            "gen_tokens": self.args.gen,
            "decode_seconds": self.best.decode_s,
            "decode_tok_per_s": self.decode_tps,
            "decode_weight_bytes_per_s": self.achieved,
            "decode_bandwidth_pct": self.pct,
            "decode_roofline_tok_per_s": self.roofline_tps,
            "repeat": self.args.repeat,
            "concurrent_decode": self.concurrent.iter().map(|c| json!({
                "sequences": c.seqs,
                "decode_seconds": c.decode_s,
                "tok_per_s": c.tok_per_s,
            })).collect::<Vec<_>>(),
        })
    }

    fn print(&self, model: &Model) {
        let cfg = &model.config;
        let how = match self.threads {
            Some(n) => format!("--threads {n}"),
            None => "all cores".into(),
        };
        println!("model      {}", self.label);
        println!(
            "           {}, {} layers, {}, {} params ({} active per token)",
            cfg.family,
            cfg.num_layers(),
            self.dtype,
            human_count(self.stats.total),
            human_count(self.stats.active)
        );
        match model.cuda() {
            None => {
                println!(
                    "cpu        {}, {} threads ({how})",
                    moerun_cpu::simd::active_isa(),
                    self.workers
                );
                println!(
                    "memory     {:.2} GB/s read bandwidth (measured)",
                    self.bandwidth / 1e9
                );
            }
            Some(c) => {
                println!("gpu        {}", c.device().info());
                println!(
                    "memory     {:.0} GB/s device copy bandwidth, read + written (measured); \
                     weights {} on the device",
                    self.bandwidth / 1e9,
                    decimal_bytes(c.weight_bytes() as f64)
                );
            }
        }
        println!();
        println!(
            "{:<18} {:>8} {:>10} {:>10}",
            "phase", "tokens", "seconds", "tok/s"
        );
        println!(
            "{:<18} {:>8} {:>10.3} {:>10.2}",
            "prefill", self.args.prompt, self.best.prefill_s, self.prefill_tps
        );
        println!(
            "{:<18} {:>8} {:>10.3} {:>10.2}",
            "decode (batch 1)", self.args.gen, self.best.decode_s, self.decode_tps
        );
        for c in &self.concurrent {
            println!(
                "{:<18} {:>8} {:>10.3} {:>10.2}",
                format!("decode (batch {})", c.seqs),
                c.seqs * self.args.gen,
                c.decode_s,
                c.tok_per_s
            );
        }
        println!();
        println!(
            "decode weight traffic  {}/token x {:.2} tok/s = {:.2} GB/s, {:.1}% of measured bandwidth",
            decimal_bytes(self.active_bytes as f64),
            self.decode_tps,
            self.achieved / 1e9,
            self.pct
        );
        println!(
            "decode roofline        {:.2} tok/s at the measured bandwidth",
            self.roofline_tps
        );
        if self.args.repeat > 1 {
            println!("(best of {} runs per phase)", self.args.repeat);
        }
    }
}
