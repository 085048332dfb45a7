//! Paged attention on the GPU against moerun-cpu's `paged_attention`, on fresh random pools:
//! several sequences per batch, block tables of shuffled (non-contiguous, out-of-order) blocks,
//! positions crossing blocks, cached history written by an earlier `kv_write` (chunked prefill),
//! sliding windows, GQA ratios 1 to 16, head dims 16 to 256.
//!
//! Thresholds (norm-wise relative error against the CPU's f32 output): the exact paths (split-K
//! decode, combine, f32 tiles) 1e-5 — both sides are f32, only the summation order, exp2 vs exp
//! and the scale folded into q separate them (measured <= 1.3e-6). The tensor-core path 1e-2: q,
//! k, v and the softmax weights are rounded to bf16 (relative 2^-9 each; measured <= 2.3e-3).
//! Outputs start as NaN, so an element no kernel wrote fails. The tensor-core path reading the
//! batch's own K/V from a bf16 batch copy must equal the same kernel reading them from the f32
//! pool bit for bit (both round the same f32 values to bf16), and each build of the mma.sync kernel
//! (1, 2 or 4 query heads per block) must equal the others bit for bit (the same arithmetic per
//! row), as must each build of the wgmma kernel (sm_90, head_dim 128: the default there; it sums
//! in another order than mma.sync, so the two agree only within the bf16 tolerance).
//! Without a GPU every test prints "skipped: CUDA is unavailable: <reason>" and passes.

mod common;

// Every test holds `device_alone`: some switch the prefill attention build (`set_attention_wgmma`,
// device-wide) while others compare paths bit for bit.
use common::{check, device, device_alone, poison, rel_err, rng, uniform};
use moerun_core::DType;
use moerun_cpu::attention::{
    paged_attention as cpu_attention, AttentionShape as CpuShape, KvPool, TokenSlot,
};
use moerun_cuda::{
    AttentionPrefill, AttentionScratch, AttentionShape, CudaDevice, CudaError, CudaSlice,
    DeviceKvPool, DeviceRope, KvBuffersMut, KvDtype, QkvShape, TokenPlacement,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

const EXACT_TOL: f64 = 1e-5;
const BF16_TOL: f64 = 1e-2;

/// One batch to attend: per sequence `(cached, new)`: positions already in the pool, then the
/// batch's tokens at the positions after them.
struct Case<'a> {
    name: String,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    window: Option<usize>,
    seqs: &'a [(usize, usize)],
    /// Batch tokens in round-robin order over the sequences instead of grouped per sequence, so
    /// no 64-token tile belongs to one sequence.
    interleave: bool,
    prefill: AttentionPrefill,
    /// q is uniform in [-q_range, q_range]: larger makes the softmax sharper.
    q_range: f32,
    /// The host's bound on the context, if not the true one (an underestimate must still be
    /// exact).
    max_context: Option<usize>,
    /// Also write the batch's K/V into a bf16 batch copy and run the tensor-core kernel from it;
    /// its output must equal the pool-only run's bit for bit (the error reported is the copy
    /// run's).
    batch_copy: bool,
    /// Batch rows in this order of the grouped (or interleaved) list: `order[i]` is the index
    /// there of row i.
    order: Option<Vec<usize>>,
    /// Also run the mma.sync tensor-core kernel with 1, 2 and 4 query heads per block (each from
    /// the pool and, with `batch_copy`, from the copy); every run must equal the mma.sync
    /// default's bit for bit.
    variants: bool,
    /// Also run each two-head wgmma build (sm_90, head_dim 128; elsewhere the same kernel runs
    /// again), from the pool and with `batch_copy` from the copy: every run must equal the
    /// default's bit for bit.
    wgmma_builds: bool,
    /// The pools (the GPU's and the CPU reference's) store this. With bf16 every path run from
    /// the pool (and from the copy) must also equal, bit for bit, the same path over an f32 pool
    /// that holds the rounded values.
    kv_dtype: KvDtype,
}

impl Case<'_> {
    fn new(name: impl Into<String>, (heads, kv_heads, head_dim): (usize, usize, usize)) -> Self {
        Case {
            name: name.into(),
            heads,
            kv_heads,
            head_dim,
            block_size: 16,
            window: None,
            seqs: &[],
            interleave: false,
            prefill: AttentionPrefill::ExactF32,
            q_range: 1.0,
            max_context: None,
            batch_copy: false,
            order: None,
            variants: false,
            wgmma_builds: false,
            kv_dtype: KvDtype::F32,
        }
    }
}

/// Blocks for each sequence from one shuffled list of the pool's blocks: the flat block table
/// and where each sequence's table starts.
fn block_tables(
    r: &mut StdRng,
    lens: &[usize],
    bs: usize,
    spare: usize,
) -> (Vec<i32>, Vec<usize>, usize) {
    let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let total = need.iter().sum::<usize>() + spare;
    let mut ids: Vec<i32> = (0..total as i32).collect();
    ids.shuffle(r);
    let mut starts = Vec::new();
    let mut at = 0;
    for n in need {
        starts.push(at);
        at += n;
    }
    ids.truncate(at);
    (ids, starts, total)
}

/// Upload a placement's three i32 buffers.
fn placement_buffers(
    dev: &CudaDevice,
    positions: &[i32],
    starts: &[i32],
    tables: &[i32],
) -> (CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>) {
    (
        dev.upload(positions).unwrap(),
        dev.upload(starts).unwrap(),
        dev.upload(tables).unwrap(),
    )
}

