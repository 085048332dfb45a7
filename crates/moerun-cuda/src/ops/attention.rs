//! Paged attention on the device (`kernels/attention.cu`): one layer's K/V in fixed-size blocks
//! ([`DeviceKvPool`]), the write of a batch's K/V rows into them, and causal attention of a flat
//! batch over each token's visible positions, with exactly the semantics of moerun-cpu's
//! `paged_attention`: a token at position `p` sees its own sequence's positions `lo..=p`
//! (`lo = p + 1 - window` under a sliding window), found through the sequence's block table;
//! query head `h` reads kv head `h / (num_heads / num_kv_heads)`. A pool stores f32 or bf16
//! ([`KvDtype`]); every kernel below exists in one build per dtype, and where this text says
//! "the f32 pool" a bf16 pool's values are read the same way, widened (so the same bits as an
//! f32 pool holding those values).
//!
//! One call runs up to three kernels, and each token is handled by exactly one path, chosen on
//! the device by the *tile rule* (no host synchronisation, grid sizes from host-known bounds):
//! - when the batch has at least `tile_m` tokens, every tile of `tile_m` consecutive tokens that
//!   all belong to one sequence (same `table_start`) goes to a tiled prefill kernel, grid
//!   (n / tile_m, num_heads), block 256: K/V tiles of 64 positions staged in shared memory by
//!   `cp.async`, online softmax, causal tiles skipped, the tiles with the most keys launched first.
//!   [`AttentionPrefill::ExactF32`] (the default) runs it on CUDA cores in f32, tile_m 64;
//!   [`AttentionPrefill::TensorCoreBf16`] on tensor cores (`mma.sync` m16n8k16, bf16 operands
//!   read by `ldmatrix`, f32 accumulation, tile_m 64, blocks of 128 threads, two per SM, a
//!   3-stage pipeline of bf16 K/V tiles; head_dim 64 or 128). Builds with two query heads per
//!   warp (blocks of 2 or 4 heads of one kv head, grid (n / 64, num_heads / heads), q staged in
//!   shared memory) do the same per-row arithmetic with each K/V fragment load serving twice the
//!   products, so they give the same bits; [`CudaDevice::set_tensor_core_attention_heads`] or
//!   `MOERUN_ATTN_TC_HEADS` picks one. Keys of the batch's own positions come, already bf16,
//!   from a [`BatchKvBf16`] copy when the caller passes one
//!   ([`CudaDevice::paged_attention_batch_copy`]; the q/k/v prologue or
//!   [`CudaDevice::kv_write_with_copy`] fill it), by `cp.async`; keys of earlier positions (a
//!   cached prefix) are read from the f32 pool (cp.async a tile ahead) and rounded in shared
//!   memory. The two give the same bf16 values, so the output is bitwise the same with or
//!   without the copy.
//! - on Hopper (compute capability 9.0) with head_dim 128, the tensor-core prefill tiles run the
//!   *wgmma* kernel instead (`kernels/attention_wgmma.cu`, [`super::attention_wgmma`],
//!   FlashAttention-3 style): the same tile rule (tile_m 64), key sources, masks, GQA and
//!   rounding points, in another accumulation order (other bits, the same tolerance). CTAs of a
//!   producer warpgroup and two consumer warpgroups (two query heads of one kv head; one for odd
//!   groups), K/V tiles of 128 keys in a 3-stage ring, S = QK^T and O += PV by wgmma with P from
//!   registers, the softmax of one tile overlapping the previous tile's PV and the other
//!   consumer's products. Non-Hopper devices and head_dim 64 keep the `mma.sync` builds;
//!   `MOERUN_ATTN_WGMMA=0` (read once) or [`CudaDevice::set_attention_wgmma`]`(Some(0))` turn it
//!   off (then the `mma.sync` builds run, as before).
//! - every other token (decode, short chunks, the tails of prefills, tiles mixing sequences) goes
//!   to split-K flash-decoding in exact f32: grid (n, splits, kv_heads * head_chunks), block 128;
//!   a block reads each K/V row of its split once for all (up to 8) query heads of its kv head.
//!   With more than one split, the last split block of a group to finish (an arrival count)
//!   merges the splits' partials, kept in an [`AttentionScratch`] the caller creates beforehand.
//!   Splits are chosen so the decode grid has about 8 blocks per SM: `splits = ceil(8 * SMs /
//!   (n * kv_heads * head_chunks))`, at least 16 keys per split, capped by the context bound
//!   (`max_context`, or the window) and by the scratch.
//! - on Hopper (compute capability 9+), a small decode batch (its (token, kv head x head chunk)
//!   groups fit the device's active clusters at once) instead runs the *cluster* kernel: grid
//!   (n, size x clusters, kv_heads * head_chunks) in thread-block clusters of `size` blocks of
//!   256 threads: 8 (the portable maximum), or 16 (Hopper's non-portable size, the
//!   `attention_cl16` builds) where one cluster of 16 covers what 8 would take in several
//!   clusters or in three steps or more a block ([`choose_cluster`]). The
//!   blocks of a cluster split a token's keys evenly and merge through distributed shared
//!   memory (st.async into each slice owner's inbox), each block writing its slice of the
//!   output: no partials, fence or atomic when one cluster covers the context (the latency of a
//!   batch-1 decode step). Longer contexts take up to 16 clusters per group, merged as the split
//!   kernel merges its splits (`cluster_plan`); contexts needing more than 8 steps of keys per
//!   block stay on the split kernel, which keeps more loads in flight per SM.
//!
//! The exact f32 paths agree with the CPU within f32 rounding (~1e-6 relative); results are not
//! bitwise batch invariant (which path a token takes and its splits depend on the batch).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::attention_fold::PrologueArgs;
use super::attention_wgmma::{FaMap, WgmmaAttention};
use super::to_i32;
use crate::error::{ensure, CudaError, DriverContext, Result};
use crate::CudaDevice;

/// Query tokens per tile of the exact f32 tiled kernel (`TILE_M` in the kernel file).
const TILE_M: usize = 64;
/// Query tokens per tile of the tensor-core kernel (`TC_M`: 4 warps of 16 rows).
const TC_M: usize = 64;
/// Threads per block of the exact f32 tiled kernel (`TF_THREADS`).
const TF_THREADS: u32 = 256;
/// One build of the tensor-core kernel, `attn_tile_bf16{suffix}_d<D>`: `heads` query heads (of
/// one kv head) per block over the same 64 tokens, `threads` per block, `stages` bf16 K/V tiles
/// in its pipeline, `q_heads` heads of bf16 q staged in shared memory. All give the same bits.
#[derive(Clone, Copy, Debug)]
struct TcVariant {
    heads: usize,
    threads: u32,
    stages: usize,
    q_heads: usize,
    suffix: &'static str,
}

/// One head per warp (16 rows, q in registers), 4 warps, 3 stages, two blocks per SM; two heads
/// per warp (32 rows: each K/V fragment serves both), 4 warps, 2 stages + q, two blocks per SM;
/// two heads per warp, 8 warps (4 heads), 3 stages + q, one block per SM.
const TC_VARIANTS: [TcVariant; 3] = [
    TcVariant {
        heads: 1,
        threads: 128,
        stages: 3,
        q_heads: 0,
        suffix: "",
    },
    TcVariant {
        heads: 2,
        threads: 128,
        stages: 2,
        q_heads: 2,
        suffix: "_h2",
    },
    TcVariant {
        heads: 4,
        threads: 256,
        stages: 3,
        q_heads: 4,
        suffix: "_h4",
    },
];

/// Query heads per tensor-core block when neither [`CudaDevice::set_tensor_core_attention_heads`]
/// nor `MOERUN_ATTN_TC_HEADS` says otherwise (where the kv group divides by it). 2: `ops_bench
/// attention` on the H200 (Qwen3-30B-A3B's 32/4 heads of 128), 4096 tokens from the batch copy
/// 619.2 / 581.0 / 584.5 µs with 1 / 2 / 4 heads per block, from the f32 pool 1,569 / 1,180 /
/// 863; `moerun bench --like qwen3-30b-a3b --device cuda --prompt 4096 --gen 8` 46.0k (1 head)
/// against 47.3k tok/s (2 heads).
const DEFAULT_TC_HEADS: usize = 2;
/// Fewest keys a split of the decode kernel takes: fewer would cost more in partials than the
/// parallelism gains.
const MIN_SPLIT_KEYS: usize = 16;
/// Decode blocks per SM the split count aims for, by default. 8 rather than 4 (H200, Qwen3-30B-A3B
/// shapes, `moerun bench --like qwen3-30b-a3b --device cuda --prompt 512 --gen 64 --concurrency
/// 8,32`, alternating): 8 sequences 702.6 / 693.2 -> 714.0 / 717.0 tok/s, 32 sequences 1,369.8 /
/// 1,375.3 -> 1,388.1 / 1,377.1; 16 and 32 were no better (709 / 679 at 8 sequences).
const BLOCKS_PER_SM: usize = 8;

/// Decode blocks per SM the split count aims for: [`BLOCKS_PER_SM`], or
/// `MOERUN_CUDA_SPLIT_BLOCKS_PER_SM` (1 to 64, read once), to measure the trade.
fn blocks_per_sm() -> usize {
    static FORCED: OnceLock<Option<usize>> = OnceLock::new();
    env_count(&FORCED, "MOERUN_CUDA_SPLIT_BLOCKS_PER_SM", |b| {
        (1..=64).contains(&b)
    })
    .unwrap_or(BLOCKS_PER_SM)
}
/// Largest head_dim the kernels take (the decode kernel's widest lane layout).
pub const MAX_HEAD_DIM: usize = 512;
/// Largest head_dim the tiled prefill kernels take; larger heads run every token on the split-K
/// kernel (exact, only slower for long prefills).
const MAX_TILED_HEAD_DIM: usize = 256;
/// Query heads per block of the split-K kernel for head_dim 512 (register budget).
const MAX_GROUP_D512: usize = 2;
/// Blocks per thread-block cluster of the cluster decode kernel's builds (`CL_SIZE`): 8, the
/// portable maximum (the `attention` build), and Hopper's non-portable 16 (`attention_cl16`).
const CLUSTER_SIZES: [usize; 2] = [8, 16];
/// The cluster size [`CudaDevice::set_decode_cluster_size`] (`asked`, 0: none) or else
/// `MOERUN_CUDA_CLUSTER_SIZE` forces, if any (else each call's plan picks: [`choose_cluster`]).
/// A refused environment value never gets this far (the kernels do not compile).
fn forced_cluster_size(asked: usize) -> Option<usize> {
    match asked {
        0 => crate::compile::cluster_size_knob().ok().flatten(),
        size => Some(size),
    }
}
/// Threads per block of the cluster decode kernel (`CL_THREADS`: 8 warps).
const CLUSTER_THREADS: usize = 256;
/// Most clusters per (token, kv head x head chunk): bounds the final merge (and the kernel's
/// shared memory for its weights).
const MAX_CLUSTERS: usize = 16;
/// Most steps of keys a block of the cluster kernel takes; longer contexts (for the batch) go to
/// the split kernel.
const MAX_CLUSTER_STEPS: usize = 8;
const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// What a [`DeviceKvPool`] stores: f32 (the default, exact), or bf16 in half the bytes, each
/// value rounded to nearest even once when written (by `kv_write` or the q/k/v prologue) and
/// widened exactly when read. The attention kernels are built once per dtype (`MOERUN_KV_BF16`,
/// attention_common.cuh) with the same arithmetic, so attention over a bf16 pool gives the bits
/// of attention over an f32 pool holding the rounded values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    #[default]
    F32,
    Bf16,
}

