//! Top-k, top-p and min-p: which tokens stay eligible for the draw. All three keep a prefix of
//! the vocabulary ordered by likelihood (ties to the lower id), so the kept set is always the
//! shortest of three prefixes and always holds the most likely token. The work is one or two
//! passes over the vocabulary plus work proportional to the kept set: no full sort of a 150k
//! vocabulary, and no exponential of every logit where top-k or min-p alone decides.

use std::cmp::Ordering;

use super::dist::{most_likely, Ranked, Weights};
use super::SamplingParams;

/// Top-k above this selects with `select_nth_unstable` (O(V)) rather than a bounded heap
/// (O(V log k), but one comparison for most tokens, and the result comes out in order).
const HEAP_TOP_K: usize = 4096;

/// How many of the most likely tokens top-p looks among before widening its search: a real
/// model's nucleus at top_p 0.9-0.95 is usually a few dozen tokens.
const NUCLEUS_FIRST_LOOK: usize = 256;

/// Orders token ids by decreasing logit, ties to the lower id: the one order every cut uses, so
/// "the k best" is well defined even among equal logits.
fn more_likely(logits: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    move |&a, &b| {
        let (la, lb) = (logits[a as usize], logits[b as usize]);
        // The logits were sanitised (no NaN), so partial_cmp always answers.
        lb.partial_cmp(&la)
            .unwrap_or(Ordering::Equal)
            .then(a.cmp(&b))
    }
}

/// Fill `ids` with the tokens that survive top-k, then top-p, then min-p, leaving their weights
/// computed in `weights`. At least one of the three cuts is on.
///
/// Top-p is measured on the distribution renormalised after top-k, as in HF and vLLM; min-p
/// compares each weight with the largest (which weighs exactly 1), a ratio that neither earlier
/// cut changes since both keep the most likely token. `heap` is selection scratch.
pub(crate) fn kept_tokens(
    ids: &mut Vec<u32>,
    logits: &[f32],
    weights: &mut Weights,
    heap: &mut Vec<Ranked>,
    params: &SamplingParams,
) {
    let vocab = logits.len();
    let order = more_likely(logits);
    let top_p = f64::from(params.top_p);

    match params.top_k_for(vocab) {
        Some(k) => {
            ids.clear();
            if k <= HEAP_TOP_K {
                most_likely(logits, k, heap);
                ids.extend(heap.iter().map(|r| r.id));
            } else {
                ids.extend(0..vocab as u32);
                ids.select_nth_unstable_by(k - 1, &order);
                ids.truncate(k);
            }
            weights.fill(logits, ids);
            if top_p < 1.0 {
                let mass: f64 = ids.iter().map(|&i| f64::from(weights.get(i))).sum();
                let n = nucleus_len(ids, weights, top_p * mass, &order).unwrap_or(ids.len());
                ids.truncate(n);
            }
        }
        None if top_p < 1.0 => vocabulary_nucleus(ids, logits, weights, heap, top_p, &order),
        None => {
            // Min-p alone: its cut `exp(x - max) >= min_p` is found on the logits, with some
            // slack for the rounding of exp; the exact test follows below.
            let cut = params.min_p.ln() - 1e-3;
            let max = weights.max();
            ids.clear();
            ids.extend((0..vocab as u32).filter(|&i| logits[i as usize] - max >= cut));
            weights.fill(logits, ids);
        }
    }

    if params.min_p > 0.0 {
        let min_p = params.min_p;
        ids.retain(|&i| weights.get(i) >= min_p);
    }
}

/// Top-p over the whole vocabulary: into `ids`, the most likely tokens whose weight reaches
/// `top_p` of the total, in order.
fn vocabulary_nucleus(
    ids: &mut Vec<u32>,
    logits: &[f32],
    weights: &mut Weights,
    heap: &mut Vec<Ranked>,
    top_p: f64,
    order: &impl Fn(&u32, &u32) -> Ordering,
) {
    let vocab = logits.len();
    let total = weights.total(logits);
    let target = top_p * total;

    most_likely(logits, NUCLEUS_FIRST_LOOK.min(vocab), heap);
    ids.clear();
    ids.extend(heap.iter().map(|r| r.id));
    if let Some(n) = nucleus_len(ids, weights, target, order) {
        ids.truncate(n);
        return;
    }

    // A wide nucleus. Tokens below (1 - top_p) * total / vocab weigh less than
    // (1 - top_p) * total together, so the nucleus is complete before reaching any of them:
    // drop them unordered, then order the rest only as far as needed. Halving the floor leaves
    // room for rounding.
    let floor = 0.5 * (1.0 - top_p) * total / vocab as f64;
    ids.clear();
    ids.extend((0..vocab as u32).filter(|&i| f64::from(weights.get(i)) >= floor));
    let n = nucleus_len(ids, weights, target, order).unwrap_or(ids.len());
    ids.truncate(n);
}

/// Reorder `ids` so that it starts with its most likely tokens in order, and return how many of
/// them it takes for their weight to reach `target`, or `None` if all of them do not. The order
/// is established in growing chunks, so only as much of `ids` is sorted as the answer needs.
fn nucleus_len(
    ids: &mut [u32],
    weights: &Weights,
    target: f64,
    order: &impl Fn(&u32, &u32) -> Ordering,
) -> Option<usize> {
    let mut cumulative = 0.0f64;
    let mut done = 0;
    let mut chunk = 64;
    while done < ids.len() {
        let end = (done + chunk).min(ids.len());
        if end < ids.len() {
            // Move the next `end - done` best of the rest to its front, in any order...
            ids[done..].select_nth_unstable_by(end - done - 1, order);
        }
        // ...then order just those.
        ids[done..end].sort_unstable_by(order);
        for (i, &id) in ids.iter().enumerate().take(end).skip(done) {
            cumulative += f64::from(weights.get(id));
            if cumulative >= target {
                return Some(i + 1);
            }
        }
        done = end;
        chunk *= 4;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights_of(logits: &[f32]) -> (Weights, f64) {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut w = Weights::default();
        w.reset(max);
        let total = w.total(logits);
        (w, total)
    }

    #[test]
    fn nucleus_spanning_several_chunks_is_found_in_likelihood_order() {
        // A flat-ish distribution over 1000 tokens whose 90% nucleus needs several chunks.
        let logits: Vec<f32> = (0..1000).map(|i| -(i as f32) * 0.001).rev().collect();
        let (w, total) = weights_of(&logits);
        let mut ids: Vec<u32> = (0..1000).collect();
        let order = more_likely(&logits);
        let n = nucleus_len(&mut ids, &w, 0.9 * total, &order).unwrap();
        assert!(n > 64 * 5, "needs more than two chunks, got {n}");
        let expected: Vec<u32> = (0..1000u32).rev().take(n).collect();
        assert_eq!(&ids[..n], &expected[..]);
        let before: f64 = ids[..n - 1].iter().map(|&i| f64::from(w.get(i))).sum();
        assert!(before < 0.9 * total);
    }

    #[test]
    fn equal_logits_at_the_top_k_boundary_keep_the_lower_ids() {
        let logits = [1.0f32, 3.0, 1.0, 1.0, 2.0];
        let mut w = Weights::default();
        w.reset(3.0);
        let params = SamplingParams {
            top_k: 3,
            ..Default::default()
        };
        let mut ids = Vec::new();
        kept_tokens(&mut ids, &logits, &mut w, &mut Vec::new(), &params);
        assert_eq!(ids, [1, 4, 0]);
    }
}
