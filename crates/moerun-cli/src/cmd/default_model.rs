//! Where a command's model comes from: `--model DIR`, or the default model embedded in this
//! binary (see `build.rs`). The embedded files are unpacked once into a cache directory named
//! after their content hash and then loaded through exactly the same checkpoint path as any
//! other directory (mmapped safetensors, tokenizer.json, ...).

use std::path::{Path, PathBuf};

use super::CliResult;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/default_model.rs"));
}

/// The checkpoint directory to load.
pub fn resolve(model: Option<&Path>) -> CliResult<PathBuf> {
    match model {
        Some(dir) => Ok(dir.to_path_buf()),
        None if embedded::FILES.is_empty() => {
            Err("no --model given, and this build embeds no default model".into())
        }
        None => unpack(),
    }
}

fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("MOERUN_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("moerun");
    }
    if let Some(home) = std::env::var_os("HOME") {
        return PathBuf::from(home).join(".cache/moerun");
    }
    std::env::temp_dir().join("moerun")
}

/// Write the embedded files once (to a temporary sibling, then renamed into place, so a
/// concurrent or interrupted run never sees a half-written model).
fn unpack() -> CliResult<PathBuf> {
    let root = cache_root();
    let dir = root.join(format!("default-{:016x}", embedded::HASH));
    if dir.join("config.json").exists() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    let tmp = root.join(format!(
        ".default-{:016x}-{}",
        embedded::HASH,
        std::process::id()
    ));
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    for (name, bytes) in embedded::FILES {
        let path = tmp.join(name);
        std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        // Another process may have won the race; its copy is as good as ours.
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join("config.json").exists() {
            return Err(format!("{}: {e}", dir.display()).into());
        }
    }
    Ok(dir)
}
