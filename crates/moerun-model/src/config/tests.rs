//! Config resolution against published configs and both spellings.

use super::*;

fn known(name: &str) -> ModelConfig {
    let text = match name {
        "qwen3-30b-a3b" => include_str!("../../../../configs/qwen3-30b-a3b.json"),
        "qwen2-57b-a14b" => include_str!("../../../../configs/qwen2-57b-a14b.json"),
        "mixtral-8x7b" => include_str!("../../../../configs/mixtral-8x7b.json"),
        "olmoe-1b-7b-0924" => include_str!("../../../../configs/olmoe-1b-7b-0924.json"),
        "qwen3.5-35b-a3b" => include_str!("../../../../configs/qwen3.5-35b-a3b.json"),
        _ => unreachable!(),
    };
    ModelConfig::from_json_str(text).unwrap()
}

#[test]
fn qwen3_30b_a3b_resolves_to_its_published_shape() {
    let c = known("qwen3-30b-a3b");
    assert_eq!(c.family, Family::Qwen3Moe);
    assert_eq!((c.num_layers(), c.hidden_size, c.head_dim), (48, 2048, 128));
    assert_eq!((c.num_heads, c.num_kv_heads), (32, 4));
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate),
        (128, 8, 768)
    );
    assert!(moe.norm_topk_prob);
    assert!(c
        .layers
        .iter()
        .all(|l| l.ffn == FfnKind::Moe && l.sliding_window.is_none()));
    assert_eq!(c.qk_norm, QkNorm::PerHead);
    assert_eq!(c.rope.theta, 1_000_000.0);
    assert_eq!(c.rope.scaling, RopeScaling::Default);
}

#[test]
fn qwen2_moe_has_a_gated_shared_expert_and_qkv_bias() {
    let c = known("qwen2-57b-a14b");
    let moe = c.moe.as_ref().unwrap();
    let shared = moe.shared_expert.as_ref().unwrap();
    assert_eq!((shared.intermediate, shared.gated), (20480, true));
    assert_eq!(
        c.attention_bias,
        AttentionBias {
            qkv: true,
            o: false
        }
    );
    assert!(!moe.norm_topk_prob);
}

#[test]
fn mixtral_and_olmoe_use_intermediate_size_for_experts() {
    let m = known("mixtral-8x7b");
    assert_eq!(m.moe.as_ref().unwrap().expert_intermediate, 14336);
    assert!(
        m.moe.as_ref().unwrap().norm_topk_prob,
        "Mixtral always renormalises"
    );
    let o = known("olmoe-1b-7b-0924");
    assert_eq!(o.moe.as_ref().unwrap().expert_intermediate, 1024);
    assert_eq!(o.qk_norm, QkNorm::WholeProjection);
    assert_eq!(o.rms_norm_eps, 1e-5);
}

fn base(extra: &str) -> String {
    format!(
        r#"{{"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 100,
            "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_experts_per_tok": 2 {extra}}}"#
    )
}