impl KvDtype {
    /// Index of the dtype's kernel build in `Kernels::attention`.
    pub(crate) fn slot(self) -> usize {
        match self {
            KvDtype::F32 => 0,
            KvDtype::Bf16 => 1,
        }
    }
    /// Bytes per stored value.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }
}

/// A pool's K and V buffers, as stored.
pub enum KvBuffers<'a> {
    F32(&'a CudaSlice<f32>, &'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<u16>, &'a CudaSlice<u16>),
}

/// A pool's K and V buffers, writable (callers that fill a pool themselves: benchmarks with
/// synthetic K/V, tests).
pub enum KvBuffersMut<'a> {
    F32(&'a mut CudaSlice<f32>, &'a mut CudaSlice<f32>),
    Bf16(&'a mut CudaSlice<u16>, &'a mut CudaSlice<u16>),
}

enum KvStore {
    F32(CudaSlice<f32>, CudaSlice<f32>),
    Bf16(CudaSlice<u16>, CudaSlice<u16>),
}

/// One layer's paged KV on the device: K and V, each `[blocks][block_size][kv_heads][head_dim]`
/// of its [`KvDtype`].
pub struct DeviceKvPool {
    store: KvStore,
    blocks: usize,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl DeviceKvPool {
    pub fn blocks(&self) -> usize {
        self.blocks
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    pub fn dtype(&self) -> KvDtype {
        match self.store {
            KvStore::F32(..) => KvDtype::F32,
            KvStore::Bf16(..) => KvDtype::Bf16,
        }
    }
    /// Bytes held on the device (K and V).
    pub fn bytes(&self) -> usize {
        let values = match &self.store {
            KvStore::F32(k, v) => k.len() + v.len(),
            KvStore::Bf16(k, v) => k.len() + v.len(),
        };
        values * self.dtype().size()
    }
    /// The keys and values, `[blocks][block_size][kv_heads][head_dim]` each.
    pub fn buffers(&self) -> KvBuffers<'_> {
        match &self.store {
            KvStore::F32(k, v) => KvBuffers::F32(k, v),
            KvStore::Bf16(k, v) => KvBuffers::Bf16(k, v),
        }
    }
    /// Both buffers, writable.
    pub fn buffers_mut(&mut self) -> KvBuffersMut<'_> {
        match &mut self.store {
            KvStore::F32(k, v) => KvBuffersMut::F32(k, v),
            KvStore::Bf16(k, v) => KvBuffersMut::Bf16(k, v),
        }
    }
    /// K and V as stored, widened (exactly) to f32, after the pool's stream has finished
    /// (for tests and tools that compare caches).
    pub fn download_f32(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        fn get<T: DeviceRepr + Default + Clone>(x: &CudaSlice<T>, what: &str) -> Result<Vec<T>> {
            let v = x.stream().clone_dtoh(x).ctx(what)?;
            x.stream().synchronize().ctx(what)?;
            Ok(v)
        }
        let widen = |x: Vec<u16>| -> Vec<f32> {
            x.into_iter()
                .map(|h| f32::from_bits((h as u32) << 16))
                .collect()
        };
        Ok(match &self.store {
            KvStore::F32(k, v) => (get(k, "downloading K")?, get(v, "downloading V")?),
            KvStore::Bf16(k, v) => (
                widen(get(k, "downloading K")?),
                widen(get(v, "downloading V")?),
            ),
        })
    }

    /// The device addresses of K and V, for kernels that read them.
    pub(crate) fn ptrs(&self, dev: &CudaDevice, what: &str) -> Result<(u64, u64)> {
        match &self.store {
            KvStore::F32(k, v) => Ok((dev.ptr(k, what)?, dev.ptr(v, what)?)),
            KvStore::Bf16(k, v) => Ok((dev.ptr(k, what)?, dev.ptr(v, what)?)),
        }
    }
    /// The device addresses of K and V, for kernels that write them.
    pub(crate) fn ptrs_mut(&mut self, dev: &CudaDevice, what: &str) -> Result<(u64, u64)> {
        match &mut self.store {
            KvStore::F32(k, v) => Ok((dev.ptr_mut(k, what)?, dev.ptr_mut(v, what)?)),
            KvStore::Bf16(k, v) => Ok((dev.ptr_mut(k, what)?, dev.ptr_mut(v, what)?)),
        }
    }
}

/// Where each token of a flat batch sits: `positions[i]` (its position in its sequence) and
/// `table_start[i]` (offset into `block_tables` where its sequence's block table begins; the
/// table's j-th entry is the pool block holding positions `j * block_size..`). All three are
/// device buffers of i32 the caller fills (once per forward, shared by all layers).
#[derive(Clone, Copy)]
pub struct TokenPlacement<'a> {
    pub positions: &'a CudaSlice<i32>,
    pub table_start: &'a CudaSlice<i32>,
    pub block_tables: &'a CudaSlice<i32>,
    /// Upper bound (host-known) on position + 1 over the batch: sizes split-K grids. A token past
    /// it is still attended exactly (its last split runs on), only with less parallelism.
    pub max_context: usize,
    /// Every token at which a run of one sequence's tokens begins, ascending (host-known; empty
    /// when the caller does not say). With it the split kernel's grid starts at the first token
    /// that a prefill tile does not own, instead of launching a block per token that only finds
    /// its tile owned (16,384 such blocks, ~23 µs, in a 4096-token prefill of 4 KV heads).
    pub seq_starts: &'a [usize],
}

/// The first token of `n` that is not in a whole tile of `tile_m` tokens of one sequence, by the
/// tokens where runs of one sequence begin (`seq_starts`); 0 when they are not given. Never past
/// the first token the kernels' tile rule leaves to the split kernel: a tile the rule rejects
/// has a run starting strictly inside it (its table starts differ), or runs past n.
fn first_untiled(seq_starts: &[usize], n: usize, tile_m: usize) -> usize {
    if seq_starts.is_empty() || tile_m == 0 {
        return 0;
    }
    // The tile holding the first run start that is not on a tile boundary; else the tail.
    let whole = n / tile_m * tile_m;
    seq_starts
        .iter()
        .filter(|&&s| !s.is_multiple_of(tile_m))
        .map(|&s| s / tile_m * tile_m)
        .fold(whole, usize::min)
}

/// Shape of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k.
    pub scale: f32,
    /// Attend to at most this many positions, the current one included.
    pub sliding_window: Option<usize>,
}

/// Which kernel runs the prefill tiles (64 consecutive tokens of one sequence). Every other token
/// is always exact f32. [`CudaDevice::paged_attention`] uses [`AttentionPrefill::ExactF32`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionPrefill {
    /// f32 on CUDA cores, as exact as the CPU (~1e-6 relative): what conformance runs.
    #[default]
    ExactF32,
    /// bf16 tensor cores: q·scale, k, v and the softmax weights are rounded to bf16, sums are
    /// f32 (~1e-3 relative error; tests allow 1e-2). head_dim 64 or 128 only.
    TensorCoreBf16,
}

/// The batch's own K and V rounded to bf16, `[tokens][kv_heads][head_dim]` each: the source of
/// the tensor-core prefill kernel for keys at the batch's own positions (no f32 stage, no
/// rounding per tile). Row `i` is the batch's token `i`; a copy of `tokens` rows serves batches of
/// up to that many tokens. Made by [`CudaDevice::batch_kv_bf16`], filled by the q/k/v prologue
/// (`qkv_split_norm_rope_copy`) or [`CudaDevice::kv_write_with_copy`] in the same pass.
pub struct BatchKvBf16 {
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    tokens: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl BatchKvBf16 {
    /// Rows it holds.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// The keys, `[tokens][kv_heads][head_dim]` bf16 bits.
    pub fn k(&self) -> &CudaSlice<u16> {
        &self.k
    }
    /// The values, laid out as the keys.
    pub fn v(&self) -> &CudaSlice<u16> {
        &self.v
    }
    /// Whether it can take `tokens` rows of `kv_heads` x `head_dim`.
    pub fn fits(&self, tokens: usize, kv_heads: usize, head_dim: usize) -> bool {
        self.tokens >= tokens && self.kv_heads == kv_heads && self.head_dim == head_dim
    }
    /// Both buffers, for the kernels that write them.
    pub(crate) fn k_v_mut(&mut self) -> (&mut CudaSlice<u16>, &mut CudaSlice<u16>) {
        (&mut self.k, &mut self.v)
    }
    /// Refuse a copy that cannot hold `tokens` rows of `kv_heads` x `head_dim`.
    pub(crate) fn check(
        &self,
        what: &str,
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        ensure(self.fits(tokens, kv_heads, head_dim), || {
            format!(
                "{what}: a batch copy of {} rows of {} x {} for {tokens} tokens of {kv_heads} x \
                 {head_dim}",
                self.tokens, self.kv_heads, self.head_dim
            )
        })
    }
}

impl AttentionPrefill {
    /// Whether a batch of `tokens` tokens with heads of `head_dim` runs tensor-core tiles, which
    /// read a [`BatchKvBf16`] copy when given one (so a pass should make it): the kernel exists
    /// for this head size and the batch holds at least one tile.
    pub fn takes_batch_copy(self, tokens: usize, head_dim: usize) -> bool {
        self == AttentionPrefill::TensorCoreBf16 && matches!(head_dim, 64 | 128) && tokens >= TC_M
    }
}

/// Scratch for split-K partials, created once (outside any CUDA graph) and passed to every
/// attention call; sized by [`CudaDevice::attention_scratch`].
pub struct AttentionScratch {
    acc: CudaSlice<f32>,
    ml: CudaSlice<f32>,
    /// Split blocks arrived, per (token, kv head x head chunk); zero between launches (the last
    /// block of each group resets its count).
    arrivals: CudaSlice<u32>,
}

impl AttentionScratch {
    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        (self.acc.len() + self.ml.len() + self.arrivals.len()) * 4
    }
}

