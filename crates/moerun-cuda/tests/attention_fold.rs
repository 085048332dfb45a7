//! The attention prologue folded into decode attention (`paged_attention_folded`) against the
//! prologue kernel then attention: the same output bits and the same pool, for each pool dtype,
//! head size, GQA ratio, norm choice, window and context the fold takes (one cluster or
//! several), one sequence or two; and the batches it does not take refused by name.

mod common;

use common::{check, device, device_alone, rng, uniform};
use moerun_cuda::{
    AttentionShape, CudaDevice, CudaError, CudaSlice, DeviceKvPool, DeviceRope, FoldedPrologue,
    KvDtype, QkvShape, TokenPlacement,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

const BLOCK: usize = 16;

/// A decode batch: one new token per sequence at position `contexts[s]` (earlier positions
/// already cached), the sequences' blocks shuffled over the pool.
struct Batch {
    qkv: CudaSlice<f32>,
    positions_u32: CudaSlice<u32>,
    positions: CudaSlice<i32>,
    table_start: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    seq_starts: Vec<usize>,
    max_context: usize,
    blocks: usize,
    /// The cached positions' placement and random K/V rows (kv_write's input).
    cached: Option<Cached>,
}

struct Cached {
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    positions: CudaSlice<i32>,
    table_start: CudaSlice<i32>,
}

impl Batch {
    fn new(
        dev: &CudaDevice,
        r: &mut StdRng,
        (hq, hkv, d): (usize, usize, usize),
        contexts: &[usize],
        tables_per_seq: usize,
    ) -> Batch {
        let n = contexts.len();
        let blocks = n * tables_per_seq + 1;
        let mut ids: Vec<i32> = (0..blocks as i32).collect();
        ids.shuffle(r);
        let tables: Vec<i32> = ids[..n * tables_per_seq].to_vec();
        let starts: Vec<i32> = (0..n).map(|s| (s * tables_per_seq) as i32).collect();
        let (mut cpos, mut cstart) = (Vec::new(), Vec::new());
        for (s, &c) in contexts.iter().enumerate() {
            assert!(c < tables_per_seq * BLOCK, "the tables hold the context");
            cpos.extend(0..c as i32);
            cstart.extend(std::iter::repeat_n(starts[s], c));
        }
        let width = (hq + 2 * hkv) * d;
        let cached = (!cpos.is_empty()).then(|| Cached {
            k: dev
                .upload(&uniform(r, cpos.len() * hkv * d, -2.0, 2.0))
                .unwrap(),
            v: dev
                .upload(&uniform(r, cpos.len() * hkv * d, -2.0, 2.0))
                .unwrap(),
            positions: dev.upload(&cpos).unwrap(),
            table_start: dev.upload(&cstart).unwrap(),
        });
        let pos: Vec<i32> = contexts.iter().map(|&c| c as i32).collect();
        let pos_u32: Vec<u32> = contexts.iter().map(|&c| c as u32).collect();
        Batch {
            qkv: dev.upload(&uniform(r, n * width, -2.0, 2.0)).unwrap(),
            positions_u32: dev.upload(&pos_u32).unwrap(),
            positions: dev.upload(&pos).unwrap(),
            table_start: dev.upload(&starts).unwrap(),
            tables: dev.upload(&tables).unwrap(),
            seq_starts: (0..n).collect(),
            max_context: contexts.iter().max().unwrap() + 1,
            blocks,
            cached,
        }
    }

    fn at(&self) -> TokenPlacement<'_> {
        TokenPlacement {
            positions: &self.positions,
            table_start: &self.table_start,
            block_tables: &self.tables,
            max_context: self.max_context,
            seq_starts: &self.seq_starts,
        }
    }

    /// A pool holding the cached positions' K/V.
    fn pool(&self, dev: &CudaDevice, dtype: KvDtype, hkv: usize, d: usize) -> DeviceKvPool {
        let mut pool = dev.kv_pool_of(dtype, self.blocks, BLOCK, hkv, d).unwrap();
        if let Some(c) = &self.cached {
            let at = TokenPlacement {
                positions: &c.positions,
                table_start: &c.table_start,
                block_tables: &self.tables,
                max_context: self.max_context,
                seq_starts: &[],
            };
            dev.kv_write(&mut pool, &c.k, &c.v, &at).unwrap();
        }
        pool
    }
}

struct Case {
    heads: (usize, usize, usize),
    contexts: &'static [usize],
    /// q_norm and k_norm given (Qwen3) or neither (Mixtral).
    norms: bool,
    /// Rotary dims / head_dim: 1 (full) or 1/2 (partial rotary).
    rotary_half: bool,
    window: Option<usize>,
}

