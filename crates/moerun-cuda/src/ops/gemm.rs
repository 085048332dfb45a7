//! Prefill GEMM through cuBLAS: `out[m, n] = x[m, k] · wᵀ` with w row-major `[n, k]`.
//!
//! bf16 weights: the f32 activations are first **rounded to bf16** (`kernels/convert.cu`), then
//! cuBLAS multiplies bf16 × bf16 on the tensor cores with f32 accumulation (`CUBLAS_COMPUTE_32F`)
//! into f32 (or bf16) outputs. The rounding of x is the main error against the CPU's f32 path:
//! about 2⁻⁹ relative per element, ~1e-3..1e-2 on a product, so a token's outputs differ between
//! this path and the GEMV (which keeps x in f32). f32 weights: a plain f32 SGEMM (no TF32), no
//! rounding. f16 weights are refused (f16 activations could overflow); convert them at load.
//!
//! [`CudaDevice::gemm_split`] trades twice the tensor-core work for the GEMV's precision: x enters
//! as two bf16 halves (hi + lo, 16 mantissa bits), each multiplied once, the second pass adding
//! into the first's f32 output.
//!
//! Layout: cuBLAS is column-major, so the row-major `out[m, n]` is computed as the column-major
//! `outᵀ[n, m] = w[n, k] · xᵀ[k, m]`: `A = w` read transposed (lda = k), `B = x` (ldb = k).

use std::ffi::c_void;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use moerun_core::DType;

use super::to_i32;
use crate::error::{ensure, CudaError, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix};

