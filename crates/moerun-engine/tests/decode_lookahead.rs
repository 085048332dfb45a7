//! `run_step`'s lookahead block: a one-token step also takes the block of the sequence's next
//! position when one is free (so that the CUDA backend can launch the next greedy step ahead into
//! it), never fails for want of it, and changes no logits.

mod reference;

use moerun_engine::{run_step, Sequence, SequenceKv};
use moerun_model::{LogitsFor, Model};
use reference::fixtures_dir;

/// Decode `steps` tokens after a prompt of `prompt` tokens in a cache of `room` tokens; the block
/// count of the sequence's table after each step, and the logits of every step.
fn decode(model: &Model, room: usize, prompt: usize, steps: usize) -> (Vec<usize>, Vec<f32>) {
    let mut kv = SequenceKv::for_model(model, room).unwrap();
    let mut seq = Sequence::new((0..prompt as u32).map(|i| i % 50 + 1).collect());
    let (mut blocks, mut logits) = (Vec::new(), Vec::new());
    for s in 0..=steps {
        let out = run_step(
            model,
            &mut kv,
            &mut [&mut seq],
            &[usize::MAX],
            LogitsFor::LastOfEachSeq,
        )
        .unwrap();
        blocks.push(seq.table.blocks.len());
        logits.extend_from_slice(&out.logits);
        if s < steps {
            seq.tokens.push((s as u32 % 7) + 3);
        }
    }
    (blocks, logits)
}

#[test]
fn a_decode_step_holds_its_next_positions_block_when_one_is_free() {
    let model = Model::load(&fixtures_dir().join("qwen3_moe_f32")).unwrap();
    let bs = moerun_model::kv::DEFAULT_BLOCK_SIZE;
    // A prompt that ends one short of a block's last slot, then decode steps across the block.
    let prompt = bs - 2;
    let (blocks, roomy) = decode(&model, 4 * bs, prompt, 3);
    // The prompt (bs - 2 tokens, several at once) holds one block; the step at position bs - 2
    // also takes the next position's (bs - 1), still the first block; the step at bs - 1 takes
    // the block of bs ahead of time; the step at bs needs no new one.
    assert_eq!(blocks, [1, 1, 2, 2], "blocks after each step");
    // In a cache of one block the step at bs - 1 finds none to spare and runs without it.
    let (exact_blocks, exact) = decode(&model, bs, prompt, 2);
    assert_eq!(exact_blocks, [1, 1, 1], "no block past the cache's room");
    assert!(
        roomy[..exact.len()] == exact[..],
        "the lookahead block changed the logits"
    );
}
