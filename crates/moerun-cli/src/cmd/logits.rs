//! `moerun logits`: float32 logits for every position, by one prefill or token by token through
//! the KV cache, written as `.npy` for comparison with transformers.

use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::cuda::WeightSource;
use moerun_model::npy::write_npy_f32;
use moerun_model::{LogitsFor, Model, WeightsIn};

use super::CliResult;
use crate::LogitsArgs;

pub fn run(args: &LogitsArgs) -> CliResult {
    let tokens = parse_tokens(&args.tokens)?;
    let mut model = Model::load_with(&args.model, WeightsIn::for_device(args.device.device))?;
    model.set_kv_dtype(args.device.kv_dtype)?;
    model.place(args.device.device, WeightSource::Host)?;
    let logits = compute(&model, &tokens, args.incremental)?;
    write_npy_f32(&args.out, &[tokens.len(), model.config.vocab_size], &logits)?;
    Ok(())
}

/// Logits `[tokens.len(), vocab]`, via one prefill or one step per token.
pub fn compute(model: &Model, tokens: &[u32], incremental: bool) -> CliResult<Vec<f32>> {
    let mut kv = SequenceKv::for_model(model, tokens.len())?;
    let mut seq = Sequence::new(tokens.to_vec());
    if !incremental {
        let out = run_step(
            model,
            &mut kv,
            &mut [&mut seq],
            &[usize::MAX],
            LogitsFor::AllTokens,
        )?;
        return Ok(out.logits);
    }
    let mut logits = Vec::with_capacity(tokens.len() * model.config.vocab_size);
    for _ in 0..tokens.len() {
        let out = run_step(
            model,
            &mut kv,
            &mut [&mut seq],
            &[1],
            LogitsFor::LastOfEachSeq,
        )?;
        logits.extend_from_slice(&out.logits);
    }
    Ok(logits)
}

/// Parse `1,2,3` (spaces allowed) into token ids.
pub fn parse_tokens(text: &str) -> CliResult<Vec<u32>> {
    let tokens = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| format!("--tokens: '{s}' is not a token id (non-negative integer)"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if tokens.is_empty() {
        return Err("--tokens: no token ids given".into());
    }
    Ok(tokens)
}
