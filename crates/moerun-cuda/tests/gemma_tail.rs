//! Gemma 4's two layer tails (`gemma4_attn_tail`, `gemma4_ffn_tail`) on the GPU against the CPU
//! reference's steps written out (moerun-cpu's rms_norm_rows, then the adds and scales in the
//! order of crates/moerun-model/src/gemma4/forward.rs), on fresh random inputs.
//!
//! Threshold: 1e-5 norm-wise relative error, as rms_norm's (f32 on both sides, only the sums'
//! order differing). Without a GPU every test prints "skipped: CUDA is unavailable: <reason>"
//! and passes.

mod common;

use common::{check, device, poison, rel_err, rng, uniform, widen};
use moerun_cpu::ops::rms_norm_rows;
use moerun_cuda::{
    AttnTailNorms, AttnTailOut, CudaDevice, CudaSlice, FfnTail, RouterNorms, GEMMA_TAIL_MAX_WIDTH,
};

const EPS: f32 = 1e-6;

fn normed(x: &[f32], w: &[f32]) -> Vec<f32> {
    let mut v = x.to_vec();
    rms_norm_rows(&mut v, w, EPS);
    v
}

fn up(dev: &CudaDevice, v: &[f32]) -> CudaSlice<f32> {
    dev.upload(v).unwrap()
}

/// Widths below one block's pass, Gemma-4-26B-A4B's 2816, and the widest taken.
const SHAPES: [(usize, usize); 4] = [(1, 2816), (5, 100), (3, 2816), (2, GEMMA_TAIL_MAX_WIDTH)];

#[test]
fn attn_tail_matches_the_cpu_steps_with_and_without_the_router() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemma4_attn_tail");
    for (rows, width) in SHAPES {
        let x = uniform(&mut r, rows * width, -2.0, 2.0);
        let a = uniform(&mut r, rows * width, -3.0, 3.0);
        let [w_post, w_pre, scale, w_pre2] = [(); 4].map(|_| uniform(&mut r, width, 0.5, 1.5));
        let root = (width as f64).powf(-0.5) as f32;
        // CPU: x += post_attention(a); pre_feedforward(x); norm(x) * scale * root; pre_ff_2(x).
        let post = normed(&a, &w_post);
        let s: Vec<f32> = x.iter().zip(&post).map(|(x, p)| x + p).collect();
        let want_xn = normed(&s, &w_pre);
        let unit = normed(&s, &vec![1.0; width]);
        let want_xr: Vec<f32> = unit
            .chunks_exact(width)
            .flat_map(|row| row.iter().zip(&scale).map(|(v, c)| v * c * root))
            .collect();
        let want_xe = normed(&s, &w_pre2);

        let (ad, wpost, wpre) = (up(dev, &a), up(dev, &w_post), up(dev, &w_pre));
        let (sd, wpre2) = (up(dev, &scale), up(dev, &w_pre2));
        for with_router in [true, false] {
            let tag = format!("gemma4_attn_tail {rows}x{width} router={with_router}");
            let mut xd = up(dev, &x);
            let mut xn = up(dev, &poison(x.len()));
            let (mut xr, mut xe) = (up(dev, &poison(x.len())), up(dev, &poison(x.len())));
            let norms = AttnTailNorms {
                post_attention: &wpost,
                pre_feedforward: &wpre,
                router: with_router.then_some(RouterNorms {
                    scale: &sd,
                    root,
                    pre_feedforward_2: &wpre2,
                }),
                eps: EPS,
            };
            let out = AttnTailOut {
                normed: &mut xn,
                router_in: with_router.then_some((&mut xr, &mut xe)),
            };
            dev.gemma4_attn_tail(&mut xd, &ad, &norms, out).unwrap();
            let got_x = dev.download(&xd).unwrap();
            check(&format!("{tag} x"), rel_err(&got_x, &widen(&s)), 1e-5);
            let got_xn = dev.download(&xn).unwrap();
            check(
                &format!("{tag} xn"),
                rel_err(&got_xn, &widen(&want_xn)),
                1e-5,
            );
            let (got_xr, got_xe) = (dev.download(&xr).unwrap(), dev.download(&xe).unwrap());
            if with_router {
                check(
                    &format!("{tag} xr"),
                    rel_err(&got_xr, &widen(&want_xr)),
                    1e-5,
                );
                check(
                    &format!("{tag} xe"),
                    rel_err(&got_xe, &widen(&want_xe)),
                    1e-5,
                );
            } else {
                let untouched = |v: &[f32]| v.iter().all(|f| f.is_nan());
                assert!(
                    untouched(&got_xr) && untouched(&got_xe),
                    "{tag}: no router outputs written"
                );
            }
        }
    }
}

