//! The prefill path of [`CudaDevice::moe_experts`] on Hopper (sm_90): our own grouped GEMMs on the
//! tensor cores (`kernels/moe_wgmma.cu`, wgmma, bf16 operands, f32 accumulation), bf16 weights
//! only. With P = n · k pairs listed in expert order q by `moe_align`:
//!
//! 1. `moe_align` (as in decode) writes the per-expert offsets, which stay on the device.
//! 2. `f32_to_bf16`: `xb = bf16(x)`, `[n, H]`, once per token (not once per pair).
//! 3. `moe_wgmma_gate_up_n<BN>` (persistent, one CTA of 384 threads per SM):
//!    `h[q, j] = bf16(act(g) · u)` with `g = xb[t] · gate_j`, `u = xb[t] · up_j` for q's token t;
//!    A rows are gathered from xb by index, each tile takes BN/2 gate rows and the matching up
//!    rows, so the activation runs in the epilogue from f32 accumulators.
//! 4. `moe_wgmma_down_n<BN>`: `y[q] = bf16(h[q] · downᵀ)`, `[P, H]`.
//! 5. `moe_combine_checked_bf16`: `out[t] = Σ_r weights[t, r] · y[pos[t k + r]]` in rank order,
//!    f32; a token with an id >= E (a caller bug; such pairs are never computed) gets NaN.
//!
//! The GEMMs find their tiles from the device offsets, so the path needs no host sizes and never
//! waits for the device: it can be captured in a CUDA graph (sizes are host upper bounds).
//!
//! Tiles are 128 rows x BN columns ([`WgmmaTile`]); each of the two consumer warpgroups owns 64
//! rows and skips its wgmma when all of them lie past its expert's end. N256 is the default:
//! at 4096 tokens of Qwen3-30B-A3B it beat N128 (less L2 traffic per FLOP) and N256Pair (TMA
//! multicast of B across a cluster of two, which loses the parallelism of experts with one or an
//! odd number of m tiles); docs/perf/cuda-ops.md has the figures.
//!
//! Rounding against the f32 reference: x, h and the expert outputs y are rounded to bf16 (2⁻⁹
//! relative each); g and u stay f32 into the activation (the cuBLAS path rounds them too). Tests
//! hold it to 1e-2 against the f32 reference and, element by element, to a reference that rounds
//! at those three places within what rounding flips can move each element (tests/moe.rs
//! `check_steps`).

use std::sync::OnceLock;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use moerun_core::DType;

use super::{DeviceExperts, MoeCall, MoeScratch, MAX_EXPERTS};
use crate::error::{DriverContext, Result};
use crate::ops::tma::TensorMap;
use crate::ops::to_i32;
use crate::{CudaDevice, CudaError};

/// Rows of a tile (two consumer warpgroups of 64).
const BM: usize = 128;
/// Threads of a CTA: a producer warpgroup and two consumer warpgroups.
const THREADS: u32 = 384;

/// Output columns per tile of the wgmma GEMMs (BN in `kernels/moe_wgmma.cu`): 128 or 256. The
/// gate_up kernel's B tile holds BN/2 gate and BN/2 up rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WgmmaTile {
    /// 128 x 128 tiles, 5 pipeline stages of 32 KiB.
    N128,
    /// 128 x 256 tiles, 4 stages of 48 KiB: 3/4 of the L2 traffic per FLOP of N128.
    #[default]
    N256,
    /// As N256, in clusters of two CTAs that take two m tiles of one expert and the same n tile:
    /// each loads half of the shared B tile with TMA and multicasts it to both, so B crosses
    /// from L2 once per pair (2/3 of N256's traffic). An expert with an odd tile count leaves one
    /// CTA of its last pair computing nothing.
    N256Pair,
}

impl WgmmaTile {
    /// `MOERUN_CUDA_MOE_TILE` (`n128`, `n256`, `pair`) if set to one of those, else the default:
    /// lets `moerun bench` compare the variants end to end.
    pub(super) fn from_env() -> WgmmaTile {
        match std::env::var("MOERUN_CUDA_MOE_TILE").as_deref() {
            Ok("n128") => WgmmaTile::N128,
            Ok("pair") => WgmmaTile::N256Pair,
            _ => WgmmaTile::default(),
        }
    }
    fn slot(self) -> usize {
        match self {
            WgmmaTile::N128 => 0,
            WgmmaTile::N256 => 1,
            WgmmaTile::N256Pair => 2,
        }
    }
    fn bn(self) -> usize {
        [128, 256, 256][self.slot()]
    }
    fn stages(self) -> usize {
        [5, 4, 4][self.slot()]
    }
    /// Dynamic shared memory of a CTA for `experts` experts: 1 KiB of alignment slack, the
    /// stages, their two mbarriers each, the tile prefix of `experts + 1` u32.
    fn smem(self, experts: usize) -> usize {
        1024 + self.stages() * ((BM + self.bn()) * 128 + 16) + 4 * (experts + 1)
    }
}

