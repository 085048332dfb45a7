//! The cuBLAS prefill paths of [`CudaDevice::moe_experts`] ([`super::MoePath::PrefillCublas`],
//! [`super::MoePath::PrefillPerExpert`], and [`super::MoePath::Prefill`] where the device has no
//! wgmma; on sm_90 `Prefill` is `wgmma`'s kernels): tensor-core GEMMs over each expert's tokens,
//! bf16 weights only. With P = n · k pairs listed in expert order q by `moe_align`:
//!
//! 1. `moe_align` (as in decode), then one wait for the device: the host reads the offsets, i.e.
//!    each expert's token count, which cuBLAS takes as host sizes.
//! 2. `moe_gather_bf16` (grid P, block 256): `xg[q] = bf16(x[token of q])`.
//! 3. gate_up: one `cublasGemmGroupedBatchedEx`, a group per expert with tokens:
//!    `gu[q, 0..2I] = xg[q] · gate_upᵀ` (bf16 in, f32 accumulation, bf16 out).
//! 4. `moe_silu_mul_bf16` (grid P, block 256): `gu[q, j] = bf16(silu(gu[q, j]) · gu[q, I + j])`,
//!    in place, so the down GEMM reads it with a leading dimension of 2I.
//! 5. down: one grouped GEMM, `yb[q] = gu[q, 0..I] · downᵀ` (bf16 out).
//! 6. `moe_combine_bf16` (grid n, block 256): `out[t] = Σ_r weights[t, r] · yb[pos[t k + r]]` in
//!    rank order, f32.
//!
//! Error against the f32 reference: x, the gate/up outputs, `silu · up` and the expert outputs are
//! each rounded to bf16 (2⁻⁹ relative), ~3e-3 norm-wise in all; tests hold it to 1e-2, and
//! element by element to a reference that rounds at the same four places, within what the bf16
//! roundings that f32 summation order flips can move each element (tests/moe.rs `check_steps`).
//!
//! cuBLAS is column-major: each expert's row-major `C[m_e, N] = A[m_e, K] · W[N, K]ᵀ` is the
//! column-major `Cᵀ[N, m_e] = W · Aᵀ` with `W` transposed (lda = K), as in `ops/gemm.rs`.

use std::ffi::c_void;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasGemmGroupedBatchedEx, cublasOperation_t,
    cudaDataType,
};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use moerun_core::DType;

use super::{DeviceExperts, MoeCall, MoeScratch};
use crate::error::{DriverContext, Result};
use crate::ops::to_i32;
use crate::{CudaDevice, CudaError};

/// One projection over every expert with tokens: `C_g[m_g, n] = A_g[m_g, k] · W_gᵀ`, row-major,
/// bf16, rows of A and C `lda` and `ldc` elements apart.
struct Grouped {
    /// Output columns (rows of W) and the reduction length.
    n: usize,
    k: usize,
    lda: usize,
    ldc: usize,
    /// Per group: tokens, and the device addresses of W, A and C.
    tokens: Vec<usize>,
    w: Vec<u64>,
    a: Vec<u64>,
    c: Vec<u64>,
}