/// The output of a bf16 GEMM: f32, or bf16 bit patterns.
pub enum GemmOut<'a> {
    F32(&'a mut dyn DevicePtrMut<f32>),
    Bf16(&'a mut dyn DevicePtrMut<u16>),
}

/// Operands of one cuBLAS call, as raw device addresses.
struct GemmCall {
    m: i32,
    n: i32,
    k: i32,
    w: u64,
    x: u64,
    out: u64,
    in_type: cudaDataType,
    out_type: cudaDataType,
    /// Add into `out` (`beta` = 1) instead of overwriting it.
    accumulate: bool,
}

/// `(w.rows(), w.cols())` once `x` (of `x_len` values) holds `m` rows of `w.cols()` and `out`
/// (of `out_len`) `m` rows of `w.rows()`; else the error names `op` and the mismatch.
pub(crate) fn gemm_shapes(
    op: &str,
    x_len: usize,
    m: usize,
    w: &DeviceMatrix,
    out_len: usize,
) -> Result<(usize, usize)> {
    let (n, k) = (w.rows(), w.cols());
    ensure(x_len == m * k, || {
        format!("{op}: x holds {x_len}, expected {m} x {k}")
    })?;
    ensure(out_len == m * n, || {
        format!("{op}: out holds {out_len}, expected {m} x {n}")
    })?;
    Ok((n, k))
}

impl CudaDevice {
    /// `out[m, w.rows()] = x[m, w.cols()] · wᵀ` on cuBLAS. bf16 weights round x to bf16 first
    /// (see the module doc); f32 weights run an exact f32 SGEMM.
    pub fn gemm(
        &self,
        x: &impl DevicePtr<f32>,
        m: usize,
        w: &DeviceMatrix,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (n, k) = gemm_shapes("gemm", x.len(), m, w, out.len())?;
        match w.dtype() {
            DType::BF16 => {
                // SAFETY: uninitialised device memory, but to_bf16 writes all m * k elements
                // before the GEMM (later on the same stream) reads any.
                let mut xb = unsafe { self.stream.alloc::<u16>(m * k) }.ctx("allocating")?;
                self.to_bf16(x, &mut xb)?;
                self.gemm_bf16(&xb, m, w, GemmOut::F32(out))
            }
            DType::F32 => {
                let call = GemmCall {
                    m: to_i32(m, "m")?,
                    n: to_i32(n, "n")?,
                    k: to_i32(k, "k")?,
                    w: w.device_ptr(self, "gemm w")?,
                    x: self.ptr(x, "gemm x")?,
                    out: self.ptr_mut(out, "gemm out")?,
                    in_type: cudaDataType::CUDA_R_32F,
                    out_type: cudaDataType::CUDA_R_32F,
                    accumulate: false,
                };
                self.cublas_gemm(&call)
            }
            DType::F16 => Err(CudaError::Unsupported(
                "GEMM with f16 weights (convert them to bf16 at load)".into(),
            )),
        }
    }

    /// [`CudaDevice::gemm`] with bf16 weights multiplying x split into two bf16 halves (see the
    /// module doc): `out = w · hi + w · lo`, where the rounded path has `w · bf16(x)`. Other
    /// weights: [`CudaDevice::gemm`].
    pub fn gemm_split(
        &self,
        x: &impl DevicePtr<f32>,
        m: usize,
        w: &DeviceMatrix,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        if w.dtype() != DType::BF16 {
            return self.gemm(x, m, w, out);
        }
        let (n, k) = gemm_shapes("gemm_split", x.len(), m, w, out.len())?;
        // SAFETY: uninitialised device memory, written in full by to_bf16_split before either
        // GEMM (later on the same stream) reads it.
        let mut hi = unsafe { self.stream.alloc::<u16>(m * k) }.ctx("allocating")?;
        let mut lo = unsafe { self.stream.alloc::<u16>(m * k) }.ctx("allocating")?;
        self.to_bf16_split(x, &mut hi, &mut lo)?;
        let mut call = GemmCall {
            m: to_i32(m, "m")?,
            n: to_i32(n, "n")?,
            k: to_i32(k, "k")?,
            w: w.device_ptr(self, "gemm w")?,
            x: self.ptr(&hi, "gemm x hi")?,
            out: self.ptr_mut(out, "gemm out")?,
            in_type: cudaDataType::CUDA_R_16BF,
            out_type: cudaDataType::CUDA_R_32F,
            accumulate: false,
        };
        self.cublas_gemm(&call)?;
        call.x = self.ptr(&lo, "gemm x lo")?;
        call.accumulate = true;
        self.cublas_gemm(&call)
    }

    /// `out[m, w.rows()] = x[m, w.cols()] · wᵀ` with x already bf16 and bf16 weights, f32
    /// accumulation, f32 or bf16 output.
    pub fn gemm_bf16(
        &self,
        x: &impl DevicePtr<u16>,
        m: usize,
        w: &DeviceMatrix,
        out: GemmOut<'_>,
    ) -> Result<()> {
        let (n, k) = (w.rows(), w.cols());
        if w.dtype() != DType::BF16 {
            return Err(CudaError::Unsupported(format!(
                "gemm_bf16 with {} weights",
                w.dtype()
            )));
        }
        ensure(x.len() == m * k, || {
            format!("gemm_bf16: x holds {}, expected {m} x {k}", x.len())
        })?;
        let (out, out_type, out_len) = match out {
            GemmOut::F32(o) => {
                let len = o.len();
                (self.ptr_mut(o, "gemm out")?, cudaDataType::CUDA_R_32F, len)
            }
            GemmOut::Bf16(o) => {
                let len = o.len();
                (self.ptr_mut(o, "gemm out")?, cudaDataType::CUDA_R_16BF, len)
            }
        };
        ensure(out_len == m * n, || {
            format!("gemm_bf16: out holds {out_len}, expected {m} x {n}")
        })?;
        let call = GemmCall {
            m: to_i32(m, "m")?,
            n: to_i32(n, "n")?,
            k: to_i32(k, "k")?,
            w: w.device_ptr(self, "gemm w")?,
            x: self.ptr(x, "gemm x")?,
            out,
            in_type: cudaDataType::CUDA_R_16BF,
            out_type,
            accumulate: false,
        };
        self.cublas_gemm(&call)
    }

    fn cublas_gemm(&self, c: &GemmCall) -> Result<()> {
        if c.m == 0 || c.n == 0 {
            return Ok(());
        }
        // cuBLAS calls run on the thread's current context.
        self.ctx.bind_to_thread().ctx("binding the context")?;
        let (alpha, beta) = (1.0f32, if c.accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: w holds n * k, x m * k and out m * n elements of the given types (checked by
        // the callers); alpha and beta are host f32, as CUBLAS_COMPUTE_32F with the default host
        // pointer mode expects; the handle is bound to this device's stream.
        unsafe {
            gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                c.n,
                c.m,
                c.k,
                (&alpha as *const f32).cast::<c_void>(),
                c.w as *const c_void,
                c.in_type,
                c.k,
                c.x as *const c_void,
                c.in_type,
                c.k,
                (&beta as *const f32).cast::<c_void>(),
                c.out as *mut c_void,
                c.out_type,
                c.n,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .ctx("cublasGemmEx")
    }
}
