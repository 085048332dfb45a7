//! The tensors of a Gemma 4 checkpoint, named as transformers saves them: under
//! `model.language_model.` for a multimodal (`gemma4`) config (its towers are not written: moerun
//! does not run them), else under `model.`; experts fused (`experts.gate_up_proj`,
//! `experts.down_proj`); KV-shared layers without `k_proj`/`v_proj`/`k_norm`; `attention_k_eq_v`
//! full layers without `v_proj`; a `layer_scalar` per layer.

use moerun_model::config::{Gemma4Config, ModelConfig};

use super::{Init, Plan, Planned};

/// Every tensor of a Gemma 4 text model of `cfg`.
pub fn tensors(cfg: &ModelConfig, g: &Gemma4Config) -> Vec<Planned> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut p = Plan {
        out: Vec::new(),
        group: "embeddings".into(),
        // Gemma4RMSNorm multiplies by the weight: ones are the identity.
        norm_init: Init::Ones,
    };
    let base = if g.towers.is_empty() {
        "model"
    } else {
        "model.language_model"
    };
    let n = cfg.num_layers();
    p.matrix(format!("{base}.embed_tokens.weight"), v, h);
    if let Some(ple) = g.per_layer_input {
        p.matrix(
            format!("{base}.embed_tokens_per_layer.weight"),
            ple.vocab,
            n * ple.width,
        );
        p.matrix(
            format!("{base}.per_layer_model_projection.weight"),
            n * ple.width,
            h,
        );
        p.norm(
            format!("{base}.per_layer_projection_norm.weight"),
            ple.width,
        );
    }
    let bias = cfg.attention_bias;
    for (l, layer) in g.layers.iter().enumerate() {
        p.group = format!("layer {}/{n}", l + 1);
        let pre = format!("{base}.layers.{l}");
        let a = format!("{pre}.self_attn");
        let (d, q) = (layer.head_dim, cfg.num_heads * layer.head_dim);
        let kv = layer.num_kv_heads * d;
        p.norm(format!("{pre}.input_layernorm.weight"), h);
        p.linear(&format!("{a}.q_proj"), q, h, bias.qkv);
        p.norm(format!("{a}.q_norm.weight"), d);
        if !layer.shares_kv(l) {
            p.linear(&format!("{a}.k_proj"), kv, h, bias.qkv);
            if !layer.k_eq_v {
                p.linear(&format!("{a}.v_proj"), kv, h, bias.qkv);
            }
            p.norm(format!("{a}.k_norm.weight"), d);
        }
        p.linear(&format!("{a}.o_proj"), h, q, bias.o);
        p.norm(format!("{pre}.post_attention_layernorm.weight"), h);
        p.norm(format!("{pre}.pre_feedforward_layernorm.weight"), h);
        p.mlp(&format!("{pre}.mlp"), h, layer.mlp_intermediate, false);
        if let (true, Some(moe)) = (g.enable_moe_block, &cfg.moe) {
            let (e, i) = (moe.num_experts, moe.expert_intermediate);
            p.matrix(format!("{pre}.router.proj.weight"), e, h);
            p.push(format!("{pre}.router.scale"), vec![h], Init::Ones);
            p.push(
                format!("{pre}.router.per_expert_scale"),
                vec![e],
                Init::Ones,
            );
            p.push(
                format!("{pre}.experts.gate_up_proj"),
                vec![e, 2 * i, h],
                super::uniform(super::MATRIX_STD),
            );
            p.push(
                format!("{pre}.experts.down_proj"),
                vec![e, h, i],
                super::uniform(super::MATRIX_STD),
            );
            for norm in [
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
            ] {
                p.norm(format!("{pre}.{norm}.weight"), h);
            }
        }
        p.norm(format!("{pre}.post_feedforward_layernorm.weight"), h);
        if let Some(ple) = g.per_layer_input {
            p.matrix(format!("{pre}.per_layer_input_gate.weight"), ple.width, h);
            p.matrix(format!("{pre}.per_layer_projection.weight"), h, ple.width);
            p.norm(format!("{pre}.post_per_layer_input_norm.weight"), h);
        }
        p.push(format!("{pre}.layer_scalar"), vec![1], Init::Ones);
    }
    p.group = "final norm and lm_head".into();
    p.norm(format!("{base}.norm.weight"), h);
    if !cfg.tie_word_embeddings {
        p.matrix("lm_head.weight".into(), v, h);
    }
    p.out
}

#[cfg(test)]
mod tests {
    use moerun_core::DType;
    use moerun_engine::{run_step, Sequence, SequenceKv};
    use moerun_model::stats::ParamStats;
    use moerun_model::{LogitsFor, Model};

    use super::super::super::write;
    use super::*;

    #[test]
    fn planned_tensors_are_the_published_parameters_plus_one_layer_scalar_per_layer() {
        let known = super::super::super::known::find("gemma-4-26b-a4b").expect("known");
        let cfg = ModelConfig::from_json_str(known.json).expect("supported");
        let g = cfg.gemma4.as_ref().expect("gemma4");
        let planned = tensors(&cfg, g);
        let params: u64 = planned.iter().map(|t| t.numel() as u64).sum();
        // layer_scalar is a buffer: configs/README.md (and ParamStats) do not count it.
        assert_eq!(params, ParamStats::from_config(&cfg).total + 30);
        let names: Vec<&str> = planned.iter().map(|t| t.name.as_str()).collect();
        assert!(names.contains(&"model.language_model.layers.29.experts.gate_up_proj"));
        assert!(names.contains(&"model.language_model.layers.0.self_attn.v_proj.weight"));
        assert!(!names.contains(&"model.language_model.layers.5.self_attn.v_proj.weight"));
        assert!(!names.contains(&"lm_head.weight"), "tied");
    }

    #[test]
    fn a_synthesized_gemma4_with_shared_kv_and_per_layer_inputs_loads_and_runs() {
        let config = serde_json::json!({
            "model_type": "gemma4_text", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 24, "use_double_wide_mlp": true, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "global_head_dim": 16, "num_global_key_value_heads": 1, "attention_k_eq_v": true,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                            "full_attention"],
            "num_kv_shared_layers": 2, "sliding_window": 4, "enable_moe_block": true,
            "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8,
            "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 64,
            "final_logit_softcapping": 30.0, "tie_word_embeddings": false,
        });
        let cfg = ModelConfig::from_json(&config).expect("config");
        let dir = tempfile::tempdir().expect("tempdir");
        let text = serde_json::to_string_pretty(&config).expect("json");
        std::fs::write(dir.path().join("config.json"), text).expect("config written");
        let planned = tensors(&cfg, cfg.gemma4.as_ref().expect("gemma4"));
        write::write_weights(dir.path(), &planned, DType::BF16, 3, write::SHARD_LIMIT)
            .expect("written");
        let model = Model::load(dir.path()).expect("loads");
        let mut kv = SequenceKv::with_capacity(&model.config, 24);
        let mut seq = Sequence::new((0..20).collect());
        let out = run_step(
            &model,
            &mut kv,
            &mut [&mut seq],
            &[usize::MAX],
            LogitsFor::AllTokens,
        )
        .expect("runs");
        assert_eq!(out.logits.len(), 20 * 64);
        assert!(out.logits.iter().all(|v| v.is_finite() && v.abs() <= 30.0));
    }
}
