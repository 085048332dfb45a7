//! `bench-serve`: load a running server the way `vllm bench serve` does. For each concurrency
//! level, a fixed number of streamed completion requests with random-token prompts of a fixed
//! length and a fixed output length (`ignore_eos`), at most `concurrency` in flight; reported
//! per level: request throughput, output tokens per second, and the client-side time to first
//! token and inter-token latency percentiles.
//!
//! Requests ask for `stream_options.continuous_usage_stats`, so the server sends one chunk per
//! generated token carrying the running token count: every token's arrival time is observed,
//! even while its text is still held back by the detokenizer.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::client::HttpClient;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The server, e.g. `http://127.0.0.1:8000`.
    pub url: String,
    pub api_key: Option<String>,
    /// The served model name.
    pub model: String,
    /// Prompt tokens per request.
    pub input_len: usize,
    /// Generated tokens per request.
    pub output_len: usize,
    /// Concurrency levels, in order.
    pub concurrencies: Vec<usize>,
    /// Requests per level; `None`: four per concurrent client, at least 16.
    pub num_prompts: Option<usize>,
    /// Prompt token ids are drawn uniformly from `0..vocab`.
    pub vocab: u32,
    pub seed: u64,
}

/// One concurrency level's results.
#[derive(Clone, Debug, Default)]
pub struct LevelResult {
    pub concurrency: usize,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
}

/// Median, 99th percentile and mean of a sample, in milliseconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

impl Percentiles {
    /// Summarise `samples` (seconds).
    pub fn of(samples: &mut [f64]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_by(f64::total_cmp);
        // Nearest rank on the sorted sample, as numpy's "lower" interpolation rounds.
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] * 1e3;
        Percentiles {
            mean: samples.iter().sum::<f64>() / samples.len() as f64 * 1e3,
            p50: at(0.5),
            p99: at(0.99),
        }
    }
}

/// What one request observed.
#[derive(Default)]
struct Observed {
    ttft: Option<f64>,
    gaps: Vec<f64>,
    tokens: usize,
    ok: bool,
}

/// The async runtime the benchmark's clients run on.
pub type Runtime = tokio::runtime::Runtime;

/// A small runtime for clients (two threads: the load generator must not starve the server).
pub fn runtime() -> Result<Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the client runtime: {e}"))
}

/// Run every level in turn (after one warm-up request) on a runtime of its own.
pub fn run(options: &BenchOptions) -> Result<Vec<LevelResult>, String> {
    runtime()?.block_on(async {
        let client = HttpClient::new(&options.url, options.api_key.clone());
        let mut rng = StdRng::seed_from_u64(options.seed);
        let warm = one_request(&client, options, random_prompt(&mut rng, options)).await;
        if !warm.ok {
            return Err(format!(
                "the warm-up request to {} failed; is the server up and serving '{}'?",
                options.url, options.model
            ));
        }
        let mut results = Vec::new();
        for &c in &options.concurrencies {
            results.push(run_level(&client, options, c, &mut rng).await);
        }
        Ok(results)
    })
}

fn random_prompt(rng: &mut StdRng, options: &BenchOptions) -> Vec<u32> {
    (0..options.input_len)
        .map(|_| rng.random_range(0..options.vocab.max(1)))
        .collect()
}

