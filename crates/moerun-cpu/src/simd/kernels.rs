//! ISA-generic matrix-product kernels, written once against the [`Simd`] vector abstraction and
//! instantiated by each ISA module inside its `#[target_feature]` entry points.
//!
//! # One summation order for every output
//!
//! Every output `dot(x[i, ..], w[j, ..])` is computed the same way, whichever driver runs it:
//! one accumulator vector of `S::LANES` lanes starts at zero; chunk `c` of k (elements
//! `c * LANES ..`) adds `x_chunk * w_chunk` into it with one (fused, where the ISA has it)
//! multiply-add, `x` as the first operand; a final short chunk has the missing lanes set to zero
//! on both sides; then [`Simd::reduce`] folds the lanes with a fixed tree. Widening bf16/f16 to
//! f32 is exact, so whether a weight chunk is widened in registers (here) or was widened earlier
//! into a panel ([`super::gemm`]) does not change any value. A register tile only computes
//! several such dot products side by side, sharing loads; nothing about one output depends on
//! the tile shape, on the other rows of `x`, or on which thread ran it. That is what makes
//! decode (GEMV) and prefill (GEMM) results bitwise identical. (NaN payloads are the one thing
//! not pinned down: LLVM does not preserve them.)
//!
//! # The decode driver
//!
//! [`stream`] reads weight rows straight from storage and widens them in registers. A tile
//! covers `NR` weight rows (independent accumulator chains, enough to hide FMA latency) and up
//! to `MR` rows of `x`; with `m <= MR` every weight byte is read exactly once. The `NR` rows of a
//! tile are taken from `NR` equal *segments* of the block (rows `j, j + seg, j + 2 seg, ..`), so
//! the tile reads `NR` sequential streams of memory that each run through many consecutive
//! rows. Taking `NR` adjacent rows instead means short interleaved runs inside the same pages,
//! which the hardware prefetcher follows poorly: on the development machine that ran at 75-95%
//! of the segmented speed, worst for short rows (k = 768). A software prefetch 1 KiB ahead in
//! each stream covers the start of every run.

// The kernels read stored little-endian weights with native loads.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "moerun-cpu kernels assume a little-endian target"
);

/// The vector operations the kernels need; one implementation per ISA.
///
/// All methods are `unsafe`: they dereference raw pointers (valid for the stated number of
/// elements, no alignment required) and use instructions the caller must have checked the CPU
/// supports. Implementations are `#[inline(always)]` so they compile into the caller's
/// `#[target_feature]` context.
pub(crate) trait Simd {
    /// One accumulator: `LANES` f32 values.
    type V: Copy;
    /// f32 lanes per vector: how a dot product is split over k.
    const LANES: usize;

    unsafe fn zero() -> Self::V;
    /// `LANES` f32 values from `p`.
    unsafe fn load(p: *const f32) -> Self::V;
    /// `n < LANES` f32 values from `p`, the other lanes zero (reads nothing past `p + n`).
    unsafe fn load_partial(p: *const f32, n: usize) -> Self::V;
    /// `LANES` bf16 values from `p`, widened.
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    unsafe fn load_bf16_partial(p: *const u16, n: usize) -> Self::V;
    /// `LANES` f16 values from `p`, widened.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    unsafe fn load_f16_partial(p: *const u16, n: usize) -> Self::V;
    /// Store `LANES` f32 values at `p`.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `acc + a * b` (rounded once where the ISA has FMA).
    unsafe fn mul_add(a: Self::V, b: Self::V, acc: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// Sum of the lanes, by the ISA's fixed tree.
    unsafe fn reduce(v: Self::V) -> f32;
    /// `out[i] = reduce(accs[i])` for every accumulator. An ISA may override this to reduce
    /// several accumulators at once with shared shuffles, but each sum must be formed by the very
    /// same additions as [`Simd::reduce`] (so values are bitwise equal).
    #[inline(always)]
    unsafe fn reduce_all(accs: &[Self::V], out: &mut [f32]) {
        for (o, &a) in out.iter_mut().zip(accs) {
            *o = Self::reduce(a);
        }
    }
    /// Hint that the cache line at `p` will be read soon (never faults, any address).
    unsafe fn prefetch(p: *const u8);
}

/// A stored weight element type: how `LANES` elements are loaded and widened.
pub(crate) trait Format {
    type Elem;
    unsafe fn load<S: Simd>(p: *const Self::Elem) -> S::V;
    unsafe fn load_partial<S: Simd>(p: *const Self::Elem, n: usize) -> S::V;
}

/// f32 weights.
pub(crate) struct F32;
/// bf16 weights (the top 16 bits of an f32).
pub(crate) struct Bf16;
/// IEEE half-precision weights.
pub(crate) struct F16;

impl Format for F32 {
    type Elem = f32;
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        S::load(p)
    }
    #[inline(always)]
    unsafe fn load_partial<S: Simd>(p: *const f32, n: usize) -> S::V {
        S::load_partial(p, n)
    }
}

