//! moerun's OpenAI-compatible HTTP server: `POST /v1/chat/completions` and `/v1/completions`
//! (whole or streamed as Server-Sent Events), `GET /v1/models`, `/health` and `/metrics`, over
//! an engine thread that batches every live request into each forward pass (iteration-level
//! continuous batching with chunked prefill, a paged KV cache with prefix caching, and
//! preemption by recompute; see `moerun_engine::scheduler`).
//!
//! [`Server::start`] binds, starts the engine thread and serves on a runtime of its own, so the
//! CLI, the benchmark and the tests all run the very same stack. Clients never see a panic:
//! every failure is an OpenAI-style error body with a meaningful status.

pub mod api;
pub mod bench;
pub mod client;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod routes;
pub mod served;
pub mod sse;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;

use axum::serve::ListenerExt;
use moerun_core::DType;
use moerun_engine::scheduler::{KvWindowGroup, SchedulerConfig};
use moerun_model::kv::DEFAULT_BLOCK_SIZE;
use moerun_model::ModelConfig;
use tokio::sync::oneshot;

pub use engine::{EngineConfig, EngineHandle};
pub use error::ApiError;
pub use served::ServedModel;

/// Everything the operator decides (the `moerun serve` flags).
#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub addr: SocketAddr,
    pub api_key: Option<String>,
    /// Most sequences running at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Token budget of one step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Longest prompt + completion (`--max-model-len`); `None`: the model's context.
    pub max_model_len: Option<usize>,
    /// Bytes of KV cache (`--kv-cache-memory`); `None`: what `max_num_seqs` full-length
    /// sequences need, at most [`default_kv_budget`] (1 GiB on the CPU, most of the free memory
    /// of a GPU).
    pub kv_cache_bytes: Option<u64>,
    /// Requests allowed to wait for admission; more get a 503.
    pub max_waiting: usize,
    pub enable_prefix_caching: bool,
    /// Largest request body accepted (413 past it).
    pub max_body_bytes: usize,
    /// Shut down gracefully on Ctrl-C (the CLI); tests stop the server by hand.
    pub handle_ctrl_c: bool,
    /// What the KV cache stores (`--kv-dtype`): f32, or bf16 in half the bytes per token (so
    /// twice the tokens in a budget, on either backend; `Model::set_kv_dtype`).
    pub kv_dtype: DType,
}

/// KV cache size when none is given, on the CPU.
pub const DEFAULT_KV_CACHE_BYTES: u64 = 1 << 30;

/// GPU memory kept free beside the KV cache for activations, the MoE op's prefill scratch and
/// decode graphs.
const GPU_RESERVE_BYTES: u64 = 4 << 30;

/// The most KV cache the server takes unless told: [`DEFAULT_KV_CACHE_BYTES`] on the CPU; on a
/// GPU 90% of the memory still free once the weights are resident, less [`GPU_RESERVE_BYTES`]
/// (vLLM's `--gpu-memory-utilization 0.9`, in spirit), never under the CPU default.
pub fn default_kv_budget(model: &moerun_model::Model) -> u64 {
    match model.cuda().map(|c| c.device().memory_info()) {
        Some(Ok((free, _total))) => (free as u64 / 10 * 9)
            .saturating_sub(GPU_RESERVE_BYTES)
            .max(DEFAULT_KV_CACHE_BYTES),
        _ => DEFAULT_KV_CACHE_BYTES,
    }
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            api_key: None,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            kv_cache_bytes: None,
            max_waiting: 1024,
            enable_prefix_caching: true,
            max_body_bytes: 8 << 20,
            handle_ctrl_c: false,
            kv_dtype: DType::F32,
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(String),
    #[error("cannot start the HTTP runtime: {0}")]
    Runtime(std::io::Error),
}

