//! Prefill driver: a cache-blocked GEMM whose every output is still summed in the one order of
//! [`super::kernels`], so its results match the streaming GEMV bit for bit.
//!
//! A task owns a block of weight rows. It first widens them once into f32 *panels* of `NR` rows,
//! laid out `[chunk][NR][LANES]` so the microkernel reads them sequentially. Then, for each block
//! of `MC` rows of `x` and each pass over `KC` elements of k, every `MR`-row tile of `x` is copied
//! into a small aligned buffer (`[chunk][MR][LANES]`, zero-padded past k exactly as the GEMV's
//! masked tail loads are) and multiplied against every panel.
//!
//! Why this shape: the dot-product formulation needs a full vector of *both* operands per
//! multiply-add, so the register tile (`MR x NR` accumulators) bounds reuse, and L2 bandwidth is
//! the limit. The `x` tile of one pass (`MR * KC * 4` bytes) stays in L1 while the panels stream
//! from L2, each panel vector being reused `MR` times from a register. Splitting k into passes
//! is what lets the `x` tile fit in L1; the price is that the 16-lane accumulators of a tile are
//! parked in a buffer between passes, which is exact (the chain of multiply-adds simply resumes),
//! so the summation order is unchanged.

use std::cell::Cell;

use super::kernels::{put, Args, Format, Simd};

