//! Attention rows of ops_bench, on Qwen3-30B-A3B's attention shape (32 query heads, 4 kv heads,
//! head_dim 128), block size 16, block tables of shuffled blocks:
//! - decode (split-K + combine), over an f32 pool and over a bf16 pool: GB/s = K and V rows read
//!   (batch x context x kv_heads x head_dim x 4 or 2 bytes x 2) over the time of one call; pools
//!   smaller than the L2 are cycled through copies (separate blocks) adding up to >= 512 MiB, as
//!   for the GEMV rows; `MOERUN_ATTN_BENCH_IN_ORDER=1` lays each sequence's blocks out in order
//!   instead of shuffled;
//! - prefill of one 4096-token sequence from position 0: TFLOP/s with causal FLOPs
//!   4 · n²/2 · heads · head_dim, exact f32 tiles, bf16 tensor-core tiles reading every key from
//!   the f32 pool, and the same reading the batch's own keys from a bf16 batch copy (what a
//!   model's prefill runs); then a 1024-token chunk after 3072 cached positions (FLOPs of the
//!   chunk's rows: 4 · heads · head_dim · sum of keys seen), whose cached keys always come from
//!   the pool.
//!
//! The tensor-core rows run once per build of the mma.sync kernel (1, 2 or 4 query heads per
//! block, see `CudaDevice::set_tensor_core_attention_heads`) and, on sm_90, once per two-head
//! build of the wgmma kernel (`CudaDevice::set_attention_wgmma`);
//! `MOERUN_ATTN_BENCH_NO_EXACT=1` leaves out the (slow) exact f32 row;
//! `MOERUN_ATTN_BENCH_WGMMA=4,6` runs only those wgmma builds.
//!
//! `MOERUN_ATTN_BENCH=decode` (or `prefill`) runs only those rows; `MOERUN_ATTN_BENCH_NCU=1`
//! times each decode row on one pool copy, for Nsight Compute: it flushes the caches before every
//! profiled kernel anyway, and 64 copies would mean over a thousand profiled launches per row.
//! Decode rows then launch 3 warm-ups + 15 timed calls each, in the order of [`rows`].

use moerun_cuda::{
    AttentionPrefill, AttentionShape, CudaDevice, CudaError, CudaSlice, DeviceKvPool, KvBuffersMut,
    KvDtype, Result, TokenPlacement,
};

/// Which tensor-core kernel a prefill row runs: the mma.sync build with this many query heads
/// per block, or wgmma build b (`CudaDevice::set_attention_wgmma`).
#[derive(Clone, Copy, PartialEq)]
enum Tc {
    MmaSync(usize),
    Wgmma(usize),
}

/// Where a prefill row's tensor-core tiles take the batch's own keys from.
#[derive(Clone, Copy, PartialEq)]
enum Keys {
    Pool,
    BatchCopy,
}

use super::{time, Row, XorShift, ROTATE_BYTES};

const HEADS: usize = 32;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 128;
const BLOCK: usize = 16;

fn shape() -> AttentionShape {
    AttentionShape {
        num_heads: HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        sliding_window: None,
    }
}

fn driver(e: impl std::fmt::Display) -> CudaError {
    CudaError::Unavailable(format!("bench copy: {e}"))
}

/// A pool of `blocks` blocks of random K/V stored as `dtype` (never zeros: they can time faster
/// than real data).
fn random_pool(
    dev: &CudaDevice,
    rng: &mut XorShift,
    blocks: usize,
    dtype: KvDtype,
) -> Result<DeviceKvPool> {
    let mut pool = dev.kv_pool_of(dtype, blocks, BLOCK, KV_HEADS, HEAD_DIM)?;
    let chunk_len = (16usize << 20).min(blocks * BLOCK * KV_HEADS * HEAD_DIM);
    match pool.buffers_mut() {
        KvBuffersMut::F32(k, v) => fill_cycling(dev, &dev.upload(&rng.f32s(chunk_len))?, [k, v])?,
        KvBuffersMut::Bf16(k, v) => {
            let bits: Vec<u16> = (0..chunk_len)
                .map(|_| half::bf16::from_f32(rng.next_f32()).to_bits())
                .collect();
            fill_cycling(dev, &dev.upload(&bits)?, [k, v])?
        }
    }
    Ok(pool)
}

/// Fill each buffer with copies of `chunk`.
fn fill_cycling<T: cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    chunk: &CudaSlice<T>,
    bufs: [&mut CudaSlice<T>; 2],
) -> Result<()> {
    for buf in bufs {
        let mut o = 0;
        while o < buf.len() {
            let len = chunk.len().min(buf.len() - o);
            dev.stream()
                .memcpy_dtod(&chunk.slice(..len), &mut buf.slice_mut(o..o + len))
                .map_err(driver)?;
            o += len;
        }
    }
    Ok(())
}

