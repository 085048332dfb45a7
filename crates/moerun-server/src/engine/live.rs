//! The engine's state for one live request: its sampler (seeded per request, so its draws do not
//! depend on the batch), its streaming detokenizer and stop-string matcher, and the channel its
//! events go to. Turning a sampled token into an [`Event`] happens here, in the same order the
//! CLI's `generate` composes them: stop token -> detokenize -> stop strings -> emit.

use std::time::Instant;

use moerun_engine::sampling::{Sampler, TokenLogprob};
use moerun_engine::stop::{StopMatcher, StopTokens};
use moerun_text::{DecodeStream, Tokenizer};
use tokio::sync::mpsc;

use super::{Event, FinishReason, GenerationRequest, TokenLogprobs, Usage};
use crate::metrics::Metrics;
use crate::served::ServedModel;

/// One request the engine is working on (waiting or running in the scheduler).
pub(super) struct Live<'m> {
    events: mpsc::UnboundedSender<Event>,
    tokenizer: &'m Tokenizer,
    sampler: Sampler,
    decoder: DecodeStream<'m, Tokenizer>,
    matcher: StopMatcher,
    stop_tokens: StopTokens,
    logprobs: Option<usize>,
    every_token: bool,
    usage: Usage,
    arrival: Instant,
    last_token_at: Option<Instant>,
    top: Vec<TokenLogprob>,
}

impl<'m> Live<'m> {
    /// State for `request`; its parameters were validated by the HTTP layer, so an error here
    /// is an internal one.
    pub fn new(
        model: &'m ServedModel,
        request: &GenerationRequest,
        events: mpsc::UnboundedSender<Event>,
    ) -> Result<Self, (String, mpsc::UnboundedSender<Event>)> {
        let checked = Sampler::new(request.sampling.clone(), request.prompt_tokens.len())
            .and_then(|s| Ok((s, StopMatcher::new(request.stop.iter().cloned())?)));
        let (sampler, matcher) = match checked {
            Ok(pair) => pair,
            Err(message) => return Err((message, events)),
        };
        let stop_tokens = StopTokens::new(
            &model.eos_token_ids,
            &request.stop_token_ids,
            request.ignore_eos,
        );
        Ok(Live {
            events,
            tokenizer: &model.tokenizer,
            sampler,
            // Special tokens are left out of the text, as OpenAI servers do by default.
            decoder: model.tokenizer.decode_stream(true),
            matcher,
            stop_tokens,
            logprobs: request.logprobs,
            every_token: request.every_token,
            usage: Usage {
                prompt_tokens: request.prompt_tokens.len(),
                completion_tokens: 0,
            },
            arrival: request.arrival,
            last_token_at: None,
            top: Vec::new(),
        })
    }

    /// Whether the client is gone (its receiver dropped).
    pub fn is_cancelled(&self) -> bool {
        self.events.is_closed()
    }

    /// Whether this request's next token is the argmax of the raw logits with nothing to report
    /// beside it (greedy, no penalties, no logprobs): the model may pick it on the device.
    pub fn takes_plain_greedy(&self) -> bool {
        self.logprobs.is_none() && self.sampler.params().is_plain_greedy()
    }

    /// Choose the next token from this sequence's logits row (used as scratch) given its whole
    /// history, with its logprobs if the request wants them.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> (u32, Option<TokenLogprobs>) {
        let Some(n) = self.logprobs else {
            return (self.sampler.sample(logits, history), None);
        };
        let chosen = self
            .sampler
            .sample_with_logprobs(logits, history, n, &mut self.top);
        let logprobs = TokenLogprobs {
            token: self.token_text(chosen.token),
            logprob: chosen.logprob,
            top: self
                .top
                .iter()
                .map(|t| (self.token_text(t.token), t.logprob))
                .collect(),
        };
        (chosen.token, Some(logprobs))
    }

    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Whether `token` ends the sequence without being part of it (EOS, a stop token id).
    pub fn is_stop_token(&self, token: u32) -> bool {
        self.stop_tokens.is_stop_token(token)
    }

    /// Record that a token was sampled now, for the latency histograms.
    pub fn record_timing(&mut self, now: Instant, metrics: &Metrics) {
        match self.last_token_at {
            None => metrics.observe_ttft(now.duration_since(self.arrival)),
            Some(previous) => metrics.observe_itl(now.duration_since(previous)),
        }
        self.last_token_at = Some(now);
    }

    /// A token joined the output: stream its text. True if it completed a stop string (the
    /// request must then finish with [`FinishReason::Stop`]).
    pub fn accept(&mut self, token: u32, logprobs: Option<TokenLogprobs>) -> Result<bool, String> {
        self.usage.completion_tokens += 1;
        let delta = self.decoder.step(token).map_err(|e| e.to_string())?;
        let (text, stopped) = match delta {
            Some(delta) => {
                let out = self.matcher.push(&delta);
                (out.text.to_string(), out.stop.is_some())
            }
            None => (String::new(), false),
        };
        let logprobs: Vec<TokenLogprobs> = logprobs.into_iter().collect();
        if !text.is_empty() || !logprobs.is_empty() || self.every_token {
            self.send(Event::Delta {
                text,
                logprobs,
                usage: self.usage,
            });
        }
        Ok(stopped)
    }

    /// The request ended: release text still held back (unless a stop string ended it), then
    /// send the terminal event.
    pub fn finish(mut self, reason: FinishReason, metrics: &Metrics) {
        if self.matcher.stopped().is_none() {
            let mut tail = String::new();
            if let Ok(Some(rest)) = self.decoder.finish() {
                tail.push_str(self.matcher.push(&rest).text);
            }
            if self.matcher.stopped().is_none() {
                tail.push_str(self.matcher.finish());
            }
            if !tail.is_empty() {
                self.send(Event::Delta {
                    text: tail,
                    logprobs: Vec::new(),
                    usage: self.usage,
                });
            }
        }
        metrics.observe_finished(reason, self.arrival.elapsed());
        self.send(Event::Finished {
            reason,
            usage: self.usage,
        });
    }

    /// The engine gave up on this request.
    pub fn fail(self, message: String) {
        self.send(Event::Failed(message));
    }

    fn send(&self, event: Event) {
        // A closed channel means the client left; the engine notices and aborts before the
        // next step, so there is nothing to do here.
        let _ = self.events.send(event);
    }
}