impl CudaDevice {
    pub(super) fn moe_prefill(
        &self,
        c: &MoeCall,
        w: &DeviceExperts,
        s: &mut MoeScratch,
        per_expert: bool,
    ) -> Result<()> {
        if w.dtype != DType::BF16 {
            return Err(CudaError::Unsupported(format!(
                "the MoE prefill path with {} experts (bf16 only; other dtypes take the decode \
                 path)",
                w.dtype
            )));
        }
        let (e, hidden, inter) = (w.experts, w.hidden, w.intermediate);
        let pairs = c.tokens * c.top_k;
        let p_max = s.max_tokens * s.top_k;
        self.moe_align(c, w, s, 0)?;
        let offsets = self.download(&s.offsets)?; // the one wait of this path
        let invalid = offsets[e + 1] - offsets[e];
        if invalid > 0 {
            return Err(CudaError::InvalidArgument(format!(
                "moe_experts: {invalid} expert ids are >= {e}"
            )));
        }

        let pair_list = self.ptr(&s.pairs, "moe pairs")?;
        let pos = self.ptr(&s.pos, "moe pos")?;
        let gu = self.ptr_mut(&mut s.inner, "moe gate_up out")?;
        let outer = self.ptr_mut(&mut s.outer, "moe activations")?;
        let (xg, yb) = (outer, outer + (p_max * hidden * 2) as u64);
        let (hidden_i, inter_i, k_i) = (
            to_i32(hidden, "hidden")?,
            to_i32(inter, "intermediate")?,
            to_i32(c.top_k, "top_k")?,
        );
        let kernels = &self.kernels.moe;
        let rows = |n: usize| LaunchConfig {
            grid_dim: (n as u32, 1, 1), // n <= P_max <= i32::MAX
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };

        let mut b = self.stream.launch_builder(&kernels.gather_bf16);
        b.arg(&c.x)
            .arg(&pair_list)
            .arg(&xg)
            .arg(&hidden_i)
            .arg(&k_i);
        // SAFETY: x holds n · H f32 (16-byte aligned, H a multiple of 8); pairs holds P pair
        // indices < P from moe_align; xg has room for P_max · H bf16 (the first half of outer).
        unsafe { b.launch(rows(pairs)) }.ctx("moe_gather_bf16")?;

        let busy: Vec<usize> = (0..e).filter(|&g| offsets[g + 1] > offsets[g]).collect();
        let start = |g: usize| offsets[g] as usize;
        let count = |g: usize| (offsets[g + 1] - offsets[g]) as usize;
        let (gate_up, down) = (
            self.ptr(&w.gate_up, "moe gate_up")?,
            self.ptr(&w.down, "moe down")?,
        );
        let mat = (hidden * inter * 2) as u64;
        let up = Grouped {
            n: 2 * inter,
            k: hidden,
            lda: hidden,
            ldc: 2 * inter,
            tokens: busy.iter().map(|&g| count(g)).collect(),
            w: busy.iter().map(|&g| gate_up + 2 * mat * g as u64).collect(),
            a: busy
                .iter()
                .map(|&g| xg + (start(g) * hidden * 2) as u64)
                .collect(),
            c: busy
                .iter()
                .map(|&g| gu + (start(g) * 2 * inter * 2) as u64)
                .collect(),
        };
        let dn = Grouped {
            n: hidden,
            k: inter,
            lda: 2 * inter,
            ldc: hidden,
            tokens: up.tokens.clone(),
            w: busy.iter().map(|&g| down + mat * g as u64).collect(),
            a: up.c.clone(),
            c: busy
                .iter()
                .map(|&g| yb + (start(g) * hidden * 2) as u64)
                .collect(),
        };
        if !per_expert {
            // cuBLAS reads the grouped GEMMs' pointer arrays on the device: both calls' arrays
            // go up in one copy, ordered before the calls on the stream.
            let host: Vec<u64> = [&up, &dn]
                .iter()
                .flat_map(|g| g.w.iter().chain(&g.a).chain(&g.c).copied())
                .collect();
            self.stream
                .memcpy_htod(&host, &mut s.gemm_ptrs)
                .ctx("uploading GEMM pointers")?;
        }
        let ptrs = self.ptr(&s.gemm_ptrs, "moe gemm pointers")?;
        let groups = busy.len() as u64;
        self.moe_gemms(&up, per_expert, ptrs)?;

        let mut b = self.stream.launch_builder(&kernels.silu_mul_bf16);
        let act = w.activation().code();
        b.arg(&gu).arg(&inter_i).arg(&act);
        // SAFETY: gu holds P_max rows of 2I bf16, the first P written by the GEMM above.
        unsafe { b.launch(rows(pairs)) }.ctx("moe_silu_mul_bf16")?;

        self.moe_gemms(&dn, per_expert, ptrs + 3 * 8 * groups)?;

        let mut b = self.stream.launch_builder(&kernels.combine_bf16);
        b.arg(&yb).arg(&pos).arg(&c.weights).arg(&c.out);
        b.arg(&hidden_i).arg(&k_i);
        // SAFETY: yb holds P rows of H bf16 written by the down GEMMs (every pair is in some
        // expert's group: none is out of range); pos holds P places < P; weights n · k f32 and
        // out n · H f32.
        unsafe { b.launch(rows(c.tokens)) }.ctx("moe_combine_bf16")?;
        Ok(())
    }

