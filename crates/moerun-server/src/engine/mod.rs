//! The engine: one dedicated thread that owns the KV cache and the scheduler and runs the model
//! step after step (iteration-level continuous batching), fed by a bounded channel of commands
//! from the HTTP handlers. The forward pass is CPU-bound rayon work, so it never runs on the
//! async runtime.
//!
//! What it promises:
//! - every submitted request gets, on its own channel, text deltas and then exactly one terminal
//!   event ([`Event::Finished`] or [`Event::Failed`]), unless its client went away;
//! - a request whose receiver is dropped (client disconnected) is aborted before the next step and
//!   its KV blocks are freed at once;
//! - a full command channel or a full waiting queue is refused at submission ([`SubmitError`]),
//!   so load past capacity gets a clear 503 instead of unbounded latency;
//! - a panic or error inside a step fails the requests of that step and the engine keeps serving.

mod live;
mod run;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use moerun_engine::sampling::SamplingParams;
use moerun_engine::scheduler::{AddError, SchedulerConfig};
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
use crate::served::ServedModel;

/// What the engine needs to run one request, already validated and tokenized.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub prompt_tokens: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop strings (not emitted).
    pub stop: Vec<String>,
    /// Token ids that end the sequence besides EOS (not emitted).
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the model's EOS ids (benchmarks with fixed output lengths).
    pub ignore_eos: bool,
    /// Report the chosen token's logprob and this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Send an event per generated token even when its text is still held back.
    pub every_token: bool,
    /// When the HTTP request arrived (time to first token counts from here).
    pub arrival: Instant,
}

/// One generated token's logprob and the most likely alternatives, as text.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// Why a request ended, in OpenAI's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What the engine sends about one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New text (possibly empty when logprobs or per-token events are asked for), the
    /// logprobs of the tokens it came from, and the usage so far.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprobs>,
        usage: Usage,
    },
    /// The request is done; nothing follows.
    Finished { reason: FinishReason, usage: Usage },
    /// The engine could not finish the request (an internal error); nothing follows.
    Failed(String),
}

/// Why a submission was refused.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The scheduler refused it (too long, queue full, ...).
    #[error("{0}")]
    Rejected(AddError),
    /// Too many submissions are in flight to the engine thread.
    #[error("the server is busy: too many requests are queued")]
    Busy,
    /// The engine thread is gone.
    #[error("the engine has stopped")]
    Stopped,
}

/// Limits of the engine (the command channel holds at most `scheduler.max_waiting`).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
}

/// A request's stream of events; dropping it cancels the request.
pub type EventReceiver = mpsc::UnboundedReceiver<Event>;

enum Command {
    Add {
        request: GenerationRequest,
        events: mpsc::UnboundedSender<Event>,
        accepted: oneshot::Sender<Result<(), AddError>>,
    },
}

/// The handlers' side of the engine; cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    alive: Arc<AtomicBool>,
}

impl EngineHandle {
    /// Queue a request; on success its events arrive on the returned receiver.
    pub async fn submit(&self, request: GenerationRequest) -> Result<EventReceiver, SubmitError> {
        let (events, receiver) = mpsc::unbounded_channel();
        let (accepted, verdict) = oneshot::channel();
        let command = Command::Add {
            request,
            events,
            accepted,
        };
        self.commands.try_send(command).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SubmitError::Busy,
            mpsc::error::TrySendError::Closed(_) => SubmitError::Stopped,
        })?;
        match verdict.await {
            Ok(Ok(())) => Ok(receiver),
            Ok(Err(e)) => Err(SubmitError::Rejected(e)),
            Err(_) => Err(SubmitError::Stopped),
        }
    }

    /// Whether the engine thread is still running.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The engine thread; dropping every [`EngineHandle`] makes it exit, `join` waits for that.
pub struct Engine {
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Start the engine thread over `model`. Fails only on an invalid configuration.
    pub fn start(
        model: Arc<ServedModel>,
        config: EngineConfig,
        metrics: Arc<Metrics>,
    ) -> Result<(Engine, EngineHandle), String> {
        config.scheduler.validate().map_err(|e| e.to_string())?;
        // The scheduler's block manager is the only allocator of this storage. Made here, not
        // in the engine thread, so that a device out of memory fails the start with its reason.
        let sched = &config.scheduler;
        let kv = match sched.kv_window {
            None => model.model.new_kv_cache(sched.num_blocks, sched.block_size),
            Some(w) => model.model.new_kv_cache_with_window_group(
                sched.num_blocks,
                w.num_blocks,
                sched.block_size,
            ),
        }
        .map_err(|e| format!("KV cache: {e}"))?;
        metrics.set_kv_cache_bytes(kv.bytes());
        // Enough room for a burst of submissions; the scheduler's own waiting queue is the
        // real bound, this one only absorbs what arrives during one step.
        let capacity = config.scheduler.max_waiting.max(1);
        let (commands, receiver) = mpsc::channel(capacity);
        let alive = Arc::new(AtomicBool::new(true));
        let flag = alive.clone();
        let thread = std::thread::Builder::new()
            .name("moerun-engine".into())
            .spawn(move || {
                // Cleared on the way out however the loop ends, a panic included, so that
                // `/health` reports a dead engine.
                let _alive = AliveGuard(flag);
                run::engine_loop(&model, &config, kv, receiver, &metrics);
            })
            .map_err(|e| format!("could not start the engine thread: {e}"))?;
        Ok((
            Engine {
                thread: Some(thread),
            },
            EngineHandle { commands, alive },
        ))
    }

    /// Wait for the engine thread to exit (after every handle is dropped).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
