//! Kernel benchmark: measured read bandwidth (the decode roofline), GEMV throughput against it for
//! the matrix shapes of Qwen3-30B-A3B, and GEMM GFLOP/s for prefill-sized batches.
//!
//! `cargo run --release -p moerun-cpu --example kernel_bench [-- --quick] [--rounds N]`
//!
//! GEMV runs against cold weights: each shape is replicated into at least 1 GiB of distinct
//! copies (more than the last-level cache) and the calls cycle through them, as decoding does
//! when it walks through the layers and experts of a model. It is timed twice: called from a
//! thread of rayon's pool (as a forward pass run inside `ThreadPool::install` calls it) and from
//! an outside thread, where every call also pays for handing the work to the pool and waking
//! the caller afterwards (tens of microseconds, which small matrices feel). GEMM reuses one
//! matrix (it is compute bound) and is called from inside the pool. Timings use rayon's global
//! pool (all cores unless `RAYON_NUM_THREADS` says otherwise).

use std::time::{Duration, Instant};

use moerun_core::{DType, MatRef};
use moerun_cpu::{bandwidth::measure_read_bandwidth, linear::matmul_t, simd};
use rayon::prelude::*;

const GIB: usize = 1 << 30;

/// Decode shapes `(rows, cols, what)`.
const GEMV_SHAPES: [(usize, usize, &str); 4] = [
    (151936, 2048, "lm_head"),
    (4096, 2048, "q_proj"),
    (768, 2048, "expert gate/up"),
    (2048, 768, "expert down"),
];

