//! Rotary position embedding parameters and their inverse frequencies, computed exactly as
//! transformers' `modeling_rope_utils.py` does (`_compute_default_rope_parameters`,
//! `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
//! `_compute_yarn_parameters`), in f32 like torch, so positions rotate identically.

use moerun_core::{Error, Result};
use serde_json::Value;

/// Supported `rope_type`s with their parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    Default,
    Linear {
        factor: f32,
    },
    /// Dynamic NTK: identical to `Default` up to `max_position_embeddings`; past it transformers
    /// rescales the base from the longest sequence seen so far, which depends on batch history,
    /// so the forward pass refuses such positions instead of guessing.
    Dynamic {
        factor: f32,
        max_position_embeddings: usize,
    },
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    Yarn {
        factor: f32,
        original_max_position_embeddings: f32,
        beta_fast: f32,
        beta_slow: f32,
        /// cos and sin are multiplied by this ("mscale").
        attention_factor: f32,
        truncate: bool,
    },
}

/// RoPE of a model: base, scaling, and how much of each head rotates.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub scaling: RopeScaling,
    /// Number of leading dimensions of each head that rotate (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
}

impl RopeConfig {
    /// Read RoPE settings from either spelling: transformers 5's `rope_parameters` dict, or v4's
    /// top-level `rope_theta` plus an optional `rope_scaling` dict (`type` or `rope_type`).
    /// `default_partial` is the family's `partial_rotary_factor` when the config has none.
    pub(super) fn parse(
        cfg: &Value,
        head_dim: usize,
        max_positions: usize,
        default_partial: f64,
    ) -> Result<RopeConfig> {
        let empty = serde_json::Map::new();
        let params = cfg
            .get("rope_parameters")
            .and_then(Value::as_object)
            .or_else(|| cfg.get("rope_scaling").and_then(Value::as_object))
            .unwrap_or(&empty);
        if params.values().any(Value::is_object) {
            return Err(Error::Unsupported(
                "per-layer-type rope_parameters in this family".into(),
            ));
        }
        let num = |key: &str| -> Option<f64> {
            params
                .get(key)
                .and_then(Value::as_f64)
                .or_else(|| cfg.get(key).and_then(Value::as_f64))
        };
        let theta = num("rope_theta").unwrap_or(10000.0) as f32;
        let partial = num("partial_rotary_factor").unwrap_or(default_partial);
        let rotary_dim = (head_dim as f64 * partial) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(Error::Config(format!(
                "partial_rotary_factor {partial} gives an invalid rotary dimension {rotary_dim}"
            )));
        }
        let kind = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let need = |key: &str| -> Result<f32> {
            num(key).map(|v| v as f32).ok_or_else(|| {
                Error::Config(format!(
                    "rope type '{kind}' needs '{key}' in its parameters"
                ))
            })
        };
        let original = || {
            num("original_max_position_embeddings")
                .map(|v| v as f32)
                .unwrap_or(max_positions as f32)
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: need("factor")?,
            },
            "dynamic" => RopeScaling::Dynamic {
                factor: need("factor")?,
                max_position_embeddings: max_positions,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: original(),
            },
            "yarn" => {
                let original_max = original();
                let factor = num("factor")
                    .map(|v| v as f32)
                    .unwrap_or(max_positions as f32 / original_max);
                let mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention_factor = match num("attention_factor") {
                    Some(a) => a,
                    None => match (num("mscale"), num("mscale_all_dim")) {
                        (Some(m), Some(md)) if m != 0.0 && md != 0.0 => {
                            mscale(factor as f64, m) / mscale(factor as f64, md)
                        }
                        _ => mscale(factor as f64, 1.0),
                    },
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original_max,
                    beta_fast: num("beta_fast").filter(|&v| v != 0.0).unwrap_or(32.0) as f32,
                    beta_slow: num("beta_slow").filter(|&v| v != 0.0).unwrap_or(1.0) as f32,
                    attention_factor: attention_factor as f32,
                    truncate: params
                        .get("truncate")
                        .and_then(Value::as_bool)
                        .unwrap_or(true),
                }
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "rope type '{other}' (supported: default, linear, dynamic, llama3, yarn)"
                )))
            }
        };
        Ok(RopeConfig {
            theta,
            scaling,
            rotary_dim,
        })
    }

    /// The first position these frequencies cannot serve, if any (dynamic NTK past its range).
    pub fn position_limit(&self) -> Option<usize> {
        match self.scaling {
            RopeScaling::Dynamic {
                max_position_embeddings,
                ..
            } => Some(max_position_embeddings),
            _ => None,
        }
    }

    /// Inverse frequencies (`rotary_dim / 2` of them) and the factor cos/sin are scaled by.
    pub fn inv_freq(&self) -> (Vec<f32>, f32) {
        let dim = self.rotary_dim;
        // torch: base ** (arange(0, dim, 2).float() / dim), all in f32.
        let pos_freqs: Vec<f32> = (0..dim)
            .step_by(2)
            .map(|i| self.theta.powf(i as f32 / dim as f32))
            .collect();
        let base: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        match self.scaling {
            RopeScaling::Default | RopeScaling::Dynamic { .. } => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_ctx,
            } => {
                let low_wavelen = old_ctx / low_freq_factor;
                let high_wavelen = old_ctx / high_freq_factor;
                let freqs = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        if wavelen < high_wavelen || wavelen > low_wavelen {
                            scaled
                        } else {
                            let smooth = (old_ctx / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        }
                    })
                    .collect();
                (freqs, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let theta = self.theta as f64;
                let correction_dim = |rotations: f64| {
                    dim as f64
                        * (original_max_position_embeddings as f64
                            / (rotations * 2.0 * std::f64::consts::PI))
                            .ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (
                    correction_dim(beta_fast as f64),
                    correction_dim(beta_slow as f64),
                );
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0) as f32;
                let mut high = high.min(dim as f64 - 1.0) as f32;
                if low == high {
                    high += 0.001;
                }
                let freqs = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (factor * p);
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                (freqs, attention_factor)
            }
        }
    }
}
