//! ISA-generic matrix-product kernels, written once against the [`Simd`] vector abstraction and
//! instantiated by each ISA module inside its `#[target_feature]` entry points.
//!
//! # One summation order for every output
//!
//! Every output `dot(x[i, ..], w[j, ..])` is computed the same way, whichever driver runs it:
//! one accumulator vector of `S::LANES` lanes starts at zero; chunk `c` of k (elements
//! `c * LANES ..`) adds `x_chunk * w_chunk` into it with one (fused, where the ISA has it)
//! multiply-add; a final short chunk is loaded with the missing lanes set to zero on both sides;
//! then [`Simd::reduce`] folds the lanes with a fixed tree. Widening bf16/f16 to f32 is exact, so
//! whether a weight chunk is widened in registers ([`Raw`]) or was widened earlier into a panel
//! ([`Panel`]) does not change any value. A register tile ([`tile`]) only computes several such
//! dot products side by side, sharing loads; nothing about one output depends on the tile shape,
//! on the other rows of `x`, or on which thread ran it. That is what makes decode (GEMV) and
//! prefill (GEMM) results bitwise identical.
//!
//! # Drivers
//!
//! * [`stream`] (decode, small m): weight rows are read straight from storage, `NR` rows at a
//!   time (several independent accumulator chains in flight), each byte read once when
//!   `m <= MR`. A software prefetch runs one row group ahead.
//! * [`packed`] (prefill): a block of weight rows is widened once into an f32 panel buffer laid
//!   out chunk-major (`[panel][chunk][NR][LANES]`) so the microkernel reads it sequentially; then
//!   every `MR`-row tile of `x` is multiplied against every panel. The `x` tile (`MR` rows) is the
//!   operand that stays hot in L1 while panels stream from L2.

use std::cell::Cell;

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

/// A product to compute: `out_t[j * m + i] = dot(x[i, ..k], w[j, ..k])` for `i < m`, `j < n`.
/// `x` is `[m, k]` f32, `w` is `[n, k]` in the stored dtype, `out_t` is `[n, m]`.
#[derive(Clone, Copy)]
pub(crate) struct Args {
    pub x: *const f32,
    pub m: usize,
    pub k: usize,
    pub w: *const u8,
    pub n: usize,
    pub out_t: *mut f32,
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
/// `PREFETCH`, loading chunk `c` of row `r` also prefetches the element `ahead` further on (the
/// same column of the next row group: the next bytes this thread will need).
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
        if PREFETCH
            && (c * S::LANES * std::mem::size_of::<F::Elem>()) % 64
                < S::LANES * std::mem::size_of::<F::Elem>() * crate::linear::knob("PFL", 1)
        {
            // `wrapping_add`: past the last group this points beyond the matrix, which a
            // prefetch tolerates but `add` would make undefined behaviour.
            let p = self
                .base
                .wrapping_add(r * self.ld + c * S::LANES + self.ahead);
            S::prefetch(p.cast());
        }
    }
}

/// One widened panel: `[chunk][NR][LANES]` f32, rows past the matrix and lanes past k zero.
struct Panel<const NR: usize> {
    base: *const f32,
}

impl<S: Simd, const NR: usize> Source<S> for Panel<NR> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> S::V {
        S::load(self.base.add((c * NR + r) * S::LANES))
    }
    #[inline(always)]
    unsafe fn load_tail(&self, r: usize, c: usize, _n: usize) -> S::V {
        // Zero-padded when packed, so this equals what `Raw::load_tail` yields.
        S::load(self.base.add((c * NR + r) * S::LANES))
    }
    #[inline(always)]
    unsafe fn prefetch(&self, _r: usize, _c: usize) {}
}

/// The register tile: `MR` rows of `x` (at `x`, `k` apart) times `NR` weight rows of `w`, over all
/// of k. Returns the `MR x NR` dot products. This loop *is* the summation order (see the module
/// comment); every driver goes through it.
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
    for (out_i, acc_i) in out.iter_mut().zip(&acc) {
        for (o, &a) in out_i.iter_mut().zip(acc_i) {
            *o = S::reduce(a);
        }
    }
    out
}

/// Write a tile's results for x rows `i..` and weight rows `j..j + nr` into `out_t`.
#[inline(always)]
unsafe fn put<const MR: usize, const NR: usize>(
    a: Args,
    i: usize,
    j: usize,
    nr: usize,
    t: &[[f32; NR]; MR],
) {
    for (ii, t_i) in t.iter().enumerate() {
        for (r, &v) in t_i.iter().enumerate().take(nr) {
            *a.out_t.add((j + r) * a.m + i + ii) = v;
        }
    }
}

/// All `m` rows of `x` against one source of `NR` weight rows starting at weight row `j`, in
/// tiles of at most `MR <= 4` x rows. Only the first `nr` tile rows are written out.
#[inline(always)]
unsafe fn all_x_rows<S: Simd, W: Source<S>, const MR: usize, const NR: usize>(
    a: Args,
    w: &W,
    j: usize,
    nr: usize,
) {
    let mut i = 0;
    while i < a.m {
        let x = a.x.add(i * a.k);
        let mr = (a.m - i).min(MR);
        // The guards are constants after inlining, so unused tile heights compile away.
        match mr {
            4 if MR >= 4 => put(a, i, j, nr, &tile::<S, W, 4, NR>(x, a.k, w)),
            3 if MR >= 3 => put(a, i, j, nr, &tile::<S, W, 3, NR>(x, a.k, w)),
            2 if MR >= 2 => put(a, i, j, nr, &tile::<S, W, 2, NR>(x, a.k, w)),
            _ => put(a, i, j, nr, &tile::<S, W, 1, NR>(x, a.k, w)),
        }
        i += mr;
    }
}

