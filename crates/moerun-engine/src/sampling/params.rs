//! The knobs of one request's sampling, with the meanings and defaults of the OpenAI API and
//! vLLM, and the validation that lets the sampler assume every value is in range.

use serde::{Deserialize, Serialize};

/// Temperatures below this are treated as greedy: dividing logits by a near-zero temperature only
/// produces infinities, and the distribution it approximates is the argmax anyway (vLLM uses the
/// same threshold).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// Largest magnitude OpenAI (and vLLM) accept for the presence and frequency penalties.
pub const MAX_OPENAI_PENALTY: f32 = 2.0;

/// How to turn one sequence's logits into its next token. The defaults change nothing: plain
/// sampling from the softmax at temperature 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Divides the logits; 0 (or anything below [`GREEDY_TEMPERATURE`]) means greedy argmax.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 or -1 (vLLM's spelling) disables it.
    pub top_k: i32,
    /// Keep the smallest set of most likely tokens whose probability sums to at least `top_p`.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's.
    pub min_p: f32,
    /// HF's multiplicative penalty for every token seen in the prompt or the output; 1 is off.
    pub repetition_penalty: f32,
    /// OpenAI's additive penalty for every token that occurred in the output at least once.
    pub presence_penalty: f32,
    /// OpenAI's additive penalty per occurrence of a token in the output.
    pub frequency_penalty: f32,
    /// Seed of the sequence's random generator; `None` draws one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Parameters for greedy decoding (argmax, no penalties).
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Whether the next token is the argmax of the penalised logits (no random draw).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// Whether the next token is the argmax of the model's logits as they are: greedy without
    /// penalties. The model can then pick it where the logits are (`LogitsFor::GreedyOfEachSeq`:
    /// on the GPU only the ids cross to the host).
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy() && !self.has_penalties()
    }

    /// The top-k cut for a vocabulary of `vocab` tokens, or `None` where it keeps everything.
    pub fn top_k_for(&self, vocab: usize) -> Option<usize> {
        match usize::try_from(self.top_k) {
            Ok(k) if k > 0 && k < vocab => Some(k),
            _ => None,
        }
    }

    /// Check every field; the error names the first bad field and the value it had.
    pub fn validate(&self) -> Result<(), String> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!("temperature must be a finite number >= 0, got {t}"));
        }
        if self.top_k < -1 {
            return Err(format!(
                "top_k must be a positive number of tokens, or 0 or -1 to disable it, got {}",
                self.top_k
            ));
        }
        let p = self.top_p;
        // Written so that NaN fails: every comparison with NaN is false.
        if !(p > 0.0 && p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {p}"));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(format!("min_p must be in [0, 1], got {m}"));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(format!(
                "repetition_penalty must be a finite number > 0 (1 disables it), got {r}"
            ));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-MAX_OPENAI_PENALTY..=MAX_OPENAI_PENALTY).contains(&value) {
                return Err(format!(
                    "{name} must be in [-{MAX_OPENAI_PENALTY}, {MAX_OPENAI_PENALTY}], got {value}"
                ));
            }
        }
        Ok(())
    }

    /// Whether any penalty would change the logits.
    pub(crate) fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}
