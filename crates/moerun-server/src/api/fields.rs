//! Reading a request's JSON object field by field, so that every mistake is reported with the
//! name of the field at fault (serde's derive would say "invalid type at line 1 column 37").
//! A `null` counts as absent, as in the OpenAI API. [`Fields::finish`] refuses whatever field
//! nobody read: a parameter this server does not know is an error, never silently ignored.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// The fields of one JSON object, consumed as they are read.
pub struct Fields {
    map: Map<String, Value>,
}

impl Fields {
    /// The top-level object of a request body.
    pub fn parse(body: &[u8]) -> Result<Fields, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request("invalid_json", format!("the body is not valid JSON: {e}"))
        })?;
        match value {
            Value::Object(map) => Ok(Fields { map }),
            other => Err(ApiError::bad_request(
                "invalid_json",
                format!("the body must be a JSON object, got {}", type_name(&other)),
            )),
        }
    }

    /// Take a field's raw value; `None` when absent or null.
    pub fn take(&mut self, name: &str) -> Option<Value> {
        self.map.remove(name).filter(|v| !v.is_null())
    }

    /// A required field.
    pub fn require(&mut self, name: &str) -> Result<Value, ApiError> {
        self.take(name).ok_or_else(|| {
            ApiError::invalid(
                name,
                "missing_required_parameter",
                format!("'{name}' is required"),
            )
        })
    }

    /// A string field.
    pub fn string(&mut self, name: &str) -> Result<Option<String>, ApiError> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::wrong_type(name, "a string")),
        }
    }

    /// A boolean field.
    pub fn bool(&mut self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(ApiError::wrong_type(name, "a boolean")),
        }
    }

    /// A number field, as f32, which must lie in `range` (inclusive ends).
    pub fn number(&mut self, name: &str, range: (f32, f32)) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.take(name) else {
            return Ok(None);
        };
        let x = v
            .as_f64()
            .ok_or_else(|| ApiError::wrong_type(name, "a number"))? as f32;
        if !(x >= range.0 && x <= range.1) {
            return Err(ApiError::invalid(
                name,
                "invalid_value",
                format!(
                    "'{name}' must be between {} and {}, got {x}",
                    range.0, range.1
                ),
            ));
        }
        Ok(Some(x))
    }

    /// An integer field (a JSON number without fraction), which must lie in `range`.
    pub fn integer(&mut self, name: &str, range: (i64, i64)) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.take(name) else {
            return Ok(None);
        };
        let n = as_integer(&v).ok_or_else(|| ApiError::wrong_type(name, "an integer"))?;
        if n < range.0 || n > range.1 {
            return Err(ApiError::invalid(
                name,
                "invalid_value",
                format!(
                    "'{name}' must be between {} and {}, got {n}",
                    range.0, range.1
                ),
            ));
        }
        Ok(Some(n))
    }

    /// A nested object field, read the same way.
    pub fn object(&mut self, name: &str) -> Result<Option<Fields>, ApiError> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields { map })),
            Some(_) => Err(ApiError::wrong_type(name, "an object")),
        }
    }

    /// Refuse every field that was not read, naming the first (in the order sent).
    pub fn finish(self, context: &str) -> Result<(), ApiError> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(name) => Err(ApiError::unsupported(
                &format!("{context}{name}"),
                format!("unrecognized or unsupported parameter '{context}{name}'"),
            )),
        }
    }
}

/// A JSON number that is a whole number (`3` or `3.0`) as i64.
pub fn as_integer(v: &Value) -> Option<i64> {
    if let Some(n) = v.as_i64() {
        return Some(n);
    }
    if v.as_u64().is_some() {
        return Some(i64::MAX); // beyond i64: clamp, every range check then refuses it
    }
    let x = v.as_f64()?;
    (x.fract() == 0.0 && x.abs() < 9.0e15).then_some(x as i64)
}

/// The JSON type of a value, for messages.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Fields {
    /// The names of the fields not read yet, in the order sent.
    pub fn keys(&self) -> Vec<String> {
        self.map.keys().cloned().collect()
    }
}
