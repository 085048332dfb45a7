//! Gemma 4 config resolution: the published gemma-4-26B-A4B config, the transformers-5 spelling,
//! the config class's defaults, KV sharing, and refusals by name.

use super::*;
use serde_json::json;

fn resolve_json(value: serde_json::Value) -> Result<ModelConfig> {
    ModelConfig::from_json(&value)
}

fn g4(c: &ModelConfig) -> &Gemma4Config {
    c.gemma4.as_ref().expect("a gemma4 config")
}

/// A small gemma4_text config; `extra` overrides or adds fields.
fn text(extra: serde_json::Value) -> serde_json::Value {
    let mut base = json!({
        "model_type": "gemma4_text", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "global_head_dim": 16, "sliding_window": 6, "hidden_size_per_layer_input": 0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                        "sliding_attention", "full_attention"],
    });
    for (k, v) in extra.as_object().expect("object") {
        base[k] = v.clone();
    }
    base
}

#[test]
fn gemma_4_26b_a4b_resolves_to_its_published_shape() {
    let c = ModelConfig::from_json_str(include_str!("../../../../../configs/gemma-4-26b-a4b.json"))
        .unwrap();
    let g = g4(&c);
    assert_eq!(c.family, Family::Gemma4);
    assert_eq!(
        (c.num_layers(), c.hidden_size, c.vocab_size),
        (30, 2816, 262_144)
    );
    assert_eq!(c.num_heads, 16);
    let full: Vec<usize> = (0..30).filter(|&l| !g.layers[l].sliding).collect();
    assert_eq!(full, vec![5, 11, 17, 23, 29]);
    for (l, layer) in g.layers.iter().enumerate() {
        let want = if layer.sliding {
            (256, 8, false)
        } else {
            (512, 2, true)
        };
        assert_eq!(
            (layer.head_dim, layer.num_kv_heads, layer.k_eq_v),
            want,
            "layer {l}"
        );
        assert_eq!(layer.kv_source, l, "no KV sharing");
        assert_eq!(layer.mlp_intermediate, 2112);
        assert_eq!(c.layers[l].sliding_window, layer.sliding.then_some(1024));
        assert_eq!(c.layers[l].ffn, FfnKind::Moe);
    }
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate),
        (128, 8, 704)
    );
    assert!(g.enable_moe_block && g.per_layer_input.is_none());
    assert_eq!(g.final_logit_softcapping, Some(30.0));
    assert_eq!(g.sliding_rope.rotated_pairs, 128);
    assert_eq!((g.full_rope.head_dim, g.full_rope.rotated_pairs), (512, 64));
    assert_eq!(
        (g.sliding_rope.theta, g.full_rope.theta),
        (10_000.0, 1_000_000.0)
    );
    assert_eq!(g.towers, vec!["vision"], "audio_config is null");
    assert!(c.tie_word_embeddings && !c.rms_norm_unit_offset);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(2), vec![1])
    );
    // 25 sliding layers of 2·8·256 and 5 full ones of 2·2·512 values, f32.
    assert_eq!(c.kv_bytes_per_token(4), (25 * 4096 + 5 * 2048) * 4);
}

#[test]
fn per_layer_config_overrides_full_layers_as_transformers_saves_them() {
    let c = resolve_json(text(json!({
        "attention_k_eq_v": true,
        "per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1},
                             "4": {"head_dim": 16, "num_key_value_heads": 1}},
    })))
    .unwrap();
    let shapes: Vec<(usize, usize)> = g4(&c)
        .layers
        .iter()
        .map(|l| (l.head_dim, l.num_kv_heads))
        .collect();
    assert_eq!(shapes, vec![(8, 2), (16, 1), (8, 2), (8, 2), (16, 1)]);
}

#[test]
fn hub_globals_apply_to_full_layers_and_kv_heads_only_with_k_eq_v() {
    let with = resolve_json(text(
        json!({"attention_k_eq_v": true, "num_global_key_value_heads": 1}),
    ))
    .unwrap();
    let without = resolve_json(text(json!({"num_global_key_value_heads": 1}))).unwrap();
    assert_eq!(
        (
            g4(&with).layers[1].head_dim,
            g4(&with).layers[1].num_kv_heads
        ),
        (16, 1)
    );
    assert!(g4(&with).layers[1].k_eq_v && !g4(&with).layers[0].k_eq_v);
    assert_eq!(
        (
            g4(&without).layers[1].head_dim,
            g4(&without).layers[1].num_kv_heads
        ),
        (16, 2)
    );
    // global_head_dim defaults to 512.
    let mut v = text(json!({}));
    v.as_object_mut().unwrap().remove("global_head_dim");
    assert_eq!(g4(&resolve_json(v).unwrap()).layers[1].head_dim, 512);
}

