//! Gemma 4's decoder layers on the GPU against the CPU's, one at a time on the same inputs: every
//! layer of the f32 fixtures (sliding and full attention, K/V-sharing layers, per-layer inputs,
//! the MoE block), first a prefill chunk that runs past the sliding window, then a decode step
//! after it. Without a GPU each test prints "skipped: <reason>".

use std::path::Path;

use moerun_core::{BlockTable, Device};

use crate::batch::{Batch, SeqChunk};
use crate::kv::KvCache;
use crate::Model;

use super::tests::rel;

/// Deterministic values in [-a, a).
fn values(n: usize, seed: u64, a: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
        })
        .collect()
}

#[test]
fn every_gemma4_layer_matches_the_cpu_in_prefill_and_decode() {
    let mut failures = Vec::new();
    for name in [
        "gemma4_moe_f32",
        "gemma4_moe_kv_shared_ple_f32",
        "gemma4_dense_defaults_f32",
    ] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name);
        let gpu = match Model::load_on(&dir, Device::Cuda(0)) {
            Ok(m) => m,
            Err(e) if e.to_string().contains("CUDA is unavailable") => {
                println!("skipped: {e}");
                return;
            }
            Err(e) => panic!("{name}: {e}"),
        };
        let cpu = Model::load(&dir).unwrap();
        let cfg = &cpu.config;
        let g = cfg.gemma4.as_ref().unwrap();
        let (wc, wg) = (
            cpu.weights.gemma4.as_ref().unwrap(),
            gpu.weights.gemma4.as_ref().unwrap(),
        );
        let h = cfg.hidden_size;
        // 20 tokens: past every fixture's window (9 to 12) and across blocks of 8.
        let table = BlockTable {
            blocks: vec![2, 0, 3, 1],
        };
        let (prefill, decode) = (vec![1u32; 20], vec![1u32; 1]);
        let batches = [
            Batch::new(vec![SeqChunk {
                tokens: &prefill,
                start_pos: 0,
                block_table: &table,
            }]),
            Batch::new(vec![SeqChunk {
                tokens: &decode,
                start_pos: 20,
                block_table: &table,
            }]),
        ];
        let mut cpu_kv = KvCache::new(cfg, 4, 8);
        let mut gpu_kv = gpu.new_kv_cache(4, 8).unwrap();
        let cuda = gpu.cuda().unwrap();
        for (step, batch) in ["prefill", "decode"].iter().zip(&batches) {
            let n = batch.num_tokens();
            for l in 0..cfg.num_layers() {
                let x = values(n * h, (l * 7 + n) as u64, 2.0);
                let ple = g.per_layer_input.map(|p| {
                    (
                        values(n * g.layers.len() * p.width, l as u64 + 99, 1.0),
                        p.width,
                    )
                });
                let ple_ref = ple.as_ref().map(|(v, w)| (v.as_slice(), *w));
                let mut want = x.clone();
                crate::gemma4::forward::layer_alone(
                    cfg,
                    wc,
                    batch,
                    &mut cpu_kv,
                    l,
                    &mut want,
                    ple_ref,
                );
                let got = crate::gemma4::cuda::layer_alone(
                    cuda,
                    gpu_kv.device.as_mut().unwrap(),
                    cfg,
                    wg,
                    batch,
                    l,
                    &x,
                    ple_ref,
                )
                .unwrap();
                let e = rel(&got, &want);
                let kind = if g.layers[l].sliding {
                    "sliding"
                } else {
                    "full"
                };
                let verdict = if e <= 1e-5 { "ok" } else { "FAIL" };
                println!("RESULT|gemma4 {name} layer {l} ({kind}) {step}|{e:.2e}|1e-5|{verdict}");
                if e > 1e-5 {
                    failures.push(format!("{name} layer {l} ({kind}) {step}: {e:.3e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