impl Format for Bf16 {
    type Elem = u16;
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const u16) -> S::V {
        S::load_bf16(p)
    }
    #[inline(always)]
    unsafe fn load_partial<S: Simd>(p: *const u16, n: usize) -> S::V {
        S::load_bf16_partial(p, n)
    }
}

impl Format for F16 {
    type Elem = u16;
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const u16) -> S::V {
        S::load_f16(p)
    }
    #[inline(always)]
    unsafe fn load_partial<S: Simd>(p: *const u16, n: usize) -> S::V {
        S::load_f16_partial(p, n)
    }
}

/// A product to compute: `out[i * n + j] = dot(x[i, ..k], w[j, ..k])` for `i < m`, `j < n`.
/// `x` is `[m, k]` f32, `w` is `[n, k]` in the stored dtype, `out` is `[m, n]` f32.
#[derive(Clone, Copy)]
pub(crate) struct Args {
    pub x: *const f32,
    pub m: usize,
    pub k: usize,
    pub w: *const u8,
    pub n: usize,
    pub out: *mut f32,
}

/// Where a tile reads its weight chunks from.
trait Source<S: Simd> {
    /// Full chunk `c` of tile row `r`.
    unsafe fn load(&self, r: usize, c: usize) -> S::V;
    /// Final chunk `c` of tile row `r`, holding `n < LANES` real elements.
    unsafe fn load_tail(&self, r: usize, c: usize, n: usize) -> S::V;
    /// Called once per row and full chunk, before the load.
    unsafe fn prefetch(&self, r: usize, c: usize);
}

/// Weight rows in their stored dtype, `ld` elements apart, widened as they are loaded. With
/// `PREFETCH`, each new cache line of a row also prefetches the line `ahead` elements further on.
struct Raw<F: Format, const PREFETCH: bool> {
    base: *const F::Elem,
    ld: usize,
    ahead: usize,
}

impl<S: Simd, F: Format, const PREFETCH: bool> Source<S> for Raw<F, PREFETCH> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> S::V {
        F::load::<S>(self.base.add(r * self.ld + c * S::LANES))
    }
    #[inline(always)]
    unsafe fn load_tail(&self, r: usize, c: usize, n: usize) -> S::V {
        F::load_partial::<S>(self.base.add(r * self.ld + c * S::LANES), n)
    }
    #[inline(always)]
    unsafe fn prefetch(&self, r: usize, c: usize) {
        let chunk_bytes = S::LANES * std::mem::size_of::<F::Elem>();
        // Once per 64-byte line: chunks smaller than a line only prefetch when they start one.
        if PREFETCH && (c * chunk_bytes) % 64 < chunk_bytes {
            // `wrapping_add`: near the end this points past the matrix, which a prefetch
            // tolerates but `add` would make undefined behaviour.
            let p = self
                .base
                .wrapping_add(r * self.ld + c * S::LANES + self.ahead);
            S::prefetch(p.cast());
        }
    }
}

/// The decode register tile: `MR` rows of `x` (at `x`, `k` apart) times `NR` weight rows of `w`,
/// over all of k. Returns the `MR x NR` dot products, each summed in the order the module comment
/// fixes (the GEMM microkernel in [`super::gemm`] is the same loop over packed operands).
#[inline(always)]
unsafe fn tile<S: Simd, W: Source<S>, const MR: usize, const NR: usize>(
    x: *const f32,
    k: usize,
    w: &W,
) -> [[f32; NR]; MR] {
    let lanes = S::LANES;
    let full = k / lanes;
    let rem = k % lanes;
    let mut acc = [[S::zero(); NR]; MR];
    let mut xs = [S::zero(); MR];
    for c in 0..full {
        for (i, xv) in xs.iter_mut().enumerate() {
            *xv = S::load(x.add(i * k + c * lanes));
        }
        for r in 0..NR {
            w.prefetch(r, c);
            let wv = w.load(r, c);
            for (acc_i, &xv) in acc.iter_mut().zip(&xs) {
                acc_i[r] = S::mul_add(xv, wv, acc_i[r]);
            }
        }
    }
    if rem != 0 {
        for (i, xv) in xs.iter_mut().enumerate() {
            *xv = S::load_partial(x.add(i * k + full * lanes), rem);
        }
        for r in 0..NR {
            let wv = w.load_tail(r, full, rem);
            for (acc_i, &xv) in acc.iter_mut().zip(&xs) {
                acc_i[r] = S::mul_add(xv, wv, acc_i[r]);
            }
        }
    }
    let mut out = [[0.0; NR]; MR];
    S::reduce_all(acc.as_flattened(), out.as_flattened_mut());
    out
}