    /// Run `g` as one grouped GEMM (its W, A, C pointer arrays at `ptrs` on the device) or as one
    /// `cublasGemmEx` per group.
    fn moe_gemms(&self, g: &Grouped, per_expert: bool, ptrs: u64) -> Result<()> {
        let count = g.tokens.len();
        if count == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().ctx("binding the context")?;
        let handle = *self.blas.handle();
        let (n, k, lda, ldc) = (
            to_i32(g.n, "n")?,
            to_i32(g.k, "k")?,
            to_i32(g.lda, "lda")?,
            to_i32(g.ldc, "ldc")?,
        );
        let tokens = g
            .tokens
            .iter()
            .map(|&t| to_i32(t, "tokens"))
            .collect::<Result<Vec<i32>>>()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf16 = cudaDataType::CUDA_R_16BF;
        let (op_t, op_n) = (
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
        );
        if per_expert {
            for (i, &m) in tokens.iter().enumerate() {
                // SAFETY: W_i holds n · k bf16 (row-major, ld k), A_i tokens[i] rows of k bf16
                // (ld lda >= k), C_i tokens[i] rows of n bf16 (ld ldc >= n), all inside their
                // buffers by the offsets of moe_align; alpha and beta are host f32 as
                // CUBLAS_COMPUTE_32F expects; the handle works on this device's stream.
                unsafe {
                    gemm_ex(
                        handle,
                        op_t,
                        op_n,
                        n,
                        m,
                        k,
                        (&alpha as *const f32).cast::<c_void>(),
                        g.w[i] as *const c_void,
                        bf16,
                        k,
                        g.a[i] as *const c_void,
                        bf16,
                        lda,
                        (&beta as *const f32).cast::<c_void>(),
                        g.c[i] as *mut c_void,
                        bf16,
                        ldc,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .ctx("cublasGemmEx (MoE expert)")?;
            }
            return Ok(());
        }
        let same = |v: i32| vec![v; count];
        let (transa, transb) = (vec![op_t; count], vec![op_n; count]);
        let (m_arr, k_arr, lda_arr, ldb_arr, ldc_arr) =
            (same(n), same(k), same(k), same(lda), same(ldc));
        let (alphas, betas) = (vec![alpha; count], vec![beta; count]);
        let group_size = same(1);
        let stride = 8 * count as u64;
        // SAFETY: every host array holds `count` entries (one group of one problem per expert
        // with tokens); the device arrays at `ptrs` hold count W, then count A, then count C
        // addresses, uploaded on this stream before this call, each valid as in the per-expert
        // branch above.
        unsafe {
            cublasGemmGroupedBatchedEx(
                handle,
                transa.as_ptr(),
                transb.as_ptr(),
                m_arr.as_ptr(),
                tokens.as_ptr(),
                k_arr.as_ptr(),
                alphas.as_ptr().cast::<c_void>(),
                ptrs as *const *const c_void,
                bf16,
                lda_arr.as_ptr(),
                (ptrs + stride) as *const *const c_void,
                bf16,
                ldb_arr.as_ptr(),
                betas.as_ptr().cast::<c_void>(),
                (ptrs + 2 * stride) as *const *mut c_void,
                bf16,
                ldc_arr.as_ptr(),
                to_i32(count, "groups")?,
                group_size.as_ptr(),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        }
        .result()
        .ctx("cublasGemmGroupedBatchedEx (MoE)")
    }
}
