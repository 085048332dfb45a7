//! MoE routed-experts rows of ops_bench, on Qwen3-30B-A3B's layer (128 experts, top-8, H 2048,
//! I 768, bf16: 9.4 MB per expert, 1.2 GB per layer), routings of k distinct uniform experts per
//! token:
//! - decode: GB/s = (distinct experts the batch routes to x 9.4 MB + x and out) over the time of
//!   one call. Calls alternate between two layers (2.4 GB) and 8 routings, so no call finds its
//!   experts in the 60 MB L2. Batch 1 is also timed as a CUDA graph of 16 calls, which removes
//!   the launch gaps a captured decode step would not have.
//! - prefill: TFLOP/s = 2 · n · k · 3 · H · I over the time of one call, host sync included.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use moerun_core::DType;
use moerun_cuda::{
    CudaDevice, CudaError, CudaSlice, DecodePass, DeviceExperts, MoePath, MoeScratch, Result,
    WgmmaTile,
};

use super::{time, Row, XorShift};

const EXPERTS: usize = 128;
const TOP_K: usize = 8;
const HIDDEN: usize = 2048;
const INTER: usize = 768;
const LAYERS: usize = 2;
const ROUTINGS: usize = 8;
const GRAPH_CALLS: usize = 16;

/// A path to time, and the decode pass it is forced to (None: the rule's).
type Run = (MoePath, Option<DecodePass>);

fn driver(e: impl std::fmt::Display) -> CudaError {
    CudaError::Unavailable(format!("bench: {e}"))
}

/// `len` bytes on the device, tiled with a random bf16 pattern (never zeros).
fn filled(dev: &CudaDevice, pattern: &[u8], len: usize) -> Result<CudaSlice<u8>> {
    let mut buf = dev.zeros::<u8>(len)?;
    let mut at = 0;
    while at < len {
        let n = pattern.len().min(len - at);
        dev.stream()
            .memcpy_htod(&pattern[..n], &mut buf.slice_mut(at..at + n))
            .map_err(driver)?;
        at += n;
    }
    Ok(buf)
}

/// One routing on the device, and how many distinct experts it touches.
struct Routing {
    ids: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    distinct: usize,
}

fn routing(dev: &CudaDevice, rng: &mut XorShift, tokens: usize) -> Result<Routing> {
    let mut ids = Vec::with_capacity(tokens * TOP_K);
    let mut used = [false; EXPERTS];
    for _ in 0..tokens {
        let mut pool: Vec<u32> = (0..EXPERTS as u32).collect();
        for i in 0..TOP_K {
            let j = i + ((rng.next_f32() * 0.5 + 0.5) * (EXPERTS - i) as f32) as usize;
            pool.swap(i, j.min(EXPERTS - 1));
        }
        for &e in &pool[..TOP_K] {
            used[e as usize] = true;
        }
        ids.extend_from_slice(&pool[..TOP_K]);
    }
    let weights: Vec<f32> = rng
        .f32s(tokens * TOP_K)
        .iter()
        .map(|v| v.abs() + 0.01)
        .collect();
    Ok(Routing {
        ids: dev.upload(&ids)?,
        weights: dev.upload(&weights)?,
        distinct: used.iter().filter(|&&u| u).count(),
    })
}

