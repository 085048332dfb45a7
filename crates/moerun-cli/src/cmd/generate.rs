//! `moerun generate`: a prompt in, text streamed out as it is produced, with the model's own
//! chat template under `--chat`, and a stats line on stderr (or one JSON object with `--json`).

use std::io::{IsTerminal, Read, Write};

use moerun_engine::generate::{generate, Control, GenerateOptions, Generation};
use moerun_engine::sampling::{Sampler, SamplingParams};
use moerun_engine::stop::StopMatcher;
use moerun_engine::{Sequence, SequenceKv};
use moerun_text::template::{ChatArgs, TemplateValue};

use super::text_model::TextModel;
use super::CliResult;
use crate::{GenerateArgs, SamplingFlags};

/// New tokens when neither the flag nor generation_config.json says.
const DEFAULT_MAX_TOKENS: usize = 256;

pub fn run(args: &GenerateArgs) -> CliResult {
    let prompt = match &args.prompt {
        Some(p) => p.clone(),
        None => read_stdin_prompt()?,
    };
    if prompt.trim().is_empty() {
        return Err("the prompt is empty".into());
    }
    let tm = TextModel::load(args.model.as_deref(), args.device)?;
    let prompt_ids = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(TemplateValue::message("system", system));
        }
        messages.push(TemplateValue::message("user", &prompt));
        encode_chat(&tm, messages)?
    } else {
        tm.tokenizer.encode(&prompt, true)?
    };
    tm.check_prompt_len(prompt_ids.len())?;
    let params = args.sampling.apply(tm.generation.sampling_params());
    let max_new = max_new_tokens(&tm, args.max_tokens, prompt_ids.len());
    let mut stdout = std::io::stdout().lock();
    let stream = !args.json;
    let (text, generation) =
        run_generation(&tm, prompt_ids, params, max_new, &args.stop, |delta| {
            if stream {
                // A closed pipe (e.g. `| head`) ends the stream quietly.
                let _ = stdout.write_all(delta.as_bytes());
                let _ = stdout.flush();
            }
        })?;
    if args.json {
        let json = serde_json::json!({
            "text": text,
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.tokens.len(),
            "finish_reason": generation.finish_reason.as_openai(),
            "time_to_first_token_ms": generation.time_to_first_token.as_secs_f64() * 1e3,
            "prefill_tokens_per_second": generation.prefill_tokens_per_second(),
            "decode_tokens_per_second": generation.decode_tokens_per_second(),
        });
        writeln!(stdout, "{json}")?;
    } else {
        writeln!(stdout)?;
        eprintln!("{}", stats_line(&generation));
    }
    Ok(())
}

/// Render `messages` with the model's chat template (generation prompt on) and tokenize it
/// without adding special tokens again, as transformers' `apply_chat_template` does.
pub fn encode_chat(tm: &TextModel, messages: Vec<TemplateValue>) -> CliResult<Vec<u32>> {
    let template = tm.tokenizer.chat_template(None, false).map_err(|e| {
        format!(
            "{}: this model has no usable chat template ({e})",
            tm.dir.display()
        )
    })?;
    let mut chat = ChatArgs::new(messages);
    chat.add_generation_prompt = true;
    let text = template.render(&chat)?;
    Ok(tm.tokenizer.encode(&text, false)?)
}

/// `--max-tokens`, else generation_config.json's limit, else a default; never past the context.
pub fn max_new_tokens(tm: &TextModel, flag: Option<usize>, prompt_len: usize) -> usize {
    let wanted = flag
        .or_else(|| tm.generation.max_new_tokens_after(prompt_len))
        .unwrap_or(DEFAULT_MAX_TOKENS);
    wanted.min(tm.context_len() - prompt_len)
}

/// Generate from `prompt_ids`, passing each safe-to-show text delta to `emit`; returns the full
/// text (stop string excluded) and the generation record.
pub fn run_generation(
    tm: &TextModel,
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    max_new: usize,
    stops: &[String],
    emit: impl FnMut(&str),
) -> CliResult<(String, Generation)> {
    let mut kv = tm.generation_kv_cache(prompt_ids.len() + max_new)?;
    let mut seq = Sequence::new(prompt_ids);
    continue_generation(tm, &mut kv, &mut seq, params, max_new, stops, emit)
}

/// Like [`run_generation`] over an existing sequence whose first `seq.cached` tokens are
/// already in `kv` (chat turns reuse the previous turns' KV).
pub fn continue_generation(
    tm: &TextModel,
    kv: &mut SequenceKv,
    seq: &mut Sequence,
    params: SamplingParams,
    max_new: usize,
    stops: &[String],
    mut emit: impl FnMut(&str),
) -> CliResult<(String, Generation)> {
    let mut sampler = Sampler::new(params, seq.tokens.len())
        .map_err(|e| format!("invalid sampling parameter: {e}"))?;
    let mut matcher =
        StopMatcher::new(stops.iter().cloned()).map_err(|e| format!("invalid --stop: {e}"))?;
    let stop_tokens = tm.stop_tokens();
    let options = GenerateOptions {
        max_new_tokens: max_new,
        stop_tokens: &stop_tokens,
    };
    let mut decoder = tm.tokenizer.decode_stream(true);
    let mut text = String::new();
    let mut failure = None;
    let generation = generate(&tm.model, kv, seq, &mut sampler, &options, |token| {
        match decoder.step(token) {
            Ok(Some(delta)) => {
                let out = matcher.push(&delta);
                text.push_str(out.text);
                emit(out.text);
                if out.stop.is_some() {
                    return Control::Stop;
                }
            }
            Ok(None) => {}
            Err(e) => {
                failure = Some(e);
                return Control::Stop;
            }
        }
        Control::Continue
    })?;
    if let Some(e) = failure {
        return Err(e.into());
    }
    if matcher.stopped().is_none() {
        if let Some(rest) = decoder.finish()? {
            let out = matcher.push(&rest);
            text.push_str(out.text);
            emit(out.text);
        }
        let tail = matcher.finish().to_string();
        text.push_str(&tail);
        emit(&tail);
    }
    Ok((text, generation))
}

/// The stats line printed on stderr after the text.
pub fn stats_line(g: &Generation) -> String {
    format!(
        "[{} prompt tokens, {} generated ({}); time to first token {:.1} ms; prefill {:.1} tok/s; decode {:.1} tok/s]",
        g.prompt_tokens,
        g.tokens.len(),
        g.finish_reason.as_openai(),
        g.time_to_first_token.as_secs_f64() * 1e3,
        g.prefill_tokens_per_second(),
        g.decode_tokens_per_second()
    )
}

fn read_stdin_prompt() -> CliResult<String> {
    let mut stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Err("give a prompt as an argument or on standard input".into());
    }
    let mut text = String::new();
    stdin.read_to_string(&mut text)?;
    Ok(text)
}

impl SamplingFlags {
    /// The model's defaults with the flags given on the command line on top.
    pub fn apply(&self, mut p: SamplingParams) -> SamplingParams {
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(k) = self.top_k {
            p.top_k = k;
        }
        if let Some(v) = self.top_p {
            p.top_p = v;
        }
        if let Some(v) = self.min_p {
            p.min_p = v;
        }
        if let Some(v) = self.repetition_penalty {
            p.repetition_penalty = v;
        }
        if self.seed.is_some() {
            p.seed = self.seed;
        }
        p
    }
}
