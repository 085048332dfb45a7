//! The routed experts of a MoE layer on the device: `out[t] = Σ_{r<k} weights[t, r] ·
//! expert_{ids[t, r]}(x[t])`, each expert `down(act(gate(x)) * up(x))` (act SiLU or GELU-tanh, [ExpertActivation]), the k terms summed in
//! router rank order as moerun-model's `ffn_block` does. Routing ([`CudaDevice::route_topk`])
//! comes before: this op starts from its `ids [n, k]` and `weights [n, k]`.
//!
//! A layer's experts live stacked in one [`DeviceExperts`] (gate_up `[E][2I][H]`, down
//! `[E][H][I]`, stored dtype). Each call groups the batch's (token, rank) pairs by expert on the
//! device, so that each expert's weights are read once for all of its tokens, then runs one of two
//! paths ([`MoePath::for_batch`] picks unless [`MoeScratch::set_path`] forces one):
//!
//! - [`MoePath::Decode`] (≤ [`MoePath::DECODE_MAX_TOKENS`] tokens, or weights other than bf16):
//!   three launches on the CUDA cores with f32 activations, no host synchronisation and no
//!   allocation, so a decode step can be captured in a CUDA graph. Batch invariant, bit for bit
//!   (see `decode`).
//! - [`MoePath::Prefill`] (bf16 weights, more tokens): tensor cores. On sm_90
//!   ([`CudaDevice::has_wgmma`]) our own wgmma grouped GEMMs (`wgmma`, `kernels/moe_wgmma.cu`):
//!   the gather of x rows and the activation are folded into the GEMMs, the tile schedule comes
//!   from the device offsets, and nothing waits for the device. It rounds x, `act(g) · u` and the
//!   expert outputs to bf16 (2⁻⁹ relative each): ~3e-3 from the f32 result, against 1e-7 for the
//!   decode path. Elsewhere it is [`MoePath::PrefillCublas`].
//! - [`MoePath::PrefillCublas`]: one cuBLAS grouped GEMM per projection (see `prefill`). It waits
//!   for the device once per call, to learn each expert's token count, and also rounds the gate/up
//!   outputs to bf16. [`MoePath::PrefillPerExpert`] is the same with one GEMM call per expert,
//!   kept to measure what grouping buys.
//!
//! All scratch (pair lists, intermediates, arrival counters) is allocated once by
//! [`CudaDevice::moe_scratch`] for a largest batch and passed to every call.

mod decode;
mod prefill;
mod wgmma;

pub use wgmma::WgmmaTile;

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut};
use moerun_core::{DType, MatRef};

use crate::device::dtype_slot;
use crate::error::{ensure, CudaError, DriverContext, Result};
use crate::CudaDevice;

/// Experts one layer may have: the alignment kernel keeps two counters per expert in 16 KiB of
/// shared memory, and the slot count is a grid dimension.
pub const MAX_EXPERTS: usize = 2048;

/// Down-projection rows per block of the decode kernel (`MOE_DOWN_TILE` in `kernels/moe.cu`): each
/// token has one arrival counter per such tile of its output.
const DOWN_TILE: usize = 32;

/// Intermediate indices per block of the decode gate_up kernel (one per warp).
const GATE_UP_TILE: usize = 8;

/// Down rows per block of the tiny decode down kernel (`MOE_DOWN_ROWS`).
const TINY_DOWN_ROWS: usize = 4;

/// Intermediate indices per block of the tiny decode gate_up kernel (8 warps x `MOE_TINY_JW`).
const TINY_GATE_UP_TILE: usize = 16;

