//! A loaded model and its forward pass over a flat batch (the flow itself is
//! [`crate::forward::decoder`], run here on the CPU backend).

use std::path::Path;

use moerun_core::{DType, Device, Error, Result};
use moerun_cuda::CudaDevice;

use crate::attention::Rope;
use crate::backend::cpu::CpuPass;
use crate::batch::{Batch, LogitsFor};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::cuda::deltanet::LinearPlacement;
use crate::cuda::{CudaModel, CudaPass, DeviceKv, Fetched, Placement, Tokens, WeightSource};
use crate::forward;
use crate::kv::KvCache;
use crate::linear_state::LinearStateCache;
use crate::weights::ModelWeights;

/// A model ready to run: its resolved config, its weights, precomputed RoPE frequencies.
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    pub(crate) rope: Rope,
    checkpoint: Checkpoint,
    /// The weights' device copy when the model runs on the CUDA backend.
    cuda: Option<CudaModel>,
    /// What the KV caches this model makes store ([`Model::set_kv_dtype`]).
    kv_dtype: DType,
}

/// Where a CPU model's weights live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightsIn {
    /// Mapped from the files: nothing copied, pages read on demand from the page cache.
    Mapped,
    /// Copied into anonymous memory advised for huge pages. Decode streams every active weight
    /// byte per token, and from page-cache pages it reached about half the bandwidth the same
    /// bytes reach in anonymous memory on the machines measured (docs/perf/cpu-engine.md).
    Memory,
    /// `Memory` when the files fit in three quarters of the available memory, else `Mapped`;
    /// `MOERUN_WEIGHTS=mmap` or `MOERUN_WEIGHTS=memory` decides instead.
    Auto,
}

impl WeightsIn {
    /// How to hold the host weights of a model that will run on `device`: a GPU reads them once
    /// to upload them, so they stay mapped.
    pub fn for_device(device: Device) -> WeightsIn {
        match device {
            Device::Cpu => WeightsIn::Auto,
            Device::Cuda(_) => WeightsIn::Mapped,
        }
    }

    /// The concrete choice for `bytes` of weight files.
    pub fn resolve(self, bytes: u64) -> WeightsIn {
        if self != WeightsIn::Auto {
            return self;
        }
        match std::env::var("MOERUN_WEIGHTS").as_deref() {
            Ok("mmap") => return WeightsIn::Mapped,
            Ok("memory") => return WeightsIn::Memory,
            _ => {}
        }
        match available_memory() {
            Some(avail) if bytes <= avail / 4 * 3 => WeightsIn::Memory,
            _ => WeightsIn::Mapped,
        }
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes (Linux; `None` elsewhere or if unreadable).
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What a forward pass returns: logits for the requested rows, `[rows.len(), vocab]`.
#[derive(Debug)]
pub struct ForwardOutput {
    pub rows: Vec<usize>,
    /// `[rows.len(), vocab]`; empty for [`LogitsFor::GreedyOfEachSeq`].
    pub logits: Vec<f32>,
    /// Each row's greedy pick ([`argmax`]) for [`LogitsFor::GreedyOfEachSeq`]; else empty.
    pub tokens: Vec<u32>,
}

impl ForwardOutput {
    /// The output for `which` from host logits of `rows`: greedy picks take the arg-max of each
    /// row here.
    fn from_logits(rows: Vec<usize>, logits: Vec<f32>, which: LogitsFor) -> ForwardOutput {
        match which {
            LogitsFor::GreedyOfEachSeq => {
                let vocab = logits.len() / rows.len().max(1);
                let tokens = match vocab {
                    0 => vec![0; rows.len()],
                    v => logits.chunks_exact(v).map(argmax).collect(),
                };
                ForwardOutput {
                    rows,
                    logits: Vec::new(),
                    tokens,
                }
            }
            _ => ForwardOutput {
                rows,
                logits,
                tokens: Vec::new(),
            },
        }
    }
}

/// The greedy pick of a row of logits: the largest, the lowest index among equal ones; NaN is
/// never chosen, and a row with nothing above -inf gives 0. The engine's greedy sampling and the
/// GPU's `argmax_rows` pick exactly this.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        // Strictly greater: an equal logit later in the vocabulary never displaces an earlier one.
        if x > best_value {
            best = i;
            best_value = x;
        }
    }
    best as u32
}

