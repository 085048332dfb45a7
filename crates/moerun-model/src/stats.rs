//! Parameter and byte counts of a model, from its [`ModelConfig`] alone (no weights needed).
//!
//! Two figures matter for a Mixture-of-Experts model: how many parameters it stores (`total`), and
//! how many one decoded token touches (`active`). Decoding at batch 1 is bound by memory bandwidth,
//! so the active bytes per token are the numerator of its roofline: tokens/s can never exceed
//! bandwidth / active bytes. Counting follows configs/README.md: active = attention (with q/k norms
//! and biases) + linear attention + router + top_k routed experts + shared expert (with its gate) +
//! dense MLPs + RMSNorms + one embedding row + the full lm_head (the tied matrix for tied models);
//! total counts a tied matrix once. Not counted: a vision tower or an MTP head a checkpoint may
//! carry (the forward pass does not run them).

use moerun_core::DType;

use crate::config::{FfnKind, ModelConfig, QkNorm};

/// Parameter counts of a model, by component, summed over all layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamStats {
    /// Every stored parameter (a tied embedding/lm_head counted once).
    pub total: u64,
    /// Parameters read to decode one token.
    pub active: u64,
    /// The embedding table, `vocab × hidden`.
    pub embedding: u64,
    /// `lm_head`, `vocab × hidden`; 0 when tied (it is the embedding).
    pub lm_head: u64,
    /// q/k/v/o projections (q with its output gate, where the family has one), their biases and
    /// the q/k norms, over the attention layers.
    pub attention: u64,
    /// The Gated DeltaNet layers: `in_proj_qkv`/`z`/`b`/`a`, conv taps, `A_log`, `dt_bias`, the
    /// gated norm and `out_proj`.
    pub linear_attention: u64,
    /// Router matrices of the MoE layers.
    pub router: u64,
    /// All routed experts of all MoE layers.
    pub experts: u64,
    /// The routed experts one token uses (`top_k` per MoE layer).
    pub experts_active: u64,
    /// Shared experts and their sigmoid gates.
    pub shared_experts: u64,
    /// Dense SwiGLU MLPs (dense models, and MoE models' MLP-only layers).
    pub dense_mlp: u64,
    /// Every RMSNorm weight vector outside attention (two per layer plus the final one; Gemma
    /// 4's sandwich norms: four to seven per layer).
    pub norms: u64,
    /// Gemma 4's per-layer input embeddings: the packed table, its projection and norm, and each
    /// layer's gate, projection and norm.
    pub per_layer_input: u64,
}

impl ParamStats {
    /// Count the parameters `cfg` implies.
    pub fn from_config(cfg: &ModelConfig) -> ParamStats {
        if let Some(g) = &cfg.gemma4 {
            return crate::gemma4::stats::param_stats(cfg, g);
        }
        let h = cfg.hidden_size as u64;
        let v = cfg.vocab_size as u64;
        let (q, kv) = (cfg.q_dim() as u64, cfg.kv_dim() as u64);
        // q_proj also yields the output gate where there is one.
        let q_out = if cfg.attention_output_gate { 2 * q } else { q };

        // Attention is the same in every attention layer.
        let mut attn = h * q_out + 2 * h * kv + q * h;
        if cfg.attention_bias.qkv {
            attn += q_out + 2 * kv;
        }
        if cfg.attention_bias.o {
            attn += h;
        }
        attn += match cfg.qk_norm {
            QkNorm::None => 0,
            QkNorm::PerHead => 2 * cfg.head_dim as u64,
            QkNorm::WholeProjection => q + kv,
        };

        let linear_layers = (cfg.num_layers() - cfg.num_attention_layers()) as u64;
        let linear = cfg.linear_attention.map_or(0, |la| {
            let (conv, value) = (la.conv_dim() as u64, la.value_dim() as u64);
            let heads = la.num_value_heads as u64;
            (conv + value + 2 * heads) * h       // in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
                + conv * la.conv_kernel as u64   // conv1d
                + 2 * heads                      // A_log, dt_bias
                + la.value_head_dim as u64       // gated norm
                + h * value // out_proj
        });

        let mut s = ParamStats {
            embedding: v * h,
            lm_head: if cfg.tie_word_embeddings { 0 } else { v * h },
            // Two norms per layer, plus the final norm.
            norms: (2 * cfg.num_layers() as u64 + 1) * h,
            attention: attn * cfg.num_attention_layers() as u64,
            linear_attention: linear * linear_layers,
            ..ParamStats::default()
        };
        for layer in &cfg.layers {
            match layer.ffn {
                FfnKind::Dense { intermediate } => {
                    let i = intermediate as u64;
                    let bias = if cfg.mlp_bias { 2 * i + h } else { 0 };
                    s.dense_mlp += 3 * h * i + bias;
                }
                FfnKind::Moe => {
                    let Some(moe) = &cfg.moe else { continue };
                    let expert = 3 * h * moe.expert_intermediate as u64;
                    s.router += moe.num_experts as u64 * h;
                    s.experts += moe.num_experts as u64 * expert;
                    s.experts_active += moe.top_k as u64 * expert;
                    if let Some(shared) = &moe.shared_expert {
                        s.shared_experts += 3 * h * shared.intermediate as u64;
                        if shared.gated {
                            s.shared_experts += h;
                        }
                    }
                }
            }
        }
        let always =
            s.attention + s.linear_attention + s.router + s.shared_experts + s.dense_mlp + s.norms;
        s.total = always + s.experts + s.embedding + s.lm_head;
        // One embedding row is read per token; the whole output projection is (the tied matrix
        // when tied, so the embedding is effectively read twice: one row, then in full).
        s.active = always + s.experts_active + h + v * h;
        s
    }

