//! Route ahead (ops::route_ahead): one token's o_proj with the products its MoE routing is made
//! of, then the add+RMSNorm with that routing, against the plain GEMV and add_rms_norm (the same
//! bits) and against a routing of `router · norm(x + y)` in f64 (the same experts; weights within
//! f32 rounding).

mod common;

use common::{bits_of, check, device, matrix, poison, rel_err, rng, uniform};
use moerun_core::DType;
use moerun_cuda::{CudaError, RouterShape};

/// `w` ([rows, cols], row-major) widened as the device reads it: `dtype`'s rounding of `values`.
fn rounded(values: &[f32], dtype: DType) -> Vec<f64> {
    let bytes = common::stored(values, dtype);
    let mut out = vec![0.0f32; values.len()];
    moerun_core::tensor::widen_into(dtype, &bytes, &mut out);
    out.into_iter().map(f64::from).collect()
}

/// Softmax of `logits`, the top `k` by probability (ties to the lower index), optionally
/// renormalised: moerun-model's `route` in f64.
fn route_f64(logits: &[f64], k: usize, renormalise: bool) -> (Vec<u32>, Vec<f64>) {
    let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
    let sum: f64 = e.iter().sum();
    let mut order: Vec<usize> = (0..e.len()).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
    order.truncate(k);
    let mut w: Vec<f64> = order.iter().map(|&i| e[i] / sum).collect();
    if renormalise {
        let t: f64 = w.iter().sum();
        w.iter_mut().for_each(|v| *v /= t);
    }
    (order.into_iter().map(|i| i as u32).collect(), w)
}

