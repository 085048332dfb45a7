//! The Hopper prefill attention on wgmma (`kernels/attention_wgmma.cu`, FlashAttention-3 style):
//! which build runs the tensor-core prefill tiles of [`super::attention`] on sm_90 for head_dim
//! 128. The kernel keeps the tensor-core path's contract (the tile rule with tiles of 64 tokens,
//! the batch copy and the f32 pool as key sources, causal, windows, GQA), so the attention op
//! only swaps the function, its block and its shared memory.
//!
//! - Where: compute capability 9.0 (H100, H200: the one `sm_90a` target) and head_dim 128.
//!   head_dim 64 and every other device keep the `mma.sync` builds (`attn_tile_bf16*`).
//! - Off switch: `MOERUN_ATTN_WGMMA=0` (read once) or [`CudaDevice::set_attention_wgmma`]`(Some(0))`
//!   run the `mma.sync` builds instead; `MOERUN_ATTN_WGMMA=b` / `Some(b)`, b in 1..=7, picks a
//!   two-head build of [`WGMMA_BUILDS`] (to measure them against each other: all give the same
//!   bits).
//! - Builds: CTAs of 2 query heads of one kv head (an even GQA group: 384 threads, a producer and
//!   two consumer warpgroups) with 2 or 3 stages of K/V tiles of 128 keys, without or with FA3's
//!   overlap of a tile's softmax with the previous tile's P V, and with the overlap, with or
//!   without FA3's ping-pong of the two consumers; an odd group takes the one-head build (256
//!   threads) of the same overlap.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::CudaFunction;

use super::tma::TensorMap;
use crate::error::{ensure, Result};
use crate::CudaDevice;

/// One entry point of `attention_wgmma.cu`: `heads` query heads per CTA (consumer warpgroups),
/// `stages` K/V tiles in the ring, `overlap` FA3's intra-warpgroup pipelining (the `_pp` builds
/// add its ping-pong between the two consumers).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WgmmaBuild {
    pub(crate) name: &'static str,
    pub(crate) heads: usize,
    stages: usize,
    overlap: bool,
    /// How the copy tiles load: 0 cp.async, 1 TMA, 2 TMA multicast over a cluster of two CTAs
    /// (the four heads of a kv group divisible by 4; others take the TMA build).
    tma: u8,
}

/// Two-head builds first (the knob's 1..=7 index them), then the one-head builds.
pub(crate) const WGMMA_BUILDS: [WgmmaBuild; 9] = [
    build("attn_wgmma_h2_s2", 2, 2, false, 0),
    build("attn_wgmma_h2_s3", 2, 3, false, 0),
    build("attn_wgmma_h2_s3_ov", 2, 3, true, 0),
    build("attn_wgmma_h2_s3_ovpp", 2, 3, true, 0),
    build("attn_wgmma_h2_s2_ovpp", 2, 2, true, 0),
    build("attn_wgmma_h2_s3_ovpp_tma", 2, 3, true, 1),
    build("attn_wgmma_h2_s3_ovpp_cl", 2, 3, true, 2),
    build("attn_wgmma_h1_s3", 1, 3, false, 0),
    build("attn_wgmma_h1_s3_ov", 1, 3, true, 0),
];

const fn build(
    name: &'static str,
    heads: usize,
    stages: usize,
    overlap: bool,
    tma: u8,
) -> WgmmaBuild {
    WgmmaBuild {
        name,
        heads,
        stages,
        overlap,
        tma,
    }
}

/// Two-head builds the knob can pick (indices 1..=TWO_HEAD_BUILDS).
const TWO_HEAD_BUILDS: usize = 7;
/// The two-head build used by default (an index into [`WGMMA_BUILDS`]) for calls that may read
/// keys from the f32 pool (a cached prefix, or no batch copy): 3 stages, overlap, ping-pong,
/// copy tiles by cp.async. `ops_bench attention` on the H200: 1024 tokens after 3072 cached
/// 248.6 µs from the copy (276.7 from the pool) against 268.2 (303.5) with the TMA build.
const DEFAULT_BUILD: usize = 3;
/// The two-head build for calls whose keys are all the batch's own (a batch copy, and no token
/// sees past the batch's length: `max_context <= n`, a fresh prefill): the same with the copy
/// tiles by TMA. 4096 tokens from position 0 from the copy: 300.4 µs against 323.3; `moerun bench
/// --like qwen3-30b-a3b --prompt 4096`: 55.3k against 54.5k tok/s.
const OWN_KEYS_BUILD: usize = 5;
/// head_dim of the kernel.
pub(crate) const WGMMA_HEAD_DIM: usize = 128;

