//! A Hugging Face checkpoint directory: `config.json` plus weights in safetensors, either one
//! `model.safetensors`, shards listed by `model.safetensors.index.json`, or (for repos that name
//! their files differently) every `*.safetensors` in the directory.
//!
//! [`Checkpoint::open`] maps and validates every weight file and checks the index against the shards
//! before returning, so a missing file, a malformed index or a damaged shard fails at open with one
//! line naming the path. After that, tensor access is a lookup plus a zero-copy view of the mapping.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use moerun_core::{Error, Result, Tensor};
use serde_json::Value;

use crate::safetensors::{SafetensorsFile, TensorInfo};

/// The single-file weights name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The model configuration every checkpoint directory carries.
pub const CONFIG_FILE: &str = "config.json";

/// An opened checkpoint directory: all weight files mapped, every tensor name resolved to its file.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Tensor name to index into `files`. Sorted, so iteration order is stable.
    location: BTreeMap<String, usize>,
    /// Tensors held in memory instead of files, and the JSON files that go with them
    /// ([`Checkpoint::in_memory`]); empty for a checkpoint opened from a directory.
    memory: BTreeMap<String, Tensor>,
    memory_json: BTreeMap<String, Value>,
}

impl Checkpoint {
    /// Open the checkpoint in `dir`, validating its layout and every weight file.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let dir = dir.to_path_buf();
        let bad = |path: &Path, reason: String| Error::BadFile {
            path: path.to_path_buf(),
            reason,
        };
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(bad(&dir, "not a directory".into())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(bad(&dir, "checkpoint directory does not exist".into()))
            }
            Err(e) => return Err(Error::io(&dir, e)),
        }
        let config = dir.join(CONFIG_FILE);
        if !config.is_file() {
            return Err(bad(
                &config,
                "not found; every checkpoint directory needs one".into(),
            ));
        }
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        // Same precedence as the Hugging Face loaders: a single file wins over an index.
        let (files, location) = if single.is_file() {
            let file = SafetensorsFile::open(&single)?;
            let location = file.names().map(|n| (n.to_string(), 0)).collect();
            (vec![file], location)
        } else if index.is_file() {
            open_indexed(&dir, &index)?
        } else {
            let paths = loose_safetensors(&dir)?;
            if paths.is_empty() {
                return Err(bad(
                    &dir,
                    format!(
                        "no weights: neither {SINGLE_FILE} nor {INDEX_FILE} nor any *.safetensors \
                         file"
                    ),
                ));
            }
            open_all(paths)?
        };
        Ok(Checkpoint {
            dir,
            files,
            location,
            memory: BTreeMap::new(),
            memory_json: BTreeMap::new(),
        })
    }

    /// A checkpoint whose tensors are already in memory (synthetic models made for benchmarks,
    /// never written to disk); `label` stands in for the directory in messages, `json` maps file
    /// names (`config.json`, ...) to their contents.
    pub fn in_memory(
        label: &str,
        json: impl IntoIterator<Item = (String, Value)>,
        tensors: impl IntoIterator<Item = (String, Tensor)>,
    ) -> Checkpoint {
        Checkpoint {
            dir: PathBuf::from(label),
            files: Vec::new(),
            location: BTreeMap::new(),
            memory: tensors.into_iter().collect(),
            memory_json: json.into_iter().collect(),
        }
    }

    /// Copy every weight file into anonymous memory (see
    /// [`SafetensorsFile::copy_to_memory`]); tensors fetched afterwards borrow the copies.
    pub fn copy_to_memory(&mut self) -> Result<()> {
        for f in &mut self.files {
            f.copy_to_memory()?;
        }
        Ok(())
    }

    /// Bytes of all weight files.
    pub fn file_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.file_len() as u64).sum()
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Read one byte of every page of every tensor, so the mapped weights are resident before
    /// anything is timed or served (a decode step touches only the experts it routes to; the
    /// rest would otherwise fault in mid-generation). `progress` is called with the bytes done
    /// so far, from worker threads, after each tensor.
    pub fn prefault(&self, progress: impl Fn(u64) + Sync) {
        use rayon::prelude::*;
        use std::sync::atomic::{AtomicU64, Ordering};
        const PAGE: usize = 4096;
        let done = AtomicU64::new(0);
        let names: Vec<&str> = self.names().collect();
        let sum: u64 = names
            .par_iter()
            .filter_map(|n| self.get(n))
            .map(|t| {
                let s = t
                    .bytes()
                    .iter()
                    .step_by(PAGE)
                    .map(|&b| b as u64)
                    .sum::<u64>();
                progress(
                    done.fetch_add(t.byte_len() as u64, Ordering::Relaxed) + t.byte_len() as u64,
                );
                s
            })
            .sum();
        std::hint::black_box(sum);
    }

    /// Paths of the weight files, in the order they were opened.
    pub fn files(&self) -> impl Iterator<Item = &Path> + '_ {
        self.files.iter().map(SafetensorsFile::path)
    }

    /// All tensor names across all files, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.location
            .keys()
            .chain(self.memory.keys())
            .map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.location.len() + self.memory.len()
    }

    /// Whether the checkpoint holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.location.is_empty() && self.memory.is_empty()
    }

    /// Whether the checkpoint holds a tensor called `name` (of any dtype).
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name) || self.memory.contains_key(name)
    }

    /// Dtype, shape and offsets of `name`, without touching its bytes.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        let &file = self.location.get(name)?;
        self.files[file].info(name)
    }

    /// Tensor `name`, borrowing the file mapping. Fails if absent or of an unsupported dtype.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        if let Some(t) = self.memory.get(name) {
            return Ok(t.clone());
        }
        let &file = self
            .location
            .get(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        self.files[file].tensor(name)
    }

    /// Tensor `name` if present and usable, else `None` (for optional weights such as biases).
    /// A tensor that is present but unusable also gives `None`; [`tensor`](Self::tensor) says why.
    pub fn get(&self, name: &str) -> Option<Tensor> {
        self.tensor(name).ok()
    }

    /// Parse `file_name` in the checkpoint directory as JSON: `None` if the file does not exist,
    /// an error naming the path if it cannot be read or is not valid JSON.
    pub fn read_json(&self, file_name: &str) -> Result<Option<Value>> {
        if let Some(v) = self.memory_json.get(file_name) {
            return Ok(Some(v.clone()));
        }
        read_json_file(&self.dir.join(file_name))
    }

    /// Total bytes of all tensors' data, supported dtypes or not.
    pub fn weight_bytes(&self) -> u64 {
        self.location
            .iter()
            .filter_map(|(name, &file)| self.files[file].info(name))
            .map(|info| info.byte_len() as u64)
            .sum::<u64>()
            + self
                .memory
                .values()
                .map(|t| t.byte_len() as u64)
                .sum::<u64>()
    }
}