/// Handles of `kernels/moe.cu` and `kernels/moe_prefill.cu`.
pub(crate) struct MoeKernels {
    align: CudaFunction,
    /// `[dtype_slot][pass]`, passes of at most [`DecodePass::tokens`] tokens.
    gate_up: [[CudaFunction; 3]; 3],
    down: [[CudaFunction; 3]; 3],
    /// `[dtype_slot]`, for [`DecodePass::Tiny`].
    tiny_gate_up: [CudaFunction; 3],
    tiny_down: [CudaFunction; 3],
    /// `moe_tiny_gate_up_norm_<dt>` and `moe_tiny_down_late_<dt>`: behind the route ahead.
    tiny_gate_up_norm: [CudaFunction; 3],
    tiny_down_late: [CudaFunction; 3],
    gather_bf16: CudaFunction,
    silu_mul_bf16: CudaFunction,
    combine_bf16: CudaFunction,
    wgmma: wgmma::WgmmaKernels,
}

impl MoeKernels {
    /// Load every entry point; `get(file, function)` looks one up in a compiled kernel file.
    pub(crate) fn load(get: impl Fn(&str, &str) -> Result<CudaFunction>) -> Result<Self> {
        let variants = |kind: &str| -> Result<[[CudaFunction; 3]; 3]> {
            let dt = |d: &str| -> Result<[CudaFunction; 3]> {
                Ok([
                    get("moe", &format!("moe_{kind}_{d}_m1"))?,
                    get("moe", &format!("moe_{kind}_{d}_m4"))?,
                    get("moe", &format!("moe_{kind}_{d}_m8"))?,
                ])
            };
            // Indexed by dtype_slot: bf16, f16, f32.
            Ok([dt("bf16")?, dt("f16")?, dt("f32")?])
        };
        Ok(MoeKernels {
            align: get("moe", "moe_align")?,
            gate_up: variants("gate_up")?,
            down: variants("down")?,
            tiny_gate_up: [
                get("moe", "moe_tiny_gate_up_bf16")?,
                get("moe", "moe_tiny_gate_up_f16")?,
                get("moe", "moe_tiny_gate_up_f32")?,
            ],
            tiny_down: [
                get("moe", "moe_tiny_down_bf16")?,
                get("moe", "moe_tiny_down_f16")?,
                get("moe", "moe_tiny_down_f32")?,
            ],
            tiny_gate_up_norm: [
                get("moe", "moe_tiny_gate_up_norm_bf16")?,
                get("moe", "moe_tiny_gate_up_norm_f16")?,
                get("moe", "moe_tiny_gate_up_norm_f32")?,
            ],
            tiny_down_late: [
                get("moe", "moe_tiny_down_late_bf16")?,
                get("moe", "moe_tiny_down_late_f16")?,
                get("moe", "moe_tiny_down_late_f32")?,
            ],
            gather_bf16: get("moe_prefill", "moe_gather_bf16")?,
            silu_mul_bf16: get("moe_prefill", "moe_silu_mul_bf16")?,
            combine_bf16: get("moe_prefill", "moe_combine_bf16")?,
            wgmma: wgmma::WgmmaKernels::load(&get)?,
        })
    }
}

/// How [`CudaDevice::moe_experts`] computes a call (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoePath {
    /// CUDA cores, f32 activations, graph-capturable; any weight dtype.
    Decode,
    /// Tensor cores, bf16 activations; bf16 weights only: our wgmma grouped GEMMs where the
    /// device has them ([`CudaDevice::has_wgmma`], no host wait), else [`MoePath::PrefillCublas`].
    Prefill,
    /// cuBLAS grouped GEMMs (one wait for the device per call); any tensor-core GPU.
    PrefillCublas,
    /// As [`MoePath::PrefillCublas`], one cuBLAS call per expert with tokens (for comparison).
    PrefillPerExpert,
}

impl MoePath {
    /// Batches up to this many tokens take the decode path. Measured on Qwen3-30B-A3B's layer
    /// (docs/perf/cuda-ops.md): at 32 tokens decode and prefill take the same time (~0.37 ms, both
    /// reading nearly every expert), at 128 prefill is 2.5x faster, as each expert's ~8 tokens
    /// make the decode kernels' f32 FMAs outgrow the bandwidth.
    pub const DECODE_MAX_TOKENS: usize = 32;

