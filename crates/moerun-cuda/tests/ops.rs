//! The row-wise ops on the GPU against their CPU references (moerun-cpu's kernels, or the same
//! steps written out where the CPU version lives in moerun-model), on fresh random inputs.
//!
//! Thresholds (norm-wise relative error, f32 arithmetic on both sides, only the summation order
//! and 1-2 ulp differences of expf/sincosf separating them): rms_norm, rope, silu_mul and the
//! router's weights 1e-5; embedding gathers and the router's expert choices must be exact.
//! Without a GPU every test prints "skipped: CUDA is unavailable: <reason>" and passes.

mod common;

use common::{
    bits_of, check, device, matrix, poison, rel_err, rel_err_on, rng, stored, uniform, widen,
};
use moerun_core::{DType, MatRef};
use moerun_cpu::ops::{
    gelu_tanh_mul_in_place, rms_norm_rows, rope_rotate_half, silu_mul_in_place, softmax_in_place,
};
use moerun_cuda::{AddNormGrid, CudaError, RouterShape};

#[test]
fn rms_norm_matches_cpu_on_hidden_rows_and_per_head_rows() {
    let Some(dev) = device() else { return };
    let mut r = rng("rms_norm");
    for (rows, width) in [(7usize, 2048usize), (40, 128), (3, 5000)] {
        let x = uniform(&mut r, rows * width, -2.0, 2.0);
        let w = uniform(&mut r, width, 0.5, 1.5);
        let mut want = x.clone();
        rms_norm_rows(&mut want, &w, 1e-6);

        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut out = dev.upload(&poison(x.len())).unwrap();
        dev.rms_norm(&xd, &wd, 1e-6, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        check(
            &format!("rms_norm {rows}x{width}"),
            rel_err(&got, &widen(&want)),
            1e-5,
        );

        let mut inplace = dev.upload(&x).unwrap();
        dev.rms_norm_in_place(&mut inplace, &wd, 1e-6).unwrap();
        assert_eq!(
            dev.download(&inplace).unwrap(),
            got,
            "in place equals out of place"
        );
    }
}

#[test]
fn add_rms_norm_matches_cpu_and_its_bf16_output_is_its_output_rounded() {
    let Some(dev) = device() else { return };
    let mut r = rng("add_rms_norm");
    for (rows, width) in [(1usize, 2048usize), (40, 2048), (3, 5000)] {
        let x = uniform(&mut r, rows * width, -2.0, 2.0);
        let y = uniform(&mut r, rows * width, -2.0, 2.0);
        let w = uniform(&mut r, width, 0.5, 1.5);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        let mut want = sum.clone();
        rms_norm_rows(&mut want, &w, 1e-6);

        let (yd, wd) = (dev.upload(&y).unwrap(), dev.upload(&w).unwrap());
        let mut xd = dev.upload(&x).unwrap();
        let mut out = dev.upload(&poison(x.len())).unwrap();
        let mut out_b = dev.upload(&vec![0xffffu16; x.len()]).unwrap();
        dev.add_rms_norm_with_bf16(&mut xd, &yd, &wd, 1e-6, &mut out, Some(&mut out_b))
            .unwrap();
        assert_eq!(dev.download(&xd).unwrap(), sum, "x += y exactly");
        let got = dev.download(&out).unwrap();
        check(
            &format!("add_rms_norm {rows}x{width}"),
            rel_err(&got, &widen(&want)),
            1e-5,
        );
        // The bf16 output is what to_bf16 makes of the f32 output, bit for bit: the GEMMs that
        // read it give the same results as converting themselves.
        let mut rounded = dev.upload(&vec![0u16; x.len()]).unwrap();
        dev.to_bf16(&out, &mut rounded).unwrap();
        assert_eq!(
            dev.download(&out_b).unwrap(),
            dev.download(&rounded).unwrap(),
            "bf16 output {rows}x{width}"
        );

        // Without the bf16 output: the same f32 results.
        let mut xd = dev.upload(&x).unwrap();
        let mut plain = dev.upload(&poison(x.len())).unwrap();
        dev.add_rms_norm(&mut xd, &yd, &wd, 1e-6, &mut plain)
            .unwrap();
        assert_eq!(dev.download(&plain).unwrap(), got, "{rows}x{width}");

        let mut short = dev.upload(&vec![0u16; x.len() - 1]).unwrap();
        let err = dev
            .add_rms_norm_with_bf16(&mut xd, &yd, &wd, 1e-6, &mut plain, Some(&mut short))
            .unwrap_err();
        assert!(err.to_string().contains("bf16 output"), "{err}");
    }
}

/// moerun-model's Rope, written out: angle = inv_freq * pos in f32, cos/sin scaled by the
/// attention factor, then moerun-cpu's rotate-half on the first rotary_dim dims of each head.
fn rope_cpu(x: &mut [f32], pos: &[u32], inv_freq: &[f32], factor: f32, heads: usize, dim: usize) {
    let half = inv_freq.len();
    for (row, &p) in x.chunks_exact_mut(heads * dim).zip(pos) {
        let angles: Vec<f32> = inv_freq.iter().map(|f| f * p as f32).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos() * factor).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin() * factor).collect();
        for head in row.chunks_exact_mut(dim) {
            rope_rotate_half(&mut head[..2 * half], &cos, &sin);
        }
    }
}