fn bits_differing(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// Run `case` both ways over pools of `dtype`; returns whether it folded (it must, where
/// `must_fold`).
fn fold_matches_prologue_then_attention(
    dev: &CudaDevice,
    r: &mut StdRng,
    case: &Case,
    dtype: KvDtype,
    must_fold: bool,
) -> bool {
    let (hq, hkv, d) = case.heads;
    let longest = *case.contexts.iter().max().unwrap();
    let batch = Batch::new(dev, r, case.heads, case.contexts, longest / BLOCK + 2);
    let at = batch.at();
    let half = if case.rotary_half { d / 4 } else { d / 2 };
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1e6f32.powf(-2.0 * i as f32 / (2 * half) as f32))
        .collect();
    let rope: DeviceRope = dev.upload_rope(&inv_freq, 1.0).unwrap();
    let norm = |r: &mut StdRng| dev.upload(&uniform(r, d, 0.5, 1.5)).unwrap();
    let (q_norm, k_norm) = match case.norms {
        true => (Some(norm(r)), Some(norm(r))),
        false => (None, None),
    };
    let shape = AttentionShape {
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        scale: (d as f32).powf(-0.5),
        sliding_window: case.window,
    };
    let n = case.contexts.len();
    let mut scratch = dev.attention_scratch(n, hq, d, longest + 1).unwrap();
    let label = format!(
        "{hq}/{hkv} heads of {d}, contexts {:?}, norms {}, rotary {}, window {:?}, {dtype:?}",
        case.contexts,
        case.norms,
        2 * half,
        case.window
    );

    // The reference: the prologue kernel (k and v into the pool), then attention.
    let mut want_pool = batch.pool(dev, dtype, hkv, d);
    let mut q = dev.zeros::<f32>(n * hq * d).unwrap();
    let mut k = dev.zeros::<f32>(n * hkv * d).unwrap();
    let mut v = dev.zeros::<f32>(n * hkv * d).unwrap();
    let qkv_shape = QkvShape {
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
        eps: 1e-6,
        v_unit_norm: false,
    };
    dev.qkv_split_norm_rope(
        &batch.qkv,
        qkv_shape,
        &batch.positions_u32,
        q_norm.as_ref(),
        k_norm.as_ref(),
        &rope,
        &mut q,
        &mut k,
        &mut v,
        None,
        Some((&mut want_pool, &at)),
    )
    .unwrap();
    let mut want = dev.upload(&vec![f32::NAN; n * hq * d]).unwrap();
    dev.paged_attention(&q, &want_pool, &at, &shape, &mut want, &mut scratch)
        .unwrap();

    let mut pool = batch.pool(dev, dtype, hkv, d);
    let folds = dev.attention_prologue_folds(&at, &shape, &pool, &scratch);
    assert!(folds || !must_fold, "{label}: does not fold");
    let mut got = dev.upload(&vec![f32::NAN; n * hq * d]).unwrap();
    let prologue = FoldedPrologue {
        q_norm: q_norm.as_ref(),
        k_norm: k_norm.as_ref(),
        rope: &rope,
        eps: 1e-6,
    };
    let run = dev.paged_attention_folded(
        &batch.qkv,
        prologue,
        &mut pool,
        &at,
        &shape,
        &mut got,
        &mut scratch,
    );
    if !folds {
        let err = run.unwrap_err();
        assert!(
            matches!(err, CudaError::InvalidArgument(ref m) if m.contains("does not fold")),
            "{label}: {err}"
        );
        return false;
    }
    run.unwrap();
    let (got, want) = (dev.download(&got).unwrap(), dev.download(&want).unwrap());
    assert!(want.iter().all(|x| x.is_finite()), "{label}: reference");
    let (got_k, got_v) = pool.download_f32().unwrap();
    let (want_k, want_v) = want_pool.download_f32().unwrap();
    let (out_differ, k_differ, v_differ) = (
        bits_differing(&got, &want),
        bits_differing(&got_k, &want_k),
        bits_differing(&got_v, &want_v),
    );
    if out_differ + k_differ + v_differ > 0 {
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / w.abs().max(1e-3))
            .fold(0.0f32, f32::max);
        println!(
            "{label}: output bits differ at {out_differ} of {} (worst relative {worst:e}), \
             K at {k_differ}, V at {v_differ}",
            got.len()
        );
    }
    check(
        &format!("folded prologue, {label} (output and pool bits differing)"),
        (out_differ + k_differ + v_differ) as f64,
        0.0,
    );
    true
}

