//! Speed of the CUDA backend's matrix ops against the device's own ceilings: a device-to-device
//! copy (the memory roofline, bytes read + written), the decode GEMV (GB/s of weights streamed)
//! and the cuBLAS prefill GEMM (TFLOP/s). Prints one table.
//!
//! Run: `cargo run --release -p moerun-cuda --example ops_bench` (on a machine with a GPU; with
//! the toolkit libraries on LD_LIBRARY_PATH). Each figure is the median of timed repetitions after
//! warm-ups, timed with CUDA events. Matrices smaller than the L2 cache are cycled through enough
//! copies (>= 512 MiB in all) that every launch reads them from HBM, not L2.

#[path = "bench/attention.rs"]
mod attention;
#[path = "bench/moe.rs"]
mod moe;

use moerun_core::{DType, MatRef};
use moerun_cuda::{CudaDevice, CudaSlice, DeviceMatrix, GemmOut, GemvLayout, Result};

/// Bytes the copies of a small matrix must add up to, so that L2 (60 MiB on H200) cannot hold them.
const ROTATE_BYTES: usize = 512 << 20;
const WARMUP: usize = 3;
const REPS: usize = 15;

/// A small xorshift generator: random weights without depending on `rand` here.
struct XorShift(u64);

impl XorShift {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn bf16_bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|_| half::bf16::from_f32(self.next_f32()).to_le_bytes())
            .collect()
    }
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median milliseconds of one call of `f` (each repetition timed alone, after warm-ups).
fn time(dev: &CudaDevice, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    let mut t = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        t.push(dev.elapsed_ms(&mut f)? as f64);
    }
    Ok(median(t))
}

struct Row {
    op: String,
    shape: String,
    us: f64,
    gbs: Option<f64>,
    tflops: Option<f64>,
}

fn copy_ceiling(dev: &CudaDevice) -> Result<f64> {
    let n = 1usize << 28; // 1 GiB of f32
    let src = dev.zeros::<f32>(n)?;
    let mut dst = dev.zeros::<f32>(n)?;
    let ms = time(dev, || {
        dev.stream()
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| moerun_cuda::CudaError::Unavailable(format!("copy: {e}")))
    })?;
    Ok(2.0 * (n * 4) as f64 / (ms * 1e-3) / 1e9)
}

/// GEMV rows for one weight shape: every batch size in `ms`, both layouts.
fn gemv_rows(
    dev: &CudaDevice,
    rng: &mut XorShift,
    (n, k): (usize, usize),
    ms: &[usize],
) -> Result<Vec<Row>> {
    let bytes = rng.bf16_bytes(n * k);
    let w = MatRef {
        dtype: DType::BF16,
        rows: n,
        cols: k,
        data: &bytes,
    };
    let copies = ROTATE_BYTES.div_ceil(bytes.len()).clamp(1, 64);
    let mats: Vec<DeviceMatrix> = (0..copies)
        .map(|_| dev.upload_matrix(w))
        .collect::<Result<_>>()?;
    let mut rows = Vec::new();
    for &m in ms {
        let x = dev.upload(&rng.f32s(m * k))?;
        let mut out = dev.zeros::<f32>(m * n)?;
        for layout in [GemvLayout::WarpPerRow, GemvLayout::BlockPerRows] {
            // One timed repetition runs every copy once; per launch is that over `copies`.
            let ms_per = time(dev, || {
                mats.iter()
                    .try_for_each(|w| dev.gemv_with(layout, &x, m, w, &mut out))
            })? / copies as f64;
            let bytes_moved = (n * k * 2 + m * k * 4 + m * n * 4) as f64;
            rows.push(Row {
                op: format!("gemv bf16 m={m} {layout:?}"),
                shape: format!("{n}x{k}"),
                us: ms_per * 1e3,
                gbs: Some(bytes_moved / (ms_per * 1e-3) / 1e9),
                tflops: None,
            });
        }
    }
    Ok(rows)
}