#[test]
fn rope_matches_cpu_for_full_and_partial_rotary_and_far_positions() {
    let Some(dev) = device() else { return };
    let mut r = rng("rope");
    let positions: Vec<u32> = vec![0, 1, 17, 4095, 32768, 131071];
    for (heads, dim, rotary, factor) in [(4usize, 128usize, 128usize, 1.0f32), (6, 128, 64, 1.2)] {
        let half = rotary / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / rotary as f32))
            .collect();
        let x = uniform(&mut r, positions.len() * heads * dim, -1.0, 1.0);
        let mut want = x.clone();
        rope_cpu(&mut want, &positions, &inv_freq, factor, heads, dim);

        let rope = dev.upload_rope(&inv_freq, factor).unwrap();
        let pos = dev.upload(&positions).unwrap();
        let mut xd = dev.upload(&x).unwrap();
        dev.rope(&mut xd, &pos, &rope, heads, dim).unwrap();
        let got = dev.download(&xd).unwrap();
        check(
            &format!("rope rotary {rotary}/{dim}"),
            rel_err(&got, &widen(&want)),
            1e-5,
        );
        for (t, (g, w)) in got
            .chunks_exact(heads * dim)
            .zip(x.chunks_exact(heads * dim))
            .enumerate()
        {
            for h in 0..heads {
                let tail = h * dim + rotary..(h + 1) * dim;
                assert_eq!(
                    &g[tail.clone()],
                    &w[tail],
                    "token {t} head {h}: pass-through"
                );
            }
        }
    }
}

#[test]
fn silu_mul_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut r = rng("silu_mul");
    let n = 3 * 6144 + 5;
    let gate = uniform(&mut r, n, -8.0, 8.0);
    let up = uniform(&mut r, n, -2.0, 2.0);
    let mut want = gate.clone();
    silu_mul_in_place(&mut want, &up);
    let (mut g, u) = (dev.upload(&gate).unwrap(), dev.upload(&up).unwrap());
    dev.silu_mul(&mut g, &u).unwrap();
    check(
        "silu_mul",
        rel_err(&dev.download(&g).unwrap(), &widen(&want)),
        1e-5,
    );
}