impl Model {
    /// Open a Hugging Face checkpoint directory for the CPU: its weights copied into memory
    /// when they fit, else mapped ([`WeightsIn::Auto`]).
    pub fn load(dir: &Path) -> Result<Model> {
        Model::load_with(dir, WeightsIn::Auto)
    }

    /// Open a checkpoint directory, its weights held as `how` says.
    pub fn load_with(dir: &Path, how: WeightsIn) -> Result<Model> {
        let mut checkpoint = Checkpoint::open(dir)?;
        if how.resolve(checkpoint.file_bytes()) == WeightsIn::Memory {
            checkpoint.copy_to_memory()?;
        }
        Model::from_checkpoint(checkpoint)
    }

    /// Open a checkpoint directory for `device`: on the CPU as [`Model::load`]; on a GPU the
    /// weights stay mapped on the host (they are read once, to upload them).
    pub fn load_on(dir: &Path, device: Device) -> Result<Model> {
        let mut model = Model::load_with(dir, WeightsIn::for_device(device))?;
        model.place(device, WeightSource::Host)?;
        Ok(model)
    }

    /// The model of an opened checkpoint (a directory's, or one held in memory).
    pub fn from_checkpoint(checkpoint: Checkpoint) -> Result<Model> {
        let dir = checkpoint.dir().to_path_buf();
        let config_json = checkpoint
            .read_json("config.json")?
            .ok_or_else(|| Error::Config(format!("{}/config.json not found", dir.display())))?;
        let config = ModelConfig::from_json(&config_json)?;
        let weights = ModelWeights::load(&checkpoint, &config)?;
        if config.has_vision_tower {
            let skipped = checkpoint
                .names()
                .filter(|n| n.starts_with("model.visual."))
                .count();
            let what = match skipped {
                0 => "the checkpoint has none".to_string(),
                n => format!("{n} tensors under model.visual."),
            };
            eprintln!(
                "moerun: {}: text model only; the vision tower ({what}) is not loaded",
                dir.display()
            );
        }
        Ok(Model {
            rope: Rope::new(&config),
            config,
            weights,
            checkpoint,
            cuda: None,
            kv_dtype: DType::F32,
        })
    }

    /// What the KV caches this model makes ([`Model::new_kv_cache`]) store: f32 (the default,
    /// the precision every conformance test is held to), or bf16 in half the memory, each K/V
    /// value rounded to nearest even once (transformers keeps a bf16 model's K/V in bf16), on
    /// either backend: the CUDA kernels round as the CPU does (the two caches differ only where
    /// their f32 values straddle a rounding boundary). f16 is refused.
    pub fn set_kv_dtype(&mut self, dtype: DType) -> Result<()> {
        match dtype {
            DType::F32 | DType::BF16 => {}
            DType::F16 => return Err(crate::kv::f16_kv_refused()),
        }
        self.kv_dtype = dtype;
        Ok(())
    }

    /// What the KV caches this model makes store.
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    /// Run the model on `device` from now on: on a GPU, upload the weights (or draw them there,
    /// for synthetic benchmark models). Refuses what the CUDA backend does not run, by name.
    pub fn place(&mut self, device: Device, source: WeightSource) -> Result<()> {
        match device {
            Device::Cpu => {
                self.cuda = None;
                Ok(())
            }
            Device::Cuda(ordinal) => {
                crate::cuda::check_supported(&self.config)?;
                let dev = CudaDevice::open(ordinal).map_err(crate::cuda::dev_err)?;
                self.cuda = Some(crate::cuda::upload::upload(
                    dev,
                    &self.config,
                    &self.weights,
                    &self.rope,
                    source,
                )?);
                Ok(())
            }
        }
    }

    /// Where the model runs.
    pub fn device(&self) -> Device {
        match &self.cuda {
            None => Device::Cpu,
            Some(c) => Device::Cuda(c.device().info().ordinal),
        }
    }

