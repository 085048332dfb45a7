//! Fused small steps of a decoder layer (`kernels/fused.cu`): the residual add with the next
//! RMSNorm, and the attention prologue (split of the stacked q/k/v projection, per-head q/k
//! RMSNorm, RoPE). Each computes the unfused ops' formula; only the order of the sum of squares
//! differs (a block reduction), so results agree within f32 rounding.
//!
//! Launch: `add_rms_norm` grid (rows), block 1024; `qkv_split_norm_rope` grid
//! (tokens, ceil((heads_q + 2 * heads_kv) / 4)), block (32, 4). Its `_copy` form also writes
//! the k and v heads, rounded to bf16, into a [`BatchKvBf16`] for tensor-core prefill attention.

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{blocks, to_i32, BatchKvBf16, DeviceKvPool, DeviceRope, KvDtype, TokenPlacement};
use crate::error::{ensure, DriverContext, Result};
use crate::CudaDevice;

/// Threads of the block that norms one row.
pub(crate) const ROW_BLOCK: u32 = 1024;

/// Widest head the prologue kernel takes (its shared buffer).
pub const FUSED_MAX_HEAD_DIM: usize = 256;

/// Handles of `kernels/fused.cu`.
pub(crate) struct FusedKernels {
    add_rms_norm: CudaFunction,
    pub(crate) rms_norm_block: CudaFunction,
    qkv_split_norm_rope: CudaFunction,
    /// The same, loading everything that does not come from the projection before its wait.
    qkv_split_norm_rope_early: CudaFunction,
}

impl FusedKernels {
    pub(crate) fn load(get: impl Fn(&str) -> Result<CudaFunction>) -> Result<Self> {
        Ok(FusedKernels {
            add_rms_norm: get("add_rms_norm_f32")?,
            rms_norm_block: get("rms_norm_block_f32")?,
            qkv_split_norm_rope: get("qkv_split_norm_rope_f32")?,
            qkv_split_norm_rope_early: get("qkv_split_norm_rope_early_f32")?,
        })
    }
}

/// Shape of the attention prologue.
#[derive(Clone, Copy, Debug)]
pub struct QkvShape {
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub eps: f32,
    /// RMSNorm each v head without a learned scale (Gemma 4's `v_norm`).
    pub v_unit_norm: bool,
}

/// Heads per block of the prologue kernel (`QKV_HEADS_PER_BLOCK` in kernels/fused.cu).
const QKV_HEADS_PER_BLOCK: usize = 4;

/// Most tokens the prologue's `_early` entry takes (every captured decode bucket): it loads the
/// norm weights, cos/sin and pool slot before its wait, which shortens a decode step's chain but
/// holds registers that halve a prefill's resident blocks (kernels/fused.cu).
const PROLOGUE_EARLY_MAX_TOKENS: usize = 128;

/// Where the prologue writes K/V: the C layout of `struct KvDest` in kernels/fused.cu (a null
/// `pool_k` writes none).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KvDest {
    pool_k: u64,
    pool_v: u64,
    table_start: u64,
    block_tables: u64,
    tables_len: i32,
    block_size: i32,
    blocks: i32,
    /// 1: the pool stores bf16 ([`KvDtype::Bf16`]), 0: f32.
    pool_bf16: i32,
    copy_k: u64,
    copy_v: u64,
}

// SAFETY: plain data (device addresses, integers) in the C layout the kernel declares; passed by
// value as one kernel parameter.
unsafe impl DeviceRepr for KvDest {}

impl CudaDevice {
    /// `x += y`, then `out = weight * (x / sqrt(mean(x²) + eps))` per row of `weight.len()`.
    pub fn add_rms_norm(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.add_rms_norm_with_bf16(x, y, weight, eps, out, None)
    }