/// Gemma 4's elementwise ops against the CPU's arithmetic: GELU-tanh-and-multiply (plain and on a
/// slice of packed per-layer inputs), scale, soft-capping, the router's row scale and its
/// per-expert weight scale (NaN for an id out of range).
#[test]
fn gemma_elementwise_ops_match_cpu() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemma ops");
    let n = 3 * 2816 + 7;
    let gate = uniform(&mut r, n, -6.0, 6.0);
    let up = uniform(&mut r, n, -2.0, 2.0);
    let mut want = gate.clone();
    gelu_tanh_mul_in_place(&mut want, &up);
    let (mut g, u) = (dev.upload(&gate).unwrap(), dev.upload(&up).unwrap());
    dev.gelu_tanh_mul(&mut g, &u).unwrap();
    check(
        "gelu_tanh_mul",
        rel_err(&dev.download(&g).unwrap(), &widen(&want)),
        1e-6,
    );

    // Layer 2 of 5 per-layer inputs of width 8, 3 tokens.
    let (rows, width, layers, l) = (3usize, 8usize, 5usize, 2usize);
    let gate = uniform(&mut r, rows * width, -4.0, 4.0);
    let packed = uniform(&mut r, rows * layers * width, -2.0, 2.0);
    let mut want = gate.clone();
    for (t, row) in want.chunks_exact_mut(width).enumerate() {
        gelu_tanh_mul_in_place(row, &packed[t * layers * width + l * width..][..width]);
    }
    let (mut g, p) = (dev.upload(&gate).unwrap(), dev.upload(&packed).unwrap());
    dev.gelu_tanh_mul_strided(&mut g, width, &p, layers * width, l * width)
        .unwrap();
    check(
        "gelu_tanh_mul per-layer slice",
        rel_err(&dev.download(&g).unwrap(), &widen(&want)),
        1e-6,
    );
    assert!(dev
        .gelu_tanh_mul_strided(&mut g, width, &p, layers * width, layers * width)
        .is_err());

    let x = uniform(&mut r, n, -30.0, 30.0);
    let mut xd = dev.upload(&x).unwrap();
    dev.scale(&mut xd, 53.0).unwrap();
    let want: Vec<f32> = x.iter().map(|v| v * 53.0).collect();
    check(
        "scale",
        rel_err(&dev.download(&xd).unwrap(), &widen(&want)),
        0.0,
    );
    let mut xd = dev.upload(&x).unwrap();
    dev.softcap(&mut xd, 15.0).unwrap();
    let want: Vec<f32> = x.iter().map(|v| (v / 15.0).tanh() * 15.0).collect();
    check(
        "softcap",
        rel_err(&dev.download(&xd).unwrap(), &widen(&want)),
        1e-6,
    );
    assert!(dev.softcap(&mut xd, 0.0).is_err());

    // route_topk with Gemma 4's per-expert scale: route_topk's ids, and its weights times the
    // chosen experts' scales, bit for bit; a row of NaN logits (no expert chosen) gives NaN.
    let (experts, top_k, tokens) = (40usize, 6usize, 5usize);
    let shape = RouterShape {
        experts,
        top_k,
        renormalise: true,
    };
    let mut logits = uniform(&mut r, tokens * experts, -3.0, 3.0);
    logits[3 * experts..4 * experts].fill(f32::NAN);
    let scale = uniform(&mut r, experts, 0.5, 2.0);
    let (ld, sd) = (dev.upload(&logits).unwrap(), dev.upload(&scale).unwrap());
    let mut plain = (
        dev.upload(&vec![u32::MAX; tokens * top_k]).unwrap(),
        dev.upload(&poison(tokens * top_k)).unwrap(),
    );
    dev.route_topk(&ld, shape, &mut plain.0, &mut plain.1)
        .unwrap();
    let mut scaled = (
        dev.upload(&vec![u32::MAX; tokens * top_k]).unwrap(),
        dev.upload(&poison(tokens * top_k)).unwrap(),
    );
    dev.route_topk_scaled(&ld, shape, &sd, &mut scaled.0, &mut scaled.1)
        .unwrap();
    let (ids, w) = (
        dev.download(&plain.0).unwrap(),
        dev.download(&plain.1).unwrap(),
    );
    assert_eq!(dev.download(&scaled.0).unwrap(), ids, "the same experts");
    let got = dev.download(&scaled.1).unwrap();
    for (i, (&e, &w)) in ids.iter().zip(&w).enumerate() {
        if (e as usize) < experts {
            assert_eq!(
                got[i].to_bits(),
                (w * scale[e as usize]).to_bits(),
                "weight {i}"
            );
        } else {
            assert!(
                i / top_k == 3 && got[i].is_nan(),
                "weight {i} of out-of-range expert {e}"
            );
        }
    }
    let short = dev.upload(&scale[1..]).unwrap();
    let err = dev
        .route_topk_scaled(&ld, shape, &short, &mut scaled.0, &mut scaled.1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("39 per-expert scales for 40 experts"), "{err}");
}

#[test]
fn embedding_gathers_rows_exactly_for_every_dtype_and_refuses_bad_ids() {
    let Some(dev) = device() else { return };
    let mut r = rng("embed");
    // Rows shorter than a block's first pass, and longer than two (8 loads a thread each).
    for (vocab, hidden) in [(1000usize, 96usize), (1000, 4100)] {
        let values = uniform(&mut r, vocab * hidden, -1.0, 1.0);
        let ids: Vec<u32> = vec![0, 999, 5, 5, 123, 777, 1];
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let bytes = stored(&values, dtype);
            let table = MatRef {
                dtype,
                rows: vocab,
                cols: hidden,
                data: &bytes,
            };
            let mut want = vec![0.0f32; ids.len() * hidden];
            for (row, &id) in want.chunks_exact_mut(hidden).zip(&ids) {
                moerun_core::tensor::widen_into(dtype, table.row(id as usize), row);
            }
            let td = dev.upload_matrix(table).unwrap();
            let mut out = dev.upload(&poison(want.len())).unwrap();
            dev.embed(&td, &ids, &mut out).unwrap();
            let got = dev.download(&out).unwrap();
            let exact = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            check(
                &format!("embed {dtype}"),
                if exact { 0.0 } else { 1.0 },
                0.0,
            );

            let mut two = dev.zeros::<f32>(2 * hidden).unwrap();
            let err = dev.embed(&td, &[3, 1000], &mut two).unwrap_err();
            assert!(
                matches!(err, CudaError::InvalidArgument(ref m) if m.contains("1000")),
                "{err}"
            );
        }
    }
}

