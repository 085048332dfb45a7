//! Reading and writing the safetensors format: an 8-byte little-endian header length `N`, `N` bytes
//! of JSON naming each tensor's dtype, shape and `data_offsets` (relative to the data region), then
//! the data region itself.
//!
//! [`SafetensorsFile::open`] maps the file and validates the whole header before returning, so a
//! damaged or truncated file fails at open with one line naming the file and the problem, never later
//! and never with a panic. Tensors borrow the mapping: [`SafetensorsFile::tensor`] copies nothing.
//! Tensors whose dtype moerun does not compute with (integer buffers, f64, fp8...) are validated like
//! the others but only fail when accessed, because real checkpoints carry such buffers next to the
//! weights. [`SafetensorsWriter`] streams a file to disk tensor by tensor, so a synthetic checkpoint
//! of tens of GB never has to exist in memory as a whole.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use moerun_core::{DType, Error, Result, SharedBytes, Tensor};
use serde_json::{Map, Value};

/// Largest header accepted. Real headers are well under 10 MB; a larger claim means garbage.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The key under which a safetensors header keeps its free-form string metadata.
const METADATA_KEY: &str = "__metadata__";

/// Bits per element of every dtype the safetensors format defines, supported by moerun or not.
/// Knowing the width of unsupported dtypes lets open validate their byte length too.
fn dtype_bits(name: &str) -> Option<usize> {
    Some(match name {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// Where one tensor lives in a safetensors file, as its header describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The dtype as spelled in the header (`"BF16"`, `"I64"`...), supported by moerun or not.
    pub dtype: String,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Byte range `[begin, end)` relative to the start of the data region.
    pub data_offsets: (usize, usize),
}

impl TensorInfo {
    /// Number of bytes the tensor occupies.
    pub fn byte_len(&self) -> usize {
        self.data_offsets.1 - self.data_offsets.0
    }

    /// The moerun dtype, or `None` when moerun does not compute with this one.
    pub fn moerun_dtype(&self) -> Option<DType> {
        DType::from_safetensors(&self.dtype)
    }
}

/// A validated, memory-mapped safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    /// The mapping every tensor borrows; cloned (cheaply) into each [`Tensor`]'s bytes: the file
    /// itself, or its copy in anonymous memory ([`SafetensorsFile::copy_to_memory`]).
    mmap: Arc<Mmap>,
    /// Absolute byte offset of the data region (8 + header length).
    data_start: usize,
    /// Tensor names in on-disk order (by data offset), for deterministic iteration.
    order: Vec<String>,
    tensors: HashMap<String, TensorInfo>,
    metadata: HashMap<String, String>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SafetensorsFile({}, {} tensors)",
            self.path.display(),
            self.order.len()
        )
    }
}

impl SafetensorsFile {
    /// Replace the file mapping by a copy of the file in anonymous memory, advised to be backed
    /// by huge pages. Tensors made afterwards borrow the copy. Why: on the machines measured,
    /// streaming weights out of the page cache ran at about half the memory bandwidth that the
    /// same bytes in anonymous memory reach (docs/perf/cpu-engine.md: decode 12-15 -> 22-26
    /// tok/s), the cost of page-cache pages (4 KiB, file-backed) against huge anonymous pages.
    pub fn copy_to_memory(&mut self) -> Result<()> {
        let io = |e| Error::io(&self.path, e);
        let mut anon = memmap2::MmapMut::map_anon(self.mmap.len()).map_err(io)?;
        #[cfg(target_os = "linux")]
        {
            // Only advice: without transparent huge pages the copy still works, on 4 KiB pages.
            let _ = anon.advise(memmap2::Advice::HugePage);
        }
        // Copy in parallel chunks: reading the file's pages (from disk the first time) and
        // writing the copy both go faster on every core.
        use rayon::prelude::*;
        const CHUNK: usize = 64 << 20;
        anon.par_chunks_mut(CHUNK)
            .zip(self.mmap.par_chunks(CHUNK))
            .for_each(|(dst, src)| dst.copy_from_slice(src));
        self.mmap = Arc::new(anon.make_read_only().map_err(io)?);
        Ok(())
    }

