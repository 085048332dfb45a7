//! The sampler draws from the distribution it claims: empirical frequencies of many seeded draws
//! against the exact (truncated, renormalised) softmax, and the kept sets of top-k, top-p and
//! min-p against sets worked out by hand.

use moerun_engine::sampling::{Sampler, SamplingParams};

const DRAWS: usize = 20_000;

/// Logits whose softmax is exactly `probs` (up to rounding).
fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|&p| p.ln() as f32).collect()
}

/// softmax(logits / temperature) in f64.
fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    let max = logits
        .iter()
        .map(|&x| f64::from(x))
        .fold(f64::MIN, f64::max);
    let e: Vec<f64> = logits
        .iter()
        .map(|&x| ((f64::from(x) - max) / temperature).exp())
        .collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

/// `probs` restricted to `kept` and renormalised.
fn restricted(probs: &[f64], kept: &[usize]) -> Vec<f64> {
    let mass: f64 = kept.iter().map(|&i| probs[i]).sum();
    (0..probs.len())
        .map(|i| {
            if kept.contains(&i) {
                probs[i] / mass
            } else {
                0.0
            }
        })
        .collect()
}

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        seed: Some(1234),
        ..Default::default()
    };
    f(&mut p);
    p
}

/// Relative frequency of each token over `DRAWS` draws from fresh copies of `logits`.
fn frequencies(params: SamplingParams, logits: &[f32]) -> Vec<f64> {
    let mut sampler = Sampler::new(params, 0).unwrap();
    let mut counts = vec![0usize; logits.len()];
    let mut scratch = logits.to_vec();
    for _ in 0..DRAWS {
        scratch.copy_from_slice(logits);
        counts[sampler.sample(&mut scratch, &[]) as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / DRAWS as f64).collect()
}

/// Every frequency within 4.5 standard errors of its probability; impossible tokens never drawn.
fn assert_close(freq: &[f64], expected: &[f64]) {
    for (token, (&f, &p)) in freq.iter().zip(expected).enumerate() {
        if p == 0.0 {
            assert_eq!(f, 0.0, "token {token} has probability 0 but was drawn");
            continue;
        }
        let se = (p * (1.0 - p) / DRAWS as f64).sqrt();
        assert!(
            (f - p).abs() <= 4.5 * se,
            "token {token}: frequency {f:.4}, probability {p:.4} (se {se:.4})"
        );
    }
}

/// The distribution `Sampler::probabilities` reports, in f64.
fn reported(params: SamplingParams, logits: &[f32]) -> Vec<f64> {
    let mut probs = Vec::new();
    let mut scratch = logits.to_vec();
    Sampler::new(params, 0)
        .unwrap()
        .probabilities(&mut scratch, &[], &mut probs);
    probs.into_iter().map(f64::from).collect()
}

fn kept(probs: &[f64]) -> Vec<usize> {
    (0..probs.len()).filter(|&i| probs[i] > 0.0).collect()
}

const LOGITS: [f32; 8] = [1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 2.5, -0.5];

/// Probabilities chosen so each cut has an unambiguous answer. In order of likelihood:
/// token 1 (0.40), 3 (0.25), 4 (0.15), 2 (0.10), 0 (0.05), 5 (0.05).
const PROBS: [f64; 6] = [0.05, 0.40, 0.10, 0.25, 0.15, 0.05];

#[test]
fn draws_at_temperature_one_follow_the_softmax() {
    let freq = frequencies(params(|_| {}), &LOGITS);
    assert_close(&freq, &softmax(&LOGITS, 1.0));
}

#[test]
fn draws_at_temperature_one_half_follow_the_sharpened_softmax() {
    let freq = frequencies(params(|p| p.temperature = 0.5), &LOGITS);
    assert_close(&freq, &softmax(&LOGITS, 0.5));
}

#[test]
fn draws_at_temperature_two_follow_the_flattened_softmax() {
    let freq = frequencies(params(|p| p.temperature = 2.0), &LOGITS);
    assert_close(&freq, &softmax(&LOGITS, 2.0));
}

#[test]
fn reported_probabilities_equal_the_exact_softmax() {
    let got = reported(params(|p| p.temperature = 0.7), &LOGITS);
    for (g, e) in got.iter().zip(softmax(&LOGITS, 0.7)) {
        assert!((g - e).abs() < 1e-6, "{g} vs {e}");
    }
}

#[test]
fn top_k_never_yields_a_token_outside_the_k_best_and_renormalises_them() {
    let top3 = [4, 6, 1];
    let p = params(|p| p.top_k = 3);
    let freq = frequencies(p.clone(), &LOGITS);
    let expected = restricted(&softmax(&LOGITS, 1.0), &top3);
    assert_close(&freq, &expected);
    assert_eq!(kept(&reported(p, &LOGITS)), [1, 4, 6]);
}

#[test]
fn top_k_over_a_large_vocabulary_draws_only_the_k_best() {
    // 50k pseudo-random logits; the 5 best are found by a full sort.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let logits: Vec<f32> = (0..50_000)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0
        })
        .collect();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let best = &order[..5];
    let mut sampler = Sampler::new(params(|p| p.top_k = 5), 0).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..2_000 {
        let mut scratch = logits.clone();
        let token = sampler.sample(&mut scratch, &[]) as usize;
        assert!(best.contains(&token), "token {token} is not among {best:?}");
        seen.insert(token);
    }
    assert!(seen.len() >= 2, "sampling, not argmax");
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_the_threshold() {
    let logits = logits_of(&PROBS);
    for (top_p, nucleus) in [
        (0.3, vec![1]),
        (0.6, vec![1, 3]),
        (0.75, vec![1, 3, 4]),
        (0.85, vec![1, 2, 3, 4]),
        // Tokens 0 and 5 tie at 0.05: the lower id comes first.
        (0.92, vec![0, 1, 2, 3, 4]),
        (0.97, vec![0, 1, 2, 3, 4, 5]),
    ] {
        let p = params(|p| p.top_p = top_p);
        assert_eq!(
            kept(&reported(p.clone(), &logits)),
            nucleus,
            "top_p {top_p}"
        );
        if top_p == 0.75 {
            assert_close(&frequencies(p, &logits), &restricted(&PROBS, &nucleus));
        }
    }
}

