//! The Rust tokenizer must give the ids and texts that Python `tokenizers`/transformers give for
//! the same `tokenizer.json` (goldens written by tools/tokenizers/make_tokenizers.py).

mod common;

use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    vocab_size: usize,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    ids_with_special: Vec<u32>,
    decoded: String,
    decoded_skip_special: String,
}

fn goldens() -> std::collections::BTreeMap<String, Golden> {
    let path = common::repo_root().join("tests/tokenizers/goldens.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn every_committed_tokenizer_encodes_and_decodes_like_python() {
    let goldens = goldens();
    assert_eq!(goldens.len(), common::TOKENIZERS.len());
    for name in common::TOKENIZERS {
        let golden = &goldens[name];
        let tok = common::tokenizer(name);
        assert_eq!(tok.vocab_size(), golden.vocab_size, "{name}: vocab size");
        for case in &golden.cases {
            let what = format!("{name}: {:?}", case.text);
            assert_eq!(
                tok.encode(&case.text, false).unwrap(),
                case.ids,
                "{what} ids"
            );
            assert_eq!(
                tok.encode(&case.text, true).unwrap(),
                case.ids_with_special,
                "{what} ids with special tokens"
            );
            assert_eq!(
                tok.decode(&case.ids_with_special, false).unwrap(),
                case.decoded,
                "{what} decode"
            );
            assert_eq!(
                tok.decode(&case.ids_with_special, true).unwrap(),
                case.decoded_skip_special,
                "{what} decode skipping special tokens"
            );
        }
    }
}

#[test]
fn special_token_ids_come_from_the_tokenizer_config() {
    let smol = common::tokenizer("smollm2-135m-instruct");
    assert_eq!(smol.bos_token_id(), Some(1)); // <|im_start|>
    assert_eq!(smol.eos_token_id(), Some(2)); // <|im_end|>
    assert!(smol.is_special(0) && smol.is_special(2));

    let qwen = common::tokenizer("qwen3");
    assert_eq!(qwen.bos_token_id(), None); // Qwen has no BOS
    assert_eq!(qwen.eos_token_id(), Some(151645));
    assert_eq!(qwen.pad_token_id(), Some(151643));
    assert_eq!(qwen.token_to_id("<think>"), Some(151667));
    assert!(
        !qwen.is_special(151667),
        "<think> is an added but not special token in Qwen3"
    );
    assert_eq!(qwen.special_token_ids().len(), 14);

    let gemma = common::tokenizer("gemma3-270m");
    assert_eq!(gemma.bos_token_id(), Some(2));
    assert_eq!(gemma.eos_token_id(), Some(1));
    assert_eq!(gemma.id_to_token(2).as_deref(), Some("<bos>"));
}

#[test]
fn byte_fallback_and_byte_level_tokens_are_visible_by_name() {
    let gemma = common::tokenizer("gemma3-270m");
    let byte = gemma.token_to_id("<0xF0>").unwrap();
    assert_eq!(gemma.decode(&[byte], false).unwrap(), "\u{FFFD}");
    let smol = common::tokenizer("smollm2-135m-instruct");
    let ids = smol.encode(" the", false).unwrap();
    assert_eq!(smol.id_to_token(ids[0]).as_deref(), Some("Ġthe"));
}

#[test]
fn ids_outside_the_vocabulary_decode_to_nothing_as_in_hugging_face() {
    // Python: Tokenizer.from_file(smollm2).decode([28, 50000, 29]) == ",-"
    let smol = common::tokenizer("smollm2-135m-instruct");
    assert_eq!(smol.decode(&[28, 50000, 29], false).unwrap(), ",-");
    let mut stream = smol.decode_stream(false);
    let mut text = String::new();
    for id in [28, 50000, 29] {
        text.extend(stream.step(id).unwrap());
    }
    text.extend(stream.finish().unwrap());
    assert_eq!(text, ",-");
}
