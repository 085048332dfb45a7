//! Chat templates: Hugging Face Jinja templates rendered with minijinja so that the prompt is
//! byte-identical to transformers' `apply_chat_template(..., tokenize=False)`.
//!
//! The environment mirrors transformers' `_compile_jinja_template`: `trim_blocks` and
//! `lstrip_blocks` on, trailing newline dropped, loop controls, `raise_exception(msg)` (an error
//! value, [`TextError::TemplateRaised`]), `strftime_now(fmt)` (local time), a `tojson` that is
//! Python's `json.dumps` ([`pyjson`]), and Python string/dict methods (`.strip()`, `.items()`,
//! `.startswith()`, ...) through minijinja-contrib's pycompat. The render context is theirs too:
//! `messages` (cleaned as in [`value`]), `tools`, `documents`, `add_generation_prompt`, the named
//! special tokens, then caller arguments such as `enable_thinking`, which win over special tokens.

pub mod pyjson;
pub mod value;

use std::collections::BTreeMap;
use std::fmt;

use chrono::format::{Item, StrftimeItems};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};

use crate::error::{Result, TextError};
pub use value::TemplateValue;

/// The name the single template is stored under in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Everything a render call passes to the template besides the special tokens.
#[derive(Clone, Debug, Default)]
pub struct ChatArgs {
    /// The conversation, oldest first: objects with `role`, `content` (a string or a list of
    /// parts), and whatever else the template reads (`tool_calls`, `reasoning_content`, ...).
    pub messages: Vec<TemplateValue>,
    /// Tool schemas (`{"type": "function", "function": {...}}`), or `None` for no tools.
    pub tools: Option<Vec<TemplateValue>>,
    /// Retrieval documents for templates that support them, or `None`.
    pub documents: Option<Vec<TemplateValue>>,
    /// End with the header that opens the assistant's turn.
    pub add_generation_prompt: bool,
    /// Extra template variables (`enable_thinking`, `date_string`, ...). They override special
    /// tokens of the same name, as in transformers.
    pub extra: Vec<(String, TemplateValue)>,
}

impl ChatArgs {
    /// Arguments for `messages` with no tools and no generation prompt.
    pub fn new(messages: Vec<TemplateValue>) -> Self {
        Self {
            messages,
            ..Self::default()
        }
    }
}

/// A compiled chat template plus the special tokens (`bos_token`, `eos_token`, ...) it sees.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(String, String)>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported here, not at render time.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TextError::TemplateSyntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", pyjson::tojson_filter);
        env.add_filter("trim", python_trim);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TextError::TemplateSyntax(describe(&e)))?;
        Ok(Self {
            env,
            special_tokens: Vec::new(),
        })
    }

    /// Sets the named special tokens (`("bos_token", "<s>")`, ...) passed to every render.
    pub fn with_special_tokens(mut self, tokens: Vec<(String, String)>) -> Self {
        self.special_tokens = tokens;
        self
    }

    /// Renders the prompt for `args`.
    pub fn render(&self, args: &ChatArgs) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::TemplateRender(describe(&e)))?;
        let messages = args
            .messages
            .iter()
            .map(value::normalize_message)
            .collect::<Result<Vec<Value>>>()?;
        let list = |items: &Option<Vec<TemplateValue>>| match items {
            Some(items) => Value::from(items.iter().map(|v| v.0.clone()).collect::<Vec<_>>()),
            None => Value::from(()),
        };
        // transformers always passes `tools` and `documents`, as None when absent, so `tools is
        // defined` holds and `tools is none` decides.
        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        context.insert("messages".into(), Value::from(messages));
        context.insert("tools".into(), list(&args.tools));
        context.insert("documents".into(), list(&args.documents));
        context.insert(
            "add_generation_prompt".into(),
            Value::from(args.add_generation_prompt),
        );
        for (name, token) in &self.special_tokens {
            context.insert(name.clone(), Value::from(token.as_str()));
        }
        for (name, value) in &args.extra {
            context.insert(name.clone(), value.0.clone());
        }
        template
            .render(Value::from(context))
            .map_err(|e| match raised_message(&e) {
                Some(message) => TextError::TemplateRaised(message),
                None => TextError::TemplateRender(describe(&e)),
            })
    }
}

/// Marks an error as coming from the template's own `raise_exception`, so that render can tell
/// a refused conversation from a broken template.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn raised_message(error: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(err) = source {
        if let Some(raised) = err.downcast_ref::<Raised>() {
            return Some(raised.0.clone());
        }
        source = err.source();
    }
    None
}

