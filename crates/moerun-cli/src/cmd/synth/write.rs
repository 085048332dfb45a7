//! Streaming random weights to safetensors files. A real-size checkpoint is tens of GB, so nothing
//! is held whole: each tensor's bytes are generated in batches of a few tens of MB just before they
//! are appended to the file, and big checkpoints are split into shards with an index, as the Hub
//! does.
//!
//! Values come from SplitMix64 seeded per fixed-size chunk of each tensor (from the user's seed, the
//! tensor's index and the chunk's index), so chunks are generated in parallel and the bytes depend
//! on the seed alone, never on the thread count.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use half::{bf16, f16};
use moerun_core::DType;
use moerun_model::checkpoint::{INDEX_FILE, SINGLE_FILE};
use moerun_model::safetensors::{SafetensorsWriter, TensorSpec};
use rayon::prelude::*;

use super::plan::{Init, Planned};
use crate::cmd::inspect::human_bytes;
use crate::cmd::CliResult;

/// Largest shard the Hub's tooling would write for us; a tensor bigger than this gets a shard of
/// its own.
pub const SHARD_LIMIT: u64 = 4_000_000_000;

/// Elements per independently seeded chunk. Fixed, so the output does not depend on threads.
const CHUNK: usize = 1 << 16;
/// Elements generated before each write: bounds memory (64 MB at f32) while giving every thread
/// many chunks.
const BATCH: usize = 1 << 24;

/// SplitMix64: tiny, fast, and good enough for weights nobody will train.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `0..n` (`n > 0`), by the multiply-shift reduction.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `[0, 1)` with 24 bits, every value exactly representable in f32.
    fn unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
}

/// SplitMix64's output function (a strong 64-bit mixer).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The generator of chunk `chunk` of tensor `tensor`.
fn chunk_rng(seed: u64, tensor: usize, chunk: usize) -> SplitMix64 {
    SplitMix64::new(mix(mix(seed ^ 0x6D6F_6572_756E) ^ tensor as u64) ^ mix(chunk as u64 + 1))
}

/// Fill `out` (whole elements of `dtype`) with values drawn by `init`.
pub(super) fn fill(init: Init, dtype: DType, rng: &mut SplitMix64, out: &mut [u8]) {
    let mut value = || match init {
        Init::Ones => 1.0,
        Init::Zeros => 0.0,
        Init::Uniform(a) => (2.0 * rng.unit_f32() - 1.0) * a,
    };
    match dtype {
        DType::F32 => encode(out, &mut value, f32::to_le_bytes),
        DType::BF16 => encode(out, &mut value, |v| {
            bf16::from_f32(v).to_bits().to_le_bytes()
        }),
        DType::F16 => encode(out, &mut value, |v| {
            f16::from_f32(v).to_bits().to_le_bytes()
        }),
    }
}

fn encode<const N: usize>(
    out: &mut [u8],
    value: &mut impl FnMut() -> f32,
    enc: impl Fn(f32) -> [u8; N],
) {
    for c in out.chunks_exact_mut(N) {
        c.copy_from_slice(&enc(value()));
    }
}

/// One weight file and the tensors (a range of the plan) it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub file: String,
    pub tensors: Range<usize>,
    pub bytes: u64,
}

/// Split the plan into consecutive shards of at most `limit` bytes (a larger tensor alone).
pub fn shards(tensors: &[Planned], dtype: DType, limit: u64) -> Vec<Shard> {
    let mut out: Vec<Shard> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let bytes = (t.numel() * dtype.size()) as u64;
        match out.last_mut() {
            Some(s) if s.bytes + bytes <= limit => {
                s.tensors.end = i + 1;
                s.bytes += bytes;
            }
            _ => out.push(Shard {
                file: String::new(),
                tensors: i..i + 1,
                bytes,
            }),
        }
    }
    let n = out.len();
    for (k, s) in out.iter_mut().enumerate() {
        s.file = if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        };
    }
    out
}

/// What was written.
pub struct Written {
    pub files: usize,
    pub bytes: u64,
}

