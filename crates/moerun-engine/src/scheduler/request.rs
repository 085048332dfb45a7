//! What goes into the scheduler (a [`Request`]), what can refuse it ([`AddError`]), and what
//! comes out when a request ends ([`Finished`]).

use std::fmt;

/// Identifies a request; the engine maps the API's string ids onto these.
pub type RequestId = u64;

/// A generation request, already tokenised.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Unique among live requests.
    pub id: RequestId,
    /// The prompt, at least one token.
    pub prompt_tokens: Vec<u32>,
    /// Most tokens to generate, at least 1. The request is refused, not clamped, when
    /// `prompt + max_new_tokens` exceeds `max_model_len`: silently returning a shorter
    /// completion than asked is worse than a clear 400. A server whose client left `max_tokens`
    /// out should pass `max_model_len - prompt_len`, as vLLM does.
    pub max_new_tokens: usize,
}

/// Why [`super::Scheduler::add_request`] refused a request. Each names the limit it hit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddError {
    /// The prompt has no tokens.
    EmptyPrompt,
    /// `max_new_tokens` is 0.
    ZeroMaxNewTokens,
    /// The prompt alone leaves no room for one generated token.
    PromptTooLong {
        prompt_len: usize,
        max_model_len: usize,
    },
    /// Prompt plus requested completion exceed the model's context.
    ContextTooLong {
        prompt_len: usize,
        max_new_tokens: usize,
        max_model_len: usize,
    },
    /// The request could never fit in the KV cache, even alone.
    ExceedsKvCapacity {
        needed_blocks: usize,
        num_blocks: usize,
    },
    /// The waiting queue is full: the server is overloaded (429/503), retry later.
    QueueFull { max_waiting: usize },
    /// A live request already has this id.
    DuplicateId(RequestId),
}

impl AddError {
    /// Whether the refusal is about load rather than the request itself (429/503, not 400).
    pub fn is_overload(&self) -> bool {
        matches!(self, AddError::QueueFull { .. })
    }
}

impl fmt::Display for AddError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddError::EmptyPrompt => write!(f, "the prompt is empty"),
            AddError::ZeroMaxNewTokens => write!(f, "max_tokens must be at least 1"),
            AddError::PromptTooLong {
                prompt_len,
                max_model_len,
            } => write!(
                f,
                "the prompt has {prompt_len} tokens; this model's maximum context length is \
                 {max_model_len} tokens, which leaves no room for a completion"
            ),
            AddError::ContextTooLong {
                prompt_len,
                max_new_tokens,
                max_model_len,
            } => write!(
                f,
                "this model's maximum context length is {max_model_len} tokens, but {} were \
                 requested ({prompt_len} in the prompt, {max_new_tokens} for the completion)",
                prompt_len + max_new_tokens
            ),
            AddError::ExceedsKvCapacity {
                needed_blocks,
                num_blocks,
            } => write!(
                f,
                "the request needs {needed_blocks} KV blocks but the cache has {num_blocks}"
            ),
            AddError::QueueFull { max_waiting } => {
                write!(
                    f,
                    "the server is busy: {max_waiting} requests are already waiting"
                )
            }
            AddError::DuplicateId(id) => write!(f, "request id {id} is already in use"),
        }
    }
}

impl std::error::Error for AddError {}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated `max_new_tokens` tokens (OpenAI's `"length"`).
    Length,
    /// The engine saw EOS or a stop string (OpenAI's `"stop"`).
    Stop,
    /// The client went away, or the engine gave up on it.
    Aborted,
}

/// A request that ended; its blocks are already released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub id: RequestId,
    pub reason: FinishReason,
    /// Length of the original prompt.
    pub prompt_len: usize,
    /// Every token generated, in order (also those generated before a preemption).
    pub output_tokens: Vec<u32>,
}

/// Why [`super::Scheduler::update`] refused a step's results. Nothing was applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateError {
    /// A chunk that completed its sequence's pending tokens needs a sampled token.
    MissingToken(RequestId),
    /// A token for a request whose chunk produced no logits, or that was not scheduled.
    UnexpectedToken(RequestId),
    /// The same request appears twice in the results.
    DuplicateResult(RequestId),
}

impl fmt::Display for UpdateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpdateError::MissingToken(id) => write!(f, "no sampled token for request {id}"),
            UpdateError::UnexpectedToken(id) => {
                write!(f, "request {id} was not scheduled to sample a token")
            }
            UpdateError::DuplicateResult(id) => write!(f, "request {id} reported twice"),
        }
    }
}

impl std::error::Error for UpdateError {}

/// Where a live request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    Waiting,
    Running,
}

/// A live request as the scheduler tracks it.
#[derive(Debug)]
pub(super) struct SeqState {
    /// Arrival order; the waiting and running lists are both sorted by it.
    pub arrival: u64,
    pub status: Status,
    /// Prompt then generated tokens. After a preemption all of them are recomputed as if they
    /// were the prompt, so nothing generated is lost.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_new_tokens: usize,
    /// Leading tokens whose KV is in the cache (as of the last update).
    pub num_computed: usize,
}

impl SeqState {
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens whose KV is still to compute; the last of them yields the next token's logits.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
}