/// Handles of `kernels/attention.cu`.
pub(crate) struct AttentionKernels {
    kv_write: CudaFunction,
    /// `[dim class][group class]`: head_dim <= 16, 32, 64, 128, 256, 512 x query heads per block
    /// 1, 2, 4, 8 (head_dim 512: 1 and 2 only; its row repeats the 2-head kernel).
    split: [[CudaFunction; 4]; 6],
    /// The cluster decode kernels in clusters of 8 and of 16 blocks ([`CLUSTER_SIZES`]).
    cluster: [ClusterKernels; 2],
    /// head_dim <= 64, 128, 256.
    tile_f32: [CudaFunction; 3],
    /// The dynamic shared memory each `tile_f32` kernel was allowed (0: the device refused).
    tile_f32_smem: [usize; 3],
    /// `[TC_VARIANTS index][head_dim 64, 128]`.
    tile_bf16: [[CudaFunction; 2]; 3],
    /// The dynamic shared memory each `tile_bf16` kernel was allowed (as for `tile_f32_smem`).
    tile_bf16_smem: [[usize; 2]; 3],
    /// Query heads per tensor-core block asked for by `set_tensor_core_attention_heads` (0: none).
    tc_heads: AtomicUsize,
    /// Blocks per decode cluster asked for by `set_decode_cluster_size` (0: none).
    cluster_forced: AtomicUsize,
    /// The wgmma prefill kernel (sm_90, head_dim 128), `ops/attention_wgmma.rs`.
    pub(super) wgmma: WgmmaAttention,
}

/// The cluster decode kernels of one cluster size (sm_90+ only; empty elsewhere).
struct ClusterKernels {
    /// Blocks per cluster (the build's `CL_SIZE`).
    size: usize,
    /// Indexed as `AttentionKernels::split`.
    kernels: [[CudaFunction; 4]; 6],
    /// Whether each kernel got the dynamic shared memory of its widest head.
    smem_ok: [[bool; 4]; 6],
    /// The folded-prologue builds (`PRO_GROUP` query heads a block), by dim class (`PRO_DIMS`
    /// only), with whether their shared memory was granted.
    pro: [Option<(CudaFunction, bool)>; 6],
    /// Clusters of each kernel the device runs at once (queried on first use).
    slots: [[OnceLock<usize>; 4]; 6],
}

impl ClusterKernels {
    /// The cluster kernels of one build, in clusters of `size` blocks: `f` loads an entry point
    /// of that build by its name in attention.cu. Each is opted in to its cluster size and its
    /// shared memory.
    fn load(f: &impl Fn(&str) -> Result<CudaFunction>, size: usize) -> Result<Self> {
        let row = |d: usize| -> Result<[CudaFunction; 4]> {
            if d == 512 {
                // As for the split kernels: the 2-head kernel serves the larger group classes.
                let g2 = f("attn_cluster_d512_g2")?;
                return Ok([f("attn_cluster_d512_g1")?, g2.clone(), g2.clone(), g2]);
            }
            group_row(f, "cluster", d)
        };
        let kernels = [
            row(16)?,
            row(32)?,
            row(64)?,
            row(128)?,
            row(256)?,
            row(512)?,
        ];
        kernels
            .iter()
            .flatten()
            .for_each(|k| allow_cluster_size(k, size));
        let smem_ok = std::array::from_fn(|dc| {
            std::array::from_fn(|gc| {
                let want = cluster_smem(DIM_CLASSES[dc], GROUP_CLASSES[gc], size);
                allow_smem(&kernels[dc][gc], want) >= want
            })
        });
        let mut pro: [Option<(CudaFunction, bool)>; 6] = Default::default();
        for d in PRO_DIMS {
            let func = f(&format!("attn_cluster_d{d}_g{PRO_GROUP}_pro"))?;
            allow_cluster_size(&func, size);
            let want = cluster_smem(d, PRO_GROUP, size);
            let ok = allow_smem(&func, want) >= want;
            pro[class_of(&DIM_CLASSES, d)] = Some((func, ok));
        }
        Ok(ClusterKernels {
            size,
            kernels,
            smem_ok,
            pro,
            slots: Default::default(),
        })
    }
}

const DIM_CLASSES: [usize; 6] = [16, 32, 64, 128, 256, 512];
/// The head dims (classes) and query heads per block of the cluster kernel's folded-prologue
/// builds (`attn_cluster_d<D>_g4_pro`): batch 1's blocks of the GQA models we target (and of
/// the small fixtures that check them against transformers).
const PRO_DIMS: [usize; 4] = [16, 32, 64, 128];
const PRO_GROUP: usize = 4;
const GROUP_CLASSES: [usize; 4] = [1, 2, 4, 8];
const TILE_F32_DIMS: [usize; 3] = [64, 128, 256];
const TILE_BF16_DIMS: [usize; 2] = [64, 128];

/// Dynamic shared memory of the f32 tiled kernel: Q, K, V tiles (row stride head_dim + 4) and P.
fn tile_f32_smem(head_dim: usize) -> usize {
    (3 * TILE_M * (head_dim + 4) + TILE_M * (TILE_M + 1)) * 4
}

/// Dynamic shared memory of a tensor-core kernel: its stages of the bf16 tile, K and V
/// [64][head_dim + 8] each, then its bf16 q tile, [q_heads][64][head_dim + 8].
fn tile_bf16_smem(head_dim: usize, v: &TcVariant) -> usize {
    (v.stages * 2 + v.q_heads) * TC_M * (head_dim + 8) * 2
}

/// The count environment variable `name` sets, read once into `cell`, if `allowed` takes it;
/// anything else is ignored. The attention kernels' measuring knobs.
fn env_count(
    cell: &'static OnceLock<Option<usize>>,
    name: &str,
    allowed: impl Fn(usize) -> bool,
) -> Option<usize> {
    *cell.get_or_init(|| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&c| allowed(c))
    })
}

/// `MOERUN_ATTN_TC_HEADS` (1, 2 or 4), read once; anything else is ignored.
fn env_tc_heads() -> Option<usize> {
    static HEADS: OnceLock<Option<usize>> = OnceLock::new();
    env_count(&HEADS, "MOERUN_ATTN_TC_HEADS", |h| {
        TC_VARIANTS.iter().any(|v| v.heads == h)
    })
}

/// The tensor-core variant for a kv group of `group` query heads when `want` heads per block are
/// asked for: the widest at most `want` that divides the group and whose shared memory `granted`
/// (by variant) covers; the one-head kernel otherwise (its own shortfall is refused at launch).
fn pick_tc_variant(want: usize, group: usize, granted: [usize; 3], head_dim: usize) -> usize {
    (1..TC_VARIANTS.len())
        .rev()
        .find(|&i| {
            let v = &TC_VARIANTS[i];
            v.heads <= want
                && group.is_multiple_of(v.heads)
                && granted[i] >= tile_bf16_smem(head_dim, v)
        })
        .unwrap_or(0)
}

/// Dynamic shared memory of the cluster kernel for `group` (class) query heads of `head_dim` in
/// clusters of `size` blocks: the 8 warps' states, each `group * (head_dim + 2)` floats, then the
/// inbox of the merge: from each block of the cluster its slice of the `group * head_dim`
/// outputs (float4 items, split evenly over the cluster) and a (max, sum) pair per head.
fn cluster_smem(head_dim: usize, group: usize, size: usize) -> usize {
    let slice_items = (group * head_dim / 4).div_ceil(size);
    (CLUSTER_THREADS / 32) * group * (head_dim + 2) * 4 + size * (slice_items * 16 + group * 8)
}

/// Whether a batch of `n` tokens of `head_dim` runs prefill tiles of `tile_m` queries (the
/// widest heads never do).
fn tiles(head_dim: usize, n: usize, tile_m: usize) -> bool {
    head_dim <= MAX_TILED_HEAD_DIM && n >= tile_m
}

/// Keys one step of a cluster-kernel block covers: its lane groups (a key each, head_dim / 4
/// lanes, at most 32) times the keys per group per step (4 for head_dim <= 128, 2 for 256, 1 for
/// 512), as in `attend_keys`.
fn cluster_keys_per_step(dim_class: usize) -> usize {
    let lanes = (dim_class / 4).min(32);
    let vpl = (dim_class / 128).max(1);
    CLUSTER_THREADS / lanes * (4 / vpl)
}

/// The `kind` ("split" or "cluster") decode kernels of head dim class `d`, one per group class:
/// `attn_<kind>_d<d>_g<1, 2, 4, 8>`.
fn group_row(
    f: &impl Fn(&str) -> Result<CudaFunction>,
    kind: &str,
    d: usize,
) -> Result<[CudaFunction; 4]> {
    Ok([
        f(&format!("attn_{kind}_d{d}_g1"))?,
        f(&format!("attn_{kind}_d{d}_g2"))?,
        f(&format!("attn_{kind}_d{d}_g4"))?,
        f(&format!("attn_{kind}_d{d}_g8"))?,
    ])
}

/// Opt a cluster kernel in to clusters past the portable 8 blocks when its build's `size` has
/// them. A device that refuses (not Hopper) leaves the occupancy query no room for such a
/// cluster, so that build is never planned with.
fn allow_cluster_size(func: &CudaFunction, size: usize) {
    if size > 8 {
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED;
        let _ = func.set_attribute(attr, 1);
    }
}

/// Opt `func` in to `want` bytes of dynamic shared memory; returns what it may use (48 KiB, the
/// default, when the device refuses: those head dims are then refused at launch, not at open).
fn allow_smem(func: &CudaFunction, want: usize) -> usize {
    let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    match func.set_attribute(attr, want as i32) {
        Ok(()) => want,
        Err(_) => 48 << 10,
    }
}

impl AttentionKernels {
    /// The cluster kernels of clusters of `size` blocks.
    fn cluster_build(&self, size: usize) -> Option<&ClusterKernels> {
        self.cluster.iter().find(|k| k.size == size)
    }

