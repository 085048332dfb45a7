//! `moerun inspect`: what a checkpoint is, in one screen. Architecture from the resolved config,
//! parameter counts and per-token bytes from `moerun_model::stats`, dtypes and sizes from the
//! safetensors headers (as stored, before any widening), so a user can see at a glance what decode
//! will have to stream per token.

use std::collections::BTreeMap;

use moerun_core::DType;
use moerun_model::config::{FfnKind, ModelConfig, RopeScaling};
use moerun_model::stats::{human_count, ParamStats};
use moerun_model::Model;

use super::CliResult;
use crate::InspectArgs;

mod gemma4;

pub fn run(args: &InspectArgs) -> CliResult {
    let model = Model::load(&args.model)?;
    let cfg = &model.config;
    let stats = ParamStats::from_config(cfg);
    let stored = StoredDtypes::of(&model);
    let dtype = stored.main()?;
    let row = |key: &str, value: String| println!("{key:<16} {value}");

    row("model", args.model.display().to_string());
    row("family", cfg.family.to_string());
    row("layers", layers(cfg));
    if let Some(mixers) = mixers(cfg) {
        row("token mixers", mixers);
    }
    row("sliding window", sliding(cfg));
    row("hidden size", cfg.hidden_size.to_string());
    let heads = match &cfg.gemma4 {
        Some(g) => gemma4::heads(cfg, g),
        None => format!(
            "{} q / {} kv, head_dim {}",
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ),
    };
    row("heads", heads);
    row("experts", experts(cfg));
    row("vocab", cfg.vocab_size.to_string());
    row(
        "parameters",
        format!(
            "{} total, {} active per token",
            human_count(stats.total),
            human_count(stats.active)
        ),
    );
    row("dtype", stored.describe());
    let weight_bytes = model.checkpoint().weight_bytes();
    row(
        "weight bytes",
        format!("{} ({weight_bytes} bytes)", human_bytes(weight_bytes)),
    );
    let active = stats.active_bytes(dtype);
    row(
        "active bytes",
        format!(
            "{} per token ({active} bytes, at {dtype})",
            human_bytes(active)
        ),
    );
    let kv = cfg.kv_bytes_per_token(4) as u64;
    let state = cfg.linear_state_bytes_per_sequence() as u64;
    let state = if state > 0 {
        format!(
            "; linear-attention state {} per sequence",
            human_bytes(state)
        )
    } else {
        String::new()
    };
    row(
        "kv cache",
        format!(
            "{} per token ({kv} bytes, f32; half with --kv-dtype bf16){state}",
            human_bytes(kv)
        ),
    );
    match &cfg.gemma4 {
        Some(g) => {
            row("rope", gemma4::rope(g));
            for (key, value) in gemma4::rows(cfg, g) {
                row(key, value);
            }
        }
        None => row("rope", rope(cfg)),
    }
    row(
        "tied embeddings",
        if cfg.tie_word_embeddings { "yes" } else { "no" }.to_string(),
    );
    let stored_params = stored.params;
    if stored_params != stats.total {
        // E.g. a tied model whose file also carries lm_head, extra buffers moerun ignores, or a
        // vision tower / MTP head (not run).
        row(
            "note",
            format!(
                "the checkpoint stores {stored_params} parameters; the config implies {}",
                stats.total
            ),
        );
    }
    Ok(())
}

/// A byte count in binary units: `5.79 GiB`, `768 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

/// Bytes and parameters per stored dtype, from the safetensors headers.
pub struct StoredDtypes {
    /// Safetensors dtype name (`BF16`, `I64`...) to bytes.
    pub bytes: BTreeMap<String, u64>,
    pub params: u64,
}

impl StoredDtypes {
    pub fn of(model: &Model) -> StoredDtypes {
        let ckpt = model.checkpoint();
        let mut bytes = BTreeMap::new();
        let mut params = 0;
        for info in ckpt.names().filter_map(|n| ckpt.info(n)) {
            *bytes.entry(info.dtype.clone()).or_insert(0) += info.byte_len() as u64;
            params += info.shape.iter().product::<usize>() as u64;
        }
        StoredDtypes { bytes, params }
    }

    /// The dtype holding most bytes: the one decode streams (weights of one checkpoint share it).
    pub fn main(&self) -> CliResult<DType> {
        let (name, _) = self
            .bytes
            .iter()
            .max_by_key(|(_, &b)| b)
            .ok_or("the checkpoint holds no tensors")?;
        DType::from_safetensors(name).ok_or_else(|| {
            format!("weights are stored as {name}, which moerun does not compute with").into()
        })
    }

