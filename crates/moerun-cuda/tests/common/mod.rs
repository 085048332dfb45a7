//! Shared by the GPU test binaries: one device per process (or the reason there is none), fresh
//! random inputs with a printed seed, the norm-wise relative error, and the `RESULT` line that
//! scripts/gpu-check.sh collects into its table.

#![allow(dead_code)] // each test binary uses its own subset

use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use half::{bf16, f16};
use moerun_core::{DType, MatRef};
use moerun_cuda::{CudaDevice, CudaSlice, DeviceMatrix};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The device every test of this binary shares, or `None` after printing why the test is
/// skipped. Without a GPU every test passes by skipping.
pub fn device() -> Option<&'static CudaDevice> {
    static DEVICE: OnceLock<Result<CudaDevice, String>> = OnceLock::new();
    match DEVICE.get_or_init(|| CudaDevice::open(0).map_err(|e| e.to_string())) {
        Ok(d) => Some(d),
        Err(reason) => {
            println!("skipped: {reason}");
            None
        }
    }
}

/// The tests of a binary share one device and so one stream. A test that needs them alone holds
/// [`device_alone`], the others [`device_shared`]: a graph capture on the stream takes in whatever
/// any thread enqueues meanwhile (uploads from pageable memory, which a capture refuses, other
/// tests' kernels, their allocations: tests/moe.rs failed about one run in three at the default
/// test threads without this, with a SIGSEGV, CUDA_ERROR_ILLEGAL_STATE in a capture or
/// CUDA_ERROR_INVALID_VALUE in an allocation), and a device-wide setting switched in one test
/// (tests/attention.rs's `set_attention_wgmma`) changes what another compares bit for bit.
static DEVICE_TURNS: RwLock<()> = RwLock::new(());

/// Held by a test that uses the shared device beside others (see [`DEVICE_TURNS`]).
pub fn device_shared() -> RwLockReadGuard<'static, ()> {
    // A test that panicked while holding it leaves nothing inconsistent: the lock guards no data.
    DEVICE_TURNS
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Held by a test that needs the shared device alone (see [`DEVICE_TURNS`]).
pub fn device_alone() -> RwLockWriteGuard<'static, ()> {
    DEVICE_TURNS
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A generator seeded from the clock (fresh inputs every run), printing its seed so a failure
/// can be replayed with `MOERUN_TEST_SEED`.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("MOERUN_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in `[lo, hi)`.
pub fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A host buffer of NaNs: outputs start poisoned, so an element the kernel never wrote fails.
#[allow(dead_code)] // not every test binary writes f32 outputs through it
pub fn poison(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

/// `‖out − want‖₂ / ‖want‖₂`, in f64; NaN anywhere gives NaN (which never passes).
pub fn rel_err(out: &[f32], want: &[f64]) -> f64 {
    assert_eq!(out.len(), want.len(), "lengths");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&o, &w) in out.iter().zip(want) {
        num += (o as f64 - w) * (o as f64 - w);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Print the `RESULT` line for the summary table, then assert `err <= tol` (NaN fails).
pub fn check(op: &str, err: f64, tol: f64) {
    let verdict = if err <= tol { "PASS" } else { "FAIL" };
    println!("RESULT|{op}|{err:.3e}|{tol:.0e}|{verdict}");
    assert!(err <= tol, "{op}: relative error {err:e} over {tol:e}");
}

/// `values` stored as `dtype` (little-endian, as the loaders upload weights).
pub fn stored(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// `values` (rows of `values.len() / rows`) stored as `dtype` on the device.
pub fn matrix(dev: &CudaDevice, values: &[f32], dtype: DType, rows: usize) -> DeviceMatrix {
    let bytes = stored(values, dtype);
    dev.upload_matrix(MatRef {
        dtype,
        rows,
        cols: values.len() / rows,
        data: &bytes,
    })
    .unwrap()
}

/// The bit patterns of a device buffer's values.
pub fn bits_of(dev: &CudaDevice, b: &CudaSlice<f32>) -> Vec<u32> {
    dev.download(b)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// f32 values as the f64 reference `rel_err` takes.
pub fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// [`rel_err`] of two device buffers: `got` against `want`.
pub fn rel_err_on(dev: &CudaDevice, got: &CudaSlice<f32>, want: &CudaSlice<f32>) -> f64 {
    rel_err(
        &dev.download(got).unwrap(),
        &widen(&dev.download(want).unwrap()),
    )
}
