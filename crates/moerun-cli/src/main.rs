//! `moerun`: run Mixture-of-Experts language models from Hugging Face checkpoints.
//!
//! Each subcommand lives in `cmd/`; this file only parses flags and turns any error into one line
//! on stderr and a non-zero exit.

mod cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "moerun",
    version,
    about = "Fast, faithful inference for Mixture-of-Experts LLMs"
)]
struct Cli {
    /// Worker threads for the CPU kernels (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streamed as it is produced.
    Generate(GenerateArgs),
    /// An interactive conversation using the model's chat template.
    Chat(ChatArgs),
    /// Teacher-forced perplexity of a text file.
    Perplexity(PerplexityArgs),
    /// Write float32 logits for every position of a token sequence to a .npy file.
    Logits(LogitsArgs),
    /// Describe a checkpoint: family, layers, experts, parameters, bytes.
    Inspect(InspectArgs),
    /// Write a checkpoint with random weights at a real model's shapes.
    Synth(SynthArgs),
    /// Measure prefill and decode speed against this machine's memory bandwidth.
    Bench(BenchArgs),
    /// Serve an OpenAI-compatible HTTP API with continuous batching.
    Serve(ServeArgs),
    /// Measure a server under concurrent streamed requests (a concurrency sweep).
    BenchServe(BenchServeArgs),
}

/// Where a model command runs, and what its KV cache stores.
#[derive(Args, Clone, Copy)]
pub struct DeviceFlag {
    /// Device to run on: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: moerun_core::Device,
    /// What the KV cache stores: f32, or bf16 in half the memory (each value rounded once), on
    /// either device.
    #[arg(long, default_value = "f32", value_parser = parse_kv_dtype)]
    pub kv_dtype: moerun_core::DType,
}

impl Default for DeviceFlag {
    fn default() -> Self {
        DeviceFlag {
            device: moerun_core::Device::Cpu,
            kv_dtype: moerun_core::DType::F32,
        }
    }
}

fn parse_device(s: &str) -> Result<moerun_core::Device, String> {
    s.parse().map_err(|e: moerun_core::Error| e.to_string())
}

/// A count that must be at least 1 (`--max-tokens 0` would generate nothing; the server refuses
/// `max_tokens: 0` the same way).
fn parse_at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_kv_dtype(s: &str) -> Result<moerun_core::DType, String> {
    match moerun_core::DType::parse(s) {
        Some(d @ (moerun_core::DType::F32 | moerun_core::DType::BF16)) => Ok(d),
        _ => Err(format!("'{s}' is not a KV cache dtype (f32 or bf16)")),
    }
}

/// Sampling flags shared by generate and chat; unset ones come from generation_config.json.
#[derive(Args, Clone, Default)]
pub struct SamplingFlags {
    /// Sampling temperature; 0 decodes greedily.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<i32>,
    /// Nucleus sampling: keep the smallest set of tokens with this much probability.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalise tokens already in the prompt or output (1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Random seed: the same seed gives the same text.
    #[arg(long)]
    pub seed: Option<u64>,
}

#[derive(Args)]
pub struct GenerateArgs {
    /// Checkpoint directory (default: the embedded default model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The prompt; read from standard input when absent.
    pub prompt: Option<String>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// A system message (requires --chat).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, value_parser = parse_at_least_one)]
    pub max_tokens: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    /// Stop when this text is generated (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print one JSON object with the text and statistics instead of streaming.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub device: DeviceFlag,
}

#[derive(Args)]
pub struct ChatArgs {
    /// Checkpoint directory (default: the embedded default model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A system message that starts the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, value_parser = parse_at_least_one)]
    pub max_tokens: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    /// Stop a reply when this text is generated (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    #[command(flatten)]
    pub device: DeviceFlag,
}

#[derive(Args)]
pub struct PerplexityArgs {
    /// Checkpoint directory (default: the embedded default model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per window (default 512, at most the model's context).
    #[arg(long)]
    pub context: Option<usize>,
    #[command(flatten)]
    pub device: DeviceFlag,
}

#[derive(Args)]
pub struct LogitsArgs {
    /// Checkpoint directory (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long)]
    pub tokens: String,
    /// Feed one token per forward step through the KV cache (the decode path) instead of one
    /// prefill.
    #[arg(long)]
    pub incremental: bool,
    /// Output file (.npy, float32, shape [n_tokens, vocab]).
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub device: DeviceFlag,
}