    /// [`CudaDevice::add_rms_norm`] that, given `out_bf16`, also writes `out` rounded to bf16
    /// there (round to nearest even, the bits `to_bf16` would give): the input of a bf16 GEMM,
    /// without a conversion launch and its pass over `out`.
    pub fn add_rms_norm_with_bf16(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
        out: &mut impl DevicePtrMut<f32>,
        out_bf16: Option<&mut CudaSlice<u16>>,
    ) -> Result<()> {
        let (len, width) = (x.len(), weight.len());
        ensure(y.len() == len && out.len() == len, || {
            format!("add_rms_norm: x {len}, y {}, out {}", y.len(), out.len())
        })?;
        ensure(width > 0 && len.is_multiple_of(width), || {
            format!("add_rms_norm: {len} values are not rows of {width}")
        })?;
        if let Some(b) = &out_bf16 {
            ensure(b.len() == len, || {
                format!("add_rms_norm: the bf16 output holds {}, x {len}", b.len())
            })?;
        }
        let rows = len / width;
        if rows == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, "add_rms_norm x")?;
        let yp = self.ptr(y, "add_rms_norm y")?;
        let wp = self.ptr(weight, "add_rms_norm weight")?;
        let op = self.ptr_mut(out, "add_rms_norm out")?;
        let bp = match out_bf16 {
            Some(b) => self.ptr_mut(b, "add_rms_norm bf16 out")?,
            None => 0,
        };
        let width_i = to_i32(width, "width")?;
        let cfg = LaunchConfig {
            grid_dim: (blocks(rows, 1)?, 1, 1),
            block_dim: (ROW_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        if crate::skip::skipped("add_rms_norm") {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(&self.kernels.fused.add_rms_norm);
        b.arg(&xp)
            .arg(&yp)
            .arg(&wp)
            .arg(&op)
            .arg(&width_i)
            .arg(&eps)
            .arg(&bp);
        // SAFETY: x, y and out hold rows * width f32 and a non-null bf16 output rows * width
        // u16 (checked), weight width; args match.
        unsafe { b.launch(cfg) }.ctx("add_rms_norm_f32")?;
        Ok(())
    }

    /// Split `qkv` (`[tokens, (heads_q + 2 * heads_kv) * head_dim]`, each token's q heads then k
    /// heads then v heads) into `q`, `k`, `v`; RMSNorm each q and k head by `q_norm`/`k_norm`
    /// (`head_dim` weights) when given; rotate q and k at `positions`.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_split_norm_rope(
        &self,
        qkv: &impl DevicePtr<f32>,
        shape: QkvShape,
        positions: &impl DevicePtr<u32>,
        q_norm: Option<&CudaSlice<f32>>,
        k_norm: Option<&CudaSlice<f32>>,
        rope: &DeviceRope,
        q: &mut impl DevicePtrMut<f32>,
        k: &mut impl DevicePtrMut<f32>,
        v: &mut impl DevicePtrMut<f32>,
        gate: Option<&mut CudaSlice<f32>>,
        kv: Option<(&mut DeviceKvPool, &TokenPlacement)>,
    ) -> Result<()> {
        let (q_norm_k_norm, outs) = ((q_norm, k_norm), (q, k, v));
        self.qkv_split_norm_rope_copy(
            qkv,
            shape,
            positions,
            q_norm_k_norm,
            rope,
            outs,
            gate,
            kv,
            None,
        )
    }

    /// [`CudaDevice::qkv_split_norm_rope`] that, given `copy`, also writes the k and v heads
    /// rounded to bf16 into its first `tokens` rows: the batch copy
    /// [`CudaDevice::paged_attention_batch_copy`] reads for the batch's own keys.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_split_norm_rope_copy(
        &self,
        qkv: &impl DevicePtr<f32>,
        shape: QkvShape,
        positions: &impl DevicePtr<u32>,
        (q_norm, k_norm): (Option<&CudaSlice<f32>>, Option<&CudaSlice<f32>>),
        rope: &DeviceRope,
        (q, k, v): (
            &mut impl DevicePtrMut<f32>,
            &mut impl DevicePtrMut<f32>,
            &mut impl DevicePtrMut<f32>,
        ),
        gate: Option<&mut CudaSlice<f32>>,
        kv: Option<(&mut DeviceKvPool, &TokenPlacement)>,
        copy: Option<&mut BatchKvBf16>,
    ) -> Result<()> {
        let QkvShape {
            heads_q,
            heads_kv,
            head_dim,
            eps,
            v_unit_norm,
        } = shape;
        let tokens = positions.len();
        let q_width = if gate.is_some() {
            2 * head_dim
        } else {
            head_dim
        };
        let width = heads_q * q_width + 2 * heads_kv * head_dim;
        ensure(qkv.len() == tokens * width, || {
            format!(
                "qkv_split_norm_rope: qkv {} is not {tokens} x {width}",
                qkv.len()
            )
        })?;
        ensure(
            q.len() == tokens * heads_q * head_dim
                && k.len() == tokens * heads_kv * head_dim
                && v.len() == tokens * heads_kv * head_dim,
            || "qkv_split_norm_rope: q/k/v outputs do not match the shape".to_string(),
        )?;
        ensure(
            head_dim <= FUSED_MAX_HEAD_DIM && 2 * rope.half() <= head_dim,
            || {
                format!(
                "qkv_split_norm_rope: head_dim {head_dim} (max {FUSED_MAX_HEAD_DIM}), rotary {}",
                2 * rope.half()
            )
            },
        )?;
        for n in [q_norm, k_norm].into_iter().flatten() {
            ensure(n.len() == head_dim, || {
                format!(
                    "qkv_split_norm_rope: a norm of {} for head_dim {head_dim}",
                    n.len()
                )
            })?;
        }
        if tokens == 0 {
            return Ok(());
        }
        let src = self.ptr(qkv, "qkv")?;
        let (qp, kp, vp) = (
            self.ptr_mut(q, "q")?,
            self.ptr_mut(k, "k")?,
            self.ptr_mut(v, "v")?,
        );
        let pos = self.ptr(positions, "positions")?;
        let qn = match q_norm {
            Some(n) => self.ptr(n, "q_norm")?,
            None => 0,
        };
        let kn = match k_norm {
            Some(n) => self.ptr(n, "k_norm")?,
            None => 0,
        };
        let freq = self.ptr(rope.inv_freq(), "inv_freq")?;
        let (hq, hkv, d, half) = (
            to_i32(heads_q, "heads_q")?,
            to_i32(heads_kv, "heads_kv")?,
            to_i32(head_dim, "head_dim")?,
            to_i32(rope.half(), "half")?,
        );
        let factor = rope.attention_factor();
        let v_norm = i32::from(v_unit_norm);
        let gate_ptr = match gate {
            Some(g) => {
                ensure(g.len() == tokens * heads_q * head_dim, || {
                    format!(
                        "qkv_split_norm_rope: gate holds {}, expected {tokens} x {heads_q} x \
                         {head_dim}",
                        g.len()
                    )
                })?;
                self.ptr_mut(g, "gate")?
            }
            None => 0,
        };
        let mut dest = match kv {
            None => KvDest::default(),
            Some((pool, at)) => {
                ensure(
                    pool.kv_heads() == heads_kv
                        && pool.head_dim() == head_dim
                        && at.positions.len() == tokens
                        && at.table_start.len() == tokens,
                    || {
                        format!(
                            "qkv_split_norm_rope: a pool of {} x {} and {} placed tokens for \
                             {tokens} tokens of {heads_kv} x {head_dim}",
                            pool.kv_heads(),
                            pool.head_dim(),
                            at.positions.len()
                        )
                    },
                )?;
                let (blocks, block_size) = (pool.blocks(), pool.block_size());
                let pool_bf16 = i32::from(pool.dtype() == KvDtype::Bf16);
                let (pool_k, pool_v) = pool.ptrs_mut(self, "qkv_split_norm_rope pool")?;
                KvDest {
                    pool_k,
                    pool_v,
                    pool_bf16,
                    table_start: self.ptr(at.table_start, "table_start")?,
                    block_tables: self.ptr(at.block_tables, "block_tables")?,
                    tables_len: to_i32(at.block_tables.len(), "block_tables length")?,
                    block_size: to_i32(block_size, "block_size")?,
                    blocks: to_i32(blocks, "blocks")?,
                    ..KvDest::default()
                }
            }
        };
        if let Some(c) = copy {
            c.check("qkv_split_norm_rope", tokens, heads_kv, head_dim)?;
            let (ck, cv) = c.k_v_mut();
            dest.copy_k = self.ptr_mut(ck, "copy k")?;
            dest.copy_v = self.ptr_mut(cv, "copy v")?;
        }
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(tokens).unwrap_or(u32::MAX),
                (heads_q + 2 * heads_kv).div_ceil(QKV_HEADS_PER_BLOCK) as u32,
                1,
            ),
            block_dim: (32, QKV_HEADS_PER_BLOCK as u32, 1),
            shared_mem_bytes: 0,
        };
        if crate::skip::skipped("qkv_prologue") {
            return Ok(());
        }
        let func = match tokens <= PROLOGUE_EARLY_MAX_TOKENS {
            true => &self.kernels.fused.qkv_split_norm_rope_early,
            false => &self.kernels.fused.qkv_split_norm_rope,
        };
        let mut b = self.stream.launch_builder(func);
        b.arg(&src)
            .arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&pos)
            .arg(&qn)
            .arg(&kn)
            .arg(&freq);
        b.arg(&hq)
            .arg(&hkv)
            .arg(&d)
            .arg(&half)
            .arg(&factor)
            .arg(&eps)
            .arg(&v_norm)
            .arg(&gate_ptr)
            .arg(&dest);
        // SAFETY: qkv holds tokens * width f32, q/k/v their parts, positions tokens, norms
        // head_dim (or null), inv_freq half <= head_dim / 2; the pool (when given) holds blocks x
        // block_size rows of heads_kv x head_dim and the kernel bounds every table index and
        // block id; a copy (when given) holds at least `tokens` rows of heads_kv x head_dim
        // (checked); args match the kernel.
        unsafe { b.launch(cfg) }.ctx("qkv_split_norm_rope_f32")?;
        Ok(())
    }
}