#[test]
fn top_p_is_measured_after_temperature() {
    // At temperature 1 token 0 alone has 0.5 < 0.6; at 0.5 it has 0.25/0.38 = 0.66.
    let logits = logits_of(&[0.5, 0.3, 0.2]);
    let at = |temperature| {
        kept(&reported(
            params(|p| {
                p.top_p = 0.6;
                p.temperature = temperature;
            }),
            &logits,
        ))
    };
    assert_eq!(at(1.0), [0, 1]);
    assert_eq!(at(0.5), [0]);
}

#[test]
fn top_p_is_measured_on_the_distribution_renormalised_after_top_k() {
    // Top-2 leaves 0.40 and 0.25, renormalised 0.615 and 0.385: token 1 alone reaches 0.6,
    // where against the full distribution (0.40) it would not.
    let logits = logits_of(&PROBS);
    let p = params(|p| {
        p.top_k = 2;
        p.top_p = 0.6;
    });
    assert_eq!(kept(&reported(p, &logits)), [1]);
}

#[test]
fn min_p_drops_tokens_below_the_fraction_of_the_most_likely() {
    let logits = logits_of(&PROBS);
    // Thresholds 0.3 * 0.40 = 0.12 and 0.5 * 0.40 = 0.20.
    let p = params(|p| p.min_p = 0.3);
    assert_eq!(kept(&reported(p.clone(), &logits)), [1, 3, 4]);
    assert_close(&frequencies(p, &logits), &restricted(&PROBS, &[1, 3, 4]));
    assert_eq!(kept(&reported(params(|p| p.min_p = 0.5), &logits)), [1, 3]);
    assert_eq!(kept(&reported(params(|p| p.min_p = 1.0), &logits)), [1]);
}

#[test]
fn min_p_applies_after_top_p_as_in_transformers() {
    // Top-p 0.65 on (0.6, 0.3, 0.1) keeps {0, 1}; min-p 0.2 (threshold 0.12) keeps both.
    // vLLM V1's order (min-p first, top-p on the renormalised rest) would keep only token 0.
    let logits = logits_of(&[0.6, 0.3, 0.1]);
    let p = params(|p| {
        p.top_p = 0.65;
        p.min_p = 0.2;
    });
    assert_eq!(kept(&reported(p, &logits)), [0, 1]);
}

#[test]
fn every_cut_together_keeps_the_shortest_prefix() {
    let logits = logits_of(&PROBS);
    let p = params(|p| {
        p.top_k = 4;
        p.top_p = 0.95;
        p.min_p = 0.3;
    });
    // top-k: {1, 3, 4, 2}; top-p over its 0.9 mass: all four; min-p 0.12: drops token 2.
    let got = reported(p.clone(), &logits);
    assert_eq!(kept(&got), [1, 3, 4]);
    assert_close(&frequencies(p, &logits), &restricted(&PROBS, &[1, 3, 4]));
}

#[test]
fn masked_tokens_are_never_drawn() {
    let mut logits = LOGITS;
    logits[4] = f32::NEG_INFINITY;
    logits[6] = f32::NAN;
    let freq = frequencies(params(|_| {}), &logits);
    assert_eq!((freq[4], freq[6]), (0.0, 0.0));
    let mut finite = LOGITS;
    finite[4] = -1e30;
    finite[6] = -1e30;
    assert_close(&freq, &softmax(&finite, 1.0));
}

#[test]
fn an_all_masked_vocabulary_yields_the_first_token_without_panicking() {
    let logits = [f32::NEG_INFINITY; 4];
    let mut sampler = Sampler::new(params(|p| p.top_p = 0.5), 0).unwrap();
    assert_eq!(sampler.sample(&mut logits.clone(), &[]), 0);
}