/// Read and parse a JSON file; `Ok(None)` when it does not exist.
fn read_json_file(path: &Path) -> Result<Option<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::BadFile {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })
}

type Opened = (Vec<SafetensorsFile>, BTreeMap<String, usize>);

/// Open the shards named by the index at `index` and check that each holds what the index says.
/// The index's `weight_map` is authoritative: tensors a shard holds beyond it are not exposed.
fn open_indexed(dir: &Path, index: &Path) -> Result<Opened> {
    let bad = |reason: String| Error::BadFile {
        path: index.to_path_buf(),
        reason,
    };
    // is_file() was true a moment ago, so None here means it vanished in between.
    let root = read_json_file(index)?.ok_or_else(|| bad("disappeared while opening".into()))?;
    let weight_map = root
        .get("weight_map")
        .ok_or_else(|| bad("missing 'weight_map'".into()))?
        .as_object()
        .ok_or_else(|| bad("'weight_map' must be an object of tensor name to file name".into()))?;
    if weight_map.is_empty() {
        return Err(bad(
            "'weight_map' is empty: the index names no tensors".into()
        ));
    }
    let mut shard_of: BTreeMap<String, &str> = BTreeMap::new();
    for (tensor, shard) in weight_map {
        let shard = shard.as_str().ok_or_else(|| {
            bad(format!(
                "weight_map entry for tensor '{tensor}' must be a file name string"
            ))
        })?;
        // Shards must stay inside the checkpoint directory: no absolute paths, no "..".
        let plain = !shard.is_empty()
            && Path::new(shard)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        if !plain {
            return Err(bad(format!(
                "weight_map puts tensor '{tensor}' in '{shard}', which is not a file name inside \
                 the checkpoint directory"
            )));
        }
        shard_of.insert(tensor.clone(), shard);
    }
    let shard_names: BTreeSet<&str> = shard_of.values().copied().collect();
    let mut files = Vec::with_capacity(shard_names.len());
    let mut file_index = BTreeMap::new();
    for shard in shard_names {
        let path = dir.join(shard);
        if !path.is_file() {
            // Say how much lives there and name one tensor, so the user sees why the file matters.
            let mut here = shard_of
                .iter()
                .filter(|(_, s)| **s == shard)
                .map(|(t, _)| t);
            let example = here.next().map(String::as_str).unwrap_or_default();
            let count = 1 + here.count();
            return Err(Error::BadFile {
                path,
                reason: format!(
                    "shard missing: {INDEX_FILE} puts {count} tensor(s) here, e.g. '{example}'"
                ),
            });
        }
        file_index.insert(shard, files.len());
        files.push(SafetensorsFile::open(&path)?);
    }
    let mut location = BTreeMap::new();
    for (tensor, shard) in &shard_of {
        let i = file_index[shard];
        if !files[i].contains(tensor) {
            return Err(bad(format!(
                "weight_map puts tensor '{tensor}' in {shard}, which does not contain it"
            )));
        }
        location.insert(tensor.clone(), i);
    }
    Ok((files, location))
}

/// Every regular `*.safetensors` file directly in `dir`, sorted by name.
fn loose_safetensors(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut paths = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.extension().is_some_and(|x| x == "safetensors") && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths)
}

/// Open every file in `paths`, refusing a tensor name that appears in two of them.
fn open_all(paths: Vec<PathBuf>) -> Result<Opened> {
    let mut files: Vec<SafetensorsFile> = Vec::with_capacity(paths.len());
    let mut location = BTreeMap::new();
    for path in paths {
        let file = SafetensorsFile::open(&path)?;
        for name in file.names() {
            if let Some(&other) = location.get(name) {
                let other: &SafetensorsFile = &files[other];
                return Err(Error::BadFile {
                    path: path.clone(),
                    reason: format!(
                        "tensor '{name}' is also in {}; without an index the files must not overlap",
                        other.path().display()
                    ),
                });
            }
            location.insert(name.to_string(), files.len());
        }
        files.push(file);
    }
    Ok((files, location))
}
