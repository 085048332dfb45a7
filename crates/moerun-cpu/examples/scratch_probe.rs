//! Temporary experiments (to be deleted).
use moerun_core::{DType, MatRef};
use moerun_cpu::linear::matmul_t;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args[1].parse().unwrap();
    let k: usize = args[2].parse().unwrap();
    let threads: usize = args[3].parse().unwrap();
    let dtype = if args.get(4).map(|s| s.as_str()) == Some("f32") {
        DType::F32
    } else {
        DType::BF16
    };
    let bytes = n * k * dtype.size();
    let copies = if std::env::var("HOT").is_ok() {
        1
    } else {
        (1usize << 30).div_ceil(bytes).max(2)
    };
    let data = vec![0x11u8; copies * bytes];
    let x = vec![0.5f32; k];
    let mut out = vec![0.0f32; n];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let mut best = f64::MAX;
        for rep in 0..40 {
            let t = Instant::now();
            for c in 0..copies {
                let w = MatRef {
                    dtype,
                    rows: n,
                    cols: k,
                    data: &data[c * bytes..(c + 1) * bytes],
                };
                matmul_t(&x, 1, w, &mut out);
            }
            if rep > 0 {
                best = best.min(t.elapsed().as_secs_f64() / copies as f64);
            }
        }
        println!(
            "{n}x{k} {dtype} threads={threads}: {:.1} us/call {:.1} GB/s",
            best * 1e6,
            bytes as f64 / best / 1e9
        );
    });
}
