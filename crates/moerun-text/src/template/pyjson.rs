//! `tojson` as transformers defines it for chat templates: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, with the
//! same keyword arguments. Tool schemas and tool-call arguments are printed into prompts with it,
//! so its spacing (`", "` and `": "` when not indenting, `","` plus newlines when indenting), its
//! key order (insertion order) and its float spelling (`1.0`, `1e+16`) are part of the prompt the
//! model was trained on. minijinja's own `tojson` is compact and HTML-escapes, hence this file.

use std::fmt::Write;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// How to print: the knobs of `json.dumps` that templates use. The default is transformers'.
#[derive(Clone, Debug, Default)]
pub struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX` (transformers' default is `false`).
    pub ensure_ascii: bool,
    /// `None` prints on one line; `Some(s)` puts each item on its own line indented by `s`.
    pub indent: Option<String>,
    /// Item and key separators; `None` uses Python's defaults for the chosen `indent`.
    pub separators: Option<(String, String)>,
    /// Sort object keys instead of keeping insertion order.
    pub sort_keys: bool,
}

/// The `tojson` filter: `value | tojson`, `tojson(indent=4)`, and Python's positional order
/// `tojson(ensure_ascii, indent, separators, sort_keys)`.
pub fn tojson_filter(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let mut options = DumpOptions::default();
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    for (name, arg) in names.iter().zip(args.iter()) {
        apply_option(&mut options, name, arg)?;
    }
    for name in names {
        if let Some(arg) = kwargs.get::<Option<Value>>(name)? {
            apply_option(&mut options, name, &arg)?;
        }
    }
    kwargs.assert_all_used()?;
    dumps(value, &options)
}

fn apply_option(options: &mut DumpOptions, name: &str, arg: &Value) -> Result<(), Error> {
    let bad = |what: &str| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: {name} {what}"),
        )
    };
    match name {
        "ensure_ascii" => options.ensure_ascii = arg.is_true(),
        "sort_keys" => options.sort_keys = arg.is_true(),
        "indent" => {
            options.indent = if arg.is_none() || arg.is_undefined() {
                None
            } else if let Some(s) = arg.as_str() {
                Some(s.to_string())
            } else if let Some(n) = arg.as_i64().filter(|_| arg.is_integer()) {
                // Python indents by n spaces; a negative or zero count still breaks lines.
                Some(" ".repeat(n.max(0) as usize))
            } else {
                return Err(bad("must be an integer, a string or none"));
            }
        }
        "separators" => {
            options.separators = if arg.is_none() || arg.is_undefined() {
                None
            } else {
                let parts: Vec<Value> = arg
                    .try_iter()
                    .map_err(|_| bad("must be a pair of strings"))?
                    .collect();
                match parts.as_slice() {
                    [item, key] if item.as_str().is_some() && key.as_str().is_some() => Some((
                        item.as_str().unwrap_or_default().to_string(),
                        key.as_str().unwrap_or_default().to_string(),
                    )),
                    _ => return Err(bad("must be a pair of strings")),
                }
            }
        }
        _ => unreachable!("only the four names above are passed"),
    }
    Ok(())
}

/// Serializes `value` exactly as Python's `json.dumps` would with `options`.
pub fn dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match (&options.separators, &options.indent) {
        (Some((item, key)), _) => (item.clone(), key.clone()),
        (None, Some(_)) => (",".to_string(), ": ".to_string()),
        (None, None) => (", ".to_string(), ": ".to_string()),
    };
    let mut writer = Writer {
        options,
        item_sep,
        key_sep,
        out: String::new(),
    };
    writer.value(value, 0)?;
    Ok(writer.out)
}

struct Writer<'a> {
    options: &'a DumpOptions,
    item_sep: String,
    key_sep: String,
    out: String,
}

impl Writer<'_> {
    fn value(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.number(value)?,
            ValueKind::String => self.string(value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container('[', ']', items.len(), depth, |w, i, d| {
                    w.value(&items[i], d)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.options.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                let mut entries = Vec::with_capacity(keys.len());
                for key in keys {
                    let item = value.get_item(&key)?;
                    entries.push((key, item));
                }
                self.container('{', '}', entries.len(), depth, |w, i, d| {
                    let (key, item) = &entries[i];
                    w.key(key)?;
                    let sep = w.key_sep.clone();
                    w.out.push_str(&sep);
                    w.value(item, d)
                })?;
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "tojson: a value of kind {} is not JSON serializable",
                        value.kind()
                    ),
                ))
            }
        }
        Ok(())
    }

    /// Writes `open item sep item ... close`, one item per line when indenting, as Python does
    /// (empty containers stay `[]` / `{}` even then).
    fn container(
        &mut self,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        let indent = self.options.indent.clone();
        for i in 0..len {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            if let Some(unit) = &indent {
                self.out.push('\n');
                self.out.push_str(&unit.repeat(depth + 1));
            }
            item(self, i, depth + 1)?;
        }
        if let Some(unit) = &indent {
            self.out.push('\n');
            self.out.push_str(&unit.repeat(depth));
        }
        self.out.push(close);
        Ok(())
    }

    /// Python converts int, float, bool and None keys to strings; anything else is an error.
    fn key(&mut self, key: &Value) -> Result<(), Error> {
        match key.kind() {
            ValueKind::String => self.string(key.as_str().unwrap_or_default()),
            ValueKind::Number | ValueKind::Bool | ValueKind::None => {
                let mut text = String::new();
                let mut scratch = Writer {
                    options: self.options,
                    item_sep: String::new(),
                    key_sep: String::new(),
                    out: String::new(),
                };
                scratch.value(key, 0)?;
                text.push_str(&scratch.out);
                self.string(&text);
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: object keys must be strings",
                ))
            }
        }
        Ok(())
    }

    fn number(&mut self, value: &Value) -> Result<(), Error> {
        if value.is_integer() {
            // Integers print in full, as Python's arbitrary-precision ints do.
            self.out.push_str(&value.to_string());
            return Ok(());
        }
        let f = f64::try_from(value.clone())?;
        self.out.push_str(&python_float_repr(f));
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{08}' => self.out.push_str("\\b"),
                '\u{0c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(self.out, "\\u{:04x}", c as u32);
                }
                c if self.options.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `float.__repr__`: the shortest round-tripping digits, in positional notation for
/// 1e-4 <= |x| < 1e16 and as `d.ddde+XX` otherwise; `NaN`, `Infinity`, `-Infinity` as json.dumps
/// writes them.
pub fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let abs = f.abs();
    if abs == 0.0 || (1e-4..1e16).contains(&abs) {
        // Rust's Debug is the shortest round-trip form and keeps a ".0" on whole numbers.
        let text = format!("{f:?}");
        if text.contains('e') {
            // Rust switches to exponents earlier than Python in a few cases; expand them.
            return format!("{f}");
        }
        return text;
    }
    // `{:e}` gives the shortest digits as `1.5e-5`; Python writes `1.5e-05` and `1e+16`.
    let text = format!("{f:e}");
    let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exponent.abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn one_line_output_uses_pythons_comma_space_and_colon_space() {
        let v = json(r#"{"b": 1, "a": [true, null, "x"], "c": {}}"#);
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            r#"{"b": 1, "a": [true, null, "x"], "c": {}}"#
        );
    }

    #[test]
    fn indented_output_puts_each_item_on_its_own_line() {
        let v = json(r#"{"a": [1, 2], "b": [], "c": "d"}"#);
        let options = DumpOptions {
            indent: Some("    ".into()),
            ..DumpOptions::default()
        };
        let expected =
            "{\n    \"a\": [\n        1,\n        2\n    ],\n    \"b\": [],\n    \"c\": \"d\"\n}";
        assert_eq!(dumps(&v, &options).unwrap(), expected);
    }

    #[test]
    fn non_ascii_is_kept_and_control_characters_are_escaped() {
        let v = Value::from("café \"q\" \u{1}\n😀");
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            "\"café \\\"q\\\" \\u0001\\n😀\""
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&Value::from("é😀"), &ascii).unwrap(),
            "\"\\u00e9\\ud83d\\ude00\""
        );
    }

    #[test]
    fn floats_are_spelled_as_python_spells_them() {
        for (f, expected) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123456789.125, "123456789.125"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(python_float_repr(f), expected, "{f}");
        }
    }

    #[test]
    fn sort_keys_orders_object_keys() {
        let v = json(r#"{"b": 1, "a": 2}"#);
        let options = DumpOptions {
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(dumps(&v, &options).unwrap(), r#"{"a": 2, "b": 1}"#);
    }
}