    /// The path for a batch of `tokens` over experts stored as `dtype`: decode up to
    /// [`MoePath::DECODE_MAX_TOKENS`] tokens or for non-bf16 weights, else prefill.
    pub fn for_batch(tokens: usize, dtype: DType) -> MoePath {
        if dtype == DType::BF16 && tokens > Self::DECODE_MAX_TOKENS {
            MoePath::Prefill
        } else {
            MoePath::Decode
        }
    }
}

/// How the decode kernels walk an expert's tokens. In the aligned variants (`One`, `Four`,
/// `Eight`) a pass takes up to that many of an expert's tokens: each pass streams the expert's
/// weights again (from L2 when they were just read), and larger passes need more registers, so
/// fewer warps fit on a multiprocessor. All give the same results, bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePass {
    /// At most [`DecodePass::TINY_PAIRS`] pairs: two launches and no alignment step; the down
    /// projection runs per token with all its k ranks in one block, so the rank-order sum needs
    /// no arrival counters (an expert two tokens share is read once per token).
    Tiny,
    /// One token per pass: 62-72 registers, 4 blocks of 256 threads per SM.
    One,
    /// Up to 4 tokens: 112-127 registers, 2 blocks per SM.
    Four,
    /// Up to 8 tokens: ~165 registers, 1 block per SM.
    Eight,
}

impl DecodePass {
    /// Most (token, rank) pairs [`DecodePass::Tiny`] takes: one per lane of a warp.
    pub const TINY_PAIRS: usize = 32;

    /// Most tokens one pass takes.
    pub fn tokens(self) -> usize {
        match self {
            DecodePass::Tiny | DecodePass::One => 1,
            DecodePass::Four => 4,
            DecodePass::Eight => 8,
        }
    }

    /// The pass for `pairs` (token, rank) pairs over `experts` experts: `Tiny` up to
    /// [`DecodePass::TINY_PAIRS`], then by the mean pairs per expert that has any: `One` while
    /// it is at most 1, else `Four`. `Eight` lost to `Four` on every batch measured (its 165
    /// registers leave one block per multiprocessor); it stays for comparison.
    pub fn for_pairs(pairs: usize, experts: usize) -> DecodePass {
        if pairs <= Self::TINY_PAIRS {
            DecodePass::Tiny
        } else if pairs <= experts {
            DecodePass::One
        } else {
            DecodePass::Four
        }
    }

    fn slot(self) -> usize {
        match self {
            DecodePass::Tiny | DecodePass::One => 0,
            DecodePass::Four => 1,
            DecodePass::Eight => 2,
        }
    }
}

/// The activation of an expert's gate: `down(act(gate · x) * (up · x))`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertActivation {
    /// `x / (1 + exp(-x))` (SwiGLU experts: Mixtral, Qwen, OLMoE, ...).
    #[default]
    Silu,
    /// GELU with the tanh approximation (Gemma 4's experts).
    GeluTanh,
}

impl ExpertActivation {
    /// The kernels' `act` argument (`expert_act` in kernels/common.cuh).
    pub(crate) fn code(self) -> i32 {
        match self {
            ExpertActivation::Silu => 0,
            ExpertActivation::GeluTanh => 1,
        }
    }
}

/// One layer's routed experts resident on the device, stacked: gate_up `[E][2I][H]` (per expert
/// its I gate rows then its I up rows) and down `[E][H][I]`, in the stored dtype (bf16/f16/f32).
pub struct DeviceExperts {
    activation: ExpertActivation,
    dtype: DType,
    experts: usize,
    hidden: usize,
    intermediate: usize,
    gate_up: CudaSlice<u8>,
    down: CudaSlice<u8>,
}

