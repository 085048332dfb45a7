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
    /// Write float32 logits for every position of a token sequence to a .npy file.
    Logits(LogitsArgs),
    /// Describe a checkpoint: family, layers, experts, parameters, bytes.
    Inspect(InspectArgs),
    /// Write a checkpoint with random weights at a real model's shapes.
    Synth(SynthArgs),
    /// Measure prefill and decode speed against this machine's memory bandwidth.
    Bench(BenchArgs),
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
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Tokens to generate for the decode measurement.
    #[arg(long, default_value_t = 128)]
    pub gen: usize,
    /// Repetitions of the whole measurement; the best is reported.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = configure_threads(cli.threads) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Logits(a) => cmd::logits::run(&a),
        Command::Inspect(a) => cmd::inspect::run(&a),
        Command::Synth(a) => cmd::synth::run(&a),
        Command::Bench(a) => cmd::bench::run(&a, cli.threads),
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