#[test]
fn both_spellings_of_rope_and_expert_count_resolve_alike() {
    let v4 = ModelConfig::from_json_str(&base(
        r#", "num_experts": 8, "rope_theta": 5000.0,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}"#,
    ))
    .unwrap();
    let v5 = ModelConfig::from_json_str(&base(
        r#", "num_local_experts": 8, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0,
           "factor": 4.0, "original_max_position_embeddings": 1024}"#,
    ))
    .unwrap();
    assert_eq!(v4, v5);
    assert_eq!(v4.moe.unwrap().num_experts, 8);
    assert!(matches!(v4.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
}

#[test]
fn mlp_only_layers_and_sparse_step_pick_dense_layers() {
    let c = ModelConfig::from_json_str(&base(
        r#", "num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]"#,
    ))
    .unwrap();
    let kinds: Vec<bool> = c.layers.iter().map(|l| l.ffn == FfnKind::Moe).collect();
    assert_eq!(kinds, vec![false, true, false, false]);
}

#[test]
fn unknown_model_type_is_named_with_the_supported_list() {
    let err = ModelConfig::from_json_str(r#"{"model_type": "gpt_bigcode"}"#).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("gpt_bigcode") && msg.contains("qwen3_moe") && msg.contains("mixtral"),
        "{msg}"
    );
}

#[test]
fn unsupported_rope_type_and_activation_are_refused_by_name() {
    let e = ModelConfig::from_json_str(&base(
        r#", "num_experts": 8, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}"#,
    ))
    .unwrap_err();
    assert!(e.to_string().contains("longrope"), "{e}");
    let e = ModelConfig::from_json_str(&base(r#", "num_experts": 8, "hidden_act": "gelu""#))
        .unwrap_err();
    assert!(e.to_string().contains("gelu"), "{e}");
}

#[test]
fn missing_and_mistyped_fields_are_named() {
    let e = ModelConfig::from_json_str(r#"{"model_type": "llama"}"#).unwrap_err();
    assert!(e.to_string().contains("hidden_size"), "{e}");
    let e = ModelConfig::from_json_str(&base(r#", "num_experts": "eight""#)).unwrap_err();
    assert!(e.to_string().contains("num_experts"), "{e}");
}

#[test]
fn llama3_rope_keeps_high_frequencies_and_divides_low_ones() {
    let c = ModelConfig::from_json_str(
        r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 1, "num_hidden_layers": 1,
            "vocab_size": 10, "intermediate_size": 8, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
    )
    .unwrap();
    let (freqs, scale) = c.rope.inv_freq();
    assert_eq!(scale, 1.0);
    assert_eq!(freqs[0], 1.0, "highest frequency untouched");
    let base_last = 1.0 / 500000f32.powf(62.0 / 64.0);
    assert!(
        (freqs[31] - base_last / 8.0).abs() < 1e-12,
        "lowest frequency divided by factor"
    );
}

#[test]
fn qwen3_5_35b_a3b_resolves_its_text_config_to_the_hybrid_stack() {
    let c = known("qwen3.5-35b-a3b");
    assert_eq!(c.family, Family::Qwen35Moe);
    assert!(c.has_vision_tower);
    assert_eq!((c.num_layers(), c.hidden_size, c.head_dim), (40, 2048, 256));
    assert_eq!((c.num_heads, c.num_kv_heads, c.vocab_size), (16, 2, 248320));
    // Every fourth layer is full attention (layer_types as published).
    for (i, l) in c.layers.iter().enumerate() {
        let want = if (i + 1) % 4 == 0 {
            Mixer::Attention
        } else {
            Mixer::GatedDeltaNet
        };
        assert_eq!(l.mixer, want, "layer {i}");
        assert_eq!((l.ffn, l.sliding_window), (FfnKind::Moe, None));
    }
    assert_eq!(c.num_attention_layers(), 10);
    let la = c.linear_attention.unwrap();
    assert_eq!(
        (
            la.num_key_heads,
            la.num_value_heads,
            la.key_head_dim,
            la.value_head_dim
        ),
        (16, 32, 128, 128)
    );
    assert_eq!((la.conv_kernel, la.conv_dim()), (4, 8192));
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate),
        (256, 8, 512)
    );
    assert!(moe.norm_topk_prob);
    let shared = moe.shared_expert.as_ref().unwrap();
    assert_eq!((shared.intermediate, shared.gated), (512, true));
    assert!(c.rms_norm_unit_offset && c.attention_output_gate);
    assert_eq!(c.qk_norm, QkNorm::PerHead);
    // partial_rotary_factor 0.25 of 256; mrope_section is inert for text positions.
    assert_eq!((c.rope.theta, c.rope.rotary_dim), (1e7, 64));
    assert_eq!(c.rope.scaling, RopeScaling::Default);
    assert_eq!(c.eos_token_ids, vec![248044]);
    assert!(!c.tie_word_embeddings);
    // KV for 10 layers only; 30 layers of fixed-size state per sequence.
    assert_eq!(c.kv_bytes_per_token(2), 2 * 10 * 512 * 2);
    assert_eq!(
        c.linear_state_bytes_per_sequence(),
        30 * (3 * 8192 + 32 * 128 * 128) * 4
    );
}

fn qwen3_5_text(extra: &str) -> Result<ModelConfig> {
    ModelConfig::from_json_str(&format!(
        r#"{{"model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 100,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
            "num_experts": 8, "num_experts_per_tok": 2 {extra}}}"#
    ))
}

#[test]
fn qwen3_5_defaults_follow_its_config_class() {
    let c = qwen3_5_text("").unwrap();
    // head_dim 256, partial rotary 0.25, full attention every 4th layer, linear_* defaults.
    assert_eq!((c.head_dim, c.rope.rotary_dim), (256, 64));
    let mixers: Vec<Mixer> = c.layers.iter().map(|l| l.mixer).collect();
    assert_eq!(mixers[3], Mixer::Attention);
    assert_eq!(c.num_attention_layers(), 1);
    let la = c.linear_attention.unwrap();
    assert_eq!(
        (la.num_key_heads, la.num_value_heads, la.conv_kernel),
        (16, 32, 4)
    );
    assert!(!c.has_vision_tower);
    let c = qwen3_5_text(r#", "full_attention_interval": 2"#).unwrap();
    assert_eq!(c.num_attention_layers(), 3);
}

#[test]
fn qwen3_5_options_transformers_would_ignore_are_refused_by_name() {
    for (extra, name) in [
        (r#", "mlp_only_layers": [1]"#, "mlp_only_layers"),
        (r#", "attn_output_gate": false"#, "attn_output_gate"),
        (r#", "norm_topk_prob": false"#, "norm_topk_prob"),
        (r#", "sliding_window": 128"#, "sliding_window"),
        (
            r#", "layer_types": ["linear_attention", "sliding_attention", "full_attention",
                "linear_attention", "linear_attention", "full_attention"]"#,
            "sliding_attention",
        ),
        (r#", "linear_num_key_heads": 5"#, "linear_num_value_heads"),
    ] {
        let e = qwen3_5_text(extra).unwrap_err();
        assert!(e.to_string().contains(name), "{name}: {e}");
    }
}

#[test]
fn multimodal_wrapper_takes_the_text_config_and_the_top_level_tie_flag() {
    let c = ModelConfig::from_json_str(
        r#"{"model_type": "qwen3_5_moe", "tie_word_embeddings": false, "vision_config": {"depth": 1},
            "text_config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 4, "vocab_size": 100, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2}}"#,
    )
    .unwrap();
    assert_eq!((c.family, c.has_vision_tower), (Family::Qwen35Moe, true));
    assert_eq!(c.hidden_size, 64);
    let e = ModelConfig::from_json_str(r#"{"model_type": "qwen3_5_moe"}"#).unwrap_err();
    assert!(e.to_string().contains("text_config"), "{e}");
}