/// Run `case` on the GPU and the CPU; returns the relative error of the GPU's output.
fn run_case(dev: &CudaDevice, r: &mut StdRng, case: &Case) -> f64 {
    let (h, kvh, d, bs) = (case.heads, case.kv_heads, case.head_dim, case.block_size);
    let width = kvh * d;
    let lens: Vec<usize> = case.seqs.iter().map(|&(c, n)| c + n).collect();
    let (tables, starts, blocks) = block_tables(r, &lens, bs, 3);
    let table_of = |s: usize| -> Vec<u32> {
        tables[starts[s]..starts[s] + lens[s].div_ceil(bs)]
            .iter()
            .map(|&b| b as u32)
            .collect()
    };

    // (sequence, position) of the history and of the batch.
    let history: Vec<(usize, usize)> = case
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(s, &(cached, _))| (0..cached).map(move |p| (s, p)))
        .collect();
    let mut batch: Vec<(usize, usize)> = Vec::new();
    if case.interleave {
        let most = case.seqs.iter().map(|&(_, n)| n).max().unwrap_or(0);
        for j in 0..most {
            for (s, &(cached, new)) in case.seqs.iter().enumerate() {
                if j < new {
                    batch.push((s, cached + j));
                }
            }
        }
    } else {
        for (s, &(cached, new)) in case.seqs.iter().enumerate() {
            batch.extend((0..new).map(|j| (s, cached + j)));
        }
    }
    if let Some(order) = &case.order {
        assert_eq!(
            order.len(),
            batch.len(),
            "{}: order is a permutation",
            case.name
        );
        batch = order.iter().map(|&i| batch[i]).collect();
    }
    let n = batch.len();
    let mut copy = case
        .batch_copy
        .then(|| dev.batch_kv_bf16(n.max(1), kvh, d).unwrap());

    let cpu_dtype = match case.kv_dtype {
        KvDtype::F32 => DType::F32,
        KvDtype::Bf16 => DType::BF16,
    };
    let mut cpu_pool = KvPool::with_dtype(blocks, bs, kvh, d, cpu_dtype);
    let mut gpu_pool = dev.kv_pool_of(case.kv_dtype, blocks, bs, kvh, d).unwrap();
    // A bf16 pool's twin: an f32 pool of the values rounded on the host.
    let mut rounded_pool =
        (case.kv_dtype == KvDtype::Bf16).then(|| dev.kv_pool(blocks, bs, kvh, d).unwrap());
    let tables_d = dev.upload(&tables).unwrap();
    for (tokens, own) in [(&history, false), (&batch, true)] {
        if tokens.is_empty() {
            continue;
        }
        let k = uniform(r, tokens.len() * width, -1.0, 1.0);
        let v = uniform(r, tokens.len() * width, -1.0, 1.0);
        for (i, &(s, p)) in tokens.iter().enumerate() {
            let row = i * width..(i + 1) * width;
            cpu_pool.write(&table_of(s), p, &k[row.clone()], &v[row]);
        }
        let pos: Vec<i32> = tokens.iter().map(|&(_, p)| p as i32).collect();
        let st: Vec<i32> = tokens.iter().map(|&(s, _)| starts[s] as i32).collect();
        let (pos_d, st_d) = (dev.upload(&pos).unwrap(), dev.upload(&st).unwrap());
        let at = TokenPlacement {
            positions: &pos_d,
            table_start: &st_d,
            block_tables: &tables_d,
            max_context: 1,
            seq_starts: &[],
        };
        let (kd, vd) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
        let copy = if own { copy.as_mut() } else { None };
        dev.kv_write_with_copy(&mut gpu_pool, &kd, &vd, &at, copy)
            .unwrap();
        if let Some(twin) = rounded_pool.as_mut() {
            let round = |x: &[f32]| -> Vec<f32> {
                x.iter()
                    .map(|&x| half::bf16::from_f32(x).to_f32())
                    .collect()
            };
            let (kr, vr) = (
                dev.upload(&round(&k)).unwrap(),
                dev.upload(&round(&v)).unwrap(),
            );
            dev.kv_write(twin, &kr, &vr, &at).unwrap();
        }
    }

    let q = uniform(r, n * h * d, -case.q_range, case.q_range);
    let scale = 1.0 / (d as f32).sqrt();
    let cpu_shape = CpuShape {
        num_heads: h,
        num_kv_heads: kvh,
        head_dim: d,
        scale,
        sliding_window: case.window,
    };
    let cpu_tables: Vec<Vec<u32>> = (0..case.seqs.len()).map(table_of).collect();
    let slots: Vec<TokenSlot> = batch
        .iter()
        .map(|&(s, p)| TokenSlot {
            block_table: &cpu_tables[s],
            position: p,
        })
        .collect();
    let mut want = vec![0.0f32; n * h * d];
    cpu_attention(&q, &slots, &cpu_pool, &cpu_shape, &mut want);

    let pos: Vec<i32> = batch.iter().map(|&(_, p)| p as i32).collect();
    let st: Vec<i32> = batch.iter().map(|&(s, _)| starts[s] as i32).collect();
    let (pos_d, st_d, _) = placement_buffers(dev, &pos, &st, &[0]);
    let max_context = case
        .max_context
        .unwrap_or_else(|| lens.iter().copied().max().unwrap_or(1));
    // Where each run of one sequence's tokens begins: the split kernel's grid then starts at the
    // first token no tile owns (a wrong start would leave tokens unattended: NaN-poisoned out).
    let seq_starts: Vec<usize> = (0..n)
        .filter(|&i| i == 0 || batch[i].0 != batch[i - 1].0)
        .collect();
    let at = TokenPlacement {
        positions: &pos_d,
        table_start: &st_d,
        block_tables: &tables_d,
        max_context,
        seq_starts: &seq_starts,
    };
    let shape = AttentionShape {
        num_heads: h,
        num_kv_heads: kvh,
        head_dim: d,
        scale,
        sliding_window: case.window,
    };
    let mut scratch = dev.attention_scratch(n, h, d, max_context).unwrap();
    let qd = dev.upload(&q).unwrap();
    // The case's prefill path from `pool` into a poisoned output, downloaded.
    let from = |pool: &DeviceKvPool, scratch: &mut AttentionScratch| {
        let mut out = dev.upload(&poison(n * h * d)).unwrap();
        dev.paged_attention_with(case.prefill, &qd, pool, &at, &shape, &mut out, scratch)
            .unwrap();
        dev.download(&out).unwrap()
    };
    let from_pool = |scratch: &mut AttentionScratch| from(&gpu_pool, scratch);
    let mut got = from_pool(&mut scratch);
    // The case's tensor-core path from the batch copy (and `pool` for earlier keys) into a
    // poisoned output, downloaded.
    let from_copy_and = |gpu_pool: &DeviceKvPool, scratch: &mut AttentionScratch| {
        copy.as_ref().map(|copy| {
            let mut out = dev.upload(&poison(n * h * d)).unwrap();
            dev.paged_attention_batch_copy(&qd, gpu_pool, copy, &at, &shape, &mut out, scratch)
                .unwrap();
            let got = dev.download(&out).unwrap();
            // With a bf16 output too: the same f32 values, and bf16 rows that are exactly
            // to_bf16 of them (the tile kernel's own stores and the converted rest alike).
            let mut out = dev.upload(&poison(n * h * d)).unwrap();
            let mut out_b = dev.upload(&vec![0xffffu16; n * h * d]).unwrap();
            dev.paged_attention_batch_copy_with_bf16(
                &qd, gpu_pool, copy, &at, &shape, &mut out, &mut out_b, scratch,
            )
            .unwrap();
            let mut rounded = dev.upload(&vec![0u16; n * h * d]).unwrap();
            dev.to_bf16(&out, &mut rounded).unwrap();
            assert_eq!(
                dev.download(&out).unwrap(),
                got,
                "{}: f32 out with bf16",
                case.name
            );
            assert!(
                dev.download(&out_b).unwrap() == dev.download(&rounded).unwrap(),
                "{}: the bf16 output is not the f32 output rounded",
                case.name
            );
            got
        })
    };
    let from_copy = |scratch: &mut AttentionScratch| from_copy_and(&gpu_pool, scratch);
    if let Some(twin) = &rounded_pool {
        let mut differing = count_differing(&from(twin, &mut scratch), &got);
        if let (Some(a), Some(b)) = (from_copy(&mut scratch), from_copy_and(twin, &mut scratch)) {
            differing += count_differing(&a, &b);
        }
        check(
            &format!(
                "attention {} bf16 pool vs an f32 pool of the rounded values (elements differing)",
                case.name
            ),
            differing as f64,
            0.0,
        );
    }
    if case.wgmma_builds {
        for build in 1..=7 {
            dev.set_attention_wgmma(Some(build)).unwrap();
            let mut differing = count_differing(&from_pool(&mut scratch), &got);
            if let Some(c) = from_copy(&mut scratch) {
                differing += count_differing(&c, &got);
            }
            check(
                &format!(
                    "attention {} wgmma build {build} vs default (elements differing)",
                    case.name
                ),
                differing as f64,
                0.0,
            );
        }
        dev.set_attention_wgmma(None).unwrap();
    }
    if case.variants {
        // The mma.sync builds against the mma.sync default (on sm_90 the default for head_dim
        // 128 is the wgmma kernel, whose accumulation order differs).
        dev.set_attention_wgmma(Some(0)).unwrap();
        let base = from_pool(&mut scratch);
        let differ = |a: &[f32]| count_differing(a, &base);
        for heads in [1, 2, 4] {
            dev.set_tensor_core_attention_heads(Some(heads)).unwrap();
            let mut differing = differ(&from_pool(&mut scratch));
            if let Some(c) = from_copy(&mut scratch) {
                differing += differ(&c);
            }
            check(
                &format!(
                    "attention {} {heads} heads per block vs default (elements differing)",
                    case.name
                ),
                differing as f64,
                0.0,
            );
        }
        dev.set_tensor_core_attention_heads(None).unwrap();
        dev.set_attention_wgmma(None).unwrap();
    }
    if let Some(from_copy) = from_copy(&mut scratch) {
        check(
            &format!(
                "attention {} batch copy vs pool (elements differing)",
                case.name
            ),
            count_differing(&from_copy, &got) as f64,
            0.0,
        );
        got = from_copy;
    }
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    rel_err(&got, &want)
}

