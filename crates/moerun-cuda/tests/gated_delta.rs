//! Qwen3.5's Gated DeltaNet ops on the GPU against moerun-cpu's kernels, step by step over a
//! batch of sequences with their own (non-zero) carried state: causal conv + SiLU from the conv
//! window, l2norm/β/decay, the delta rule (both device kernels: the column split for key_dim 16,
//! 32, 64, 128 and the row split for other key_dims), the gated RMSNorm; outputs and the states
//! left behind. Plus the attention output gate's split and sigmoid gate.
//!
//! Threshold 1e-5 (norm-wise relative error): f32 on both sides, only summation order and
//! FMA contraction differ. Without a GPU every test prints "skipped: ..." and passes.

mod common;

use common::{check, device, rel_err, rng, uniform, widen};
use moerun_cpu::gated_delta::{causal_conv1d_silu, gated_delta_rule_recurrent, DeltaHead};
use moerun_cpu::ops::{l2_normalize_rows, rms_norm_gated_rows, sigmoid, softplus};
use moerun_cuda::{DeltaSeqs, DeltaShape};

#[test]
fn gated_deltanet_steps_match_the_cpu_from_carried_state_for_every_kernel() {
    let Some(dev) = device() else { return };
    let mut r = rng("gated_delta");
    // (key heads, value heads, key_dim, value_dim): Qwen3.5-35B-A3B's heads (column split, 4
    // lanes per column), the fixtures' (16 x 24), key_dim 64 (2 lanes), 48 (row split).
    for (kh, hv, dk, dv) in [
        (2, 4, 128, 128),
        (2, 4, 16, 24),
        (1, 2, 64, 40),
        (2, 2, 48, 32),
    ] {
        let shape = DeltaShape {
            key_heads: kh,
            value_heads: hv,
            key_dim: dk,
            value_dim: dv,
            conv_kernel: 4,
        };
        let cd = shape.conv_dim();
        let conv_len = 3 * cd;
        let rec_len = hv * dk * dv;
        // Three sequences: a prefill run, an empty chunk, a decode step.
        let lens = [37usize, 0, 1];
        let rows: usize = lens.iter().sum();
        let x = uniform(&mut r, rows * cd, -1.5, 1.5);
        let taps = uniform(&mut r, 4 * cd, -0.5, 0.5);
        let b = uniform(&mut r, rows * hv, -3.0, 3.0);
        let a = uniform(&mut r, rows * hv, -3.0, 3.0);
        let a_log = uniform(&mut r, hv, -1.0, 1.0);
        let dt_bias = uniform(&mut r, hv, -1.0, 1.0);
        let z = uniform(&mut r, rows * hv * dv, -2.0, 2.0);
        let norm_w = uniform(&mut r, dv, 0.5, 1.5);
        let init: Vec<Vec<f32>> = lens
            .iter()
            .map(|_| uniform(&mut r, conv_len + rec_len, -0.3, 0.3))
            .collect();

        // The CPU, sequence by sequence.
        let mut want_x = x.clone();
        let mut want_states = init.clone();
        let mut start = 0;
        for (s, &n) in lens.iter().enumerate() {
            let (win, _) = want_states[s].split_at_mut(conv_len);
            causal_conv1d_silu(&mut want_x[start * cd..(start + n) * cd], win, &taps, cd);
            start += n;
        }
        for row in want_x.chunks_exact_mut(cd) {
            l2_normalize_rows(&mut row[..2 * kh * dk], dk, 1e-6);
        }
        let beta: Vec<f32> = b.iter().map(|&v| sigmoid(v)).collect();
        let (al, dt) = (&a_log, &dt_bias);
        let g: Vec<f32> = a
            .chunks_exact(hv)
            .flat_map(|row| (0..hv).map(move |h| -al[h].exp() * softplus(row[h] + dt[h])))
            .collect();
        let mut want_core = vec![0.0f32; rows * hv * dv];
        let mut start = 0;
        for (s, &n) in lens.iter().enumerate() {
            for h in 0..hv {
                let k_head = h / (hv / kh);
                let col = |off: usize, width: usize| -> Vec<f32> {
                    (start..start + n)
                        .flat_map(|t| want_x[t * cd + off..][..width].to_vec())
                        .collect()
                };
                let q = col(k_head * dk, dk);
                let k = col(kh * dk + k_head * dk, dk);
                let v = col(2 * kh * dk + h * dv, dv);
                let gs: Vec<f32> = (start..start + n).map(|t| g[t * hv + h]).collect();
                let bs: Vec<f32> = (start..start + n).map(|t| beta[t * hv + h]).collect();
                let head = DeltaHead {
                    q: &q,
                    k: &k,
                    v: &v,
                    g: &gs,
                    beta: &bs,
                    key_dim: dk,
                    value_dim: dv,
                };
                let state = &mut want_states[s][conv_len + h * dk * dv..][..dk * dv];
                let mut out = vec![0.0f32; n * dv];
                gated_delta_rule_recurrent(&head, state, &mut out);
                for (i, o) in out.chunks_exact(dv).enumerate() {
                    want_core[(start + i) * hv * dv + h * dv..][..dv].copy_from_slice(o);
                }
            }
            start += n;
        }
        let mut want_out = want_core.clone();
        rms_norm_gated_rows(&mut want_out, &z, &norm_w, 1e-6);

        // The GPU, all sequences at once.
        let slots: Vec<_> = init.iter().map(|s| dev.upload(s).unwrap()).collect();
        let addrs: Vec<u64> = slots
            .iter()
            .map(|s| dev.state_address(s).unwrap())
            .collect();
        let starts: Vec<i32> = lens
            .iter()
            .scan(0, |acc, &n| {
                let s = *acc;
                *acc += n as i32;
                Some(s)
            })
            .collect();
        let lens_i32: Vec<i32> = lens.iter().map(|&n| n as i32).collect();
        let (seq_start, seq_len, states) = (
            dev.upload(&starts).unwrap(),
            dev.upload(&lens_i32).unwrap(),
            dev.upload(&addrs).unwrap(),
        );
        let seqs = DeltaSeqs {
            seq_start: &seq_start,
            seq_len: &seq_len,
            states: &states,
            rows,
        };
        let mut xd = dev.upload(&x).unwrap();
        dev.deltanet_conv_silu(&mut xd, &dev.upload(&taps).unwrap(), shape, &seqs, 0)
            .unwrap();
        let mut beta_d = dev.alloc_f32(rows * hv).unwrap();
        let mut g_d = dev.alloc_f32(rows * hv).unwrap();
        dev.deltanet_gates(
            &mut xd,
            shape,
            &dev.upload(&b).unwrap(),
            &dev.upload(&a).unwrap(),
            &dev.upload(&a_log).unwrap(),
            &dev.upload(&dt_bias).unwrap(),
            &mut beta_d,
            &mut g_d,
        )
        .unwrap();
        let what = format!("kh {kh} hv {hv} dk {dk} dv {dv}");
        check(
            &format!("conv+l2norm {what}"),
            rel_err(&dev.download(&xd).unwrap(), &widen(&want_x)),
            1e-5,
        );
        check(
            &format!("beta {what}"),
            rel_err(&dev.download(&beta_d).unwrap(), &widen(&beta)),
            1e-5,
        );
        check(
            &format!("g {what}"),
            rel_err(&dev.download(&g_d).unwrap(), &widen(&g)),
            1e-5,
        );
        let mut core = dev.alloc_f32(rows * hv * dv).unwrap();
        dev.gated_delta_recurrent(&xd, &beta_d, &g_d, shape, &seqs, conv_len, &mut core)
            .unwrap();
        check(
            &format!("delta rule {what}"),
            rel_err(&dev.download(&core).unwrap(), &widen(&want_core)),
            1e-5,
        );
        dev.gated_rms_norm(
            &mut core,
            &dev.upload(&z).unwrap(),
            &dev.upload(&norm_w).unwrap(),
            1e-6,
        )
        .unwrap();
        check(
            &format!("gated norm {what}"),
            rel_err(&dev.download(&core).unwrap(), &widen(&want_out)),
            1e-5,
        );
        for (s, slot) in slots.iter().enumerate() {
            let got = dev.download(slot).unwrap();
            check(
                &format!("state of sequence {s} (len {}) {what}", lens[s]),
                rel_err(&got, &widen(&want_states[s])),
                1e-5,
            );
            if lens[s] == 0 {
                assert_eq!(got, init[s], "an empty chunk leaves its state untouched");
            }
        }
    }
}