/// Handles of `kernels/moe_wgmma.cu`, indexed by [`WgmmaTile::slot`].
pub(crate) struct WgmmaKernels {
    gate_up: [CudaFunction; 3],
    down: [CudaFunction; 3],
    combine: CudaFunction,
    /// Clusters of two the device runs at once, for the pair kernels (`[gate_up, down]`,
    /// queried on first use; 0: refused).
    pair_clusters: [OnceLock<u32>; 2],
}

/// A 2-D map of `rows` bf16 rows of `k` elements at `addr` (row-major, k a multiple of 8), read
/// in boxes of 128 rows x 64 elements with the 128-byte swizzle wgmma expects; reads past either
/// edge give zeros.
fn weight_map(addr: u64, rows: usize, k: usize) -> Result<TensorMap> {
    TensorMap::bf16_swizzled(
        addr,
        [k as u64, rows as u64],
        &[(k * 2) as u64],
        [64, 128],
        "MoE weights",
    )
}

impl WgmmaKernels {
    /// Load the entry points and opt them in to their shared memory (for [`MAX_EXPERTS`]). On
    /// devices without sm_90a the entries are empty and never launched, and a refused opt-in is
    /// not an error.
    pub(crate) fn load(get: &impl Fn(&str, &str) -> Result<CudaFunction>) -> Result<Self> {
        let pair = |kind: &str| -> Result<[CudaFunction; 3]> {
            let f = [
                get("moe_wgmma", &format!("moe_wgmma_{kind}_n128"))?,
                get("moe_wgmma", &format!("moe_wgmma_{kind}_n256"))?,
                get("moe_wgmma", &format!("moe_wgmma_{kind}_pair"))?,
            ];
            let tiles = [WgmmaTile::N128, WgmmaTile::N256, WgmmaTile::N256Pair];
            for (func, tile) in f.iter().zip(tiles) {
                let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                let _ = func.set_attribute(attr, tile.smem(MAX_EXPERTS) as i32);
            }
            Ok(f)
        };
        Ok(WgmmaKernels {
            gate_up: pair("gate_up")?,
            down: pair("down")?,
            combine: get("moe_prefill", "moe_combine_checked_bf16")?,
            pair_clusters: Default::default(),
        })
    }
}

impl CudaDevice {
    /// Whether the wgmma prefill path runs here: compute capability 9.0 (H100, H200), the one
    /// architecture with an `sm_90a` target, unless `MOERUN_CUDA_MOE_WGMMA=0` turns it off (then
    /// [`super::MoePath::Prefill`] is the cuBLAS path everywhere: an A/B switch without a rebuild).
    pub fn has_wgmma(&self) -> bool {
        static ALLOWED: OnceLock<bool> = OnceLock::new();
        let allowed = *ALLOWED
            .get_or_init(|| std::env::var_os("MOERUN_CUDA_MOE_WGMMA").is_none_or(|v| v != "0"));
        allowed && self.info().compute_capability == (9, 0)
    }