fn run_and_check(dev: &CudaDevice, r: &mut StdRng, case: &Case) {
    let tol = match case.prefill {
        AttentionPrefill::ExactF32 => EXACT_TOL,
        AttentionPrefill::TensorCoreBf16 => BF16_TOL,
    };
    check(
        &format!("attention {}", case.name),
        run_case(dev, r, case),
        tol,
    );
}

#[test]
fn kv_write_puts_each_row_in_its_block_and_slot_and_skips_out_of_range_blocks() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("kv_write");
    let (blocks, bs, kvh, d) = (6usize, 4usize, 2usize, 8usize);
    let width = kvh * d;
    // Two sequences: tables [4, 1, 5] and [0, 99 (out of range)].
    let tables = vec![4, 1, 5, 0, 99];
    let tokens: Vec<(i32, i32)> = vec![(0, 0), (0, 3), (0, 4), (0, 9), (3, 2), (3, 5)];
    let k = uniform(&mut r, tokens.len() * width, -1.0, 1.0);
    let v = uniform(&mut r, tokens.len() * width, -1.0, 1.0);
    let mut want_k = vec![0.0f32; blocks * bs * width];
    let mut want_v = want_k.clone();
    for (i, &(start, p)) in tokens.iter().enumerate() {
        let blk = tables[(start + p / bs as i32) as usize] as usize;
        if blk >= blocks {
            continue;
        }
        let o = (blk * bs + p as usize % bs) * width;
        want_k[o..o + width].copy_from_slice(&k[i * width..(i + 1) * width]);
        want_v[o..o + width].copy_from_slice(&v[i * width..(i + 1) * width]);
    }
    let pos: Vec<i32> = tokens.iter().map(|t| t.1).collect();
    let st: Vec<i32> = tokens.iter().map(|t| t.0).collect();
    let (pos_d, st_d, tables_d) = placement_buffers(dev, &pos, &st, &tables);
    let at = TokenPlacement {
        positions: &pos_d,
        table_start: &st_d,
        block_tables: &tables_d,
        max_context: 10,
        seq_starts: &[],
    };
    let (kd, vd) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let mut pool = dev.kv_pool_of(dtype, blocks, bs, kvh, d).unwrap();
        dev.kv_write(&mut pool, &kd, &vd, &at).unwrap();
        // A bf16 pool holds each value rounded to nearest even (half's from_f32).
        let stored = |x: &[f32]| -> Vec<f32> {
            match dtype {
                KvDtype::F32 => x.to_vec(),
                KvDtype::Bf16 => x
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_f32())
                    .collect(),
            }
        };
        let (got_k, got_v) = pool.download_f32().unwrap();
        let exact = count_differing(&got_k, &stored(&want_k)) == 0
            && count_differing(&got_v, &stored(&want_v)) == 0;
        check(
            &format!("kv_write placement ({dtype:?} pool)"),
            if exact { 0.0 } else { 1.0 },
            0.0,
        );
        assert_eq!(pool.bytes(), 2 * blocks * bs * width * dtype.size());
    }
}

/// Elements of `a` and `b` whose bits differ.
fn count_differing(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

#[test]
fn decode_matches_cpu_for_every_head_dim_and_gqa_ratio() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention decode");
    let seqs = [(0, 1), (1, 1), (15, 1), (16, 1), (300, 1), (777, 1)];
    for d in [16, 24, 32, 48, 64, 128, 256] {
        for (h, kvh) in [(4, 4), (4, 2), (6, 2), (6, 1), (16, 2), (32, 2)] {
            let mut case = Case::new(format!("decode d{d} {h}/{kvh} heads"), (h, kvh, d));
            case.seqs = &seqs;
            run_and_check(dev, &mut r, &case);
        }
    }
}

