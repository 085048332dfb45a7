//! `moerun chat`: an interactive conversation with history, rendered by the model's chat
//! template. Each turn re-renders the whole conversation but only prefills what the KV cache
//! does not already hold (the common prefix with the previous turn is reused). `/reset` starts
//! over, `/exit` (or end of input) quits. Works the same when stdin is not a terminal.

use std::io::{BufRead, IsTerminal, Write};

use moerun_engine::Sequence;
use moerun_text::TemplateValue;

use super::generate::{encode_chat, stats_line};
use super::text_model::TextModel;
use super::CliResult;
use crate::ChatArgs;

pub fn run(args: &ChatArgs) -> CliResult {
    let tm = TextModel::load(args.model.as_deref(), args.device)?;
    let params = args.sampling.apply(tm.generation.sampling_params());
    let interactive = std::io::stdin().is_terminal();
    let mut kv = tm.generation_kv_cache(tm.context_len())?;
    let mut seq = Sequence::default();
    let mut history: Vec<TemplateValue> = Vec::new();
    if let Some(system) = &args.system {
        history.push(TemplateValue::message("system", system));
    }
    let base_history = history.clone();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let input = line.trim();
        match input {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history = base_history.clone();
                seq.release(&mut kv);
                seq = Sequence::default();
                eprintln!("[conversation reset]");
                continue;
            }
            _ => {}
        }
        history.push(TemplateValue::message("user", input));
        let ids = encode_chat(&tm, history.clone())?;
        let max_new = super::generate::max_new_tokens(
            &tm,
            args.max_tokens,
            ids.len().min(tm.context_len() - 1),
        );
        if ids.len() + 1 >= tm.context_len() {
            return Err(format!(
                "the conversation has reached {} tokens, the model's context is {}; use /reset",
                ids.len(),
                tm.context_len()
            )
            .into());
        }
        // Keep the KV of the longest common prefix with what is cached; recompute the rest.
        let common = seq
            .tokens
            .iter()
            .zip(&ids)
            .take(seq.cached)
            .take_while(|(a, b)| a == b)
            .count();
        // Linear-attention state (Qwen3.5's Gated DeltaNet) cannot be rewound to a prefix:
        // such models recompute the conversation unless it extends exactly what is cached.
        let rewinds = common < seq.cached;
        seq.cached = if rewinds && tm.model.config.linear_attention.is_some() {
            0
        } else {
            common
        };
        seq.tokens = ids;
        let mut stdout = std::io::stdout().lock();
        let (text, generation) = super::generate::continue_generation(
            &tm,
            &mut kv,
            &mut seq,
            params.clone(),
            max_new,
            &args.stop,
            |delta| {
                let _ = stdout.write_all(delta.as_bytes());
                let _ = stdout.flush();
            },
        )?;
        writeln!(stdout)?;
        if interactive {
            eprintln!("{}", stats_line(&generation));
        }
        history.push(TemplateValue::message("assistant", &text));
    }
    Ok(())
}
