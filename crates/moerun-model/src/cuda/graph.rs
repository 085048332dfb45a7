//! Decode steps replayed from CUDA graphs. A decode step (one new token per sequence) is the
//! same few hundred kernels every time; launching them one by one costs more than running them
//! at small batch. So the first step of each batch-size bucket is captured into a graph over
//! fixed input buffers (token ids, positions, block tables) and later steps only copy their
//! inputs in and replay it.
//!
//! - Buckets: a batch of n sequences runs in the smallest bucket >= n; the padding rows decode
//!   token 0 at position 0 into the cache's trash block, which no sequence owns, and their
//!   logits are dropped.
//! - Block tables are captured at a fixed width per sequence (at least 512 keys' worth); a longer
//!   table recaptures the bucket at double the width. Attention's split-K grid and its choice of
//!   8- or 16-block clusters are planned for that width's context.
//! - A graph bakes in the addresses of the KV pools and scratch it was captured over, so the
//!   graphs live in the [`DeviceKv`] and are dropped when its MoE scratch is replaced.
//! - Gemma 4 (`crate::gemma4::cuda`) is captured the same way, its own flow inside the capture.
//! - Buckets whose MoE layers would wait for the device (the cuBLAS prefill path past 32 tokens,
//!   off Hopper) run eagerly; on Hopper the wgmma prefill path needs no wait, so every bucket up to
//!   128 is captured (the standard flow only: hybrid and Gemma 4 models stay eager past 32).
//! - If a capture fails, graphs are switched off for this cache with the reason on stderr and
//!   every step runs eagerly (same kernels, same results). `MOERUN_CUDA_GRAPHS=0` switches them
//!   off too, to measure what they buy.
//! - Gated DeltaNet layers (Qwen3.5) read their sequences' state slots through a device table of
//!   slot addresses, rewritten before each replay like the token ids; padding rows point at a
//!   trash slot of the graph's own. Zeroing a slot for a sequence at position 0 is a memset
//!   enqueued before the replay, outside the graph.

use std::collections::HashMap;

use moerun_core::{DType, Error, Result};
use moerun_cuda::{CudaDevice, CudaSlice, CudaView, DeviceGraph, MoePath};

use super::deltanet::LinearPlacement;
use super::pass::{CudaPass, Placement, Tokens};
use super::{dev_err, CudaModel, DeviceExperts, DeviceKv};
use crate::batch::Batch;
use crate::config::ModelConfig;
use crate::forward;
use crate::linear_state::LinearStateCache;
use crate::weights::{FfnWeights, ModelWeights};

/// Batch sizes captured; larger decode batches run eagerly (their kernels are long enough).
const BUCKETS: &[usize] = &[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128];

/// Block-table width (blocks per sequence) of a first capture: 512 keys in blocks of 16, the
/// context bound decode attention plans its clusters with (ops/attention.rs `choose_cluster`).
/// Up to 512 keys it takes clusters of 8 blocks; a bound of 1,024 would give every short context
/// clusters of 16, which lose there (H200, Qwen3-30B-A3B shapes, prompt 300: 476.4 against 479.3
/// tok/s), where a context past 512 recaptures at 1,024 and takes them (prompt 512: 469.7 against
/// 465.8).
const MIN_TABLE_BLOCKS: usize = 32;

#[derive(Default)]
pub(crate) struct DecodeGraphs {
    by_bucket: HashMap<usize, DecodeGraph>,
    /// Why graphs are off for this cache, once a capture failed.
    disabled: Option<String>,
    /// A greedy step launched ahead from the bucket-1 graph, and the buffers of its picks
    /// (`ahead.rs`).
    pub(crate) ahead: Option<super::ahead::Ahead>,
    pub(crate) picks: Option<super::ahead::Picks>,
}

impl DecodeGraphs {
    /// How many decode graphs are captured, or why graphs are off (a capture failed).
    pub(crate) fn state(&self) -> Result<usize, String> {
        match &self.disabled {
            Some(why) => Err(why.clone()),
            None => Ok(self.by_bucket.len()),
        }
    }

    pub(crate) fn clear(&mut self) {
        self.by_bucket.clear();
        self.ahead = None;
    }

