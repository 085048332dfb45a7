//! `moerun synth`: a checkpoint directory with random weights at a real model's shapes, so speed can
//! be measured (and loading tested) at full size without downloading the real weights. The output
//! is what `Model::load` reads from the Hub: `config.json`, `generation_config.json`, and either
//! `model.safetensors` or shards plus `model.safetensors.index.json`.

mod known;
mod plan;
mod write;

pub use write::SplitMix64;

use std::path::{Path, PathBuf};
use std::time::Instant;

use moerun_core::{DType, SharedBytes, Tensor};
use moerun_model::checkpoint::Checkpoint;
use moerun_model::stats::{human_count, ParamStats};
use moerun_model::{Model, ModelConfig};
use serde_json::Value;

use super::inspect::human_bytes;
use super::CliResult;
use crate::SynthArgs;

pub fn run(args: &SynthArgs) -> CliResult {
    if args.list {
        print_list();
        return Ok(());
    }
    let (Some(like), Some(out)) = (&args.like, &args.out) else {
        return Err("synth needs --like and --out (or --list)".into());
    };
    let dtype = DType::parse(&args.dtype)
        .ok_or_else(|| format!("--dtype '{}': expected bf16, f16 or f32", args.dtype))?;
    let (name, config_json, cfg) = resolve(like, args.layers, dtype)?;
    let layers = cfg.num_layers();
    let full = plan::raw_num_layers(&source(like)?.1).unwrap_or(layers);
    prepare_out_dir(out)?;

    let start = Instant::now();
    let stats = ParamStats::from_config(&cfg);
    eprintln!(
        "synth: {name} ({}), {layers} of {full} layers, {dtype}, {} parameters, {}, seed {}",
        cfg.family,
        human_count(stats.total),
        human_bytes(stats.total_bytes(dtype)),
        args.seed
    );
    write_json(&out.join("config.json"), &config_json)?;
    write_json(
        &out.join("generation_config.json"),
        &plan::generation_config(&config_json),
    )?;
    let tensors = plan::tensors(&cfg);
    let written = write::write_weights(out, &tensors, dtype, args.seed, write::SHARD_LIMIT)?;
    println!(
        "wrote {}: {} weight file(s), {} bytes ({}), {} parameters, in {:.1} s",
        out.display(),
        written.files,
        written.bytes,
        human_bytes(written.bytes),
        human_count(stats.total),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The config a synthetic model of `like` (its first `layers` layers, weights in `dtype`) has:
/// (name, rewritten config.json, resolved config). Unsupported families are refused here.
fn resolve(
    like: &str,
    layers: Option<usize>,
    dtype: DType,
) -> CliResult<(String, Value, ModelConfig)> {
    let (name, raw) = source(like)?;
    ModelConfig::from_json(&raw).map_err(|e| format!("{name}: {e}"))?;
    let full = plan::raw_num_layers(&raw)
        .ok_or_else(|| format!("{name}: config has no num_hidden_layers"))?;
    let layers = match layers {
        None => full,
        Some(0) => return Err("--layers must be at least 1".into()),
        Some(n) if n > full => {
            return Err(format!("--layers {n}: {name} has only {full} layers").into())
        }
        Some(n) => n,
    };
    let config_json = plan::rewrite_config(&raw, layers, dtype);
    let cfg = ModelConfig::from_json(&config_json).map_err(|e| format!("{name}: {e}"))?;
    Ok((name, config_json, cfg))
}

/// A synthetic model of `like` held in memory, never written: the checkpoint's tensors have the
/// plan's names and shapes, but every matrix is a window onto one shared zero buffer (at its own
/// offset, so each has its own identity), and only the small vectors (norm weights, biases)
/// hold their real initial values. Meant for a device backend that draws the matrices itself
/// ([`moerun_model::cuda::WeightSource::Random`]): a 60 GB model costs the host well under 1 GB.
pub fn in_memory(like: &str, layers: Option<usize>, dtype: DType) -> CliResult<(String, Model)> {
    let (name, config_json, cfg) = resolve(like, layers, dtype)?;
    let tensors = plan::tensors(&cfg);
    const STRIDE: usize = 64;
    let largest = tensors
        .iter()
        .map(|t| t.numel() * dtype.size())
        .max()
        .unwrap_or(0);
    let shared = SharedBytes::from_vec(vec![0u8; largest + STRIDE * tensors.len()]);
    let mut rng = SplitMix64::new(0x73_796e_7468);
    let mut named = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let bytes = t.numel() * dtype.size();
        let data = if t.shape.len() >= 2 {
            shared
                .slice(i * STRIDE, bytes)
                .ok_or("synthetic model: shared buffer too small")?
        } else {
            let mut v = vec![0u8; bytes];
            write::fill(t.init, dtype, &mut rng, &mut v);
            SharedBytes::from_vec(v)
        };
        let tensor = Tensor::new(dtype, t.shape.clone(), data)?;
        named.push((t.name.clone(), tensor));
    }
    let generation = plan::generation_config(&config_json);
    let checkpoint = Checkpoint::in_memory(
        &format!("synthetic {name}"),
        [
            ("config.json".to_string(), config_json),
            ("generation_config.json".to_string(), generation),
        ],
        named,
    );
    Ok((name, Model::from_checkpoint(checkpoint)?))
}

/// The config `--like` names: a known model, a config.json path, or a checkpoint directory.
pub(crate) fn source(like: &str) -> CliResult<(String, Value)> {
    let parse = |text: &str, origin: &str| -> CliResult<Value> {
        serde_json::from_str(text).map_err(|e| format!("{origin}: not valid JSON: {e}").into())
    };
    if let Some(k) = known::find(like) {
        return Ok((k.name.to_string(), parse(k.json, k.name)?));
    }
    let mut path = PathBuf::from(like);
    if path.is_dir() {
        path = path.join("config.json");
    }
    if !path.is_file() {
        return Err(format!(
            "--like '{like}': not a known model nor a config.json file; known models: {}",
            known::names()
        )
        .into());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((
        path.display().to_string(),
        parse(&text, &path.display().to_string())?,
    ))
}

/// Create `dir`, or accept it if it exists and is empty: never overwrite anything.
fn prepare_out_dir(dir: &Path) -> CliResult {
    if dir.exists() {
        if !dir.is_dir() {
            return Err(format!("--out {}: exists and is not a directory", dir.display()).into());
        }
        let mut entries =
            std::fs::read_dir(dir).map_err(|e| format!("--out {}: {e}", dir.display()))?;
        if entries.next().is_some() {
            return Err(format!(
                "--out {}: directory is not empty; refusing to overwrite it",
                dir.display()
            )
            .into());
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("--out {}: {e}", dir.display()).into())
}

/// Write pretty JSON with a trailing newline, as transformers does.
fn write_json(path: &Path, value: &Value) -> CliResult {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()).into())
}

/// `--list`: every known model, its family, and whether moerun runs it.
fn print_list() {
    println!(
        "{:<24} {:<14} {:<10} parameters",
        "name", "model_type", "supported"
    );
    for k in known::KNOWN {
        let (supported, params) = match known::resolve(k.json) {
            Ok(cfg) => {
                let s = ParamStats::from_config(&cfg);
                (
                    "yes".to_string(),
                    format!(
                        "{} total, {} active",
                        human_count(s.total),
                        human_count(s.active)
                    ),
                )
            }
            Err(e) => ("no".to_string(), e),
        };
        println!(
            "{:<24} {:<14} {:<10} {params}",
            k.name,
            known::model_type(k.json),
            supported
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moerun_model::Model;

    /// A qwen3_moe config of a few KB, with an MLP-only layer.
    fn tiny_config() -> Value {
        serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 3, "vocab_size": 100,
            "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 6,
            "num_experts_per_tok": 2, "mlp_only_layers": [1], "norm_topk_prob": true,
        })
    }

    #[test]
    fn sharded_output_loads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = ModelConfig::from_json(&tiny_config()).expect("config");
        write_json(&dir.path().join("config.json"), &tiny_config()).expect("config written");
        let tensors = plan::tensors(&cfg);
        // A 20 KB limit forces several shards and the index.
        let w =
            write::write_weights(dir.path(), &tensors, DType::BF16, 5, 20_000).expect("written");
        assert!(w.files > 2, "{} files", w.files);
        assert!(dir.path().join("model.safetensors.index.json").is_file());
        let model = Model::load(dir.path()).expect("loads");
        assert_eq!(model.checkpoint().weight_bytes(), w.bytes);
        assert_eq!(
            w.bytes,
            ParamStats::from_config(&cfg).total_bytes(DType::BF16)
        );
    }
}
