//! Serving a hybrid model (Qwen3.5's Gated DeltaNet layers beside full attention): each request's
//! linear-attention state lives in its own slot, so greedy continuations equal transformers'
//! and do not change when sixteen requests share the batch, even with chunked prefill.

mod common;

use std::path::{Path, PathBuf};

use common::{completion, options, runtime, text_of, MODEL};
use futures_util::future::join_all;
use moerun_server::client::HttpClient;
use moerun_server::{ServedModel, Server, ServerOptions};
use moerun_text::Tokenizer;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// The qwen3_5_moe_text_f32 fixture's weights with the chat fixture's tokenizer (ids < 256 only:
/// prompts are sent as token ids).
fn hybrid_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moerun-hybrid-serve-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "reference.json"] {
        std::fs::copy(
            repo("tests/fixtures/qwen3_5_moe_text_f32").join(f),
            dir.join(f),
        )
        .unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            repo("tests/fixtures_text/qwen3_moe_chat").join(f),
            dir.join(f),
        )
        .unwrap();
    }
    dir
}

fn start(dir: &Path, options: ServerOptions) -> Server {
    let model = ServedModel::load(dir, MODEL.into()).expect("hybrid fixture loads");
    Server::start(model, &options).expect("server starts")
}

#[test]
fn hybrid_greedy_matches_transformers_alone_and_among_sixteen_others() {
    let dir = hybrid_dir();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids = |key: &str| -> Vec<u32> {
        reference[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, greedy) = (ids("tokens"), ids("greedy"));
    let want = Tokenizer::from_dir(&dir)
        .unwrap()
        .decode(&greedy, true)
        .unwrap();
    // A small token budget forces chunked prefill across steps.
    let server = start(
        &dir,
        ServerOptions {
            max_num_batched_tokens: 48,
            max_num_seqs: 16,
            ..options()
        },
    );
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let alone = rt
        .block_on(client.post_json("/v1/completions", &completion(&prompt, greedy.len())))
        .unwrap();
    assert_eq!(alone.status, 200);
    assert_eq!(
        text_of(&alone.json()),
        want,
        "lone request differs from transformers"
    );
    let n_new = greedy.len();
    let replies = rt.block_on(join_all((0..17).map(|i| {
        let client = client.clone();
        // Request 0 is the reference prompt; the others are shifted prompts of other lengths.
        let p: Vec<u32> = if i == 0 {
            prompt.clone()
        } else {
            prompt[i..prompt.len() - 3 * i].to_vec()
        };
        async move {
            client
                .post_json("/v1/completions", &completion(&p, n_new))
                .await
                .unwrap()
        }
    })));
    assert!(replies.iter().all(|r| r.status == 200));
    assert_eq!(
        text_of(&replies[0].json()),
        want,
        "batched request differs from transformers"
    );
}
