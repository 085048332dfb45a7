//! The numerics under the sampler: temperature, softmax weights, the k most likely tokens,
//! log-probabilities and the draw itself. Sums are kept in f64 so that a 150k-token vocabulary
//! of tiny probabilities does not lose mass to f32 rounding.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::TokenLogprob;

/// Divide `logits` by `temperature` in place and return the largest. Sanitises as it goes: NaN
/// becomes -inf (never drawn) and +inf becomes `f32::MAX`, so that `x - max` stays a number.
pub(crate) fn scale(logits: &mut [f32], temperature: f32) -> f32 {
    let mut max = f32::NEG_INFINITY;
    for x in logits.iter_mut() {
        // Division, not multiplication by 1/t: HF divides, and the roundings then agree.
        let mut v = if temperature == 1.0 {
            *x
        } else {
            *x / temperature
        };
        if v.is_nan() {
            v = f32::NEG_INFINITY;
        } else if v == f32::INFINITY {
            v = f32::MAX;
        }
        *x = v;
        max = max.max(v);
    }
    max
}

/// Unnormalised softmax weights `exp(logit - max)`, indexed by token id. The exponential is the
/// costly part of a step, so the whole vocabulary is only computed when something needs its
/// total (a draw without top-k, top-p without top-k, logprobs); after top-k only the k
/// survivors are.
#[derive(Clone, Debug, Default)]
pub(crate) struct Weights {
    w: Vec<f32>,
    max: f32,
    /// Sum over the whole vocabulary, once computed this step.
    total: Option<f64>,
}

impl Weights {
    /// Start a step over logits whose largest is `max`.
    pub(crate) fn reset(&mut self, max: f32) {
        self.max = max;
        self.total = None;
    }

    /// The largest logit of this step.
    pub(crate) fn max(&self) -> f32 {
        self.max
    }

    /// Compute every token's weight (once per step) and return their sum; 0 when every logit is
    /// -inf.
    pub(crate) fn total(&mut self, logits: &[f32]) -> f64 {
        if let Some(total) = self.total {
            return total;
        }
        let total = if self.max == f32::NEG_INFINITY {
            0.0
        } else {
            let max = self.max;
            self.w.clear();
            self.w.extend(logits.iter().map(|&x| weight(x, max)));
            self.w.iter().map(|&w| f64::from(w)).sum()
        };
        self.total = Some(total);
        total
    }

    /// Make sure the weights of `ids` are computed.
    pub(crate) fn fill(&mut self, logits: &[f32], ids: &[u32]) {
        if self.total.is_some() {
            return;
        }
        self.w.resize(logits.len(), 0.0);
        for &id in ids {
            self.w[id as usize] = weight(logits[id as usize], self.max);
        }
    }

    /// The weight of `id`, which [`Weights::total`] or [`Weights::fill`] computed this step.
    pub(crate) fn get(&self, id: u32) -> f32 {
        self.w[id as usize]
    }

    /// Every weight, valid after [`Weights::total`].
    pub(crate) fn all(&self) -> &[f32] {
        &self.w
    }
}

/// The most likely token weighs exactly 1, which min-p relies on.
fn weight(x: f32, max: f32) -> f32 {
    if x == max {
        1.0
    } else {
        (x - max).exp()
    }
}

/// Index of the largest logit, ties to the lowest id; NaN never wins. 0 when nothing is larger
/// than -inf (the model's pick, which the GPU's greedy path reproduces).
pub(crate) use moerun_model::argmax;

/// A token in a selection heap. Ordered so that the *less* likely token is the greater (lower
/// logit, or the same logit and a higher id): the heap's top is then the one to evict.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ranked {
    pub(crate) logit: f32,
    pub(crate) id: u32,
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        // Logits are sanitised (no NaN) before any selection, so partial_cmp always answers.
        other
            .logit
            .partial_cmp(&self.logit)
            .unwrap_or(Ordering::Equal)
            .then(self.id.cmp(&other.id))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

/// The `n` most likely tokens into `buf`, most likely first, ties to the lower id. One pass with
/// a bounded heap: O(V log n), and most tokens cost one comparison with the heap's top.
pub(crate) fn most_likely(logits: &[f32], n: usize, buf: &mut Vec<Ranked>) {
    buf.clear();
    if n == 0 {
        return;
    }
    // The heap borrows the buffer's allocation and gives it back sorted.
    let mut heap = BinaryHeap::from(std::mem::take(buf));
    for (i, &logit) in logits.iter().enumerate() {
        let candidate = Ranked {
            logit,
            id: i as u32,
        };
        if heap.len() < n {
            heap.push(candidate);
        } else if let Some(mut worst) = heap.peek_mut() {
            // Strictly more likely: a tie loses to the kept token, whose id is lower.
            if logit > worst.logit {
                *worst = candidate;
            }
        }
    }
    *buf = heap.into_sorted_vec();
}