#[test]
fn route_ahead_gives_o_proj_bits_add_rms_norm_bits_and_the_routing_of_the_normed_row() {
    let Some(dev) = device() else { return };
    let mut r = rng("route_ahead");
    // Each routing build (1, 2, 4 experts a lane), bf16 (hi and lo halves) and f32 matrices,
    // renormalised or not, up to 32 choices.
    for (experts, hidden, width, top_k, renormalise, dtype) in [
        (128usize, 2048usize, 4096usize, 8usize, true, DType::BF16),
        (60, 512, 1024, 4, false, DType::BF16),
        (8, 256, 512, 2, true, DType::F32),
        (128, 512, 256, 32, false, DType::F32),
        (33, 1024, 2048, 1, true, DType::BF16),
    ] {
        let name = format!("route ahead {experts}e {hidden}x{width} {dtype} top{top_k}");
        let router_v = uniform(&mut r, experts * hidden, -0.1, 0.1);
        let wo_v = uniform(&mut r, hidden * width, -0.05, 0.05);
        let router = matrix(dev, &router_v, dtype, experts);
        let wo = matrix(dev, &wo_v, dtype, hidden);
        let g = uniform(&mut r, hidden, 0.5, 1.5);
        let gd = dev.upload(&g).unwrap();
        let x = uniform(&mut r, hidden, -2.0, 2.0);
        let a = uniform(&mut r, width, -1.0, 1.0);
        let ad = dev.upload(&a).unwrap();
        let ra = dev.route_ahead_weights(&router, &gd, &wo).unwrap();
        assert_eq!(ra.experts(), experts);

        // o_proj and the products in one launch; y must be the GEMV's bits.
        let xd = dev.upload(&x).unwrap();
        let mut y = dev.upload(&poison(hidden)).unwrap();
        let mut z = dev.upload(&poison(ra.z_len())).unwrap();
        dev.gemv_route_ahead(&ad, &xd, &wo, &ra, &mut y, &mut z)
            .unwrap();
        let mut want_y = dev.upload(&poison(hidden)).unwrap();
        dev.gemv(&ad, 1, &wo, &mut want_y).unwrap();
        assert_eq!(bits_of(dev, &y), bits_of(dev, &want_y), "{name}: o_proj");

        // The add+norm with the routing against add_rms_norm (bits) and routing in f64.
        let eps = 1e-6;
        let shape = RouterShape {
            experts,
            top_k,
            renormalise,
        };
        let mut got_x = dev.upload(&x).unwrap();
        let mut got_xn = dev.upload(&poison(hidden)).unwrap();
        let mut got_e = dev.upload(&vec![u32::MAX; top_k]).unwrap();
        let mut got_w = dev.upload(&poison(top_k)).unwrap();
        dev.add_rms_norm_route(
            &mut got_x,
            &y,
            &gd,
            eps,
            &mut got_xn,
            (&z, &ra),
            shape,
            &mut got_e,
            &mut got_w,
        )
        .unwrap();
        let mut want_x = dev.upload(&x).unwrap();
        let mut want_xn = dev.upload(&poison(hidden)).unwrap();
        dev.add_rms_norm(&mut want_x, &y, &gd, eps, &mut want_xn)
            .unwrap();
        assert_eq!(bits_of(dev, &got_x), bits_of(dev, &want_x), "{name}: x");
        assert_eq!(
            bits_of(dev, &got_xn),
            bits_of(dev, &want_xn),
            "{name}: normed row"
        );

        // The router over the normed row, in f64 from the stored weights.
        let xn: Vec<f64> = dev
            .download(&want_xn)
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect();
        let rw = rounded(&router_v, dtype);
        let logits: Vec<f64> = (0..experts)
            .map(|e| (0..hidden).map(|j| rw[e * hidden + j] * xn[j]).sum())
            .collect();
        // The experts: the f64 top k, rank by rank, up to near-ties. The two sides' logits
        // differ by summation order and by M's and R's hi/lo rounding (~2^-17 of each product:
        // ~2e-5 here), so a rank may hold the other of two logits closer than TIE; with wider
        // gaps (nearly always) the ids must be the f64 routing's exactly.
        const TIE: f64 = 1e-4;
        let (want_e, _) = route_f64(&logits, top_k, renormalise);
        let got_e = dev.download(&got_e).unwrap();
        let mut sorted = logits.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let gap = (0..top_k.min(experts - 1))
            .map(|i| sorted[i] - sorted[i + 1])
            .fold(f64::INFINITY, f64::min);
        if gap > TIE {
            assert_eq!(got_e, want_e, "{name}: experts");
        }
        let mut distinct = got_e.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), top_k, "{name}: distinct experts {got_e:?}");
        for (rank, &e) in got_e.iter().enumerate() {
            let off = (logits[e as usize] - sorted[rank]).abs();
            assert!(
                off <= TIE,
                "{name}: rank {rank} took expert {e}, {off:e} off the f64 rank"
            );
        }
        // Their weights: the f64 softmax of those experts (renormalised over them if asked).
        let mx = sorted[0];
        let total: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
        let mut want_w: Vec<f64> = got_e
            .iter()
            .map(|&e| (logits[e as usize] - mx).exp() / total)
            .collect();
        if renormalise {
            let t: f64 = want_w.iter().sum();
            want_w.iter_mut().for_each(|v| *v /= t);
        }
        check(
            &name,
            rel_err(&dev.download(&got_w).unwrap(), &want_w),
            1e-4,
        );
    }

    // f16 weights and more than 128 experts are refused by name.
    let router = matrix(dev, &[0.0; 4 * 64], DType::F16, 4);
    let wo = matrix(dev, &[0.0; 64 * 64], DType::F16, 64);
    let g = dev.upload(&[1.0f32; 64]).unwrap();
    let err = dev.route_ahead_weights(&router, &g, &wo).err().unwrap();
    assert!(
        matches!(err, CudaError::Unsupported(ref m) if m.contains("f16")),
        "{err}"
    );
    assert!(!dev.route_ahead_supported(129, 8, DType::BF16));
    assert!(!dev.route_ahead_supported(128, 33, DType::BF16));
}