fn gemm_row(
    dev: &CudaDevice,
    rng: &mut XorShift,
    (m, n, k): (usize, usize, usize),
    f32_path: bool,
) -> Result<Row> {
    let bytes = rng.bf16_bytes(n * k);
    let w = dev.upload_matrix(MatRef {
        dtype: DType::BF16,
        rows: n,
        cols: k,
        data: &bytes,
    })?;
    let ms = if f32_path {
        let x = dev.upload(&rng.f32s(m * k))?;
        let mut out = dev.zeros::<f32>(m * n)?;
        time(dev, || dev.gemm(&x, m, &w, &mut out))?
    } else {
        let xb: Vec<u16> = rng
            .bf16_bytes(m * k)
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let x: CudaSlice<u16> = dev.upload(&xb)?;
        let mut out = dev.zeros::<u16>(m * n)?;
        time(dev, || dev.gemm_bf16(&x, m, &w, GemmOut::Bf16(&mut out)))?
    };
    Ok(Row {
        op: if f32_path {
            "gemm f32 x -> bf16 -> f32 out".into()
        } else {
            "gemm bf16 -> bf16 out".into()
        },
        shape: format!("{m}x{n}x{k}"),
        us: ms * 1e3,
        gbs: None,
        tflops: Some(2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12),
    })
}

fn main() {
    if let Err(e) = run() {
        eprintln!("ops_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let dev = CudaDevice::open(0)?;
    println!("{}", dev.info());
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let copy = copy_ceiling(&dev)?;
    let mut rows = Vec::new();
    // `ops_bench attention`: the attention rows alone.
    if std::env::args().nth(1).as_deref() == Some("attention") {
        rows.extend(attention::rows(&dev, &mut rng)?);
        print_rows(copy, &rows);
        return Ok(());
    }
    // `ops_bench moe`: the MoE experts rows alone.
    if std::env::args().nth(1).as_deref() == Some("moe") {
        rows.extend(moe::rows(&dev, &mut rng)?);
        print_rows(copy, &rows);
        return Ok(());
    }
    // Decode shapes of Qwen3-30B-A3B (hidden 2048): lm_head, q_proj, o_proj, one expert's
    // gate_proj; and an 18432x7168 dense layer of a larger model.
    for (shape, ms) in [
        ((151936, 2048), &[1usize, 4, 8][..]),
        ((18432, 7168), &[1][..]),
        ((4096, 2048), &[1, 4][..]),
        ((2048, 4096), &[1][..]),
        ((768, 2048), &[1][..]),
    ] {
        rows.extend(gemv_rows(&dev, &mut rng, shape, ms)?);
    }
    for (shape, f32_path) in [
        ((8192, 8192, 8192), false),
        ((2048, 4096, 2048), false),
        ((2048, 4096, 2048), true),
        ((512, 768, 2048), false),
    ] {
        rows.push(gemm_row(&dev, &mut rng, shape, f32_path)?);
    }
    rows.extend(attention::rows(&dev, &mut rng)?);
    rows.extend(moe::rows(&dev, &mut rng)?);
    print_rows(copy, &rows);
    Ok(())
}

fn print_rows(copy: f64, rows: &[Row]) {
    println!();
    println!("device-to-device copy: {copy:.0} GB/s (read + written), the memory ceiling below");
    println!(
        "{:<36} {:>16} {:>10} {:>8} {:>7} {:>8}",
        "op", "shape", "time_us", "GB/s", "%copy", "TFLOP/s"
    );
    for r in rows {
        let (gbs, pct) = match r.gbs {
            Some(g) => (format!("{g:.0}"), format!("{:.0}%", 100.0 * g / copy)),
            None => ("-".into(), "-".into()),
        };
        let tf = r.tflops.map_or("-".into(), |t| format!("{t:.0}"));
        println!(
            "{:<36} {:>16} {:>10.1} {:>8} {:>7} {:>8}",
            r.op, r.shape, r.us, gbs, pct, tf
        );
    }
}