impl WgmmaBuild {
    /// Threads per CTA: a producer warpgroup and one consumer warpgroup per head.
    pub(crate) fn threads(&self) -> u32 {
        128 * (self.heads as u32 + 1)
    }
    /// Dynamic shared memory: 1 KiB to align to the swizzle's 1024 bytes, the heads' bf16 q
    /// (64 rows x 128 dims), the stages (K and V, 128 keys x 128 dims of bf16 each), and each
    /// stage's two mbarriers.
    pub(crate) fn smem(&self) -> usize {
        1024 + self.heads * 64 * 128 * 2 + self.stages * (2 * 128 * 128 * 2 + 16)
    }
}

/// Handles of `attention_wgmma.cu`, one per [`WGMMA_BUILDS`] entry.
pub(crate) struct WgmmaAttention {
    funcs: Vec<CudaFunction>,
    /// Whether each build was granted its shared memory (devices without sm_90a may refuse; they
    /// never launch it anyway).
    granted: Vec<bool>,
    /// [`CudaDevice::set_attention_wgmma`]'s choice plus one (0: none made).
    forced: AtomicUsize,
}

/// A build chosen for a call: its function, query heads per CTA, threads and shared memory.
pub(crate) struct WgmmaPick<'a> {
    pub(crate) func: &'a CudaFunction,
    /// [`WgmmaBuild::tma`]: whether the launch needs the copy's tensor maps.
    pub(crate) tma: u8,
    pub(crate) heads: usize,
    pub(crate) threads: u32,
    pub(crate) smem: usize,
}

/// The batch copy's tensor maps (TMA builds).
pub(crate) struct FaMap;

impl FaMap {
    pub(crate) const NONE: TensorMap = TensorMap::NONE;

    /// A map of a batch copy's K or V at `addr`: `rows` rows of `kv_heads` x 128 bf16, read in
    /// boxes of 64 dims x 1 kv head x 128 rows with the 128-byte swizzle (rows past `rows` read
    /// as zeros).
    pub(crate) fn batch_copy(addr: u64, rows: usize, kv_heads: usize) -> Result<TensorMap> {
        let d = WGMMA_HEAD_DIM as u64;
        TensorMap::bf16_swizzled(
            addr,
            [d, kv_heads as u64, rows as u64],
            &[d * 2, kv_heads as u64 * d * 2],
            [64, 1, 128],
            "attention batch copy",
        )
    }
}

/// `MOERUN_ATTN_WGMMA` (0 ..= 7), read once; anything else is ignored.
fn env_wgmma() -> Option<usize> {
    static MODE: OnceLock<Option<usize>> = OnceLock::new();
    *MODE.get_or_init(|| {
        std::env::var("MOERUN_ATTN_WGMMA")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&m| m <= TWO_HEAD_BUILDS)
    })
}

/// The build for a kv group of `group` query heads when `mode` is asked for (0: none; b: the
/// two-head build b - 1): the two-head build for even groups, else the one-head build with the
/// same overlap.
fn pick_build(mode: usize, group: usize) -> Option<usize> {
    if mode == 0 {
        return None;
    }
    let two = mode - 1;
    let b = &WGMMA_BUILDS[two];
    if b.tma == 2 && !group.is_multiple_of(4) && group.is_multiple_of(2) {
        // The cluster build pairs two CTAs of one kv head: the TMA build of the same pipeline.
        return WGMMA_BUILDS.iter().position(|c| {
            c.heads == 2 && c.tma == 1 && c.stages == b.stages && c.overlap == b.overlap
        });
    }
    if group.is_multiple_of(2) {
        return Some(two);
    }
    WGMMA_BUILDS
        .iter()
        .position(|c| c.heads == 1 && c.overlap == b.overlap)
}

impl WgmmaAttention {
    /// Load the entry points and opt them in to their shared memory.
    pub(crate) fn load(get: &impl Fn(&str, &str) -> Result<CudaFunction>) -> Result<Self> {
        let mut funcs = Vec::with_capacity(WGMMA_BUILDS.len());
        let mut granted = Vec::with_capacity(WGMMA_BUILDS.len());
        for b in &WGMMA_BUILDS {
            let f = get("attention_wgmma", b.name)?;
            let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            granted.push(f.set_attribute(attr, b.smem() as i32).is_ok());
            funcs.push(f);
        }
        Ok(WgmmaAttention {
            funcs,
            granted,
            forced: AtomicUsize::new(0),
        })
    }