#[test]
fn long_decode_contexts_split_and_combine_like_the_cpu() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention long decode");
    let seqs = [(4095, 1), (1500, 1), (2000, 1), (64, 1)];
    for (window, bound) in [(None, None), (Some(1000), None), (None, Some(100))] {
        let mut case = Case::new(
            format!("long decode window {window:?} bound {bound:?}"),
            (32, 4, 128),
        );
        case.seqs = &seqs;
        case.window = window;
        case.max_context = bound;
        case.q_range = 4.0;
        run_and_check(dev, &mut r, &case);
    }
    // Batch 1 (many splits) and a batch large enough for one split per token.
    let one = [(3000, 1)];
    let many: Vec<(usize, usize)> = (0..200).map(|i| (37 * i % 900, 1)).collect();
    for (name, seqs) in [("batch 1", &one[..]), ("batch 200", &many[..])] {
        let mut case = Case::new(format!("long decode {name}"), (8, 1, 64));
        case.seqs = seqs;
        run_and_check(dev, &mut r, &case);
    }
}

/// Small decode batches, which Hopper runs on the cluster kernel (one cluster of 8 blocks per
/// token and kv head up to ~512 keys, up to 16 merged through the scratch beyond): every context
/// length from a key per block to 8192, windows, a host bound below the truth (the token's keys
/// still spread over its clusters), head dims 16 to 512 and GQA ratios 1 to 16.
#[test]
fn small_decode_batches_match_cpu_on_one_or_many_clusters() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention cluster decode");
    let one = |c: usize| vec![(c, 1)];
    for (shape, seqs, window, bound) in [
        ((32, 4, 128), one(0), None, None),
        ((32, 4, 128), one(7), None, None),
        ((32, 4, 128), one(511), None, None),
        ((32, 4, 128), one(2047), None, None),
        ((32, 4, 128), one(8191), None, None),
        ((32, 4, 128), one(3000), Some(700), None),
        ((32, 4, 128), one(5000), None, Some(64)),
        ((32, 4, 128), vec![(100, 1), (1500, 1), (0, 1)], None, None),
        ((16, 1, 64), one(4000), None, None),
        ((6, 2, 48), vec![(900, 1), (33, 1)], Some(300), None),
        ((4, 4, 16), one(2500), None, None),
        ((16, 8, 256), one(1800), Some(1024), None),
        ((16, 2, 512), one(400), None, None),
    ] {
        let name = format!("cluster decode {seqs:?} {shape:?} window {window:?} bound {bound:?}");
        let mut case = Case::new(name, shape);
        case.seqs = &seqs;
        cluster_case(dev, &mut r, case, (window, bound), KvDtype::F32);
    }
}

/// Run `case` (its sequences set) as a decode of larger queries (`q_range` 4) with a window and a
/// host bound on the context, over a pool of `kv_dtype`, and check it against the CPU.
fn cluster_case(
    dev: &CudaDevice,
    r: &mut StdRng,
    mut case: Case<'_>,
    (window, bound): (Option<usize>, Option<usize>),
    kv_dtype: KvDtype,
) {
    case.window = window;
    case.max_context = bound;
    case.q_range = 4.0;
    case.kv_dtype = kv_dtype;
    run_and_check(dev, r, &case);
}

/// The cluster decode kernel in clusters of 8 and of 16 blocks (the two builds, forced in turn by
/// `set_decode_cluster_size`) matches the CPU over one and several clusters, both pool dtypes,
/// a window and a host bound below the truth; and a size other than 8 or 16 is refused.
#[test]
fn decode_clusters_of_8_and_16_blocks_match_cpu() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention cluster sizes");
    let one = |c: usize| vec![(c, 1)];
    for size in [8, 16] {
        dev.set_decode_cluster_size(Some(size)).unwrap();
        for (shape, seqs, window, bound, kv_dtype) in [
            ((32, 4, 128), one(5), None, None, KvDtype::F32),
            ((32, 4, 128), one(300), None, None, KvDtype::F32),
            ((32, 4, 128), one(700), None, None, KvDtype::Bf16),
            ((32, 4, 128), one(1100), None, None, KvDtype::F32),
            ((32, 4, 128), one(2100), None, None, KvDtype::Bf16),
            ((32, 4, 128), one(3000), Some(700), Some(64), KvDtype::F32),
            ((16, 4, 64), one(900), None, None, KvDtype::F32),
            ((16, 2, 512), one(400), None, None, KvDtype::F32),
        ] {
            let name = format!(
                "clusters of {size}: {seqs:?} {shape:?} {kv_dtype:?} window {window:?} bound \
                 {bound:?}"
            );
            let mut case = Case::new(name, shape);
            case.seqs = &seqs;
            cluster_case(dev, &mut r, case, (window, bound), kv_dtype);
        }
    }
    dev.set_decode_cluster_size(None).unwrap();
    let err = dev
        .set_decode_cluster_size(Some(12))
        .unwrap_err()
        .to_string();
    assert!(err.contains("12") && err.contains("8 or 16"), "{err}");
}

/// Decode calls in a row give the same bits: the arrival counts the last block of each merge
/// resets are ready for the next call (what a replayed CUDA graph relies on), for one cluster,
/// several clusters and the split kernel.
#[test]
fn repeated_decode_calls_are_bitwise_equal() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention repeat");
    let (h, kvh, d, bs) = (32usize, 4usize, 128usize, 16usize);
    for (batch, context) in [(1usize, 500usize), (1, 3000), (2, 2000), (40, 700)] {
        let per_seq = context.div_ceil(bs);
        let mut pool = dev.kv_pool(batch * per_seq, bs, kvh, d).unwrap();
        let KvBuffersMut::F32(k, v) = pool.buffers_mut() else {
            unreachable!("kv_pool makes f32 pools")
        };
        let fill = |buf: &mut CudaSlice<f32>, r: &mut StdRng| {
            let vals = uniform(r, buf.len(), -1.0, 1.0);
            dev.stream().memcpy_htod(&vals, buf).unwrap();
        };
        fill(k, &mut r);
        fill(v, &mut r);
        let tables: Vec<i32> = (0..(batch * per_seq) as i32).collect();
        let starts: Vec<i32> = (0..batch).map(|b| (b * per_seq) as i32).collect();
        let pos = vec![context as i32 - 1; batch];
        let (pos_d, st_d, tables_d) = placement_buffers(dev, &pos, &starts, &tables);
        let at = TokenPlacement {
            positions: &pos_d,
            table_start: &st_d,
            block_tables: &tables_d,
            max_context: context,
            seq_starts: &[],
        };
        let shape = AttentionShape {
            num_heads: h,
            num_kv_heads: kvh,
            head_dim: d,
            scale: 0.3,
            sliding_window: None,
        };
        let mut scratch = dev.attention_scratch(batch, h, d, context).unwrap();
        let q = dev
            .upload(&uniform(&mut r, batch * h * d, -2.0, 2.0))
            .unwrap();
        let mut outs = Vec::new();
        for _ in 0..3 {
            let mut out = dev.upload(&poison(batch * h * d)).unwrap();
            dev.paged_attention(&q, &pool, &at, &shape, &mut out, &mut scratch)
                .unwrap();
            outs.push(dev.download(&out).unwrap());
        }
        let same = outs.iter().all(|o| {
            o.iter()
                .zip(&outs[0])
                .all(|(a, b)| a.to_bits() == b.to_bits())
        });
        let finite = outs[0].iter().all(|x| x.is_finite());
        check(
            &format!("attention repeat b={batch} ctx {context} (1 = differs)"),
            if same && finite { 0.0 } else { 1.0 },
            0.0,
        );
    }
}

