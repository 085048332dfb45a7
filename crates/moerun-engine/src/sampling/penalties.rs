//! Repetition, presence and frequency penalties: the only steps that look at what the sequence
//! has already said. They edit the raw logits in place, before temperature, as both HF and vLLM
//! do, so a penalty means the same thing whatever the temperature.

use super::SamplingParams;

/// Apply the penalties of `params` to `logits`. `history` is the prompt followed by the output so
/// far; its first `prompt_len` tokens are the prompt (clamped to `history.len()`). Ids outside
/// the vocabulary are ignored: the model refuses them before they could be in a history.
///
/// - repetition penalty (HF `RepetitionPenaltyLogitsProcessor`, vLLM): once per distinct token
///   of prompt + output, a positive logit is divided by the penalty and a negative one
///   multiplied, so a penalty > 1 always makes the token less likely;
/// - frequency then presence (OpenAI): per distinct token of the output only,
///   `logit -= frequency * count`, then `logit -= presence`.
///
/// `scratch` holds a sorted copy of the history; it is reused between calls. Cost: O(h log h)
/// for a history of h tokens, nothing at all when every penalty is off.
pub(crate) fn apply_penalties(
    logits: &mut [f32],
    history: &[u32],
    prompt_len: usize,
    params: &SamplingParams,
    scratch: &mut Vec<u32>,
) {
    if params.repetition_penalty != 1.0 {
        let penalty = params.repetition_penalty;
        for_each_distinct(history, scratch, |token, _| {
            if let Some(x) = logits.get_mut(token as usize) {
                // x == 0 stays 0 either way; -inf stays -inf.
                *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
            }
        });
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let output = &history[prompt_len.min(history.len())..];
        let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
        for_each_distinct(output, scratch, |token, count| {
            if let Some(x) = logits.get_mut(token as usize) {
                // Two subtractions in OpenAI's (and vLLM's) order, for identical rounding.
                *x -= frequency * count as f32;
                *x -= presence;
            }
        });
    }
}

/// Call `f(token, occurrences)` once per distinct token of `tokens`, in increasing id order.
fn for_each_distinct(tokens: &[u32], scratch: &mut Vec<u32>, mut f: impl FnMut(u32, usize)) {
    scratch.clear();
    scratch.extend_from_slice(tokens);
    scratch.sort_unstable();
    for run in scratch.chunk_by(|a, b| a == b) {
        f(run[0], run.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_tokens_are_visited_once_with_their_counts() {
        let mut seen = Vec::new();
        for_each_distinct(&[5, 1, 5, 3, 5, 1], &mut Vec::new(), |t, c| {
            seen.push((t, c))
        });
        assert_eq!(seen, [(1, 2), (3, 1), (5, 3)]);
    }

    #[test]
    fn out_of_vocabulary_history_tokens_are_ignored() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 1.0,
            ..Default::default()
        };
        let mut logits = [1.0f32, 1.0];
        apply_penalties(&mut logits, &[7, 1, 99], 1, &params, &mut Vec::new());
        assert_eq!(logits, [1.0, 0.5 - 1.0]);
    }
}