    /// Bytes of all weights stored in `dtype`.
    pub fn total_bytes(&self, dtype: DType) -> u64 {
        self.total * dtype.size() as u64
    }

    /// Weight bytes decode streams per token with weights stored in `dtype`: exact for top-k
    /// routing, since every token reads exactly `top_k` experts per MoE layer.
    pub fn active_bytes(&self, dtype: DType) -> u64 {
        self.active * dtype.size() as u64
    }
}

/// A parameter count for people: `30.53B`, `134.52M`, `51.2K`, `12`.
pub fn human_count(n: u64) -> String {
    let n_f = n as f64;
    if n >= 1_000_000_000 {
        format!("{:.2}B", n_f / 1e9)
    } else if n >= 1_000_000 {
        format!("{:.2}M", n_f / 1e6)
    } else if n >= 1_000 {
        format!("{:.1}K", n_f / 1e3)
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(json: &str) -> ParamStats {
        ParamStats::from_config(&ModelConfig::from_json_str(json).expect("config parses"))
    }

    // Expected figures are configs/README.md's, which were summed from transformers' own modules.

    #[test]
    fn qwen3_30b_a3b() {
        let s = stats(include_str!("../../../configs/qwen3-30b-a3b.json"));
        assert_eq!(s.total, 30_532_122_624);
        assert_eq!(s.active, 3_041_869_824);
        assert_eq!(s.active_bytes(DType::BF16), 6_083_739_648);
        assert_eq!(s.total_bytes(DType::BF16), 2 * 30_532_122_624);
    }

    #[test]
    fn qwen3_235b_a22b() {
        let s = stats(include_str!("../../../configs/qwen3-235b-a22b.json"));
        assert_eq!(s.total, 235_093_634_560);
        assert_eq!(s.active, 21_568_437_760);
        assert_eq!(s.active_bytes(DType::BF16), 43_136_875_520);
    }

    #[test]
    fn qwen2_57b_a14b() {
        let s = stats(include_str!("../../../configs/qwen2-57b-a14b.json"));
        assert_eq!(s.total, 57_408_658_944);
        assert_eq!(s.active, 13_704_735_744);
        assert_eq!(s.active_bytes(DType::BF16), 27_409_471_488);
        assert_eq!(s.shared_experts, 28 * 220_204_544);
    }

    #[test]
    fn mixtral_8x7b() {
        let s = stats(include_str!("../../../configs/mixtral-8x7b.json"));
        assert_eq!(s.total, 46_702_792_704);
        assert_eq!(s.active, 12_748_857_344);
        assert_eq!(s.active_bytes(DType::BF16), 25_497_714_688);
    }

    #[test]
    fn olmoe_1b_7b() {
        let s = stats(include_str!("../../../configs/olmoe-1b-7b-0924.json"));
        assert_eq!(s.total, 6_919_161_856);
        assert_eq!(s.active, 1_178_996_736);
        assert_eq!(s.active_bytes(DType::BF16), 2_357_993_472);
    }

    #[test]
    fn qwen3_5_35b_a3b_hybrid() {
        let s = stats(include_str!("../../../configs/qwen3.5-35b-a3b.json"));
        assert_eq!(s.total, 34_660_610_688);
        assert_eq!(s.active, 2_946_431_616);
        assert_eq!(s.active_bytes(DType::BF16), 5_892_863_232);
        assert_eq!(s.linear_attention, 30 * 33_718_464);
        assert_eq!(s.attention, 10 * 27_263_488);
        assert_eq!(s.shared_experts, 40 * 3_147_776);
    }

    #[test]
    fn gemma_4_26b_a4b_sandwich_norms_dense_mlp_and_experts() {
        let s = stats(include_str!("../../../configs/gemma-4-26b-a4b.json"));
        assert_eq!(s.total, 25_233_141_760);
        assert_eq!(s.active, 3_822_533_376);
        assert_eq!(s.active_bytes(DType::BF16), 7_645_066_752);
        // 25 sliding layers (q, k, v, o, q/k norms) and 5 full ones (k_eq_v: no v_proj).
        assert_eq!(s.attention, 25 * 34_603_520 + 5 * 49_021_952);
        assert_eq!(s.dense_mlp, 30 * 17_842_176);
        assert_eq!(s.router, 30 * 363_392);
        assert_eq!(s.norms, 30 * 19_712 + 2_816);
        assert_eq!((s.lm_head, s.per_layer_input), (0, 0));
    }

    #[test]
    fn smollm2_135m_dense_tied() {
        let s = stats(include_str!("../../../configs/smollm2-135m-instruct.json"));
        assert_eq!(s.total, 134_515_008);
        assert_eq!(s.active, 134_515_584);
        assert_eq!(s.active_bytes(DType::BF16), 269_031_168);
        assert_eq!((s.lm_head, s.router, s.experts), (0, 0, 0));
    }

    #[test]
    fn components_add_up() {
        let s = stats(include_str!("../../../configs/qwen3-30b-a3b.json"));
        let parts = s.embedding
            + s.lm_head
            + s.attention
            + s.linear_attention
            + s.router
            + s.experts
            + s.shared_experts
            + s.dense_mlp
            + s.norms;
        assert_eq!(parts, s.total);
        assert_eq!(s.experts_active * 16, s.experts, "top-8 of 128 experts");
    }

    #[test]
    fn human_counts() {
        assert_eq!(human_count(30_532_122_624), "30.53B");
        assert_eq!(human_count(134_515_008), "134.52M");
        assert_eq!(human_count(51_200), "51.2K");
        assert_eq!(human_count(12), "12");
    }
}
