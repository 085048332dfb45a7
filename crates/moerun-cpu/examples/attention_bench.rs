//! Decode attention on the CPU: one token over a paged KV pool at Qwen3-30B-A3B's head shapes
//! (32 query / 4 KV heads of 128), f32 against bf16 storage, best of 7 rounds of 50 calls.
//!
//! `cargo run --release -p moerun-cpu --example attention_bench [-- KEYS]` (default 2048 keys)

use std::time::Instant;

use moerun_core::DType;
use moerun_cpu::attention::{paged_attention, AttentionShape, KvPool, TokenSlot};

fn main() {
    let keys: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2048);
    let (bs, kvh, d, heads) = (16, 4, 128, 32);
    let blocks = keys.div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let q: Vec<f32> = (0..heads * d).map(|j| (j as f32 * 0.3).cos()).collect();
    let shape = AttentionShape {
        num_heads: heads,
        num_kv_heads: kvh,
        head_dim: d,
        scale: (d as f32).powf(-0.5),
        sliding_window: None,
    };
    let slot = TokenSlot {
        block_table: &table,
        position: keys - 1,
    };
    for dtype in [DType::F32, DType::BF16] {
        let mut pool = KvPool::with_dtype(blocks, bs, kvh, d, dtype);
        for p in 0..keys {
            let row: Vec<f32> = (0..kvh * d)
                .map(|j| ((p * 7 + j) as f32 * 0.01).sin())
                .collect();
            pool.write(&table, p, &row, &row);
        }
        let mut out = vec![0.0; heads * d];
        let mut best = f64::MAX;
        for _ in 0..7 {
            let t = Instant::now();
            for _ in 0..50 {
                paged_attention(&q, &[slot], &pool, &shape, &mut out);
            }
            best = best.min(t.elapsed().as_secs_f64() / 50.0);
        }
        println!(
            "{dtype:>4} pool: {:7.1} us a token over {keys} keys ({:.1} MB of K/V)",
            best * 1e6,
            pool.bytes() as f64 / 1e6
        );
    }
}