    /// `get(file, function)` loads an entry point of a compiled kernel file.
    /// The kernels of the attention files' build named with `suffix` ("" for f32 pools,
    /// "_kvbf16" for bf16 ones: compile.rs).
    pub(crate) fn load(
        get: &impl Fn(&str, &str) -> Result<CudaFunction>,
        suffix: &str,
    ) -> Result<Self> {
        let get = |file: &str, func: &str| get(&format!("{file}{suffix}"), func);
        let f = |name: &str| get("attention", name);
        let split_row = |d: usize| group_row(&f, "split", d);
        let cluster = [
            ClusterKernels::load(&f, CLUSTER_SIZES[0])?,
            ClusterKernels::load(&|name: &str| get("attention_cl16", name), CLUSTER_SIZES[1])?,
        ];
        let tile_f32 = [
            f("attn_tile_f32_c1")?,
            f("attn_tile_f32_c2")?,
            f("attn_tile_f32_c4")?,
        ];
        let mut tile_bf16 = Vec::with_capacity(TC_VARIANTS.len());
        for v in &TC_VARIANTS {
            let s = v.suffix;
            tile_bf16.push([
                f(&format!("attn_tile_bf16{s}_d64"))?,
                f(&format!("attn_tile_bf16{s}_d128"))?,
            ]);
        }
        let tile_bf16: [[CudaFunction; 2]; 3] = tile_bf16
            .try_into()
            .map_err(|_| CudaError::InvalidArgument("tensor-core variants".into()))?;
        let f32_smem = [0, 1, 2].map(|i| allow_smem(&tile_f32[i], tile_f32_smem(TILE_F32_DIMS[i])));
        let bf16_smem = std::array::from_fn(|v| {
            std::array::from_fn(|c| {
                allow_smem(
                    &tile_bf16[v][c],
                    tile_bf16_smem(TILE_BF16_DIMS[c], &TC_VARIANTS[v]),
                )
            })
        });
        // Two tensor-core blocks share an SM only if the SM gives shared memory its largest
        // share; a hint (a device that ignores it runs one block per SM, as fast as before).
        let carveout = CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
        for f in tile_bf16.iter().flatten() {
            let _ = f.set_attribute(carveout, 100);
        }
        Ok(AttentionKernels {
            kv_write: f("kv_write_f32")?,
            split: [
                split_row(16)?,
                split_row(32)?,
                split_row(64)?,
                split_row(128)?,
                split_row(256)?,
                [
                    f("attn_split_d512_g1")?,
                    f("attn_split_d512_g2")?,
                    f("attn_split_d512_g2")?,
                    f("attn_split_d512_g2")?,
                ],
            ],
            cluster,
            tile_f32,
            tile_f32_smem: f32_smem,
            tile_bf16,
            tile_bf16_smem: bf16_smem,
            tc_heads: AtomicUsize::new(0),
            cluster_forced: AtomicUsize::new(0),
            wgmma: WgmmaAttention::load(&get)?,
        })
    }
}

/// The kernels' argument block: the C layout of `struct AttnArgs` in kernels/attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnArgs {
    q: u64,
    out: u64,
    pool_k: u64,
    pool_v: u64,
    positions: u64,
    table_start: u64,
    block_tables: u64,
    part_acc: u64,
    part_ml: u64,
    arrivals: u64,
    copy_k: u64,
    copy_v: u64,
    n: i32,
    num_heads: i32,
    kv_heads: i32,
    head_dim: i32,
    group: i32,
    head_chunks: i32,
    tables_len: i32,
    blocks: i32,
    block_size: i32,
    block_shift: i32,
    window: i32,
    chunk: i32,
    nsplit: i32,
    tiled: i32,
    tile_m: i32,
    scale_log2: f32,
    /// The token of the split and cluster kernels' first block (blockIdx.x 0): every token
    /// before it lies in a tile the tiled kernel owns.
    token0: i32,
    /// The output rounded to bf16 as well (the wgmma tile kernel's rows; 0: none).
    out_bf16: u64,
}

const _: () = assert!(std::mem::size_of::<AttnArgs>() == 176);

// SAFETY: plain data (integers, floats, device addresses) in the C layout the kernels declare;
// passed by value as one kernel parameter.
unsafe impl DeviceRepr for AttnArgs {}

/// Which prefill tiles a call runs and where their keys come from.
#[derive(Clone, Copy)]
pub(super) struct KeySource<'a> {
    pub(super) prefill: AttentionPrefill,
    /// The batch's own K/V in bf16 (tensor-core tiles only).
    pub(super) copy: Option<&'a BatchKvBf16>,
    /// Where the output also goes rounded to bf16 (0: nowhere): n rows, every one written.
    pub(super) out_bf16: u64,
    /// The attention prologue folded in (`q` is then the stacked projection): the cluster
    /// kernel's _pro build (ops/attention_fold.rs).
    pub(super) fold: Option<PrologueArgs>,
}

/// How the decode kernel splits each token's keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SplitPlan {
    splits: usize,
    /// Keys per split (the last split runs on to the token).
    chunk: usize,
}

/// `work` = n * kv_heads * head_chunks blocks per split; `context` = the most keys a token sees;
/// `capacity` = the most splits the scratch holds for this batch.
fn split_plan(work: usize, context: usize, sms: usize, capacity: usize) -> SplitPlan {
    let context = context.max(1);
    let wanted = (blocks_per_sm() * sms).div_ceil(work.max(1));
    let splits = wanted
        .min(context.div_ceil(MIN_SPLIT_KEYS))
        .min(capacity)
        .max(1);
    // Round chunks to 16 keys; that can only lower the split count.
    let chunk = context.div_ceil(splits).div_ceil(16) * 16;
    SplitPlan {
        splits: context.div_ceil(chunk),
        chunk,
    }
}

/// How the cluster kernel covers a decode batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ClusterPlan {
    /// Blocks per cluster: which build runs ([`CLUSTER_SIZES`]).
    size: usize,
    /// Clusters per (token, kv head x head chunk) group.
    clusters: usize,
    /// The fewest keys a block takes (a token's keys spread over fewer clusters when short).
    min_keys: usize,
}

impl ClusterPlan {
    /// Key steps the busiest block takes over `context` keys of `step` keys a step.
    fn steps(&self, context: usize, step: usize) -> usize {
        context.max(1).div_ceil(self.clusters * self.size * step)
    }
}

/// How the split and cluster decode kernels take a batch's tokens (those no prefill tile owns).
struct DecodeLayout {
    dim_class: usize,
    /// Query heads per block, as an index of `GROUP_CLASSES`.
    group_class: usize,
    /// Blocks of query heads per kv head.
    head_chunks: usize,
    /// (token, kv head x head chunk) groups.
    work: usize,
    /// The split kernel's plan (used when `cluster` is none).
    split: SplitPlan,
    /// The cluster kernel's plan, when it runs.
    cluster: Option<ClusterPlan>,
}

/// `size` = blocks per cluster; `work` = (token, kv head x head chunk) groups; `context` = the
/// most keys a token sees; `slots` = clusters the device runs at once; `capacity` = the most
/// partials per row the scratch holds; `step` = keys per block step. None: the split kernel
/// suits this batch better (the groups do not all run at once, or the blocks would take too
/// many steps).
fn cluster_plan(
    size: usize,
    work: usize,
    context: usize,
    slots: usize,
    capacity: usize,
    step: usize,
) -> Option<ClusterPlan> {
    if work == 0 || work > slots {
        return None;
    }
    // Four steps per block at least before a second cluster: the merge of several clusters'
    // partials (a fence, an atomic, then L2 reads) costs more than steps whose rows are already
    // in flight (two steps load before the programmatic wait, cluster_kernel's DEPTH). Measured
    // at batch 1 over 512-560 keys (H200, ktrace timeline, docs/perf/cuda-model.md v10): one
    // cluster of 3 steps 7.7 µs a layer, two of 2 steps 10.0, three of 1 step 8.6.
    // (MOERUN_CUDA_CLUSTER_MIN_STEPS overrides it, to measure the trade.)
    let min_keys = cluster_min_steps() * step;
    let clusters = (slots / work)
        .min(context.max(1).div_ceil(size * min_keys))
        .min(MAX_CLUSTERS)
        .min(capacity)
        .max(1);
    if context.div_ceil(clusters * size) > MAX_CLUSTER_STEPS * step {
        return None;
    }
    Some(ClusterPlan {
        size,
        clusters,
        min_keys,
    })
}

/// The cluster plan a call runs, from the plans of clusters of 8 (`eight`) and of 16 (`sixteen`)
/// blocks over `context` keys of `step` keys a step (`forced`: `MOERUN_CUDA_CLUSTER_SIZE`).
/// Sixteen when it covers the context in one cluster and eight would take several (a global
/// merge: a fence, an atomic, L2 reads of the partials) or three steps or more a block; eight
/// otherwise (a merge over 16 blocks costs more than a step it saves from two). Measured on the
/// H200, batch 1 of Qwen3-30B-A3B shapes (`MOERUN_CUDA_CLUSTER_SIZE` 8 against 16, alternating;
/// docs/perf/cuda-model.md v23): 201-264 keys (one step of 8 or of 16) 480.6 / 477.7 tok/s,
/// 301-364 (two steps against one) 478.9 / 477.3, 513-768 (three to four against two) 465.4 /
/// 470.8, 1,101-1,164 (two clusters of 8 against one of 16, three steps) 439.0 / 458.6,
/// 2,049-2,112 (four clusters of 8 against two of 16) 429.3 / 424.5, and against one of 16 of
/// up to 8 steps 423.9 / 422.4 (3,501-3,564 keys: 402.1 / 402.1). The plan sees the host's
/// bound on the context, not the context: a decode graph's is its table width (graph.rs).
fn choose_cluster(
    eight: Option<ClusterPlan>,
    sixteen: Option<ClusterPlan>,
    context: usize,
    step: usize,
    forced: Option<usize>,
) -> Option<ClusterPlan> {
    match forced {
        Some(8) => return eight,
        Some(_) => return sixteen,
        None => {}
    }
    match (eight, sixteen) {
        (Some(e), Some(s))
            if s.clusters == 1 && (e.clusters > 1 || e.steps(context, step) >= 3) =>
        {
            Some(s)
        }
        _ => eight,
    }
}

/// Batches whose keys (tokens x context) number at most this many take their decode blocks in
/// chunks of at most [`SMALL_BATCH_HEADS`] query heads: twice the blocks, half the registers and
/// the per-warp chain of each. `ops_bench attention` (H200, Qwen3-30B-A3B's 32/4 heads of 128):
/// batch 1 at 512 / 2048 / 8192 keys 12.5 / 18.4 / 48.4 µs with the whole group of 8 per block
/// against 9.1 / 15.6 / 33.0 with 4; 8 sequences of 512 keys 28.9 against 19.7; but 8 of 4096
/// keys 111.8 against 143.2 and 32 of 512 keys 60.2 against 67.5, where the device is full and
/// reading each K/V row once per chunk costs more than the parallelism buys. (Measured with the
/// 4-key split kernel; the 2-key one that replaced it for head_dim 128 may move the crossover.)
const SMALL_BATCH_KEYS: usize = 8192;
/// Query heads per decode block for batches of at most [`SMALL_BATCH_KEYS`] keys.
const SMALL_BATCH_HEADS: usize = 4;

/// The most query heads one decode block takes for `tokens` tokens of up to `context` keys, or
/// `None` for the whole GQA group (up to 8). `MOERUN_CUDA_ATTN_HEADS` (1, 2, 4 or 8) overrides
/// the rule, to measure it.
fn decode_head_cap(tokens: usize, context: usize) -> Option<usize> {
    static FORCED: OnceLock<Option<usize>> = OnceLock::new();
    env_count(&FORCED, "MOERUN_CUDA_ATTN_HEADS", |c| {
        GROUP_CLASSES.contains(&c)
    })
    .or((tokens.saturating_mul(context.max(1)) <= SMALL_BATCH_KEYS).then_some(SMALL_BATCH_HEADS))
}

/// Fewest key steps a cluster kernel block takes: 4, or `MOERUN_CUDA_CLUSTER_MIN_STEPS`.
fn cluster_min_steps() -> usize {
    static STEPS: OnceLock<Option<usize>> = OnceLock::new();
    env_count(&STEPS, "MOERUN_CUDA_CLUSTER_MIN_STEPS", |s| {
        (1..=MAX_CLUSTER_STEPS).contains(&s)
    })
    .unwrap_or(4)
}