    /// `bf16`, or `mixed: bf16 99.9%, f32 0.1%` (shares of bytes).
    pub fn describe(&self) -> String {
        let lower = |name: &str| {
            DType::from_safetensors(name)
                .map(|d| d.to_string())
                .unwrap_or_else(|| name.to_ascii_lowercase())
        };
        if self.bytes.len() == 1 {
            return self.bytes.keys().map(|n| lower(n)).collect();
        }
        let total: u64 = self.bytes.values().sum::<u64>().max(1);
        let mut parts: Vec<(&String, &u64)> = self.bytes.iter().collect();
        parts.sort_by(|a, b| b.1.cmp(a.1));
        let parts: Vec<String> = parts
            .into_iter()
            .map(|(n, &b)| format!("{} {:.1}%", lower(n), 100.0 * b as f64 / total as f64))
            .collect();
        format!("mixed: {}", parts.join(", "))
    }
}

/// `48 (48 MoE, 0 dense)`.
fn layers(cfg: &ModelConfig) -> String {
    let moe = cfg.layers.iter().filter(|l| l.ffn == FfnKind::Moe).count();
    format!(
        "{} ({moe} MoE, {} dense)",
        cfg.num_layers(),
        cfg.num_layers() - moe
    )
}

/// For hybrid models: `30 Gated DeltaNet (16 key / 32 value heads of 128/128, conv 4), 10 full
/// attention (gated output)`.
fn mixers(cfg: &ModelConfig) -> Option<String> {
    let la = cfg.linear_attention?;
    let full = cfg.num_attention_layers();
    let gated = if cfg.attention_output_gate {
        " (gated output)"
    } else {
        ""
    };
    Some(format!(
        "{} Gated DeltaNet ({} key / {} value heads of {}/{}, conv {}), {full} full attention{gated}",
        cfg.num_layers() - full,
        la.num_key_heads,
        la.num_value_heads,
        la.key_head_dim,
        la.value_head_dim,
        la.conv_kernel
    ))
}

/// `none`, or `4096 tokens on 24 of 28 layers` (listing every distinct window).
fn sliding(cfg: &ModelConfig) -> String {
    let mut windows: BTreeMap<usize, usize> = BTreeMap::new();
    for w in cfg.layers.iter().filter_map(|l| l.sliding_window) {
        *windows.entry(w).or_insert(0) += 1;
    }
    if windows.is_empty() {
        return "none".into();
    }
    windows
        .iter()
        .map(|(w, n)| format!("{w} tokens on {n} of {} layers", cfg.num_layers()))
        .collect::<Vec<_>>()
        .join("; ")
}

/// `128 routed, 8 active per token (intermediate 768)`, plus the shared expert, or `none (dense)`.
fn experts(cfg: &ModelConfig) -> String {
    let Some(moe) = &cfg.moe else {
        return "none (dense)".into();
    };
    let mut s = format!(
        "{} routed, {} active per token (intermediate {})",
        moe.num_experts, moe.top_k, moe.expert_intermediate
    );
    if let Some(shared) = &moe.shared_expert {
        let gated = if shared.gated { ", gated" } else { "" };
        s += &format!(
            "; shared expert (intermediate {}{gated})",
            shared.intermediate
        );
    }
    s
}

/// `default, theta 1000000` or `yarn (factor 4, original context 32768), theta 1000000`.
fn rope(cfg: &ModelConfig) -> String {
    let r = &cfg.rope;
    let kind = match r.scaling {
        RopeScaling::Default => "default".to_string(),
        RopeScaling::Linear { factor } => format!("linear (factor {factor})"),
        RopeScaling::Dynamic { factor, .. } => format!("dynamic NTK (factor {factor})"),
        RopeScaling::Llama3 {
            factor,
            original_max_position_embeddings,
            ..
        } => {
            format!("llama3 (factor {factor}, original context {original_max_position_embeddings})")
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            ..
        } => format!("yarn (factor {factor}, original context {original_max_position_embeddings})"),
    };
    let partial = if r.rotary_dim < cfg.head_dim {
        format!(", rotating {} of {} dims", r.rotary_dim, cfg.head_dim)
    } else {
        String::new()
    };
    format!("{kind}, theta {}{partial}", r.theta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_units() {
        assert_eq!(human_bytes(768), "768 B");
        assert_eq!(human_bytes(16 * 1024), "16.00 KiB");
        assert_eq!(human_bytes(6_216_000_000), "5.79 GiB");
    }
}