    /// Table width of a captured bucket (0 if none).
    fn table_width(&self, bucket: usize) -> usize {
        self.by_bucket.get(&bucket).map_or(0, |g| g.table_blocks)
    }
}

/// One bucket's graph and the buffers it reads and writes.
struct DecodeGraph {
    table_blocks: usize,
    tokens: CudaSlice<u32>,
    at: Placement,
    /// Hybrid models: the sequences' slot addresses, and the padding rows' trash slot.
    linear: Option<(LinearPlacement, CudaSlice<f32>)>,
    logits: CudaSlice<f32>,
    graph: DeviceGraph,
    /// The position the last replay of one sequence decoded (what [`pick`] moves on from).
    replayed_at: Option<usize>,
    /// Where a greedy chain's pick left the inputs ([`pick`]): the position they hold and the
    /// pick buffer whose token is already in `tokens`. A replay of exactly that step copies
    /// neither in.
    advanced_to: Option<(usize, usize)>,
    /// The block tables last copied in: an unchanged table is not copied again.
    tables_in: Vec<i32>,
    /// Bytes of activations the step drew from (or wanted of) the arena.
    arena_bytes: usize,
}

/// Whether captured steps draw their activations from the arena: off with
/// `MOERUN_CUDA_ARENA=0` (each op then allocates, and the graph holds allocation nodes).
fn arena_enabled() -> bool {
    std::env::var_os("MOERUN_CUDA_ARENA").is_none_or(|v| v != "0")
}

fn graphs_enabled() -> bool {
    !super::profile::enabled() && std::env::var_os("MOERUN_CUDA_GRAPHS").is_none_or(|v| v != "0")
}

/// Run `batch` from a graph if it is a decode step a graph can take, and return its logits,
/// still on the device (`[rows, vocab]`); `None` means run it eagerly. `rows` are the rows whose
/// logits are wanted; `linear` the linear-attention state and each sequence's slot address
/// (hybrid models).
pub(crate) fn try_decode<'k>(
    m: &CudaModel,
    cfg: &ModelConfig,
    w: &ModelWeights,
    kv: &'k mut DeviceKv,
    batch: &Batch,
    rows: &[usize],
    linear: Option<(&LinearStateCache, &[u64])>,
) -> Result<Option<CudaView<'k, f32>>> {
    let Some(bucket) = prepare(m, cfg, w, kv, batch, rows, linear.map(|(c, _)| c))? else {
        return Ok(None);
    };
    let tokens: Vec<u32> = batch.seqs.iter().map(|s| s.tokens[0]).collect();
    replay(
        m,
        kv,
        bucket,
        batch,
        StepTokens::Host(&tokens),
        linear.map(|(_, a)| a),
    )?;
    let g = &kv.graphs.by_bucket[&bucket];
    let n = batch.seqs.len();
    Ok(Some(g.logits.slice(0..n * cfg.vocab_size)))
}

/// Where a replayed step's token ids come from.
pub(crate) enum StepTokens<'a> {
    /// One per sequence, from the host.
    Host(&'a [u32]),
    /// The pick of the step before, in pick buffer `.0` on the device (`ahead.rs`; one sequence).
    Pick(usize),
}