/// 0..n in a random order (Fisher-Yates).
fn permutation(rng: &mut XorShift, n: usize) -> Vec<i32> {
    let mut v: Vec<i32> = (0..n as i32).collect();
    for i in (1..n).rev() {
        let j = (((rng.next_f32() * 0.5 + 0.5) * (i + 1) as f32) as usize).min(i);
        v.swap(i, j);
    }
    v
}

fn decode_row(
    dev: &CudaDevice,
    rng: &mut XorShift,
    (batch, context): (usize, usize),
    dtype: KvDtype,
) -> Result<Row> {
    let per_seq = context.div_ceil(BLOCK);
    let bytes = batch * context * KV_HEADS * HEAD_DIM * dtype.size() * 2;
    let copies = if std::env::var_os("MOERUN_ATTN_BENCH_NCU").is_some() {
        1
    } else {
        ROTATE_BYTES.div_ceil(bytes).clamp(1, 64)
    };
    let pool = random_pool(dev, rng, copies * batch * per_seq, dtype)?;
    // MOERUN_ATTN_BENCH_IN_ORDER=1: each sequence's blocks one after another in the pool (as a
    // fresh cache hands them out), instead of shuffled.
    let tables = if std::env::var_os("MOERUN_ATTN_BENCH_IN_ORDER").is_some() {
        (0..(copies * batch * per_seq) as i32).collect()
    } else {
        permutation(rng, copies * batch * per_seq)
    };
    let tables = dev.upload(&tables)?;
    let positions = dev.upload(&vec![context as i32 - 1; batch])?;
    let starts: Vec<CudaSlice<i32>> = (0..copies)
        .map(|c| {
            let s: Vec<i32> = (0..batch)
                .map(|b| ((c * batch + b) * per_seq) as i32)
                .collect();
            dev.upload(&s)
        })
        .collect::<Result<_>>()?;
    let q = dev.upload(&rng.f32s(batch * HEADS * HEAD_DIM))?;
    let mut out = dev.zeros::<f32>(batch * HEADS * HEAD_DIM)?;
    let mut scratch = dev.attention_scratch(batch, HEADS, HEAD_DIM, context)?;
    let ms = time(dev, || {
        starts.iter().try_for_each(|st| {
            let at = TokenPlacement {
                positions: &positions,
                table_start: st,
                block_tables: &tables,
                max_context: context,
                seq_starts: &[],
            };
            dev.paged_attention(&q, &pool, &at, &shape(), &mut out, &mut scratch)
        })
    })? / copies as f64;
    Ok(Row {
        op: format!("attention decode b={batch} {dtype:?} pool"),
        shape: format!("ctx {context} 32/4x128"),
        us: ms * 1e3,
        gbs: Some(bytes as f64 / (ms * 1e-3) / 1e9),
        tflops: None,
    })
}

