//! Where a command's model comes from: `--model DIR`, or the default model embedded in this
//! binary, unpacked once into a cache directory and then loaded through exactly the same
//! checkpoint path as any other directory.

use std::path::{Path, PathBuf};

use super::CliResult;

/// The checkpoint directory to load.
pub fn resolve(model: Option<&Path>) -> CliResult<PathBuf> {
    match model {
        Some(dir) => Ok(dir.to_path_buf()),
        None => Err("no --model given, and this build embeds no default model".into()),
    }
}