#[test]
fn prefill_and_chunked_prefill_match_cpu_on_the_exact_tiled_path() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention prefill");
    let one = [(0, 200)];
    let chunked = [(130, 77), (0, 64)];
    let long_chunk = [(500, 300)];
    for (shape, seqs, window, bs) in [
        ((6, 1, 48), &one[..], None, 16),
        ((4, 2, 32), &chunked[..], None, 8),
        ((4, 1, 16), &one[..], Some(13), 4),
        ((8, 8, 128), &long_chunk[..], Some(100), 16),
        ((32, 4, 128), &one[..], None, 16),
        ((4, 2, 256), &chunked[..], Some(70), 16),
        ((2, 1, 24), &long_chunk[..], None, 32),
    ] {
        let mut case = Case::new(
            format!("prefill {seqs:?} {shape:?} window {window:?}"),
            shape,
        );
        case.seqs = seqs;
        case.window = window;
        case.block_size = bs;
        case.q_range = 3.0;
        run_and_check(dev, &mut r, &case);
    }
}

/// Gemma 4's shapes: sliding layers of head_dim 256 (16 heads over 8 KV heads, window 1024 in
/// the real model) and full layers of head_dim 512 (16 over 2), which never tile (every token
/// takes the split-K kernel, at most 2 query heads per block), decode and prefill.
#[test]
fn gemma4_head_dims_256_and_512_match_cpu_decode_and_prefill() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention gemma4");
    let decode = [(0, 1), (17, 1), (1030, 1), (2500, 1)];
    let prefill = [(0, 150)];
    let chunk = [(90, 70), (0, 3)];
    for (shape, window) in [
        ((16, 2, 512), None),
        ((4, 4, 512), None),
        ((6, 1, 512), Some(40)),
        ((16, 8, 256), Some(1024)),
        ((16, 8, 256), Some(50)),
    ] {
        for (what, seqs) in [
            ("decode", &decode[..]),
            ("prefill", &prefill[..]),
            ("chunk", &chunk[..]),
        ] {
            let mut case = Case::new(format!("gemma4 {what} {shape:?} window {window:?}"), shape);
            case.seqs = seqs;
            case.window = window;
            case.q_range = 3.0;
            run_and_check(dev, &mut r, &case);
        }
    }
}

#[test]
fn mixed_batches_of_prefills_and_decodes_match_cpu_grouped_and_interleaved() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention mixed");
    let seqs = [(300, 1), (0, 150), (45, 1), (1000, 70), (7, 1), (64, 128)];
    for interleave in [false, true] {
        for window in [None, Some(64)] {
            let mut case = Case::new(
                format!("mixed interleave={interleave} window {window:?}"),
                (16, 2, 64),
            );
            case.seqs = &seqs;
            case.window = window;
            case.interleave = interleave;
            run_and_check(dev, &mut r, &case);
        }
    }
}

#[test]
fn tensor_core_prefill_is_within_bf16_rounding_of_cpu() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention bf16");
    let one = [(0, 600)];
    let mixed = [(300, 200), (10, 1), (0, 130), (2000, 1)];
    let cached = [(1500, 400)];
    for (shape, seqs, window) in [
        ((8, 2, 128), &one[..], None),
        ((8, 2, 128), &cached[..], Some(700)),
        ((4, 1, 64), &cached[..], None),
        ((32, 4, 128), &mixed[..], None),
        ((16, 2, 64), &mixed[..], Some(100)),
        ((4, 4, 64), &one[..], Some(250)),
    ] {
        let mut case = Case::new(format!("bf16 prefill {shape:?} window {window:?}"), shape);
        case.seqs = seqs;
        case.window = window;
        case.prefill = AttentionPrefill::TensorCoreBf16;
        case.q_range = 2.0;
        run_and_check(dev, &mut r, &case);
    }
}

/// A bf16 pool on every path: decode on the split and cluster kernels (short and long contexts,
/// windows), exact f32 prefill tiles over a cached prefix (their pool tiles widened), Gemma 4's
/// head dims 256 and 512, mixed interleaved batches, and the tensor-core prefill from the pool
/// and from the batch copy (each mma.sync build; each wgmma build on sm_90), whose pool tiles
/// land as bf16. Each is within its usual tolerance of the CPU over a bf16 pool, and bit for bit
/// the same path over an f32 pool holding the rounded values (run_case).
#[test]
fn bf16_pools_give_the_bits_of_f32_pools_of_the_rounded_values_on_every_path() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention bf16 pool");
    let decode = [(0, 1), (15, 1), (300, 1), (777, 1)];
    let long = [(5000, 1), (12, 1)];
    let many = [(700, 1); 40];
    let chunked = [(130, 77), (0, 64)];
    let mixed = [(300, 1), (0, 150), (45, 1), (1000, 70), (64, 128)];
    // (heads, kv heads, head_dim), sequences, window, interleaved.
    type ExactCase<'a> = (
        (usize, usize, usize),
        &'a [(usize, usize)],
        Option<usize>,
        bool,
    );
    let exact: [ExactCase; 9] = [
        ((32, 4, 128), &decode[..], None, false),
        ((16, 2, 64), &long[..], None, false),
        ((32, 4, 128), &many[..], None, false),
        ((8, 2, 128), &decode[..], Some(100), false),
        ((4, 2, 32), &chunked[..], None, false),
        ((8, 8, 128), &chunked[..], Some(100), false),
        ((16, 2, 512), &chunked[..], None, false),
        ((16, 8, 256), &decode[..], Some(50), false),
        ((16, 2, 64), &mixed[..], Some(64), true),
    ];
    for (shape, seqs, window, interleave) in exact {
        let mut case = Case::new(
            format!(
                "bf16 pool exact {shape:?} {} seqs window {window:?}",
                seqs.len()
            ),
            shape,
        );
        case.seqs = seqs;
        case.window = window;
        case.interleave = interleave;
        case.q_range = 3.0;
        case.kv_dtype = KvDtype::Bf16;
        run_and_check(dev, &mut r, &case);
    }
    let cached_odd = [(1500, 400)];
    let mixed_tc = [(300, 200), (10, 1), (0, 130), (2000, 1), (77, 64)];
    let tensor_core: [(CopyCase, bool); 4] = [
        (((8, 2, 128), &cached_odd[..], Some(700), None), true),
        (((8, 2, 128), &cached_odd[..], None, None), false),
        (((16, 2, 64), &mixed_tc[..], Some(100), None), true),
        (((32, 4, 128), &mixed_tc[..], None, None), true),
    ];
    for (c, batch_copy) in tensor_core {
        let (shape, seqs, window, _) = &c;
        let name = format!("bf16 pool tensor cores {shape:?} {seqs:?} window {window:?}");
        let head_dim = shape.2;
        let mut case = tensor_core_case(name, c, batch_copy);
        case.kv_dtype = KvDtype::Bf16;
        case.variants = true;
        case.wgmma_builds = head_dim == 128;
        run_and_check(dev, &mut r, &case);
    }
}