    /// Bytes of the whole file.
    pub fn file_len(&self) -> usize {
        self.mmap.len()
    }

    /// Map `path` and validate its header; every problem is reported here, naming the file.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
        let bad = |reason: String| Error::BadFile {
            path: path.clone(),
            reason,
        };
        let too_short = |len: u64| {
            bad(format!(
                "file is {len} bytes, too short to hold the 8-byte header length"
            ))
        };
        // Checked before mapping: an empty file cannot be mapped on every platform, and a file
        // without the length prefix is not worth mapping.
        if file_len < 8 {
            return Err(too_short(file_len));
        }
        // SAFETY: the mapping is read-only and shared by the tensors for their whole life. Like every
        // mmap-based loader we assume the checkpoint is not truncated or rewritten while it is in
        // use; that is the price of loading tens of GB without copying them.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let bytes: &[u8] = &mmap;
        // From here on only the mapped length counts: the file may have changed since metadata().
        let Some(prefix) = bytes.first_chunk::<8>() else {
            return Err(too_short(bytes.len() as u64));
        };
        let header_len = u64::from_le_bytes(*prefix);
        let after_prefix = (bytes.len() - 8) as u64;
        if header_len > after_prefix {
            return Err(bad(format!(
                "header claims {header_len} bytes but the file has only {after_prefix} after the \
                 8-byte length prefix (truncated, or not a safetensors file)"
            )));
        }
        if header_len > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "header claims {header_len} bytes, more than the {MAX_HEADER_BYTES}-byte limit \
                 (not a safetensors file?)"
            )));
        }
        // Both fit in usize now: header_len <= 100 MB and the file is mapped in our address space.
        let data_start = 8 + header_len as usize;
        let header = std::str::from_utf8(&bytes[8..data_start])
            .map_err(|e| bad(format!("header is not valid UTF-8: {e}")))?;
        let root: Value = serde_json::from_str(header)
            .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let Value::Object(entries) = root else {
            return Err(bad(format!(
                "header is JSON {} but must be an object",
                json_kind(&root)
            )));
        };
        let data_len = bytes.len() - data_start;
        let parsed = parse_header(entries, data_len).map_err(bad)?;
        Ok(SafetensorsFile {
            path,
            mmap: Arc::new(mmap),
            data_start,
            order: parsed.order,
            tensors: parsed.tensors,
            metadata: parsed.metadata,
        })
    }

    /// The file this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names in on-disk order.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.order.iter().map(String::as_str)
    }

    /// Number of tensors in the file.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether the file holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether the file holds a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Dtype, shape and offsets of `name`, without touching its bytes.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The header's `__metadata__` map (empty when absent).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// Total bytes of all tensors' data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.byte_len() as u64).sum()
    }

    /// Tensor `name`, borrowing the file mapping (no copy). Fails if absent or of a dtype moerun
    /// does not compute with.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        let dtype = info.moerun_dtype().ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: tensor '{name}' has dtype {}; moerun computes with F32, BF16 and F16 only",
                self.path.display(),
                info.dtype
            ))
        })?;
        let (begin, end) = info.data_offsets;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.mmap.clone();
        // Bounds were validated at open; this can only fail if that validation has a bug.
        let bytes =
            SharedBytes::new(owner, self.data_start + begin, end - begin).ok_or_else(|| {
                Error::BadFile {
                    path: self.path.clone(),
                    reason: format!("tensor '{name}' lies outside the mapped file"),
                }
            })?;
        Tensor::new(dtype, info.shape.clone(), bytes)
    }
}

/// A one-word description of a JSON value's type, for error messages.
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The validated content of a header.
struct ParsedHeader {
    order: Vec<String>,
    tensors: HashMap<String, TensorInfo>,
    metadata: HashMap<String, String>,
}