/// Prefill shapes: batch rows `m` and weight rows `n` (k = 2048).
const GEMM_MS: [usize; 3] = [32, 128, 512];
const GEMM_NS: [usize; 3] = [768, 2048, 4096];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--rounds N`: measure everything N times and keep each figure's best, for machines shared
    // with other work (a figure then reflects the quietest of N attempts).
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(1usize)
        .max(1);
    let threads = rayon::current_num_threads();
    let probe = if quick { GIB / 4 } else { GIB };
    let working_set = if quick { GIB / 4 } else { GIB };
    let gemv_cases: Vec<(DType, usize, usize, &str)> = [DType::BF16, DType::F32]
        .into_iter()
        .flat_map(|d| GEMV_SHAPES.map(|(n, k, what)| (d, n, k, what)))
        .collect();

    let (mut bw1, mut bw, mut peak) = (0.0f64, 0.0f64, None::<f64>);
    let mut gemv = vec![(f64::INFINITY, f64::INFINITY); gemv_cases.len()];
    let mut gemm_secs = vec![f64::INFINITY; GEMM_MS.len() * GEMM_NS.len()];
    for round in 0..rounds {
        if rounds > 1 {
            eprintln!("round {} of {rounds}", round + 1);
        }
        bw1 = bw1.max(measure_read_bandwidth(probe, 1));
        bw = bw.max(measure_read_bandwidth(probe, threads));
        for (best, &(dtype, n, k, _)) in gemv.iter_mut().zip(&gemv_cases) {
            let (inside, outside) = gemv_cold(dtype, n, k, working_set);
            *best = (best.0.min(inside), best.1.min(outside));
        }
        peak = fma_peak_gflops().map(|p| peak.map_or(p, |q: f64| q.max(p)));
        for (i, &m) in GEMM_MS.iter().enumerate() {
            for (j, &n) in GEMM_NS.iter().enumerate() {
                let best = &mut gemm_secs[i * GEMM_NS.len() + j];
                *best = best.min(gemm(DType::BF16, m, n, 2048, quick));
            }
        }
    }

    println!(
        "SIMD path: {}   rayon threads: {threads}   rounds: {rounds}",
        simd::active_isa()
    );
    println!(
        "read bandwidth ({} MiB buffer): 1 thread {:.1} GB/s, {threads} threads {:.1} GB/s",
        probe >> 20,
        bw1 / 1e9,
        bw / 1e9
    );

    println!("\nGEMV (m = 1, cold weights); called from a pool thread | from outside the pool:");
    println!(
        "  {:<16} {:>14} {:>5} {:>9} {:>7} {:>7} | {:>9} {:>7} {:>7}",
        "shape", "rows x cols", "dtype", "us/call", "GB/s", "% bw", "us/call", "GB/s", "% bw"
    );
    for (&(dtype, n, k, what), &(inside, outside)) in gemv_cases.iter().zip(&gemv) {
        let bytes = (n * k * dtype.size()) as f64;
        let cols = |secs: f64| {
            let rate = bytes / secs;
            format!(
                "{:>9.1} {:>7.1} {:>6.1}%",
                secs * 1e6,
                rate / 1e9,
                100.0 * rate / bw
            )
        };
        println!(
            "  {what:<16} {:>14} {dtype:>5} {} | {}",
            format!("{n}x{k}"),
            cols(inside),
            cols(outside)
        );
    }

    match peak {
        Some(p) => println!("\nGEMM (k = 2048, bf16 weights), measured FMA peak {p:.0} GFLOP/s:"),
        None => println!("\nGEMM (k = 2048, bf16 weights):"),
    }
    println!(
        "  {:>5} {:>6} {:>10} {:>9} {:>8}",
        "m", "n", "ms/call", "GFLOP/s", "% peak"
    );
    for (i, &m) in GEMM_MS.iter().enumerate() {
        for (j, &n) in GEMM_NS.iter().enumerate() {
            let secs = gemm_secs[i * GEMM_NS.len() + j];
            let gflops = 2.0 * (m * n * 2048) as f64 / secs / 1e9;
            let share = peak.map_or("-".to_string(), |p| format!("{:.0}%", 100.0 * gflops / p));
            println!(
                "  {m:>5} {n:>6} {:>10.3} {gflops:>9.1} {share:>8}",
                secs * 1e3
            );
        }
    }
}

/// Weight bytes that stand for random values of `dtype` (magnitudes around 1e-2, no NaNs).
fn fill(dtype: DType, bytes: &mut [u8]) {
    let size = dtype.size();
    bytes
        .par_chunks_mut(size << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut s = (c as u32).wrapping_mul(2_654_435_761) | 1;
            for e in chunk.chunks_exact_mut(size) {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let v = ((s >> 8) as f32 / (1 << 24) as f32 - 0.5) * 0.04;
                match dtype {
                    DType::F32 => e.copy_from_slice(&v.to_le_bytes()),
                    DType::BF16 => e.copy_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes()),
                    DType::F16 => e.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                }
            }
        });
}

/// Seconds per m = 1 product, called from a pool thread and from outside the pool, cycling over
/// copies of an `[n, k]` matrix that together fill at least `working_set` bytes (at least two
/// copies, so no call finds its matrix in cache).
fn gemv_cold(dtype: DType, n: usize, k: usize, working_set: usize) -> (f64, f64) {
    let bytes = n * k * dtype.size();
    let copies = working_set.div_ceil(bytes).max(2);
    let mut data = vec![0u8; copies * bytes];
    fill(dtype, &mut data);
    let x: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let mat = |c: usize| MatRef {
        dtype,
        rows: n,
        cols: k,
        data: &data[c * bytes..(c + 1) * bytes],
    };
    // One full cycle to warm up (page tables, rayon threads), then whole cycles until at least
    // half a second has passed; the best cycle's mean is reported (the machine may be shared,
    // and a disturbed cycle says nothing about the kernel).
    let time = || {
        let mut out = vec![0.0f32; n];
        for c in 0..copies {
            matmul_t(&x, 1, mat(c), &mut out);
        }
        let start = Instant::now();
        let mut best = f64::INFINITY;
        while best.is_infinite() || start.elapsed() < Duration::from_millis(500) {
            let cycle = Instant::now();
            for c in 0..copies {
                matmul_t(&x, 1, mat(c), &mut out);
            }
            best = best.min(cycle.elapsed().as_secs_f64() / copies as f64);
        }
        std::hint::black_box(&out);
        best
    };
    // `rayon::scope` runs its body on a thread of the global pool.
    let inside = rayon::scope(|_| time());
    let outside = time();
    (inside, outside)
}

/// Best seconds per `[m, k] x [n, k]ᵀ` product over a few repeats, called from a pool thread.
fn gemm(dtype: DType, m: usize, n: usize, k: usize, quick: bool) -> f64 {
    let mut data = vec![0u8; n * k * dtype.size()];
    fill(dtype, &mut data);
    let w = MatRef {
        dtype,
        rows: n,
        cols: k,
        data: &data,
    };
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i % 23) as f32 - 11.0) * 0.01)
        .collect();
    let mut out = vec![0.0f32; m * n];
    matmul_t(&x, m, w, &mut out);
    // From a pool thread, as in the GEMV table's first columns.
    rayon::scope(|_| {
        let mut best = f64::INFINITY;
        let budget = Duration::from_millis(if quick { 100 } else { 400 });
        let start = Instant::now();
        let mut runs = 0;
        while runs < 3 || start.elapsed() < budget {
            let t = Instant::now();
            matmul_t(&x, m, w, &mut out);
            best = best.min(t.elapsed().as_secs_f64());
            runs += 1;
        }
        std::hint::black_box(&out);
        best
    })
}

/// Peak f32 multiply-add rate of the active SIMD path over all rayon threads, in GFLOP/s: every
/// thread runs independent FMA chains on registers only. `None` on the scalar path.
fn fma_peak_gflops() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use moerun_cpu::simd::Isa;
        const ITERS: usize = 4_000_000;
        let isa = simd::active();
        let lanes = match isa {
            Isa::Avx512 => 16,
            Isa::Avx2 => 8,
            Isa::Scalar => return None,
        };
        let run = || {
            rayon::broadcast(|_| match isa {
                // SAFETY: `simd::active` only returns paths this CPU supports, and each
                // function enables exactly the features its path was detected with.
                Isa::Avx512 => unsafe { fma_loops::avx512(ITERS) },
                // SAFETY: as above.
                _ => unsafe { fma_loops::avx2(ITERS) },
            })
        };
        // Best of a few runs: the machine may be shared.
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let start = Instant::now();
            std::hint::black_box(run());
            best = best.min(start.elapsed().as_secs_f64());
        }
        let secs = best;
        let flops = (rayon::current_num_threads() * ITERS * fma_loops::CHAINS * lanes * 2) as f64;
        Some(flops / secs / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Register-only FMA loops for [`fma_peak_gflops`].
#[cfg(target_arch = "x86_64")]
mod fma_loops {
    use std::arch::x86_64::*;

    /// Independent FMA chains per thread: more than latency x throughput (4 x 2), few enough to
    /// stay in registers.
    pub const CHAINS: usize = 12;

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512(iters: usize) -> f32 {
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        let mut sum = _mm512_setzero_ps();
        for v in acc {
            sum = _mm512_add_ps(sum, v);
        }
        _mm512_reduce_add_ps(sum)
    }

    /// # Safety
    /// The CPU must support AVX and FMA.
    #[target_feature(enable = "avx,fma")]
    pub unsafe fn avx2(iters: usize) -> f32 {
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let mut sum = _mm256_setzero_ps();
        for v in acc {
            sum = _mm256_add_ps(sum, v);
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        lanes.iter().sum()
    }
}
