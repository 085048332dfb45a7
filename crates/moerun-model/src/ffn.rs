//! Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block.
//!
//! MoE follows the flat-batch recipe: route every token (softmax over the router logits in f32,
//! top-k, optional renormalisation), group the batch's (token, rank) pairs by expert, run each
//! selected expert once over all its tokens (a GEMM when it has several), then sum each token's
//! expert outputs in router rank order. Qwen2-MoE's shared expert, scaled by
//! `sigmoid(shared_expert_gate(x))`, is added after the routed sum, as transformers does.

use rayon::prelude::*;

use moerun_cpu::ops::{sigmoid, silu_mul_in_place, softmax_in_place};

use crate::config::MoeConfig;
use crate::linear::{apply, linear};
use crate::weights::{ExpertWeights, MlpWeights, MoeWeights};

/// `down(silu(gate(x)) * up(x))` over `m` rows.
pub fn mlp(w: &MlpWeights, x: &[f32], m: usize) -> Vec<f32> {
    let mut g = apply(x, m, &w.gate_proj);
    let u = apply(x, m, &w.up_proj);
    silu_mul_in_place(&mut g, &u);
    apply(&g, m, &w.down_proj)
}

fn expert_mlp(w: &ExpertWeights, x: &[f32], m: usize) -> Vec<f32> {
    let (mut g, u) = rayon::join(|| linear(x, m, &w.gate, None), || linear(x, m, &w.up, None));
    silu_mul_in_place(&mut g, &u);
    linear(&g, m, &w.down, None)
}

/// One token's routing decision: experts and weights in rank order (best first).
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Route one row of router logits: softmax in f32, top-k (ties broken towards the lower expert
/// index), renormalised when the family asks.
pub fn route(logits: &[f32], top_k: usize, norm_topk_prob: bool) -> Route {
    let mut probs = logits.to_vec();
    softmax_in_place(&mut probs);
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let mut weights: Vec<f32> = order.iter().map(|&e| probs[e]).collect();
    if norm_topk_prob {
        let sum: f32 = weights.iter().sum();
        for w in &mut weights {
            *w /= sum;
        }
    }
    Route {
        experts: order,
        weights,
    }
}

/// The routed experts' weighted sum over the rows of `x` (width `h`), one route per row:
/// `run(e, rows, n)` is expert `e` over `n` gathered rows. The (token, rank) pairs are grouped by
/// expert (token order kept), each expert runs once over its tokens, and each token's weighted
/// outputs are summed in rank order, so a row's result does not depend on the batch.
pub(crate) fn routed_sum(
    routes: &[Route],
    num_experts: usize,
    x: &[f32],
    h: usize,
    run: impl Fn(usize, &[f32], usize) -> Vec<f32> + Sync,
) -> Vec<f32> {
    let m = routes.len();
    let k = routes.first().map_or(0, |r| r.experts.len());
    let mut groups: Vec<Vec<(usize, usize)>> = vec![Vec::new(); num_experts];
    for (t, r) in routes.iter().enumerate() {
        for (rank, &e) in r.experts.iter().enumerate() {
            groups[e].push((t, rank));
        }
    }
    // The selected experts run side by side: in decode each is a handful of small products,
    // and one parallel region over all of them keeps both threads streaming weights instead of
    // splitting and joining every 3 MiB product. Each output row is computed exactly as alone.
    let outputs: Vec<(usize, Vec<f32>)> = groups
        .par_iter()
        .enumerate()
        .filter(|(_, group)| !group.is_empty())
        .map(|(e, group)| {
            let mut gathered = Vec::with_capacity(group.len() * h);
            for &(t, _) in group {
                gathered.extend_from_slice(&x[t * h..(t + 1) * h]);
            }
            (e, run(e, &gathered, group.len()))
        })
        .collect();
    // Where each (token, rank)'s expert output row is: the expert's output and the row in it.
    let mut at = vec![(0usize, 0usize); m * k];
    for (o, (e, _)) in outputs.iter().enumerate() {
        for (row, &(t, rank)) in groups[*e].iter().enumerate() {
            at[t * k + rank] = (o, row);
        }
    }
    // Each token's weighted expert outputs summed in rank order, straight into its row (no
    // `m * k * h` staging buffer: at prefill sizes that was tens of MB of fresh pages per layer).
    let mut out = vec![0.0f32; m * h];
    for (t, o) in out.chunks_exact_mut(h).enumerate() {
        for rank in 0..k {
            let (which, row) = at[t * k + rank];
            let src = &outputs[which].1[row * h..][..h];
            let weight = routes[t].weights[rank];
            for (d, v) in o.iter_mut().zip(src) {
                *d += v * weight;
            }
        }
    }
    out
}

/// The MoE block over `m` rows of normed input.
pub fn ffn_block(cfg: &MoeConfig, w: &MoeWeights, x: &[f32], m: usize) -> Vec<f32> {
    let h = x.len() / m.max(1);
    let k = cfg.top_k;
    let router_logits = linear(x, m, &w.router, None);
    let routes: Vec<Route> = router_logits
        .chunks_exact(cfg.num_experts)
        .map(|row| route(row, k, cfg.norm_topk_prob))
        .collect();
    let mut out = routed_sum(&routes, cfg.num_experts, x, h, |e, rows, n| {
        expert_mlp(&w.experts[e], rows, n)
    });
    if let Some(shared) = &w.shared_expert {
        let s = mlp(shared, x, m);
        let gates = w.shared_expert_gate.as_ref().map(|g| linear(x, m, g, None));
        for (t, o) in out.chunks_exact_mut(h).enumerate() {
            let scale = gates.as_ref().map(|g| sigmoid(g[t])).unwrap_or(1.0);
            for (d, v) in o.iter_mut().zip(&s[t * h..(t + 1) * h]) {
                *d += scale * v;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_picks_top_k_in_rank_order_and_renormalises() {
        let r = route(&[0.1, 2.0, -1.0, 1.5], 2, true);
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(r.weights[0] > r.weights[1]);
    }

    #[test]
    fn route_without_renormalisation_keeps_softmax_probabilities() {
        let r = route(&[0.0, 0.0, 0.0, 0.0], 2, false);
        assert_eq!(r.experts, vec![0, 1], "ties go to the lower expert index");
        assert!((r.weights[0] - 0.25).abs() < 1e-7);
    }
}