/// A prefill of `n` tokens after `cached` positions of one sequence.
fn prefill_row(
    dev: &CudaDevice,
    rng: &mut XorShift,
    (cached, n): (usize, usize),
    prefill: AttentionPrefill,
    keys: Keys,
    tc: Option<Tc>,
) -> Result<Row> {
    let total = cached + n;
    let blocks = total.div_ceil(BLOCK);
    let mut pool = random_pool(dev, rng, blocks, KvDtype::F32)?;
    let tables = dev.upload(&permutation(rng, blocks))?;
    let positions = dev.upload(&(cached as i32..total as i32).collect::<Vec<_>>())?;
    let starts = dev.upload(&vec![0i32; n])?;
    let at = TokenPlacement {
        positions: &positions,
        table_start: &starts,
        block_tables: &tables,
        max_context: total,
        seq_starts: &[0],
    };
    // The batch's own K/V, written as a pass writes them (pool and, for the copy rows, copy).
    let width = KV_HEADS * HEAD_DIM;
    let (k, v) = (
        dev.upload(&rng.f32s(n * width))?,
        dev.upload(&rng.f32s(n * width))?,
    );
    let mut copy = dev.batch_kv_bf16(n, KV_HEADS, HEAD_DIM)?;
    let own = (keys == Keys::BatchCopy).then_some(&mut copy);
    dev.kv_write_with_copy(&mut pool, &k, &v, &at, own)?;
    let q = dev.upload(&rng.f32s(n * HEADS * HEAD_DIM))?;
    let mut out = dev.zeros::<f32>(n * HEADS * HEAD_DIM)?;
    let mut scratch = dev.attention_scratch(n, HEADS, HEAD_DIM, total)?;
    match tc {
        Some(Tc::MmaSync(heads)) => {
            dev.set_attention_wgmma(Some(0))?;
            dev.set_tensor_core_attention_heads(Some(heads))?;
        }
        Some(Tc::Wgmma(b)) => dev.set_attention_wgmma(Some(b))?,
        None => {}
    }
    let own_keys = keys == Keys::BatchCopy && cached == 0;
    let wgmma_build = dev.attention_wgmma_build(HEAD_DIM, HEADS / KV_HEADS, own_keys);
    let heads = match tc {
        Some(Tc::MmaSync(h)) => format!(", mma.sync {h} heads/block"),
        Some(Tc::Wgmma(b)) => format!(
            ", {}",
            wgmma_build.map_or(format!("wgmma {b} (not on this device)"), str::to_string)
        ),
        None if prefill == AttentionPrefill::TensorCoreBf16 => {
            format!(", default ({})", wgmma_build.unwrap_or("mma.sync"))
        }
        None => String::new(),
    };
    let ms = time(dev, || match keys {
        Keys::Pool => {
            dev.paged_attention_with(prefill, &q, &pool, &at, &shape(), &mut out, &mut scratch)
        }
        Keys::BatchCopy => {
            dev.paged_attention_batch_copy(&q, &pool, &copy, &at, &shape(), &mut out, &mut scratch)
        }
    });
    dev.set_tensor_core_attention_heads(None)?;
    dev.set_attention_wgmma(None)?;
    let ms = ms?;
    // Row i sees cached + i + 1 keys.
    let seen = (n * cached) as f64 + (n * (n + 1)) as f64 / 2.0;
    let flops = 4.0 * seen * (HEADS * HEAD_DIM) as f64;
    let source = match keys {
        Keys::Pool => "",
        Keys::BatchCopy => " + batch copy",
    };
    Ok(Row {
        op: format!("attention prefill {prefill:?}{source}{heads}"),
        shape: format!("n={n} after {cached} 32/4x128"),
        us: ms * 1e3,
        gbs: None,
        tflops: Some(flops / (ms * 1e-3) / 1e12),
    })
}

/// (batch, context) of the decode rows: batch 1 across contexts (the latency-bound decode step of
/// one sequence), then batches 8 to 128.
const DECODE_ROWS: [(usize, usize); 11] = [
    (1, 512),
    (1, 2048),
    (1, 4096),
    (1, 8192),
    (8, 512),
    (8, 4096),
    (32, 512),
    (32, 4096),
    (128, 512),
    (128, 4096),
    (8, 8192),
];

/// Every attention row.
pub fn rows(dev: &CudaDevice, rng: &mut XorShift) -> Result<Vec<Row>> {
    let only = std::env::var("MOERUN_ATTN_BENCH").unwrap_or_default();
    let mut rows = Vec::new();
    if only.is_empty() || only == "decode" {
        for row in DECODE_ROWS {
            for dtype in [KvDtype::F32, KvDtype::Bf16] {
                rows.push(decode_row(dev, rng, row, dtype)?);
            }
        }
    }
    if only.is_empty() || only == "prefill" {
        let (exact, tensor) = (AttentionPrefill::ExactF32, AttentionPrefill::TensorCoreBf16);
        if std::env::var_os("MOERUN_ATTN_BENCH_NO_EXACT").is_none() {
            rows.push(prefill_row(dev, rng, (0, 4096), exact, Keys::Pool, None)?);
        }
        // The tensor-core rows with the mma.sync builds (query heads per block) and the wgmma
        // builds (sm_90 only).
        let wgmma = dev
            .attention_wgmma_build(HEAD_DIM, HEADS / KV_HEADS, false)
            .is_some();
        // MOERUN_ATTN_BENCH_WGMMA=4,6 runs only those wgmma builds (default: all).
        let builds: Vec<usize> = std::env::var("MOERUN_ATTN_BENCH_WGMMA")
            .ok()
            .map(|v| v.split(',').filter_map(|b| b.trim().parse().ok()).collect())
            .unwrap_or_else(|| (1..=7).collect());
        for (chunk, keys) in [
            ((0, 4096), Keys::Pool),
            ((0, 4096), Keys::BatchCopy),
            ((3072, 1024), Keys::Pool),
            ((3072, 1024), Keys::BatchCopy),
        ] {
            // The default tile kernel, each mma.sync head count, then each wgmma build.
            let mma = [1, 2, 4].map(Tc::MmaSync);
            let wgmma_builds = builds.iter().filter(|_| wgmma).map(|&b| Tc::Wgmma(b));
            let tiles = mma.into_iter().chain(wgmma_builds).map(Some);
            for tc in std::iter::once(None).chain(tiles) {
                rows.push(prefill_row(dev, rng, chunk, tensor, keys, tc)?);
            }
        }
    }
    Ok(rows)
}