/// moerun-model's `route`, written out: softmax in f32, order by probability then lower index.
fn route_cpu(logits: &[f32], k: usize, renormalise: bool) -> (Vec<u32>, Vec<f32>) {
    let mut p = logits.to_vec();
    softmax_in_place(&mut p);
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order.truncate(k);
    let mut w: Vec<f32> = order.iter().map(|&e| p[e]).collect();
    if renormalise {
        let sum: f32 = w.iter().sum();
        w.iter_mut().for_each(|v| *v /= sum);
    }
    (order.into_iter().map(|e| e as u32).collect(), w)
}

#[test]
fn router_picks_the_cpu_experts_in_rank_order_with_ties_to_the_lower_index() {
    let Some(dev) = device() else { return };
    let mut r = rng("router");
    // Expert counts at and past each build's edge (1, 2, 4, 8, 16 experts per lane).
    for (tokens, experts, top_k, renormalise) in [
        (33usize, 128usize, 8usize, true),
        (6, 8, 8, true),
        (5, 32, 4, false),
        (5, 33, 4, true),
        (9, 60, 4, false),
        (5, 64, 8, false),
        (7, 65, 8, false),
        (4, 129, 8, true),
        (4, 256, 8, true),
        (3, 257, 8, false),
        (3, 512, 8, false),
    ] {
        let mut logits = uniform(&mut r, tokens * experts, -4.0, 4.0);
        // Token 0: all equal (ties everywhere); token 1: a repeated maximum.
        logits[..experts].fill(0.25);
        logits[experts + 3] = 9.0;
        logits[experts + 1] = 9.0;
        let (mut want_e, mut want_w) = (Vec::new(), Vec::new());
        for row in logits.chunks_exact(experts) {
            let (e, w) = route_cpu(row, top_k, renormalise);
            want_e.extend(e);
            want_w.extend(w);
        }
        let shape = RouterShape {
            experts,
            top_k,
            renormalise,
        };
        let ld = dev.upload(&logits).unwrap();
        let mut ed = dev.upload(&vec![u32::MAX; tokens * top_k]).unwrap();
        let mut wd = dev.upload(&poison(tokens * top_k)).unwrap();
        dev.route_topk(&ld, shape, &mut ed, &mut wd).unwrap();
        let (got_e, got_w) = (dev.download(&ed).unwrap(), dev.download(&wd).unwrap());
        let name = format!("router {experts}e top{top_k} renorm={renormalise}");
        assert_eq!(got_e, want_e, "{name}: experts");
        assert_eq!(&got_e[..top_k], &(0..top_k as u32).collect::<Vec<_>>()[..]);
        assert_eq!(
            &got_e[top_k..top_k + 2],
            &[1, 3],
            "repeated max: lower index first"
        );
        check(&name, rel_err(&got_w, &widen(&want_w)), 1e-5);
    }
}