impl ServerOptions {
    /// The scheduler's limits for `model`, with the KV cache sized from the options (at most
    /// `kv_budget` bytes unless `--kv-cache-memory` says otherwise).
    ///
    /// Models with linear-attention layers also keep a fixed-size state per running sequence
    /// (tens of MB at real shapes), allocated as sequences start. Unless `--kv-cache-memory` is
    /// given, those states come out of the same budget: at most half of it, `max_num_seqs` being
    /// lowered to what that half holds (the start message says so).
    pub fn scheduler_config(
        &self,
        model: &ModelConfig,
        kv_budget: u64,
    ) -> Result<SchedulerConfig, StartError> {
        let context = model.max_position_embeddings;
        let max_model_len = self.max_model_len.unwrap_or(context);
        if max_model_len > context {
            return Err(StartError::Config(format!(
                "--max-model-len {max_model_len} exceeds the model's context of {context} tokens"
            )));
        }
        let (max_num_seqs, kv_budget) = self.sequences_and_kv_budget(model, kv_budget)?;
        let sizes = kv_sizes(self, max_num_seqs, model, max_model_len);
        let bytes = self
            .kv_cache_bytes
            .unwrap_or_else(|| sizes.wanted_bytes().min(kv_budget));
        let (num_blocks, kv_window) = sizes.blocks_in(bytes);
        if num_blocks == 0 || kv_window.is_some_and(|w| w.num_blocks == 0) {
            return Err(StartError::Config(format!(
                "--kv-cache-memory {bytes} bytes holds no KV block ({} bytes each)",
                sizes.block_bytes()
            )));
        }
        let config = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len,
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks,
            // A cached prefix block holds K/V but not the linear-attention state at its end, so
            // hybrid (Gated DeltaNet) models always recompute their prompts; nor the window
            // group's blocks before its end, which sliding-window models give back.
            enable_prefix_caching: self.enable_prefix_caching
                && model.linear_attention.is_none()
                && kv_window.is_none(),
            max_waiting: self.max_waiting,
            kv_window,
        };
        config
            .validate()
            .map_err(|e| StartError::Config(e.to_string()))?;
        Ok(config)
    }
}

impl ServerOptions {
    /// The most sequences that may run, and the bytes left for KV once their linear-attention
    /// states are set aside (see [`ServerOptions::scheduler_config`]).
    fn sequences_and_kv_budget(
        &self,
        model: &ModelConfig,
        kv_budget: u64,
    ) -> Result<(usize, u64), StartError> {
        let per_seq = model.linear_state_bytes_per_sequence() as u64;
        if per_seq == 0 || self.kv_cache_bytes.is_some() {
            return Ok((self.max_num_seqs, kv_budget));
        }
        let fit = usize::try_from(kv_budget / 2 / per_seq).unwrap_or(usize::MAX);
        if fit == 0 {
            return Err(StartError::Config(format!(
                "one sequence's linear-attention state ({per_seq} bytes) is more than half of the \
                 {kv_budget} bytes the KV cache may take: give more with --kv-cache-memory"
            )));
        }
        let seqs = self.max_num_seqs.min(fit);
        Ok((seqs, kv_budget - seqs as u64 * per_seq))
    }
}

/// What the KV cache of a model needs per block, and how many blocks `max_num_seqs` sequences of
/// `max_model_len` tokens would want, in each group: the layers that see every position, and
/// (when the model's sliding window is shorter than `max_model_len`) the sliding-window layers,
/// which keep a sequence's window plus one step's chunk.
struct KvSizes {
    full_block_bytes: u64,
    full_blocks_wanted: u64,
    /// The window, its bytes per block and the blocks wanted, when the group is kept apart.
    window: Option<(usize, u64, u64)>,
}