/// Decode driver: weight rows read from storage in groups of `NR`, each group against all rows of
/// `x` (`MR` at a time). With `m <= MR` every weight byte is read exactly once. With `prefetch`,
/// each load also prefetches the same column of the next group (`NR` rows further on).
#[inline(always)]
pub(crate) unsafe fn stream<S: Simd, F: Format, const MR: usize, const NR: usize>(
    a: Args,
    prefetch: bool,
) {
    let w = a.w.cast::<F::Elem>();
    let mut j = 0;
    while j + NR <= a.n {
        let (base, ld, ahead) = (
            w.add(j * a.k),
            a.k,
            NR * a.k * crate::linear::knob("PFD", 1) + crate::linear::knob("PFE", 0),
        );
        if prefetch {
            all_x_rows::<S, _, MR, NR>(a, &Raw::<F, true> { base, ld, ahead }, j, NR);
        } else {
            all_x_rows::<S, _, MR, NR>(a, &Raw::<F, false> { base, ld, ahead }, j, NR);
        }
        j += NR;
    }
    // Leftover rows one at a time: same per-output order, just a narrower tile.
    while j < a.n {
        let src = Raw::<F, false> {
            base: w.add(j * a.k),
            ld: a.k,
            ahead: 0,
        };
        all_x_rows::<S, _, MR, 1>(a, &src, j, 1);
        j += 1;
    }
}

thread_local! {
    /// Per-thread panel buffer of [`packed`], kept between calls so prefill does not pay for
    /// allocating and faulting in fresh pages on every matrix product.
    static PANELS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Prefill driver: widen all `n` weight rows of the block into panels of `NR` rows once, then
/// run every `MR`-row tile of `x` against every panel.
#[inline(always)]
pub(crate) unsafe fn packed<S: Simd, F: Format, const MR: usize, const NR: usize>(a: Args) {
    let lanes = S::LANES;
    let chunks = a.k.div_ceil(lanes);
    let panels = a.n.div_ceil(NR);
    let panel_len = chunks * NR * lanes;
    let mut buf = PANELS.take();
    // 16 spare floats so the panels can start on a 64-byte boundary.
    let need = panels * panel_len + 16;
    if buf.len() < need {
        buf.resize(need, 0.0);
    }
    let offset = buf.as_ptr().align_offset(64).min(16);
    let base = buf.as_mut_ptr().add(offset);

    pack::<S, F, NR>(a, base, chunks);
    let mut i = 0;
    while i < a.m {
        let x = a.x.add(i * a.k);
        let mr = (a.m - i).min(MR);
        for p in 0..panels {
            let src = Panel::<NR> {
                base: base.add(p * panel_len),
            };
            let j = p * NR;
            let nr = (a.n - j).min(NR);
            match mr {
                4 if MR >= 4 => put(a, i, j, nr, &tile::<S, _, 4, NR>(x, a.k, &src)),
                3 if MR >= 3 => put(a, i, j, nr, &tile::<S, _, 3, NR>(x, a.k, &src)),
                2 if MR >= 2 => put(a, i, j, nr, &tile::<S, _, 2, NR>(x, a.k, &src)),
                _ => put(a, i, j, nr, &tile::<S, _, 1, NR>(x, a.k, &src)),
            }
        }
        i += mr;
    }
    PANELS.set(buf);
}

/// Widen the block's weight rows into `[panel][chunk][NR][LANES]` at `dst`, zero-padding rows
/// past `n` and lanes past `k` (so panel tiles need no tail handling of their own).
#[inline(always)]
unsafe fn pack<S: Simd, F: Format, const NR: usize>(a: Args, dst: *mut f32, chunks: usize) {
    let lanes = S::LANES;
    let full = a.k / lanes;
    let rem = a.k % lanes;
    let w = a.w.cast::<F::Elem>();
    let mut out = dst;
    for p in 0..a.n.div_ceil(NR) {
        for c in 0..chunks {
            for r in 0..NR {
                let row = p * NR + r;
                let v = if row >= a.n {
                    S::zero()
                } else if c < full {
                    F::load::<S>(w.add(row * a.k + c * lanes))
                } else {
                    F::load_partial::<S>(w.add(row * a.k + c * lanes), rem)
                };
                S::store(out, v);
                out = out.add(lanes);
            }
        }
    }
}

/// Sum of `n` f32 at `p`: the bandwidth probe's inner loop. The data is read as 8 interleaved
/// sub-streams (one block of 4 vectors from each in turn), which keeps more cache-line requests in
/// flight than one sequential stream: on the development machine 8 streams read about 2x as
/// fast per core as 1, and the GEMV kernels also read 6-8 rows at once, so this is the
/// bandwidth they can actually reach.
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
