//! Gemma 4's feed-forward: the dense GELU-tanh MLP every layer has, and the routed experts that
//! run beside it with `enable_moe_block`.
//!
//! The router (`Gemma4TextRouter`) reads the residual stream itself, not a normed copy:
//! RMSNorm without a scale, times the learned `router.scale`, times `hidden ** -0.5`, then
//! `router.proj`, softmax in f32 over all experts, top-k (ties to the lower index), the top-k
//! weights renormalised to sum to one and then multiplied by `per_expert_scale[expert]`.
//! The experts (`Gemma4TextExperts`) take `pre_feedforward_layernorm_2(residual)`:
//! `down(gelu_tanh(gate(x)) * up(x)) * weight` with `gate`/`up` the two halves of `gate_up_proj`.
//! As elsewhere in moerun each selected expert runs once over all its tokens, and each token's
//! outputs are summed in router rank order, so results do not depend on the batch.

use moerun_cpu::ops::{gelu_tanh_mul_in_place, rms_norm_rows, softmax_in_place};

use crate::ffn::{routed_sum, Route};
use crate::linear::{apply, linear};
use crate::weights::MlpWeights;

use super::weights::Gemma4MoeWeights;

/// `down(gelu_tanh(gate(x)) * up(x))` over `m` rows.
pub fn mlp(w: &MlpWeights, x: &[f32], m: usize) -> Vec<f32> {
    let mut g = apply(x, m, &w.gate_proj);
    let u = apply(x, m, &w.up_proj);
    gelu_tanh_mul_in_place(&mut g, &u);
    apply(&g, m, &w.down_proj)
}

/// Route one row of router logits: softmax, top-k, renormalise, scale per expert.
pub fn route(logits: &[f32], top_k: usize, per_expert_scale: &[f32]) -> Route {
    let mut probs = logits.to_vec();
    softmax_in_place(&mut probs);
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let sum: f32 = order.iter().map(|&e| probs[e]).sum();
    let weights = order
        .iter()
        .map(|&e| probs[e] / sum * per_expert_scale[e])
        .collect();
    Route {
        experts: order,
        weights,
    }
}

/// Router logits of `m` rows of the residual stream `x`.
fn router_logits(w: &Gemma4MoeWeights, x: &[f32], m: usize, eps: f32) -> Vec<f32> {
    let h = w.router_scale.len();
    let mut xn = x.to_vec();
    rms_norm_rows(&mut xn, &vec![1.0; h], eps);
    let root = (h as f64).powf(-0.5) as f32;
    for row in xn.chunks_exact_mut(h) {
        for (v, s) in row.iter_mut().zip(&w.router_scale) {
            // transformers: hidden_states * self.scale * self.scalar_root_size, left to right.
            *v = *v * s * root;
        }
    }
    linear(&xn, m, &w.router_proj, None)
}

/// The routed experts over `m` rows: routing from the residual `x`, experts on
/// `pre_feedforward_layernorm_2(x)`. Returns the weighted sum before `post_feedforward_layernorm_2`.
pub fn experts(w: &Gemma4MoeWeights, top_k: usize, x: &[f32], m: usize, eps: f32) -> Vec<f32> {
    let h = x.len() / m.max(1);
    let num_experts = w.experts.len();
    let routes: Vec<Route> = router_logits(w, x, m, eps)
        .chunks_exact(num_experts)
        .map(|row| route(row, top_k, &w.per_expert_scale))
        .collect();
    let mut xn = x.to_vec();
    rms_norm_rows(&mut xn, &w.pre_feedforward_layernorm_2, eps);
    routed_sum(&routes, num_experts, &xn, h, |e, rows, n| {
        expert(&w.experts[e], rows, n)
    })
}

/// One expert over `m` gathered rows: `gate_up` gives `[m, 2I]`, gate then up in each row.
fn expert(
    (gate_up, down): &(moerun_core::Tensor, moerun_core::Tensor),
    x: &[f32],
    m: usize,
) -> Vec<f32> {
    let gu = linear(x, m, gate_up, None);
    let i = gate_up.shape[0] / 2;
    let mut act = Vec::with_capacity(m * i);
    for row in gu.chunks_exact(2 * i) {
        let (gate, up) = row.split_at(i);
        let start = act.len();
        act.extend_from_slice(gate);
        gelu_tanh_mul_in_place(&mut act[start..], up);
    }
    linear(&act, m, down, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_renormalises_the_top_k_then_scales_each_expert() {
        let r = route(&[0.5, 2.0, -1.0, 1.5], 2, &[1.0, 0.5, 1.0, 2.0]);
        assert_eq!(r.experts, vec![1, 3]);
        let (p1, p3) = (2.0f32.exp(), 1.5f32.exp());
        assert!((r.weights[0] - p1 / (p1 + p3) * 0.5).abs() < 1e-6);
        assert!((r.weights[1] - p3 / (p1 + p3) * 2.0).abs() < 1e-6);
    }

    #[test]
    fn route_breaks_ties_towards_the_lower_expert() {
        let r = route(&[0.0; 4], 2, &[1.0; 4]);
        assert_eq!(r.experts, vec![0, 1]);
        assert_eq!(r.weights, vec![0.5, 0.5]);
    }
}
