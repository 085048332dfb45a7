//! The attention prologue folded into decode attention: at batch 1 the prologue kernel
//! ([`CudaDevice::qkv_split_norm_rope`]) cost a launch and a programmatic wait of its own between
//! the q/k/v GEMV and attention (~3 µs a layer for ~40 KB of work). The cluster decode kernel's
//! `_pro` builds (kernels/attention.cu, "the attention prologue folded into decode attention")
//! take the GEMV's raw rows instead: each block makes its query heads (RMSNorm, RoPE) in shared
//! memory after its wait, and the blocks holding the token's own position make its key and value,
//! store them in the pool and set them into the rows they attend over, with the prologue kernel's
//! arithmetic (the same bits: the same q, the same pool values, the same output).
//!
//! Folds only where that build runs the whole batch: every token its own sequence's only token
//! (a decode step: no block needs a key another token's blocks make), the cluster kernel planned
//! for it (no prefill tiles), 4-head blocks of head_dim up to 128 (batch 1 of Qwen3-MoE,
//! Mixtral, Qwen2-MoE, Llama). No output gate, no v norm: the fold's prologue is the plain one.
//! [`CudaDevice::attention_prologue_folds`] says whether a batch folds; the caller runs the
//! prologue and [`CudaDevice::paged_attention`] otherwise.

use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};

use super::attention::KeySource;
use super::{
    to_i32, AttentionPrefill, AttentionScratch, AttentionShape, DeviceKvPool, DeviceRope,
    TokenPlacement, FUSED_MAX_HEAD_DIM,
};
use crate::error::{ensure, Result};
use crate::CudaDevice;

/// The folded prologue's norms and rotation (the prologue's, less the output gate and v norm).
#[derive(Clone, Copy)]
pub struct FoldedPrologue<'a> {
    /// Per-head RMSNorm weights of q and k (`head_dim` each), or none.
    pub q_norm: Option<&'a CudaSlice<f32>>,
    pub k_norm: Option<&'a CudaSlice<f32>>,
    pub rope: &'a DeviceRope,
    pub eps: f32,
}

/// The C layout of `struct PrologueArgs` in kernels/attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct PrologueArgs {
    qkv: u64,
    q_norm: u64,
    k_norm: u64,
    inv_freq: u64,
    attention_factor: f32,
    eps: f32,
    half: i32,
}

const _: () = assert!(std::mem::size_of::<PrologueArgs>() == 48);

// SAFETY: plain data (device addresses, floats, an integer) in the C layout the kernel declares;
// passed by value as one kernel parameter.
unsafe impl DeviceRepr for PrologueArgs {}

impl CudaDevice {
    /// Whether [`CudaDevice::paged_attention_folded`] takes this batch: every token the only one
    /// of its sequence (`at.seq_starts` names each), and the cluster kernel's folded build runs it.
    /// Never with `MOERUN_CUDA_FOLD_PROLOGUE=0` (a measuring knob: the prologue kernel, then
    /// attention).
    pub fn attention_prologue_folds(
        &self,
        at: &TokenPlacement,
        shape: &AttentionShape,
        pool: &DeviceKvPool,
        scratch: &AttentionScratch,
    ) -> bool {
        static OFF: OnceLock<bool> = OnceLock::new();
        let off = *OFF.get_or_init(|| {
            std::env::var_os("MOERUN_CUDA_FOLD_PROLOGUE").is_some_and(|v| v == "0")
        });
        let n = at.positions.len();
        if off
            || n == 0
            || at.seq_starts.len() != n
            || at.table_start.len() != n
            || shape.num_kv_heads == 0
            || !shape.num_heads.is_multiple_of(shape.num_kv_heads)
            || shape.head_dim != pool.head_dim()
            || shape.num_kv_heads != pool.kv_heads()
        {
            return false;
        }
        self.fold_layout(pool.dtype(), n, shape, at.max_context, scratch)
    }

    /// `out = attention(q)` over the pool after the prologue of `qkv` (`[tokens][(num_heads + 2 *
    /// num_kv_heads) * head_dim]`, each token's q heads, then k heads, then v heads, as the
    /// stacked projection writes them): q and k normed and rotated, k and v stored at each
    /// token's position in the pool. The same pool contents and output bits as
    /// [`CudaDevice::qkv_split_norm_rope`] (with that pool) then [`CudaDevice::paged_attention`],
    /// in one launch. Refused (by name) for a batch [`CudaDevice::attention_prologue_folds`]
    /// does not take.
    #[allow(clippy::too_many_arguments)] // paged_attention's arguments plus the prologue
    pub fn paged_attention_folded(
        &self,
        qkv: &impl DevicePtr<f32>,
        prologue: FoldedPrologue,
        pool: &mut DeviceKvPool,
        at: &TokenPlacement,
        shape: &AttentionShape,
        out: &mut impl DevicePtrMut<f32>,
        scratch: &mut AttentionScratch,
    ) -> Result<()> {
        let d = shape.head_dim;
        let half = prologue.rope.half();
        ensure(d <= FUSED_MAX_HEAD_DIM && 2 * half <= d, || {
            format!(
                "folded attention prologue: head_dim {d} (max {FUSED_MAX_HEAD_DIM}), rotary {}",
                2 * half
            )
        })?;
        for n in [prologue.q_norm, prologue.k_norm].into_iter().flatten() {
            ensure(n.len() == d, || {
                format!(
                    "folded attention prologue: a norm of {} for head_dim {d}",
                    n.len()
                )
            })?;
        }
        ensure(
            self.attention_prologue_folds(at, shape, pool, scratch),
            || {
                format!(
                "folded attention prologue: a batch of {} tokens ({} sequences) of {} heads ({} kv \
                 heads) of {d} over {} keys does not fold (attention_prologue_folds)",
                at.positions.len(),
                at.seq_starts.len(),
                shape.num_heads,
                shape.num_kv_heads,
                at.max_context
            )
            },
        )?;
        let ptr_or_null = |n: Option<&CudaSlice<f32>>, what| match n {
            Some(n) => self.ptr(n, what),
            None => Ok(0),
        };
        let qkv_ptr = self.ptr(qkv, "folded prologue qkv")?;
        // The kernel copies each head in by 16-byte asynchronous copies (fold_prologue_fetch).
        ensure(qkv_ptr.is_multiple_of(16) && d.is_multiple_of(4), || {
            format!(
                "folded attention prologue: q/k/v must start 16-byte aligned with head_dim {d} a                  multiple of 4"
            )
        })?;
        let args = PrologueArgs {
            qkv: qkv_ptr,
            q_norm: ptr_or_null(prologue.q_norm, "q_norm")?,
            k_norm: ptr_or_null(prologue.k_norm, "k_norm")?,
            inv_freq: self.ptr(prologue.rope.inv_freq(), "inv_freq")?,
            attention_factor: prologue.rope.attention_factor(),
            eps: prologue.eps,
            half: to_i32(half, "rotary half")?,
        };
        let source = KeySource {
            prefill: AttentionPrefill::ExactF32,
            copy: None,
            out_bf16: 0,
            fold: Some(args),
        };
        // The kernel writes the pool through the addresses `attend` takes from it.
        let pool: &DeviceKvPool = pool;
        self.attend(source, qkv, pool, at, shape, out, scratch)
    }
}
