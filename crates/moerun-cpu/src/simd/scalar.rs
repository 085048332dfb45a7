//! Portable path: the same kernels over plain arrays of 8 f32 lanes, a separate multiply and add
//! per lane (Rust never fuses them, so results do not depend on the target's FMA support). LLVM
//! turns the lane loops into whatever vectors the target has (SSE2, NEON), so this is also a
//! reasonable fallback on non-x86 machines, not just a reference.

use moerun_core::DType;

use super::gemm;
use super::kernels::{self, Args, Bf16, Format, Simd, F16, F32};
use super::Mode;

/// Marker type for the portable implementation of [`Simd`].
pub(crate) struct Scalar;

const LANES: usize = 8;
type V = [f32; LANES];

#[inline(always)]
fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// The first `n` values at `p` mapped by `f`, the other lanes zero. Unaligned reads: stored
/// weights carry no alignment guarantee.
#[inline(always)]
unsafe fn gather<T: Copy>(p: *const T, n: usize, f: impl Fn(T) -> f32) -> V {
    let mut v = [0.0; LANES];
    for (l, o) in v.iter_mut().enumerate().take(n) {
        *o = f(p.add(l).read_unaligned());
    }
    v
}

impl Simd for Scalar {
    type V = V;
    const LANES: usize = LANES;

    #[inline(always)]
    unsafe fn zero() -> V {
        [0.0; LANES]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> V {
        gather(p, LANES, |v| v)
    }
    #[inline(always)]
    unsafe fn load_partial(p: *const f32, n: usize) -> V {
        gather(p, n, |v| v)
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> V {
        gather(p, LANES, bf16_to_f32)
    }
    #[inline(always)]
    unsafe fn load_bf16_partial(p: *const u16, n: usize) -> V {
        gather(p, n, bf16_to_f32)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> V {
        gather(p, LANES, f16_to_f32)
    }
    #[inline(always)]
    unsafe fn load_f16_partial(p: *const u16, n: usize) -> V {
        gather(p, n, f16_to_f32)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: V) {
        p.cast::<V>().write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn mul_add(a: V, b: V, acc: V) -> V {
        let mut r = acc;
        for l in 0..LANES {
            r[l] += a[l] * b[l];
        }
        r
    }
    #[inline(always)]
    unsafe fn add(a: V, b: V) -> V {
        let mut r = a;
        for (r, b) in r.iter_mut().zip(b) {
            *r += b;
        }
        r
    }
    #[inline(always)]
    unsafe fn reduce(v: V) -> f32 {
        // Fixed tree, as on AVX2: lane l += lane l+4, then l += l+2, l += l+1.
        let s4 = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
        let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
        s2[0] + s2[1]
    }
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
}

/// One block of a transposed product (see [`kernels::Args`]).
///
/// # Safety
/// `a` must describe valid buffers: `x` with `m * k` f32, `w` with `n * k` elements of `dtype`,
/// `out` with `m * n` f32.
pub(crate) unsafe fn matmul_t_block(mode: Mode, dtype: DType, a: Args) {
    match dtype {
        DType::F32 => block::<F32>(mode, a),
        DType::BF16 => block::<Bf16>(mode, a),
        DType::F16 => block::<F16>(mode, a),
    }
}

unsafe fn block<F: Format>(mode: Mode, a: Args) {
    match mode {
        Mode::Stream if a.m == 1 => kernels::stream::<Scalar, F, 1, 4>(a, false),
        Mode::Stream => kernels::stream::<Scalar, F, 2, 4>(a, false),
        Mode::Packed => gemm::packed::<Scalar, F, 4, 1>(a),
    }
}

/// Sum of `n` f32 at `p` (bandwidth probe).
///
/// # Safety
/// `p` valid for `n` reads.
pub(crate) unsafe fn read_sum(p: *const f32, n: usize) -> f32 {
    kernels::read_sum::<Scalar>(p, n)
}