/// The bucket whose graph takes `batch` (captured now if it had no graph yet, or one too narrow
/// for its block tables), or `None` where the step must run eagerly.
pub(crate) fn prepare(
    m: &CudaModel,
    cfg: &ModelConfig,
    w: &ModelWeights,
    kv: &mut DeviceKv,
    batch: &Batch,
    rows: &[usize],
    linear: Option<&LinearStateCache>,
) -> Result<Option<usize>> {
    let n = batch.seqs.len();
    let decode = batch.seqs.iter().all(|s| s.tokens.len() == 1);
    if !decode || !rows.iter().copied().eq(0..n) || kv.graphs.disabled.is_some() {
        return Ok(None);
    }
    if cfg.linear_attention.is_some() != linear.is_some() {
        return Ok(None);
    }
    let moe = first_moe(m, cfg, w);
    // The bucket's MoE must not wait for the device: the decode path never does, nor does the
    // prefill path on Hopper (wgmma, its tile list read on the device); the cuBLAS prefill path
    // reads each expert's token count on the host, which a graph cannot hold. The hybrid and
    // Gemma 4 flows keep eager steps past the decode path's batches until their graphs have been
    // tested there (only the standard flow's have, on the H200).
    let standard_flow = cfg.linear_attention.is_none() && w.gemma4.is_none();
    let graph_safe = |b: usize| {
        moe.is_none_or(|(e, _)| {
            MoePath::for_batch(b, e.dtype()) == MoePath::Decode
                || (standard_flow && e.dtype() == DType::BF16 && m.dev.has_wgmma())
        })
    };
    let Some(&bucket) = BUCKETS.iter().find(|&&b| b >= n && graph_safe(b)) else {
        return Ok(None);
    };
    if !graphs_enabled() {
        return Ok(None);
    }
    let need_blocks = batch
        .seqs
        .iter()
        .map(|s| s.block_table)
        .chain(batch.window_tables.iter().copied())
        .map(|t| t.blocks.len())
        .max()
        .unwrap_or(1);
    // The MoE scratch must hold the bucket before capture: replacing it later would leave the
    // graph pointing at freed memory.
    if let Some((experts, top_k)) = moe {
        kv.scratch.moe(&m.dev, experts, bucket, top_k)?;
    }
    if kv.scratch.replaced {
        kv.graphs.clear();
        kv.scratch.replaced = false;
    }
    let fits = kv
        .graphs
        .by_bucket
        .get(&bucket)
        .is_some_and(|g| g.table_blocks >= need_blocks);
    if !fits {
        let table_blocks = need_blocks.next_power_of_two().max(MIN_TABLE_BLOCKS);
        let step = |kv: &mut DeviceKv| capture(m, cfg, w, kv, bucket, table_blocks, linear);
        match capture_in_arena(&m.dev, kv, step) {
            Ok(g) => {
                kv.graphs.by_bucket.insert(bucket, g);
            }
            Err(e) => {
                eprintln!("moerun: CUDA graphs off for this KV cache, decoding eagerly: {e}");
                kv.graphs.disabled = Some(e.to_string());
                kv.graphs.clear();
                return Ok(None);
            }
        }
    }
    Ok(Some(bucket))
}

/// Write `batch`'s inputs (token ids from `tokens`, positions, block tables, state slots) into
/// the captured graph of `bucket` and launch it. Its logits land in the graph's `logits`.
pub(crate) fn replay(
    m: &CudaModel,
    kv: &mut DeviceKv,
    bucket: usize,
    batch: &Batch,
    tokens: StepTokens<'_>,
    linear_addrs: Option<&[u64]>,
) -> Result<()> {
    let tables_init = padding_tables(kv, bucket, kv.graphs.table_width(bucket));
    let g = kv
        .graphs
        .by_bucket
        .get_mut(&bucket)
        .ok_or_else(|| no_graph(bucket))?;
    let n = batch.seqs.len();
    let mut positions = vec![0i32; bucket];
    let mut tables = tables_init;
    let width = g.table_blocks;
    for (i, seq) in batch.seqs.iter().enumerate() {
        positions[i] = seq.start_pos as i32;
        for (j, &b) in seq.block_table.blocks.iter().enumerate() {
            tables[i * width + j] = b as i32;
        }
        if let Some(window) = batch.window_tables.get(i) {
            let at = (bucket + i) * width;
            for (j, &b) in window.blocks.iter().enumerate() {
                // Released entries (before the window) become -1, which attention skips.
                tables[at + j] = b as i32;
            }
        }
    }
    let dev = &m.dev;
    // A greedy chain's next step: its token and positions were written by the pick before it.
    let advanced = match tokens {
        StepTokens::Pick(slot) => n == 1 && g.advanced_to == Some((batch.seqs[0].start_pos, slot)),
        StepTokens::Host(_) => false,
    };
    g.advanced_to = None;
    g.replayed_at = (n == 1).then(|| batch.seqs[0].start_pos);
    if tables != g.tables_in {
        dev.copy_to_device(&tables, &mut g.at.block_tables)
            .map_err(dev_err)?;
        g.tables_in = tables;
    }
    if let (Some((lp, trash)), Some(addrs)) = (&mut g.linear, linear_addrs) {
        let trash = dev.state_address(trash).map_err(dev_err)?;
        let mut all = vec![trash; bucket];
        all[..n].copy_from_slice(addrs);
        lp.set_states(dev, &all)?;
    }
    if advanced {
        return g.graph.launch().map_err(dev_err);
    }
    let positions_u32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
    match tokens {
        StepTokens::Host(ids) => {
            let mut padded = vec![0u32; bucket];
            padded[..n].copy_from_slice(ids);
            dev.copy_to_device(&padded, &mut g.tokens)
        }
        StepTokens::Pick(slot) => {
            let picks = kv.graphs.picks.as_ref().ok_or_else(|| {
                Error::Device("internal: a step from a pick before any pick".into())
            })?;
            dev.copy_within(picks.device(slot), &mut g.tokens.slice_mut(0..n))
        }
    }
    .map_err(dev_err)?;
    dev.copy_to_device(&positions, &mut g.at.positions)
        .map_err(dev_err)?;
    dev.copy_to_device(&positions_u32, &mut g.at.positions_u32)
        .map_err(dev_err)?;
    g.graph.launch().map_err(dev_err)
}