/// Validate every entry of a header against a data region of `data_len` bytes. Errors are the
/// reason part of a [`Error::BadFile`].
fn parse_header(entries: Map<String, Value>, data_len: usize) -> Result<ParsedHeader, String> {
    let mut tensors = HashMap::with_capacity(entries.len());
    let mut metadata = HashMap::new();
    for (name, entry) in entries {
        if name == METADATA_KEY {
            metadata = parse_metadata(entry)?;
            continue;
        }
        let info = parse_entry(&name, &entry, data_len)?;
        tensors.insert(name, info);
    }
    let mut order: Vec<String> = tensors.keys().cloned().collect();
    order.sort_by(|a, b| {
        tensors[a]
            .data_offsets
            .cmp(&tensors[b].data_offsets)
            .then(a.cmp(b))
    });
    // Overlapping tensors mean a corrupt header (each writer lays tensors out back to back). Gaps
    // are tolerated: they are harmless and the format does not forbid padding.
    for pair in order.windows(2) {
        let (a, b) = (&tensors[&pair[0]], &tensors[&pair[1]]);
        if b.data_offsets.0 < a.data_offsets.1 {
            return Err(format!(
                "tensors '{}' and '{}' overlap in the data region",
                pair[0], pair[1]
            ));
        }
    }
    Ok(ParsedHeader {
        order,
        tensors,
        metadata,
    })
}

/// Parse `__metadata__`, which the format defines as a string-to-string map.
fn parse_metadata(entry: Value) -> Result<HashMap<String, String>, String> {
    let Value::Object(map) = entry else {
        return Err(format!(
            "{METADATA_KEY} is {} but must be an object",
            json_kind(&entry)
        ));
    };
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            other => Err(format!(
                "{METADATA_KEY} key '{k}' holds {} but values must be strings",
                json_kind(&other)
            )),
        })
        .collect()
}

/// Parse and check one tensor entry: fields present and well-typed, offsets inside the data region,
/// byte length consistent with shape and dtype.
fn parse_entry(name: &str, entry: &Value, data_len: usize) -> Result<TensorInfo, String> {
    let Value::Object(fields) = entry else {
        return Err(format!(
            "tensor '{name}': entry is {} but must be an object",
            json_kind(entry)
        ));
    };
    let field = |key: &str| {
        fields
            .get(key)
            .ok_or_else(|| format!("tensor '{name}': missing field '{key}'"))
    };
    let dtype = field("dtype")?
        .as_str()
        .ok_or_else(|| format!("tensor '{name}': 'dtype' must be a string"))?
        .to_string();
    let shape = usize_array(field("shape")?).ok_or_else(|| {
        format!("tensor '{name}': 'shape' must be an array of non-negative integers")
    })?;
    let offsets = usize_array(field("data_offsets")?)
        .filter(|o| o.len() == 2)
        .ok_or_else(|| {
            format!(
                "tensor '{name}': 'data_offsets' must be two non-negative integers [begin, end]"
            )
        })?;
    let (begin, end) = (offsets[0], offsets[1]);
    if begin > end {
        return Err(format!(
            "tensor '{name}': data_offsets [{begin}, {end}] end before they begin"
        ));
    }
    if end > data_len {
        return Err(format!(
            "tensor '{name}' ends at byte {end} but the data region has {data_len} (truncated file?)"
        ));
    }
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("tensor '{name}': shape {shape:?} overflows the element count"))?;
    // An unknown dtype (newer than this reader) cannot be length-checked; it still fails cleanly
    // when accessed, like any other unsupported dtype.
    if let Some(bits) = dtype_bits(&dtype) {
        let total_bits = numel
            .checked_mul(bits)
            .ok_or_else(|| format!("tensor '{name}': shape {shape:?} overflows the byte count"))?;
        if total_bits % 8 != 0 || total_bits / 8 != end - begin {
            return Err(format!(
                "tensor '{name}': shape {shape:?} of {dtype} needs {} bytes but data_offsets \
                 [{begin}, {end}] span {}",
                total_bits.div_ceil(8),
                end - begin
            ));
        }
    }
    Ok(TensorInfo {
        dtype,
        shape,
        data_offsets: (begin, end),
    })
}

/// A JSON array of integers that fit in `usize`, or `None`.
fn usize_array(v: &Value) -> Option<Vec<usize>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
        .collect()
}

/// What [`SafetensorsWriter`] needs to know of a tensor before its bytes arrive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name; must be unique within the file and not `__metadata__`.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Row-major shape.
    pub shape: Vec<usize>,
}

