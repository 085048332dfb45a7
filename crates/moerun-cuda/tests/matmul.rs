//! The decode GEMV and the cuBLAS prefill GEMM against an f64 reference over the same stored
//! weights, on fresh random inputs.
//!
//! Thresholds (norm-wise relative error):
//! - GEMV, either layout, any weight dtype, f32 activations: 1e-5. The weights are widened exactly, so only the
//!   f32 summation order separates it from the f64 reference.
//! - GEMM with bf16 weights against the f32-activation reference: 1e-2, because the GEMM rounds
//!   the activations to bf16 (2⁻⁹ relative per element) before the tensor cores see them. Against
//!   a reference fed the same bf16-rounded activations: 1e-5 (this pins the layout and accuracy
//!   of the cuBLAS call itself).
//! - GEMM with a bf16 output: 1e-2 (the output is rounded to bf16 as well).
//! - GEMM with f32 weights (f32 SGEMM, no TF32): 1e-5.

mod common;

use common::{check, device, poison, rel_err, rng, stored, uniform};
use half::bf16;
use moerun_core::{DType, MatRef};
use moerun_cuda::{CudaError, GemmOut, GemvLayout};

const LAYOUTS: [GemvLayout; 2] = [GemvLayout::WarpPerRow, GemvLayout::BlockPerRows];

/// Stored bytes of `values` in `dtype`, and the values as the device will see them (widened).
fn store(values: &[f32], dtype: DType) -> (Vec<u8>, Vec<f32>) {
    let bytes = stored(values, dtype);
    let mut widened = vec![0.0; values.len()];
    moerun_core::tensor::widen_into(dtype, &bytes, &mut widened);
    (bytes, widened)
}

/// `x[m, k] · w[n, k]ᵀ` in f64.
fn matmul_f64(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (xr, wr) = (&x[i * k..][..k], &w[j * k..][..k]);
            out[i * n + j] = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
        }
    }
    out
}

fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

#[test]
fn gemv_matches_f64_reference_for_every_dtype_and_batch_size() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemv");
    // (n, k): n not a multiple of the 8 rows per block; k = 40 leaves most lanes idle and skips
    // the unrolled loop; k = 2056 ends in a partial unrolled step.
    for (dtype, n, k) in [
        (DType::BF16, 1000usize, 2048usize),
        (DType::BF16, 77, 40),
        (DType::BF16, 300, 2056),
        (DType::F16, 500, 1024),
        (DType::F32, 333, 516),
    ] {
        let (bytes, w) = store(&uniform(&mut r, n * k, -1.0, 1.0), dtype);
        let wd = dev
            .upload_matrix(MatRef {
                dtype,
                rows: n,
                cols: k,
                data: &bytes,
            })
            .unwrap();
        for m in [1usize, 3, 8, 11] {
            let x = uniform(&mut r, m * k, -1.0, 1.0);
            let xd = dev.upload(&x).unwrap();
            let want = matmul_f64(&x, m, &w, n, k);
            for layout in LAYOUTS {
                let mut out = dev.upload(&poison(m * n)).unwrap();
                dev.gemv_with(layout, &xd, m, &wd, &mut out).unwrap();
                let got = dev.download(&out).unwrap();
                check(
                    &format!("gemv {layout:?} {dtype} {n}x{k} m={m}"),
                    rel_err(&got, &want),
                    1e-5,
                );
            }
        }
    }
}

#[test]
fn gemv_rows_do_not_depend_on_the_batch() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemv_batch_invariance");
    let (n, k) = (257usize, 1024usize);
    let (bytes, _) = store(&uniform(&mut r, n * k, -1.0, 1.0), DType::BF16);
    let w = MatRef {
        dtype: DType::BF16,
        rows: n,
        cols: k,
        data: &bytes,
    };
    let wd = dev.upload_matrix(w).unwrap();
    let x = uniform(&mut r, 7 * k, -1.0, 1.0);
    let xd = dev.upload(&x).unwrap();
    for layout in LAYOUTS {
        let mut batched = dev.zeros::<f32>(7 * n).unwrap();
        dev.gemv_with(layout, &xd, 7, &wd, &mut batched).unwrap();
        let batched = dev.download(&batched).unwrap();
        for i in 0..7 {
            let mut alone = dev.zeros::<f32>(n).unwrap();
            let xi = dev.upload(&x[i * k..][..k]).unwrap();
            dev.gemv_with(layout, &xi, 1, &wd, &mut alone).unwrap();
            assert_eq!(
                dev.download(&alone).unwrap(),
                &batched[i * n..][..n],
                "{layout:?} row {i}"
            );
        }
    }
}

