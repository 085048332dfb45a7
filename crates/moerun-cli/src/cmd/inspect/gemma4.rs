//! What `moerun inspect` says about a Gemma 4 model beyond the common rows: attention shapes by
//! layer type, RoPE by layer type, which layers keep K/V (and how much of it the sliding window
//! reads), the dense MLP beside the experts, soft-capping, per-layer inputs, skipped towers.

use moerun_model::config::{Gemma4Config, Gemma4Rope, ModelConfig};
use moerun_model::kv::KV_BYTES_PER_VALUE;

use super::human_bytes;

/// `16 q; sliding: 8 kv × 256; full: 2 kv × 512, K = V`.
pub fn heads(cfg: &ModelConfig, g: &Gemma4Config) -> String {
    let mut parts = vec![format!("{} q", cfg.num_heads)];
    for sliding in [true, false] {
        let Some(l) = g.layers.iter().find(|l| l.sliding == sliding) else {
            continue;
        };
        let kind = if sliding { "sliding" } else { "full" };
        let k_eq_v = if l.k_eq_v { ", K = V projection" } else { "" };
        parts.push(format!(
            "{kind}: {} kv × {}{k_eq_v}",
            l.num_kv_heads, l.head_dim
        ));
    }
    parts.join("; ")
}

/// `sliding: default, theta 10000; full: proportional, theta 1000000, 64 of 256 pairs rotate`.
pub fn rope(g: &Gemma4Config) -> String {
    let one = |kind: &str, r: &Gemma4Rope| {
        let mut s = format!(
            "{kind}: {}, theta {}",
            if r.proportional {
                "proportional"
            } else {
                "default"
            },
            r.theta
        );
        if r.rotated_pairs < r.head_dim / 2 {
            s += &format!(", {} of {} pairs rotate", r.rotated_pairs, r.head_dim / 2);
        }
        if r.factor != 1.0 {
            s += &format!(", factor {}", r.factor);
        }
        s
    };
    let mut parts = Vec::new();
    if g.layers.iter().any(|l| l.sliding) {
        parts.push(one("sliding", &g.sliding_rope));
    }
    if g.layers.iter().any(|l| !l.sliding) {
        parts.push(one("full", &g.full_rope));
    }
    parts.join("; ")
}

/// Extra `(key, value)` rows.
pub fn rows(cfg: &ModelConfig, g: &Gemma4Config) -> Vec<(&'static str, String)> {
    let mut rows = vec![("kv layers", kv_layers(g))];
    let widths: Vec<usize> = g.layers.iter().map(|l| l.mlp_intermediate).collect();
    let (lo, hi) = (
        widths.iter().min().copied().unwrap_or(0),
        widths.iter().max().copied().unwrap_or(0),
    );
    let width = if lo == hi {
        format!("intermediate {lo}")
    } else {
        format!("intermediate {lo}, {hi} on KV-shared layers")
    };
    let beside = if g.enable_moe_block {
        ", beside the experts in every layer"
    } else {
        ""
    };
    rows.push(("dense mlp", format!("GELU-tanh, {width}{beside}")));
    if let Some(cap) = g.final_logit_softcapping {
        rows.push(("logit softcap", format!("{cap} · tanh(logits / {cap})")));
    }
    if let Some(ple) = g.per_layer_input {
        rows.push((
            "per-layer input",
            format!(
                "{} per layer (table {} × {})",
                ple.width,
                ple.vocab,
                cfg.num_layers() * ple.width
            ),
        ));
    }
    if !g.towers.is_empty() {
        rows.push(("not run", format!("{} tower(s)", g.towers.join(", "))));
    }
    rows
}

/// Which layers keep K/V and what the sliding ones read: `30 keep K/V: 25 sliding (1.56 MiB per
/// token... of which attention reads the last 1024 tokens), 5 full (...)`.
fn kv_layers(g: &Gemma4Config) -> String {
    let bytes = |sliding: bool| -> (usize, u64) {
        let own = g
            .layers
            .iter()
            .enumerate()
            .filter(|(i, l)| l.sliding == sliding && !l.shares_kv(*i));
        own.fold((0, 0), |(n, b), (_, l)| {
            (
                n + 1,
                b + (2 * l.num_kv_heads * l.head_dim * KV_BYTES_PER_VALUE) as u64,
            )
        })
    };
    let (ns, bs) = bytes(true);
    let (nf, bf) = bytes(false);
    let window = g.sliding_window as u64;
    let mut s = format!(
        "{} keep K/V: {ns} sliding ({} per token; attention reads the last {window} tokens, \
         {} per sequence at most, but every block is kept), {nf} full ({} per token)",
        ns + nf,
        human_bytes(bs),
        human_bytes(bs * window),
        human_bytes(bf)
    );
    let shared: Vec<String> = g
        .layers
        .iter()
        .enumerate()
        .filter(|(i, l)| l.shares_kv(*i))
        .map(|(i, l)| format!("{i}→{}", l.kv_source))
        .collect();
    if !shared.is_empty() {
        s += &format!(
            "; {} reuse an earlier layer's ({})",
            shared.len(),
            shared.join(", ")
        );
    }
    s
}