    /// The GPU copy of the model, when it runs on CUDA.
    pub fn cuda(&self) -> Option<&CudaModel> {
        self.cuda.as_ref()
    }

    /// KV storage for this model where it runs: `num_blocks` blocks of `block_size` tokens.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        self.kv_cache(num_blocks, None, block_size)
    }

    /// [`Model::new_kv_cache`] with the sliding-window layers' K/V in `num_window_blocks`
    /// blocks of their own ([`KvCache::with_window_group`]); batches then name each sequence's
    /// window table. Refused for a model without sliding-window layers.
    pub fn new_kv_cache_with_window_group(
        &self,
        num_blocks: usize,
        num_window_blocks: usize,
        block_size: usize,
    ) -> Result<KvCache> {
        if self.config.kv_window().is_none() {
            return Err(Error::InvalidArgument(format!(
                "a window group for the KV cache of {}, which has no sliding-window layers",
                self.config.family
            )));
        }
        self.kv_cache(num_blocks, Some(num_window_blocks), block_size)
    }

    fn kv_cache(
        &self,
        num_blocks: usize,
        num_window_blocks: Option<usize>,
        block_size: usize,
    ) -> Result<KvCache> {
        let cfg = &self.config;
        match (&self.cuda, num_window_blocks) {
            (None, w) => Ok(KvCache::of_dtype(
                cfg,
                num_blocks,
                w,
                block_size,
                self.kv_dtype,
            )),
            (Some(c), _) => {
                let dkv = DeviceKv::new(
                    c.device(),
                    cfg,
                    (num_blocks, num_window_blocks, block_size),
                    self.kv_dtype,
                )?;
                Ok(KvCache::on_device(
                    cfg,
                    dkv,
                    num_blocks,
                    num_window_blocks,
                    block_size,
                ))
            }
        }
    }

    /// Linear-attention (Gated DeltaNet) state for this model where it runs: `num_slots`
    /// sequences' slots, in host memory or, for a model on the CUDA backend, in GPU memory
    /// (each slot allocated at its first use, as on the host).
    pub fn new_linear_state(&self, num_slots: usize) -> LinearStateCache {
        let cache = LinearStateCache::new(&self.config, num_slots);
        match &self.cuda {
            None => cache,
            Some(_) => cache.on_device(),
        }
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// Run the batch: write its K/V into `kv` at each token's position and return logits for
    /// the rows `which` selects. Every sequence's block table must cover its new positions.
    /// Models with linear-attention layers are refused: they need [`Model::forward_with_state`].
    pub fn forward(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        if self.config.linear_attention.is_some() {
            return Err(Error::Unsupported(format!(
                "{} keeps per-sequence linear-attention state: run it with \
                 Model::forward_with_state and a state slot per sequence",
                self.config.family
            )));
        }
        self.run(batch, kv, None, which)
    }

    /// [`Model::forward`] for every model, hybrid ones included: each sequence's Gated DeltaNet
    /// layers start from its state in `states` (slot `batch.state_slots[i]`; zero when its
    /// chunk starts at position 0) and leave it advanced past the chunk.
    pub fn forward_with_state(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        states: &mut LinearStateCache,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        self.run(batch, kv, Some(states), which)
    }

    /// Run the pass on a thread of rayon's pool: every matrix product inside then starts and
    /// joins its tasks without handing work across threads and waking the caller, which costs
    /// tens of microseconds per product otherwise (measured: a 3 MiB expert GEMV at 65% of read
    /// bandwidth from outside the pool, 88% from inside).
    fn run(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        states: Option<&mut LinearStateCache>,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        if let Some(cuda) = &self.cuda {
            return self.run_cuda(cuda, batch, kv, states, which);
        }
        if rayon::current_thread_index().is_some() {
            return self.run_in_pool(batch, kv, states, which);
        }
        rayon::scope(|_| self.run_in_pool(batch, kv, states, which))
    }

    fn run_cuda(
        &self,
        cuda: &CudaModel,
        batch: &Batch,
        kv: &mut KvCache,
        states: Option<&mut LinearStateCache>,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        let tokens = self.check_batch(batch, kv)?;
        let rows = batch.logit_rows(which);
        if tokens.is_empty() {
            return Ok(ForwardOutput::from_logits(rows, Vec::new(), which));
        }
        let dkv = kv.device.as_mut().ok_or_else(|| {
            Error::InvalidArgument(
                "the model runs on CUDA but its KV cache is in host memory: make it with \
                 Model::new_kv_cache"
                    .into(),
            )
        })?;
        let (cfg, w) = (&self.config, &self.weights);
        if w.gemma4.is_some() {
            // Checked here: a graph replay embeds on the device without looking.
            crate::gemma4::cuda::check_tokens(cfg, &tokens)?;
        }
        // Linear-attention state: every slot is checked before any is touched, then each
        // sequence's slot gets device memory (zeroed for a chunk at position 0).
        let linear = match (&cfg.linear_attention, states) {
            (Some(_), Some(states)) => {
                if !states.is_on_device() {
                    return Err(Error::InvalidArgument(
                        "the model runs on CUDA but its linear-attention state is in host \
                         memory: make it with Model::new_linear_state"
                            .into(),
                    ));
                }
                states.begin(batch)?;
                let addrs = states.device_slots(cuda.device(), batch)?;
                Some((states, addrs))
            }
            _ => None,
        };
        let graph_state = linear.as_ref().map(|(s, a)| (&**s, a.as_slice()));
        let greedy = which == LogitsFor::GreedyOfEachSeq;
        // A greedy step of one sequence may have been launched ahead by the call before, and
        // launches the one after it (cuda/ahead.rs); every other call discards such a step.
        if greedy && linear.is_none() {
            if let Some(token) = crate::cuda::ahead::greedy_step(cuda, (cfg, w), dkv, batch)? {
                return Ok(ForwardOutput {
                    rows,
                    logits: Vec::new(),
                    tokens: vec![token],
                });
            }
        } else {
            dkv.graphs.ahead = None;
        }
        let graph = crate::cuda::graph::try_decode(cuda, cfg, w, dkv, batch, &rows, graph_state)?;
        let fetched = match graph {
            Some(logits) => crate::cuda::fetch(cuda.device(), &logits, cfg.vocab_size, greedy)?,
            None => {
                let logits = match &w.gemma4 {
                    Some(g) => {
                        crate::gemma4::cuda::forward(cuda, dkv, cfg, g, batch, &tokens, &rows)?
                    }
                    None => {
                        let at = Placement::of_batch(cuda.device(), batch)?;
                        let lp = match &linear {
                            Some((states, addrs)) => Some(LinearPlacement::of_batch(
                                cuda.device(),
                                cfg,
                                states,
                                batch,
                                addrs,
                            )?),
                            None => None,
                        };
                        let mut pass = CudaPass::new(cuda, dkv, &at, Tokens::Host);
                        if let Some(lp) = &lp {
                            pass = pass.with_linear_state(lp);
                        }
                        forward::decoder_logits(&mut pass, cfg, w, &tokens, &rows)?
                    }
                };
                crate::cuda::fetch(cuda.device(), &logits, cfg.vocab_size, greedy)?
            }
        };
        if let Some((states, _)) = linear {
            states.finish(batch);
        }
        Ok(match fetched {
            Fetched::Logits(logits) => ForwardOutput::from_logits(rows, logits, which),
            Fetched::Tokens(tokens) => ForwardOutput {
                rows,
                logits: Vec::new(),
                tokens,
            },
        })
    }

    /// Check the batch against the cache and the model; return its tokens, flat.
    fn check_batch(&self, batch: &Batch, kv: &KvCache) -> Result<Vec<u32>> {
        let cfg = &self.config;
        check_window_tables(cfg, batch, kv)?;
        let mut tokens = Vec::with_capacity(batch.num_tokens());
        for seq in &batch.seqs {
            let end = seq.start_pos + seq.tokens.len();
            if seq.block_table.capacity(kv.block_size()) < end {
                return Err(Error::InvalidArgument(format!(
                    "block table holds {} positions but the batch writes up to {end}",
                    seq.block_table.capacity(kv.block_size())
                )));
            }
            if let Some(&b) = seq
                .block_table
                .blocks
                .iter()
                .find(|&&b| b as usize >= kv.num_blocks())
            {
                return Err(Error::InvalidArgument(format!(
                    "block {b} is outside the KV cache ({} blocks)",
                    kv.num_blocks()
                )));
            }
            if let Some(limit) = cfg.rope.position_limit().filter(|&l| end > l) {
                return Err(Error::Unsupported(format!(
                    "position {} with dynamic NTK rope: positions past max_position_embeddings ({limit}) \
                     rescale with batch history in transformers",
                    end - 1
                )));
            }
            for &t in seq.tokens {
                if t as usize >= cfg.vocab_size {
                    return Err(Error::TokenOutOfRange {
                        id: t,
                        vocab: cfg.vocab_size,
                    });
                }
                tokens.push(t);
            }
        }
        Ok(tokens)
    }

    fn run_in_pool(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        states: Option<&mut LinearStateCache>,
        which: LogitsFor,
    ) -> Result<ForwardOutput> {
        let cfg = &self.config;
        if kv.device.is_some() {
            return Err(Error::InvalidArgument(
                "the KV cache is on the GPU but the model runs on the CPU".into(),
            ));
        }
        let tokens = self.check_batch(batch, kv)?;
        let rows = batch.logit_rows(which);
        if let Some(g) = &self.weights.gemma4 {
            let logits = crate::gemma4::forward(cfg, g, batch, kv, &tokens, &rows)?;
            return Ok(ForwardOutput::from_logits(rows, logits, which));
        }
        // Linear-attention state: every slot is checked before any is touched.
        let linear_state = match (&cfg.linear_attention, states) {
            (Some(_), Some(states)) if states.is_on_device() => {
                return Err(Error::InvalidArgument(
                    "the linear-attention state is on the GPU but the model runs on the CPU".into(),
                ))
            }
            (Some(_), Some(states)) => {
                states.begin(batch)?;
                Some(states)
            }
            _ => None,
        };
        let hybrid = linear_state.is_some();
        let mut pass = CpuPass::new(cfg, &self.rope, batch, kv, linear_state);
        let logits = forward::decoder(&mut pass, cfg, &self.weights, &tokens, &rows)?;
        if hybrid {
            if let Some((states, _)) = pass.into_linear_state() {
                states.finish(batch);
            }
        }
        Ok(ForwardOutput::from_logits(rows, logits, which))
    }
}