#[test]
fn gemv_route_gives_the_bits_of_the_gemv_then_route_topk() {
    let Some(dev) = device() else { return };
    if !dev.gemv_route_supported(128) {
        println!("skipped: gemv_route needs sm_90+ (and MOERUN_CUDA_GEMV_ROUTE unset)");
        return;
    }
    let mut r = rng("gemv_route");
    // Each routing build (1, 2, 4 experts per lane), a cluster with idle and partial blocks
    // (100, 60, 8, 1 experts), columns below, at and past one chunk per thread (768, 2048,
    // 2056 bf16 values), every dtype, top-k up to all the experts, a NaN input, and ties: a zero
    // input (every probability equal) and a router whose second half repeats its first (pairs of
    // equal probabilities), where the lower index must win.
    for (experts, hidden, top_k, renormalise, dtype, input) in [
        (128usize, 2048usize, 8usize, true, DType::BF16, "random"),
        (100, 2048, 8, true, DType::BF16, "random"),
        (128, 2056, 128, true, DType::BF16, "random"),
        (60, 768, 4, false, DType::F16, "random"),
        (64, 1024, 8, false, DType::F32, "random"),
        (8, 4096, 2, true, DType::BF16, "random"),
        (1, 512, 1, false, DType::BF16, "random"),
        (33, 2048, 4, true, DType::BF16, "nan"),
        (128, 2048, 8, true, DType::BF16, "zero"),
        (96, 2048, 40, false, DType::BF16, "zero"),
        (128, 2048, 8, true, DType::BF16, "pairs"),
        (64, 1024, 11, true, DType::F32, "pairs"),
    ] {
        let mut rows = uniform(&mut r, experts * hidden, -0.1, 0.1);
        if input == "pairs" {
            let half = experts / 2 * hidden;
            rows.copy_within(..half, half);
        }
        let w = matrix(dev, &rows, dtype, experts);
        let mut x = uniform(&mut r, hidden, -2.0, 2.0);
        match input {
            "nan" => x[hidden / 2] = f32::NAN,
            "zero" => x.fill(0.0),
            _ => {}
        }
        let xd = dev.upload(&x).unwrap();
        let shape = RouterShape {
            experts,
            top_k,
            renormalise,
        };
        let mut logits = dev.upload(&poison(experts)).unwrap();
        dev.gemv(&xd, 1, &w, &mut logits).unwrap();
        let mut want_e = dev.upload(&vec![u32::MAX; top_k]).unwrap();
        let mut want_w = dev.upload(&poison(top_k)).unwrap();
        dev.route_topk(&logits, shape, &mut want_e, &mut want_w)
            .unwrap();
        let mut got_e = dev.upload(&vec![u32::MAX; top_k]).unwrap();
        let mut got_w = dev.upload(&poison(top_k)).unwrap();
        dev.gemv_route(&xd, &w, shape, &mut got_e, &mut got_w)
            .unwrap();
        let name = format!("gemv_route {experts}e x {hidden} {dtype} top{top_k} {input}");
        assert_eq!(
            dev.download(&got_e).unwrap(),
            dev.download(&want_e).unwrap(),
            "{name}: experts"
        );
        let same = bits_of(dev, &got_w) == bits_of(dev, &want_w);
        check(&name, if same { 0.0 } else { 1.0 }, 0.0);
    }

    // More experts than a cluster's 128 rows: refused by name, route_topk takes them.
    let w = matrix(dev, &[0.0; 129 * 64], DType::BF16, 129);
    let xd = dev.upload(&vec![0.0f32; 64]).unwrap();
    let shape = RouterShape {
        experts: 129,
        top_k: 8,
        renormalise: true,
    };
    let mut e = dev.zeros::<u32>(8).unwrap();
    let mut wt = dev.zeros::<f32>(8).unwrap();
    let err = dev.gemv_route(&xd, &w, shape, &mut e, &mut wt).unwrap_err();
    assert!(
        matches!(err, CudaError::InvalidArgument(ref m) if m.contains("129 experts")),
        "{err}"
    );
}

