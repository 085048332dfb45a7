//! `moerun perplexity`: teacher-forced perplexity of a text file, in the spirit of
//! llama-perplexity. The text is tokenized once (with the tokenizer's special tokens, as
//! transformers' `tokenizer(text)` does) and cut into non-overlapping windows of `--context`
//! tokens; each window is one prefill, and every token but the window's first is scored given
//! the window's tokens before it. The result is `exp(mean negative log-likelihood)` over all
//! scored tokens, printed last as `perplexity: <value>`.

use moerun_engine::{run_step, Sequence};
use moerun_model::LogitsFor;

use super::text_model::TextModel;
use super::CliResult;
use crate::PerplexityArgs;

/// Window length when `--context` is not given (capped by the model's context).
const DEFAULT_CONTEXT: usize = 512;

pub fn run(args: &PerplexityArgs) -> CliResult {
    let text =
        std::fs::read_to_string(&args.file).map_err(|e| format!("{}: {e}", args.file.display()))?;
    let tm = TextModel::load(args.model.as_deref(), args.device)?;
    let context = args
        .context
        .unwrap_or(DEFAULT_CONTEXT.min(tm.context_len()));
    if context < 2 {
        return Err("--context must be at least 2 tokens".into());
    }
    if context > tm.context_len() {
        return Err(format!(
            "--context {context} exceeds the model's context of {} tokens",
            tm.context_len()
        )
        .into());
    }
    let tokens = tm.tokenizer.encode(&text, true)?;
    if tokens.len() < 2 {
        return Err(format!("{}: fewer than two tokens to score", args.file.display()).into());
    }
    let windows: Vec<&[u32]> = tokens.chunks(context).filter(|w| w.len() >= 2).collect();
    let mut kv = tm.kv_cache(context)?;
    let (mut nll, mut scored) = (0.0f64, 0usize);
    for (i, window) in windows.iter().enumerate() {
        let mut seq = Sequence::new(window.to_vec());
        let out = run_step(
            &tm.model,
            &mut kv,
            &mut [&mut seq],
            &[usize::MAX],
            LogitsFor::AllTokens,
        )?;
        seq.release(&mut kv);
        nll += window_nll(&out.logits, window, tm.model.config.vocab_size);
        scored += window.len() - 1;
        eprintln!(
            "[{}/{}] {} tokens scored, running perplexity {:.4}",
            i + 1,
            windows.len(),
            scored,
            (nll / scored as f64).exp()
        );
    }
    println!(
        "tokens: {}, windows: {}, context: {context}",
        tokens.len(),
        windows.len()
    );
    println!("perplexity: {:.4}", (nll / scored as f64).exp());
    Ok(())
}

/// Sum over positions `p < len-1` of `-log softmax(logits[p])[window[p+1]]`, in f64.
pub fn window_nll(logits: &[f32], window: &[u32], vocab: usize) -> f64 {
    let mut total = 0.0;
    for (p, row) in logits
        .chunks_exact(vocab)
        .take(window.len() - 1)
        .enumerate()
    {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        let target = row[window[p + 1] as usize] as f64;
        total += max + sum.ln() - target;
    }
    total
}
