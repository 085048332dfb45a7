//! The two generation endpoints' request bodies, validated into one [`ParsedRequest`]. Only
//! parameters this server implements are accepted; a known parameter with a value it cannot honour
//! (`n: 2`, `echo: true`, tools) and any unknown parameter get a 400 naming the parameter.

use serde_json::Value;

use super::fields::{as_integer, type_name, Fields};
use crate::error::ApiError;

/// Which endpoint a request came to; decides the response shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// The input to generate after, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Chat messages (each an object with at least a string `role`), rendered by the model's
    /// chat template with these extra template variables.
    Chat {
        messages: Vec<Value>,
        template_kwargs: Vec<(String, Value)>,
    },
    /// Completion text, tokenized with the tokenizer's special tokens.
    Text(String),
    /// Completion prompt given as token ids.
    Tokens(Vec<u32>),
}

/// Sampling fields the request set; the rest come from the model's generation config.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
}

/// A validated generation request of either endpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub prompt: Prompt,
    /// Most tokens to generate, if the client said, and which field said it (for errors).
    pub max_tokens: Option<(usize, &'static str)>,
    pub sampling: SamplingOverrides,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Report logprobs with this many alternatives (0: only the chosen token's).
    pub logprobs: Option<usize>,
    pub stream: bool,
    /// `stream_options.include_usage`: a final chunk with the usage.
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats` (vLLM): usage in every chunk, and one chunk per
    /// generated token even while its text is still held back.
    pub continuous_usage: bool,
}

/// Most stop strings one request may give.
const MAX_STOP_STRINGS: usize = 16;
/// Most alternatives `top_logprobs` / completions' `logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Parse and validate a request body for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let mut f = Fields::parse(body)?;
    let model = match f.require("model")? {
        Value::String(s) => s,
        _ => return Err(ApiError::wrong_type("model", "a string")),
    };
    let prompt = match endpoint {
        Endpoint::Chat => parse_chat_prompt(&mut f)?,
        Endpoint::Completion => parse_completion_prompt(&mut f)?,
    };
    let max_tokens = parse_max_tokens(&mut f, endpoint)?;
    let sampling = parse_sampling(&mut f)?;
    let stop = parse_stop(&mut f)?;
    let stop_token_ids = parse_token_list(&mut f, "stop_token_ids")?.unwrap_or_default();
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let logprobs = parse_logprobs(&mut f, endpoint)?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let (mut include_usage, mut continuous_usage) = (false, false);
    if let Some(mut options) = f.object("stream_options")? {
        if !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "invalid_value",
                "'stream_options' is only allowed when 'stream' is true",
            ));
        }
        include_usage = options.bool("include_usage")?.unwrap_or(false);
        continuous_usage = options.bool("continuous_usage_stats")?.unwrap_or(false);
        options.finish("stream_options.")?;
    }
    refuse_unsupported(&mut f, endpoint)?;
    f.finish("")?;
    Ok(ParsedRequest {
        endpoint,
        model,
        prompt,
        max_tokens,
        sampling,
        stop,
        stop_token_ids,
        ignore_eos,
        logprobs,
        stream,
        include_usage,
        continuous_usage,
    })
}

fn parse_chat_prompt(f: &mut Fields) -> Result<Prompt, ApiError> {
    let Value::Array(items) = f.require("messages")? else {
        return Err(ApiError::wrong_type("messages", "an array of messages"));
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "invalid_value",
            "'messages' must hold at least one message",
        ));
    }
    let messages = items
        .into_iter()
        .enumerate()
        .map(|(i, m)| normalize_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let mut template_kwargs = Vec::new();
    if let Some(mut kwargs) = f.object("chat_template_kwargs")? {
        for name in kwargs.keys() {
            if let Some(v) = kwargs.take(&name) {
                template_kwargs.push((name, v));
            }
        }
    }
    if f.bool("add_generation_prompt")? == Some(false) {
        return Err(ApiError::unsupported(
            "add_generation_prompt",
            "'add_generation_prompt' must be true: the reply is always a new assistant turn",
        ));
    }
    Ok(Prompt::Chat {
        messages,
        template_kwargs,
    })
}

/// Check one message and flatten a list of text parts into one string, as the templates of
/// text-only models expect.
fn normalize_message(i: usize, message: Value) -> Result<Value, ApiError> {
    let at = |field: &str| format!("messages[{i}]{field}");
    let Value::Object(mut map) = message else {
        return Err(ApiError::wrong_type(&at(""), "an object"));
    };
    match map.get("role") {
        Some(Value::String(_)) => {}
        None => {
            return Err(ApiError::invalid(
                &at(".role"),
                "missing_required_parameter",
                format!("'{}' is required", at(".role")),
            ))
        }
        Some(_) => return Err(ApiError::wrong_type(&at(".role"), "a string")),
    }
    let content = match map.remove("content") {
        None | Some(Value::Null) => Value::Null,
        Some(Value::String(s)) => Value::String(s),
        Some(Value::Array(parts)) => {
            let mut text = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let field = at(&format!(".content[{j}]"));
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push(t.to_string()),
                    (Some("text"), None) => {
                        return Err(ApiError::wrong_type(&format!("{field}.text"), "a string"))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::unsupported(
                            &format!("{field}.type"),
                            format!("content parts of type '{other}' are not supported"),
                        ))
                    }
                    (None, _) => return Err(ApiError::wrong_type(&field, "a text part")),
                }
            }
            Value::String(text.join("\n"))
        }
        Some(other) => {
            return Err(ApiError::wrong_type(
                &at(".content"),
                &format!(
                    "a string or an array of text parts, not {}",
                    type_name(&other)
                ),
            ))
        }
    };
    map.insert("content".into(), content);
    Ok(Value::Object(map))
}