/// Index of the smallest class that holds `v`.
fn class_of(classes: &[usize], v: usize) -> usize {
    classes
        .iter()
        .position(|&c| v <= c)
        .unwrap_or(classes.len() - 1)
}

impl CudaDevice {
    /// Clusters of the cluster decode kernel `k` for (`dim_class`, `group_class`) that run at
    /// once, if this device has the kernel (compute capability 9+, its shared memory granted) and
    /// `work` groups might use it (one cluster each fits the device's SMs). Queried once per
    /// kernel.
    fn cluster_slots(
        &self,
        k: &ClusterKernels,
        dim_class: usize,
        group_class: usize,
        work: usize,
    ) -> Option<usize> {
        if self.info().compute_capability.0 < 9
            || !k.smem_ok[dim_class][group_class]
            || work * k.size > self.info().multiprocessors as usize
        {
            return None;
        }
        let slots = *k.slots[dim_class][group_class].get_or_init(|| {
            let cfg = LaunchConfig {
                grid_dim: (1, k.size as u32, 1),
                block_dim: (CLUSTER_THREADS as u32, 1, 1),
                shared_mem_bytes: cluster_smem(
                    DIM_CLASSES[dim_class],
                    GROUP_CLASSES[group_class],
                    k.size,
                ) as u32,
            };
            // A refused query means the kernel cannot be planned for: no clusters, split kernel.
            k.kernels[dim_class][group_class]
                .occupancy_max_active_clusters(cfg, &self.stream)
                .map_or(0, |c| c as usize)
        });
        (slots > 0).then_some(slots)
    }

    /// How the decode kernels take `n` tokens of `shape` seeing at most `max_context` keys (the
    /// window bounds it) with `scratch`'s partials.
    fn decode_layout(
        &self,
        dtype: KvDtype,
        n: usize,
        shape: &AttentionShape,
        max_context: usize,
        scratch: &AttentionScratch,
    ) -> DecodeLayout {
        let (num_heads, d) = (shape.num_heads, shape.head_dim);
        let group = num_heads / shape.num_kv_heads;
        let mut group_class = class_of(&GROUP_CLASSES, group);
        if d > MAX_TILED_HEAD_DIM {
            group_class = group_class.min(class_of(&GROUP_CLASSES, MAX_GROUP_D512));
        }
        let context = shape
            .sliding_window
            .map_or(max_context, |w| w.min(max_context));
        if let Some(cap) = decode_head_cap(n, context) {
            group_class = group_class.min(class_of(&GROUP_CLASSES, cap));
        }
        let head_chunks = group.div_ceil(GROUP_CLASSES[group_class]);
        let per_split = n * num_heads;
        let capacity =
            (scratch.acc.len() / (per_split * d)).min(scratch.ml.len() / (per_split * 2));
        let sms = self.info().multiprocessors as usize;
        let work = n * shape.num_kv_heads * head_chunks;
        let dim_class = class_of(&DIM_CLASSES, d);
        let step = cluster_keys_per_step(DIM_CLASSES[dim_class]);
        let [eight, sixteen] = self.kernels.attention[dtype.slot()]
            .cluster
            .each_ref()
            .map(|k| {
                self.cluster_slots(k, dim_class, group_class, work)
                    .and_then(|slots| {
                        // More than one cluster per group needs an arrival count per group and
                        // rank.
                        let capacity = if work * k.size <= scratch.arrivals.len() {
                            capacity
                        } else {
                            1
                        };
                        cluster_plan(k.size, work, context, slots, capacity, step)
                    })
            });
        let asked = self.kernels.attention[dtype.slot()]
            .cluster_forced
            .load(Ordering::Relaxed);
        let cluster = choose_cluster(eight, sixteen, context, step, forced_cluster_size(asked));
        DecodeLayout {
            dim_class,
            group_class,
            head_chunks,
            work,
            split: split_plan(work, context, sms, capacity),
            cluster,
        }
    }

    /// The folded-prologue build of the cluster kernel for this layout, if it has one and the
    /// batch runs it: the cluster kernel takes every token (`cluster`, no prefill tiles) and
    /// its shared memory was granted.
    fn fold_kernel(
        &self,
        dtype: KvDtype,
        dim_class: usize,
        group_class: usize,
        cluster: Option<ClusterPlan>,
        tiled: bool,
    ) -> Option<&CudaFunction> {
        let k = self.kernels.attention[dtype.slot()].cluster_build(cluster?.size)?;
        match &k.pro[dim_class] {
            Some((f, true)) if !tiled && GROUP_CLASSES[group_class] == PRO_GROUP => Some(f),
            _ => None,
        }
    }

    /// Whether the cluster kernel's folded-prologue build would run `n` tokens of `shape` over a
    /// pool of `dtype` (the plan of [`CudaDevice::paged_attention`], whose prefill tiles are the
    /// exact ones).
    pub(super) fn fold_layout(
        &self,
        dtype: KvDtype,
        n: usize,
        shape: &AttentionShape,
        max_context: usize,
        scratch: &AttentionScratch,
    ) -> bool {
        let l = self.decode_layout(dtype, n, shape, max_context, scratch);
        let tiled = tiles(shape.head_dim, n, TILE_M);
        self.fold_kernel(dtype, l.dim_class, l.group_class, l.cluster, tiled)
            .is_some()
    }