    /// The build that runs the tensor-core prefill tiles for this call, if any: compute
    /// capability 9.0, head_dim 128, not switched off, its shared memory granted. `own_keys`:
    /// the call's keys are all the batch's own, from a batch copy (see [`OWN_KEYS_BUILD`]).
    pub(crate) fn pick(
        &self,
        compute_capability: (u32, u32),
        head_dim: usize,
        group: usize,
        own_keys: bool,
    ) -> Option<WgmmaPick<'_>> {
        if compute_capability != (9, 0) || head_dim != WGMMA_HEAD_DIM {
            return None;
        }
        let default = if own_keys {
            OWN_KEYS_BUILD
        } else {
            DEFAULT_BUILD
        };
        let mode = match self.forced.load(Ordering::Relaxed) {
            0 => env_wgmma().unwrap_or(default + 1),
            m => m - 1,
        };
        let i = pick_build(mode, group)?;
        let b = &WGMMA_BUILDS[i];
        self.granted[i].then_some(WgmmaPick {
            func: &self.funcs[i],
            tma: b.tma,
            heads: b.heads,
            threads: b.threads(),
            smem: b.smem(),
        })
    }
}

impl CudaDevice {
    /// The wgmma build that runs the tensor-core prefill tiles for heads of `head_dim` in kv
    /// groups of `group` query heads on this device as things are set now, if any (`None`: the
    /// `mma.sync` builds run them), for a call whose keys are all the batch's own, read from a
    /// batch copy (`own_keys`: a fresh prefill with a copy), or not.
    pub fn attention_wgmma_build(
        &self,
        head_dim: usize,
        group: usize,
        own_keys: bool,
    ) -> Option<&'static str> {
        // Both KV dtypes' builds make the same choice.
        let w = &self.kernels.attention[0].wgmma;
        let cc = self.info().compute_capability;
        let pick = w.pick(cc, head_dim, group, own_keys)?;
        WGMMA_BUILDS
            .iter()
            .zip(&w.funcs)
            .find(|(_, f)| std::ptr::eq(*f, pick.func))
            .map(|(b, _)| b.name)
    }

    /// Which kernel runs the tensor-core prefill tiles of head_dim 128 on sm_90: `None` as
    /// `MOERUN_ATTN_WGMMA` says (default: the wgmma kernel, build 4 or, for calls whose keys all
    /// come from the batch copy, build 6), `Some(0)` the `mma.sync` builds
    /// (then [`CudaDevice::set_tensor_core_attention_heads`] picks among them), `Some(b)` for b in
    /// 1..=7 the wgmma two-head build b (2 stages; 3 stages; 3 stages with the softmax / P V
    /// overlap; that with ping-pong; 2 stages with both; the 4th with the copy tiles by TMA; and by
    /// TMA multicast over a cluster of two CTAs). Every wgmma build gives the same bits; other
    /// devices and head sizes ignore this.
    pub fn set_attention_wgmma(&self, build: Option<usize>) -> Result<()> {
        let b = build.unwrap_or(0);
        ensure(build.is_none() || b <= TWO_HEAD_BUILDS, || {
            format!("wgmma attention: build {b} (0 = off, 1..={TWO_HEAD_BUILDS} are built)")
        })?;
        for k in self.kernels.attention.iter() {
            k.wgmma
                .forced
                .store(build.map_or(0, |b| b + 1), Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_fit_an_sm_and_groups_pick_a_build_whose_heads_divide_them() {
        for b in &WGMMA_BUILDS {
            assert!(b.smem() <= 227 << 10, "{b:?}: {} bytes", b.smem());
        }
        assert_eq!(WGMMA_BUILDS[1].smem(), 1024 + 32768 + 3 * 65552);
        let (own, other) = (&WGMMA_BUILDS[OWN_KEYS_BUILD], &WGMMA_BUILDS[DEFAULT_BUILD]);
        assert_eq!((own.heads, own.tma, other.heads, other.tma), (2, 1, 2, 0));
        const { assert!(OWN_KEYS_BUILD < TWO_HEAD_BUILDS && DEFAULT_BUILD < TWO_HEAD_BUILDS) };
        for mode in 1..=TWO_HEAD_BUILDS {
            for group in 1..=16 {
                let i = pick_build(mode, group).unwrap();
                assert!(
                    group.is_multiple_of(WGMMA_BUILDS[i].heads),
                    "{mode} {group}"
                );
                assert_eq!(WGMMA_BUILDS[i].overlap, WGMMA_BUILDS[mode - 1].overlap);
            }
        }
        assert_eq!(pick_build(0, 8), None);
        assert_eq!(pick_build(2, 8), Some(1));
        assert_eq!(pick_build(3, 1), Some(8));
        assert_eq!(pick_build(4, 3), Some(8));
        assert_eq!(pick_build(1, 3), Some(7));
        assert_eq!(pick_build(7, 8), Some(6), "a group of 8: the cluster build");
        assert_eq!(pick_build(7, 2), Some(5), "a group of 2: the TMA build");
        assert_eq!(pick_build(7, 6), Some(5));
        assert!(WGMMA_BUILDS[..TWO_HEAD_BUILDS].iter().all(|b| b.heads == 2));
    }
}