fn kv_sizes(
    options: &ServerOptions,
    max_num_seqs: usize,
    model: &ModelConfig,
    max_model_len: usize,
) -> KvSizes {
    let bs = DEFAULT_BLOCK_SIZE;
    let (full, windowed) = model.kv_bytes_per_token_by_group(options.kv_dtype.size());
    let seqs = max_num_seqs as u64;
    let seq_blocks = max_model_len.div_ceil(bs);
    match model.kv_window().filter(|&w| w < max_model_len) {
        Some(w) => {
            let chunk = options.max_num_batched_tokens.max(1);
            let per_seq = seq_blocks.min((w - 1 + chunk).div_ceil(bs) + 1) as u64;
            KvSizes {
                full_block_bytes: (full * bs) as u64,
                full_blocks_wanted: seqs * seq_blocks as u64,
                window: Some((w, (windowed * bs) as u64, seqs * per_seq)),
            }
        }
        None => KvSizes {
            full_block_bytes: ((full + windowed) * bs) as u64,
            full_blocks_wanted: seqs * seq_blocks as u64,
            window: None,
        },
    }
}

impl KvSizes {
    /// Bytes of one block of each group together (what the error message quotes).
    fn block_bytes(&self) -> u64 {
        self.full_block_bytes + self.window.map_or(0, |(_, b, _)| b)
    }

    fn wanted_bytes(&self) -> u64 {
        let window = self.window.map_or(0, |(_, bytes, n)| bytes * n);
        self.full_block_bytes * self.full_blocks_wanted + window
    }

    /// Blocks of each group in `bytes`. Short of what is wanted, both groups shrink by the same
    /// fraction, so the cache holds as many whole sequences in one as in the other; past it, the
    /// window group gets what it wants and the other group the rest. A group whose blocks cost
    /// nothing (a model whose every layer is windowed) gets what it wants.
    fn blocks_in(&self, bytes: u64) -> (usize, Option<KvWindowGroup>) {
        let to_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let Some((window, window_block_bytes, window_wanted)) = self.window else {
            return (to_usize(bytes / self.full_block_bytes.max(1)), None);
        };
        let wanted = self.wanted_bytes().max(1);
        let (num_blocks, num_window) = if bytes >= wanted {
            let rest = bytes - window_wanted * window_block_bytes;
            let full = match self.full_block_bytes {
                0 => self.full_blocks_wanted,
                b => rest / b,
            };
            (to_usize(full), to_usize(window_wanted))
        } else {
            let share = |blocks: u64, block_bytes: u64| -> usize {
                let fitting = (blocks as u128 * bytes as u128 / wanted as u128) as u64;
                match block_bytes {
                    0 => to_usize(blocks),
                    b => to_usize(fitting.min(bytes / b)),
                }
            };
            (
                share(self.full_blocks_wanted, self.full_block_bytes),
                share(window_wanted, window_block_bytes),
            )
        };
        (
            num_blocks,
            Some(KvWindowGroup {
                window,
                num_blocks: num_window,
            }),
        )
    }
}

/// A running server: its address, and the way to stop it.
pub struct Server {
    pub addr: SocketAddr,
    /// The scheduler limits it runs with (KV blocks included).
    pub scheduler: SchedulerConfig,
    shutdown: Option<oneshot::Sender<()>>,
    http: Option<JoinHandle<Result<(), std::io::Error>>>,
    engine: Option<engine::Engine>,
}