/// (heads, kv heads, head_dim), sequences, window, batch row order.
type CopyCase<'a> = (
    (usize, usize, usize),
    &'a [(usize, usize)],
    Option<usize>,
    Option<Vec<usize>>,
);

/// A tensor-core prefill case named `name` (q in [-2, 2]), reading the batch's own keys from a
/// bf16 batch copy when `batch_copy`.
fn tensor_core_case<'a>(
    name: String,
    (shape, seqs, window, order): CopyCase<'a>,
    batch_copy: bool,
) -> Case<'a> {
    let mut case = Case::new(name, shape);
    case.seqs = seqs;
    case.window = window;
    case.order = order;
    case.prefill = AttentionPrefill::TensorCoreBf16;
    case.batch_copy = batch_copy;
    case.q_range = 2.0;
    case
}

/// The tensor-core kernel reading the batch's own keys from a bf16 batch copy: a fresh prefill,
/// chunked prefills whose cached prefix is or is not a whole number of key tiles (those keys
/// still come from the pool), windows, several sequences with decode tokens between them, and
/// batches whose rows are not one run of consecutive positions per sequence (a sequence's keys
/// sit in rows after its tile, or another sequence's rows interrupt its run): the kernel checks
/// which rows hold which key, so each is exact, and bitwise equal to the pool-only run.
#[test]
fn tensor_core_prefill_from_the_batch_copy_equals_the_pool_path_bitwise() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention bf16 batch copy");
    let fresh = [(0, 600)];
    let cached_whole = [(1024, 300)];
    let cached_odd = [(1500, 400)];
    let mixed = [(300, 200), (10, 1), (0, 130), (2000, 1), (77, 64)];
    let small = [(0, 64)];
    let split_a = [(0, 128), (0, 64)];
    let late_first: Vec<usize> = (64..192).chain(0..64).collect();
    let a_b_a: Vec<usize> = (0..64).chain(128..192).chain(64..128).collect();
    let cases: [CopyCase; 10] = [
        ((32, 4, 128), &fresh[..], None, None),
        ((8, 2, 128), &cached_whole[..], None, None),
        ((8, 2, 128), &cached_odd[..], Some(700), None),
        ((4, 1, 64), &cached_odd[..], None, None),
        ((32, 4, 128), &mixed[..], None, None),
        ((16, 2, 64), &mixed[..], Some(100), None),
        ((4, 4, 64), &small[..], None, None),
        ((4, 4, 64), &fresh[..], Some(250), None),
        ((8, 1, 128), &[(0, 192)][..], None, Some(late_first)),
        ((8, 2, 128), &split_a[..], None, Some(a_b_a)),
    ];
    for c in cases {
        let (shape, seqs, window, order) = &c;
        let reordered = order.is_some();
        let name = format!("bf16 copy {shape:?} {seqs:?} window {window:?} reordered {reordered}");
        run_and_check(dev, &mut r, &tensor_core_case(name, c, true));
    }
}

/// The tensor-core kernel's builds (1 head per warp; 2 heads per warp in blocks of 2 or 4 heads,
/// q from shared memory, 2 or 3 stages) do the same arithmetic per row, so each must give the
/// default's bits: fresh prefills, chunked prefills whose cached prefix comes from the pool (the
/// 2-stage build lands those tiles in halves), windows, head_dim 64 and 128, GQA groups of 1, 2,
/// 4 and 8 (a group the asked heads per block do not divide takes a narrower build), decode
/// tokens and reordered rows in the batch, and every tile from the pool (no copy).
#[test]
fn tensor_core_prefill_builds_are_bitwise_equal() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention bf16 builds");
    let fresh = [(0, 600)];
    let cached_odd = [(1500, 400)];
    let mixed = [(300, 200), (10, 1), (0, 130), (2000, 1), (77, 64)];
    let split_a = [(0, 128), (0, 64)];
    let a_b_a: Vec<usize> = (0..64).chain(128..192).chain(64..128).collect();
    let cases: [(CopyCase, bool); 9] = [
        (((32, 4, 128), &fresh[..], None, None), true),
        (((32, 4, 128), &fresh[..], None, None), false),
        (((8, 2, 128), &cached_odd[..], Some(700), None), true),
        (((8, 2, 128), &cached_odd[..], None, None), false),
        (((16, 2, 64), &mixed[..], Some(100), None), true),
        (((4, 1, 64), &cached_odd[..], None, None), true),
        (((6, 3, 128), &fresh[..], Some(250), None), true),
        (((4, 4, 64), &fresh[..], Some(250), None), true),
        (((8, 2, 128), &split_a[..], None, Some(a_b_a)), true),
    ];
    for (c, batch_copy) in cases {
        let (shape, seqs, window, _) = &c;
        let name = format!("bf16 builds {shape:?} {seqs:?} window {window:?} copy {batch_copy}");
        let mut case = tensor_core_case(name, c, batch_copy);
        case.variants = true;
        run_and_check(dev, &mut r, &case);
    }
}

