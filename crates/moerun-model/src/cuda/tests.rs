//! The CUDA backend's ops against the CPU's, one by one through the [`Backend`] trait, on the
//! same inputs (the f32 qwen3_moe fixture's first layer): where a whole-model mismatch would only
//! say "wrong", this says which op. Without a GPU each test prints "skipped: <reason>".

use std::path::Path;

use moerun_core::{BlockTable, Device};

use super::{CudaPass, Placement, Tokens};
use crate::backend::cpu::CpuPass;
use crate::backend::{AttentionSpec, Backend};
use crate::batch::{Batch, SeqChunk};
use crate::kv::KvCache;
use crate::weights::{FfnWeights, MixerWeights};
use crate::Model;

/// The fixture in `dir` on GPU 0 and on the CPU, or `None` (the skip line printed) without CUDA.
fn on_gpu_and_cpu(dir: &Path) -> Option<(Model, Model)> {
    match Model::load_on(dir, Device::Cuda(0)) {
        Ok(gpu) => Some((gpu, Model::load(dir).unwrap())),
        Err(e) if e.to_string().contains("CUDA is unavailable") => {
            println!("skipped: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Layer 0's q, k, v or o projection.
fn proj(w: &crate::weights::ModelWeights, i: usize) -> &crate::weights::Linear {
    match &w.layers[0].mixer {
        MixerWeights::Attention(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj][i],
        MixerWeights::GatedDeltaNet(_) => unreachable!("layer 0 is attention"),
    }
}

/// `‖got − want‖ / ‖want‖` in f64 (shared with the Gemma 4 tests).
pub(super) fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let d: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let n: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

#[test]
fn every_backend_op_matches_the_cpu_on_the_gpu() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe_f32");
    let Some((gpu, cpu)) = on_gpu_and_cpu(&dir) else {
        return;
    };
    let cfg = &cpu.config;
    let tokens: Vec<u32> = (0..21u32)
        .map(|i| (i * 37 + 5) % cfg.vocab_size as u32)
        .collect();
    let table = BlockTable {
        blocks: vec![3, 0, 2],
    };
    let batch = Batch::new(vec![SeqChunk {
        tokens: &tokens,
        start_pos: 0,
        block_table: &table,
    }]);
    let mut cpu_kv = KvCache::new(cfg, 4, 16);
    let mut gpu_kv = gpu.new_kv_cache(4, 16).unwrap();
    let cuda = gpu.cuda().unwrap();
    let at = Placement::of_batch(cuda.device(), &batch).unwrap();
    let mut c = CpuPass::new(cfg, &cpu.rope, &batch, &mut cpu_kv, None);
    let mut g = CudaPass::new(cuda, gpu_kv.device.as_mut().unwrap(), &at, Tokens::Host);
    // The GPU model's host weights are its own copy: same values, other addresses.
    let (wc, wg) = (&cpu.weights, &gpu.weights);
    let mut failures = Vec::new();
    let mut check = |what: &str, got: Vec<f32>, want: &[f32]| {
        let e = rel(&got, want);
        let verdict = if e <= 1e-5 { "ok" } else { "FAIL" };
        println!("RESULT|backend op {what}|{e:.2e}|1e-5|{verdict}");
        if e > 1e-5 {
            failures.push(format!("{what}: {e:.3e}"));
        }
    };
    macro_rules! both {
        ($what:expr, |$b:ident, $w:ident| $op:expr) => {{
            let want = {
                let ($b, $w) = (&mut c, wc);
                let a = $op;
                $b.to_host(a).unwrap()
            };
            let got = {
                let ($b, $w) = (&mut g, wg);
                let a = $op;
                $b.to_host(a).unwrap()
            };
            check($what, got, &want);
            want
        }};
    }
    let x = both!("embed", |b, w| b.embed(&w.embed_tokens, &tokens).unwrap());
    let xn = both!("rms_norm", |b, w| {
        let x = b.upload(&x).unwrap();
        b.rms_norm(&x, &w.layers[0].input_layernorm, cfg.rms_norm_eps)
            .unwrap()
    });
    let MixerWeights::Attention(_) = &wc.layers[0].mixer else {
        panic!("layer 0 is attention")
    };
    // The attention prologue: the GPU's fused kernel (stacked q/k/v GEMV, per-head norms,
    // RoPE) against the CPU's composition, each output on its own.
    let mut parts: Vec<Vec<f32>> = Vec::new();
    for part in 0..3 {
        let name = [
            "attention_inputs q",
            "attention_inputs k",
            "attention_inputs v",
        ][part];
        parts.push(both!(name, |b, w| {
            let MixerWeights::Attention(a) = &w.layers[0].mixer else {
                unreachable!()
            };
            let x = b.upload(&xn).unwrap();
            let i = b.attention_inputs(0, cfg, a, &x).unwrap();
            [i.q, i.k, i.v].into_iter().nth(part).unwrap()
        }));
    }
    let (qr, kr, v) = (parts[0].clone(), parts[1].clone(), parts[2].clone());
    let spec = AttentionSpec {
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        scale: (cfg.head_dim as f64).powf(-0.5) as f32,
        sliding_window: None,
    };
    let attn = both!("attention", |b, w| {
        let _ = w;
        let (q, k, v) = (
            b.upload(&qr).unwrap(),
            b.upload(&kr).unwrap(),
            b.upload(&v).unwrap(),
        );
        b.attention(0, &q, &k, &v, &spec).unwrap()
    });
    both!("linear o_proj", |b, w| {
        let x = b.upload(&attn).unwrap();
        b.linear(&x, proj(w, 3)).unwrap()
    });
    both!("add", |b, w| {
        let _ = w;
        let mut a = b.upload(&x).unwrap();
        let y = b.upload(&xn).unwrap();
        b.add_assign(&mut a, &y).unwrap();
        a
    });
    let moe_cfg = cfg.moe.as_ref().unwrap();
    both!("moe", |b, w| {
        let FfnWeights::Moe(m) = &w.layers[0].ffn else {
            panic!("layer 0 is MoE")
        };
        let x = b.upload(&xn).unwrap();
        b.moe(&x, moe_cfg, m).unwrap()
    });
    both!("select_rows", |b, w| {
        let _ = w;
        let x = b.upload(&x).unwrap();
        b.select_rows(&x, cfg.hidden_size, &[20, 3, 7]).unwrap()
    });
    // One token's last residual add, final norm and LM head: folded into one GEMV on the GPU.
    let h = cfg.hidden_size;
    both!("final_logits (one token)", |b, w| {
        let mut x1 = b.upload(&x[..h]).unwrap();
        let y1 = b.upload(&xn[h..2 * h]).unwrap();
        let norm = (&w.norm[..], cfg.rms_norm_eps);
        let logits = b
            .final_logits(&mut x1, Some(&y1), &[0], h, norm, &w.lm_head)
            .unwrap();
        // The residual the fold leaves must be the plain sum.
        let mut want = x[..h].to_vec();
        want.iter_mut()
            .zip(&xn[h..2 * h])
            .for_each(|(a, y)| *a += y);
        assert_eq!(
            b.to_host(x1).unwrap(),
            want,
            "the residual after final_logits"
        );
        logits
    });
    both!("lm_head", |b, w| {
        let x = b.upload(&xn).unwrap();
        b.matmul(&x, &w.lm_head).unwrap()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One token's decode step after a prefill takes the route ahead on every MoE layer of the f32
/// qwen3_moe fixture (its MoE blocks have no shared expert) and gives the CPU's logits (1e-4,
/// the f32 bar); Qwen2-MoE's shared expert keeps its layers off it.
#[test]
fn one_token_steps_route_ahead_and_match_the_cpu_on_the_gpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let Some((gpu, cpu)) = on_gpu_and_cpu(&root.join("qwen3_moe_f32")) else {
        return;
    };
    let cuda = gpu.cuda().unwrap();
    if !cuda.device().route_ahead_wanted() {
        println!("skipped: MOERUN_CUDA_ROUTE_AHEAD=0");
        return;
    }
    let cfg = &cpu.config;
    let moe_layers = (0..cfg.num_layers())
        .filter(|&l| matches!(cpu.weights.layers[l].ffn, FfnWeights::Moe(_)))
        .count();
    assert!(moe_layers > 0);
    assert_eq!(cuda.route_ahead.len(), moe_layers, "folds made at upload");
    let tokens: Vec<u32> = (0..9u32)
        .map(|i| (i * 53 + 11) % cfg.vocab_size as u32)
        .collect();
    let table = BlockTable { blocks: vec![1, 0] };
    let mut cpu_kv = KvCache::new(cfg, 2, 16);
    let mut gpu_kv = gpu.new_kv_cache(2, 16).unwrap();
    let (head, last) = tokens.split_at(tokens.len() - 1);
    let mut logits = Vec::new();
    for (chunk, start) in [(head, 0), (last, head.len())] {
        let batch = Batch::new(vec![SeqChunk {
            tokens: chunk,
            start_pos: start,
            block_table: &table,
        }]);
        let rows = [chunk.len() - 1];
        let mut c = CpuPass::new(cfg, &cpu.rope, &batch, &mut cpu_kv, None);
        let want = crate::forward::decoder(&mut c, cfg, &cpu.weights, chunk, &rows).unwrap();
        let at = Placement::of_batch(cuda.device(), &batch).unwrap();
        let mut g = CudaPass::new(cuda, gpu_kv.device.as_mut().unwrap(), &at, Tokens::Host);
        let got = crate::forward::decoder(&mut g, cfg, &gpu.weights, chunk, &rows).unwrap();
        let ahead = g.routed_ahead_blocks();
        logits.push((chunk.len(), ahead, rel(&got, &want)));
    }
    for (n, ahead, e) in logits {
        println!("RESULT|route ahead, a step of {n} tokens ({ahead} MoE blocks routed ahead)|{e:.2e}|1e-4|{}", if e <= 1e-4 { "ok" } else { "FAIL" });
        assert!(
            e <= 1e-4,
            "a step of {n} tokens: {e:.3e} from the CPU's logits"
        );
        let want = if n == 1 { moe_layers } else { 0 };
        assert_eq!(
            ahead, want,
            "MoE blocks routed ahead in a step of {n} tokens"
        );
    }
    let Some((shared, _)) = on_gpu_and_cpu(&root.join("qwen2_moe_shared_tied_linear")) else {
        return;
    };
    assert!(
        shared.cuda().unwrap().route_ahead.is_empty(),
        "a shared expert keeps its layers off the route ahead"
    );
}

/// The whole decoder, layer by layer, on both backends from the same start, for every f32
/// fixture the CUDA backend runs: names the first layer (and part of it) that drifts.
#[test]
fn every_layer_matches_the_cpu_on_the_gpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut failures = Vec::new();
    for name in [
        "qwen3_moe_f32",
        "llama_bf16_bias_dynamic_v4",
        "qwen2_dense_swa_yarn",
    ] {
        let dir = root.join(name);
        let Some((gpu, cpu)) = on_gpu_and_cpu(&dir) else {
            return;
        };
        let cfg = &cpu.config;
        let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        // bf16 weights: this prefill's projections run on cuBLAS with activations rounded to
        // bf16 (the conformance test's 2e-2 prefill bar); f32 weights stay exact f32.
        let tol = if json["dtype"].as_str() == Some("float32") {
            1e-4
        } else {
            2e-2
        };
        let tokens: Vec<u32> = json["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let blocks = tokens.len().div_ceil(16);
        let table = BlockTable {
            blocks: (0..blocks as u32).rev().collect(),
        };
        let batch = Batch::new(vec![SeqChunk {
            tokens: &tokens,
            start_pos: 0,
            block_table: &table,
        }]);
        let mut cpu_kv = KvCache::new(cfg, blocks, 16);
        let mut gpu_kv = gpu.new_kv_cache(blocks, 16).unwrap();
        let cuda = gpu.cuda().unwrap();
        let at = Placement::of_batch(cuda.device(), &batch).unwrap();
        let mut c = CpuPass::new(cfg, &cpu.rope, &batch, &mut cpu_kv, None);
        let mut g = CudaPass::new(cuda, gpu_kv.device.as_mut().unwrap(), &at, Tokens::Host);
        let eps = cfg.rms_norm_eps;
        let mut xc = c.embed(&cpu.weights.embed_tokens, &tokens).unwrap();
        let mut xg = g.embed(&gpu.weights.embed_tokens, &tokens).unwrap();
        for l in 0..cfg.num_layers() {
            let (lc, lg) = (&cpu.weights.layers[l], &gpu.weights.layers[l]);
            let nc = c.rms_norm(&xc, &lc.input_layernorm, eps).unwrap();
            let ng = g.rms_norm(&xg, &lg.input_layernorm, eps).unwrap();
            let (MixerWeights::Attention(ac), MixerWeights::Attention(ag)) = (&lc.mixer, &lg.mixer)
            else {
                panic!("attention layers only")
            };
            let sw = cfg.layers[l].sliding_window;
            let mc = crate::forward::attention_block(&mut c, cfg, ac, l, sw, &nc).unwrap();
            let mg = crate::forward::attention_block(&mut g, cfg, ag, l, sw, &ng).unwrap();
            let e_attn = rel(&g.to_host(mg.clone()).unwrap(), &mc);
            c.add_assign(&mut xc, &mc).unwrap();
            g.add_assign(&mut xg, &mg).unwrap();
            let nc = c.rms_norm(&xc, &lc.post_attention_layernorm, eps).unwrap();
            let ng = g.rms_norm(&xg, &lg.post_attention_layernorm, eps).unwrap();
            let (fc, fg) = match (&lc.ffn, &lg.ffn) {
                (FfnWeights::Moe(a), FfnWeights::Moe(b)) => {
                    let mcfg = cfg.moe.as_ref().unwrap();
                    (c.moe(&nc, mcfg, a).unwrap(), g.moe(&ng, mcfg, b).unwrap())
                }
                (FfnWeights::Dense(a), FfnWeights::Dense(b)) => {
                    (c.mlp(&nc, a).unwrap(), g.mlp(&ng, b).unwrap())
                }
                _ => unreachable!(),
            };
            let e_ffn = rel(&g.to_host(fg.clone()).unwrap(), &fc);
            c.add_assign(&mut xc, &fc).unwrap();
            g.add_assign(&mut xg, &fg).unwrap();
            let e_x = rel(&g.to_host(xg.clone()).unwrap(), &xc);
            println!(
                "RESULT|{name} layer {l} (attention {e_attn:.1e}, ffn {e_ffn:.1e})|{e_x:.2e}|{tol:.0e}|{}",
                if e_x <= tol { "ok" } else { "FAIL" }
            );
            if e_x > tol {
                failures.push(format!(
                    "{name} layer {l}: attention {e_attn:.2e} ffn {e_ffn:.2e}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Qwen3.5 on both backends, layer by layer (Gated DeltaNet and gated attention, MoE with the
/// sigmoid-gated shared expert) over three steps of a mixed batch: two sequences prefilling
/// from position 0 in other slots than their order, then one decoding while the other prefills
/// a continuation, then both decoding. Each step starts both backends from the same input, so
/// the state carried across steps (conv windows, recurrent states) is what is compared in the
/// later steps. Also the attention output gate's two ops on their own.
#[test]
fn qwen3_5_layers_match_the_cpu_on_the_gpu_prefill_and_decode_mixed() {
    use super::deltanet::LinearPlacement;
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_moe_text_f32");
    let Some((gpu, cpu)) = on_gpu_and_cpu(&dir) else {
        return;
    };
    let cfg = &cpu.config;
    let cuda = gpu.cuda().unwrap();
    let mut failures = Vec::new();
    let mut report = |what: String, e: f64, tol: f64| {
        let verdict = if e <= tol { "ok" } else { "FAIL" };
        println!("RESULT|{what}|{e:.2e}|{tol:.0e}|{verdict}");
        if e > tol {
            failures.push(format!("{what}: {e:.3e}"));
        }
    };
    // The output gate's ops alone, on values of both signs.
    {
        let table = BlockTable { blocks: vec![0] };
        let toks = [1u32, 2, 3];
        let batch = Batch::new(vec![SeqChunk {
            tokens: &toks,
            start_pos: 0,
            block_table: &table,
        }]);
        let mut ckv = KvCache::new(cfg, 1, 16);
        let mut gkv = gpu.new_kv_cache(1, 16).unwrap();
        let at = Placement::of_batch(cuda.device(), &batch).unwrap();
        let mut c = CpuPass::new(cfg, &cpu.rope, &batch, &mut ckv, None);
        let mut g = CudaPass::new(cuda, gkv.device.as_mut().unwrap(), &at, Tokens::Host);
        let d = cfg.head_dim;
        let x: Vec<f32> = (0..3 * cfg.num_heads * 2 * d)
            .map(|i| ((i as f32) * 0.37).sin() * 3.0)
            .collect();
        let (qc, gc) = c.split_query_gate(&x, d).unwrap();
        let xg = g.upload(&x).unwrap();
        let (qg, gg) = g.split_query_gate(&xg, d).unwrap();
        let (qg, gg2) = (g.to_host(qg).unwrap(), g.to_host(gg.clone()).unwrap());
        report("backend op split_query_gate q".into(), rel(&qg, &qc), 0.0);
        report(
            "backend op split_query_gate gate".into(),
            rel(&gg2, &gc),
            0.0,
        );
        let mut oc = qc.clone();
        c.sigmoid_gate(&mut oc, &gc).unwrap();
        let mut og = g.upload(&qc).unwrap();
        g.sigmoid_gate(&mut og, &gg).unwrap();
        report(
            "backend op sigmoid_gate".into(),
            rel(&g.to_host(og).unwrap(), &oc),
            1e-6,
        );
    }

    let toks: Vec<u32> = (0..40u32)
        .map(|i| (i * 53 + 11) % cfg.vocab_size as u32)
        .collect();
    let (ta, tb) = (
        BlockTable { blocks: vec![2, 0] },
        BlockTable { blocks: vec![1, 3] },
    );
    // (tokens of A, start of A, tokens of B, start of B) per step; A in slot 3, B in slot 1.
    let steps: [(&[u32], usize, &[u32], usize); 3] = [
        (&toks[..13], 0, &toks[20..26], 0),
        (&toks[13..14], 13, &toks[26..29], 6),
        (&toks[14..15], 14, &toks[29..30], 9),
    ];
    let mut ckv = KvCache::new(cfg, 4, 16);
    let mut gkv = gpu.new_kv_cache(4, 16).unwrap();
    let mut cst = cpu.new_linear_state(4);
    let mut gst = gpu.new_linear_state(4);
    assert!(gst.is_on_device() && !cst.is_on_device());
    let eps = cfg.rms_norm_eps;
    for (step, &(a, sa, b, sb)) in steps.iter().enumerate() {
        let batch = Batch::new(vec![
            SeqChunk {
                tokens: a,
                start_pos: sa,
                block_table: &ta,
            },
            SeqChunk {
                tokens: b,
                start_pos: sb,
                block_table: &tb,
            },
        ])
        .with_state_slots(vec![3, 1]);
        let tokens: Vec<u32> = a.iter().chain(b).copied().collect();
        cst.begin(&batch).unwrap();
        gst.begin(&batch).unwrap();
        let addrs = gst.device_slots(cuda.device(), &batch).unwrap();
        let lp = LinearPlacement::of_batch(cuda.device(), cfg, &gst, &batch, &addrs).unwrap();
        let at = Placement::of_batch(cuda.device(), &batch).unwrap();
        {
            let mut c = CpuPass::new(cfg, &cpu.rope, &batch, &mut ckv, Some(&mut cst));
            let mut g = CudaPass::new(cuda, gkv.device.as_mut().unwrap(), &at, Tokens::Host)
                .with_linear_state(&lp);
            let mut xc = c.embed(&cpu.weights.embed_tokens, &tokens).unwrap();
            for l in 0..cfg.num_layers() {
                let (lc, lg) = (&cpu.weights.layers[l], &gpu.weights.layers[l]);
                // Both backends start the layer from the CPU's input.
                let mut xg = g.upload(&xc).unwrap();
                let nc = c.rms_norm(&xc, &lc.input_layernorm, eps).unwrap();
                let ng = g.rms_norm(&xg, &lg.input_layernorm, eps).unwrap();
                let (kind, mc, mg) = match (&lc.mixer, &lg.mixer) {
                    (MixerWeights::Attention(ac), MixerWeights::Attention(ag)) => {
                        let sw = cfg.layers[l].sliding_window;
                        (
                            "gated attention",
                            crate::forward::attention_block(&mut c, cfg, ac, l, sw, &nc).unwrap(),
                            crate::forward::attention_block(&mut g, cfg, ag, l, sw, &ng).unwrap(),
                        )
                    }
                    (MixerWeights::GatedDeltaNet(wc), MixerWeights::GatedDeltaNet(wg)) => (
                        "gated deltanet",
                        c.gated_deltanet(l, wc, &nc).unwrap(),
                        g.gated_deltanet(l, wg, &ng).unwrap(),
                    ),
                    _ => unreachable!(),
                };
                report(
                    format!("qwen3_5 step {step} layer {l} {kind}"),
                    rel(&g.to_host(mg.clone()).unwrap(), &mc),
                    1e-5,
                );
                c.add_assign(&mut xc, &mc).unwrap();
                g.add_assign(&mut xg, &mg).unwrap();
                let nc = c.rms_norm(&xc, &lc.post_attention_layernorm, eps).unwrap();
                let ng = g.rms_norm(&xg, &lg.post_attention_layernorm, eps).unwrap();
                let (FfnWeights::Moe(fc), FfnWeights::Moe(fg)) = (&lc.ffn, &lg.ffn) else {
                    panic!("qwen3_5's layers are MoE")
                };
                let mcfg = cfg.moe.as_ref().unwrap();
                let oc = c.moe(&nc, mcfg, fc).unwrap();
                let og = g.moe(&ng, mcfg, fg).unwrap();
                report(
                    format!("qwen3_5 step {step} layer {l} moe (shared expert gated)"),
                    rel(&g.to_host(og).unwrap(), &oc),
                    1e-5,
                );
                c.add_assign(&mut xc, &oc).unwrap();
            }
        }
        cst.finish(&batch);
        gst.finish(&batch);
    }
    assert_eq!(gst.positions(3), 15);
    assert_eq!(gst.positions(1), 10);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
