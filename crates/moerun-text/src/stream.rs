//! Incremental detokenization for streaming: token ids go in one at a time, text deltas come
//! out, and the deltas always are valid UTF-8 and concatenate to `decode(all_ids)`.
//!
//! Decoding one token alone is wrong in two ways: a character may be spread over several
//! tokens (byte-level BPE splits an emoji into byte tokens; SentencePiece vocabularies fall back
//! to `<0xF0>`-style byte tokens), and decoders treat the first token of a sequence specially
//! (SentencePiece's `▁` prefix space is stripped there). So the stream keeps two offsets into the
//! ids: `prefix` (where the already-emitted text of the current window starts) and `read` (how
//! far text has been emitted). Each step decodes `ids[prefix..]` and `ids[prefix..read]`; the
//! difference is new text unless it ends in U+FFFD, the mark of an unfinished character, in which
//! case the stream waits for more tokens. The window starts on a token boundary whose text was
//! complete, so the first-token rules apply equally to both decodes and cancel out.
//!
//! The stream only needs a way to decode a slice of ids ([`TokenDecoder`]), so its policy is
//! tested below with a toy decoder and in `tests/decode_stream.rs` with real tokenizers.

use crate::error::Result;

/// Decodes a run of ids to text; implemented by [`crate::Tokenizer`].
pub trait TokenDecoder {
    /// The text of `ids`, with U+FFFD where bytes do not form a character yet.
    fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String>;
}

/// The replacement character a lossy UTF-8 decode leaves for an unfinished byte sequence.
const REPLACEMENT: char = '\u{FFFD}';

/// Streaming detokenizer over any [`TokenDecoder`]; see the module docs for the invariant.
#[derive(Debug)]
pub struct DecodeStream<'a, D: TokenDecoder + ?Sized> {
    decoder: &'a D,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl<'a, D: TokenDecoder + ?Sized> DecodeStream<'a, D> {
    /// An empty stream; `skip_special_tokens` is passed to every decode.
    pub fn new(decoder: &'a D, skip_special_tokens: bool) -> Self {
        Self {
            decoder,
            skip_special_tokens,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds one token and returns the text it completes, if any. `None` means the token's text
    /// is still unfinished (or empty) and will come out with a later token or [`Self::finish`].
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let shown = self.decode(self.prefix, self.read)?;
        let full = self.decode(self.prefix, self.ids.len())?;
        if full.len() <= shown.len() || full.ends_with(REPLACEMENT) {
            return Ok(None);
        }
        let Some(delta) = new_suffix(&shown, &full) else {
            // The window's text changed before the point already shown (no decoder in use does
            // this); wait rather than emit something that would not add up.
            return Ok(None);
        };
        let delta = delta.to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(Some(delta))
    }

    /// Returns whatever text is still held back once no more tokens will come: the tail of a
    /// sequence that ends inside a character decodes with U+FFFD, exactly as `decode` shows it.
    pub fn finish(&mut self) -> Result<Option<String>> {
        if self.read == self.ids.len() {
            return Ok(None);
        }
        let shown = self.decode(self.prefix, self.read)?;
        let full = self.decode(self.prefix, self.ids.len())?;
        self.prefix = self.read;
        self.read = self.ids.len();
        let delta = new_suffix(&shown, &full).unwrap_or(&full);
        Ok((!delta.is_empty()).then(|| delta.to_string()))
    }

    /// Every id pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn decode(&self, start: usize, end: usize) -> Result<String> {
        if start == end {
            return Ok(String::new());
        }
        self.decoder
            .decode_ids(&self.ids[start..end], self.skip_special_tokens)
    }
}

/// `full` minus its leading `shown`, if `full` starts with it.
fn new_suffix<'s>(shown: &str, full: &'s str) -> Option<&'s str> {
    full.strip_prefix(shown)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary: id n < 256 is the byte n; 256 is a special token "<eos>"; 257 is
    /// a SentencePiece-like "▁hi" whose leading space is dropped at the start of a sequence.
    struct Bytes;

    impl TokenDecoder for Bytes {
        fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
            let mut bytes = Vec::new();
            for (i, &id) in ids.iter().enumerate() {
                match id {
                    0..=255 => bytes.push(id as u8),
                    256 if skip_special_tokens => {}
                    256 => bytes.extend_from_slice(b"<eos>"),
                    _ => bytes.extend_from_slice(if i == 0 { b"hi" } else { b" hi" }),
                }
            }
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
    }

    fn stream_all(ids: &[u32], skip: bool) -> Vec<String> {
        let mut stream = DecodeStream::new(&Bytes, skip);
        let mut out: Vec<String> = ids
            .iter()
            .filter_map(|&id| stream.step(id).unwrap())
            .collect();
        out.extend(stream.finish().unwrap());
        out
    }

    #[test]
    fn a_character_split_over_byte_tokens_comes_out_whole() {
        let ids: Vec<u32> = "a😀b".bytes().map(u32::from).collect();
        assert_eq!(stream_all(&ids, false), ["a", "😀", "b"]);
    }

    #[test]
    fn the_leading_space_rule_of_the_first_token_is_not_repeated_mid_stream() {
        assert_eq!(stream_all(&[257, 257, 257], false), ["hi", " hi", " hi"]);
    }

    #[test]
    fn special_tokens_are_emitted_or_skipped_as_asked() {
        assert_eq!(stream_all(&[104, 256, 105], false), ["h", "<eos>", "i"]);
        assert_eq!(stream_all(&[104, 256, 105], true), ["h", "i"]);
    }

    #[test]
    fn an_unfinished_character_at_the_end_is_flushed_as_decode_shows_it() {
        let ids = [104, 0xF0, 0x9F];
        let out = stream_all(&ids, false);
        assert_eq!(out.concat(), Bytes.decode_ids(&ids, false).unwrap());
        assert_eq!(out[0], "h");
    }
}