/// The wgmma prefill kernel (the tensor-core default on sm_90 for head_dim 128; elsewhere these
/// cases run the mma.sync builds and check them): one 4096-token sequence of Qwen3-30B-A3B's
/// shape, lengths that leave tails to the split kernel, several sequences with decode tokens
/// between them, chunks after a cached prefix (its keys from the f32 pool), sliding windows, GQA
/// groups of 8, 4, 3 (odd: the one-head build) and 1, reordered rows, with and without a batch
/// copy. Each within the bf16 tolerance of the CPU, from the copy bitwise equal to the pool, and
/// every two-head build (2 or 3 stages, with or without the softmax / P V overlap and ping-pong,
/// copy tiles by cp.async, TMA or TMA multicast in clusters of two CTAs)
/// bitwise equal to the default.
#[test]
fn wgmma_prefill_matches_cpu_and_its_builds_agree_bitwise() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("attention wgmma");
    for group in [1, 2, 3, 8] {
        for own_keys in [false, true] {
            let build = dev.attention_wgmma_build(128, group, own_keys);
            println!("wgmma build for head_dim 128, group {group}, own keys {own_keys}: {build:?}");
            if dev.info().compute_capability == (9, 0) {
                assert!(
                    build.is_some(),
                    "sm_90 runs the wgmma kernel for group {group}"
                );
            }
        }
    }
    assert_eq!(
        dev.attention_wgmma_build(64, 2, true),
        None,
        "head_dim 64 stays on mma.sync"
    );
    dev.set_attention_wgmma(Some(0)).unwrap();
    assert_eq!(
        dev.attention_wgmma_build(128, 8, true),
        None,
        "switched off"
    );
    dev.set_attention_wgmma(None).unwrap();
    for bad in [8, 9] {
        let err = dev.set_attention_wgmma(Some(bad)).unwrap_err();
        assert!(
            matches!(err, CudaError::InvalidArgument(ref m) if m.contains("build")),
            "{bad}: {err}"
        );
    }

    let long = [(0, 4096)];
    let tails = [(0, 600)];
    let mixed = [(300, 200), (10, 1), (0, 130), (2000, 1), (77, 64)];
    let chunk = [(3072, 1024)];
    let cached_odd = [(1500, 400)];
    let cached_whole = [(1024, 300)];
    let fresh = [(0, 700)];
    let split_a = [(0, 128), (0, 64)];
    let a_b_a: Vec<usize> = (0..64).chain(128..192).chain(64..128).collect();
    let cases: [(CopyCase, bool); 12] = [
        (((32, 4, 128), &long[..], None, None), true),
        (((8, 2, 128), &tails[..], None, None), false),
        (((32, 4, 128), &mixed[..], None, None), true),
        (((8, 1, 128), &mixed[..], Some(300), None), false),
        (((8, 2, 128), &chunk[..], None, None), true),
        (((8, 2, 128), &cached_odd[..], Some(700), None), true),
        (((16, 2, 128), &fresh[..], Some(100), None), true),
        (((4, 4, 128), &tails[..], Some(250), None), true),
        (((4, 4, 128), &cached_whole[..], None, None), false),
        (((6, 2, 128), &tails[..], None, None), true),
        (((6, 2, 128), &cached_odd[..], Some(500), None), false),
        (((8, 2, 128), &split_a[..], None, Some(a_b_a)), true),
    ];
    for (c, batch_copy) in cases {
        let (shape, seqs, window, _) = &c;
        let name = format!("wgmma {shape:?} {seqs:?} window {window:?} copy {batch_copy}");
        let mut case = tensor_core_case(name, c, batch_copy);
        case.wgmma_builds = true;
        run_and_check(dev, &mut r, &case);
    }
}

/// The q/k/v prologue's fixed inputs for `hq` / `hkv` heads of `d`: RoPE tables (base 10000),
/// a random k norm, and the shape.
fn prologue_inputs(
    dev: &CudaDevice,
    r: &mut StdRng,
    (hq, hkv, d): (usize, usize, usize),
) -> (DeviceRope, CudaSlice<f32>, QkvShape) {
    let inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / d as f32))
        .collect();
    let rope = dev.upload_rope(&inv_freq, 1.0).unwrap();
    let k_norm = dev.upload(&uniform(r, d, 0.5, 1.5)).unwrap();
    let shape = QkvShape {
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
        eps: 1e-6,
        v_unit_norm: false,
    };
    (rope, k_norm, shape)
}

/// One sequence's `tokens` new tokens from position `first`, as the prologue tests feed them:
/// random q/k/v rows (hq + 2 hkv heads of d) and their placement over `blocks` blocks, taken in
/// reverse order.
struct PrologueBatch {
    qkv: CudaSlice<f32>,
    positions: CudaSlice<u32>,
    placement: (CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>),
    max_context: usize,
}

impl PrologueBatch {
    fn new(
        dev: &CudaDevice,
        r: &mut StdRng,
        (hq, hkv, d): (usize, usize, usize),
        (tokens, first): (usize, usize),
        blocks: usize,
    ) -> PrologueBatch {
        let width = (hq + 2 * hkv) * d;
        let qkv = dev.upload(&uniform(r, tokens * width, -2.0, 2.0)).unwrap();
        let positions: Vec<u32> = (0..tokens as u32).map(|p| p + first as u32).collect();
        let pos_i32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let tables: Vec<i32> = (0..blocks as i32).rev().collect();
        PrologueBatch {
            qkv,
            positions: dev.upload(&positions).unwrap(),
            placement: placement_buffers(dev, &pos_i32, &vec![0; tokens], &tables),
            max_context: tokens + first,
        }
    }

    fn at(&self) -> TokenPlacement<'_> {
        TokenPlacement {
            positions: &self.placement.0,
            table_start: &self.placement.1,
            block_tables: &self.placement.2,
            max_context: self.max_context,
            seq_starts: &[],
        }
    }
}

/// The q/k/v prologue writes its k and v rows straight into the pool, as kv_write would put them:
/// f32 as they are, bf16 rounded to nearest even; both of its entries (the early one for
/// decode-sized batches, the plain one past 128 tokens).
#[test]
fn qkv_prologue_writes_the_pool_of_either_dtype_as_kv_write_would() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("qkv prologue pool");
    let (hq, hkv, d) = (8usize, 2usize, 128usize);
    let (rope, k_norm, shape) = prologue_inputs(dev, &mut r, (hq, hkv, d));
    for tokens in [5usize, 200] {
        let blocks = (tokens + 3).div_ceil(16) + 2;
        let batch = PrologueBatch::new(dev, &mut r, (hq, hkv, d), (tokens, 3), blocks);
        let at = batch.at();
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
            let mut pool = dev.kv_pool_of(dtype, blocks, 16, hkv, d).unwrap();
            let mut q = dev.zeros::<f32>(tokens * hq * d).unwrap();
            let mut k = dev.zeros::<f32>(tokens * hkv * d).unwrap();
            let mut v = dev.zeros::<f32>(tokens * hkv * d).unwrap();
            dev.qkv_split_norm_rope(
                &batch.qkv,
                shape,
                &batch.positions,
                None,
                Some(&k_norm),
                &rope,
                &mut q,
                &mut k,
                &mut v,
                None,
                Some((&mut pool, &at)),
            )
            .unwrap();
            let mut want = dev.kv_pool_of(dtype, blocks, 16, hkv, d).unwrap();
            dev.kv_write(&mut want, &k, &v, &at).unwrap();
            let (got_k, got_v) = pool.download_f32().unwrap();
            let (want_k, want_v) = want.download_f32().unwrap();
            let differ = count_differing(&got_k, &want_k) + count_differing(&got_v, &want_v);
            let written = want_k.iter().filter(|x| x.to_bits() != 0).count();
            assert!(written > tokens * hkv * d / 2, "kv_write wrote the rows");
            check(
                &format!("qkv prologue pool rows, {tokens} tokens, {dtype:?} (elements differing)"),
                differ as f64,
                0.0,
            );
        }
    }
}