/// `replay` or `pick` for a bucket `prepare` did not make: a caller bug.
fn no_graph(bucket: usize) -> Error {
    Error::Device(format!("internal: no decode graph for {bucket} sequences"))
}

/// The arg-max of row 0 of the logits a replay of `bucket` wrote, into pick buffer `slot`, and
/// its copy to the host (enqueued: `ahead::Picks::read` waits for it). The graph's inputs move on
/// to the next step of the chain (the pick, one position further), so that [`replay`] of that
/// step from this pick copies nothing in.
pub(crate) fn pick(
    m: &CudaModel,
    vocab: usize,
    kv: &mut DeviceKv,
    bucket: usize,
    slot: usize,
) -> Result<()> {
    let g = kv
        .graphs
        .by_bucket
        .get_mut(&bucket)
        .ok_or_else(|| no_graph(bucket))?;
    let picks = kv
        .graphs
        .picks
        .as_mut()
        .ok_or_else(|| Error::Device("internal: no pick buffers".into()))?;
    let inputs = moerun_cuda::NextStepInputs {
        tokens: &mut g.tokens,
        positions: &mut g.at.positions,
        positions_u32: &mut g.at.positions_u32,
        host_picks: None,
    };
    picks.pick(&m.dev, &g.logits.slice(0..vocab), vocab, slot, inputs)?;
    g.advanced_to = g.replayed_at.map(|at| (at + 1, slot));
    Ok(())
}

/// Run `capture` (a decode step's [`capture`]), which takes every activation of the step from
/// the cache's arena, so that the graph is a chain of kernels without allocation nodes (whose
/// edges can then be programmatic). If the arena was too small, it grows (to at least twice its
/// size, so that recaptures stay few), the graphs captured over its old region are dropped, and
/// the step is captured again.
fn capture_in_arena(
    dev: &CudaDevice,
    kv: &mut DeviceKv,
    capture: impl Fn(&mut DeviceKv) -> Result<DecodeGraph>,
) -> Result<DecodeGraph> {
    let g = capture(kv)?;
    let capacity = kv.scratch.arena.capacity();
    if g.arena_bytes <= capacity {
        return Ok(g);
    }
    let wanted = g.arena_bytes.max(2 * capacity);
    drop(g);
    kv.graphs.clear();
    kv.scratch.arena.grow(dev, wanted).map_err(dev_err)?;
    capture(kv)
}