#[test]
fn the_folded_prologue_gives_the_bits_of_the_prologue_then_attention() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    if dev.info().compute_capability.0 < 9 {
        println!("skipped: the folded prologue runs in thread-block clusters (sm_90+)");
        return;
    }
    let mut r = rng("folded prologue");
    let cases = [
        // Qwen3-30B-A3B: 32 / 4 heads of 128 (4-head blocks), q and k norms; the new token at
        // position 0, in the first block's last slot, mid-block, and past one cluster's keys.
        Case {
            heads: (32, 4, 128),
            contexts: &[0],
            norms: true,
            rotary_half: false,
            window: None,
        },
        Case {
            heads: (32, 4, 128),
            contexts: &[15],
            norms: true,
            rotary_half: false,
            window: None,
        },
        Case {
            heads: (32, 4, 128),
            contexts: &[523],
            norms: true,
            rotary_half: false,
            window: None,
        },
        Case {
            heads: (32, 4, 128),
            contexts: &[2900],
            norms: true,
            rotary_half: false,
            window: None,
        },
        // Two sequences, one token each.
        Case {
            heads: (32, 4, 128),
            contexts: &[300, 77],
            norms: true,
            rotary_half: false,
            window: None,
        },
        // Mixtral: 32 / 8 heads of 128, no norms; partial rotary; a window.
        Case {
            heads: (32, 8, 128),
            contexts: &[700],
            norms: false,
            rotary_half: true,
            window: None,
        },
        Case {
            heads: (16, 2, 128),
            contexts: &[400],
            norms: true,
            rotary_half: false,
            window: Some(100),
        },
        // head_dim 64, groups of 4 and of 6 (head chunks of 4 and 2).
        Case {
            heads: (16, 4, 64),
            contexts: &[1000],
            norms: true,
            rotary_half: false,
            window: None,
        },
        // The small fixtures' shapes: 4 / 1 heads of 32, 8 / 2 of 16.
        Case {
            heads: (4, 1, 32),
            contexts: &[20],
            norms: true,
            rotary_half: false,
            window: None,
        },
        Case {
            heads: (8, 2, 16),
            contexts: &[130],
            norms: false,
            rotary_half: false,
            window: None,
        },
        Case {
            heads: (12, 2, 64),
            contexts: &[33],
            norms: true,
            rotary_half: true,
            window: None,
        },
    ];
    // Every case runs in each cluster build (the plan's pick, then 8 and 16 blocks forced; a
    // failure's report names it), then the first failure fails the test. In clusters of 16
    // several sequences' clusters need more blocks than fit on the device at once, and the
    // planner rightly takes the split kernel (no fold): there only one sequence must fold (its
    // bits are checked whenever it folds).
    let mut failed = None;
    for size in [None, Some(8), Some(16)] {
        dev.set_decode_cluster_size(size).unwrap();
        for case in &cases {
            let must_fold = size != Some(16) || case.contexts.len() == 1;
            for dtype in [KvDtype::F32, KvDtype::Bf16] {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    fold_matches_prologue_then_attention(dev, &mut r, case, dtype, must_fold)
                }));
                if let Err(e) = run {
                    eprintln!("(the failure above: clusters {size:?}, dtype {dtype:?})");
                    failed.get_or_insert(e);
                }
            }
        }
    }
    dev.set_decode_cluster_size(None).unwrap();
    if let Some(e) = failed {
        std::panic::resume_unwind(e);
    }
}

/// Batches the fold does not take are refused by name (the caller then runs the prologue and
/// attention): two tokens of one sequence, a head size without a folded build, groups of fewer
/// than 4 query heads a block, contexts long enough for the split kernel.
#[test]
fn batches_the_fold_does_not_take_are_refused_by_name() {
    let Some(dev) = device() else { return };
    let _alone = device_alone();
    let mut r = rng("folded prologue refusals");
    let refused = [
        Case {
            heads: (8, 8, 128),
            contexts: &[100],
            norms: true,
            rotary_half: false,
            window: None,
        },
        Case {
            heads: (8, 2, 256),
            contexts: &[100],
            norms: true,
            rotary_half: false,
            window: None,
        },
        Case {
            heads: (32, 4, 128),
            contexts: &[60000],
            norms: true,
            rotary_half: false,
            window: None,
        },
    ];
    for case in &refused {
        let folded = fold_matches_prologue_then_attention(dev, &mut r, case, KvDtype::F32, false);
        assert!(!folded, "{:?} / {:?} folded", case.heads, case.contexts);
    }
    // Two tokens of one sequence (a prefill's): the second needs the first's key, made by
    // other blocks.
    let (hq, hkv, d) = (32, 4, 128);
    let batch = Batch::new(dev, &mut r, (hq, hkv, d), &[10, 11], 4);
    let starts = dev.upload(&[0i32, 0]).unwrap();
    let at = TokenPlacement {
        table_start: &starts,
        seq_starts: &[0],
        ..batch.at()
    };
    let shape = AttentionShape {
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        scale: 0.1,
        sliding_window: None,
    };
    let pool = batch.pool(dev, KvDtype::F32, hkv, d);
    let scratch = dev.attention_scratch(2, hq, d, 64).unwrap();
    assert!(!dev.attention_prologue_folds(&at, &shape, &pool, &scratch));
}
