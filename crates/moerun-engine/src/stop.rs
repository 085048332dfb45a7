//! When generation stops: stop strings over streamed text, and stop token ids (EOS).
//!
//! [`StopMatcher`] takes the detokenised text delta by delta and promises that
//! - the text it releases never contains a stop string, nor any part of one: a suffix that could
//!   still grow into a stop string is held back until the next delta decides it;
//! - when a stop string completes, everything before it is released and the stop string itself
//!   is not (OpenAI's behaviour), and nothing after it ever is;
//! - the released text and the stop decision do not depend on how the text was split into
//!   deltas: the stop string that *ends* first in the text wins, and of several ending at the same
//!   place the longest (which starts first);
//! - [`StopMatcher::finish`] releases whatever is still held back once generation ends otherwise.
//!
//! Deltas are `&str`, so whole characters: holding back bytes of an unfinished UTF-8 sequence is
//! the detokeniser's job, and slicing here always falls on character boundaries.

/// What one [`StopMatcher::push`] released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Emitted<'a> {
    /// Text that is safe to show now.
    pub text: &'a str,
    /// The stop string this delta completed, if any: `text` ends right before it, and the
    /// sequence is finished.
    pub stop: Option<&'a str>,
}

/// Finds stop strings in a stream of text deltas without ever releasing part of one.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Unreleased text, behind `released` bytes handed out by the previous call. Those are only
    /// removed at the next call, so that calls can return slices of this buffer.
    buffer: String,
    released: usize,
    /// Index into `stops` of the stop string hit, once one has been.
    hit: Option<usize>,
}

impl StopMatcher {
    /// A matcher for these stop strings (none is fine: then text passes straight through).
    /// Refuses an empty stop string, which would match before any text.
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Result<Self, String> {
        let stops: Vec<String> = stops.into_iter().map(Into::into).collect();
        if let Some(i) = stops.iter().position(String::is_empty) {
            return Err(format!(
                "stop[{i}] is an empty string, which would match anywhere"
            ));
        }
        Ok(StopMatcher {
            stops,
            ..Default::default()
        })
    }

    /// The stop strings, in the order given.
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// The stop string that ended the text, once one has.
    pub fn stopped(&self) -> Option<&str> {
        self.hit.map(|i| self.stops[i].as_str())
    }

    /// Feed the next piece of generated text and get what can be shown now. After a stop string
    /// has been hit, further text is ignored (nothing is released).
    pub fn push(&mut self, delta: &str) -> Emitted<'_> {
        self.drop_released();
        if self.hit.is_some() {
            return Emitted {
                text: "",
                stop: None,
            };
        }
        self.buffer.push_str(delta);

        if let Some((index, start)) = self.first_match() {
            self.hit = Some(index);
            self.buffer.truncate(start);
            self.released = start;
            return Emitted {
                text: &self.buffer,
                stop: Some(&self.stops[index]),
            };
        }
        self.released = self.held_from();
        Emitted {
            text: &self.buffer[..self.released],
            stop: None,
        }
    }

    /// Release the text still held back, at the end of generation (no stop string can complete
    /// any more). Empty after a stop string was hit.
    pub fn finish(&mut self) -> &str {
        self.drop_released();
        self.released = self.buffer.len();
        &self.buffer
    }

    fn drop_released(&mut self) {
        self.buffer.drain(..self.released);
        self.released = 0;
    }

    /// The stop occurrence in `buffer` that ends first (ties: the longest), as (index, start).
    /// The buffer held no complete stop string before this delta, so any match involves it.
    fn first_match(&self) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None; // (end, start, index)
        for (index, stop) in self.stops.iter().enumerate() {
            // The first occurrence of a given string is also the one that ends first.
            if let Some(start) = self.buffer.find(stop.as_str()) {
                let candidate = (start + stop.len(), start, index);
                if best.is_none_or(|b| (candidate.0, candidate.1) < (b.0, b.1)) {
                    best = Some(candidate);
                }
            }
        }
        best.map(|(_, start, index)| (index, start))
    }

    /// Where the longest suffix of `buffer` that could still grow into a stop string begins
    /// (`buffer.len()` when there is none).
    fn held_from(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A proper prefix is at most `longest - 1` bytes, so only that tail needs checking;
        // earliest start first, for the longest suffix.
        let from = self.buffer.len().saturating_sub(longest.saturating_sub(1));
        (from..self.buffer.len())
            .filter(|&i| self.buffer.is_char_boundary(i))
            .find(|&i| {
                let tail = &self.buffer.as_bytes()[i..];
                self.stops.iter().any(|s| s.as_bytes().starts_with(tail))
            })
            .unwrap_or(self.buffer.len())
    }
}

/// Token ids that end a sequence: the model's EOS ids (unless the request ignores EOS) and the
/// request's own stop token ids. As in OpenAI and vLLM, a stop token's text is not emitted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopTokens {
    /// Sorted and deduplicated, for binary search.
    ids: Vec<u32>,
}

impl StopTokens {
    /// Stop on `stop_token_ids`, and on `eos_token_ids` unless `ignore_eos` (vLLM's flag, for
    /// benchmarks that must generate exactly `max_tokens`).
    pub fn new(eos_token_ids: &[u32], stop_token_ids: &[u32], ignore_eos: bool) -> Self {
        let mut ids = stop_token_ids.to_vec();
        if !ignore_eos {
            ids.extend_from_slice(eos_token_ids);
        }
        ids.sort_unstable();
        ids.dedup();
        StopTokens { ids }
    }

    /// Whether generating `token` ends the sequence.
    pub fn is_stop_token(&self, token: u32) -> bool {
        self.ids.binary_search(&token).is_ok()
    }

    /// The stop token ids, sorted.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