    /// A zeroed f32 pool of `blocks` blocks of `block_size` positions, `kv_heads * head_dim`
    /// values each for K and for V. head_dim must be a multiple of 4 (16-byte rows), at most 512.
    pub fn kv_pool(
        &self,
        blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<DeviceKvPool> {
        self.kv_pool_of(KvDtype::F32, blocks, block_size, kv_heads, head_dim)
    }

    /// [`CudaDevice::kv_pool`] storing `dtype`.
    pub fn kv_pool_of(
        &self,
        dtype: KvDtype,
        blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<DeviceKvPool> {
        ensure(blocks > 0 && block_size > 0 && kv_heads > 0, || {
            format!("kv_pool: blocks {blocks}, block_size {block_size}, kv_heads {kv_heads} must be > 0")
        })?;
        ensure(
            head_dim > 0 && head_dim.is_multiple_of(4) && head_dim <= MAX_HEAD_DIM,
            || {
                format!(
                    "kv_pool: head_dim {head_dim} must be a multiple of 4 in 4..={MAX_HEAD_DIM}"
                )
            },
        )?;
        to_i32(blocks, "kv_pool blocks")?;
        to_i32(block_size, "kv_pool block_size")?;
        let len = blocks
            .checked_mul(block_size)
            .and_then(|x| x.checked_mul(kv_heads * head_dim))
            .ok_or_else(|| CudaError::InvalidArgument("kv_pool: size overflows".into()))?;
        let store = match dtype {
            KvDtype::F32 => KvStore::F32(self.zeros(len)?, self.zeros(len)?),
            KvDtype::Bf16 => KvStore::Bf16(self.zeros(len)?, self.zeros(len)?),
        };
        Ok(DeviceKvPool {
            store,
            blocks,
            block_size,
            kv_heads,
            head_dim,
        })
    }

    /// A [`BatchKvBf16`] of `tokens` rows of `kv_heads` x `head_dim` (contents undefined until a
    /// pass writes them).
    pub fn batch_kv_bf16(
        &self,
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<BatchKvBf16> {
        let len = tokens
            .checked_mul(kv_heads)
            .and_then(|x| x.checked_mul(head_dim))
            .ok_or_else(|| CudaError::InvalidArgument("batch_kv_bf16: size overflows".into()))?;
        ensure(len > 0 && head_dim.is_multiple_of(8), || {
            format!(
                "batch_kv_bf16: {tokens} tokens of {kv_heads} x {head_dim} (head_dim a multiple \
                 of 8, nothing empty)"
            )
        })?;
        Ok(BatchKvBf16 {
            k: self.zeros(len)?,
            v: self.zeros(len)?,
            tokens,
            kv_heads,
            head_dim,
        })
    }

    /// The copy in `slot`, first (re)made when it cannot take `tokens` rows of `kv_heads` x
    /// `head_dim` (rows rounded up to a power of two, so a pass's scratch grows a few times at
    /// most). Prefill only: a CUDA graph never reads a batch copy, so replacing it invalidates
    /// none.
    pub fn batch_kv_in<'s>(
        &self,
        slot: &'s mut Option<BatchKvBf16>,
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<&'s mut BatchKvBf16> {
        if !matches!(slot, Some(c) if c.fits(tokens, kv_heads, head_dim)) {
            // Free the old one before allocating its successor.
            *slot = None;
            let rows = tokens.next_power_of_two();
            *slot = Some(self.batch_kv_bf16(rows, kv_heads, head_dim)?);
        }
        Ok(slot.as_mut().expect("made above"))
    }

    /// Write the batch's k and v rows (`[n, kv_heads * head_dim]` f32) at their positions.
    ///
    /// Launch: grid (n), block 128. Rows whose block-table entry or block is out of range are not
    /// written (the tables are the allocator's; the kernel only refuses to write out of bounds).
    pub fn kv_write(
        &self,
        pool: &mut DeviceKvPool,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        at: &TokenPlacement,
    ) -> Result<()> {
        self.kv_write_with_copy(pool, k, v, at, None)
    }

    /// [`CudaDevice::kv_write`], and with `copy` the same rows rounded to bf16 into its first n
    /// rows (for [`CudaDevice::paged_attention_batch_copy`]).
    pub fn kv_write_with_copy(
        &self,
        pool: &mut DeviceKvPool,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        at: &TokenPlacement,
        copy: Option<&mut BatchKvBf16>,
    ) -> Result<()> {
        let n = at.positions.len();
        let width = pool.kv_heads * pool.head_dim;
        ensure(at.table_start.len() == n, || {
            format!(
                "kv_write: {n} positions but {} table starts",
                at.table_start.len()
            )
        })?;
        ensure(k.len() == n * width && v.len() == n * width, || {
            format!(
                "kv_write: k holds {}, v {}, expected {n} x {width}",
                k.len(),
                v.len()
            )
        })?;
        if n == 0 {
            return Ok(());
        }
        let kp = self.ptr(k, "kv_write k")?;
        let vp = self.ptr(v, "kv_write v")?;
        let pos = self.ptr(at.positions, "kv_write positions")?;
        let ts = self.ptr(at.table_start, "kv_write table_start")?;
        let bt = self.ptr(at.block_tables, "kv_write block_tables")?;
        let (pk, pv) = pool.ptrs_mut(self, "kv_write pool")?;
        let (copy_k, copy_v) = match copy {
            Some(c) => {
                c.check("kv_write", n, pool.kv_heads, pool.head_dim)?;
                let (ck, cv) = c.k_v_mut();
                (
                    self.ptr_mut(ck, "kv_write copy k")?,
                    self.ptr_mut(cv, "kv_write copy v")?,
                )
            }
            None => (0, 0),
        };
        let tables_len = to_i32(at.block_tables.len(), "block_tables length")?;
        let (n_i, width_i) = (to_i32(n, "tokens")?, to_i32(width, "kv row width")?);
        let (bs_i, blocks_i) = (
            to_i32(pool.block_size, "block_size")?,
            to_i32(pool.blocks, "blocks")?,
        );
        let cfg = LaunchConfig {
            grid_dim: (n_i as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let kv_write = &self.kernels.attention[pool.dtype().slot()].kv_write;
        let mut b = self.stream.launch_builder(kv_write);
        b.arg(&kp)
            .arg(&vp)
            .arg(&pos)
            .arg(&ts)
            .arg(&bt)
            .arg(&tables_len);
        b.arg(&pk)
            .arg(&pv)
            .arg(&n_i)
            .arg(&width_i)
            .arg(&bs_i)
            .arg(&blocks_i)
            .arg(&copy_k)
            .arg(&copy_v);
        // SAFETY: k and v hold n rows of `width`; positions and table_start n entries; the kernel
        // bounds every table index by tables_len and every block by `blocks`, so each write lands
        // inside the pool (blocks * block_size rows of `width`); the copy (when given) holds at
        // least n rows of `width` (checked).
        unsafe { b.launch(cfg) }.ctx("kv_write_f32")?;
        Ok(())
    }

    /// Scratch for split-K partials of batches of up to `max_tokens` tokens with `num_heads`
    /// query heads of `head_dim` and contexts up to `max_context`. Larger batches, heads or
    /// contexts still run, with fewer splits.
    pub fn attention_scratch(
        &self,
        max_tokens: usize,
        num_heads: usize,
        head_dim: usize,
        max_context: usize,
    ) -> Result<AttentionScratch> {
        // Splits > 1 only happen when n * kv_heads * head_chunks < B * SMs (B blocks per SM),
        // and then n * splits <= n * ceil(B * SMs / n) < B * SMs + n <= 2 * B * SMs.
        let target = blocks_per_sm() * self.info().multiprocessors as usize;
        let max_splits = max_context.max(1).div_ceil(MIN_SPLIT_KEYS);
        // Ask the driver now, outside any graph capture, how many clusters of this head size's
        // cluster kernels run at once (what the calls plan with).
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
            for k in &self.kernels.attention[dtype.slot()].cluster {
                for group_class in 0..GROUP_CLASSES.len() {
                    let dim_class = class_of(&DIM_CLASSES, head_dim.max(1));
                    self.cluster_slots(k, dim_class, group_class, 1);
                }
            }
        }
        let rows = num_heads.max(1) * (2 * target).min(max_tokens.max(1) * max_splits);
        Ok(AttentionScratch {
            acc: self.zeros(rows * head_dim.max(1))?,
            ml: self.zeros(rows * 2)?,
            // Splits > 1 only when the (token, kv head x head chunk) groups number under
            // `target` (split_plan): one count each.
            arrivals: self.zeros(target)?,
        })
    }

    /// Query heads per block of the tensor-core prefill kernel: 1, 2 or 4 (`None`:
    /// `MOERUN_ATTN_TC_HEADS`, else the default, 2). A group that does not divide by it takes the
    /// widest build that it does. Every choice gives the same bits; this exists to measure them
    /// against each other. Other values are refused.
    pub fn set_tensor_core_attention_heads(&self, heads: Option<usize>) -> Result<()> {
        let h = heads.unwrap_or(0);
        ensure(
            heads.is_none() || TC_VARIANTS.iter().any(|v| v.heads == h),
            || format!("tensor-core attention: {h} heads per block (1, 2 or 4 are built)"),
        )?;
        for k in self.kernels.attention.iter() {
            k.tc_heads.store(h, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Blocks per cluster of the cluster decode kernel: 8 or 16 for every call that runs it
    /// (`None`: `MOERUN_CUDA_CLUSTER_SIZE`, else each call's plan picks). A forced size whose
    /// plan does not fit the batch (its clusters do not all run at once) sends it to the split
    /// kernel. This exists to test and measure the two builds against each other; other values
    /// are refused.
    pub fn set_decode_cluster_size(&self, size: Option<usize>) -> Result<()> {
        let s = size.unwrap_or(0);
        ensure(size.is_none() || CLUSTER_SIZES.contains(&s), || {
            format!("decode attention: clusters of {s} blocks (8 or 16 are built)")
        })?;
        for k in self.kernels.attention.iter() {
            k.cluster_forced.store(s, Ordering::Relaxed);
        }
        Ok(())
    }

    /// `out[n, num_heads * head_dim] = softmax(q · Kᵀ · scale) · V` over each token's visible
    /// keys, with [`AttentionPrefill::ExactF32`] prefill tiles. The pool must already hold the
    /// K/V of every visible position, the tokens' own included (call [`CudaDevice::kv_write`]
    /// first). Enqueues 1 or 2 kernels (prefill tiles, split-K); no allocation, no synchronisation.
    pub fn paged_attention(
        &self,
        q: &impl DevicePtr<f32>,
        pool: &DeviceKvPool,
        at: &TokenPlacement,
        shape: &AttentionShape,
        out: &mut impl DevicePtrMut<f32>,
        scratch: &mut AttentionScratch,
    ) -> Result<()> {
        self.paged_attention_with(AttentionPrefill::ExactF32, q, pool, at, shape, out, scratch)
    }

    /// [`CudaDevice::paged_attention`] with an explicit prefill-tile kernel.
    #[allow(clippy::too_many_arguments)] // the brief's signature plus the one choice it adds
    pub fn paged_attention_with(
        &self,
        prefill: AttentionPrefill,
        q: &impl DevicePtr<f32>,
        pool: &DeviceKvPool,
        at: &TokenPlacement,
        shape: &AttentionShape,
        out: &mut impl DevicePtrMut<f32>,
        scratch: &mut AttentionScratch,
    ) -> Result<()> {
        let source = KeySource {
            prefill,
            copy: None,
            out_bf16: 0,
            fold: None,
        };
        self.attend(source, q, pool, at, shape, out, scratch)
    }

    /// [`CudaDevice::paged_attention`] with [`AttentionPrefill::TensorCoreBf16`] tiles that read
    /// the keys at the batch's own positions from `copy` (its first n rows: this batch's K/V,
    /// written by the prologue or [`CudaDevice::kv_write_with_copy`] after the pool's), bitwise
    /// the same output as without it. `positions` and `table_start` must start 16-byte aligned
    /// (the kernel reads them as int4; device allocations are).
    #[allow(clippy::too_many_arguments)] // paged_attention's arguments plus the copy
    pub fn paged_attention_batch_copy(
        &self,
        q: &impl DevicePtr<f32>,
        pool: &DeviceKvPool,
        copy: &BatchKvBf16,
        at: &TokenPlacement,
        shape: &AttentionShape,
        out: &mut impl DevicePtrMut<f32>,
        scratch: &mut AttentionScratch,
    ) -> Result<()> {
        let source = KeySource {
            prefill: AttentionPrefill::TensorCoreBf16,
            copy: Some(copy),
            out_bf16: 0,
            fold: None,
        };
        self.attend(source, q, pool, at, shape, out, scratch)
    }

    /// [`CudaDevice::paged_attention_batch_copy`] that also writes `out` rounded to bf16 (round
    /// to nearest even, the bits `to_bf16` gives) into `out_bf16`: the input of the o_proj GEMM.
    /// The wgmma tile kernel stores its rows both ways; the other rows (the split kernel's, or
    /// all of them on another tile kernel) are converted after.
    #[allow(clippy::too_many_arguments)] // the batch-copy entry's arguments and the bf16 output
    pub fn paged_attention_batch_copy_with_bf16(
        &self,
        q: &impl DevicePtr<f32>,
        pool: &DeviceKvPool,
        copy: &BatchKvBf16,
        at: &TokenPlacement,
        shape: &AttentionShape,
        out: &mut impl DevicePtrMut<f32>,
        out_bf16: &mut CudaSlice<u16>,
        scratch: &mut AttentionScratch,
    ) -> Result<()> {
        ensure(out_bf16.len() == out.len(), || {
            format!(
                "paged_attention: the bf16 output holds {}, out {}",
                out_bf16.len(),
                out.len()
            )
        })?;
        let source = KeySource {
            prefill: AttentionPrefill::TensorCoreBf16,
            copy: Some(copy),
            out_bf16: self.ptr_mut(out_bf16, "paged_attention bf16 out")?,
            fold: None,
        };
        self.attend(source, q, pool, at, shape, out, scratch)
    }

    #[allow(clippy::too_many_arguments)] // the public entries' arguments, passed through
    pub(super) fn attend(
        &self,
        source: KeySource,
        q: &impl DevicePtr<f32>,
        pool: &DeviceKvPool,
        at: &TokenPlacement,
        shape: &AttentionShape,
        out: &mut impl DevicePtrMut<f32>,
        scratch: &mut AttentionScratch,
    ) -> Result<()> {
        let KeySource {
            prefill,
            copy,
            out_bf16,
            fold,
        } = source;
        let AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim: d,
            scale,
            sliding_window,
        } = *shape;
        ensure(
            num_kv_heads > 0 && num_heads > 0 && num_heads.is_multiple_of(num_kv_heads),
            || format!("paged_attention: {num_heads} heads over {num_kv_heads} kv heads"),
        )?;
        ensure(num_kv_heads == pool.kv_heads && d == pool.head_dim, || {
            format!(
                "paged_attention: shape has {num_kv_heads} kv heads of {d}, the pool {} of {}",
                pool.kv_heads, pool.head_dim
            )
        })?;
        ensure(sliding_window != Some(0), || {
            "paged_attention: a sliding window of 0 sees nothing".to_string()
        })?;
        ensure(scale.is_finite(), || {
            format!("paged_attention: scale {scale}")
        })?;
        let n = at.positions.len();
        ensure(at.table_start.len() == n, || {
            format!(
                "paged_attention: {n} positions but {} table starts",
                at.table_start.len()
            )
        })?;
        // Folded, `q` is the stacked projection: each token's q, k and v heads.
        let q_heads = match fold {
            Some(_) => num_heads + 2 * num_kv_heads,
            None => num_heads,
        };
        ensure(
            q.len() == n * q_heads * d && out.len() == n * num_heads * d,
            || {
                format!(
                    "paged_attention: q holds {}, out {}, expected {n} x {q_heads} x {d} and {n} x \
                     {num_heads} x {d}",
                    q.len(),
                    out.len()
                )
            },
        )?;
        if prefill == AttentionPrefill::TensorCoreBf16 && d != 64 && d != 128 {
            return Err(CudaError::Unsupported(format!(
                "tensor-core attention for head_dim {d} (64 and 128 are built)"
            )));
        }
        ensure(d > 0 && d.is_multiple_of(4) && d <= MAX_HEAD_DIM, || {
            format!("paged_attention: head_dim {d} must be a multiple of 4 in 4..={MAX_HEAD_DIM}")
        })?;
        let kernels = &self.kernels.attention[pool.dtype().slot()];
        let group = num_heads / num_kv_heads;
        // The tiled kernel of this call, its tile height, dynamic shared memory, threads and
        // query heads per block.
        // Some(tma) when the wgmma kernel runs the tiles (it takes the copy's tensor maps too).
        let mut wgmma_tma = None;
        let (tile_func, tile_m, smem, allowed, threads, tile_heads) = match prefill {
            // No tiles for the widest heads: every token takes the split-K kernel.
            _ if d > MAX_TILED_HEAD_DIM => (&kernels.tile_f32[0], TILE_M, 0, 0, TF_THREADS, 1),
            AttentionPrefill::ExactF32 => {
                let c = class_of(&TILE_F32_DIMS, d);
                let smem = tile_f32_smem(d);
                let allowed = kernels.tile_f32_smem[c];
                (&kernels.tile_f32[c], TILE_M, smem, allowed, TF_THREADS, 1)
            }
            AttentionPrefill::TensorCoreBf16 => 'tc: {
                // sm_90, head_dim 128: the wgmma kernel, unless switched off.
                let cc = self.info().compute_capability;
                // Every key the batch's own (a fresh prefill): the TMA build.
                let own_keys = copy.is_some() && at.max_context <= n;
                if let Some(w) = kernels.wgmma.pick(cc, d, group, own_keys) {
                    wgmma_tma = Some(w.tma);
                    break 'tc (w.func, TC_M, w.smem, w.smem, w.threads, w.heads);
                }
                let c = usize::from(d == 128);
                let want = match kernels.tc_heads.load(Ordering::Relaxed) {
                    0 => env_tc_heads().unwrap_or(DEFAULT_TC_HEADS),
                    h => h,
                };
                let granted = [0, 1, 2].map(|v| kernels.tile_bf16_smem[v][c]);
                let vi = pick_tc_variant(want, group, granted, d);
                let v = &TC_VARIANTS[vi];
                let smem = tile_bf16_smem(d, v);
                let func = &kernels.tile_bf16[vi][c];
                (func, TC_M, smem, granted[vi], v.threads, v.heads)
            }
        };
        if smem > allowed {
            return Err(CudaError::Unsupported(format!(
                "{prefill:?} attention for head_dim {d}: this device gives a block too little \
                 shared memory ({smem} bytes needed)"
            )));
        }
        if n == 0 {
            return Ok(());
        }

        let DecodeLayout {
            dim_class,
            group_class,
            head_chunks,
            work,
            split: plan,
            cluster,
        } = self.decode_layout(pool.dtype(), n, shape, at.max_context, scratch);
        let tiled = tiles(d, n, tile_m);
        // The split (and cluster) kernels' blocks start here: the tokens before it are tiled.
        let token0 = if tiled {
            first_untiled(at.seq_starts, n, tile_m)
        } else {
            0
        };
        let g = GROUP_CLASSES[group_class];
        let fold_func = fold
            .map(|_| {
                self.fold_kernel(pool.dtype(), dim_class, group_class, cluster, tiled)
                    .ok_or_else(|| {
                        CudaError::Unsupported(format!(
                            "the attention prologue folded into decode attention for {n} tokens \
                             of {num_heads} heads ({num_kv_heads} kv heads) of {d} over {} keys \
                             (CudaDevice::attention_prologue_folds says which batches fold)",
                            at.max_context
                        ))
                    })
            })
            .transpose()?;
        let (nsplit, chunk) = match cluster {
            Some(c) => (c.clusters * c.size, c.min_keys),
            None => (plan.splits, plan.chunk),
        };

        let qp = self.ptr(q, "paged_attention q")?;
        let op = self.ptr_mut(out, "paged_attention out")?;
        ensure(qp.is_multiple_of(16) && op.is_multiple_of(16), || {
            "paged_attention: q and out must start 16-byte aligned".to_string()
        })?;
        let positions = self.ptr(at.positions, "paged_attention positions")?;
        let table_start = self.ptr(at.table_start, "paged_attention table_start")?;
        let (copy_k, copy_v) = match copy {
            // Only the tensor-core tiles read it: without tiles it is not needed.
            Some(c) if tiled => {
                c.check("paged_attention", n, num_kv_heads, d)?;
                ensure(
                    positions.is_multiple_of(16) && table_start.is_multiple_of(16),
                    || {
                        "paged_attention: positions and table_start must start 16-byte aligned \
                         to read a batch copy"
                            .to_string()
                    },
                )?;
                (
                    self.ptr(&c.k, "paged_attention copy k")?,
                    self.ptr(&c.v, "paged_attention copy v")?,
                )
            }
            _ => (0, 0),
        };
        let (pool_k, pool_v) = pool.ptrs(self, "paged_attention pool")?;
        let args = AttnArgs {
            q: qp,
            out: op,
            pool_k,
            pool_v,
            positions,
            table_start,
            block_tables: self.ptr(at.block_tables, "paged_attention block_tables")?,
            part_acc: self.ptr_mut(&mut scratch.acc, "paged_attention scratch")?,
            part_ml: self.ptr_mut(&mut scratch.ml, "paged_attention scratch")?,
            arrivals: self.ptr_mut(&mut scratch.arrivals, "paged_attention scratch")?,
            copy_k,
            copy_v,
            n: to_i32(n, "tokens")?,
            num_heads: to_i32(num_heads, "num_heads")?,
            kv_heads: to_i32(num_kv_heads, "num_kv_heads")?,
            head_dim: to_i32(d, "head_dim")?,
            group: to_i32(group, "group")?,
            head_chunks: to_i32(head_chunks, "head chunks")?,
            tables_len: to_i32(at.block_tables.len(), "block_tables length")?,
            blocks: to_i32(pool.blocks, "blocks")?,
            block_size: to_i32(pool.block_size, "block_size")?,
            block_shift: if pool.block_size.is_power_of_two() {
                pool.block_size.trailing_zeros() as i32
            } else {
                -1
            },
            window: to_i32(sliding_window.unwrap_or(0), "sliding_window")?,
            chunk: to_i32(chunk, "split chunk")?,
            nsplit: to_i32(nsplit, "splits")?,
            tiled: tiled as i32,
            tile_m: tile_m as i32,
            scale_log2: scale * LOG2_E,
            token0: to_i32(token0, "first split token")?,
            // Only the wgmma tile kernel stores bf16 rows; other rows are converted below.
            out_bf16: if tiled && wgmma_tma.is_some() {
                out_bf16
            } else {
                0
            },
        };
        let grid_yz = |v: usize, what: &str| -> Result<u32> {
            ensure(v <= 65535, || {
                format!("paged_attention: {what} ({v}) exceeds 65535")
            })?;
            Ok(v as u32)
        };
        // The tiled kernel's blocks each take `tile_heads` query heads (a divisor of the group).
        let tile_y = grid_yz(num_heads / tile_heads, "num_heads")?;

        if tiled {
            let cfg = LaunchConfig {
                grid_dim: ((n / tile_m) as u32, tile_y, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // The wgmma kernel's tensor maps of the copy (zeros unless its build loads by TMA).
            let maps = match wgmma_tma {
                Some(tma) if tma > 0 && copy_k != 0 => [
                    FaMap::batch_copy(copy_k, n, num_kv_heads)?,
                    FaMap::batch_copy(copy_v, n, num_kv_heads)?,
                ],
                _ => [FaMap::NONE; 2],
            };
            let mut b = self.stream.launch_builder(tile_func);
            b.arg(&args);
            if wgmma_tma.is_some() {
                b.arg(&maps[0]).arg(&maps[1]);
            }
            // SAFETY: q and out hold n x num_heads x head_dim f32 (16-byte aligned), the pool
            // blocks x block_size rows of kv_heads x head_dim; the kernel bounds every table
            // index and block id; its tiles are whole (n / tile_m of them) and its dynamic shared
            // memory is what this head_dim needs, within the limit set at load. A batch copy
            // holds at least n rows of kv_heads x head_dim (checked), and the kernel reads only
            // rows it has checked to lie in 0..n; positions and table_start are 16-byte aligned
            // for its int4 reads (checked). The wgmma kernel also takes two tensor maps, of the
            // copy's first n rows (it holds at least n, checked) or zeros when its build issues no
            // TMA; its cluster build pairs blocks along y, which num_heads / 2 makes even (the
            // build is picked only for groups divisible by 4).
            unsafe { b.launch(cfg) }.ctx("attention prefill tiles")?;
        }

        if let Some(c) = cluster {
            let cfg = LaunchConfig {
                grid_dim: (
                    (n - token0) as u32,
                    grid_yz(nsplit, "cluster splits")?,
                    grid_yz(num_kv_heads * head_chunks, "kv heads x head chunks")?,
                ),
                block_dim: (CLUSTER_THREADS as u32, 1, 1),
                shared_mem_bytes: cluster_smem(d, g, c.size) as u32,
            };
            // A plan's size is its build's (decode_layout plans with each build's own).
            let build = kernels.cluster_build(c.size).ok_or_else(|| {
                CudaError::InvalidArgument(format!("no build of {}-block clusters", c.size))
            })?;
            let mut b = self
                .stream
                .launch_builder(fold_func.unwrap_or(&build.kernels[dim_class][group_class]));
            b.arg(&args);
            if let Some(p) = &fold {
                b.arg(p);
            }
            if !crate::skip::skipped("attention") && n > token0 {
                // SAFETY: as for the split kernel below; the grid's y extent is a whole number of
                // clusters (the build's compile-time cluster shape, 1 x c.size x 1); with more than
                // one cluster per group the partials of n x num_heads x clusters rows fit the
                // scratch (cluster_plan is bounded by `capacity`) and the work x c.size arrival
                // counts exist (checked when planning); the dynamic shared memory is what this
                // head_dim needs, within the limit set at load (`smem_ok`). A folded prologue's build
                // also takes its PrologueArgs: q holds n rows of the stacked projection
                // (checked above), the norms head_dim values or null, inv_freq `half` (checked by
                // the fold's entry), and the kernel writes only pool slots it bounds as it reads.
                unsafe { b.launch(cfg) }.ctx("attention cluster decode")?;
            }
            debug_assert!(c.clusters == 1 || work * c.size <= scratch.arrivals.len());
            return self.rest_to_bf16(&args, out_bf16, num_heads * d);
        }
        let groups = work;
        ensure(plan.splits == 1 || groups <= scratch.arrivals.len(), || {
            format!(
                "paged_attention: {groups} split groups but {} arrival counts",
                scratch.arrivals.len()
            )
        })?;
        // The block's own merge of its 4 warps, or (the last split block of a group) the
        // splits' weights of its heads, whichever is larger.
        let smem = (4 * g * (d + 2)).max(g * plan.splits) * 4;
        let split_cfg = LaunchConfig {
            grid_dim: (
                (n - token0) as u32,
                grid_yz(plan.splits, "splits")?,
                grid_yz(num_kv_heads * head_chunks, "kv heads x head chunks")?,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let func = &kernels.split[dim_class][group_class];
        let mut b = self.stream.launch_builder(func);
        b.arg(&args);
        // SAFETY: as above; with more than one split the partials of n x num_heads x splits rows
        // fit the scratch (`capacity` bounds the plan) and each group has an arrival count
        // (checked above); the dynamic shared memory holds 4 warps' states of up to 8 heads
        // (<= 33 KiB for head_dim 256) or the merge's weights (8 x splits floats, splits <= 4 x
        // SMs: <= 17 KiB).
        if n > token0 {
            unsafe { b.launch(split_cfg) }.ctx("attention split-K")?;
        }
        self.rest_to_bf16(&args, out_bf16, num_heads * d)
    }

    /// The rows of `out_bf16` (0: none wanted) the tile kernel did not store: from the split
    /// kernel's first token when the wgmma tile kernel stored its rows (`args.out_bf16`), else
    /// all of them, converted from `args.out` (rows of `width`).
    fn rest_to_bf16(&self, args: &AttnArgs, out_bf16: u64, width: usize) -> Result<()> {
        if out_bf16 == 0 {
            return Ok(());
        }
        let from = if args.out_bf16 != 0 {
            args.token0 as usize * width
        } else {
            0
        };
        let n = args.n as usize * width;
        // SAFETY: out holds n x width f32 and out_bf16 as many u16 (checked by the entry); from
        // <= n.
        unsafe {
            self.to_bf16_at(
                args.out + 4 * from as u64,
                out_bf16 + 2 * from as u64,
                n - from,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_grid_starts_at_the_first_token_no_tile_owns() {
        // Not given: every token.
        assert_eq!(first_untiled(&[], 4096, 64), 0);
        // One sequence: all whole tiles, then the tail.
        assert_eq!(first_untiled(&[0], 4096, 64), 4096);
        assert_eq!(first_untiled(&[0], 4100, 64), 4096);
        assert_eq!(first_untiled(&[0], 63, 64), 0);
        // A second sequence starting inside the third tile: from that tile on.
        assert_eq!(first_untiled(&[0, 150], 300, 64), 128);
        // ... or exactly on a tile boundary: its tiles are whole too.
        assert_eq!(first_untiled(&[0, 128], 256, 64), 256);
        // Decode (one token per sequence).
        let each: Vec<usize> = (0..128).collect();
        assert_eq!(first_untiled(&each, 128, 64), 0);
    }

    #[test]
    fn split_plan_fills_the_device_and_covers_the_context() {
        let sms = 132;
        for work in [1usize, 4, 8, 32, 128, 512, 4096] {
            for context in [1usize, 15, 64, 512, 1000, 4096, 100_000] {
                let plan = split_plan(work, context, sms, usize::MAX);
                assert!(plan.splits >= 1 && plan.chunk >= 16, "{plan:?}");
                assert!(
                    plan.splits * plan.chunk >= context,
                    "{work} {context}: {plan:?}"
                );
                assert!(
                    (plan.splits - 1) * plan.chunk < context,
                    "no empty split: {plan:?}"
                );
                if plan.splits > 1 {
                    assert!(plan.chunk >= MIN_SPLIT_KEYS / 2, "{plan:?}");
                    assert!(work * plan.splits < 2 * blocks_per_sm() * sms, "{plan:?}");
                }
            }
        }
        // 4 blocks of work want 8 * 132 / 4 = 264 splits, at most 4096 / 16 = 256 (chunks of
        // 16 keys).
        assert_eq!(split_plan(4, 4096, sms, usize::MAX).splits, 256);
        // 64 want 17 (8 sequences of Qwen3-30B-A3B's 4 kv heads in 2 head chunks): 32 keys each.
        assert_eq!(split_plan(64, 544, sms, usize::MAX).splits, 17);
        assert_eq!(split_plan(4096, 4096, sms, usize::MAX).splits, 1);
    }

    #[test]
    fn cluster_plan_covers_small_batches_and_leaves_long_contexts_to_the_split_kernel() {
        assert_eq!(cluster_keys_per_step(16), 256);
        assert_eq!(cluster_keys_per_step(128), 32);
        assert_eq!(cluster_keys_per_step(256), 16);
        assert_eq!(cluster_keys_per_step(512), 8);
        // Batch 1 of Qwen3-30B-A3B (4 kv heads, head_dim 128), 16 clusters at once.
        let plan = |context| cluster_plan(8, 4, context, 16, usize::MAX, 32).map(|p| p.clusters);
        assert_eq!(plan(1), Some(1));
        assert_eq!(plan(512), Some(1), "one cluster: no global merge");
        assert_eq!(
            plan(1024),
            Some(1),
            "4 steps per block before a second cluster"
        );
        assert_eq!(plan(1025), Some(2));
        assert_eq!(plan(2048), Some(2));
        assert_eq!(plan(8192), Some(4), "256 keys, 8 steps per block");
        assert_eq!(plan(8193), None);
        assert_eq!(
            cluster_plan(8, 4, 512, 16, usize::MAX, 32)
                .unwrap()
                .min_keys,
            128
        );
        // Groups that do not all run at once, or a scratch for one cluster only.
        assert_eq!(cluster_plan(8, 17, 512, 16, usize::MAX, 32), None);
        assert_eq!(cluster_plan(8, 0, 512, 16, usize::MAX, 32), None);
        assert_eq!(
            cluster_plan(8, 4, 2048, 16, 1, 32).map(|p| p.clusters),
            Some(1)
        );
        assert_eq!(cluster_plan(8, 4, 4096, 16, 1, 32), None);
        for work in 1..=16 {
            for context in [1usize, 100, 1000, 5000, 100_000] {
                if let Some(p) = cluster_plan(8, work, context, 16, usize::MAX, 32) {
                    assert!(p.clusters >= 1 && p.clusters <= MAX_CLUSTERS, "{p:?}");
                    assert!(work * p.clusters <= 16, "one wave: {work} {context} {p:?}");
                }
            }
        }
        for size in CLUSTER_SIZES {
            assert!(cluster_smem(256, 8, size) <= 227 << 10, "{size}");
            assert!(cluster_smem(128, 8, size) <= 48 << 10, "{size}");
        }
    }

    #[test]
    fn sixteen_block_clusters_run_where_one_covers_what_eight_take_in_several_or_three_steps() {
        // Batch 1 of Qwen3-30B-A3B (8 groups of 4 heads of 128: 32 keys a step); slots as on
        // the H200 (two blocks an SM: 33 clusters of 8, 16 of 16).
        let pick = |context: usize, forced: Option<usize>| {
            let eight = cluster_plan(8, 8, context, 33, usize::MAX, 32);
            let sixteen = cluster_plan(16, 8, context, 16, usize::MAX, 32);
            choose_cluster(eight, sixteen, context, 32, forced).map(|p| (p.size, p.clusters))
        };
        assert_eq!(pick(256, None), Some((8, 1)), "one step either way");
        assert_eq!(pick(512, None), Some((8, 1)), "two steps against one");
        assert_eq!(pick(600, None), Some((16, 1)), "three steps against two");
        assert_eq!(pick(1024, None), Some((16, 1)), "four steps against two");
        assert_eq!(
            pick(2048, None),
            Some((16, 1)),
            "two clusters of 8 against one"
        );
        assert_eq!(pick(4096, None), Some((8, 4)), "both merge globally");
        // Forced sizes take their own plan, even the worse one.
        assert_eq!(pick(256, Some(16)), Some((16, 1)));
        assert_eq!(pick(2048, Some(8)), Some((8, 2)));
        // No plan of 16 (a device without the build): eight's.
        assert_eq!(
            choose_cluster(
                cluster_plan(8, 8, 1024, 33, usize::MAX, 32),
                None,
                1024,
                32,
                None
            )
            .map(|p| p.size),
            Some(8)
        );
        let steps = |p: Option<ClusterPlan>, context| p.unwrap().steps(context, 32);
        assert_eq!(steps(cluster_plan(8, 8, 768, 33, usize::MAX, 32), 768), 3);
        assert_eq!(steps(cluster_plan(16, 8, 768, 16, usize::MAX, 32), 768), 2);
    }

    #[test]
    fn tensor_core_variants_divide_the_group_and_fit_what_was_granted() {
        let all = [usize::MAX; 3];
        assert_eq!(pick_tc_variant(4, 8, all, 128), 2);
        assert_eq!(pick_tc_variant(2, 8, all, 128), 1);
        assert_eq!(pick_tc_variant(1, 8, all, 128), 0);
        assert_eq!(
            pick_tc_variant(4, 2, all, 128),
            1,
            "a group of 2 takes 2 heads"
        );
        assert_eq!(pick_tc_variant(4, 6, all, 64), 1);
        assert_eq!(pick_tc_variant(4, 1, all, 128), 0);
        assert_eq!(pick_tc_variant(4, 3, all, 128), 0);
        // A device that refused the 4-head kernel its shared memory.
        let small = [usize::MAX, usize::MAX, 48 << 10];
        assert_eq!(pick_tc_variant(4, 8, small, 128), 1);
    }

    #[test]
    fn split_plan_never_exceeds_the_scratch() {
        for capacity in [0usize, 1, 3, 7] {
            let plan = split_plan(1, 4096, 132, capacity);
            assert!(plan.splits <= capacity.max(1), "{capacity}: {plan:?}");
        }
    }

    #[test]
    fn classes_pick_the_smallest_that_fits() {
        assert_eq!(class_of(&DIM_CLASSES, 16), 0);
        assert_eq!(class_of(&DIM_CLASSES, 24), 1);
        assert_eq!(class_of(&DIM_CLASSES, 48), 2);
        assert_eq!(class_of(&DIM_CLASSES, 128), 3);
        assert_eq!(class_of(&DIM_CLASSES, 256), 4);
        assert_eq!(class_of(&GROUP_CLASSES, 6), 3);
        assert_eq!(class_of(&GROUP_CLASSES, 3), 2);
        assert_eq!(class_of(&GROUP_CLASSES, 16), 3);
        assert!(tile_f32_smem(256) <= 227 << 10, "fits an H100/H200 block");
        // Two tensor-core blocks per SM: 228 KiB per SM, 1 KiB of it reserved per block.
        for (v, blocks) in TC_VARIANTS.iter().zip([2, 2, 1]) {
            assert!(
                blocks * (tile_bf16_smem(128, v) + 1024) <= 228 << 10,
                "{blocks} blocks of {v:?} per H100/H200 SM"
            );
        }
        assert!(AttentionPrefill::TensorCoreBf16.takes_batch_copy(64, 128));
        assert!(!AttentionPrefill::TensorCoreBf16.takes_batch_copy(63, 128));
        assert!(!AttentionPrefill::TensorCoreBf16.takes_batch_copy(4096, 256));
        assert!(!AttentionPrefill::ExactF32.takes_batch_copy(4096, 128));
    }
}