/// The add+RMSNorm before a MoE layer folded into its router: the residual bit for bit that of
/// add_rms_norm, the normed row within 1e-6 and the routing weights within 1e-5 of add_rms_norm
/// then gemv_route (the norm's scale applied after the sums: a few ulp), the same experts, for
/// rows of one chunk a thread and of several (the normed row's second path), every dtype;
/// routers past the cluster and mismatched rows refused by name.
#[test]
fn gemv_route_norm_matches_add_rms_norm_then_gemv_route() {
    let Some(dev) = device() else { return };
    if !dev.gemv_route_supported(128) {
        println!("skipped: gemv_route_norm needs sm_90+ (and MOERUN_CUDA_GEMV_ROUTE unset)");
        return;
    }
    let mut r = rng("gemv_route_norm");
    for (experts, hidden, top_k, dtype) in [
        (128usize, 2048usize, 8usize, DType::BF16),
        (100, 4096, 8, DType::BF16),
        (128, 2056, 128, DType::BF16),
        (60, 1000, 4, DType::F16),
        (64, 1024, 8, DType::F32),
        (8, 512, 2, DType::BF16),
        (33, 3000, 4, DType::BF16),
        (16, 4104, 4, DType::F32),
    ] {
        let w = matrix(
            dev,
            &uniform(&mut r, experts * hidden, -0.1, 0.1),
            dtype,
            experts,
        );
        let x = uniform(&mut r, hidden, -2.0, 2.0);
        let y = dev.upload(&uniform(&mut r, hidden, -2.0, 2.0)).unwrap();
        let norm = dev.upload(&uniform(&mut r, hidden, 0.5, 1.5)).unwrap();
        let shape = RouterShape {
            experts,
            top_k,
            renormalise: true,
        };
        let eps = 1e-6;
        // The reference: add_rms_norm, then gemv_route of its output.
        let mut want_x = dev.upload(&x).unwrap();
        let mut want_xn = dev.upload(&poison(hidden)).unwrap();
        dev.add_rms_norm(&mut want_x, &y, &norm, eps, &mut want_xn)
            .unwrap();
        let mut want_e = dev.upload(&vec![u32::MAX; top_k]).unwrap();
        let mut want_w = dev.upload(&poison(top_k)).unwrap();
        dev.gemv_route(&want_xn, &w, shape, &mut want_e, &mut want_w)
            .unwrap();
        let xd = dev.upload(&x).unwrap();
        let mut got_x = dev.upload(&poison(hidden)).unwrap();
        let mut got_xn = dev.upload(&poison(hidden)).unwrap();
        let mut got_e = dev.upload(&vec![u32::MAX; top_k]).unwrap();
        let mut got_w = dev.upload(&poison(top_k)).unwrap();
        dev.gemv_route_norm(
            (&xd, &y, &norm, eps),
            (&mut got_x, &mut got_xn),
            &w,
            shape,
            &mut got_e,
            &mut got_w,
        )
        .unwrap();
        let name = format!("gemv_route_norm {experts}e x {hidden} {dtype} top{top_k}");
        assert_eq!(
            dev.download(&got_e).unwrap(),
            dev.download(&want_e).unwrap(),
            "{name}: experts"
        );
        assert_eq!(
            bits_of(dev, &got_x),
            bits_of(dev, &want_x),
            "{name}: the residual"
        );
        check(
            &format!("{name} (normed row)"),
            rel_err_on(dev, &got_xn, &want_xn),
            1e-6,
        );
        check(
            &format!("{name} (weights)"),
            rel_err_on(dev, &got_w, &want_w),
            1e-5,
        );
    }
    // Refused by name: a router past the cluster's 128 rows, and rows that do not fit it.
    let row = |len| dev.zeros::<f32>(len).unwrap();
    let mut e = dev.zeros::<u32>(2).unwrap();
    let mut wt = dev.zeros::<f32>(2).unwrap();
    let shape = |experts| RouterShape {
        experts,
        top_k: 2,
        renormalise: true,
    };
    let norm = row(64);
    for (experts, y_len, what) in [(129, 64, "129 experts"), (8, 60, "y 60")] {
        let w = matrix(dev, &vec![0.0; experts * 64], DType::BF16, experts);
        let (x, y, mut x_out, mut xn) = (row(64), row(y_len), row(64), row(64));
        let err = dev
            .gemv_route_norm(
                (&x, &y, &norm, 1e-6),
                (&mut x_out, &mut xn),
                &w,
                shape(experts),
                &mut e,
                &mut wt,
            )
            .unwrap_err();
        assert!(
            matches!(err, CudaError::InvalidArgument(ref m) if m.contains(what)),
            "{err}"
        );
    }
}

/// One token's add+norm folded into the GEMV after it: the residual `x + r` bit for bit that of
/// add_rms_norm, the products within 1e-5 of add_rms_norm then the GEMV (the norm's scale applied
/// after the sums, and the squares summed in another order: a few ulp), for rows of one chunk a
/// thread, more, and a ragged last one, every dtype, row counts not a multiple of 4.
#[test]
fn gemv_add_norm_matches_add_rms_norm_then_the_gemv() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemv_add_norm");
    for (n, k, dtype) in [
        (5120usize, 2048usize, DType::BF16),
        (1030, 4096, DType::BF16),
        (33, 3000, DType::BF16),
        (100, 1000, DType::F16),
        (64, 1024, DType::F32),
        (7, 4104, DType::F32),
    ] {
        let w = matrix(dev, &uniform(&mut r, n * k, -0.1, 0.1), dtype, n);
        let x = uniform(&mut r, k, -2.0, 2.0);
        let y = dev.upload(&uniform(&mut r, k, -2.0, 2.0)).unwrap();
        let norm = dev.upload(&uniform(&mut r, k, 0.5, 1.5)).unwrap();
        let eps = 1e-6;
        let mut want_x = dev.upload(&x).unwrap();
        let mut xn = dev.upload(&poison(k)).unwrap();
        dev.add_rms_norm(&mut want_x, &y, &norm, eps, &mut xn)
            .unwrap();
        let mut want = dev.upload(&poison(n)).unwrap();
        dev.gemv(&xn, 1, &w, &mut want).unwrap();
        let xd = dev.upload(&x).unwrap();
        let mut got_x = dev.upload(&poison(k)).unwrap();
        let mut got = dev.upload(&poison(n)).unwrap();
        dev.gemv_add_norm((&xd, &y, &norm, eps), &w, &mut got_x, &mut got)
            .unwrap();
        let name = format!("gemv_add_norm {n} x {k} {dtype}");
        assert_eq!(
            bits_of(dev, &got_x),
            bits_of(dev, &want_x),
            "{name}: the residual"
        );
        let want = widen(&dev.download(&want).unwrap());
        check(&name, rel_err(&dev.download(&got).unwrap(), &want), 1e-5);
    }
    // Lengths that do not fit the matrix: refused by name.
    let w = matrix(dev, &vec![0.0; 8 * 64], DType::BF16, 8);
    let row = |len| dev.zeros::<f32>(len).unwrap();
    let (x, y, norm, mut x_out, mut out) = (row(64), row(60), row(64), row(64), row(8));
    let err = dev
        .gemv_add_norm((&x, &y, &norm, 1e-6), &w, &mut x_out, &mut out)
        .unwrap_err();
    assert!(
        matches!(err, CudaError::InvalidArgument(ref m) if m.contains("r 60")),
        "{err}"
    );
}

