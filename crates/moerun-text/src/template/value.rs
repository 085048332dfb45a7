//! The values a chat template reads (messages, tools, extra arguments) and the clean-up
//! transformers applies to messages before rendering, so that the same conversation renders to
//! the same bytes here and there.

use indexmap::IndexMap;
use minijinja::value::ValueKind;
use minijinja::Value;
use serde::Serialize;

use crate::error::{Result, TextError};

/// A JSON-like value handed to a template: a message, a tool schema, or an extra argument such as
/// `enable_thinking`. Object keys keep their insertion order, because templates that `tojson` a
/// tool or its arguments print keys in the order given, as Python dicts do.
#[derive(Clone, Debug, PartialEq)]
pub struct TemplateValue(pub(crate) Value);

impl TemplateValue {
    /// Parses JSON text, keeping object keys in the order they are written.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str::<Value>(text)
            .map(Self)
            .map_err(|e| TextError::TemplateInput(e.to_string()))
    }

    /// Converts any serializable value (struct fields keep their declaration order).
    pub fn from_serialize<T: Serialize>(value: &T) -> Self {
        Self(Value::from(minijinja::value::Serde(value)))
    }

    /// A plain `{"role": role, "content": content}` message.
    pub fn message(role: &str, content: &str) -> Self {
        let mut map = IndexMap::new();
        map.insert(Value::from("role"), Value::from(role));
        map.insert(Value::from("content"), Value::from(content));
        Self(Value::from_object(map))
    }

    /// The underlying minijinja value, for callers that build values with minijinja directly.
    pub fn as_value(&self) -> &Value {
        &self.0
    }
}

impl From<Value> for TemplateValue {
    fn from(value: Value) -> Self {
        Self(value)
    }
}

impl From<bool> for TemplateValue {
    fn from(b: bool) -> Self {
        Self(Value::from(b))
    }
}

impl From<&str> for TemplateValue {
    fn from(s: &str) -> Self {
        Self(Value::from(s))
    }
}

impl From<String> for TemplateValue {
    fn from(s: String) -> Self {
        Self(Value::from(s))
    }
}

impl From<i64> for TemplateValue {
    fn from(n: i64) -> Self {
        Self(Value::from(n))
    }
}

/// Names a message's reasoning may come under; transformers copies the first non-null one to
/// `thinking` (first key, unless present) and `reasoning_content` (last key, unless present).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// Prepares one message as transformers 5 does before rendering: keys whose value is `null` are
/// dropped (many templates render a literal "None" otherwise), and reasoning given under any of
/// its names is made visible under `reasoning_content` and `thinking`.
pub(crate) fn normalize_message(message: &TemplateValue) -> Result<Value> {
    let value = &message.0;
    if value.kind() != ValueKind::Map {
        return Err(TextError::TemplateInput(format!(
            "a chat message must be an object, got {}",
            value.kind()
        )));
    }
    let mut entries: IndexMap<Value, Value> = IndexMap::new();
    let keys: Vec<Value> = value
        .try_iter()
        .map_err(|e| TextError::TemplateInput(e.to_string()))?
        .collect();
    for key in keys {
        let item = value
            .get_item(&key)
            .map_err(|e| TextError::TemplateInput(e.to_string()))?;
        if !item.is_none() && !item.is_undefined() {
            entries.insert(key, item);
        }
    }
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|name| entries.get(&Value::from(*name)).cloned());
    if let Some(reasoning) = reasoning {
        // Python's `{"thinking": r, **message, "reasoning_content": r}`: `thinking` always comes
        // first (the spread only overwrites its value), `reasoning_content` keeps its place if the
        // message had it and is appended otherwise.
        let thinking_key = Value::from("thinking");
        let thinking = entries
            .shift_remove(&thinking_key)
            .unwrap_or_else(|| reasoning.clone());
        entries.shift_insert(0, thinking_key, thinking);
        entries.insert(Value::from("reasoning_content"), reasoning);
    }
    Ok(Value::from_object(entries))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(value: &Value) -> Vec<String> {
        value.try_iter().unwrap().map(|k| k.to_string()).collect()
    }

    #[test]
    fn null_fields_are_dropped_like_transformers_does() {
        let m = TemplateValue::from_json(
            r#"{"role": "assistant", "content": "hi", "tool_calls": null}"#,
        )
        .unwrap();
        let out = normalize_message(&m).unwrap();
        assert_eq!(keys(&out), ["role", "content"]);
    }

    #[test]
    fn reasoning_under_another_name_is_aliased_to_reasoning_content_and_thinking() {
        let m =
            TemplateValue::from_json(r#"{"role": "assistant", "reasoning": "r", "content": "c"}"#)
                .unwrap();
        let out = normalize_message(&m).unwrap();
        assert_eq!(
            keys(&out),
            [
                "thinking",
                "role",
                "reasoning",
                "content",
                "reasoning_content"
            ]
        );
        assert_eq!(
            out.get_attr("reasoning_content").unwrap().as_str(),
            Some("r")
        );
    }

    #[test]
    fn a_message_that_is_not_an_object_is_refused() {
        let m = TemplateValue::from("hello");
        assert!(matches!(
            normalize_message(&m),
            Err(TextError::TemplateInput(_))
        ));
    }
}