/// Generate and write every tensor of `tensors` into `dir`, in shards of at most `limit` bytes.
pub fn write_weights(
    dir: &Path,
    tensors: &[Planned],
    dtype: DType,
    seed: u64,
    limit: u64,
) -> CliResult<Written> {
    let start = Instant::now();
    let plan = shards(tensors, dtype, limit);
    let total: u64 = plan.iter().map(|s| s.bytes).sum();
    // Hub checkpoints written from PyTorch carry this; some readers look for it.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut buf = Vec::new();
    let mut written = 0u64;
    for shard in &plan {
        let specs: Vec<TensorSpec> = tensors[shard.tensors.clone()]
            .iter()
            .map(|t| TensorSpec {
                name: t.name.clone(),
                dtype,
                shape: t.shape.clone(),
            })
            .collect();
        let mut writer = SafetensorsWriter::create(dir.join(&shard.file), &specs, Some(&metadata))?;
        for i in shard.tensors.clone() {
            let t = &tensors[i];
            let numel = t.numel();
            for first in (0..numel).step_by(BATCH) {
                let count = BATCH.min(numel - first);
                buf.resize(count * dtype.size(), 0);
                // BATCH is a multiple of CHUNK, so chunk k of the batch is chunk first/CHUNK + k
                // of the tensor whatever the batching.
                buf.par_chunks_mut(CHUNK * dtype.size())
                    .enumerate()
                    .for_each(|(k, out)| {
                        let mut rng = chunk_rng(seed, i, first / CHUNK + k);
                        fill(t.init, dtype, &mut rng, out);
                    });
                writer.write_data(&buf)?;
                written += buf.len() as u64;
            }
            let group_done = tensors.get(i + 1).is_none_or(|next| next.group != t.group);
            if group_done {
                eprintln!(
                    "synth: {} written ({} of {}, {:.1} s)",
                    t.group,
                    human_bytes(written),
                    human_bytes(total),
                    start.elapsed().as_secs_f64()
                );
            }
        }
        writer.finish()?;
    }
    if plan.len() > 1 {
        write_index(dir, tensors, &plan, total)?;
    }
    Ok(Written {
        files: plan.len(),
        bytes: total,
    })
}

/// `model.safetensors.index.json`: which shard holds each tensor.
fn write_index(dir: &Path, tensors: &[Planned], plan: &[Shard], total: u64) -> CliResult {
    let weight_map: BTreeMap<&str, &str> = plan
        .iter()
        .flat_map(|s| {
            tensors[s.tensors.clone()]
                .iter()
                .map(|t| (t.name.as_str(), s.file.as_str()))
        })
        .collect();
    let params: u64 = tensors.iter().map(|t| t.numel() as u64).sum();
    let index = serde_json::json!({
        "metadata": { "total_parameters": params, "total_size": total },
        "weight_map": weight_map,
    });
    super::write_json(&dir.join(INDEX_FILE), &index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(name: &str, numel: usize) -> Planned {
        Planned {
            name: name.into(),
            shape: vec![numel],
            init: Init::Uniform(1.0),
            group: name.into(),
        }
    }

    #[test]
    fn shards_pack_greedily_and_isolate_giants() {
        let t = [
            planned("a", 30),
            planned("b", 30),
            planned("c", 100),
            planned("d", 10),
        ];
        let s = shards(&t, DType::F32, 256);
        let ranges: Vec<_> = s.iter().map(|s| s.tensors.clone()).collect();
        assert_eq!(ranges, vec![0..2, 2..3, 3..4]);
        assert_eq!(s[0].file, "model-00001-of-00003.safetensors");
        assert_eq!(s.iter().map(|s| s.bytes).sum::<u64>(), 170 * 4);
        assert_eq!(shards(&t, DType::F32, 1 << 20)[0].file, SINGLE_FILE);
    }

    #[test]
    fn values_are_uniform_with_the_requested_bound() {
        let mut out = vec![0u8; 4 * 100_000];
        fill(
            Init::Uniform(0.5),
            DType::F32,
            &mut chunk_rng(7, 0, 0),
            &mut out,
        );
        let v: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert!(v.iter().all(|x| x.abs() <= 0.5));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((std - 0.5 / 3f32.sqrt()).abs() < 0.01, "std {std}");
    }

    #[test]
    fn chunks_differ_and_repeat() {
        let draw = |t, c| chunk_rng(1, t, c).next_u64();
        assert_eq!(draw(0, 0), draw(0, 0));
        assert_ne!(draw(0, 0), draw(0, 1));
        assert_ne!(draw(0, 0), draw(1, 0));
        assert!((0..1000).all(|_| SplitMix64::new(3).below(10) < 10));
    }
}
