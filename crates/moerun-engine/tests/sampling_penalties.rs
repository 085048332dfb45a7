//! Penalties change exactly the logits they should by exactly the amounts HF and OpenAI define,
//! and greedy decoding is the argmax of the penalised logits with ties to the lowest id.
//! The sampler leaves the processed logits in the caller's slice, which is what is checked here.

use moerun_engine::sampling::{Sampler, SamplingParams};

/// Run one greedy step and return (token, logits after penalties).
fn greedy_step(
    params: SamplingParams,
    prompt_len: usize,
    logits: &[f32],
    history: &[u32],
) -> (u32, Vec<f32>) {
    let params = SamplingParams {
        temperature: 0.0,
        ..params
    };
    let mut sampler = Sampler::new(params, prompt_len).unwrap();
    let mut processed = logits.to_vec();
    let token = sampler.sample(&mut processed, history);
    (token, processed)
}

#[test]
fn greedy_picks_the_argmax_and_breaks_ties_towards_the_lowest_id() {
    let logits = [1.0, 5.0, 3.0, 5.0, -2.0];
    let (token, processed) = greedy_step(SamplingParams::greedy(), 0, &logits, &[]);
    assert_eq!(token, 1);
    assert_eq!(
        processed, logits,
        "greedy without penalties leaves logits alone"
    );
    let (token, _) = greedy_step(SamplingParams::greedy(), 0, &[0.0; 6], &[]);
    assert_eq!(token, 0);
}

#[test]
fn a_temperature_below_the_greedy_threshold_decodes_greedily() {
    let params = SamplingParams {
        temperature: 1e-6,
        seed: Some(3),
        ..Default::default()
    };
    let mut sampler = Sampler::new(params, 0).unwrap();
    for _ in 0..100 {
        assert_eq!(sampler.sample(&mut [0.3, 0.1, 0.31, 0.31], &[]), 2);
    }
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens_once() {
    let params = SamplingParams {
        repetition_penalty: 2.0,
        ..Default::default()
    };
    let logits = [2.0, -2.0, 1.0, 0.0, 3.0, 4.0];
    // Token 0 in the prompt, 1 in both (twice), 3 in the output; 2, 4, 5 never seen.
    let (_, processed) = greedy_step(params, 2, &logits, &[0, 1, 1, 3, 1]);
    assert_eq!(processed, [1.0, -4.0, 1.0, 0.0, 3.0, 4.0]);
}

#[test]
fn repetition_penalty_can_move_the_argmax() {
    let params = SamplingParams {
        repetition_penalty: 1.5,
        ..Default::default()
    };
    let (token, _) = greedy_step(params, 1, &[3.0, 2.5, 1.0], &[0]);
    assert_eq!(token, 1, "3.0 / 1.5 = 2.0 < 2.5");
}

#[test]
fn frequency_and_presence_penalties_count_only_output_tokens() {
    let params = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..Default::default()
    };
    let logits = [1.0, 1.0, 1.0, 1.0, 1.0];
    // Prompt [0, 2]; output [2, 2, 3].
    let (_, processed) = greedy_step(params, 2, &logits, &[0, 2, 2, 2, 3]);
    let expected = [
        1.0,                    // prompt only: untouched
        1.0,                    // never seen
        1.0 - 0.25 * 2.0 - 0.5, // twice in the output
        1.0 - 0.25 - 0.5,       // once in the output
        1.0,
    ];
    assert_eq!(processed, expected);
}

#[test]
fn negative_presence_and_frequency_penalties_encourage_repeats() {
    let params = SamplingParams {
        presence_penalty: -1.0,
        frequency_penalty: -0.5,
        ..Default::default()
    };
    let (token, processed) = greedy_step(params, 0, &[2.0, 1.0], &[1]);
    assert_eq!(processed, [2.0, 2.5]);
    assert_eq!(token, 1);
}

#[test]
fn repetition_penalty_comes_before_the_additive_penalties() {
    let params = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 1.0,
        ..Default::default()
    };
    // (4 / 2) - 1 = 1, where the other order would give (4 - 1) / 2 = 1.5.
    let (_, processed) = greedy_step(params, 0, &[4.0, 0.0], &[0]);
    assert_eq!(processed, [1.0, 0.0]);
}

#[test]
fn penalties_apply_to_raw_logits_before_temperature() {
    let params = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 1.0,
        temperature: 0.5,
        seed: Some(0),
        ..Default::default()
    };
    let mut sampler = Sampler::new(params, 1).unwrap();
    let mut logits = [6.0, 6.0, 6.0];
    sampler.sample(&mut logits, &[0, 1]);
    // Token 0: 6 / 2 = 3, then / 0.5 = 6. Token 1: 6 / 2 - 1 = 2, then 4. Token 2: 12.
    assert_eq!(logits, [6.0, 4.0, 12.0]);
}

#[test]
fn a_history_shorter_than_the_prompt_counts_as_all_prompt() {
    let params = SamplingParams {
        frequency_penalty: 1.0,
        ..Default::default()
    };
    let (_, processed) = greedy_step(params, 10, &[1.0, 1.0], &[0, 1]);
    assert_eq!(processed, [1.0, 1.0]);
}

#[test]
fn history_tokens_outside_the_vocabulary_do_not_panic() {
    let params = SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 1.0,
        ..Default::default()
    };
    let (_, processed) = greedy_step(params, 1, &[1.0, 1.0], &[u32::MAX, 5, 1]);
    assert_eq!(processed, [1.0, 1.0 / 1.3 - 1.0]);
}