/// The q/k/v prologue's batch copy holds exactly its k and v outputs rounded to bf16 (what the
/// pool path rounds), with and without a pool to write.
#[test]
fn qkv_prologue_writes_the_batch_copy_as_its_k_and_v_rounded_to_bf16() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("qkv prologue copy");
    let (hq, hkv, d, tokens) = (8usize, 2usize, 128usize, 70usize);
    let blocks = tokens.div_ceil(16) + 6;
    let batch = PrologueBatch::new(dev, &mut r, (hq, hkv, d), (tokens, 5), blocks);
    let at = batch.at();
    let (rope, k_norm, shape) = prologue_inputs(dev, &mut r, (hq, hkv, d));
    let mut pool = dev.kv_pool(blocks, 16, hkv, d).unwrap();
    for with_pool in [true, false] {
        let mut q = dev.zeros::<f32>(tokens * hq * d).unwrap();
        let mut k = dev.zeros::<f32>(tokens * hkv * d).unwrap();
        let mut v = dev.zeros::<f32>(tokens * hkv * d).unwrap();
        let mut copy = dev.batch_kv_bf16(tokens + 3, hkv, d).unwrap();
        let kv = with_pool.then_some((&mut pool, &at));
        dev.qkv_split_norm_rope_copy(
            &batch.qkv,
            shape,
            &batch.positions,
            (None, Some(&k_norm)),
            &rope,
            (&mut q, &mut k, &mut v),
            None,
            kv,
            Some(&mut copy),
        )
        .unwrap();
        let rounded = |x: Vec<f32>| -> Vec<u16> {
            x.iter()
                .map(|&f| half::bf16::from_f32(f).to_bits())
                .collect()
        };
        let (want_k, want_v) = (
            rounded(dev.download(&k).unwrap()),
            rounded(dev.download(&v).unwrap()),
        );
        let (got_k, got_v) = (
            dev.download(copy.k()).unwrap(),
            dev.download(copy.v()).unwrap(),
        );
        let n = tokens * hkv * d;
        let differ = (0..n)
            .filter(|&i| got_k[i] != want_k[i] || got_v[i] != want_v[i])
            .count();
        check(
            &format!("qkv prologue batch copy, pool {with_pool} (elements differing)"),
            differ as f64,
            0.0,
        );
    }
    // A copy too small for the batch is refused by name.
    let mut small = dev.batch_kv_bf16(tokens - 1, hkv, d).unwrap();
    let mut q = dev.zeros::<f32>(tokens * hq * d).unwrap();
    let mut k = dev.zeros::<f32>(tokens * hkv * d).unwrap();
    let mut v = dev.zeros::<f32>(tokens * hkv * d).unwrap();
    let err = dev
        .qkv_split_norm_rope_copy(
            &batch.qkv,
            shape,
            &batch.positions,
            (None, None),
            &rope,
            (&mut q, &mut k, &mut v),
            None,
            None,
            Some(&mut small),
        )
        .unwrap_err();
    assert!(
        matches!(err, CudaError::InvalidArgument(ref m) if m.contains("batch copy")),
        "{err}"
    );
}

#[test]
fn bad_shapes_and_unsupported_paths_are_refused() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    assert!(matches!(
        dev.kv_pool(4, 16, 2, 30),
        Err(CudaError::InvalidArgument(_))
    ));
    let pool = dev.kv_pool(4, 16, 2, 48).unwrap();
    let (pos, st, tables) = placement_buffers(dev, &[0, 1], &[0, 0], &[2]);
    let at = TokenPlacement {
        positions: &pos,
        table_start: &st,
        block_tables: &tables,
        max_context: 2,
        seq_starts: &[],
    };
    let shape = AttentionShape {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 48,
        scale: 0.1,
        sliding_window: None,
    };
    let mut scratch = dev.attention_scratch(2, 4, 48, 2).unwrap();
    let q = dev.zeros::<f32>(2 * 4 * 48).unwrap();
    let mut out = dev.zeros::<f32>(2 * 4 * 48).unwrap();
    let mut short = dev.zeros::<f32>(4 * 48).unwrap();
    let call = |shape: &AttentionShape,
                prefill: AttentionPrefill,
                out: &mut CudaSlice<f32>,
                s: &mut AttentionScratch| {
        dev.paged_attention_with(prefill, &q, &pool, &at, shape, out, s)
    };
    let exact = AttentionPrefill::ExactF32;
    assert!(call(&shape, exact, &mut out, &mut scratch).is_ok());
    let err = call(&shape, exact, &mut short, &mut scratch).unwrap_err();
    assert!(matches!(err, CudaError::InvalidArgument(_)), "{err}");
    for bad in [
        AttentionShape {
            num_kv_heads: 4,
            ..shape
        },
        AttentionShape {
            num_heads: 5,
            ..shape
        },
        AttentionShape {
            head_dim: 64,
            ..shape
        },
        AttentionShape {
            sliding_window: Some(0),
            ..shape
        },
    ] {
        let err = call(&bad, exact, &mut out, &mut scratch).unwrap_err();
        assert!(
            matches!(err, CudaError::InvalidArgument(_)),
            "{bad:?}: {err}"
        );
    }
    let err = call(
        &shape,
        AttentionPrefill::TensorCoreBf16,
        &mut out,
        &mut scratch,
    )
    .unwrap_err();
    assert!(
        matches!(err, CudaError::Unsupported(ref m) if m.contains("48")),
        "{err}"
    );
    for heads in [0, 3, 8] {
        let err = dev
            .set_tensor_core_attention_heads(Some(heads))
            .unwrap_err();
        assert!(
            matches!(err, CudaError::InvalidArgument(ref m) if m.contains("heads per block")),
            "{heads}: {err}"
        );
    }
}
