//! Element types of stored weights. Activations are always f32; weights keep their stored type and
//! are widened inside the kernels.

use std::fmt;

/// The element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The dtype named by a safetensors header (`"F32"`, `"BF16"`, `"F16"`), if supported.
    pub fn from_safetensors(name: &str) -> Option<DType> {
        match name {
            "F32" => Some(DType::F32),
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            _ => None,
        }
    }

    /// The safetensors spelling of this dtype.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
        }
    }

    /// Parse a user-facing name (`f32`, `bf16`, `f16`, also `float32`, `bfloat16`, `float16`).
    pub fn parse(name: &str) -> Option<DType> {
        match name.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "float16" | "half" => Some(DType::F16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        })
    }
}