#[test]
fn attention_output_gate_ops_match_the_cpu() {
    let Some(dev) = device() else { return };
    let mut r = rng("output_gate");
    let (rows, heads, d) = (5usize, 3usize, 32usize);
    let x = uniform(&mut r, rows * heads * 2 * d, -4.0, 4.0);
    let mut q = Vec::new();
    let mut gate = Vec::new();
    for head in x.chunks_exact(2 * d) {
        q.extend_from_slice(&head[..d]);
        gate.extend_from_slice(&head[d..]);
    }
    let n = rows * heads * d;
    let (mut qd, mut gd) = (dev.alloc_f32(n).unwrap(), dev.alloc_f32(n).unwrap());
    dev.split_query_gate(&dev.upload(&x).unwrap(), d, &mut qd, &mut gd)
        .unwrap();
    assert_eq!(dev.download(&qd).unwrap(), q);
    assert_eq!(dev.download(&gd).unwrap(), gate);
    let want: Vec<f32> = q.iter().zip(&gate).map(|(v, g)| v * sigmoid(*g)).collect();
    dev.sigmoid_gate(&mut qd, &gd).unwrap();
    check(
        "sigmoid_gate",
        rel_err(&dev.download(&qd).unwrap(), &widen(&want)),
        1e-6,
    );
}
