//! `moerun serve`: the OpenAI-compatible HTTP server (`moerun_server`) over a checkpoint or the
//! embedded default model, with vLLM's flag names. Binds loopback unless told otherwise and
//! serves until Ctrl-C.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use moerun_core::Device;
use moerun_server::{ServedModel, Server, ServerOptions};

use super::CliResult;
use crate::ServeArgs;

pub fn run(args: &ServeArgs) -> CliResult {
    let options = server_options(args, true)?;
    let model = load_model(
        args.model.as_deref(),
        args.served_model_name.clone(),
        args.device.device,
    )?;
    let name = model.name.clone();
    let server = Server::start(model, &options)?;
    let s = &server.scheduler;
    let lowered = if s.max_num_seqs < options.max_num_seqs {
        format!(
            " (lowered from {}: their linear-attention states take half the KV budget)",
            options.max_num_seqs
        )
    } else {
        String::new()
    };
    eprintln!(
        "moerun: serving '{name}' at {} (max {} sequences{lowered}, {} tokens per step, \
         context {}, {} KV blocks of {} tokens{}); Ctrl-C stops",
        server.url(),
        s.max_num_seqs,
        s.max_num_batched_tokens,
        s.max_model_len,
        s.num_blocks,
        s.block_size,
        if options.api_key.is_some() {
            ", API key required"
        } else {
            ""
        },
    );
    server.wait()?;
    Ok(())
}

/// The checkpoint at `--model` (served under its path as given, as vLLM does, unless
/// `--served-model-name` says otherwise), or the embedded default model (served as `default`).
pub fn load_model(
    model: Option<&Path>,
    served_name: Option<String>,
    device: Device,
) -> CliResult<ServedModel> {
    let dir = super::default_model::resolve(model)?;
    let name = served_name.unwrap_or_else(|| match model {
        Some(path) => path.display().to_string(),
        None => "default".to_string(),
    });
    Ok(ServedModel::load_on(&dir, name, device)?)
}

/// The server options the flags describe. `ctrl_c`: stop on Ctrl-C.
pub fn server_options(args: &ServeArgs, ctrl_c: bool) -> CliResult<ServerOptions> {
    let host: IpAddr = args
        .host
        .parse()
        .map_err(|_| format!("--host {}: not an IP address", args.host))?;
    let defaults = ServerOptions::default();
    Ok(ServerOptions {
        addr: SocketAddr::new(host, args.port),
        api_key: args.api_key.clone(),
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: args.max_model_len,
        kv_cache_bytes: args.kv_cache_memory,
        max_waiting: args.max_waiting,
        enable_prefix_caching: !args.no_enable_prefix_caching,
        max_body_bytes: defaults.max_body_bytes,
        handle_ctrl_c: ctrl_c,
        kv_dtype: args.device.kv_dtype,
    })
}
