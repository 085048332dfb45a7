//! Stop strings over streamed text: never emit part of a stop string, emit everything before it,
//! and give the same answer however the text is split into deltas. Plus stop token ids.

use moerun_engine::stop::{StopMatcher, StopTokens};

/// Feed `deltas` and return (what each push released, the stop hit, what finish released).
fn stream(stops: &[&str], deltas: &[&str]) -> (Vec<String>, Option<String>, String) {
    let mut m = StopMatcher::new(stops.iter().copied()).unwrap();
    let mut released = Vec::new();
    let mut stop = None;
    for d in deltas {
        let out = m.push(d);
        released.push(out.text.to_string());
        if let Some(s) = out.stop {
            assert!(stop.is_none(), "a stop is reported once");
            stop = Some(s.to_string());
        }
    }
    let rest = m.finish().to_string();
    assert_eq!(m.stopped().map(str::to_string), stop);
    (released, stop, rest)
}

#[test]
fn a_stop_string_split_across_three_deltas_is_never_partly_emitted() {
    let (released, stop, rest) = stream(&["STOP"], &["abc ST", "O", "P and more"]);
    assert_eq!(released, ["abc ", "", ""]);
    assert_eq!(stop.as_deref(), Some("STOP"));
    assert_eq!(rest, "");
}

#[test]
fn a_stop_string_split_across_two_deltas_releases_the_text_before_it() {
    let (released, stop, _) = stream(&["</s>"], &["hello</", "s>bye"]);
    assert_eq!(released, ["hello", ""]);
    assert_eq!(stop.as_deref(), Some("</s>"));
}

#[test]
fn a_held_back_prefix_is_released_once_it_cannot_become_a_stop() {
    let (released, stop, rest) = stream(&["STOP"], &["xST", "Ox", "y"]);
    assert_eq!(released, ["x", "STOx", "y"]);
    assert_eq!(stop, None);
    assert_eq!(rest, "");
}

#[test]
fn of_overlapping_stop_strings_the_one_completed_first_wins() {
    // "ab" completes before "abc" could.
    let (released, stop, _) = stream(&["abc", "ab"], &["xxa", "bc"]);
    assert_eq!(released, ["xx", ""]);
    assert_eq!(stop.as_deref(), Some("ab"));
    // "ab" is held as the start of "abd"; "bc" then completes first, inside it.
    let (released, stop, _) = stream(&["abd", "bc"], &["a", "b", "c"]);
    assert_eq!(released, ["", "", "a"]);
    assert_eq!(stop.as_deref(), Some("bc"));
}

#[test]
fn of_stop_strings_ending_at_the_same_place_the_longest_wins() {
    let (released, stop, _) = stream(&["b", "ab"], &["xab"]);
    assert_eq!(released, ["x"]);
    assert_eq!(stop.as_deref(), Some("ab"));
}

#[test]
fn a_stop_string_at_the_very_start_releases_nothing() {
    let (released, stop, rest) = stream(&["STOP"], &["STOP", "after"]);
    assert_eq!(released, ["", ""]);
    assert_eq!(stop.as_deref(), Some("STOP"));
    assert_eq!(rest, "");
}

#[test]
fn text_after_a_stop_in_the_same_delta_or_later_is_never_released() {
    let mut m = StopMatcher::new(["."]).unwrap();
    let out = m.push("one. two.");
    assert_eq!((out.text, out.stop), ("one", Some(".")));
    let out = m.push(" three");
    assert_eq!((out.text, out.stop), ("", None));
    assert_eq!(m.finish(), "");
    assert_eq!(m.stopped(), Some("."));
}

#[test]
fn multi_byte_characters_around_a_stop_string_are_kept_whole() {
    let (released, stop, _) = stream(&["終わり"], &["日本語終", "わ", "り。"]);
    assert_eq!(released, ["日本語", "", ""]);
    assert_eq!(stop.as_deref(), Some("終わり"));
    // A held multi-byte character that turns out not to start the stop string.
    let (released, stop, rest) = stream(&["éa"], &["café", "!", "é"]);
    assert_eq!(released, ["caf", "é!", ""]);
    assert_eq!(stop, None);
    assert_eq!(rest, "é");
    // Stop strings that share a first byte with the text but not its character.
    let (released, stop, _) = stream(&["😀x"], &["a😁", "😀", "xz"]);
    assert_eq!(released, ["a😁", "", ""]);
    assert_eq!(stop.as_deref(), Some("😀x"));
}

#[test]
fn without_a_stop_everything_is_released_by_finish() {
    let (released, stop, rest) = stream(&["world!"], &["hello wor", "ld"]);
    assert_eq!(stop, None);
    assert_eq!(released.concat() + &rest, "hello world");
    assert_eq!(rest, "world");
    let (released, _, rest) = stream(&[], &["no ", "stops ", "at all"]);
    assert_eq!(released, ["no ", "stops ", "at all"]);
    assert_eq!(rest, "");
}

/// Every way of cutting `text` into deltas (2^(chars-1) of them).
fn all_splits(text: &str) -> Vec<Vec<&str>> {
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
    (0..1u32 << bounds.len())
        .map(|mask| {
            let mut cuts = vec![0];
            cuts.extend(
                (0..bounds.len())
                    .filter(|b| mask >> b & 1 == 1)
                    .map(|b| bounds[b]),
            );
            cuts.push(text.len());
            cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect()
        })
        .collect()
}

#[test]
fn the_outcome_does_not_depend_on_how_the_text_is_split() {
    let cases: [(&[&str], &str); 5] = [
        (&["abc", "bcd", "cx"], "zabcbcdx"),
        (&["aab", "ab"], "aaab"),
        (&["xyz"], "xyxyxzxy"),
        (&["é!", "!é"], "aé!éb"),
        (&["ba", "aba"], "cabab"),
    ];
    for (stops, text) in cases {
        let (whole, stop, rest) = stream(stops, &[text]);
        let expected = (whole.concat() + &rest, stop);
        for split in all_splits(text) {
            let (released, stop, rest) = stream(stops, &split);
            assert_eq!(
                (released.concat() + &rest, stop),
                expected,
                "{stops:?} {split:?}"
            );
        }
    }
}

#[test]
fn an_empty_stop_string_is_refused_by_position() {
    let err = StopMatcher::new(["x", ""]).unwrap_err();
    assert!(err.starts_with("stop[1]"), "{err}");
}

#[test]
fn eos_and_request_stop_ids_end_the_sequence_unless_eos_is_ignored() {
    let stops = StopTokens::new(&[2, 7], &[5, 2], false);
    assert_eq!(stops.ids(), [2, 5, 7]);
    assert!(stops.is_stop_token(7) && stops.is_stop_token(5));
    assert!(!stops.is_stop_token(3));
    let ignoring = StopTokens::new(&[2, 7], &[5], true);
    assert!(!ignoring.is_stop_token(7) && !ignoring.is_stop_token(2));
    assert!(ignoring.is_stop_token(5));
}