impl DeviceExperts {
    /// The same experts with gate activation `activation` (SiLU unless set).
    pub fn with_activation(mut self, activation: ExpertActivation) -> DeviceExperts {
        self.activation = activation;
        self
    }
    pub fn activation(&self) -> ExpertActivation {
        self.activation
    }
    pub fn experts(&self) -> usize {
        self.experts
    }
    pub fn hidden(&self) -> usize {
        self.hidden
    }
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Bytes on the device (both stacks).
    pub fn bytes(&self) -> usize {
        self.gate_up.len() + self.down.len()
    }
    /// Bytes of one expert's three matrices: what decode reads per expert a batch routes to (a
    /// token of top-k reads k times this; for roofline figures).
    pub fn bytes_per_expert(&self) -> usize {
        3 * self.hidden * self.intermediate * self.dtype.size()
    }
}

/// Check a layer's shape: the kernels read 16-byte chunks of weight rows, so rows of H and of I
/// elements must be whole chunks.
fn check_layout(dtype: DType, experts: usize, hidden: usize, intermediate: usize) -> Result<()> {
    ensure((1..=MAX_EXPERTS).contains(&experts), || {
        format!("experts: {experts} experts, supported 1..={MAX_EXPERTS}")
    })?;
    let chunk = 16 / dtype.size();
    ensure(
        hidden > 0
            && intermediate > 0
            && hidden.is_multiple_of(chunk)
            && intermediate.is_multiple_of(chunk),
        || {
            format!(
                "experts: hidden {hidden} and intermediate {intermediate} must be positive \
                 multiples of {chunk} for {dtype} weights"
            )
        },
    )
}

/// Buffers of [`CudaDevice::moe_experts`], sized for up to `max_tokens` tokens of `top_k` pairs
/// each (P = max_tokens · top_k pairs) for one layer shape.
pub struct MoeScratch {
    experts: usize,
    hidden: usize,
    intermediate: usize,
    max_tokens: usize,
    top_k: usize,
    path: Option<MoePath>,
    pass: Option<DecodePass>,
    wgmma_tile: WgmmaTile,
    /// `[E + 2]`: start of each group's pairs (group E: out-of-range ids), then the total.
    offsets: CudaSlice<u32>,
    /// `[P]`: pair indices `t * k + r` in group order.
    pairs: CudaSlice<u32>,
    /// `[P]`: each pair's place in `pairs`.
    pos: CudaSlice<u32>,
    /// `[min(E + 1, P)]`: the non-empty groups, ascending, then `u32::MAX`.
    active: CudaSlice<u32>,
    /// `[max_tokens][ceil(H / 32)]`: the decode down kernel's arrivals per token and row tile.
    arrivals: CudaSlice<u32>,
    /// `P · I · 4` bytes: decode `silu(gate) · up` f32 `[P][I]`; prefill gate_up out bf16 `[P][2I]`.
    inner: CudaSlice<u8>,
    /// `P · H · 4` bytes: decode expert outputs f32 `[P][H]`; prefill the gathered bf16
    /// activations `[P][H]`, then the bf16 expert outputs `[P][H]`.
    outer: CudaSlice<u8>,
    /// `[6 · E]`: the prefill GEMMs' A, B, C pointer arrays (cuBLAS reads them on the device).
    gemm_ptrs: CudaSlice<u64>,
}

impl MoeScratch {
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }
    pub fn top_k(&self) -> usize {
        self.top_k
    }
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        4 * (self.offsets.len()
            + self.pairs.len()
            + self.pos.len()
            + self.active.len()
            + self.arrivals.len())
            + self.inner.len()
            + self.outer.len()
            + 8 * self.gemm_ptrs.len()
    }
    /// Take `path` for every call (tests, benchmarks), or `None` for [`MoePath::for_batch`]. A
    /// forced path that cannot run a call (prefill with f32 weights) fails it; it never falls
    /// back.
    pub fn set_path(&mut self, path: Option<MoePath>) {
        self.path = path;
    }
    /// The tile variant of the wgmma prefill GEMMs (benchmarks compare them; default N256, or
    /// `MOERUN_CUDA_MOE_TILE`).
    pub fn set_wgmma_tile(&mut self, tile: WgmmaTile) {
        self.wgmma_tile = tile;
    }
    /// Run the decode kernels in passes of `pass`, or `None` for [`DecodePass::for_pairs`]
    /// (benchmarks compare them; results are the same bit for bit).
    pub fn set_decode_pass(&mut self, pass: Option<DecodePass>) {
        self.pass = pass;
    }
}