/// The strided grid of gemv_add_norm (one wave of blocks striding over the 4-row groups, two
/// groups in flight a thread) gives the bits of a block per group, residual included: rows of
/// 256 chunks in every dtype, row counts below one group, not a multiple of 4, fewer groups than
/// the wave and many more (an LM head's 151,936 rows); other row widths are refused by name.
#[test]
fn gemv_add_norm_strided_grid_matches_a_block_per_group_bit_for_bit() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemv_add_norm_strided");
    for (n, k, dtype) in [
        (5120usize, 2048usize, DType::BF16),
        (151_936, 2048, DType::BF16),
        (4101, 2048, DType::F16),
        (3, 2048, DType::BF16),
        (517, 1024, DType::F32),
    ] {
        let w = matrix(dev, &uniform(&mut r, n * k, -0.1, 0.1), dtype, n);
        let x = dev.upload(&uniform(&mut r, k, -2.0, 2.0)).unwrap();
        let y = dev.upload(&uniform(&mut r, k, -2.0, 2.0)).unwrap();
        let norm = dev.upload(&uniform(&mut r, k, 0.5, 1.5)).unwrap();
        let run = |grid| {
            let mut x_out = dev.upload(&poison(k)).unwrap();
            let mut out = dev.upload(&poison(n)).unwrap();
            dev.gemv_add_norm_in(grid, (&x, &y, &norm, 1e-6), &w, &mut x_out, &mut out)
                .unwrap();
            (bits_of(dev, &x_out), bits_of(dev, &out))
        };
        let (want_x, want) = run(AddNormGrid::PerGroup);
        let (got_x, got) = run(AddNormGrid::Strided);
        let name = format!("gemv_add_norm strided {n} x {k} {dtype}");
        assert_eq!(got_x, want_x, "{name}: the residual");
        assert_eq!(got, want, "{name}: the products");
        assert!(
            want.iter().all(|&b| !f32::from_bits(b).is_nan()),
            "{name}: every row written"
        );
    }
    let w = matrix(dev, &vec![0.0; 8 * 4096], DType::BF16, 8);
    let row = |len| dev.zeros::<f32>(len).unwrap();
    let (x, y, norm, mut x_out, mut out) = (row(4096), row(4096), row(4096), row(4096), row(8));
    let err = dev
        .gemv_add_norm_in(
            AddNormGrid::Strided,
            (&x, &y, &norm, 1e-6),
            &w,
            &mut x_out,
            &mut out,
        )
        .unwrap_err();
    assert!(
        matches!(err, CudaError::InvalidArgument(ref m) if m.contains("strided grid")),
        "{err}"
    );
}

/// The engine's greedy pick, written out: strictly greater wins, so the lowest index among equal
/// values, NaN never, and 0 when nothing is above -inf.
fn argmax_cpu(row: &[f32]) -> u32 {
    let (mut best, mut value) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > value {
            best = i;
            value = v;
        }
    }
    best as u32
}

