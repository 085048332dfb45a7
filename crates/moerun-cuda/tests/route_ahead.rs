//! The route ahead (ops/route_ahead.rs) against the path it replaces on a batch-1 decode step:
//! o_proj's GEMV, then the add+norm folded into the router (gemv_route_norm), then the routed
//! experts of the normed row. The same o_proj output and residual bit for bit, the same experts,
//! the routing weights and the experts' sum within 1e-5 (the norm's scale applied after the sums
//! and the router's logits through the fold: f32 rounding only), the logits' scale-free part `u`
//! within 1e-5 of the router's logits over the norm's scale. Without a GPU every test prints
//! "skipped: CUDA is unavailable: <reason>" and passes.

mod common;

use common::{
    bits_of, check, device, matrix, poison, rel_err, rel_err_on, rng, stored, uniform, widen,
};
use moerun_core::{DType, MatRef};
use moerun_cuda::{CudaDevice, CudaError, DeviceExperts, RouteInputs, RouterShape};
use rand::rngs::StdRng;

fn experts(
    dev: &CudaDevice,
    r: &mut StdRng,
    (n, hidden, inter): (usize, usize, usize),
    dtype: DType,
) -> DeviceExperts {
    let mats: Vec<[Vec<u8>; 3]> = (0..n)
        .map(|_| {
            [
                stored(&uniform(r, inter * hidden, -0.05, 0.05), dtype),
                stored(&uniform(r, inter * hidden, -0.05, 0.05), dtype),
                stored(&uniform(r, hidden * inter, -0.05, 0.05), dtype),
            ]
        })
        .collect();
    fn view(dtype: DType, data: &[u8], rows: usize, cols: usize) -> MatRef<'_> {
        MatRef {
            dtype,
            rows,
            cols,
            data,
        }
    }
    let parts: Vec<_> = mats
        .iter()
        .map(|[g, u, d]| {
            (
                view(dtype, g, inter, hidden),
                view(dtype, u, inter, hidden),
                view(dtype, d, hidden, inter),
            )
        })
        .collect();
    dev.upload_experts(&parts).unwrap()
}

#[test]
fn route_ahead_matches_o_proj_then_the_folded_router_and_the_experts() {
    let Some(dev) = device() else { return };
    if !dev.gemv_route_supported(128) {
        println!("skipped: the reference (gemv_route_norm) needs sm_90+");
        return;
    }
    let mut r = rng("route_ahead");
    // (experts, top_k, renormalise, hidden, attention width, expert intermediate, dtype)
    for (e, k, renorm, hidden, width, inter, dtype) in [
        (
            128usize,
            8usize,
            true,
            2048usize,
            4096usize,
            768usize,
            DType::BF16,
        ),
        (60, 4, false, 1000, 520, 96, DType::BF16),
        (8, 2, true, 512, 1024, 64, DType::F16),
        (64, 8, true, 256, 128, 32, DType::F32),
        (128, 32, true, 64, 64, 16, DType::BF16),
    ] {
        let name = format!("route_ahead {e}e top{k} H{hidden} W{width} I{inter} {dtype}");
        let o_proj = matrix(
            dev,
            &uniform(&mut r, hidden * width, -0.05, 0.05),
            dtype,
            hidden,
        );
        let router = matrix(dev, &uniform(&mut r, e * hidden, -0.1, 0.1), dtype, e);
        let ex = experts(dev, &mut r, (e, hidden, inter), dtype);
        let a = dev.upload(&uniform(&mut r, width, -2.0, 2.0)).unwrap();
        let x_host = uniform(&mut r, hidden, -2.0, 2.0);
        let x = dev.upload(&x_host).unwrap();
        let norm = dev.upload(&uniform(&mut r, hidden, 0.5, 1.5)).unwrap();
        let eps = 1e-6;
        let shape = RouterShape {
            experts: e,
            top_k: k,
            renormalise: renorm,
        };
        let mut scratch = dev.moe_scratch(&ex, 1, k).unwrap();

        // The path it replaces.
        let mut y = dev.upload(&poison(hidden)).unwrap();
        dev.gemv(&a, 1, &o_proj, &mut y).unwrap();
        let mut want_x = dev.upload(&poison(hidden)).unwrap();
        let mut xn = dev.upload(&poison(hidden)).unwrap();
        let mut want_ids = dev.upload(&vec![u32::MAX; k]).unwrap();
        let mut want_w = dev.upload(&poison(k)).unwrap();
        dev.gemv_route_norm(
            (&x, &y, &norm, eps),
            (&mut want_x, &mut xn),
            &router,
            shape,
            &mut want_ids,
            &mut want_w,
        )
        .unwrap();
        let mut want_out = dev.upload(&poison(hidden)).unwrap();
        dev.moe_experts(&xn, &want_ids, &want_w, k, &ex, &mut scratch, &mut want_out)
            .unwrap();
        let mut logits = dev.upload(&poison(e)).unwrap();
        dev.gemv(&xn, 1, &router, &mut logits).unwrap();

        // The route ahead, twice: its arrival count must be back at zero after each launch.
        let fold = dev.route_fold(&router, &norm, &o_proj).unwrap();
        let mut firsts = None;
        for run in 0..2 {
            let mut got_y = dev.upload(&poison(hidden)).unwrap();
            let mut u = dev.upload(&poison(e)).unwrap();
            let mut ids = dev.upload(&vec![u32::MAX - 1; k]).unwrap();
            let inputs = RouteInputs {
                router: &router,
                norm: &norm,
                x: &x,
            };
            dev.gemv_route_ahead(
                &a,
                &o_proj,
                &mut got_y,
                inputs,
                (&fold, shape),
                (&mut u, &mut ids),
            )
            .unwrap();
            let mut got_x = dev.upload(&poison(hidden)).unwrap();
            let mut got_w = dev.upload(&poison(k)).unwrap();
            let mut got_out = dev.upload(&poison(hidden)).unwrap();
            dev.moe_experts_norm_routed(
                (&x, &got_y, &norm, eps),
                &mut got_x,
                (&u, &ids, renorm),
                &mut got_w,
                &ex,
                &mut scratch,
                &mut got_out,
            )
            .unwrap();
            assert_eq!(
                bits_of(dev, &got_y),
                bits_of(dev, &y),
                "{name}: o_proj's output"
            );
            assert_eq!(
                dev.download(&ids).unwrap(),
                dev.download(&want_ids).unwrap(),
                "{name}: experts"
            );
            assert_eq!(
                bits_of(dev, &got_x),
                bits_of(dev, &want_x),
                "{name}: the residual"
            );
            check(
                &format!("{name} (weights)"),
                rel_err_on(dev, &got_w, &want_w),
                1e-5,
            );
            check(
                &format!("{name} (experts' sum)"),
                rel_err_on(dev, &got_out, &want_out),
                1e-5,
            );
            // u over the norm's scale is the router's logits.
            let s = dev.download(&want_x).unwrap();
            let ms = s.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / hidden as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            let scaled: Vec<f32> = dev
                .download(&u)
                .unwrap()
                .iter()
                .map(|&v| (v as f64 * inv) as f32)
                .collect();
            check(
                &format!("{name} (u / rms)"),
                rel_err(&scaled, &widen(&dev.download(&logits).unwrap())),
                1e-5,
            );
            let now = (bits_of(dev, &u), dev.download(&ids).unwrap());
            match &firsts {
                None => firsts = Some(now),
                Some(f) => assert_eq!(f, &now, "{name}: run {run} differs from the first"),
            }
        }
    }
}