impl Server {
    /// Bind `options.addr`, start the engine thread over `model` and serve on a background
    /// runtime. Returns once the socket accepts connections.
    pub fn start(mut model: ServedModel, options: &ServerOptions) -> Result<Server, StartError> {
        model
            .model
            .set_kv_dtype(options.kv_dtype)
            .map_err(|e| StartError::Config(format!("--kv-dtype {}: {e}", options.kv_dtype)))?;
        let scheduler =
            options.scheduler_config(&model.model.config, default_kv_budget(&model.model))?;
        let listener = TcpListener::bind(options.addr).map_err(|source| StartError::Bind {
            addr: options.addr,
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: options.addr,
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(StartError::Runtime)?;
        let model = Arc::new(model);
        let metrics = Arc::new(metrics::Metrics::default());
        let engine_config = EngineConfig {
            scheduler: scheduler.clone(),
        };
        let (engine, handle) = engine::Engine::start(model.clone(), engine_config, metrics.clone())
            .map_err(StartError::Config)?;
        let state = Arc::new(routes::AppState {
            model,
            engine: handle,
            metrics,
            api_key: options.api_key.clone(),
            max_model_len: scheduler.max_model_len,
            max_body_bytes: options.max_body_bytes,
            started: routes::unix_now(),
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("moerun-http")
            .enable_all()
            .build()
            .map_err(StartError::Runtime)?;
        let (shutdown, stop) = oneshot::channel::<()>();
        let ctrl_c = options.handle_ctrl_c;
        let http = std::thread::Builder::new()
            .name("moerun-http-main".into())
            .spawn(move || {
                runtime.block_on(async move {
                    // Without TCP_NODELAY, Nagle's algorithm holds back each small SSE chunk
                    // until the previous one is acknowledged: tens of milliseconds per token.
                    let listener = tokio::net::TcpListener::from_std(listener)?.tap_io(|tcp| {
                        let _ = tcp.set_nodelay(true);
                    });
                    let app = routes::router(state);
                    let signal = async move {
                        if ctrl_c {
                            tokio::select! {
                                _ = stop => {}
                                _ = tokio::signal::ctrl_c() => {}
                            }
                        } else {
                            let _ = stop.await;
                        }
                    };
                    axum::serve(listener, app)
                        .with_graceful_shutdown(signal)
                        .await
                })
            })
            .map_err(StartError::Runtime)?;
        Ok(Server {
            addr,
            scheduler,
            shutdown: Some(shutdown),
            http: Some(http),
            engine: Some(engine),
        })
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serve until the server stops (Ctrl-C with `handle_ctrl_c`), then clean up.
    pub fn wait(mut self) -> Result<(), std::io::Error> {
        let result = self.join_http();
        if let Some(engine) = self.engine.take() {
            engine.join();
        }
        result
    }

    /// Stop accepting, let open responses finish, stop the engine, and wait for all of it.
    pub fn shutdown(mut self) -> Result<(), std::io::Error> {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        self.wait()
    }

    fn join_http(&mut self) -> Result<(), std::io::Error> {
        match self.http.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(std::io::Error::other("the HTTP thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        let _ = self.join_http();
        if let Some(engine) = self.engine.take() {
            engine.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moerun_model::kv::KV_BYTES_PER_VALUE;

    fn config(path: &str) -> ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let text = std::fs::read_to_string(dir.join(path)).unwrap();
        ModelConfig::from_json_str(&text).unwrap()
    }

    fn options(seqs: usize, model_len: usize) -> ServerOptions {
        ServerOptions {
            max_num_seqs: seqs,
            max_model_len: Some(model_len),
            ..ServerOptions::default()
        }
    }

    #[test]
    fn a_bf16_cache_holds_twice_the_blocks_of_a_budget() {
        // Qwen3-30B-A3B: 16 sequences of 4096 tokens want ~12.9 GB in f32, so 1 GiB binds.
        let model = config("configs/qwen3-30b-a3b.json");
        let f32_kv = options(16, 4096).scheduler_config(&model, 1 << 30).unwrap();
        let bf16_kv = ServerOptions {
            kv_dtype: DType::BF16,
            ..options(16, 4096)
        }
        .scheduler_config(&model, 1 << 30)
        .unwrap();
        let (f, b) = (f32_kv.num_blocks, bf16_kv.num_blocks);
        assert!(
            f > 0 && (b == 2 * f || b == 2 * f + 1),
            "{f} f32 blocks, {b} bf16"
        );
        let bytes = b * DEFAULT_BLOCK_SIZE * model.kv_bytes_per_token(2);
        assert!(bytes <= 1 << 30, "{bytes}");
    }

    #[test]
    fn sliding_window_layers_get_a_bounded_window_group() {
        // Gemma-4-26B-A4B: 25 of 30 layers slide over 1024 positions.
        let model = config("configs/gemma-4-26b-a4b.json");
        let (full, windowed) = model.kv_bytes_per_token_by_group(KV_BYTES_PER_VALUE);
        assert!(windowed > 5 * full, "{full} {windowed}");
        let o = options(16, 32768);
        let sched = o.scheduler_config(&model, u64::MAX).unwrap();
        let w = sched.kv_window.expect("a window group");
        assert_eq!(w.window, 1024);
        assert!(!sched.enable_prefix_caching);
        // Unbounded budget: every sequence gets its whole context in the full group, and its
        // window plus a step's chunk (2048 tokens) in the window group.
        assert_eq!(sched.num_blocks, 16 * 32768 / DEFAULT_BLOCK_SIZE);
        assert_eq!(w.num_blocks, 16 * ((1023 + 2048usize).div_ceil(16) + 1));
        // A budget of a quarter of that: both groups shrink alike, and the bytes fit.
        let wanted = (sched.num_blocks * full + w.num_blocks * windowed) * DEFAULT_BLOCK_SIZE;
        let quarter = o.scheduler_config(&model, wanted as u64 / 4).unwrap();
        let qw = quarter.kv_window.unwrap();
        let used = (quarter.num_blocks * full + qw.num_blocks * windowed) * DEFAULT_BLOCK_SIZE;
        assert!(used <= wanted / 4, "{used} > {}", wanted / 4);
        assert_eq!(quarter.num_blocks, sched.num_blocks / 4);
        assert_eq!(qw.num_blocks, w.num_blocks / 4);
        // The same bytes without a window group would hold under a fifth as many positions.
        let plain = (full + windowed) * DEFAULT_BLOCK_SIZE;
        assert!(wanted / 4 / plain < quarter.num_blocks / 5);
    }

    #[test]
    fn linear_attention_state_comes_out_of_the_budget() {
        // Qwen3.5-35B-A3B: 30 Gated DeltaNet layers, ~66 MB of state per sequence.
        let model = config("configs/qwen3.5-35b-a3b.json");
        let per_seq = model.linear_state_bytes_per_sequence() as u64;
        assert!(per_seq > 50 << 20, "{per_seq}");
        let o = options(256, 4096);
        // The CPU default (1 GiB): half of it holds 8 sequences' states.
        let cpu = o.scheduler_config(&model, 1 << 30).unwrap();
        assert_eq!(cpu.max_num_seqs as u64, (1u64 << 29) / per_seq);
        let kv = cpu.num_blocks as u64 * 16 * model.kv_bytes_per_token(4) as u64;
        assert!(kv + cpu.max_num_seqs as u64 * per_seq <= 1 << 30);
        // A GPU's budget holds all 256.
        let gpu = o.scheduler_config(&model, 100 << 30).unwrap();
        assert_eq!(gpu.max_num_seqs, 256);
        // Too small for even one: refused with the way out.
        let e = o.scheduler_config(&model, per_seq).unwrap_err().to_string();
        assert!(e.contains("--kv-cache-memory"), "{e}");
        // An explicit --kv-cache-memory is the KV alone.
        let explicit = ServerOptions {
            kv_cache_bytes: Some(1 << 30),
            ..o.clone()
        };
        assert_eq!(
            explicit
                .scheduler_config(&model, 1 << 30)
                .unwrap()
                .max_num_seqs,
            256
        );
    }

    #[test]
    fn a_window_as_long_as_the_context_needs_no_group() {
        let model = config("configs/gemma-4-26b-a4b.json");
        let sched = options(4, 1024).scheduler_config(&model, u64::MAX).unwrap();
        assert_eq!(sched.kv_window, None);
        assert!(sched.enable_prefix_caching);
        let dense = config("configs/qwen3-30b-a3b.json");
        let sched = options(4, 4096).scheduler_config(&dense, u64::MAX).unwrap();
        assert_eq!(sched.kv_window, None);
    }
}