/// `strftime_now(fmt)`: the local time formatted like Python's `datetime.now().strftime(fmt)`.
fn strftime_now(format: String) -> std::result::Result<String, Error> {
    let items: Vec<Item<'_>> = StrftimeItems::new(&format).collect();
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported format {format:?}"),
        ));
    }
    let now = chrono::Local::now();
    let mut out = String::new();
    use std::fmt::Write;
    write!(out, "{}", now.format_with_items(items.into_iter())).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {format:?}"),
        )
    })?;
    Ok(out)
}

/// Prints values as Python's `str()` does where it differs from minijinja: `True`, `False`,
/// `None`. Everything else (strings, numbers, undefined as "") prints as minijinja prints it.
fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(Error::from),
        ValueKind::None => out.write_str("None").map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Jinja2's `trim(chars=None)`, i.e. Python's `str.strip`, whose whitespace also includes the
/// ASCII separators U+001C..U+001F that Rust's `char::is_whitespace` leaves out.
fn python_trim(value: &str, chars: Option<&str>) -> String {
    match chars {
        Some(chars) => value.trim_matches(|c| chars.contains(c)).to_string(),
        None => value
            .trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
            .to_string(),
    }
}

/// One line with minijinja's message and, where known, the template line.
fn describe(error: &Error) -> String {
    match error.line() {
        Some(line) => format!("{error} (template line {line})"),
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, args: &ChatArgs) -> Result<String> {
        ChatTemplate::new(source)?.render(args)
    }

    fn user(text: &str) -> Vec<TemplateValue> {
        vec![TemplateValue::message("user", text)]
    }

    #[test]
    fn raise_exception_becomes_a_typed_error_with_the_templates_message() {
        let err = render(
            "{{ raise_exception('roles must alternate') }}",
            &ChatArgs::new(user("x")),
        )
        .unwrap_err();
        assert!(matches!(err, TextError::TemplateRaised(ref m) if m == "roles must alternate"));
    }

    #[test]
    fn a_syntax_error_is_reported_when_compiling() {
        let err = ChatTemplate::new("{% for m in messages %}").unwrap_err();
        assert!(matches!(err, TextError::TemplateSyntax(_)));
    }

    #[test]
    fn python_string_and_dict_methods_work() {
        let source = "{{ messages[0].content.strip().startswith('a') }}|{% for k, v in messages[0].items() %}{{ k }};{% endfor %}";
        let out = render(source, &ChatArgs::new(user("  abc "))).unwrap();
        assert_eq!(out, "True|role;content;");
    }

    #[test]
    fn tools_are_defined_as_none_when_absent() {
        let source = "{{ tools is defined }} {{ tools is none }} {{ documents }}";
        assert_eq!(
            render(source, &ChatArgs::new(user("x"))).unwrap(),
            "True True None"
        );
    }

    #[test]
    fn extra_arguments_override_special_tokens() {
        let template = ChatTemplate::new("{{ bos_token }}{{ enable_thinking is false }}")
            .unwrap()
            .with_special_tokens(vec![("bos_token".into(), "<s>".into())]);
        let mut args = ChatArgs::new(user("x"));
        args.extra.push(("enable_thinking".into(), false.into()));
        assert_eq!(template.render(&args).unwrap(), "<s>True");
        args.extra.push(("bos_token".into(), "<B>".into()));
        assert_eq!(template.render(&args).unwrap(), "<B>True");
    }

    #[test]
    fn strftime_now_formats_the_current_date() {
        let out = render("{{ strftime_now('%Y-%m-%d') }}", &ChatArgs::new(user("x"))).unwrap();
        assert_eq!(out.len(), 10);
        assert!(out.chars().filter(|c| *c == '-').count() == 2);
        let err = render("{{ strftime_now('%Q') }}", &ChatArgs::new(user("x"))).unwrap_err();
        assert!(matches!(err, TextError::TemplateRender(_)));
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_configures_jinja() {
        let source =
            "{% for m in messages %}\n  {% if true %}\n{{ m.role }}\n  {% endif %}\n{% endfor %}\n";
        assert_eq!(render(source, &ChatArgs::new(user("x"))).unwrap(), "user\n");
    }

    #[test]
    fn loop_controls_are_available() {
        let source =
            "{% for m in [1, 2, 3] %}{% if m == 2 %}{% break %}{% endif %}{{ m }}{% endfor %}";
        assert_eq!(render(source, &ChatArgs::new(user("x"))).unwrap(), "1");
    }
}