/// Capture a decode step of `bucket` sequences with block tables `table_blocks` wide.
fn capture(
    m: &CudaModel,
    cfg: &ModelConfig,
    w: &ModelWeights,
    kv: &mut DeviceKv,
    bucket: usize,
    table_blocks: usize,
    linear: Option<&LinearStateCache>,
) -> Result<DecodeGraph> {
    let dev = &m.dev;
    let block_size = kv.block_size()?;
    let table_start: Vec<i32> = (0..bucket).map(|i| (i * table_blocks) as i32).collect();
    // The window group's tables follow the others, one per row, when it has blocks of its own.
    let window_table_start: Option<Vec<i32>> = kv.window_trash_block.map(|_| {
        (0..bucket)
            .map(|i| ((bucket + i) * table_blocks) as i32)
            .collect()
    });
    let tables = padding_tables(kv, bucket, table_blocks);
    let at = Placement {
        positions_u32: dev.zeros(bucket).map_err(dev_err)?,
        positions: dev.zeros(bucket).map_err(dev_err)?,
        table_start: dev.upload(&table_start).map_err(dev_err)?,
        window_table_start: window_table_start
            .map(|w| dev.upload(&w).map_err(dev_err))
            .transpose()?,
        block_tables: dev.upload(&tables).map_err(dev_err)?,
        max_context: table_blocks * block_size,
        // One token per sequence.
        seq_starts: (0..bucket).collect(),
    };
    let tokens = dev.zeros::<u32>(bucket).map_err(dev_err)?;
    let mut logits = dev.zeros::<f32>(bucket * cfg.vocab_size).map_err(dev_err)?;
    let host_tokens = vec![0u32; bucket];
    let rows: Vec<usize> = (0..bucket).collect();
    let linear = match linear {
        Some(cache) => {
            let trash = dev.zeros::<f32>(cache.slot_len().max(1)).map_err(dev_err)?;
            let addr = dev.state_address(&trash).map_err(dev_err)?;
            let lp = LinearPlacement::for_decode(dev, cfg, cache, bucket, addr)?;
            Some((lp, trash))
        }
        None => None,
    };
    // Nothing may be pending when capture starts (uploads above finish first).
    dev.synchronize().map_err(dev_err)?;
    if arena_enabled() {
        kv.scratch.arena.begin();
    }
    let captured = dev.capture(|| {
        let out = match &w.gemma4 {
            Some(g) => {
                crate::gemma4::cuda::decode_logits(m, kv, cfg, g, &at, &tokens, &host_tokens, &rows)
            }
            None => {
                let mut pass = CudaPass::new(m, kv, &at, Tokens::Device(&tokens));
                if let Some((lp, _)) = &linear {
                    pass = pass.with_linear_state(lp);
                }
                forward::decoder_logits(&mut pass, cfg, w, &host_tokens, &rows)
            }
        }
        .map_err(|e| moerun_cuda::CudaError::Unsupported(e.to_string()))?;
        dev.copy_within(&out, &mut logits)
    });
    let arena_bytes = kv.scratch.arena.end();
    let graph = captured.map_err(dev_err)?;
    if std::env::var_os("MOERUN_CUDA_GRAPH_INFO").is_some_and(|v| v == "1") {
        eprintln!(
            "moerun: decode graph for {bucket} sequences: {} nodes, {} programmatic edges, \
             {:.1} MB of activations (arena {:.1} MB)",
            graph.nodes(),
            graph.programmatic_edges(),
            arena_bytes as f64 / 1e6,
            kv.scratch.arena.capacity() as f64 / 1e6
        );
    }
    Ok(DecodeGraph {
        table_blocks,
        tokens,
        at,
        linear,
        logits,
        graph,
        replayed_at: None,
        advanced_to: None,
        tables_in: tables,
        arena_bytes,
    })
}

/// A bucket's block tables with every row pointing at the trash blocks (the window group's
/// after the others' when it has its own): what padding rows write into.
fn padding_tables(kv: &DeviceKv, bucket: usize, width: usize) -> Vec<i32> {
    let mut tables = vec![kv.trash_block as i32; bucket * width];
    if let Some(trash) = kv.window_trash_block {
        tables.resize(2 * bucket * width, trash as i32);
    }
    tables
}

/// The first MoE layer's experts and top-k (every MoE layer of a model has the same shapes).
fn first_moe<'a>(
    m: &'a CudaModel,
    cfg: &ModelConfig,
    w: &ModelWeights,
) -> Option<(&'a DeviceExperts, usize)> {
    let moe_cfg = cfg.moe.as_ref()?;
    if let Some(g) = &w.gemma4 {
        return g.layers.iter().find_map(|l| {
            let moe = l.moe.as_ref()?;
            m.experts
                .get(&super::tensor_key(&moe.router_proj))
                .map(|e| (e, moe_cfg.top_k))
        });
    }
    w.layers.iter().find_map(|l| match &l.ffn {
        FfnWeights::Moe(moe) => m
            .experts
            .get(&super::tensor_key(&moe.router))
            .map(|e| (e, moe_cfg.top_k)),
        FfnWeights::Dense(_) => None,
    })
}
