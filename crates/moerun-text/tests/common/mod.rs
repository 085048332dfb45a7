//! Shared by the integration tests: the committed real tokenizers under `tests/tokenizers/`,
//! loaded once per test binary. Large `tokenizer.json` files are committed gzip-compressed and
//! unpacked into a temporary model directory, so loading still goes through `Tokenizer::from_dir`.

#![allow(dead_code)] // each test binary uses a different subset of these helpers

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use moerun_text::Tokenizer;

/// The names of the committed tokenizers (directories under `tests/tokenizers/`).
pub const TOKENIZERS: [&str; 3] = ["smollm2-135m-instruct", "qwen3", "gemma3-270m"];

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A committed tokenizer directory, with `tokenizer.json.gz` unpacked into a copy under cargo's
/// per-target temporary directory (reused across runs until the archive changes).
pub fn model_dir(name: &str) -> PathBuf {
    let src = repo_root().join("tests/tokenizers").join(name);
    if src.join("tokenizer.json").is_file() {
        return src;
    }
    let dst = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("moerun-text-tokenizers")
        .join(name);
    let archive = src.join("tokenizer.json.gz");
    let unpacked = dst.join("tokenizer.json");
    let modified = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
    if modified(&unpacked).is_some() && modified(&unpacked) >= modified(&archive) {
        copy_small_files(&src, &dst);
        return dst;
    }
    fs::create_dir_all(&dst).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(fs::File::open(&archive).unwrap())
        .read_to_end(&mut json)
        .unwrap();
    // Write then rename, so that a test binary running at the same time never reads half a file.
    let tmp = dst.join(format!("tokenizer.json.{}", std::process::id()));
    fs::write(&tmp, json).unwrap();
    fs::rename(&tmp, &unpacked).unwrap();
    copy_small_files(&src, &dst);
    dst
}

/// Copies the configuration files (everything but the archive) next to the unpacked json.
fn copy_small_files(src: &Path, dst: &Path) {
    for entry in fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() && path.extension().is_some_and(|e| e != "gz") {
            fs::copy(&path, dst.join(path.file_name().unwrap())).unwrap();
        }
    }
}

/// A committed tokenizer, loaded once per test binary.
pub fn tokenizer(name: &str) -> &'static Tokenizer {
    static CELLS: [OnceLock<Tokenizer>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let index = TOKENIZERS
        .iter()
        .position(|n| *n == name)
        .unwrap_or_else(|| panic!("unknown test tokenizer {name}"));
    CELLS[index].get_or_init(|| Tokenizer::from_dir(model_dir(name)).unwrap())
}