#[test]
fn defaults_follow_the_config_class() {
    let mut v = text(json!({"num_hidden_layers": 8}));
    let o = v.as_object_mut().unwrap();
    o.remove("layer_types");
    o.remove("hidden_size_per_layer_input");
    let c = resolve_json(v).unwrap();
    let g = g4(&c);
    let sliding: Vec<bool> = g.layers.iter().map(|l| l.sliding).collect();
    // Every 6th layer full, and the last one forced full.
    assert_eq!(sliding, [true, true, true, true, true, false, true, false]);
    assert_eq!(g.full_rope.rotated_pairs, 2, "proportional 0.25 of 16 / 2");
    assert_eq!(g.full_rope.theta, 1_000_000.0);
    assert!(g.full_rope.proportional && !g.sliding_rope.proportional);
    let ple = g
        .per_layer_input
        .expect("hidden_size_per_layer_input defaults to 256");
    assert_eq!((ple.width, ple.vocab), (256, 262_144));
    assert_eq!(g.final_logit_softcapping, None);
    assert!(c.tie_word_embeddings);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(2), vec![1])
    );
}

#[test]
fn shared_layers_read_the_last_unshared_layer_of_their_type() {
    let c = resolve_json(text(
        json!({"num_kv_shared_layers": 2, "use_double_wide_mlp": true}),
    ))
    .unwrap();
    let g = g4(&c);
    let sources: Vec<usize> = g.layers.iter().map(|l| l.kv_source).collect();
    assert_eq!(sources, vec![0, 1, 2, 2, 1]);
    assert_eq!(c.layer_kv_shape(3), None);
    assert_eq!(c.layer_kv_shape(2), Some((2, 8)));
    let widths: Vec<usize> = g.layers.iter().map(|l| l.mlp_intermediate).collect();
    assert_eq!(
        widths,
        vec![48, 48, 48, 96, 96],
        "double-wide on shared layers only"
    );
    // Three layers keep K/V: two sliding (2·2·8) and one full (2·2·16).
    assert_eq!(c.kv_bytes_per_token(1), 2 * 32 + 64);
}

#[test]
fn proportional_rope_matches_transformers_inv_freq() {
    // transformers 5.24: theta 5e5, partial 0.5, factor 2, head_dim 32.
    let r = Gemma4Rope {
        theta: 500_000.0,
        head_dim: 32,
        rotated_pairs: 8,
        factor: 2.0,
        proportional: true,
    };
    let want = [0.5, 0.2202, 0.0970, 0.0427, 0.0188, 0.0083, 0.0036, 0.0016];
    let got = r.inv_freq();
    assert_eq!(got.len(), 16);
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-4, "{g} vs {w}");
    }
    assert!(got[8..].iter().all(|&f| f == 0.0));
}

#[test]
fn multimodal_wrapper_reads_text_config_and_names_its_towers() {
    let c = resolve_json(json!({
        "model_type": "gemma4", "text_config": text(json!({})),
        "vision_config": {"hidden_size": 8}, "audio_config": {"hidden_size": 8},
        "tie_word_embeddings": false,
    }))
    .unwrap();
    assert_eq!(g4(&c).towers, vec!["vision", "audio"]);
    assert!(!c.tie_word_embeddings);
    assert!(!c.has_vision_tower, "Gemma 4 reports its towers itself");
}

#[test]
fn options_moerun_cannot_honour_are_refused_by_name() {
    let cases = [
        (
            json!({"use_bidirectional_attention": "all"}),
            "use_bidirectional_attention",
        ),
        (
            json!({"hidden_activation": "gelu"}),
            "hidden_activation 'gelu'",
        ),
        (
            json!({"rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}}),
            "rope type 'yarn'",
        ),
        (
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
            "rope_parameters.sliding_attention",
        ),
        (
            json!({"per_layer_config": {"1": {"intermediate_size": 8}}}),
            "per_layer_config.1.intermediate_size",
        ),
        (
            json!({"per_layer_config": {"9": {"head_dim": 8}}}),
            "per_layer_config key '9'",
        ),
        (json!({"num_kv_shared_layers": 5}), "num_kv_shared_layers 5"),
        (
            json!({"num_kv_shared_layers": 3, "layer_types": ["sliding_attention", "sliding_attention",
                   "full_attention", "full_attention", "full_attention"]}),
            "no earlier unshared layer has its type",
        ),
        (
            json!({"layer_types": ["sliding_attention"]}),
            "'layer_types' has 1 entries",
        ),
        (
            json!({"enable_moe_block": true, "num_experts": 4}),
            "top_k_experts",
        ),
    ];
    for (extra, needle) in cases {
        let err = resolve_json(text(extra.clone())).unwrap_err().to_string();
        assert!(err.contains(needle), "{extra}: {err}");
    }
    let err = resolve_json(json!({"model_type": "gemma4"}))
        .unwrap_err()
        .to_string();
    assert!(err.contains("text_config"), "{err}");
}