#[test]
fn gemm_bf16_matches_reference_within_activation_rounding() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemm_bf16");
    for (m, n, k) in [
        (64usize, 384usize, 1024usize),
        (37, 130, 200),
        (300, 96, 2048),
    ] {
        let (bytes, w) = store(&uniform(&mut r, n * k, -1.0, 1.0), DType::BF16);
        let wd = dev
            .upload_matrix(MatRef {
                dtype: DType::BF16,
                rows: n,
                cols: k,
                data: &bytes,
            })
            .unwrap();
        let x = uniform(&mut r, m * k, -1.0, 1.0);
        let xd = dev.upload(&x).unwrap();
        let mut out = dev.upload(&poison(m * n)).unwrap();
        dev.gemm(&xd, m, &wd, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let shape = format!("{m}x{n}x{k}");
        check(
            &format!("gemm bf16 {shape} vs f32 x"),
            rel_err(&got, &matmul_f64(&x, m, &w, n, k)),
            1e-2,
        );
        // x as two bf16 halves: the f32 product to ~2^-17 of x (plus the f32 sums' rounding).
        let mut split = dev.upload(&poison(m * n)).unwrap();
        dev.gemm_split(&xd, m, &wd, &mut split).unwrap();
        let split = dev.download(&split).unwrap();
        check(
            &format!("gemm_split bf16 {shape} vs f32 x"),
            rel_err(&split, &matmul_f64(&x, m, &w, n, k)),
            5e-5,
        );
        let xb = round_bf16(&x);
        check(
            &format!("gemm bf16 {shape} vs bf16 x"),
            rel_err(&got, &matmul_f64(&xb, m, &w, n, k)),
            1e-5,
        );

        // bf16 in, bf16 out.
        let xbd = dev
            .upload(
                &xb.iter()
                    .map(|v| bf16::from_f32(*v).to_bits())
                    .collect::<Vec<u16>>(),
            )
            .unwrap();
        let mut ob = dev.upload(&vec![0x7fc0u16; m * n]).unwrap(); // bf16 NaN
        dev.gemm_bf16(&xbd, m, &wd, GemmOut::Bf16(&mut ob)).unwrap();
        let got_b: Vec<f32> = dev
            .download(&ob)
            .unwrap()
            .into_iter()
            .map(|b| bf16::from_bits(b).to_f32())
            .collect();
        check(
            &format!("gemm bf16->bf16 {shape}"),
            rel_err(&got_b, &matmul_f64(&xb, m, &w, n, k)),
            1e-2,
        );
    }
}

#[test]
fn gemm_f32_weights_is_exact_f32_and_f16_weights_are_refused() {
    let Some(dev) = device() else { return };
    let mut r = rng("gemm_f32");
    let (m, n, k) = (45usize, 129usize, 200usize);
    let (bytes, w) = store(&uniform(&mut r, n * k, -1.0, 1.0), DType::F32);
    let wd = dev
        .upload_matrix(MatRef {
            dtype: DType::F32,
            rows: n,
            cols: k,
            data: &bytes,
        })
        .unwrap();
    let x = uniform(&mut r, m * k, -1.0, 1.0);
    let mut out = dev.upload(&poison(m * n)).unwrap();
    dev.gemm(&dev.upload(&x).unwrap(), m, &wd, &mut out)
        .unwrap();
    check(
        &format!("gemm f32 {m}x{n}x{k}"),
        rel_err(&dev.download(&out).unwrap(), &matmul_f64(&x, m, &w, n, k)),
        1e-5,
    );

    let (h, _) = store(&uniform(&mut r, 8 * 8, -1.0, 1.0), DType::F16);
    let hd = dev
        .upload_matrix(MatRef {
            dtype: DType::F16,
            rows: 8,
            cols: 8,
            data: &h,
        })
        .unwrap();
    let mut o = dev.zeros::<f32>(8).unwrap();
    let err = dev
        .gemm(&dev.zeros::<f32>(8).unwrap(), 1, &hd, &mut o)
        .unwrap_err();
    assert!(matches!(err, CudaError::Unsupported(_)), "{err}");
}

