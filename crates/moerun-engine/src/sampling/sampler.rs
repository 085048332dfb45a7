//! One sequence's sampler: its parameters, where its prompt ends, its random generator and the
//! scratch buffers its calls reuse. The processing order is described in the module above.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::dist::{argmax, log_normaliser, logprob, pick, scale, top_logprobs, Ranked, Weights};
use super::penalties::apply_penalties;
use super::truncate::kept_tokens;
use super::{SamplingParams, TokenLogprob};

/// Turns a sequence's logits into its next token, step after step. Owns its random generator,
/// so a seeded sequence draws the same tokens whatever else shares its batch. The generator is
/// rand's `StdRng`: reproducible for a given build, though rand may change its algorithm in a
/// new major version.
///
/// Memory: besides the parameters, up to 8 bytes per vocabulary entry of scratch (allocated on
/// the first call that needs it and reused; greedy decoding without logprobs needs none) plus
/// one copy of the history while penalties are on.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    prompt_len: usize,
    rng: StdRng,
    /// `exp(logit - max)` per vocabulary entry, computed where needed.
    weights: Weights,
    /// Candidate token ids while truncating.
    ids: Vec<u32>,
    /// Heap for selecting the k most likely tokens (top-k, top logprobs).
    heap: Vec<Ranked>,
    /// Sorted copy of the history, for the penalties.
    history: Vec<u32>,
}

/// What the shared front half of the pipeline decided.
#[derive(Clone, Copy)]
enum Plan {
    /// Temperature 0 (or nothing left to draw from): this token, no draw.
    Greedy(u32),
    /// Draw from `weights` over the whole vocabulary.
    Everything { total: f64 },
    /// Draw from `weights` restricted to the ids left in `ids`.
    Kept,
}

impl Sampler {
    /// A sampler for a sequence whose history starts with `prompt_len` prompt tokens. Refuses
    /// invalid parameters with a message naming the field.
    pub fn new(params: SamplingParams, prompt_len: usize) -> Result<Self, String> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Ok(Sampler {
            params,
            prompt_len,
            rng,
            weights: Weights::default(),
            ids: Vec::new(),
            heap: Vec::new(),
            history: Vec::new(),
        })
    }

    /// The parameters this sampler applies.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// How many leading tokens of a history are prompt (no presence/frequency penalty).
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Choose the next token. `history` is the prompt followed by every token generated so far.
    ///
    /// `logits` (one per vocabulary entry) is used as scratch: on return it holds the penalised,
    /// temperature-scaled logits with NaN turned into -inf (when greedy: only penalised).
    ///
    /// # Panics
    /// If `logits` is empty, which no model produces.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let plan = self.plan(logits, history, false).0;
        self.draw(plan)
    }

    /// Choose the next token as [`Sampler::sample`] does (same tokens for the same seed), and
    /// report its logprob and the `top_n` most likely tokens into `top` (cleared first).
    ///
    /// Logprobs are `log_softmax` over the whole vocabulary of the logits after penalties and
    /// temperature, before top-k, top-p and min-p: the distribution the truncation starts from,
    /// so a token outside the nucleus still has its real, finite logprob. vLLM's V0 sampler
    /// reported the same; V1 by default reports the raw model logits' log_softmax instead. With
    /// temperature 0 there is no scaled distribution; the penalised logits are taken at
    /// temperature 1.
    pub fn sample_with_logprobs(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        top_n: usize,
        top: &mut Vec<TokenLogprob>,
    ) -> TokenLogprob {
        let (plan, log_z) = self.plan(logits, history, true);
        let token = self.draw(plan);
        top_logprobs(logits, top_n, log_z, &mut self.heap, top);
        TokenLogprob {
            token,
            logprob: logprob(logits[token as usize], log_z),
        }
    }

    /// Write into `probs` (resized to the vocabulary) the exact distribution the next draw
    /// would use: zero outside the kept tokens, renormalised inside; a one-hot vector when
    /// greedy. Draws no random number. For tests, and for speculative decoding's acceptance rule,
    /// which needs the target distribution itself.
    pub fn probabilities(&mut self, logits: &mut [f32], history: &[u32], probs: &mut Vec<f32>) {
        let plan = self.plan(logits, history, false).0;
        probs.clear();
        probs.resize(logits.len(), 0.0);
        match plan {
            Plan::Greedy(token) => probs[token as usize] = 1.0,
            Plan::Everything { total } => {
                for (p, &w) in probs.iter_mut().zip(self.weights.all()) {
                    *p = (f64::from(w) / total) as f32;
                }
            }
            Plan::Kept => {
                let total = self.kept_total();
                for &id in &self.ids {
                    probs[id as usize] = (f64::from(self.weights.get(id)) / total) as f32;
                }
            }
        }
    }

    /// Penalties, then either greedy or temperature and truncation. With `want_log_z`, also
    /// the log-normaliser of the distribution logprobs are reported from (NaN otherwise).
    fn plan(&mut self, logits: &mut [f32], history: &[u32], want_log_z: bool) -> (Plan, f64) {
        assert!(!logits.is_empty(), "sampling needs at least one logit");
        if self.params.has_penalties() {
            apply_penalties(
                logits,
                history,
                self.prompt_len,
                &self.params,
                &mut self.history,
            );
        }
        if self.params.is_greedy() {
            let token = argmax(logits);
            // Greedy logprobs are reported at temperature 1: there is no distribution at 0.
            let log_z = if want_log_z {
                self.start_step(logits, 1.0, true)
            } else {
                f64::NAN
            };
            return (Plan::Greedy(token), log_z);
        }

        let log_z = self.start_step(logits, self.params.temperature, want_log_z);
        if self.weights.max() == f32::NEG_INFINITY {
            // Every logit is -inf: nothing is drawable, fall back to the first token.
            return (Plan::Greedy(0), log_z);
        }
        let p = &self.params;
        let truncates = p.top_k_for(logits.len()).is_some() || p.top_p < 1.0 || p.min_p > 0.0;
        if !truncates {
            let total = self.weights.total(logits);
            return (Plan::Everything { total }, log_z);
        }
        kept_tokens(&mut self.ids, logits, &mut self.weights, &mut self.heap, p);
        (Plan::Kept, log_z)
    }

    /// Scale and sanitise `logits` for this step and return log(sum(exp)) over them, or NaN
    /// without `want` (then the costly full pass of exponentials is left to whoever needs it).
    fn start_step(&mut self, logits: &mut [f32], temperature: f32, want: bool) -> f64 {
        let max = scale(logits, temperature);
        self.weights.reset(max);
        if want {
            log_normaliser(max, self.weights.total(logits))
        } else {
            f64::NAN
        }
    }

    /// Carry out a plan: one uniform number per non-greedy token, none for greedy ones.
    fn draw(&mut self, plan: Plan) -> u32 {
        match plan {
            Plan::Greedy(token) => token,
            Plan::Everything { total } => {
                let u: f64 = self.rng.random();
                let weights = self.weights.all().iter();
                let tokens = weights.enumerate().map(|(i, &w)| (i as u32, w));
                pick(tokens, total, u)
            }
            Plan::Kept => {
                let total = self.kept_total();
                let u: f64 = self.rng.random();
                let tokens = self.ids.iter().map(|&i| (i, self.weights.get(i)));
                pick(tokens, total, u)
            }
        }
    }

    /// Sum of the kept tokens' weights, in the order [`pick`] walks them.
    fn kept_total(&self) -> f64 {
        self.ids
            .iter()
            .map(|&i| f64::from(self.weights.get(i)))
            .sum()
    }
}