/// Streams a safetensors file to disk: the header is written from the specs up front, then the
/// tensors' bytes are appended in spec order, in chunks of any size.
///
/// Dropping the writer before [`finish`](Self::finish) leaves a short file, which
/// [`SafetensorsFile::open`] rejects as truncated.
pub struct SafetensorsWriter {
    path: PathBuf,
    out: BufWriter<File>,
    /// Bytes the data region must hold in total.
    expected: u64,
    /// Bytes of the data region written so far.
    written: u64,
}

impl std::fmt::Debug for SafetensorsWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SafetensorsWriter({}, {} of {} data bytes)",
            self.path.display(),
            self.written,
            self.expected
        )
    }
}

impl SafetensorsWriter {
    /// Create `path` and write the header for `specs` (in data order) and optional metadata.
    pub fn create(
        path: impl AsRef<Path>,
        specs: &[TensorSpec],
        metadata: Option<&HashMap<String, String>>,
    ) -> Result<SafetensorsWriter> {
        let path = path.as_ref().to_path_buf();
        let invalid = |msg: String| Error::InvalidArgument(format!("{}: {msg}", path.display()));
        let mut header = Map::new();
        if let Some(meta) = metadata {
            let meta: Map<String, Value> = meta
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            header.insert(METADATA_KEY.to_string(), Value::Object(meta));
        }
        let mut offset: usize = 0;
        let mut seen = HashSet::new();
        for spec in specs {
            if spec.name == METADATA_KEY {
                return Err(invalid(format!("'{METADATA_KEY}' cannot name a tensor")));
            }
            if !seen.insert(spec.name.as_str()) {
                return Err(invalid(format!("tensor '{}' is listed twice", spec.name)));
            }
            let len = spec
                .shape
                .iter()
                .try_fold(spec.dtype.size(), |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| invalid(format!("tensor '{}': shape overflows", spec.name)))?;
            let end = offset
                .checked_add(len)
                .ok_or_else(|| invalid("total size overflows".to_string()))?;
            let entry = serde_json::json!({
                "dtype": spec.dtype.safetensors_name(),
                "shape": spec.shape,
                "data_offsets": [offset, end],
            });
            header.insert(spec.name.clone(), entry);
            offset = end;
        }
        let mut header = Value::Object(header).to_string().into_bytes();
        // Spaces are valid JSON whitespace; padding to 8 keeps the data region 8-byte aligned.
        header.resize(header.len().next_multiple_of(8), b' ');
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&header))
            .map_err(|e| Error::io(&path, e))?;
        Ok(SafetensorsWriter {
            path,
            out,
            expected: offset as u64,
            written: 0,
        })
    }

    /// Append the next `bytes` of the data region (tensors back to back, in spec order).
    pub fn write_data(&mut self, bytes: &[u8]) -> Result<()> {
        let after = self.written + bytes.len() as u64;
        if after > self.expected {
            return Err(Error::InvalidArgument(format!(
                "{}: {after} data bytes written but the header announced {}",
                self.path.display(),
                self.expected
            )));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(&self.path, e))?;
        self.written = after;
        Ok(())
    }

    /// Check that every announced byte was written, and flush the file.
    pub fn finish(mut self) -> Result<()> {
        if self.written != self.expected {
            return Err(Error::InvalidArgument(format!(
                "{}: only {} of the {} announced data bytes were written",
                self.path.display(),
                self.written,
                self.expected
            )));
        }
        // Flushing here, not in drop, is what lets a late write error (disk full) reach the caller.
        // No fsync: a benchmark checkpoint of tens of GB is read back at once from the page cache.
        self.out.flush().map_err(|e| Error::io(&self.path, e))
    }
}

/// Write `tensors` (in order, contiguous) and optional metadata to a safetensors file at `path`.
pub fn write_safetensors<S: AsRef<str>>(
    path: impl AsRef<Path>,
    tensors: &[(S, &Tensor)],
    metadata: Option<&HashMap<String, String>>,
) -> Result<()> {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(name, t)| TensorSpec {
            name: name.as_ref().to_string(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    let mut writer = SafetensorsWriter::create(path, &specs, metadata)?;
    for (_, t) in tensors {
        writer.write_data(t.bytes())?;
    }
    writer.finish()
}