/// The batch's window tables against the cache: present exactly when the cache keeps a window
/// group, one per sequence, covering the new positions, with live blocks of the window group's
/// pools from the window of each sequence's first new token on (entries before it may have been
/// released).
fn check_window_tables(cfg: &ModelConfig, batch: &Batch, kv: &KvCache) -> Result<()> {
    let Some(num_window_blocks) = kv.num_window_blocks() else {
        if batch.window_tables.is_empty() {
            return Ok(());
        }
        return Err(Error::InvalidArgument(
            "the batch names window tables but the KV cache has no window group".into(),
        ));
    };
    if batch.window_tables.len() != batch.seqs.len() {
        return Err(Error::InvalidArgument(format!(
            "the KV cache keeps the sliding-window layers apart: the batch needs a window table \
             per sequence ({} for {} sequences)",
            batch.window_tables.len(),
            batch.seqs.len()
        )));
    }
    let window = cfg.kv_window().unwrap_or(usize::MAX);
    let bs = kv.block_size();
    for (seq, table) in batch.seqs.iter().zip(&batch.window_tables) {
        let end = seq.start_pos + seq.tokens.len();
        if table.capacity(bs) < end {
            return Err(Error::InvalidArgument(format!(
                "window table holds {} positions but the batch writes up to {end}",
                table.capacity(bs)
            )));
        }
        let first_visible = (seq.start_pos + 1).saturating_sub(window);
        let live = &table.blocks[first_visible / bs..end.div_ceil(bs)];
        if let Some(&b) = live.iter().find(|&&b| b as usize >= num_window_blocks) {
            return Err(Error::InvalidArgument(format!(
                "window-table entry {b} for a position inside the window is not a block of the \
                 window group ({num_window_blocks} blocks)"
            )));
        }
    }
    Ok(())
}