thread_local! {
    /// Per-thread scratch (panels, x tile, parked accumulators), kept between calls so prefill
    /// does not allocate and fault in fresh pages for every matrix product.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Elements of k per pass: the x tile of a pass (`MR * KC * 4` bytes, 24 KiB for 6 rows) and the
/// panel slice streaming past it must share L1 (48 KiB here). Longer passes park accumulators
/// less often but push the x tile out of L1: 1024 beat 512 by 2% in alternating runs of the
/// 512-token prefill (344 vs 337 and 360 vs 353 tok/s), 2048 (one pass at k = 2048) lost 1-4%.
const KC: usize = 1024;

/// Rows of x per block. The parked accumulators of a block (`MC * rows * 64` bytes, 144 KiB for a
/// 48-row task) stay in L2 next to the panels (`rows * k * 4` bytes, 384 KiB at k = 2048).
const MC: usize = 48;

/// Floats rounded up to whole 64-byte lines, so each scratch region starts aligned.
fn lines(floats: usize) -> usize {
    floats.div_ceil(16) * 16
}

/// Compute the product block described by `a` with `MR x NR` register tiles (`MR <= 8`).
///
/// # Safety
/// `a` must describe valid buffers (see [`Args`]) and the CPU must support `S`'s instructions.
#[inline(always)]
pub(crate) unsafe fn packed<S: Simd, F: Format, const MR: usize, const NR: usize>(a: Args) {
    let lanes = S::LANES;
    let chunks = a.k.div_ceil(lanes);
    let panels = a.n.div_ceil(NR);
    let kc = (KC / lanes).max(1);
    let passes = chunks.div_ceil(kc).max(1);
    let mc = (MC / MR).max(1) * MR;
    let tile_len = MR * NR * lanes;
    let panel_len = chunks * NR * lanes;
    let panels_len = lines(panels * panel_len);
    let x_len = lines(kc * MR * lanes);
    let parked_len = if passes > 1 {
        (mc / MR) * panels * tile_len
    } else {
        0
    };

    let mut buf = SCRATCH.take();
    let need = panels_len + x_len + parked_len + 16;
    if buf.len() < need {
        buf.resize(need, 0.0);
    }
    let offset = buf.as_ptr().align_offset(64).min(16);
    let panel_base = buf.as_mut_ptr().add(offset);
    let x_tile = panel_base.add(panels_len);
    let parked = x_tile.add(x_len);

    pack_panels::<S, F, NR>(a, panel_base, chunks);
    for i0 in (0..a.m).step_by(mc) {
        let i1 = (i0 + mc).min(a.m);
        for pass in 0..passes {
            let c0 = pass * kc;
            let c1 = (c0 + kc).min(chunks);
            let (first, last) = (pass == 0, pass + 1 == passes);
            let (mut i, mut t) = (i0, 0);
            while i < i1 {
                let mr = (i1 - i).min(MR);
                pack_x_tile::<S>(a, i, mr, c0, c1, x_tile);
                for p in 0..panels {
                    let call = Step {
                        a,
                        i,
                        j: p * NR,
                        x: x_tile,
                        w: panel_base.add(p * panel_len + c0 * NR * lanes),
                        chunks: c1 - c0,
                        // Only dereferenced with several passes, when the region exists;
                        // with one pass it is empty and this points past it.
                        parked: parked.wrapping_add((t * panels + p) * tile_len),
                        first,
                        last,
                    };
                    // The guards are constants after inlining, so unused heights compile away.
                    match mr {
                        8 if MR >= 8 => call.run::<S, 8, NR>(),
                        7 if MR >= 7 => call.run::<S, 7, NR>(),
                        6 if MR >= 6 => call.run::<S, 6, NR>(),
                        5 if MR >= 5 => call.run::<S, 5, NR>(),
                        4 if MR >= 4 => call.run::<S, 4, NR>(),
                        3 if MR >= 3 => call.run::<S, 3, NR>(),
                        2 if MR >= 2 => call.run::<S, 2, NR>(),
                        _ => call.run::<S, 1, NR>(),
                    }
                }
                i += mr;
                t += 1;
            }
        }
    }
    SCRATCH.set(buf);
}

/// One microkernel call: a tile of x rows `i..` against the panel of weight rows `j..`, over
/// `chunks` chunks of one pass.
struct Step {
    a: Args,
    i: usize,
    j: usize,
    /// The packed x tile, `[chunk][MR][LANES]`.
    x: *const f32,
    /// The panel at the pass's first chunk, `[chunk][NR][LANES]`.
    w: *const f32,
    chunks: usize,
    /// Where this tile's accumulators wait between passes (`[MR][NR][LANES]`).
    parked: *mut f32,
    first: bool,
    last: bool,
}

impl Step {
    /// The microkernel: `MR x NR` accumulators in registers, one multiply-add per x row and
    /// panel row per chunk: exactly the chain [`super::kernels`] describes.
    #[inline(always)]
    unsafe fn run<S: Simd, const MR: usize, const NR: usize>(&self) {
        let lanes = S::LANES;
        let mut acc = [[S::zero(); NR]; MR];
        if !self.first {
            for (ii, acc_i) in acc.iter_mut().enumerate() {
                for (r, v) in acc_i.iter_mut().enumerate() {
                    *v = S::load(self.parked.add((ii * NR + r) * lanes));
                }
            }
        }
        let mut xs = [S::zero(); MR];
        for c in 0..self.chunks {
            for (ii, xv) in xs.iter_mut().enumerate() {
                *xv = S::load(self.x.add((c * MR + ii) * lanes));
            }
            for r in 0..NR {
                let wv = S::load(self.w.add((c * NR + r) * lanes));
                for (acc_i, &xv) in acc.iter_mut().zip(&xs) {
                    acc_i[r] = S::mul_add(xv, wv, acc_i[r]);
                }
            }
        }
        if self.last {
            let mut out = [[0.0; NR]; MR];
            S::reduce_all(acc.as_flattened(), out.as_flattened_mut());
            let nr = (self.a.n - self.j).min(NR);
            put(self.a, self.i, self.j, 1, nr, &out);
        } else {
            for (ii, acc_i) in acc.iter().enumerate() {
                for (r, &v) in acc_i.iter().enumerate() {
                    S::store(self.parked.add((ii * NR + r) * lanes), v);
                }
            }
        }
    }
}

/// Copy x rows `i..i + mr`, chunks `c0..c1`, into `dst` as `[chunk][mr][LANES]`, zero-padding
/// lanes past k (the same zeros the GEMV's masked tail load produces).
#[inline(always)]
unsafe fn pack_x_tile<S: Simd>(a: Args, i: usize, mr: usize, c0: usize, c1: usize, dst: *mut f32) {
    let lanes = S::LANES;
    let full = a.k / lanes;
    let rem = a.k % lanes;
    let mut out = dst;
    for c in c0..c1 {
        for ii in 0..mr {
            let src = a.x.add((i + ii) * a.k + c * lanes);
            let v = if c < full {
                S::load(src)
            } else {
                S::load_partial(src, rem)
            };
            S::store(out, v);
            out = out.add(lanes);
        }
    }
}

/// Widen the block's weight rows into `[panel][chunk][NR][LANES]` at `dst`, zero-padding rows
/// past `n` and lanes past k.
#[inline(always)]
unsafe fn pack_panels<S: Simd, F: Format, const NR: usize>(a: Args, dst: *mut f32, chunks: usize) {
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