/// One call's activations and routing as device addresses, checked against each other.
struct MoeCall {
    tokens: usize,
    top_k: usize,
    x: u64,
    /// x rounded to bf16 by whoever wrote x (0: none; the wgmma path then converts it itself).
    x_bf16: u64,
    ids: u64,
    weights: u64,
    out: u64,
}

impl CudaDevice {
    /// Upload a layer's experts: `(gate [I,H], up [I,H], down [H,I])` per expert, same dtype.
    pub fn upload_experts(
        &self,
        experts: &[(MatRef<'_>, MatRef<'_>, MatRef<'_>)],
    ) -> Result<DeviceExperts> {
        let Some((first, _, _)) = experts.first() else {
            return Err(CudaError::InvalidArgument(
                "upload_experts: no experts".into(),
            ));
        };
        let (dtype, inter, hidden) = (first.dtype, first.rows, first.cols);
        check_layout(dtype, experts.len(), hidden, inter)?;
        for (e, (gate, up, down)) in experts.iter().enumerate() {
            for (name, m, rows, cols) in [
                ("gate", gate, inter, hidden),
                ("up", up, inter, hidden),
                ("down", down, hidden, inter),
            ] {
                ensure(
                    m.dtype == dtype
                        && (m.rows, m.cols) == (rows, cols)
                        && m.data.len() == rows * cols * dtype.size(),
                    || {
                        format!(
                            "upload_experts: expert {e} {name} is [{}, {}] of {} in {} bytes, \
                             expected [{rows}, {cols}] of {dtype}",
                            m.rows,
                            m.cols,
                            m.dtype,
                            m.data.len()
                        )
                    },
                )?;
            }
        }
        let mat = inter * hidden * dtype.size();
        let count = experts.len();
        // SAFETY: uninitialised device memory, every byte of which the copies below write before
        // any kernel can read it (they precede every launch on the stream).
        let mut gate_up = unsafe { self.stream.alloc::<u8>(2 * count * mat) }.ctx("allocating")?;
        let mut down = unsafe { self.stream.alloc::<u8>(count * mat) }.ctx("allocating")?;
        for (e, (g, u, d)) in experts.iter().enumerate() {
            let at = 2 * e * mat;
            let copy = |what| format!("uploading expert {e} {what}");
            self.stream
                .memcpy_htod(g.data, &mut gate_up.slice_mut(at..at + mat))
                .ctx(&copy("gate"))?;
            self.stream
                .memcpy_htod(u.data, &mut gate_up.slice_mut(at + mat..at + 2 * mat))
                .ctx(&copy("up"))?;
            self.stream
                .memcpy_htod(d.data, &mut down.slice_mut(e * mat..(e + 1) * mat))
                .ctx(&copy("down"))?;
        }
        Ok(DeviceExperts {
            activation: ExpertActivation::Silu,
            dtype,
            experts: count,
            hidden,
            intermediate: inter,
            gate_up,
            down,
        })
    }

    /// Stacked buffers filled by the caller (e.g. device-side random values for benchmarks of
    /// models too large to upload): checks their sizes and stream.
    pub fn experts_from_parts(
        &self,
        dtype: DType,
        experts: usize,
        hidden: usize,
        intermediate: usize,
        gate_up: CudaSlice<u8>,
        down: CudaSlice<u8>,
    ) -> Result<DeviceExperts> {
        check_layout(dtype, experts, hidden, intermediate)?;
        let mat = hidden * intermediate * dtype.size();
        ensure(
            gate_up.len() == 2 * experts * mat && down.len() == experts * mat,
            || {
                format!(
                    "experts_from_parts: {experts} experts of H {hidden}, I {intermediate} in \
                     {dtype} need {} + {} bytes, got {} + {}",
                    2 * experts * mat,
                    experts * mat,
                    gate_up.len(),
                    down.len()
                )
            },
        )?;
        self.ptr(&gate_up, "experts_from_parts gate_up")?;
        self.ptr(&down, "experts_from_parts down")?;
        Ok(DeviceExperts {
            activation: ExpertActivation::Silu,
            dtype,
            experts,
            hidden,
            intermediate,
            gate_up,
            down,
        })
    }

    /// Scratch for up to `max_tokens` tokens routed to `top_k` experts each, for layers shaped
    /// like `experts`: about `max_tokens · top_k · (H + I) · 4` bytes (370 MB for 4096 tokens of
    /// Qwen3-30B-A3B).
    pub fn moe_scratch(
        &self,
        experts: &DeviceExperts,
        max_tokens: usize,
        top_k: usize,
    ) -> Result<MoeScratch> {
        let (e, h, i) = (experts.experts, experts.hidden, experts.intermediate);
        ensure(max_tokens > 0 && (1..=e).contains(&top_k), || {
            format!("moe_scratch: {max_tokens} tokens of top-{top_k} over {e} experts")
        })?;
        let pairs = max_tokens
            .checked_mul(top_k)
            .filter(|&p| p <= i32::MAX as usize)
            .ok_or_else(|| {
                CudaError::InvalidArgument(format!(
                    "moe_scratch: {max_tokens} x {top_k} pairs exceed i32"
                ))
            })?;
        let tiles = h.div_ceil(DOWN_TILE);
        let u8s = |n: usize| -> Result<CudaSlice<u8>> {
            // SAFETY: intermediates; every kernel writes the elements it later reads (see the
            // field docs and the kernel files).
            unsafe { self.stream.alloc::<u8>(n) }.ctx("allocating MoE scratch")
        };
        Ok(MoeScratch {
            experts: e,
            hidden: h,
            intermediate: i,
            max_tokens,
            top_k,
            path: None,
            pass: None,
            wgmma_tile: WgmmaTile::from_env(),
            offsets: self.zeros(e + 2)?,
            pairs: self.zeros(pairs)?,
            pos: self.zeros(pairs)?,
            active: self.zeros((e + 1).min(pairs))?,
            arrivals: self.zeros(max_tokens * tiles)?,
            inner: u8s(pairs * i * 4)?,
            outer: u8s(pairs * h * 4)?,
            gemm_ptrs: self.zeros(6 * e)?,
        })
    }

    /// The path [`CudaDevice::moe_experts`] takes for `tokens` tokens with this scratch.
    pub fn moe_path(
        &self,
        tokens: usize,
        experts: &DeviceExperts,
        scratch: &MoeScratch,
    ) -> MoePath {
        scratch
            .path
            .unwrap_or_else(|| MoePath::for_batch(tokens, experts.dtype))
    }

    /// `out[t] = Σ_{r=0..k} weights[t,r] · expert_{ids[t,r]}(x[t])`, summed in rank order
    /// (out is overwritten, not accumulated). x, out: [n, H] f32; ids, weights: [n, k].
    ///
    /// An id `>= E` is a caller bug: the decode and wgmma prefill paths make that token's output
    /// NaN (such pairs are never computed), the cuBLAS prefill paths fail with
    /// [`CudaError::InvalidArgument`]. The decode and wgmma paths only enqueue work; the cuBLAS
    /// paths wait for the device once (see the module doc).
    #[allow(clippy::too_many_arguments)] // the API the model is wired against (7 + self)
    pub fn moe_experts(
        &self,
        x: &impl DevicePtr<f32>,
        ids: &impl DevicePtr<u32>,
        weights: &impl DevicePtr<f32>,
        top_k: usize,
        experts: &DeviceExperts,
        scratch: &mut MoeScratch,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.moe_experts_with_bf16_x(x, None, ids, weights, top_k, experts, scratch, out)
    }

    /// [`CudaDevice::moe_experts`] given also, when the caller has it, x rounded to bf16 (round
    /// to nearest even, as `to_bf16` rounds it), which the wgmma prefill path then gathers from
    /// instead of converting x itself: the same bits, one launch and a pass over x fewer.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_experts_with_bf16_x(
        &self,
        x: &impl DevicePtr<f32>,
        x_bf16: Option<&CudaSlice<u16>>,
        ids: &impl DevicePtr<u32>,
        weights: &impl DevicePtr<f32>,
        top_k: usize,
        experts: &DeviceExperts,
        scratch: &mut MoeScratch,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let x_bf16 = match x_bf16 {
            None => 0,
            Some(xb) => {
                ensure(xb.len() == x.len(), || {
                    format!(
                        "moe_experts: the bf16 copy of x holds {}, x {}",
                        xb.len(),
                        x.len()
                    )
                })?;
                let p = self.ptr(xb, "moe_experts x bf16")?;
                ensure(p.is_multiple_of(16), || {
                    "moe_experts: the bf16 copy of x must start 16-byte aligned".to_string()
                })?;
                p
            }
        };
        let (e, h, i) = (experts.experts, experts.hidden, experts.intermediate);
        ensure(
            (scratch.experts, scratch.hidden, scratch.intermediate) == (e, h, i),
            || {
                format!(
                    "moe_experts: scratch made for {} experts of H {}, I {}; these are {e} of \
                     H {h}, I {i}",
                    scratch.experts, scratch.hidden, scratch.intermediate
                )
            },
        )?;
        ensure((1..=scratch.top_k).contains(&top_k), || {
            format!(
                "moe_experts: top_k {top_k}, the scratch holds 1..={}",
                scratch.top_k
            )
        })?;
        ensure(x.len().is_multiple_of(h), || {
            format!("moe_experts: x holds {}, not rows of {h}", x.len())
        })?;
        let n = x.len() / h;
        ensure(n <= scratch.max_tokens, || {
            format!(
                "moe_experts: {n} tokens, the scratch holds {}",
                scratch.max_tokens
            )
        })?;
        ensure(ids.len() == n * top_k && weights.len() == n * top_k, || {
            format!(
                "moe_experts: ids hold {} and weights {}, expected {n} x {top_k}",
                ids.len(),
                weights.len()
            )
        })?;
        ensure(out.len() == n * h, || {
            format!("moe_experts: out holds {}, expected {n} x {h}", out.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let call = MoeCall {
            tokens: n,
            top_k,
            x: self.ptr(x, "moe_experts x")?,
            x_bf16,
            ids: self.ptr(ids, "moe_experts ids")?,
            weights: self.ptr(weights, "moe_experts weights")?,
            out: self.ptr_mut(out, "moe_experts out")?,
        };
        ensure(
            call.x.is_multiple_of(16) && call.out.is_multiple_of(16),
            || "moe_experts: x and out must start 16-byte aligned".to_string(),
        )?;
        match self.moe_path(n, experts, scratch) {
            MoePath::Decode => self.moe_decode(&call, experts, scratch),
            MoePath::Prefill if self.has_wgmma() && experts.dtype == DType::BF16 => {
                self.moe_prefill_wgmma(&call, experts, scratch)
            }
            MoePath::Prefill | MoePath::PrefillCublas => {
                self.moe_prefill(&call, experts, scratch, false)
            }
            MoePath::PrefillPerExpert => self.moe_prefill(&call, experts, scratch, true),
        }
    }
}

/// The decode kernel of `table` for `dtype` and `pass`.
fn decode_kernel(table: &[[CudaFunction; 3]; 3], dtype: DType, pass: DecodePass) -> &CudaFunction {
    &table[dtype_slot(dtype)][pass.slot()]
}
