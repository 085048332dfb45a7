//! Serving a model with sliding-window layers (the gemma4_dense_defaults_f32 fixture: window 9,
//! 50-token prompt): the KV cache keeps those layers in a window group whose blocks each request
//! gives back as they leave its window, and greedy continuations still equal transformers', alone
//! and among others, with prefill chunked across steps.

mod common;

use std::path::PathBuf;

use common::{completion, metric, options, runtime, text_of, MODEL};
use futures_util::future::join_all;
use moerun_server::client::HttpClient;
use moerun_server::{ServedModel, Server, ServerOptions};
use moerun_text::Tokenizer;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// The fixture's weights with the chat fixture's tokenizer (its ids cover the fixture's).
fn windowed_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moerun-window-serve-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "reference.json"] {
        let from = repo("tests/fixtures/gemma4_dense_defaults_f32").join(f);
        std::fs::copy(from, dir.join(f)).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let from = repo("tests/fixtures_text/qwen3_moe_chat").join(f);
        std::fs::copy(from, dir.join(f)).unwrap();
    }
    dir
}

#[test]
fn greedy_matches_transformers_with_a_bounded_window_group() {
    let dir = windowed_dir();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids = |key: &str| -> Vec<u32> {
        let list = reference[key].as_array().unwrap();
        list.iter().map(|v| v.as_u64().unwrap() as u32).collect()
    };
    let (prompt, greedy) = (ids("tokens"), ids("greedy"));
    let want = Tokenizer::from_dir(&dir)
        .unwrap()
        .decode(&greedy, true)
        .unwrap();
    let model = ServedModel::load(&dir, MODEL.into()).expect("fixture loads");
    let server = Server::start(
        model,
        &ServerOptions {
            max_num_batched_tokens: 16,
            max_num_seqs: 8,
            max_model_len: Some(128),
            ..options()
        },
    )
    .expect("server starts");
    let window = server.scheduler.kv_window.expect("a window group");
    assert_eq!(window.window, 9);
    // Each request holds at most its window plus a 16-token chunk: 8 of them need far fewer
    // window blocks than full-length tables would.
    assert!(window.num_blocks * 2 < server.scheduler.num_blocks);

    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let alone = rt
        .block_on(client.post_json("/v1/completions", &completion(&prompt, greedy.len())))
        .unwrap();
    assert_eq!(alone.status, 200, "{}", alone.json());
    assert_eq!(text_of(&alone.json()), want, "lone request differs");
    let replies = rt.block_on(join_all((0..9).map(|i| {
        let client = client.clone();
        // Request 0 is the reference prompt; the others are shifted prompts of other lengths.
        let p: Vec<u32> = match i {
            0 => prompt.clone(),
            _ => prompt[i..prompt.len() - 2 * i].to_vec(),
        };
        let body = completion(&p, greedy.len());
        async move { client.post_json("/v1/completions", &body).await.unwrap() }
    })));
    assert!(replies.iter().all(|r| r.status == 200));
    assert_eq!(
        text_of(&replies[0].json()),
        want,
        "batched request differs from transformers"
    );
    // Every window block is back once the requests are done.
    let metrics = String::from_utf8(rt.block_on(client.get("/metrics")).unwrap().body).unwrap();
    let total = metric(&metrics, "moerun_kv_cache_window_blocks_total");
    assert_eq!(total, window.num_blocks as f64);
    assert_eq!(metric(&metrics, "moerun_kv_cache_window_blocks_used"), 0.0);
}