pub fn rows(dev: &CudaDevice, rng: &mut XorShift) -> Result<Vec<Row>> {
    let pattern = rng.bf16_bytes(16 << 20);
    let mat = HIDDEN * INTER * 2;
    let layers: Vec<DeviceExperts> = (0..LAYERS)
        .map(|_| {
            let gate_up = filled(dev, &pattern, 2 * EXPERTS * mat)?;
            let down = filled(dev, &pattern, EXPERTS * mat)?;
            dev.experts_from_parts(DType::BF16, EXPERTS, HIDDEN, INTER, gate_up, down)
        })
        .collect::<Result<_>>()?;
    let mut scratch = dev.moe_scratch(&layers[0], 4096, TOP_K)?;
    let per_expert = layers[0].bytes_per_expert();
    let shape = format!("E{EXPERTS} k{TOP_K} {HIDDEN}x{INTER}");
    let mut rows = Vec::new();
    use DecodePass::{Eight, Four, One, Tiny};
    use MoePath::{Decode, Prefill, PrefillCublas, PrefillPerExpert};
    let plan: [(usize, &[Run]); 9] = [
        (1, &[(Decode, Some(Tiny)), (Decode, Some(One))]),
        (4, &[(Decode, Some(Tiny)), (Decode, Some(One))]),
        (8, &[(Decode, Some(One)), (Decode, Some(Four))]),
        (
            32,
            &[(Decode, Some(One)), (Decode, Some(Four)), (Prefill, None)],
        ),
        (64, &[(Decode, Some(Four)), (Prefill, None)]),
        (
            128,
            &[
                (Decode, Some(Four)),
                (Decode, Some(Eight)),
                (Prefill, None),
                (PrefillCublas, None),
                (PrefillPerExpert, None),
            ],
        ),
        (
            512,
            &[(Decode, Some(Four)), (Prefill, None), (PrefillCublas, None)],
        ),
        (1024, &[(Prefill, None), (PrefillCublas, None)]),
        (
            4096,
            &[
                (Prefill, None),
                (PrefillCublas, None),
                (PrefillPerExpert, None),
            ],
        ),
    ];
    for (n, runs) in plan {
        let x = dev.upload(&rng.f32s(n * HIDDEN))?;
        let routings: Vec<Routing> = (0..ROUTINGS)
            .map(|_| routing(dev, rng, n))
            .collect::<Result<_>>()?;
        let mut out = dev.zeros::<f32>(n * HIDDEN)?;
        let distinct = routings.iter().map(|r| r.distinct).sum::<usize>() as f64 / ROUTINGS as f64;
        let bytes = distinct * per_expert as f64 + (2 * n * HIDDEN * 4) as f64;
        let flops = 2.0 * (n * TOP_K * 3 * HIDDEN * INTER) as f64;
        // On sm_90 the prefill rows are the wgmma path: N256 and pairs, and N128 from 1024 tokens.
        let wgmma = dev.has_wgmma();
        let tiles: &[WgmmaTile] = if wgmma && n >= 1024 {
            &[WgmmaTile::N256, WgmmaTile::N128, WgmmaTile::N256Pair]
        } else if wgmma {
            &[WgmmaTile::N256, WgmmaTile::N256Pair]
        } else {
            &[WgmmaTile::N256]
        };
        let runs = runs.iter().flat_map(|&(path, pass)| {
            let each = if path == Prefill { tiles } else { &tiles[..1] };
            each.iter().map(move |&tile| (path, pass, tile))
        });
        for (path, pass, tile) in runs {
            scratch.set_path(Some(path));
            scratch.set_decode_pass(pass);
            scratch.set_wgmma_tile(tile);
            let mut call = 0usize;
            let ms = time(dev, || {
                let r = &routings[call % ROUTINGS];
                let layer = &layers[call % LAYERS];
                call += 1;
                dev.moe_experts(&x, &r.ids, &r.weights, TOP_K, layer, &mut scratch, &mut out)
            })?;
            let name = match (path, pass) {
                (Decode, Some(Tiny)) => format!("moe decode n={n} tiny"),
                (Decode, Some(p)) => format!("moe decode n={n} pass={}", p.tokens()),
                (Decode, None) => format!("moe decode n={n}"),
                (Prefill, _) if wgmma => format!("moe prefill wgmma {tile:?} n={n}"),
                (Prefill | PrefillCublas, _) => format!("moe prefill grouped n={n}"),
                (PrefillPerExpert, _) => format!("moe prefill per-expert n={n}"),
            };
            rows.push(Row {
                op: name,
                shape: shape.clone(),
                us: ms * 1e3,
                gbs: (path == Decode).then(|| bytes / (ms * 1e-3) / 1e9),
                tflops: Some(flops / (ms * 1e-3) / 1e12),
            });
        }
        if n == 1 {
            for pass in [Tiny, One] {
                let ms = graph_ms(dev, &x, &routings, &layers, &mut scratch, &mut out, pass)?;
                rows.push(Row {
                    op: format!("moe decode n=1 {pass:?} graph x{GRAPH_CALLS}"),
                    shape: shape.clone(),
                    us: ms * 1e3,
                    gbs: Some(bytes / (ms * 1e-3) / 1e9),
                    tflops: Some(flops / (ms * 1e-3) / 1e12),
                });
            }
        }
    }
    scratch.set_path(None);
    scratch.set_decode_pass(None);
    Ok(rows)
}

/// Milliseconds per call of decode calls replayed from one CUDA graph of [`GRAPH_CALLS`] calls.
fn graph_ms(
    dev: &CudaDevice,
    x: &CudaSlice<f32>,
    routings: &[Routing],
    layers: &[DeviceExperts],
    scratch: &mut MoeScratch,
    out: &mut CudaSlice<f32>,
    pass: DecodePass,
) -> Result<f64> {
    scratch.set_path(Some(MoePath::Decode));
    scratch.set_decode_pass(Some(pass));
    let stream = dev.stream();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(driver)?;
    let captured = (0..GRAPH_CALLS).try_for_each(|c| {
        let r = &routings[c % routings.len()];
        let layer = &layers[c % layers.len()];
        dev.moe_experts(x, &r.ids, &r.weights, TOP_K, layer, scratch, out)
    });
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(driver)?;
    captured?;
    let graph = graph.ok_or_else(|| driver("capture made no graph"))?;
    Ok(time(dev, || graph.launch().map_err(driver))? / GRAPH_CALLS as f64)
}
