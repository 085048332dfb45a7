//! Tests of `linear::matmul_t` on every SIMD path the machine supports: accuracy against an f64
//! reference, bitwise batch invariance (GEMV and GEMM paths agree), and bitwise independence
//! from the thread count.

use half::{bf16, f16};
use moerun_core::{tensor::widen_into, DType, MatRef};
use moerun_cpu::linear::{matmul_t, matmul_t_isa};
use moerun_cpu::simd::{self, available_isas, Isa};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Small deterministic generator (xorshift64*), so failures reproduce without a rand dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Uniform in [-1, 1).
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// `values` stored as `dtype` (little-endian bytes), rounded to the nearest representable value.
fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
    }
}

/// A random `[n, k]` weight matrix stored as `dtype`.
fn weights(dtype: DType, n: usize, k: usize, seed: u64) -> Vec<u8> {
    encode(dtype, &Rng::new(seed).vec(n * k))
}

fn mat(dtype: DType, n: usize, k: usize, data: &[u8]) -> MatRef<'_> {
    MatRef {
        dtype,
        rows: n,
        cols: k,
        data,
    }
}

fn product(isa: Isa, x: &[f32], m: usize, w: MatRef<'_>) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    matmul_t_isa(isa, x, m, w, &mut out);
    out
}

/// Worst error of `got` against an f64 reference, relative to `sum_k |x_ik * w_jk|` (the scale
/// of the rounding errors a dot product can make, which stays meaningful under cancellation).
fn worst_relative_error(x: &[f32], m: usize, w: MatRef<'_>, got: &[f32]) -> f64 {
    let (n, k) = (w.rows, w.cols);
    let mut wf = vec![0.0f32; n * k];
    widen_into(w.dtype, w.data, &mut wf);
    let mut worst = 0.0f64;
    for i in 0..m {
        for j in 0..n {
            let (mut dot, mut scale) = (0.0f64, 0.0f64);
            for t in 0..k {
                let p = f64::from(x[i * k + t]) * f64::from(wf[j * k + t]);
                dot += p;
                scale += p.abs();
            }
            let err = (f64::from(got[i * n + j]) - dot).abs() / scale.max(f64::MIN_POSITIVE);
            worst = worst.max(err);
        }
    }
    worst
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn products_match_an_f64_reference_for_every_dtype_and_path() {
    // Awkward sizes: k around and between multiples of 8/16/32/64, n not a multiple of any tile
    // width, m covering the streaming (<= 4) and packed paths and ragged tile heights.
    let ks = [1, 7, 15, 16, 17, 33, 64, 100, 129, 300, 1000];
    let ns = [1, 5, 23, 50, 97];
    let ms = [1, 2, 3, 4, 5, 6, 7, 9, 13, 32, 37, 40, 130];
    for isa in available_isas() {
        for dtype in DTYPES {
            for (case, (&k, &n)) in ks
                .iter()
                .flat_map(|k| ns.iter().map(move |n| (k, n)))
                .enumerate()
            {
                let m = ms[case % ms.len()];
                let data = weights(dtype, n, k, case as u64);
                let w = mat(dtype, n, k, &data);
                let x = Rng::new(1000 + case as u64).vec(m * k);
                let out = product(isa, &x, m, w);
                let err = worst_relative_error(&x, m, w, &out);
                assert!(
                    err <= 1e-5,
                    "{isa} {dtype} m={m} n={n} k={k}: relative error {err:e}"
                );
            }
        }
    }
}

#[test]
fn every_batch_size_from_1_to_40_and_130_is_accurate() {
    let (n, k) = (31, 203);
    for isa in available_isas() {
        for dtype in DTYPES {
            let data = weights(dtype, n, k, 7);
            let w = mat(dtype, n, k, &data);
            for m in (1..=40).chain([130]) {
                let x = Rng::new(m as u64).vec(m * k);
                let out = product(isa, &x, m, w);
                let err = worst_relative_error(&x, m, w, &out);
                assert!(err <= 1e-5, "{isa} {dtype} m={m}: relative error {err:e}");
            }
        }
    }
}

#[test]
fn gemm_rows_match_gemv_bitwise() {
    // Row i of an m = 37 or m = 100 product (packed GEMM path; 100 rows span several x blocks)
    // equals the m = 1 product of x row i (streaming GEMV path), bit for bit. k = 2048 and 1000
    // take several passes over k with parked accumulators; 77 and 5 leave a ragged tail.
    for isa in available_isas() {
        for dtype in DTYPES {
            for (m, n, k) in [
                (37, 53, 1000),
                (37, 29, 77),
                (37, 100, 2048),
                (37, 8, 5),
                (100, 30, 1100),
            ] {
                let data = weights(dtype, n, k, (n * k) as u64);
                let w = mat(dtype, n, k, &data);
                let x = Rng::new(3).vec(m * k);
                let batch = product(isa, &x, m, w);
                for i in 0..m {
                    let single = product(isa, &x[i * k..(i + 1) * k], 1, w);
                    assert!(
                        same_bits(&batch[i * n..(i + 1) * n], &single),
                        "{isa} {dtype} n={n} k={k}: row {i} of the batch differs from GEMV"
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_gets_the_same_bits_in_every_batch_size_and_position() {
    // The rows of an m = 40 batch, recomputed inside every smaller batch (streaming for m <= 4,
    // packed above, ragged tile heights), and also shifted to a different position among
    // different neighbours.
    let (n, k, big) = (45, 333, 40);
    for isa in available_isas() {
        for dtype in DTYPES {
            let data = weights(dtype, n, k, 11);
            let w = mat(dtype, n, k, &data);
            let x = Rng::new(5).vec(big * k);
            let reference = product(isa, &x, big, w);
            for m in 1..big {
                let out = product(isa, &x[..m * k], m, w);
                assert!(
                    same_bits(&out, &reference[..m * n]),
                    "{isa} {dtype}: a batch of {m} differs from the first {m} rows of {big}"
                );
            }
            // Rows 10..17 of the big batch, preceded by 3 unrelated rows.
            let mut shifted = Rng::new(99).vec(3 * k);
            shifted.extend_from_slice(&x[10 * k..17 * k]);
            let out = product(isa, &shifted, 10, w);
            assert!(
                same_bits(&out[3 * n..], &reference[10 * n..17 * n]),
                "{isa} {dtype}: rows changed when their neighbours changed"
            );
        }
    }
}

#[test]
fn thread_count_does_not_change_bits() {
    // Large enough that both the streaming and the packed path split into several tasks.
    let (n, k) = (2000, 300);
    for isa in available_isas() {
        for dtype in DTYPES {
            let data = weights(dtype, n, k, 21);
            let w = mat(dtype, n, k, &data);
            for m in [1, 3, 37] {
                let x = Rng::new(m as u64).vec(m * k);
                let results: Vec<Vec<f32>> = [1, 2, 3]
                    .into_iter()
                    .map(|threads| {
                        let pool = rayon::ThreadPoolBuilder::new()
                            .num_threads(threads)
                            .build()
                            .unwrap();
                        pool.install(|| product(isa, &x, m, w))
                    })
                    .collect();
                assert!(
                    same_bits(&results[0], &results[1]),
                    "{isa} {dtype} m={m}: 1 vs 2"
                );
                assert!(
                    same_bits(&results[0], &results[2]),
                    "{isa} {dtype} m={m}: 1 vs 3"
                );
            }
        }
    }
}

#[test]
fn unaligned_weight_bytes_give_the_same_bits() {
    // Stored tensors (e.g. inside a safetensors mapping) need not be aligned to their element
    // size; the kernels load them unaligned.
    let (n, k) = (19, 150);
    for isa in available_isas() {
        for dtype in DTYPES {
            let data = weights(dtype, n, k, 4);
            let mut shifted = vec![0u8; data.len() + 1];
            shifted[1..].copy_from_slice(&data);
            for m in [1, 9] {
                let x = Rng::new(8).vec(m * k);
                let aligned = product(isa, &x, m, mat(dtype, n, k, &data));
                let unaligned = product(isa, &x, m, mat(dtype, n, k, &shifted[1..]));
                assert!(same_bits(&aligned, &unaligned), "{isa} {dtype} m={m}");
            }
        }
    }
}

#[test]
fn empty_dimensions_are_handled() {
    for isa in available_isas() {
        for dtype in DTYPES {
            // k = 0: every dot product is empty, so zero.
            let out = product(isa, &[], 3, mat(dtype, 4, 0, &[]));
            assert!(out.iter().all(|&v| v == 0.0), "{isa} {dtype}");
            // m = 0 and n = 0: nothing to write.
            assert!(product(isa, &[], 0, mat(dtype, 4, 8, &vec![0; 32 * dtype.size()])).is_empty());
            assert!(product(isa, &[1.0; 24], 3, mat(dtype, 0, 8, &[])).is_empty());
        }
    }
}

#[test]
#[should_panic(expected = "x must hold")]
fn a_short_x_panics() {
    let data = weights(DType::F32, 4, 8, 1);
    matmul_t(&[0.0; 7], 1, mat(DType::F32, 4, 8, &data), &mut [0.0; 4]);
}

#[test]
#[should_panic(expected = "out must hold")]
fn a_short_out_panics() {
    let data = weights(DType::BF16, 4, 8, 1);
    matmul_t(&[0.0; 8], 1, mat(DType::BF16, 4, 8, &data), &mut [0.0; 3]);
}

#[test]
#[should_panic(expected = "w.data size")]
fn a_wrong_weight_size_panics() {
    let data = weights(DType::F16, 4, 8, 1);
    matmul_t(&[0.0; 7], 1, mat(DType::F16, 4, 7, &data), &mut [0.0; 4]);
}

#[test]
fn isa_detection_and_forcing_work() {
    // The only test touching the process-wide override or the default-path entry point.
    let best = simd::detected();
    assert_eq!(simd::active_isa(), best.name());
    assert!(available_isas().contains(&Isa::Scalar));
    assert_eq!(available_isas().last(), Some(&best));
    for isa in Isa::ALL {
        assert_eq!(Isa::parse(isa.name()), Some(isa));
        assert_eq!(simd::force_isa(Some(isa)).is_ok(), isa.is_supported());
    }
    simd::force_isa(Some(Isa::Scalar)).unwrap();
    assert_eq!(simd::active_isa(), "scalar");
    let (n, k) = (5, 40);
    let data = weights(DType::BF16, n, k, 2);
    let w = mat(DType::BF16, n, k, &data);
    let x = Rng::new(2).vec(k);
    let mut out = vec![0.0; n];
    matmul_t(&x, 1, w, &mut out);
    assert!(same_bits(&out, &product(Isa::Scalar, &x, 1, w)));
    simd::force_isa(None).unwrap();
    assert_eq!(simd::active_isa(), best.name());
    matmul_t(&x, 1, w, &mut out);
    assert!(same_bits(&out, &product(best, &x, 1, w)));
}

#[test]
fn read_bandwidth_probe_reports_a_plausible_rate() {
    let rate = moerun_cpu::bandwidth::measure_read_bandwidth(16 << 20, 2);
    // Anything from 100 MB/s to 10 TB/s is "plausible" for a 16 MiB buffer; this checks units.
    assert!((1e8..1e13).contains(&rate), "{rate} B/s");
}