#[test]
fn ffn_tail_matches_the_cpu_steps_with_and_without_experts_and_the_next_norm() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemma4_ffn_tail");
    for (rows, width) in SHAPES {
        let x = uniform(&mut r, rows * width, -2.0, 2.0);
        let f = uniform(&mut r, rows * width, -3.0, 3.0);
        let routed = uniform(&mut r, rows * width, -1.0, 1.0);
        let [w1, w2, w_post, w_next] = [(); 4].map(|_| uniform(&mut r, width, 0.5, 1.5));
        let scalar = 0.75f32;
        let (fd, rd) = (up(dev, &f), up(dev, &routed));
        let (w1d, w2d, wpd, wnd) = (
            up(dev, &w1),
            up(dev, &w2),
            up(dev, &w_post),
            up(dev, &w_next),
        );
        for with_experts in [true, false] {
            for with_next in [true, false] {
                let tag = format!(
                    "gemma4_ffn_tail {rows}x{width} experts={with_experts} next={with_next}"
                );
                // CPU: f = pf1(f) + pf2(routed) (with experts); x = (x + post(f)) * scalar;
                // next(x).
                let branch = if with_experts {
                    let (a, b) = (normed(&f, &w1), normed(&routed, &w2));
                    a.iter().zip(&b).map(|(a, b)| a + b).collect()
                } else {
                    f.clone()
                };
                let post = normed(&branch, &w_post);
                let want_x: Vec<f32> = x.iter().zip(&post).map(|(x, p)| (x + p) * scalar).collect();
                let want_xn = normed(&want_x, &w_next);

                let mut xd = up(dev, &x);
                let mut xn = up(dev, &poison(x.len()));
                let tail = FfnTail {
                    dense: &fd,
                    routed: with_experts.then_some((&rd, &w1d, &w2d)),
                    post_feedforward: &wpd,
                    layer_scalar: scalar,
                    eps: EPS,
                };
                dev.gemma4_ffn_tail(&mut xd, &tail, with_next.then_some((&wnd, &mut xn)))
                    .unwrap();
                let got_x = dev.download(&xd).unwrap();
                check(&format!("{tag} x"), rel_err(&got_x, &widen(&want_x)), 1e-5);
                let got_xn = dev.download(&xn).unwrap();
                if with_next {
                    check(
                        &format!("{tag} xn"),
                        rel_err(&got_xn, &widen(&want_xn)),
                        1e-5,
                    );
                } else {
                    assert!(
                        got_xn.iter().all(|v| v.is_nan()),
                        "{tag}: no next norm written"
                    );
                }
            }
        }
    }
}

/// The attention tail's error over rows of `w`'s width, the router's norms (all `w`) given or
/// not, and no router outputs.
fn attn_tail_err(dev: &CudaDevice, w: &CudaSlice<f32>, x_len: usize, router: bool) -> String {
    let (mut x, mut o, a) = (
        up(dev, &vec![0.0; x_len]),
        up(dev, &vec![0.0; x_len]),
        up(dev, &vec![0.0; x_len]),
    );
    let norms = AttnTailNorms {
        post_attention: w,
        pre_feedforward: w,
        router: router.then_some(RouterNorms {
            scale: w,
            root: 1.0,
            pre_feedforward_2: w,
        }),
        eps: EPS,
    };
    let out = AttnTailOut {
        normed: &mut o,
        router_in: None,
    };
    dev.gemma4_attn_tail(&mut x, &a, &norms, out)
        .unwrap_err()
        .to_string()
}

#[test]
fn tails_refuse_rows_too_wide_and_buffers_that_do_not_match() {
    let Some(dev) = device() else { return };
    let wide = GEMMA_TAIL_MAX_WIDTH + 1;
    let err = attn_tail_err(dev, &up(dev, &vec![1.0; wide]), wide, false);
    assert!(
        err.contains(&format!("1..={GEMMA_TAIL_MAX_WIDTH}")),
        "{err}"
    );

    let (w, mut x, short) = (
        up(dev, &vec![1.0; 64]),
        up(dev, &vec![0.0; 128]),
        up(dev, &vec![0.0; 64]),
    );
    let mut o = up(dev, &vec![0.0; 128]);
    let tail = FfnTail {
        dense: &short,
        routed: None,
        post_feedforward: &w,
        layer_scalar: 1.0,
        eps: EPS,
    };
    let err = dev
        .gemma4_ffn_tail(&mut x, &tail, Some((&w, &mut o)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("buffers of [64, 128] values where x holds 128"),
        "{err}"
    );

    // The router's norms without its outputs.
    let err = attn_tail_err(dev, &w, 128, true);
    assert!(err.contains("go together"), "{err}");
}
