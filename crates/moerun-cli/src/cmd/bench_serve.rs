//! `moerun bench-serve`: a concurrency sweep against a server, in the spirit of
//! `vllm bench serve` (see `moerun_server::bench`). With `--url` it loads a running server;
//! without, it starts one in this process on a free loopback port, with the `serve` flags, and
//! measures it through the same HTTP stack clients use.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use moerun_server::bench::{self, BenchOptions};
use moerun_server::client::HttpClient;
use moerun_server::Server;
use moerun_text::Tokenizer;

use super::serve::{load_model, server_options};
use super::CliResult;
use crate::BenchServeArgs;

pub fn run(args: &BenchServeArgs) -> CliResult {
    let concurrencies = parse_list(&args.concurrency)?;
    // Kept alive until the sweep ends; dropping it stops the in-process server.
    let mut local: Option<Server> = None;
    let (url, model_name, vocab) = match &args.url {
        Some(url) => {
            let dir = super::default_model::resolve(args.serve.model.as_deref())?;
            let vocab = Tokenizer::from_dir(&dir)?.vocab_size();
            let name = match &args.serve.served_model_name {
                Some(n) => n.clone(),
                None => served_name(url, args.serve.api_key.clone())?,
            };
            (url.clone(), name, vocab)
        }
        None => {
            let model = load_model(
                args.serve.model.as_deref(),
                args.serve.served_model_name.clone(),
                args.serve.device.device,
            )?;
            let vocab = model.tokenizer.vocab_size().min(model.vocab_size());
            let name = model.name.clone();
            let mut options = server_options(&args.serve, false)?;
            options.addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
            let server = Server::start(model, &options)?;
            let url = server.url();
            local = Some(server);
            (url, name, vocab)
        }
    };
    let options = BenchOptions {
        url,
        api_key: args.serve.api_key.clone(),
        model: model_name,
        input_len: args.input_len,
        output_len: args.output_len,
        concurrencies,
        num_prompts: args.num_prompts,
        vocab: u32::try_from(vocab).unwrap_or(u32::MAX),
        seed: args.seed,
    };
    let results = bench::run(&options)?;
    if args.json {
        println!("{}", bench::to_json(&results));
    } else {
        print!(
            "{}",
            bench::format_table(&results, args.input_len, args.output_len)
        );
    }
    if let Some(server) = local {
        server.shutdown()?;
    }
    Ok(())
}

/// The first model a running server lists.
fn served_name(url: &str, api_key: Option<String>) -> CliResult<String> {
    let runtime = tokio_runtime()?;
    let reply = runtime
        .block_on(HttpClient::new(url, api_key).get("/v1/models"))
        .map_err(|e| format!("{url}: {e}"))?;
    let json = reply.json();
    json["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("{url}/v1/models lists no model (status {})", reply.status).into())
}

fn tokio_runtime() -> CliResult<moerun_server::bench::Runtime> {
    Ok(moerun_server::bench::runtime()?)
}

/// `1,4,16,64` into numbers, each at least 1.
fn parse_list(text: &str) -> CliResult<Vec<usize>> {
    let values = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("--concurrency: '{s}' is not a positive integer")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if values.is_empty() {
        return Err("--concurrency: no levels given".into());
    }
    Ok(values)
}
