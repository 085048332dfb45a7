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
}

impl Family {
    pub const ALL: [Family; 7] = [
        Family::Qwen3Moe,
        Family::Qwen2Moe,
        Family::Mixtral,
        Family::Olmoe,
        Family::Qwen3,
        Family::Qwen2,
        Family::Llama,
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
        }
    }

    pub fn from_model_type(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.model_type() == name)
    }

    /// Comma-separated list of supported `model_type`s, for error messages.
    pub fn supported_list() -> String {
        Family::ALL.map(|f| f.model_type()).join(", ")
    }

    pub fn is_moe(self) -> bool {
        matches!(
            self,
            Family::Qwen3Moe | Family::Qwen2Moe | Family::Mixtral | Family::Olmoe
        )
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.model_type())
    }
}
