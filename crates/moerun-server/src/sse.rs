//! Streaming responses: the engine's events for one request turned into Server-Sent Events, one
//! `data: {json}` per chunk and a final `data: [DONE]`, as OpenAI streams. The stream owns the
//! request's event receiver, so when the client disconnects and the body is dropped, the
//! receiver goes with it and the engine aborts the request before its next step.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};

use crate::api::request::Endpoint;
use crate::api::response::{chunk_json, logprobs_json, usage_chunk_json, Chunk, ResponseMeta};
use crate::engine::{Event, EventReceiver};
use crate::error::ApiError;

/// How the client asked to be streamed to.
#[derive(Clone, Copy, Debug)]
pub struct StreamOptions {
    pub include_usage: bool,
    pub continuous_usage: bool,
}

enum State {
    /// Nothing sent yet (chat opens with a chunk carrying the role).
    Start,
    /// Relaying engine events; `offset` is the completion text's length so far.
    Relaying {
        offset: usize,
    },
    /// Everything but `[DONE]` is sent.
    Closing,
    Done,
}

struct Streamer {
    meta: ResponseMeta,
    options: StreamOptions,
    events: EventReceiver,
    state: State,
}

/// The SSE response for a request whose engine events arrive on `events`.
pub fn stream_response(
    meta: ResponseMeta,
    options: StreamOptions,
    events: EventReceiver,
) -> Response {
    let streamer = Streamer {
        meta,
        options,
        events,
        state: State::Start,
    };
    Sse::new(into_stream(streamer))
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn data(value: &serde_json::Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

fn into_stream(streamer: Streamer) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(streamer, |mut s| async move {
        let events = s.next_events().await?;
        Some((events, s))
    })
    .flat_map(|events| stream::iter(events.into_iter().map(Ok)))
}

impl Streamer {
    /// The SSE events to send next; `None` once the stream is over.
    async fn next_events(&mut self) -> Option<Vec<SseEvent>> {
        match self.state {
            State::Start => {
                self.state = State::Relaying { offset: 0 };
                if self.meta.endpoint == Endpoint::Chat {
                    let opening = Chunk {
                        text: "",
                        role: true,
                        logprobs: None,
                        finish_reason: None,
                        // Usage starts with the first token's chunk.
                        usage: None,
                    };
                    return Some(vec![data(&chunk_json(&self.meta, &opening))]);
                }
                Some(Vec::new())
            }
            State::Relaying { offset } => Some(self.relay(offset).await),
            State::Closing => {
                self.state = State::Done;
                Some(vec![SseEvent::default().data("[DONE]")])
            }
            State::Done => None,
        }
    }

    async fn relay(&mut self, offset: usize) -> Vec<SseEvent> {
        let continuous = self.options.continuous_usage;
        match self.events.recv().await {
            Some(Event::Delta {
                text,
                logprobs,
                usage,
            }) => {
                let lp = (self.meta.logprobs && !logprobs.is_empty())
                    .then(|| logprobs_json(self.meta.endpoint, &logprobs, offset));
                self.state = State::Relaying {
                    offset: offset + text.len(),
                };
                let chunk = Chunk {
                    text: &text,
                    role: false,
                    logprobs: lp,
                    finish_reason: None,
                    usage: continuous.then_some(usage),
                };
                vec![data(&chunk_json(&self.meta, &chunk))]
            }
            Some(Event::Finished { reason, usage }) => {
                self.state = State::Closing;
                let last = Chunk {
                    text: "",
                    role: false,
                    logprobs: None,
                    finish_reason: Some(reason),
                    usage: continuous.then_some(usage),
                };
                let mut out = vec![data(&chunk_json(&self.meta, &last))];
                if self.options.include_usage {
                    out.push(data(&usage_chunk_json(&self.meta, usage)));
                }
                out
            }
            Some(Event::Failed(message)) => {
                self.state = State::Closing;
                vec![data(&ApiError::internal(message).body())]
            }
            None => {
                self.state = State::Closing;
                vec![data(&ApiError::internal("the engine stopped").body())]
            }
        }
    }
}