#[derive(Args)]
pub struct InspectArgs {
    /// Checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
}

#[derive(Args)]
pub struct SynthArgs {
    /// A known model whose shapes to copy (see `moerun synth --list`), or a config.json path.
    #[arg(long, required_unless_present = "list")]
    pub like: Option<String>,
    /// Keep only the first N decoder layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Weight dtype: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (created; must be empty or absent).
    #[arg(long, required_unless_present = "list")]
    pub out: Option<PathBuf>,
    /// List the known models and exit.
    #[arg(long)]
    pub list: bool,
}

#[derive(Args)]
pub struct BenchArgs {
    /// Checkpoint directory.
    #[arg(long, required_unless_present = "like", conflicts_with = "like")]
    pub model: Option<PathBuf>,
    /// Instead of a checkpoint, a synthetic model of this known model's shapes (see `moerun
    /// synth --list`) with random weights drawn on the GPU (needs --device cuda).
    #[arg(long)]
    pub like: Option<String>,
    /// With --like: keep only the first N decoder layers.
    #[arg(long, requires = "like")]
    pub layers: Option<usize>,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Tokens to generate for the decode measurement.
    #[arg(long, default_value_t = 128)]
    pub gen: usize,
    /// Also decode with this many sequences at once (comma-separated list, e.g. 8,32,128);
    /// each has a --prompt token prompt, and --gen steps are timed.
    #[arg(long)]
    pub concurrency: Option<String>,
    /// Repetitions of the whole measurement; the best is reported.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub device: DeviceFlag,
}

#[derive(Args, Clone)]
pub struct ServeArgs {
    /// Checkpoint directory (default: the embedded default model).
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* requests.
    #[arg(long)]
    pub api_key: Option<String>,
    #[command(flatten)]
    pub device: DeviceFlag,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (decodes plus prefill chunks).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Longest prompt + completion (default: the model's context).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Bytes of KV cache (default: what max-num-seqs full-length sequences need, at most 1 GiB
    /// on the CPU, or 90% of the GPU memory free after the weights less 4 GiB).
    #[arg(long)]
    pub kv_cache_memory: Option<u64>,
    /// Requests allowed to wait for admission; more are answered 503.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting: usize,
    /// Do not reuse the KV of prompt prefixes across requests.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// The model name clients use (default: the --model path as given, or "default").
    #[arg(long)]
    pub served_model_name: Option<String>,
}

#[derive(Args)]
pub struct BenchServeArgs {
    /// A running server to measure (default: start one in this process with the serve flags).
    #[arg(long)]
    pub url: Option<String>,
    /// Prompt tokens per request (random token ids).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Tokens generated per request (EOS ignored).
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    /// Comma-separated concurrency levels.
    #[arg(long, default_value = "1,4,16,64")]
    pub concurrency: String,
    /// Requests per level (default: 4 per concurrent client, at least 16).
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Keep freed memory for reuse instead of giving it back to the kernel. A forward pass allocates
/// and frees megabytes of activations per layer; above glibc's mmap threshold (128 KiB, rising
/// to at most 32 MiB) each such buffer is a fresh mapping whose pages the kernel zeroes on first
/// touch. In a 512-token prefill those page faults were ~5% of the time. Weights are mapped
/// separately (memmap2), so this only concerns the heap.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only sets allocator parameters; called once, first thing in main, before
    // any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    if let Err(e) = configure_threads(cli.threads) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Generate(a) => cmd::generate::run(&a),
        Command::Chat(a) => cmd::chat::run(&a),
        Command::Perplexity(a) => cmd::perplexity::run(&a),
        Command::Logits(a) => cmd::logits::run(&a),
        Command::Inspect(a) => cmd::inspect::run(&a),
        Command::Synth(a) => cmd::synth::run(&a),
        Command::Bench(a) => cmd::bench::run(&a, cli.threads),
        Command::Serve(a) => cmd::serve::run(&a),
        Command::BenchServe(a) => cmd::bench_serve::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn configure_threads(threads: Option<usize>) -> Result<(), String> {
    let Some(n) = threads else { return Ok(()) };
    if n == 0 {
        return Err("--threads must be at least 1".into());
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| format!("could not start {n} threads: {e}"))
}