async fn run_level(
    client: &HttpClient,
    options: &BenchOptions,
    concurrency: usize,
    rng: &mut StdRng,
) -> LevelResult {
    let concurrency = concurrency.max(1);
    let n = options.num_prompts.unwrap_or((4 * concurrency).max(16));
    // Fresh random prompts per request, so the prefix cache cannot make later levels cheaper.
    let queue: Vec<Vec<u32>> = (0..n).map(|_| random_prompt(rng, options)).collect();
    let queue = Arc::new(Mutex::new(queue));
    let start = Instant::now();
    let mut workers = Vec::with_capacity(concurrency);
    for _ in 0..concurrency.min(n) {
        let (client, options, queue) = (client.clone(), options.clone(), queue.clone());
        workers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let next = queue.lock().map(|mut q| q.pop()).unwrap_or(None);
                let Some(prompt) = next else { break };
                seen.push(one_request(&client, &options, prompt).await);
            }
            seen
        }));
    }
    let mut observed = Vec::with_capacity(n);
    for w in workers {
        observed.extend(w.await.unwrap_or_default());
    }
    let duration_s = start.elapsed().as_secs_f64();
    let done: Vec<&Observed> = observed.iter().filter(|o| o.ok).collect();
    let output_tokens: usize = done.iter().map(|o| o.tokens).sum();
    let mut ttft: Vec<f64> = done.iter().filter_map(|o| o.ttft).collect();
    let mut itl: Vec<f64> = done.iter().flat_map(|o| o.gaps.iter().copied()).collect();
    LevelResult {
        concurrency,
        completed: done.len(),
        failed: observed.len() - done.len(),
        duration_s,
        input_tokens: done.len() * options.input_len,
        output_tokens,
        request_throughput: done.len() as f64 / duration_s,
        output_throughput: output_tokens as f64 / duration_s,
        ttft_ms: Percentiles::of(&mut ttft),
        itl_ms: Percentiles::of(&mut itl),
    }
}

async fn one_request(client: &HttpClient, options: &BenchOptions, prompt: Vec<u32>) -> Observed {
    let body = json!({
        "model": options.model,
        "prompt": prompt,
        "max_tokens": options.output_len,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true},
    });
    let start = Instant::now();
    let mut last = start;
    let mut seen = Observed::default();
    let reply = client
        .post_stream("/v1/completions", &body, |data| {
            if data == "[DONE]" {
                seen.ok = seen.tokens == options.output_len;
                return true;
            }
            let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                return true;
            };
            let tokens = chunk["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
            if tokens > seen.tokens {
                let now = Instant::now();
                if seen.ttft.is_none() {
                    seen.ttft = Some(now.duration_since(start).as_secs_f64());
                } else {
                    // Tokens that arrive together share the gap evenly.
                    let gap =
                        now.duration_since(last).as_secs_f64() / (tokens - seen.tokens) as f64;
                    seen.gaps
                        .extend(std::iter::repeat_n(gap, tokens - seen.tokens));
                }
                last = now;
                seen.tokens = tokens;
            }
            true
        })
        .await;
    if !matches!(reply, Ok(ref r) if r.status == 200) {
        seen.ok = false;
    }
    seen
}

/// The results as a table (one row per level).
pub fn format_table(results: &[LevelResult], input_len: usize, output_len: usize) -> String {
    let mut out = format!(
        "input {input_len} tokens, output {output_len} tokens per request\n\
         {:>5} {:>5} {:>4} {:>8} {:>7} {:>10} {:>9} {:>9} {:>9} {:>9}\n",
        "conc",
        "reqs",
        "fail",
        "time s",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99"
    );
    for r in results {
        out.push_str(&format!(
            "{:>5} {:>5} {:>4} {:>8.2} {:>7.2} {:>10.1} {:>7.1}ms {:>7.1}ms {:>7.2}ms {:>7.2}ms\n",
            r.concurrency,
            r.completed,
            r.failed,
            r.duration_s,
            r.request_throughput,
            r.output_throughput,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.itl_ms.p99,
        ));
    }
    out
}

/// The results as JSON.
pub fn to_json(results: &[LevelResult]) -> Value {
    let p = |p: &Percentiles| json!({"mean": p.mean, "p50": p.p50, "p99": p.p99});
    Value::Array(
        results
            .iter()
            .map(|r| {
                json!({
                    "concurrency": r.concurrency,
                    "completed": r.completed,
                    "failed": r.failed,
                    "duration_s": r.duration_s,
                    "input_tokens": r.input_tokens,
                    "output_tokens": r.output_tokens,
                    "request_throughput": r.request_throughput,
                    "output_throughput": r.output_throughput,
                    "ttft_ms": p(&r.ttft_ms),
                    "itl_ms": p(&r.itl_ms),
                })
            })
            .collect(),
    )
}
