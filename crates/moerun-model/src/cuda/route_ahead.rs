//! Which layers route ahead (`moerun_cuda::RouteAhead`: a MoE layer's routing beside the
//! attention's output projection instead of after its add+norm) and their folds, made once at
//! upload. A layer qualifies when its attention's o_proj (no bias) feeds a MoE block whose router
//! reads nothing but the post-attention norm of the residual: no shared expert (Qwen2-MoE's and
//! Qwen3.5's have their own gate on the same input), at most 128 experts.

use std::collections::HashMap;

use moerun_core::Result;
use moerun_cuda::{CudaDevice, CudaSlice, DeviceMatrix, RouteAhead, RouterShape};

use super::{dev_err, tensor_key, vec_key};
use crate::config::ModelConfig;
use crate::weights::{FfnWeights, MixerWeights, ModelWeights};

/// One layer's route ahead: its fold, and the router and norm (by their host keys) it was made
/// for, which the MoE block that consumes it must match.
pub(crate) struct LayerRouteAhead {
    pub(crate) fold: RouteAhead,
    pub(crate) router: (usize, usize),
    pub(crate) norm: (usize, usize),
    pub(crate) shape: RouterShape,
}

/// The folds of every layer that can route ahead, by layer index (none where
/// `MOERUN_CUDA_ROUTE_AHEAD=0`).
pub(crate) fn folds(
    dev: &CudaDevice,
    cfg: &ModelConfig,
    w: &ModelWeights,
    mats: &HashMap<(usize, usize), DeviceMatrix>,
    vecs: &HashMap<(usize, usize), CudaSlice<f32>>,
) -> Result<HashMap<usize, LayerRouteAhead>> {
    let mut out = HashMap::new();
    let Some(moe_cfg) = cfg.moe.as_ref() else {
        return Ok(out);
    };
    if !dev.route_ahead_wanted() || moe_cfg.top_k > moerun_cuda::ROUTE_AHEAD_MAX_TOP_K {
        return Ok(out);
    }
    for (l, layer) in w.layers.iter().enumerate() {
        let (MixerWeights::Attention(a), FfnWeights::Moe(m)) = (&layer.mixer, &layer.ffn) else {
            continue;
        };
        if m.shared_expert.is_some() || m.shared_expert_gate.is_some() || a.o_proj.bias.is_some() {
            continue;
        }
        let norm_key = vec_key(&layer.post_attention_layernorm);
        let (Some(router), Some(o_proj), Some(norm)) = (
            mats.get(&tensor_key(&m.router)),
            mats.get(&tensor_key(&a.o_proj.weight)),
            vecs.get(&norm_key),
        ) else {
            continue;
        };
        if router.rows() != moe_cfg.num_experts || !dev.route_ahead_supported(router, o_proj) {
            continue;
        }
        let fold = dev.route_fold(router, norm, o_proj).map_err(dev_err)?;
        out.insert(
            l,
            LayerRouteAhead {
                fold,
                router: tensor_key(&m.router),
                norm: norm_key,
                shape: RouterShape {
                    experts: moe_cfg.num_experts,
                    top_k: moe_cfg.top_k,
                    renormalise: moe_cfg.norm_topk_prob,
                },
            },
        );
    }
    Ok(out)
}