/// Write a tile's results for x rows `i..` and weight rows `j, j + rs, ..` (`nr` of them) into `out`.
#[inline(always)]
pub(crate) unsafe fn put<const MR: usize, const NR: usize>(
    a: Args,
    i: usize,
    j: usize,
    rs: usize,
    nr: usize,
    t: &[[f32; NR]; MR],
) {
    for (ii, t_i) in t.iter().enumerate() {
        for (r, &v) in t_i.iter().enumerate().take(nr) {
            *a.out.add((i + ii) * a.n + j + r * rs) = v;
        }
    }
}

/// All `m` rows of `x` against one source of `NR` weight rows (weight rows `j, j + rs, ..`), in
/// tiles of at most `MR <= 4` x rows. Only the first `nr` tile rows are written out.
#[inline(always)]
unsafe fn all_x_rows<S: Simd, W: Source<S>, const MR: usize, const NR: usize>(
    a: Args,
    w: &W,
    j: usize,
    rs: usize,
    nr: usize,
) {
    let mut i = 0;
    while i < a.m {
        let x = a.x.add(i * a.k);
        let mr = (a.m - i).min(MR);
        // The guards are constants after inlining, so unused tile heights compile away.
        match mr {
            4 if MR >= 4 => put(a, i, j, rs, nr, &tile::<S, W, 4, NR>(x, a.k, w)),
            3 if MR >= 3 => put(a, i, j, rs, nr, &tile::<S, W, 3, NR>(x, a.k, w)),
            2 if MR >= 2 => put(a, i, j, rs, nr, &tile::<S, W, 2, NR>(x, a.k, w)),
            _ => put(a, i, j, rs, nr, &tile::<S, W, 1, NR>(x, a.k, w)),
        }
        i += mr;
    }
}

/// How far ahead of its loads each weight stream prefetches.
const STREAM_PREFETCH_BYTES: usize = 1024;

/// Decode driver (see the module comment): tiles of `NR` weight rows, one from each of `NR`
/// segments of the block, against all rows of `x` (`MR <= 4` at a time).
///
/// # Safety
/// `a` must describe valid buffers (see [`Args`]) and the CPU must support `S`'s instructions.
#[inline(always)]
pub(crate) unsafe fn stream<S: Simd, F: Format, const MR: usize, const NR: usize>(
    a: Args,
    prefetch: bool,
) {
    let w = a.w.cast::<F::Elem>();
    let seg = a.n / NR;
    let (ld, ahead) = (
        seg * a.k,
        STREAM_PREFETCH_BYTES / std::mem::size_of::<F::Elem>(),
    );
    for j in 0..seg {
        let base = w.add(j * a.k);
        if prefetch {
            all_x_rows::<S, _, MR, NR>(a, &Raw::<F, true> { base, ld, ahead }, j, seg, NR);
        } else {
            all_x_rows::<S, _, MR, NR>(a, &Raw::<F, false> { base, ld, ahead }, j, seg, NR);
        }
    }
    // The `n % NR` rows left over, one at a time: same per-output order, a narrower tile.
    for j in seg * NR..a.n {
        let src = Raw::<F, false> {
            base: w.add(j * a.k),
            ld: a.k,
            ahead: 0,
        };
        all_x_rows::<S, _, MR, 1>(a, &src, j, 1, 1);
    }
}

/// Sum of `n` f32 at `p`: the bandwidth probe's inner loop. The data is read as 8 interleaved
/// sub-streams (one block of 4 vectors from each in turn), which keeps more cache-line requests in
/// flight than one sequential stream: on the development machine 8 streams read 10-40% faster
/// per core than 1. The GEMV kernels read 6-8 streams at once the same way, so this is the
/// bandwidth they can actually reach, and the fair roofline to compare them with.
///
/// # Safety
/// `p` must be valid for `n` reads and the CPU must support `S`'s instructions.
#[inline(always)]
pub(crate) unsafe fn read_sum<S: Simd>(p: *const f32, n: usize) -> f32 {
    const STREAMS: usize = 8;
    const UNROLL: usize = 4;
    let block = UNROLL * S::LANES;
    let sub = n / STREAMS / block * block;
    // Two accumulator sets (even and odd streams) so consecutive adds are independent.
    let mut acc = [S::zero(); 2 * UNROLL];
    let mut i = 0;
    while i < sub {
        for st in 0..STREAMS {
            let q = p.add(st * sub + i);
            for u in 0..UNROLL {
                let a = &mut acc[(st & 1) * UNROLL + u];
                *a = S::add(*a, S::load(q.add(u * S::LANES)));
            }
        }
        i += block;
    }
    let mut sum = 0.0;
    for a in acc {
        sum += S::reduce(a);
    }
    for t in STREAMS * sub..n {
        sum += *p.add(t);
    }
    sum
}
