//! Shared by the server's integration tests: a server over the committed chat fixture on a free
//! loopback port, a client runtime, and the fixture's transformers references.

#![allow(dead_code)] // each test binary uses its own subset

use std::net::SocketAddr;
use std::path::PathBuf;

use moerun_server::client::HttpClient;
use moerun_server::{ServedModel, Server, ServerOptions};
use serde_json::{json, Value};

/// The served model name in every test.
pub const MODEL: &str = "fixture";

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures_text/qwen3_moe_chat")
}

/// Options for a test server: loopback, any free port.
pub fn options() -> ServerOptions {
    ServerOptions {
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..ServerOptions::default()
    }
}

/// A server over the chat fixture.
pub fn start(options: ServerOptions) -> Server {
    let model = ServedModel::load(&fixture_dir(), MODEL.into()).expect("fixture loads");
    Server::start(model, &options).expect("server starts")
}

/// A runtime for the test's client side.
pub fn runtime() -> tokio::runtime::Runtime {
    moerun_server::bench::runtime().expect("runtime")
}

/// One case of `text_reference.json`: the prompt and transformers' greedy continuation.
pub struct Reference {
    pub kind: String,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub text: String,
}

pub fn references() -> Vec<Reference> {
    let text = std::fs::read_to_string(fixture_dir().join("text_reference.json")).unwrap();
    let json: Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Reference {
            kind: c["kind"].as_str().unwrap().to_string(),
            prompt: c["prompt"].as_str().unwrap().to_string(),
            prompt_ids: ids(&c["prompt_ids"]),
            greedy_ids: ids(&c["greedy_ids"]),
            text: c["text"].as_str().unwrap().to_string(),
        })
        .collect()
}

/// A greedy completion request for token ids.
pub fn completion(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// What a streamed response added up to.
#[derive(Debug, Default, PartialEq)]
pub struct Streamed {
    pub text: String,
    pub finish_reason: Option<String>,
    pub usage: Option<Value>,
    pub done: bool,
    pub errors: Vec<Value>,
    pub chunks: usize,
}

/// Stream `body` to `path` and add the chunks up (chat deltas or completion text).
pub async fn stream(client: &HttpClient, path: &str, body: &Value) -> (u16, Streamed) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let mut s = Streamed::default();
    let reply = client
        .post_stream(path, &body, |data| {
            assert!(!s.done, "data after [DONE]: {data}");
            if data == "[DONE]" {
                s.done = true;
                return true;
            }
            let chunk: Value = serde_json::from_str(data).expect("chunk is JSON");
            if chunk.get("error").is_some() {
                s.errors.push(chunk);
                return true;
            }
            s.chunks += 1;
            if !chunk["usage"].is_null() {
                s.usage = Some(chunk["usage"].clone());
            }
            if let Some(choice) = chunk["choices"].get(0) {
                let piece = choice["delta"]["content"]
                    .as_str()
                    .or(choice["text"].as_str())
                    .unwrap_or("");
                s.text.push_str(piece);
                if let Some(r) = choice["finish_reason"].as_str() {
                    assert!(s.finish_reason.is_none(), "two finish reasons");
                    s.finish_reason = Some(r.to_string());
                }
            }
            true
        })
        .await
        .expect("stream answered");
    (reply.status, s)
}

/// The text of a whole (non-streamed) response of either endpoint.
pub fn text_of(json: &Value) -> String {
    let choice = &json["choices"][0];
    choice["message"]["content"]
        .as_str()
        .or(choice["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {json}"))
        .to_string()
}

/// A metric's value from a `/metrics` text (first sample whose line starts with `prefix`).
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {prefix} in:\n{text}"))
}