    pub(super) fn moe_prefill_wgmma(
        &self,
        c: &MoeCall,
        w: &DeviceExperts,
        s: &mut MoeScratch,
    ) -> Result<()> {
        if w.dtype != DType::BF16 || !self.has_wgmma() {
            return Err(CudaError::Unsupported(format!(
                "the wgmma MoE prefill path with {} experts on {} (bf16 on sm_90 only)",
                w.dtype,
                self.info().arch
            )));
        }
        let (e, hidden, inter) = (w.experts, w.hidden, w.intermediate);
        let p_max = s.max_tokens * s.top_k;
        // Element offsets inside the kernels are u32 (row * K): keep every matrix below 2³¹.
        to_i32(c.tokens * hidden, "tokens x hidden")?;
        to_i32(p_max * hidden.max(inter), "pairs x hidden")?;
        to_i32(2 * inter * hidden, "expert gate_up elements")?;
        self.moe_align(c, w, s, 0)?;

        let pair_list = self.ptr(&s.pairs, "moe pairs")?;
        let pos = self.ptr(&s.pos, "moe pos")?;
        let offsets = self.ptr(&s.offsets, "moe offsets")?;
        let h = self.ptr_mut(&mut s.inner, "moe h")?;
        let outer = self.ptr_mut(&mut s.outer, "moe activations")?;
        // outer: xb [n, H] bf16 in its first half, y [P, H] bf16 in its second.
        let y = outer + (p_max * hidden * 2) as u64;
        // x as bf16: the caller's copy when it has one, else converted into outer's first half.
        let xb = if c.x_bf16 != 0 { c.x_bf16 } else { outer };
        let (gate_up, down) = (
            self.ptr(&w.gate_up, "moe gate_up")?,
            self.ptr(&w.down, "moe down")?,
        );
        let (e_i, hidden_i, inter_i, k_i) = (
            to_i32(e, "experts")?,
            to_i32(hidden, "hidden")?,
            to_i32(inter, "intermediate")?,
            to_i32(c.top_k, "top_k")?,
        );
        let act = w.activation().code();

        if c.x_bf16 == 0 {
            let n = (c.tokens * hidden) as u64;
            let mut b = self.stream.launch_builder(&self.kernels.f32_to_bf16);
            b.arg(&c.x).arg(&xb).arg(&n);
            // SAFETY: x holds n · H f32; xb (the first half of outer) has room for max_tokens · H
            // bf16.
            unsafe { b.launch(self.elementwise_cfg(c.tokens * hidden)) }
                .ctx("f32_to_bf16 (moe)")?;
        }

        let tile = s.wgmma_tile;
        let kernels = &self.kernels.moe.wgmma;
        let smem = tile.smem(e) as u32; // < 227 KiB for E <= MAX_EXPERTS
        let sms = self.info().multiprocessors.max(1);
        let pair = tile == WgmmaTile::N256Pair;
        let cfg = |which: usize| -> Result<LaunchConfig> {
            let mut grid = sms;
            if pair {
                let func = [&kernels.gate_up[2], &kernels.down[2]][which];
                let clusters = *kernels.pair_clusters[which].get_or_init(|| {
                    let one = LaunchConfig {
                        grid_dim: (2, 1, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: smem,
                    };
                    func.occupancy_max_active_clusters(one, &self.stream)
                        .unwrap_or(0)
                });
                grid = 2 * clusters.min(sms / 2);
                if grid == 0 {
                    return Err(CudaError::Unsupported(
                        "the wgmma pair kernels: the device runs no cluster of two".into(),
                    ));
                }
            }
            Ok(LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: smem,
            })
        };
        let maps = if pair {
            Some((
                weight_map(gate_up, e * 2 * inter, hidden)?,
                weight_map(down, e * hidden, inter)?,
            ))
        } else {
            None
        };
        let none = 0u64;
        let mut b = self.stream.launch_builder(&kernels.gate_up[tile.slot()]);
        b.arg(&xb)
            .arg(&pair_list)
            .arg(&offsets)
            .arg(&gate_up)
            .arg(&h);
        b.arg(&e_i).arg(&hidden_i).arg(&inter_i).arg(&k_i).arg(&act);
        if let Some((up_map, _)) = &maps {
            b.arg(up_map);
        }
        // SAFETY: xb holds n rows of H bf16; pairs P indices t · k + r < n · k and offsets E + 2
        // group starts from moe_align (rows of group e < E are offsets[e]..offsets[e + 1] <= P);
        // gate_up holds E · 2I · H bf16; h has room for P_max · I bf16 (inner is P_max · I · 4
        // bytes). The kernel reads and writes nothing else; the argument list matches.
        // With pairs, the map covers the same gate_up stack (E · 2I rows of H).
        unsafe { b.launch(cfg(0)?) }.ctx("moe_wgmma_gate_up")?;

        let mut b = self.stream.launch_builder(&kernels.down[tile.slot()]);
        b.arg(&h).arg(&none).arg(&offsets).arg(&down).arg(&y);
        b.arg(&e_i).arg(&inter_i).arg(&hidden_i).arg(&k_i).arg(&act);
        if let Some((_, down_map)) = &maps {
            b.arg(down_map);
        }
        // SAFETY: h holds the P rows of I bf16 written above (pairs is unused: A rows are h's
        // own); down holds E · H · I bf16; y has room for P_max · H bf16 (the second half of
        // outer, P_max · H · 4 bytes in all).
        // With pairs, the map covers the same down stack (E · H rows of I).
        unsafe { b.launch(cfg(1)?) }.ctx("moe_wgmma_down")?;

        let mut b = self.stream.launch_builder(&kernels.combine);
        b.arg(&y).arg(&pos).arg(&offsets).arg(&e_i);
        b.arg(&c.weights).arg(&c.out).arg(&hidden_i).arg(&k_i);
        let rows = LaunchConfig {
            grid_dim: (c.tokens as u32, 1, 1), // n <= P_max <= i32::MAX
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: y holds rows for every pair of an expert < E (the others are never read);
        // pos holds P places < P; offsets E + 2; weights n · k f32 and out n · H f32.
        unsafe { b.launch(rows) }.ctx("moe_combine_checked_bf16")?;
        Ok(())
    }
}
