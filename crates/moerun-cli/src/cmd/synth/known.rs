//! The published `config.json` files of configs/, compiled into the binary so that
//! `moerun synth --like qwen3-30b-a3b` works anywhere, without network access or the source tree.

use moerun_model::ModelConfig;
use serde_json::Value;

/// A known model: its name (the file stem under configs/) and its `config.json` text.
pub struct Known {
    pub name: &'static str,
    pub json: &'static str,
}

macro_rules! known {
    ($($name:literal),* $(,)?) => {
        &[$(Known {
            name: $name,
            json: include_str!(concat!("../../../../../configs/", $name, ".json")),
        }),*]
    };
}

/// Every file of configs/, sorted by name.
pub const KNOWN: &[Known] = known![
    "deepseek-v3",
    "gemma-4-26b-a4b",
    "gpt-oss-20b",
    "mixtral-8x7b",
    "olmoe-1b-7b-0924",
    "qwen2-57b-a14b",
    "qwen3-235b-a22b",
    "qwen3-30b-a3b",
    "qwen3-next-80b-a3b",
    "qwen3.5-35b-a3b",
    "smollm2-135m-instruct",
];

/// The known model called `name`.
pub fn find(name: &str) -> Option<&'static Known> {
    KNOWN.iter().find(|k| k.name == name)
}

/// Comma-separated known names, for error messages.
pub fn names() -> String {
    KNOWN.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
}

/// The top-level `model_type` of a config text (`?` when absent or unparsable).
pub fn model_type(json: &str) -> String {
    serde_json::from_str::<Value>(json)
        .ok()
        .and_then(|v| v.get("model_type")?.as_str().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// Whether moerun runs this config: `Ok` with the resolved config, or the reason it does not.
pub fn resolve(json: &str) -> Result<ModelConfig, String> {
    ModelConfig::from_json_str(json).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_moe_models_gemma_4_and_smollm_are_supported() {
        for name in [
            "gemma-4-26b-a4b",
            "qwen3-30b-a3b",
            "qwen3-235b-a22b",
            "qwen2-57b-a14b",
            "mixtral-8x7b",
            "olmoe-1b-7b-0924",
            "smollm2-135m-instruct",
        ] {
            let known = find(name).expect("known");
            assert!(resolve(known.json).is_ok(), "{name}");
        }
    }

    #[test]
    fn unsupported_families_say_so() {
        let err = resolve(find("deepseek-v3").expect("known").json).unwrap_err();
        assert!(err.contains("deepseek_v3"), "{err}");
        assert_eq!(
            model_type(find("gpt-oss-20b").expect("known").json),
            "gpt_oss"
        );
    }
}