fn parse_completion_prompt(f: &mut Fields) -> Result<Prompt, ApiError> {
    let prompt = f.require("prompt")?;
    let multi = || {
        ApiError::unsupported(
            "prompt",
            "a list of several prompts is not supported; send one request per prompt",
        )
    };
    let prompt = match prompt {
        Value::String(s) => Prompt::Text(s),
        Value::Array(items) => match items.first() {
            None => {
                return Err(ApiError::invalid(
                    "prompt",
                    "invalid_value",
                    "'prompt' is empty",
                ))
            }
            Some(Value::String(_)) | Some(Value::Array(_)) if items.len() > 1 => {
                return Err(multi())
            }
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            Some(Value::Array(ids)) => Prompt::Tokens(token_ids("prompt", ids)?),
            Some(_) => Prompt::Tokens(token_ids("prompt", &items)?),
        },
        _ => {
            return Err(ApiError::wrong_type(
                "prompt",
                "a string or an array of token ids",
            ))
        }
    };
    match &prompt {
        Prompt::Text(s) if s.is_empty() => Err(ApiError::invalid(
            "prompt",
            "invalid_value",
            "'prompt' is empty",
        )),
        Prompt::Tokens(ids) if ids.is_empty() => Err(ApiError::invalid(
            "prompt",
            "invalid_value",
            "'prompt' is empty",
        )),
        _ => Ok(prompt),
    }
}

fn token_ids(param: &str, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            as_integer(v)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| ApiError::wrong_type(param, "an array of token ids (integers >= 0)"))
        })
        .collect()
}

fn parse_token_list(f: &mut Fields, name: &str) -> Result<Option<Vec<u32>>, ApiError> {
    match f.take(name) {
        None => Ok(None),
        Some(Value::Array(items)) => token_ids(name, &items).map(Some),
        Some(_) => Err(ApiError::wrong_type(name, "an array of token ids")),
    }
}

fn parse_max_tokens(
    f: &mut Fields,
    endpoint: Endpoint,
) -> Result<Option<(usize, &'static str)>, ApiError> {
    let mut read = |name: &'static str| -> Result<Option<(usize, &'static str)>, ApiError> {
        let Some(v) = f.take(name) else {
            return Ok(None);
        };
        let n = as_integer(&v).ok_or_else(|| ApiError::wrong_type(name, "an integer"))?;
        if n < 1 {
            return Err(ApiError::invalid(
                name,
                "invalid_value",
                format!("'{name}' must be at least 1, got {n}"),
            ));
        }
        Ok(Some((usize::try_from(n).unwrap_or(usize::MAX), name)))
    };
    let max_tokens = read("max_tokens")?;
    if endpoint == Endpoint::Chat {
        // The newer name wins when both are given, as in OpenAI's API.
        if let Some(n) = read("max_completion_tokens")? {
            return Ok(Some(n));
        }
    }
    Ok(max_tokens)
}

fn parse_sampling(f: &mut Fields) -> Result<SamplingOverrides, ApiError> {
    let top_k = f.integer("top_k", (-1, i64::from(i32::MAX)))?;
    let seed = f.integer("seed", (i64::MIN, i64::MAX))?;
    Ok(SamplingOverrides {
        temperature: f.number("temperature", (0.0, 1.0e6))?,
        top_p: f.number("top_p", (0.0, 1.0))?,
        top_k: top_k.map(|k| k as i32),
        min_p: f.number("min_p", (0.0, 1.0))?,
        repetition_penalty: f.number("repetition_penalty", (0.0, 1.0e6))?,
        presence_penalty: f.number("presence_penalty", (-2.0, 2.0))?,
        frequency_penalty: f.number("frequency_penalty", (-2.0, 2.0))?,
        // Negative seeds are fine for OpenAI; any i64 names one generator.
        seed: seed.map(|s| s as u64),
    })
}

fn parse_stop(f: &mut Fields) -> Result<Vec<String>, ApiError> {
    let stops = match f.take("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(ApiError::wrong_type(
                    "stop",
                    "a string or an array of strings",
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::wrong_type(
                "stop",
                "a string or an array of strings",
            ))
        }
    };
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            "invalid_value",
            format!("at most {MAX_STOP_STRINGS} stop strings are allowed"),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "invalid_value",
            "stop strings must not be empty",
        ));
    }
    Ok(stops)
}