#[test]
fn argmax_rows_picks_the_cpu_greedy_token_with_ties_nan_and_empty_rows() {
    let Some(dev) = device() else { return };
    let mut r = rng("argmax_rows");
    for (rows, width) in [(1usize, 151936usize), (7, 1000), (128, 4096), (3, 5)] {
        let mut x = uniform(&mut r, rows * width, -4.0, 4.0);
        if rows >= 3 {
            // Row 0: a repeated maximum (the lower index wins); row 1: NaNs and the maximum
            // after them; row 2: nothing above -inf (index 0).
            x[width - 1] = 9.0;
            x[width / 2] = 9.0;
            x[width] = f32::NAN;
            x[width + 2] = f32::NAN;
            x[width + 3] = 7.5;
            x[2 * width..3 * width].fill(f32::NEG_INFINITY);
        }
        let want: Vec<u32> = x.chunks_exact(width).map(argmax_cpu).collect();
        let xd = dev.upload(&x).unwrap();
        let mut out = dev.upload(&vec![u32::MAX; rows]).unwrap();
        dev.argmax_rows(&xd, width, &mut out).unwrap();
        assert_eq!(dev.download(&out).unwrap(), want, "{rows} x {width}");
        if rows >= 3 {
            assert_eq!(want[0], (width / 2) as u32);
            assert_eq!(want[2], 0);
        }
    }
    let xd = dev.upload(&[1.0f32; 10]).unwrap();
    let mut out = dev.zeros::<u32>(3).unwrap();
    let err = dev.argmax_rows(&xd, 3, &mut out).unwrap_err();
    assert!(err.to_string().contains("not rows of 3"), "{err}");
}

#[test]
fn argmax_rows_advancing_writes_the_next_steps_token_and_positions_and_the_host_picks() {
    let Some(dev) = device() else { return };
    let mut r = rng("argmax_rows_advancing");
    let (rows, width) = (3usize, 151936usize);
    let x = uniform(&mut r, rows * width, -4.0, 4.0);
    let want: Vec<u32> = x.chunks_exact(width).map(argmax_cpu).collect();
    let xd = dev.upload(&x).unwrap();
    let mut scratch = moerun_cuda::ArgmaxScratch::new(dev, rows).unwrap();
    let mut out = dev.upload(&vec![u32::MAX; rows]).unwrap();
    let mut tokens = dev.upload(&[7u32, 8, 9]).unwrap();
    let mut positions = dev.upload(&[511i32, 0, 40]).unwrap();
    let mut positions_u32 = dev.upload(&[511u32, 0, 40]).unwrap();
    // The second step also writes the picks straight to page-locked host memory.
    let mut host = dev.mapped_u32(rows).unwrap();
    // No pick: what the kernel must overwrite.
    host.pinned_mut().as_mut_slice().unwrap().fill(u32::MAX);
    let done = dev.new_event().unwrap();
    for step in 1..=2 {
        let next = moerun_cuda::NextStepInputs {
            tokens: &mut tokens,
            positions: &mut positions,
            positions_u32: &mut positions_u32,
            host_picks: (step == 2).then_some(&mut host),
        };
        dev.argmax_rows_advancing(&xd, width, &mut out, &mut scratch, next)
            .unwrap();
        if step == 2 {
            dev.record(&done).unwrap();
            done.synchronize().unwrap();
            assert_eq!(host.as_slice().unwrap(), &want[..], "the host's picks");
        }
        assert_eq!(dev.download(&out).unwrap(), want);
        assert_eq!(
            dev.download(&tokens).unwrap(),
            want,
            "the picks are the next tokens"
        );
        let at = [511 + step, step, 40 + step];
        assert_eq!(dev.download(&positions).unwrap(), at.to_vec());
        let at_u32: Vec<u32> = at.iter().map(|&p| p as u32).collect();
        assert_eq!(dev.download(&positions_u32).unwrap(), at_u32);
    }
    // Next-step buffers for fewer rows than the logits hold are refused by name.
    let mut short = dev.zeros::<u32>(2).unwrap();
    let next = moerun_cuda::NextStepInputs {
        tokens: &mut short,
        positions: &mut positions,
        positions_u32: &mut positions_u32,
        host_picks: None,
    };
    let err = dev
        .argmax_rows_advancing(&xd, width, &mut out, &mut scratch, next)
        .unwrap_err();
    assert!(err.to_string().contains("next-step inputs"), "{err}");
    let mut short_host = dev.mapped_u32(2).unwrap();
    let next = moerun_cuda::NextStepInputs {
        tokens: &mut tokens,
        positions: &mut positions,
        positions_u32: &mut positions_u32,
        host_picks: Some(&mut short_host),
    };
    let err = dev
        .argmax_rows_advancing(&xd, width, &mut out, &mut scratch, next)
        .unwrap_err();
    assert!(err.to_string().contains("next-step inputs"), "{err}");
}
