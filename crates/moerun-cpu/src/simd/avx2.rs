//! AVX2 + FMA + F16C path: 8-lane f32 accumulators in `ymm` registers.
//!
//! With only 16 `ymm` registers the tiles are smaller than on AVX-512: decode streams 4 weight
//! rows per step for one x row, 2 x rows x 4 weight rows otherwise, and prefill uses 3 x rows x
//! 4 panel rows (12 accumulators + 3 x rows + 1 weight chunk = 16 registers). Tails of k use
//! `vmaskmovps` for f32; 16-bit tails are copied into a zeroed 8-element buffer first, since AVX2
//! has no masked 16-bit load.

use std::arch::x86_64::*;

use moerun_core::DType;

use super::gemm;
use super::kernels::{self, Args, Bf16, Format, Simd, F16, F32};
use super::Mode;

/// Marker type for the AVX2 implementation of [`Simd`].
pub(crate) struct Avx2;

/// The first `n < 8` u16 at `p`, the rest zero, as one 128-bit vector.
#[inline(always)]
unsafe fn load_u16_partial(p: *const u16, n: usize) -> __m128i {
    let mut tmp = [0u16; 8];
    std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
    _mm_loadu_si128(tmp.as_ptr().cast())
}

/// bf16 → f32: zero-extend each 16-bit value to 32 bits, then shift it into the high half.
#[inline(always)]
unsafe fn widen_bf16(h: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

impl Simd for Avx2 {
    type V = __m256;
    const LANES: usize = 8;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_partial(p: *const f32, n: usize) -> __m256 {
        // Lane l is loaded iff l < n; masked-off lanes are not read and do not fault.
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane);
        _mm256_maskload_ps(p, mask)
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        widen_bf16(_mm_loadu_si128(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_bf16_partial(p: *const u16, n: usize) -> __m256 {
        widen_bf16(load_u16_partial(p, n))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_f16_partial(p: *const u16, n: usize) -> __m256 {
        _mm256_cvtph_ps(load_u16_partial(p, n))
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn mul_add(a: __m256, b: __m256, acc: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, acc)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn reduce(v: __m256) -> f32 {
        // Fixed tree: lane l += lane l+4, then l += l+2, l += l+1.
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
}

/// One block of a transposed product (see [`kernels::Args`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `a` must describe valid buffers: `x` with
/// `m * k` f32, `w` with `n * k` elements of `dtype`, `out` with `m * n` f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_t_block(mode: Mode, dtype: DType, a: Args) {
    match dtype {
        DType::F32 => block::<F32>(mode, a),
        DType::BF16 => block::<Bf16>(mode, a),
        DType::F16 => block::<F16>(mode, a),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block<F: Format>(mode: Mode, a: Args) {
    match mode {
        Mode::Stream if a.m == 1 => kernels::stream::<Avx2, F, 1, 4>(a, true),
        Mode::Stream => kernels::stream::<Avx2, F, 2, 4>(a, true),
        Mode::Packed => gemm::packed::<Avx2, F, 2, 6>(a),
    }
}

/// Sum of `n` f32 at `p` (bandwidth probe).
///
/// # Safety
/// As [`matmul_t_block`]'s CPU requirement; `p` valid for `n` reads.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn read_sum(p: *const f32, n: usize) -> f32 {
    kernels::read_sum::<Avx2>(p, n)
}