#[test]
fn route_ahead_refuses_shapes_it_cannot_take_by_name() {
    let Some(dev) = device() else { return };
    let m = |rows, cols| matrix(dev, &vec![0.0; rows * cols], DType::BF16, rows);
    let norm = dev.zeros::<f32>(64).unwrap();
    // A router whose columns are not o_proj's rows; more experts than one routing warp ranks.
    for (router, o_proj, what) in [
        (m(8, 64), m(32, 64), "router of 8 x 64"),
        (m(129, 64), m(64, 64), "router of 129 x 64"),
    ] {
        let err = dev.route_fold(&router, &norm, &o_proj).err().unwrap();
        assert!(
            matches!(err, CudaError::InvalidArgument(ref msg) if msg.contains(what)),
            "{err}"
        );
    }
    // gemv_route_ahead's refusal of an attention output of `a_len` values, for a router of
    // `experts` x 64 and top-`top_k` (o_proj 64 x 128): the message must contain `what`.
    let refused = |experts: usize, top_k: usize, a_len: usize, what: &str| {
        let (router, o_proj) = (m(experts, 64), m(64, 128));
        let fold = dev.route_fold(&router, &norm, &o_proj).unwrap();
        let shape = RouterShape {
            experts,
            top_k,
            renormalise: true,
        };
        let (a, x) = (
            dev.zeros::<f32>(a_len).unwrap(),
            dev.zeros::<f32>(64).unwrap(),
        );
        let mut y = dev.zeros::<f32>(64).unwrap();
        let mut u = dev.zeros::<f32>(experts).unwrap();
        let mut ids = dev.zeros::<u32>(top_k).unwrap();
        let inputs = RouteInputs {
            router: &router,
            norm: &norm,
            x: &x,
        };
        let err = dev
            .gemv_route_ahead(
                &a,
                &o_proj,
                &mut y,
                inputs,
                (&fold, shape),
                (&mut u, &mut ids),
            )
            .unwrap_err();
        assert!(
            matches!(err, CudaError::InvalidArgument(ref msg) if msg.contains(what)),
            "{err}"
        );
    };
    // An attention output of the wrong width; more experts a token than the last block's warp
    // ranks (one lane each).
    refused(8, 2, 100, "a 100");
    refused(64, 33, 128, "top_k 33");
}