fn parse_logprobs(f: &mut Fields, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    match endpoint {
        Endpoint::Chat => {
            let wanted = f.bool("logprobs")?.unwrap_or(false);
            let top = f.integer("top_logprobs", (0, MAX_TOP_LOGPROBS))?;
            match (wanted, top) {
                (false, Some(_)) => Err(ApiError::invalid(
                    "top_logprobs",
                    "invalid_value",
                    "'top_logprobs' requires 'logprobs' to be true",
                )),
                (false, None) => Ok(None),
                (true, top) => Ok(Some(top.unwrap_or(0) as usize)),
            }
        }
        Endpoint::Completion => Ok(f
            .integer("logprobs", (0, MAX_TOP_LOGPROBS))?
            .map(|n| n as usize)),
    }
}

/// Parameters with a value this server cannot honour, and those it ignores on purpose.
fn refuse_unsupported(f: &mut Fields, endpoint: Endpoint) -> Result<(), ApiError> {
    if let Some(n) = f.integer("n", (i64::MIN, i64::MAX))? {
        if n != 1 {
            return Err(ApiError::unsupported(
                "n",
                format!("only n = 1 is supported, got {n}"),
            ));
        }
    }
    // `user` identifies the end user to the provider; it changes nothing in generation.
    f.string("user")?;
    if let Some(bias) = f.take("logit_bias") {
        if bias.as_object().is_none_or(|m| !m.is_empty()) {
            return Err(ApiError::unsupported(
                "logit_bias",
                "'logit_bias' is not supported",
            ));
        }
    }
    match endpoint {
        Endpoint::Chat => {
            if let Some(tools) = f.take("tools") {
                if tools.as_array().is_none_or(|t| !t.is_empty()) {
                    return Err(ApiError::unsupported(
                        "tools",
                        "tool calling is not supported",
                    ));
                }
            }
            if let Some(choice) = f.take("tool_choice") {
                if choice != "none" {
                    return Err(ApiError::unsupported(
                        "tool_choice",
                        "tool calling is not supported; only 'none' is accepted",
                    ));
                }
            }
            f.bool("parallel_tool_calls")?;
            if let Some(format) = f.take("response_format") {
                if format.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(ApiError::unsupported(
                        "response_format",
                        "only response_format {\"type\": \"text\"} is supported",
                    ));
                }
            }
        }
        Endpoint::Completion => {
            if f.bool("echo")? == Some(true) {
                return Err(ApiError::unsupported("echo", "'echo' is not supported"));
            }
            if f.string("suffix")?.is_some() {
                return Err(ApiError::unsupported("suffix", "'suffix' is not supported"));
            }
            if let Some(b) = f.integer("best_of", (i64::MIN, i64::MAX))? {
                if b != 1 {
                    return Err(ApiError::unsupported(
                        "best_of",
                        format!("only best_of = 1 is supported, got {b}"),
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_json(endpoint: Endpoint, body: Value) -> Result<ParsedRequest, ApiError> {
        parse(endpoint, body.to_string().as_bytes())
    }

    #[test]
    fn a_completion_prompt_may_be_text_token_ids_or_a_list_of_one() {
        let prompt = |p: Value| {
            parse_json(Endpoint::Completion, json!({"model": "m", "prompt": p})).map(|r| r.prompt)
        };
        assert_eq!(prompt(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(prompt(json!([1, 2])).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(prompt(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(prompt(json!([[3]])).unwrap(), Prompt::Tokens(vec![3]));
        for bad in [
            json!([]),
            json!(""),
            json!([1, -2]),
            json!([[1], [2]]),
            json!(3),
        ] {
            assert_eq!(prompt(bad).unwrap_err().param.as_deref(), Some("prompt"));
        }
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens_in_chat() {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "max_tokens": 5, "max_completion_tokens": 7});
        let r = parse_json(Endpoint::Chat, body).unwrap();
        assert_eq!(r.max_tokens, Some((7, "max_completion_tokens")));
    }

    #[test]
    fn text_parts_are_joined_and_nulls_count_as_absent() {
        let body = json!({"model": "m", "temperature": null, "messages": [{"role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        let r = parse_json(Endpoint::Chat, body).unwrap();
        assert_eq!(r.sampling.temperature, None);
        let Prompt::Chat { messages, .. } = r.prompt else {
            panic!("chat prompt expected");
        };
        assert_eq!(messages[0]["content"], "a\nb");
    }

    #[test]
    fn whole_floats_count_as_integers_and_fractions_do_not() {
        let ok = json!({"model": "m", "prompt": "x", "max_tokens": 3.0});
        assert_eq!(
            parse_json(Endpoint::Completion, ok).unwrap().max_tokens,
            Some((3, "max_tokens"))
        );
        let bad = json!({"model": "m", "prompt": "x", "max_tokens": 3.5});
        let e = parse_json(Endpoint::Completion, bad).unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("max_tokens"), Some("invalid_type"))
        );
    }

    #[test]
    fn unknown_stream_options_are_named_with_their_path() {
        let body = json!({"model": "m", "prompt": "x", "stream": true,
                          "stream_options": {"include_usage": true, "color": "red"}});
        let e = parse_json(Endpoint::Completion, body).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options.color"));
    }
}
