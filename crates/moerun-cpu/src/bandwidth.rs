//! Measured memory read bandwidth: the roofline that decode (GEMV) performance is judged against.
//! Decoding reads every active weight byte once per token, so tokens per second can be at most
//! bandwidth / active bytes, and the GEMV kernels aim to get close to this figure.

use std::time::Instant;

use rayon::prelude::*;

use crate::simd;

/// Timed passes after the warm-up pass; the best one is reported (the least disturbed by other
/// work on the machine).
const REPEATS: usize = 5;

/// Read bandwidth in bytes per second: `threads` threads each stream through their own
/// contiguous part of a `bytes`-byte buffer with the widest SIMD loads available, summing the
/// values so the loads cannot be optimised away. Each thread reads its part as 8 interleaved
/// sequential streams, as the GEMV kernels read 6-8 weight rows at once; on the development
/// machine that is 10-40% faster per core than a single stream, so a single-stream probe would
/// understate the achievable bandwidth. Choose `bytes` well above the last-level cache (1 GiB or
/// more) to measure DRAM rather than cache.
///
/// The buffer is written once first, so its pages are really backed (a never-written allocation
/// would map every page to the same zero page and measure a cache instead). One warm-up pass,
/// then the best of five timed passes.
///
/// Panics if `threads == 0` or the thread pool cannot be built.
pub fn measure_read_bandwidth(bytes: usize, threads: usize) -> f64 {
    assert!(threads > 0, "need at least one thread");
    let floats = (bytes / 4).max(threads * 1024);
    let data = vec![1.0f32; floats];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("bandwidth probe thread pool");
    let isa = simd::active();
    let part = floats.div_ceil(threads);
    let pass = || {
        let sums: Vec<f32> = data
            .par_chunks(part)
            .map(|chunk| simd::read_sum(isa, chunk))
            .collect();
        std::hint::black_box(sums);
    };
    pool.install(|| {
        pass();
        let mut best = f64::INFINITY;
        for _ in 0..REPEATS {
            let start = Instant::now();
            pass();
            best = best.min(start.elapsed().as_secs_f64());
        }
        (floats * 4) as f64 / best
    })
}
