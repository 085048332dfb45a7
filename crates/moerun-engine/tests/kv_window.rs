//! The KV cache's window group: sliding-window layers keep their K/V in blocks of their own, and
//! a sequence gives those back as they leave its window. On every fixture whose windows are
//! shorter than its tokens, a run through a window pool of exactly the bound (so released blocks
//! are recycled, under other ids, while the sequence goes on) gives logits bitwise equal to the
//! ordinary cache's, and within the fixture's bar of transformers.

mod reference;

use moerun_core::{BlockTable, RELEASED_BLOCK};
use moerun_model::{Batch, LogitsFor, Model, SeqChunk};
use reference::{chunked_logits, fixtures_dir, load_reference, relative_error, WINDOWED_FIXTURES};

#[test]
fn windowed_kv_gives_the_logits_of_the_full_cache_in_a_bounded_pool() {
    for name in WINDOWED_FIXTURES {
        let dir = fixtures_dir().join(name);
        let model = Model::load(&dir).unwrap();
        let reference = load_reference(&dir);
        let window = model.config.kv_window().unwrap();
        assert!(
            window + 4 < reference.tokens.len(),
            "{name}: window {window} must be shorter than the {} tokens",
            reference.tokens.len()
        );
        for first_chunk in [1, 5] {
            let plain = chunked_logits(&model, &reference.tokens, first_chunk, false);
            let windowed = chunked_logits(&model, &reference.tokens, first_chunk, true);
            assert!(
                plain == windowed,
                "{name} (first chunk {first_chunk}): windowed KV changed the logits: {:.2e}",
                relative_error(&windowed, &plain)
            );
            let err = relative_error(&windowed, &reference.logits);
            assert!(
                err < reference.tolerance(),
                "{name}: {err:.2e} from transformers"
            );
            println!(
                "{name:36} first chunk {first_chunk}: bitwise equal, {err:.1e} from transformers"
            );
        }
    }
}

#[test]
fn a_window_group_cache_refuses_batches_that_do_not_fit_it() {
    let dir = fixtures_dir().join("mixtral_bf16_swa_llama3_v4");
    let model = Model::load(&dir).unwrap();
    let window = model.config.kv_window().unwrap();
    let tokens: Vec<u32> = (0..window as u32 + 8).map(|i| i % 50 + 1).collect();
    let mut kv = model.new_kv_cache_with_window_group(16, 16, 4).unwrap();
    let table = BlockTable {
        blocks: (0..tokens.len().div_ceil(4) as u32).collect(),
    };
    let chunk = |start: usize| SeqChunk {
        tokens: &tokens[start..start + 1],
        start_pos: start,
        block_table: &table,
    };
    let err = |r: moerun_core::Result<moerun_model::ForwardOutput>| match r {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };

    let no_window_table = Batch::new(vec![chunk(3)]);
    let e = err(model.forward(&no_window_table, &mut kv, LogitsFor::AllTokens));
    assert!(e.contains("window table per sequence"), "{e}");

    // Positions 0-7 released: fine for the last token, whose window starts later; refused, not
    // read, for a token whose window they are in.
    let mut released = table.clone();
    released.blocks[..2].fill(RELEASED_BLOCK);
    assert!(tokens.len() - window >= 8);
    let last = tokens.len() - 1;
    let batch = Batch::new(vec![chunk(last)]).with_window_tables(vec![&released]);
    model
        .forward(&batch, &mut kv, LogitsFor::AllTokens)
        .unwrap();
    let batch = Batch::new(vec![chunk(9)]).with_window_tables(vec![&released]);
    let e = err(model.forward(&batch, &mut kv, LogitsFor::AllTokens));
    assert!(e.contains("inside the window"), "{e}");

    let e = Model::load(&fixtures_dir().join("qwen3_moe_f32"))
        .unwrap()
        .new_kv_cache_with_window_group(4, 4, 4)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("no sliding-window layers"), "{e}");
}

#[test]
fn a_one_sequence_cache_keeps_only_the_window_and_changes_nothing() {
    use moerun_engine::{run_step, Sequence, SequenceKv};
    use reference::{argmax, prefill_logits};
    for name in WINDOWED_FIXTURES {
        let dir = fixtures_dir().join(name);
        let model = Model::load(&dir).unwrap();
        let r = load_reference(&dir);
        let window = model.config.kv_window().unwrap();
        let total = r.tokens.len() + r.greedy.len();
        // Chunks of 4: the window group holds the window plus 4 tokens, far below `total`.
        let mut kv = SequenceKv::for_one_sequence(&model, total, 4).unwrap();
        assert_eq!(kv.max_chunk(), 4);
        let mut seq = Sequence::new(r.tokens.clone());
        let mut logits = Vec::new();
        while !seq.pending().is_empty() {
            let out = run_step(
                &model,
                &mut kv,
                &mut [&mut seq],
                &[usize::MAX],
                LogitsFor::AllTokens,
            );
            logits.extend(out.unwrap().logits);
        }
        assert!(
            logits == prefill_logits(&model, &r.tokens),
            "{name}: windowed chunked prefill differs from one prefill"
        );
        let held = seq.window_table.held().count();
        assert!(
            held <= (window + 3).div_ceil(16) + 1,
            "{name}: {held} window blocks held"
        );
        // Greedy on from there, one token a step, as `generate` does.
        let vocab = model.config.vocab_size;
        let mut next = argmax(&logits[logits.len() - vocab..]);
        let mut greedy = vec![next];
        while greedy.len() < r.greedy.len() {
            seq.tokens.push(next);
            let out = run_step(
                &model,
                &mut kv,
                &mut [&mut seq],
                &[1],
                LogitsFor::LastOfEachSeq,
            );
            next = argmax(&out.unwrap().logits);
            greedy.push(next);
        }
        assert_eq!(greedy, r.greedy, "{name}: greedy continuation");
        seq.release(&mut kv);
        println!("{name:36} window {window}: chunked windowed prefill bitwise equal, greedy equal");
    }
}
