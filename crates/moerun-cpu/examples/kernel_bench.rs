//! Kernel benchmark: measured read bandwidth (the decode roofline), GEMV throughput against it for
//! the matrix shapes of Qwen3-30B-A3B, and GEMM GFLOP/s for prefill-sized batches.
//!
//! `cargo run --release -p moerun-cpu --example kernel_bench [-- --quick]`
//!
//! GEMV runs against cold weights: each shape is replicated into at least 1 GiB of distinct
//! copies (more than the last-level cache) and the calls cycle through them, as decoding does
//! when it walks through the layers and experts of a model. GEMM reuses one matrix (it is
//! compute bound). Timings use rayon's global pool (all cores unless `RAYON_NUM_THREADS` says
//! otherwise).

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

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let threads = rayon::current_num_threads();
    println!(
        "SIMD path: {}   rayon threads: {threads}",
        simd::active_isa()
    );

    let probe = if quick { GIB / 4 } else { GIB };
    let bw1 = measure_read_bandwidth(probe, 1);
    let bw = measure_read_bandwidth(probe, threads);
    println!(
        "read bandwidth ({} MiB buffer): 1 thread {:.1} GB/s, {threads} threads {:.1} GB/s",
        probe >> 20,
        bw1 / 1e9,
        bw / 1e9
    );

    println!("\nGEMV (m = 1, cold weights):");
    println!(
        "  {:<16} {:>14} {:>5} {:>10} {:>9} {:>8}",
        "shape", "rows x cols", "dtype", "us/call", "GB/s", "% of bw"
    );
    for dtype in [DType::BF16, DType::F32] {
        for (n, k, what) in GEMV_SHAPES {
            let (secs, bytes) = gemv_cold(dtype, n, k, if quick { GIB / 4 } else { GIB });
            let rate = bytes as f64 / secs;
            println!(
                "  {what:<16} {:>14} {dtype:>5} {:>10.1} {:>9.1} {:>7.1}%",
                format!("{n}x{k}"),
                secs * 1e6,
                rate / 1e9,
                100.0 * rate / bw
            );
        }
    }

    println!("\nGEMM (k = 2048, bf16 weights):");
    println!("  {:>5} {:>6} {:>10} {:>9}", "m", "n", "ms/call", "GFLOP/s");
    for m in [32, 128, 512] {
        for n in [768, 2048, 4096] {
            let secs = gemm(DType::BF16, m, n, 2048, quick);
            let flops = 2.0 * (m * n * 2048) as f64;
            println!(
                "  {m:>5} {n:>6} {:>10.3} {:>9.1}",
                secs * 1e3,
                flops / secs / 1e9
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

/// Seconds per m = 1 product and bytes per product, cycling over copies of an `[n, k]` matrix
/// that together fill at least `working_set` bytes.
fn gemv_cold(dtype: DType, n: usize, k: usize, working_set: usize) -> (f64, usize) {
    let bytes = n * k * dtype.size();
    let copies = working_set.div_ceil(bytes).max(2);
    let mut data = vec![0u8; copies * bytes];
    fill(dtype, &mut data);
    let x: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let mut out = vec![0.0f32; n];
    let mat = |c: usize| MatRef {
        dtype,
        rows: n,
        cols: k,
        data: &data[c * bytes..(c + 1) * bytes],
    };
    // One full cycle to warm up (page tables, rayon threads), then whole cycles until at least
    // half a second has passed; the mean over those is reported.
    for c in 0..copies {
        matmul_t(&x, 1, mat(c), &mut out);
    }
    let start = Instant::now();
    let mut calls = 0;
    while calls < copies || start.elapsed() < Duration::from_millis(500) {
        matmul_t(&x, 1, mat(calls % copies), &mut out);
        calls += 1;
    }
    std::hint::black_box(&out);
    (start.elapsed().as_secs_f64() / calls as f64, bytes)
}

/// Best seconds per `[m, k] x [n, k]ᵀ` product over a few repeats.
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
}
