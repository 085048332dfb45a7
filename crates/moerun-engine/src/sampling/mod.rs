//! Sampling policy: how one sequence's logits become its next token, with the semantics of the
//! OpenAI API, vLLM and Hugging Face `generate`. Pure data and arithmetic on a logits slice: no
//! model, no device, fully testable on synthetic logits.
//!
//! What it promises:
//! - parameters are validated once ([`SamplingParams::validate`], [`Sampler::new`]); after that
//!   no input (logits with NaN or infinities, history ids outside the vocabulary) makes it panic;
//! - a seeded [`Sampler`] draws the same tokens for the same logits, one uniform number per
//!   non-greedy step and none for greedy ones;
//! - ties are broken towards the lower token id everywhere (greedy, top-k, top logprobs);
//! - per call, work is linear in the vocabulary plus the kept set (no full sort of a 150k
//!   vocabulary), with no allocation beyond scratch buffers the sampler keeps.
//!
//! # Processing order
//!
//! 1. **Penalties on the raw logits**: repetition penalty over prompt + output, then frequency
//!    and presence penalties over the output only. HF runs its repetition processor before any
//!    warper and vLLM applies all three before temperature; doing it first means a penalty's
//!    effect is independent of the temperature, and the repetition penalty's sign rule (divide
//!    positive logits, multiply negative ones) is defined on raw logits.
//! 2. **Greedy** if `temperature` is 0: the argmax of the penalised logits. Every later step
//!    keeps the most likely token and none reorders tokens, so skipping them is exact.
//! 3. **Temperature**: divide the logits. It comes before the cuts because top-p and min-p are
//!    defined on the distribution that is actually sampled (HF's first warper; vLLM likewise).
//! 4. **Top-k, then top-p, then min-p**, HF's warper order. Top-p is measured on the distribution
//!    renormalised after top-k (HF and vLLM agree). Min-p compares each probability with the
//!    largest, a ratio the earlier cuts do not change, so its place only matters relative to
//!    top-p: vLLM V1 applies min-p before top-p, which can give a smaller nucleus when both are
//!    set; we follow HF, the numerical reference of this project.
//! 5. **Renormalise and draw** one uniform number against the kept tokens' weights.
//!
//! Logprobs ([`Sampler::sample_with_logprobs`]) are taken after step 3, before step 4: see there.

mod dist;
mod params;
mod penalties;
mod sampler;
mod truncate;

pub use params::{SamplingParams, GREEDY_TEMPERATURE, MAX_OPENAI_PENALTY};
pub use sampler::Sampler;

/// A token and its log-probability: the chosen token, or one entry of OpenAI's `top_logprobs`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token id.
    pub token: u32,
    /// Natural log of its probability (see [`Sampler::sample_with_logprobs`] for which one).
    pub logprob: f32,
}
