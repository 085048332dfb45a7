//! AVX-512 path: 16-lane f32 accumulators in `zmm` registers, fused multiply-add, masked loads
//! for the tail of k (no scalar clean-up loop, so the tail keeps the same lane structure).
//!
//! Widening: bf16 is zero-extended to 32 bits and shifted left by 16 (exact); f16 uses
//! `vcvtph2ps` (exact). Register tiles: decode streams 8 weight rows per step for one x row (8
//! independent FMA chains, enough to cover FMA latency, and 8 memory streams in flight), or
//! 4 x rows x 6 weight rows when m > 1; prefill uses 6 x rows x 4 panel rows = 24 accumulators,
//! leaving 8 of the 32 `zmm` registers for the x rows and the panel chunk in use. (6 x 4 rather
//! than 4 x 6 because the panel is the operand streamed from L2, so it gets the larger reuse;
//! 4x6, 5x5, 7x3 and 4x4 measured within a few percent of it.) Accumulators are reduced four at
//! a time by [`reduce4`], which shares shuffles but keeps the single-vector addition tree.
//!
//! Why not AVX512-BF16 (`vdpbf16ps`)? It multiplies bf16 by bf16, so the f32 activations would
//! have to be split into three bf16 parts to stay f32-accurate (two parts give only ~16 mantissa
//! bits, a relative error near 1e-5); three `vdpbf16ps` per 32 elements cost more than the two
//! FMAs they replace. Decode is bound by memory bandwidth, not by these instructions, and
//! prefill widens each weight tile only once, so there is nothing for it to win. It also flushes
//! denormals and rounds differently from FMA, which would break bitwise agreement with the
//! packed GEMM path.

use std::arch::x86_64::*;

use moerun_core::DType;

use super::gemm;
use super::kernels::{self, Args, Bf16, Format, Simd, F16, F32};
use super::Mode;

/// Marker type for the AVX-512 implementation of [`Simd`].
pub(crate) struct Avx512;

/// Mask of the low `n` lanes (`n < 16`).
#[inline(always)]
fn low_lanes(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

impl Simd for Avx512 {
    type V = __m512;
    const LANES: usize = 16;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_partial(p: *const f32, n: usize) -> __m512 {
        // Masked-off lanes are neither read nor faulted on.
        _mm512_maskz_loadu_ps(low_lanes(n), p)
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m512 {
        widen_bf16(_mm256_loadu_si256(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_bf16_partial(p: *const u16, n: usize) -> __m512 {
        widen_bf16(_mm256_maskz_loadu_epi16(low_lanes(n), p.cast()))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_f16_partial(p: *const u16, n: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(low_lanes(n), p.cast()))
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn mul_add(a: __m512, b: __m512, acc: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, acc)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn reduce(v: __m512) -> f32 {
        // Fixed tree: lane l += lane l+8, then l += l+4, l += l+2, l += l+1.
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }
    #[inline(always)]
    unsafe fn reduce_all(accs: &[__m512], out: &mut [f32]) {
        let mut quads = accs.chunks_exact(4);
        let mut outs = out.chunks_exact_mut(4);
        for (q, o) in (&mut quads).zip(&mut outs) {
            let sums = reduce4(q[0], q[1], q[2], q[3]);
            _mm_storeu_ps(o.as_mut_ptr(), sums);
        }
        for (&a, o) in quads.remainder().iter().zip(outs.into_remainder()) {
            *o = Self::reduce(a);
        }
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
}

/// [`Simd::reduce`] of four accumulators at once: the same tree (lane l + lane l+8, then l+4,
/// l+2, l+1, low operand first), but each shuffle and add serves two or four sums. Returns the
/// four sums in order.
#[inline(always)]
unsafe fn reduce4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    // Level 1: [a0..8 | b0..8] + [a8..16 | b8..16] (128-bit blocks 0,1 of each vs 2,3).
    let ab = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
    );
    let cd = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(c, d),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(c, d),
    );
    // Level 2: [a0..4 | b0..4 | c0..4 | d0..4] + [a4..8 | b4..8 | c4..8 | d4..8].
    let s4 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd),
    );
    // Level 3, within each 128-bit block: lanes 0,1 + lanes 2,3.
    let s2 = _mm512_add_ps(s4, _mm512_shuffle_ps::<0b11_10_11_10>(s4, s4));
    // Level 4: lane 0 + lane 1; block q's lane 0 now holds sum q.
    let s1 = _mm512_add_ps(s2, _mm512_shuffle_ps::<0b01_01_01_01>(s2, s2));
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, s1))
}

/// bf16 → f32: zero-extend each 16-bit value to 32 bits, then shift it into the high half.
#[inline(always)]
unsafe fn widen_bf16(h: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// One block of a transposed product (see [`kernels::Args`]).
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C, and `a` must describe valid
/// buffers: `x` with `m * k` f32, `w` with `n * k` elements of `dtype`, `out` with `m * n` f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn matmul_t_block(mode: Mode, dtype: DType, a: Args) {
    match dtype {
        DType::F32 => block::<F32>(mode, a),
        DType::BF16 => block::<Bf16>(mode, a),
        DType::F16 => block::<F16>(mode, a),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn block<F: Format>(mode: Mode, a: Args) {
    match mode {
        Mode::Stream if a.m == 1 => kernels::stream::<Avx512, F, 1, 8>(a, true),
        Mode::Stream => kernels::stream::<Avx512, F, 4, 6>(a, true),
        Mode::Packed => gemm::packed::<Avx512, F, 6, 4>(a),
    }
}

/// Sum of `n` f32 at `p` (bandwidth probe).
///
/// # Safety
/// As [`matmul_t_block`]'s CPU requirement; `p` valid for `n` reads.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn read_sum(p: *const f32, n: usize) -> f32 {
    kernels::read_sum::<Avx512>(p, n)
}
