//! Logprobs are log_softmax of the penalised, temperature-scaled logits over the whole
//! vocabulary, before top-k/top-p/min-p; asking for them does not change which token is drawn.

use moerun_engine::sampling::{Sampler, SamplingParams, TokenLogprob};

const LOGITS: [f32; 7] = [0.5, 2.0, -1.0, 1.5, 2.0, 0.0, -3.0];

/// log_softmax(logits / temperature) in f64.
fn log_softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    let scaled: Vec<f64> = logits.iter().map(|&x| f64::from(x) / temperature).collect();
    let max = scaled.iter().copied().fold(f64::MIN, f64::max);
    let lse = max + scaled.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    scaled.iter().map(|x| x - lse).collect()
}

fn step(
    params: SamplingParams,
    logits: &[f32],
    history: &[u32],
    top_n: usize,
) -> (TokenLogprob, Vec<TokenLogprob>) {
    let mut sampler = Sampler::new(params, 0).unwrap();
    let mut top = Vec::new();
    let chosen = sampler.sample_with_logprobs(&mut logits.to_vec(), history, top_n, &mut top);
    (chosen, top)
}

#[test]
fn the_chosen_token_and_the_top_list_carry_the_temperature_scaled_logprobs() {
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(11),
        ..Default::default()
    };
    let want = log_softmax(&LOGITS, 0.8);
    let (chosen, top) = step(params, &LOGITS, &[], 3);
    assert!((f64::from(chosen.logprob) - want[chosen.token as usize]).abs() < 1e-5);
    // Tokens 1 and 4 tie at 2.0: the lower id first.
    let tokens: Vec<u32> = top.iter().map(|t| t.token).collect();
    assert_eq!(tokens, [1, 4, 3]);
    for t in &top {
        assert!(
            (f64::from(t.logprob) - want[t.token as usize]).abs() < 1e-5,
            "{t:?}"
        );
    }
}

#[test]
fn logprobs_are_taken_before_truncation_so_cut_tokens_keep_finite_values() {
    let params = SamplingParams {
        top_k: 1,
        seed: Some(0),
        ..Default::default()
    };
    let want = log_softmax(&LOGITS, 1.0);
    let (chosen, top) = step(params, &LOGITS, &[], LOGITS.len());
    assert_eq!(
        chosen.token, 1,
        "top-k 1 leaves only the first of the tied best"
    );
    assert!(
        (f64::from(chosen.logprob) - want[1]).abs() < 1e-5,
        "not log(1) = 0"
    );
    assert_eq!(top.len(), LOGITS.len());
    let total: f64 = top.iter().map(|t| f64::from(t.logprob).exp()).sum();
    assert!(
        (total - 1.0).abs() < 1e-5,
        "the full list sums to one: {total}"
    );
}

#[test]
fn greedy_logprobs_are_the_penalised_log_softmax_at_temperature_one() {
    let params = SamplingParams {
        temperature: 0.0,
        repetition_penalty: 2.0,
        ..Default::default()
    };
    // Token 1 was generated: 2.0 / 2 = 1.0, which leaves token 4 as the argmax.
    let mut penalised = LOGITS;
    penalised[1] = 1.0;
    let want = log_softmax(&penalised, 1.0);
    let (chosen, top) = step(params, &LOGITS, &[1], 2);
    assert_eq!(chosen.token, 4);
    assert!((f64::from(chosen.logprob) - want[4]).abs() < 1e-5);
    let tokens: Vec<u32> = top.iter().map(|t| t.token).collect();
    assert_eq!(tokens, [4, 3]);
}

#[test]
fn asking_for_logprobs_does_not_change_the_drawn_tokens() {
    let params = SamplingParams {
        top_p: 0.9,
        seed: Some(5),
        ..Default::default()
    };
    let mut plain = Sampler::new(params.clone(), 0).unwrap();
    let mut with_logprobs = Sampler::new(params, 0).unwrap();
    let mut top = Vec::new();
    for _ in 0..200 {
        let a = plain.sample(&mut LOGITS.to_vec(), &[]);
        let b = with_logprobs.sample_with_logprobs(&mut LOGITS.to_vec(), &[], 5, &mut top);
        assert_eq!(a, b.token);
    }
}

#[test]
fn more_top_logprobs_than_the_vocabulary_lists_every_token_once() {
    let (_, top) = step(SamplingParams::default(), &LOGITS, &[], 100);
    let mut tokens: Vec<u32> = top.iter().map(|t| t.token).collect();
    assert!(top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
    tokens.sort_unstable();
    assert_eq!(tokens, (0..LOGITS.len() as u32).collect::<Vec<_>>());
}

#[test]
fn an_all_masked_vocabulary_reports_minus_infinity_not_nan() {
    let (chosen, top) = step(SamplingParams::default(), &[f32::NEG_INFINITY; 3], &[], 2);
    assert_eq!(chosen.token, 0);
    assert_eq!(chosen.logprob, f32::NEG_INFINITY);
    assert!(top.iter().all(|t| t.logprob == f32::NEG_INFINITY));
}
