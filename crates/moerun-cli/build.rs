//! Embeds the default model (`models/default/` at the workspace root) into the binary: writes
//! `$OUT_DIR/default_model.rs` with every file's bytes (`include_bytes!`) and a content hash that
//! names the directory the files are unpacked into at run time. Without that directory the list
//! is empty and commands ask for `--model`. `MOERUN_NO_EMBEDDED_MODEL=1` leaves it empty too: the
//! binary that scripts/gpu-build.sh sends to the GPU machine must stay small.

use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let dir = manifest.join("../../models/default");
    println!("cargo:rerun-if-changed={}", dir.display());
    println!("cargo:rerun-if-env-changed=MOERUN_NO_EMBEDDED_MODEL");
    let skip = std::env::var_os("MOERUN_NO_EMBEDDED_MODEL").is_some_and(|v| v == "1");
    let mut entries: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(_) if skip => Vec::new(),
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect(),
        Err(_) => Vec::new(),
    };
    entries.sort();
    // FNV-1a over names and contents: a stable identity for the unpacked copy.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut items = String::new();
    for path in &entries {
        println!("cargo:rerun-if-changed={}", path.display());
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        for b in name.bytes().chain(fs::read(path).unwrap()) {
            hash ^= b as u64;
            hash = hash.wrapping_mul(0x100_0000_01b3);
        }
        let abs = fs::canonicalize(path).unwrap();
        items.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            abs.display().to_string()
        ));
    }
    let out = Path::new(&std::env::var("OUT_DIR").unwrap()).join("default_model.rs");
    fs::write(
        out,
        format!(
            "pub const FILES: &[(&str, &[u8])] = &[\n{items}];\npub const HASH: u64 = {hash:#x};\n"
        ),
    )
    .unwrap();
}
