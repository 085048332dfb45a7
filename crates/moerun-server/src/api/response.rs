//! Response bodies of the two generation endpoints, whole and streamed, in OpenAI's shapes:
//! `chat.completion` / `chat.completion.chunk` and `text_completion`, with `usage` and logprobs
//! in the form each endpoint uses (chat: `logprobs.content[]`; completions: parallel arrays).

use serde_json::{json, Map, Value};

use super::request::Endpoint;
use crate::engine::{FinishReason, TokenLogprobs, Usage};

/// What every body of one request shares.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Whether logprobs were asked for (then the field is an object, else `null`).
    pub logprobs: bool,
}

/// `usage` as OpenAI writes it.
pub fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// Logprobs of a run of tokens. `text_offset` starts at `offset` (completions only).
pub fn logprobs_json(endpoint: Endpoint, tokens: &[TokenLogprobs], offset: usize) -> Value {
    match endpoint {
        Endpoint::Chat => {
            let entry = |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
            let content: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    let mut e = entry(&t.token, t.logprob);
                    let top: Vec<Value> = t.top.iter().map(|(s, lp)| entry(s, *lp)).collect();
                    e["top_logprobs"] = Value::Array(top);
                    e
                })
                .collect();
            json!({ "content": content })
        }
        Endpoint::Completion => {
            let mut offsets = Vec::with_capacity(tokens.len());
            let mut at = offset;
            for t in tokens {
                offsets.push(at);
                at += t.token.len();
            }
            let top: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    let map: Map<String, Value> =
                        t.top.iter().map(|(s, lp)| (s.clone(), json!(lp))).collect();
                    Value::Object(map)
                })
                .collect();
            json!({
                "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
                "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                "top_logprobs": top,
                "text_offset": offsets,
            })
        }
    }
}

/// The whole (non-streamed) response.
pub fn full_response(
    meta: &ResponseMeta,
    text: &str,
    logprobs: &[TokenLogprobs],
    reason: FinishReason,
    usage: Usage,
) -> Value {
    let logprobs = if meta.logprobs {
        logprobs_json(meta.endpoint, logprobs, 0)
    } else {
        Value::Null
    };
    let (object, choice) = match meta.endpoint {
        Endpoint::Chat => (
            "chat.completion",
            json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": reason.as_str(),
            }),
        ),
        Endpoint::Completion => (
            "text_completion",
            json!({
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": reason.as_str(),
            }),
        ),
    };
    json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage_json(usage),
    })
}

/// One streamed chunk with one choice.
pub struct Chunk<'a> {
    /// New text (chat: `delta.content`; completions: `text`).
    pub text: &'a str,
    /// Chat's opening chunk carries `delta.role`.
    pub role: bool,
    /// The logprobs of the tokens behind `text`, already in the endpoint's shape.
    pub logprobs: Option<Value>,
    /// Set on the last chunk of the choice.
    pub finish_reason: Option<FinishReason>,
    /// Usage so far, when continuous usage stats were asked for.
    pub usage: Option<Usage>,
}

/// A streamed chunk's JSON.
pub fn chunk_json(meta: &ResponseMeta, c: &Chunk) -> Value {
    let logprobs = c.logprobs.clone().unwrap_or(Value::Null);
    let finish = c.finish_reason.map(FinishReason::as_str);
    let (object, choice) = match meta.endpoint {
        Endpoint::Chat => {
            let mut delta = Map::new();
            if c.role {
                delta.insert("role".into(), json!("assistant"));
            }
            if c.role || !c.text.is_empty() || c.finish_reason.is_none() {
                delta.insert("content".into(), json!(c.text));
            }
            (
                "chat.completion.chunk",
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}),
            )
        }
        Endpoint::Completion => (
            "text_completion",
            json!({"index": 0, "text": c.text, "logprobs": logprobs, "finish_reason": finish}),
        ),
    };
    let mut body = json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    });
    if let Some(u) = c.usage {
        body["usage"] = usage_json(u);
    }
    body
}

/// The final chunk of `stream_options.include_usage`: no choices, only the usage.
pub fn usage_chunk_json(meta: &ResponseMeta, usage: Usage) -> Value {
    let object = match meta.endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completion => "text_completion",
    };
    json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage_json(usage),
    })
}
