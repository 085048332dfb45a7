//! Single-sequence generation: prefill the prompt in one forward, then decode token by token
//! through the paged KV cache, sampling each token and handing it to the caller, who may stop
//! early (stop strings live at the text level, above this crate). Timings come back with the
//! tokens so every front end reports the same figures.

use std::time::{Duration, Instant};

use moerun_core::Result;
use moerun_model::{LogitsFor, Model};

use crate::sampling::Sampler;
use crate::sequence::{run_step, Sequence, SequenceKv};
use crate::stop::StopTokens;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS or stop token was sampled (it is not part of the output).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
    /// The caller asked to stop (e.g. a stop string matched).
    Caller,
}

impl FinishReason {
    /// The OpenAI spelling (`stop` or `length`).
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop | FinishReason::Caller => "stop",
        }
    }
}

/// What [`generate`] produced.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated tokens, without the stop token.
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt prefill, up to and including the first sampled token.
    pub time_to_first_token: Duration,
    /// All decode steps after the first token.
    pub decode_time: Duration,
}

impl Generation {
    /// Prompt tokens per second of the prefill.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.time_to_first_token.as_secs_f64().max(1e-9)
    }

    /// Decoded tokens per second after the first.
    pub fn decode_tokens_per_second(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        n as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Limits and stop conditions of one generation.
pub struct GenerateOptions<'a> {
    pub max_new_tokens: usize,
    pub stop_tokens: &'a StopTokens,
}

/// Whether the caller wants more tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    Stop,
}

/// Generate after `seq`'s tokens. `seq` may already hold a cached prefix in `kv` (a chat's
/// earlier turns): only its uncached tokens are prefilled. Each sampled token is appended to
/// `seq` and passed to `on_token`.
pub fn generate(
    model: &Model,
    kv: &mut SequenceKv,
    seq: &mut Sequence,
    sampler: &mut Sampler,
    options: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> Control,
) -> Result<Generation> {
    let prompt_tokens = seq.tokens.len();
    let start = Instant::now();
    let mut tokens = Vec::new();
    let mut finish_reason = FinishReason::Length;
    let mut time_to_first_token = Duration::ZERO;
    let mut decode_start = start;
    while tokens.len() < options.max_new_tokens {
        // Plain greedy: the model picks the token where the logits are (no download of them).
        let plain_greedy = sampler.params().is_plain_greedy();
        let which = match plain_greedy {
            true => LogitsFor::GreedyOfEachSeq,
            false => LogitsFor::LastOfEachSeq,
        };
        let out = run_step(model, kv, &mut [&mut *seq], &[usize::MAX], which)?;
        if !seq.pending().is_empty() {
            continue; // a prompt longer than the cache's chunk prefills over several steps
        }
        let next = match plain_greedy {
            true => out.tokens[0],
            false => {
                let mut logits = out.logits;
                sampler.sample(&mut logits, &seq.tokens)
            }
        };
        if tokens.is_empty() {
            time_to_first_token = start.elapsed();
            decode_start = Instant::now();
        }
        if options.stop_tokens.is_stop_token(next) {
            finish_reason = FinishReason::Stop;
            break;
        }
        tokens.push(next);
        seq.tokens.push(next);
        if on_token(next) == Control::Stop {
            finish_reason = FinishReason::Caller;
            break;
        }
    }
    Ok(Generation {
        tokens,
        finish_reason,
        prompt_tokens,
        time_to_first_token,
        decode_time: decode_start.elapsed(),
    })
}
