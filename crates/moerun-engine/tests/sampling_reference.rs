//! The sampler's partial selections (select_nth, chunked nucleus, pre-filtering) against the
//! obvious definition: sort the whole vocabulary, cut top-k, then top-p, then min-p, renormalise.
//! Many random vocabularies and parameters, with plenty of tied logits, must give the same kept
//! set and the same probabilities.

use moerun_engine::sampling::{Sampler, SamplingParams};

/// A small deterministic generator, so the cases are the same on every run.
struct Lcg(u64);

impl Lcg {
    fn next_f32(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next_f32() * n as f32) as usize).min(n - 1)
    }
}

/// The textbook pipeline over a full sort, with the same f32 weights as the sampler.
fn reference(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
    let x: Vec<f32> = logits.iter().map(|&l| l / p.temperature).collect();
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = x
        .iter()
        .map(|&v| if v == max { 1.0 } else { (v - max).exp() })
        .collect();
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));

    let mut mass: f64 = w.iter().map(|&v| f64::from(v)).sum();
    if p.top_k > 0 && (p.top_k as usize) < x.len() {
        order.truncate(p.top_k as usize);
        mass = order.iter().map(|&i| f64::from(w[i])).sum();
    }
    if p.top_p < 1.0 {
        let target = f64::from(p.top_p) * mass;
        let mut cumulative = 0.0;
        let n = order
            .iter()
            .position(|&i| {
                cumulative += f64::from(w[i]);
                cumulative >= target
            })
            .map_or(order.len(), |i| i + 1);
        order.truncate(n);
    }
    if p.min_p > 0.0 {
        order.retain(|&i| w[i] >= p.min_p);
    }
    let kept_mass: f64 = order.iter().map(|&i| f64::from(w[i])).sum();
    let mut probs = vec![0.0; x.len()];
    for &i in &order {
        probs[i] = f64::from(w[i]) / kept_mass;
    }
    probs
}

fn reported(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
    let mut probs = Vec::new();
    Sampler::new(p.clone(), 0)
        .unwrap()
        .probabilities(&mut logits.to_vec(), &[], &mut probs);
    probs.into_iter().map(f64::from).collect()
}

fn assert_same_distribution(got: &[f64], want: &[f64], case: &str) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g > 0.0, w > 0.0, "{case}: token {i} kept {} vs {}", g, w);
        assert!(
            (g - w).abs() <= 1e-6 * w.max(1e-3),
            "{case}: token {i}: {g} vs {w}"
        );
    }
}

#[test]
fn fast_cuts_agree_with_a_full_sort_on_random_vocabularies() {
    let mut rng = Lcg(42);
    for case in 0..400 {
        let vocab: usize = [1, 2, 7, 100, 1000, 5000][case % 6];
        // Quantised logits make ties common; a narrow spread makes the nucleus large enough to
        // need several selection chunks.
        let spread = [0.5, 4.0, 20.0][rng.below(3)];
        let quantised = rng.below(2) == 0;
        let logits: Vec<f32> = (0..vocab)
            .map(|_| {
                let v = rng.next_f32() * spread;
                if quantised {
                    (v * 4.0).round() / 4.0
                } else {
                    v
                }
            })
            .collect();
        let top_k_choices = [
            0,
            -1,
            1,
            2,
            5,
            50,
            vocab as i32 - 1,
            vocab as i32,
            vocab as i32 + 9,
        ];
        let p = SamplingParams {
            temperature: [1.0, 0.5, 1.7][rng.below(3)],
            top_k: top_k_choices[rng.below(top_k_choices.len())].max(0),
            top_p: if rng.below(3) == 0 {
                1.0
            } else {
                0.05 + 0.95 * rng.next_f32()
            },
            min_p: if rng.below(3) == 0 {
                0.0
            } else {
                rng.next_f32()
            },
            seed: Some(0),
            ..Default::default()
        };
        let label = format!("case {case}: vocab {vocab}, {p:?}");
        assert_same_distribution(&reported(&logits, &p), &reference(&logits, &p), &label);
    }
}

#[test]
fn a_150k_vocabulary_with_top_p_keeps_exactly_the_reference_nucleus() {
    // A peaked distribution like a real model's: a few strong candidates, a long flat tail.
    let mut rng = Lcg(7);
    let logits: Vec<f32> = (0..150_000)
        .map(|i| {
            let tail = rng.next_f32() * 6.0 - 10.0;
            if i % 9973 == 0 {
                tail + 14.0
            } else {
                tail
            }
        })
        .collect();
    for top_p in [0.5, 0.9, 0.95, 0.999] {
        let p = SamplingParams {
            top_p,
            seed: Some(0),
            ..Default::default()
        };
        let label = format!("top_p {top_p}");
        assert_same_distribution(&reported(&logits, &p), &reference(&logits, &p), &label);
    }
}
