//! Parameter counts of a Gemma 4 model from its config, summed as transformers builds its
//! modules: per-layer attention shapes (KV-shared layers keep only `q_proj`, `q_norm`, `o_proj`;
//! `attention_k_eq_v` full layers have no `v_proj`; `v_norm` has no weight), the dense MLP of
//! every layer, the router (`proj`, `scale`, `per_expert_scale`) and experts, the sandwich norms,
//! and per-layer input embeddings. `layer_scalar` is a buffer, not a parameter, so it is not
//! counted (configs/README.md counts the same way).

use crate::config::{Gemma4Config, ModelConfig};
use crate::stats::ParamStats;

/// [`ParamStats`] of a Gemma 4 config.
pub fn param_stats(cfg: &ModelConfig, g: &Gemma4Config) -> ParamStats {
    let h = cfg.hidden_size as u64;
    let v = cfg.vocab_size as u64;
    let heads = cfg.num_heads as u64;
    let (bias_qkv, bias_o) = (cfg.attention_bias.qkv as u64, cfg.attention_bias.o as u64);
    let mut s = ParamStats {
        embedding: v * h,
        lm_head: if cfg.tie_word_embeddings { 0 } else { v * h },
        // The final norm; the layers' norms are added below.
        norms: h,
        ..ParamStats::default()
    };
    for (l, layer) in g.layers.iter().enumerate() {
        let d = layer.head_dim as u64;
        let q = heads * d;
        // q_proj, q_norm, o_proj.
        let mut attn = h * q + bias_qkv * q + d + q * h + bias_o * h;
        if !layer.shares_kv(l) {
            let kv = layer.num_kv_heads as u64 * d;
            let projections = if layer.k_eq_v { 1 } else { 2 };
            attn += projections * (h * kv + bias_qkv * kv) + d;
        }
        s.attention += attn;
        s.dense_mlp += 3 * h * layer.mlp_intermediate as u64;
        // input, post-attention, pre- and post-feed-forward.
        s.norms += 4 * h;
        if let (true, Some(moe)) = (g.enable_moe_block, &cfg.moe) {
            let e = moe.num_experts as u64;
            let expert = 3 * h * moe.expert_intermediate as u64;
            s.router += e * h + h + e;
            s.experts += e * expert;
            s.experts_active += moe.top_k as u64 * expert;
            // pre_feedforward_layernorm_2, post_feedforward_layernorm_1 and _2.
            s.norms += 3 * h;
        }
    }
    // Per-layer inputs: one row of the packed table is read per token, the rest in full.
    let mut ple_active = 0;
    if let Some(ple) = g.per_layer_input {
        let (width, layers) = (ple.width as u64, g.layers.len() as u64);
        let packed = layers * width;
        let per_layer = 2 * h * width + h;
        let shared = packed * h + width + layers * per_layer;
        s.per_layer_input = ple.vocab as u64 * packed + shared;
        ple_active = packed + shared;
    }
    let always = s.attention + s.router + s.dense_mlp + s.norms;
    s.total = always + s.experts + s.embedding + s.lm_head + s.per_layer_input;
    s.active = always + s.experts_active + h + v * h + ple_active;
    s
}