#[test]
fn matrix_ops_refuse_mismatched_shapes() {
    let Some(dev) = device() else { return };
    let bytes = vec![0u8; 16 * 12 * 2];
    let w = dev
        .upload_matrix(MatRef {
            dtype: DType::BF16,
            rows: 16,
            cols: 12,
            data: &bytes,
        })
        .unwrap();
    let x = dev.zeros::<f32>(12).unwrap();
    let mut out = dev.zeros::<f32>(16).unwrap();
    let err = dev.gemv(&x, 1, &w, &mut out).unwrap_err();
    assert!(
        matches!(err, CudaError::InvalidArgument(ref m) if m.contains("multiple of 8")),
        "{err}"
    );
    let mut short = dev.zeros::<f32>(15).unwrap();
    assert!(dev.gemm(&x, 1, &w, &mut short).is_err());
}

/// A row range of a stacked matrix is the part it covers, without a copy: GEMV (both layouts,
/// one and several tokens) and the bf16 GEMM over the range give the bits of the part uploaded
/// on its own. A range past the end, or one whose first row would not start 16-byte aligned,
/// is refused by name.
#[test]
fn row_ranges_of_a_stack_give_the_bits_of_the_parts_alone() {
    let Some(dev) = device() else { return };
    let mut r = rng("row_ranges");
    let k = 512usize;
    let part_rows = [96usize, 33, 200];
    let parts: Vec<Vec<u8>> = part_rows
        .iter()
        .map(|&n| store(&uniform(&mut r, n * k, -1.0, 1.0), DType::BF16).0)
        .collect();
    let stacked: Vec<u8> = parts.concat();
    let total: usize = part_rows.iter().sum();
    let stack = dev
        .upload_matrix(MatRef {
            dtype: DType::BF16,
            rows: total,
            cols: k,
            data: &stacked,
        })
        .unwrap();
    let m = 5usize;
    let x = uniform(&mut r, m * k, -1.0, 1.0);
    let xd = dev.upload(&x).unwrap();
    let x1 = dev.upload(&x[..k]).unwrap();
    let mut first = 0;
    for (p, (&n, bytes)) in part_rows.iter().zip(&parts).enumerate() {
        let range = stack.row_range(first, n).unwrap();
        assert_eq!(
            (range.rows(), range.cols(), range.byte_len()),
            (n, k, n * k * 2)
        );
        let alone = dev
            .upload_matrix(MatRef {
                dtype: DType::BF16,
                rows: n,
                cols: k,
                data: bytes,
            })
            .unwrap();
        let run = |w: &moerun_cuda::DeviceMatrix, layout: GemvLayout, x: &_, rows: usize| {
            let mut out = dev.upload(&poison(rows * n)).unwrap();
            dev.gemv_with(layout, x, rows, w, &mut out).unwrap();
            dev.download(&out).unwrap()
        };
        for layout in LAYOUTS {
            for (xs, rows) in [(&x1, 1), (&xd, m)] {
                assert_eq!(
                    run(&range, layout, xs, rows),
                    run(&alone, layout, xs, rows),
                    "part {p}, {layout:?}, {rows} token(s)"
                );
            }
        }
        let gemm = |w: &moerun_cuda::DeviceMatrix| {
            let mut out = dev.upload(&poison(m * n)).unwrap();
            dev.gemm(&xd, m, w, &mut out).unwrap();
            dev.download(&out).unwrap()
        };
        assert_eq!(gemm(&range), gemm(&alone), "part {p}, gemm");
        first += n;
    }
    let past = stack
        .row_range(total - 10, 11)
        .err()
        .expect("a range past the end");
    assert!(past.to_string().contains("row range"), "{past}");
    // Rows of 3 f32 are 12 bytes: row 1 starts at byte 12.
    let odd = dev
        .upload_matrix(MatRef {
            dtype: DType::F32,
            rows: 4,
            cols: 3,
            data: &[0u8; 48],
        })
        .unwrap();
    let unaligned = odd.row_range(1, 2).err().expect("an unaligned range");
    assert!(
        unaligned.to_string().contains("16-byte aligned"),
        "{unaligned}"
    );
    assert!(
        odd.row_range(4, 0).is_ok(),
        "an empty range at the end is a range"
    );
}
