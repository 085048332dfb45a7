//! The model families moerun implements, by `model_type`.

use std::fmt;

/// A supported architecture. Each one's forward-pass quirks are decided in `config::raw`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Qwen3Moe,
    Qwen2Moe,
    Mixtral,
    Olmoe,
    Qwen3,
    Qwen2,
    Llama,
    /// Qwen3.5/3.6-MoE: Gated DeltaNet layers mixed with gated full attention, MoE with a gated
    /// shared expert. `qwen3_5_moe` configs wrap it (`text_config`) with a vision tower.
    Qwen35Moe,
    /// Gemma 4: sliding and full attention layers of different shapes, KV sharing, sandwich
    /// norms, a dense MLP beside the routed experts (`enable_moe_block`). `gemma4` configs wrap it
    /// (`text_config`, model_type `gemma4_text`) with vision/audio towers.
    Gemma4,
}

impl Family {
    pub const ALL: [Family; 9] = [
        Family::Qwen3Moe,
        Family::Qwen2Moe,
        Family::Mixtral,
        Family::Olmoe,
        Family::Qwen3,
        Family::Qwen2,
        Family::Llama,
        Family::Qwen35Moe,
        Family::Gemma4,
    ];

    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Mixtral => "mixtral",
            Family::Olmoe => "olmoe",
            Family::Qwen3 => "qwen3",
            Family::Qwen2 => "qwen2",
            Family::Llama => "llama",
            Family::Qwen35Moe => "qwen3_5_moe",
            Family::Gemma4 => "gemma4",
        }
    }

    /// The family a `model_type` names. Qwen3.5's text part has its own spelling
    /// (`qwen3_5_moe_text`, what `Qwen3_5MoeForCausalLM` checkpoints and `text_config` say).
    pub fn from_model_type(name: &str) -> Option<Family> {
        if name == "qwen3_5_moe_text" {
            return Some(Family::Qwen35Moe);
        }
        if name == "gemma4_text" {
            return Some(Family::Gemma4);
        }
        Family::ALL.into_iter().find(|f| f.model_type() == name)
    }

    /// Comma-separated list of supported `model_type`s, for error messages.
    pub fn supported_list() -> String {
        Family::ALL.map(|f| f.model_type()).join(", ")
    }

    /// Whether every config of the family has routed experts (Gemma 4's depend on
    /// `enable_moe_block`, so it is not listed).
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            Family::Qwen3Moe
                | Family::Qwen2Moe
                | Family::Mixtral
                | Family::Olmoe
                | Family::Qwen35Moe
        )
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.model_type())
    }
}
