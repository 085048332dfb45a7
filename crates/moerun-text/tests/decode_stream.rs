//! Streaming detokenization on real vocabularies: byte-level BPE (SmolLM2, Qwen3) and
//! SentencePiece-style BPE with `▁` and byte fallback (Gemma 3). Token by token, every delta
//! must be valid text without U+FFFD, and the deltas must add up to the full decode.

mod common;

use moerun_text::Tokenizer;

const TEXTS: [&str; 12] = [
    "Hello, world! This is a streaming test.",
    "Caf\u{e9} na\u{ef}ve r\u{e9}sum\u{e9} \u{fc}ber \u{153}uvre",
    "\u{65e5}\u{672c}\u{8a9e}\u{306e}\u{6587}\u{7ae0}\u{3001}\u{4e2d}\u{6587}\u{53e5}\u{5b50}\u{3002}",
    "emoji \u{1F600}\u{1F680} family \u{1F468}\u{200D}\u{1F469}\u{200D}\u{1F467} flag \u{1F1EF}\u{1F1F5}",
    // Rare emoji: no vocabulary here has them whole, so each is split over byte tokens.
    "\u{1F9CC}\u{1FAE0}\u{1FAE1} troll, melting face, saluting face",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "a\u{301}e\u{301} combining marks",
    "\u{41f}\u{440}\u{438}\u{432}\u{435}\u{442}, \u{43c}\u{438}\u{440}! \u{645}\u{631}\u{62d}\u{628}\u{627}",
    "def f(x):\n    return x ** 2  # \u{2192} square\n",
    "<|im_start|>user\nhi \u{1F44B}<|im_end|>\n<|im_start|>assistant\n",
    "1234567890 3.14159 -42 1e-9",
    "\u{fffd} a literal replacement character in the text",
];

/// Streams `ids` and checks the invariants; returns the deltas.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<String> {
    let mut stream = tok.decode_stream(skip_special_tokens);
    let mut deltas = Vec::new();
    for &id in ids {
        if let Some(delta) = stream.step(id).unwrap() {
            deltas.push(delta);
        }
    }
    deltas.extend(stream.finish().unwrap());
    let full = tok.decode(ids, skip_special_tokens).unwrap();
    assert_eq!(
        deltas.concat(),
        full,
        "deltas must add up to the full decode"
    );
    deltas
}

#[test]
fn streamed_deltas_add_up_to_the_full_decode_on_every_tokenizer() {
    for name in common::TOKENIZERS {
        let tok = common::tokenizer(name);
        for text in TEXTS {
            let ids = tok.encode(text, true).unwrap();
            for skip in [false, true] {
                let deltas = stream(tok, &ids, skip);
                let literal_fffd = text.contains('\u{fffd}');
                for delta in &deltas {
                    assert!(
                        literal_fffd || !delta.contains('\u{fffd}'),
                        "{name}: delta {delta:?} of {text:?} holds a broken character"
                    );
                }
            }
        }
    }
}

#[test]
fn an_emoji_split_over_byte_tokens_is_streamed_as_one_character() {
    for name in common::TOKENIZERS {
        let tok = common::tokenizer(name);
        let text = "\u{1F9CC}";
        let ids = tok.encode(text, false).unwrap();
        // The point of the test: no single token of this emoji decodes to text on its own.
        assert!(ids.len() >= 2, "{name}: {ids:?}");
        for &id in &ids {
            assert!(
                tok.decode(&[id], false).unwrap().contains('\u{fffd}'),
                "{name}: {id}"
            );
        }
        assert_eq!(stream(tok, &ids, false), [text], "{name}");
    }
}

#[test]
fn sentencepiece_word_boundaries_keep_their_spaces_when_streamed() {
    let tok = common::tokenizer("gemma3-270m");
    let ids = tok.encode("one two  three", false).unwrap();
    assert!(tok.id_to_token(ids[1]).unwrap().starts_with('\u{2581}'));
    let deltas = stream(tok, &ids, false);
    assert!(deltas.len() >= 3, "{deltas:?}");
    assert_eq!(deltas.concat(), "one two  three");
}

#[test]
fn a_sequence_that_stops_inside_a_character_is_flushed_as_decode_shows_it() {
    let tok = common::tokenizer("smollm2-135m-instruct");
    let ids = tok.encode("ok \u{1F9CC}", false).unwrap();
    let cut = &ids[..ids.len() - 1];
    let deltas = stream(tok, cut, false);
    assert!(deltas.last().unwrap().ends_with('\u{fffd}'));
}