/// log(sum(exp(logits))) given the max and the sum of the weights.
pub(crate) fn log_normaliser(max: f32, total: f64) -> f64 {
    f64::from(max) + total.ln()
}

/// `logit - log_normaliser`, with an all -inf vocabulary reporting -inf rather than NaN.
pub(crate) fn logprob(logit: f32, log_normaliser: f64) -> f32 {
    if log_normaliser == f64::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    (f64::from(logit) - log_normaliser) as f32
}

/// Fill `out` with the `n` most likely tokens and their logprobs, most likely first.
pub(crate) fn top_logprobs(
    logits: &[f32],
    n: usize,
    log_normaliser: f64,
    buf: &mut Vec<Ranked>,
    out: &mut Vec<TokenLogprob>,
) {
    most_likely(logits, n, buf);
    out.clear();
    out.extend(buf.iter().map(|r| TokenLogprob {
        token: r.id,
        logprob: logprob(r.logit, log_normaliser),
    }));
}

/// The token where the running sum of `weights` first exceeds `u * total` (`u` in [0, 1)), with
/// `total` the sum of the same weights in the same order. Zero-weight tokens are never chosen;
/// if rounding lets the sum fall short, the last token with weight wins.
pub(crate) fn pick(tokens: impl Iterator<Item = (u32, f32)>, total: f64, u: f64) -> u32 {
    let target = u * total;
    let mut cumulative = 0.0f64;
    let mut last = None;
    for (token, w) in tokens {
        if w > 0.0 {
            cumulative += f64::from(w);
            if cumulative > target {
                return token;
            }
            last = Some(token);
        }
    }
    // Reached only through rounding, or with no weight at all (excluded by the callers).
    last.unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_logits_are_never_the_argmax_and_infinities_stay_finite_weights() {
        let mut logits = [f32::NAN, 1.0, f32::INFINITY, 1.0];
        assert_eq!(argmax(&logits), 2);
        let max = scale(&mut logits, 1.0);
        assert_eq!(max, f32::MAX);
        let mut w = Weights::default();
        w.reset(max);
        assert_eq!(w.total(&logits), 1.0);
        assert_eq!(w.all(), [0.0, 0.0, 1.0, 0.0]);
    }

    #[test]
    fn a_draw_at_either_end_of_the_unit_interval_lands_on_a_weighted_token() {
        let tokens = [(3, 0.0f32), (4, 0.5), (5, 0.0), (6, 0.5), (7, 0.0)];
        assert_eq!(pick(tokens.into_iter(), 1.0, 0.0), 4);
        assert_eq!(pick(tokens.into_iter(), 1.0, 0.999_999), 6);
        // A total larger than the weights (rounding) falls back to the last weighted token.
        assert_eq!(pick(tokens.into_iter(), 2.0, 0.9), 6);
    }

    #[test]
    fn the_most_likely_are_ordered_and_ties_go_to_the_lower_id() {
        let logits = [0.0f32, 2.0, 1.0, 2.0, -1.0, 2.0];
        let mut buf = Vec::new();
        most_likely(&logits, 3, &mut buf);
        let ids: Vec<u32> = buf.iter().map(|r| r.id).collect();
        assert_eq!(ids, [1, 3, 5]);
        most_likely(&logits, 4, &mut buf);
        let ids: Vec<u32> = buf.iter().map(|r| r.id).collect();
        assert_eq!(ids, [1, 3, 5, 2]);
    }

    #[test]
    fn selecting_from_ascending_logits_keeps_the_last_ones() {
        // Every token beats the heap's worst: the costly order for a bounded selection.
        let logits: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let mut buf = Vec::new();
        most_likely(&logits, 5, &mut buf);
        let ids: Vec<u32> = buf.iter().map(|r| r.id).collect();
        assert_eq!(ids, [999, 998, 997, 996, 995]);
    }

    #[test]
    fn weights_filled_for_a_subset_match_the_full_computation() {
        let logits = [0.5f32, -1.0, 2.0, 0.0];
        let mut some = Weights::default();
        some.reset(2.0);
        some.fill(&logits, &[0, 2]);
        let mut all = Weights::default();
        all.reset(2.0);
        all.total(&logits);
        assert_eq!((some.get(0), some.get(2)), (all.get(0), all.get(2)));
        assert_eq!(some.get(2), 1.0);
    }
}
