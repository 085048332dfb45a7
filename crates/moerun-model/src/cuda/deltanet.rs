//! Qwen3.5's Gated DeltaNet layer on the GPU, the device counterpart of
//! [`crate::gated_deltanet::gated_deltanet_block`] (the reference, and its formulas):
//!
//! ```text
//! in_proj_qkv/z/b/a      linear ops (GEMV or cuBLAS, as every projection)
//! deltanet_conv_silu     per (sequence, channel), from and back to the slot's conv window
//! deltanet_gates         l2norm of q/k heads in place; beta, g per (row, value head)
//! gated_delta_recurrent  per (state columns, value head, sequence), token after token, the
//!                        state in registers
//! gated_rms_norm         per (row, value head), then out_proj
//! ```
//!
//! The delta rule runs in its recurrent form for prefill as well as decode: exact, and equal to
//! the CPU's chunked form to f32 rounding (the CPU's own test shows both forms within 1e-5 of an
//! f64 reference). Columns of a head's state never mix, so the kernel spreads them over warps
//! (no barrier per token); each warp still walks its sequence's tokens in order, so long prompts
//! pay a latency per token per layer (see docs/perf/cuda-model.md). A chunked device form
//! (transformers' `chunk_gated_delta_rule`, dense products per 64 tokens) is the next step for
//! prefill.
//!
//! Every buffer the kernels read about the batch ([`LinearPlacement`]) is on the device, so a
//! decode step is graph-safe: a graph is captured over a placement whose slot addresses are
//! rewritten before each replay.

use moerun_core::{Error, Result};
use moerun_cuda::{
    CudaDevice, CudaSlice, DeltaSeqs, DeltaShape, DeviceBuffer, DevicePtr, DevicePtrMut,
};

use super::pass::CudaPass;
use super::{dev_err, tensor_key};
use crate::backend::Backend;
use crate::batch::Batch;
use crate::config::ModelConfig;
use crate::linear_state::LinearStateCache;
use crate::weights::GatedDeltaNetWeights;

/// The batch's sequences and their state slots, on the device, for every Gated DeltaNet layer
/// of one pass.
pub struct LinearPlacement {
    shape: DeltaShape,
    eps: f32,
    /// Per model layer: (conv window, recurrent state) offsets into a slot.
    offsets: Vec<Option<(usize, usize)>>,
    seq_start: CudaSlice<i32>,
    seq_len: CudaSlice<i32>,
    pub(crate) states: CudaSlice<u64>,
    rows: usize,
}

impl LinearPlacement {
    fn new(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        cache: &LinearStateCache,
        lens: &[usize],
        addrs: &[u64],
    ) -> Result<LinearPlacement> {
        let la = cfg.linear_attention.ok_or_else(|| {
            Error::InvalidArgument("a linear-attention placement for a model without it".into())
        })?;
        let shape = DeltaShape {
            key_heads: la.num_key_heads,
            value_heads: la.num_value_heads,
            key_dim: la.key_head_dim,
            value_dim: la.value_head_dim,
            conv_kernel: la.conv_kernel,
        };
        let mut starts = Vec::with_capacity(lens.len());
        let mut rows = 0;
        for &n in lens {
            starts.push(i32::try_from(rows).map_err(|_| {
                Error::InvalidArgument(format!("a batch of {rows} rows is too large"))
            })?);
            rows += n;
        }
        let lens_i32: Vec<i32> = lens.iter().map(|&n| n as i32).collect();
        // A zero-length device buffer cannot be passed to a kernel.
        let pad = |v: Vec<i32>| if v.is_empty() { vec![0] } else { v };
        let addrs = if addrs.is_empty() {
            vec![0]
        } else {
            addrs.to_vec()
        };
        Ok(LinearPlacement {
            shape,
            eps: cfg.rms_norm_eps,
            offsets: (0..cfg.num_layers())
                .map(|l| cache.layer_offsets(l))
                .collect(),
            seq_start: dev.upload(&pad(starts)).map_err(dev_err)?,
            seq_len: dev.upload(&pad(lens_i32)).map_err(dev_err)?,
            states: dev.upload(&addrs).map_err(dev_err)?,
            rows,
        })
    }

    /// The placement of `batch`, whose sequence `i` keeps its state at `addrs[i]`
    /// (`LinearStateCache::device_slots`).
    pub fn of_batch(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        cache: &LinearStateCache,
        batch: &Batch,
        addrs: &[u64],
    ) -> Result<LinearPlacement> {
        let lens: Vec<usize> = batch.seqs.iter().map(|s| s.tokens.len()).collect();
        LinearPlacement::new(dev, cfg, cache, &lens, addrs)
    }

    /// A decode step of `bucket` sequences of one token each, every slot address `trash` until
    /// [`LinearPlacement::set_states`] says otherwise.
    pub(crate) fn for_decode(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        cache: &LinearStateCache,
        bucket: usize,
        trash: u64,
    ) -> Result<LinearPlacement> {
        LinearPlacement::new(dev, cfg, cache, &vec![1; bucket], &vec![trash; bucket])
    }

    /// Point the sequences at other slots (same count).
    pub(crate) fn set_states(&mut self, dev: &CudaDevice, addrs: &[u64]) -> Result<()> {
        dev.copy_to_device(addrs, &mut self.states).map_err(dev_err)
    }
}

/// Layer `layer` over the normed input `xn` (`[rows, hidden]`), advancing each sequence's state.
pub(crate) fn gated_deltanet(
    pass: &mut CudaPass,
    lp: &LinearPlacement,
    layer: usize,
    w: &GatedDeltaNetWeights,
    xn: &DeviceBuffer<f32>,
) -> Result<DeviceBuffer<f32>> {
    let (conv_offset, rec_offset) = lp
        .offsets
        .get(layer)
        .copied()
        .flatten()
        .ok_or_else(|| Error::Device(format!("layer {layer} has no linear-attention state")))?;
    let shape = lp.shape;
    let rows = lp.rows;
    let m = pass.model();
    // One token: one GEMV over the four input projections stacked, whose output row is
    // [qkv | z | b | a]; read in place as four slices. More rows: four products (the stacked
    // output would interleave them row by row).
    let stacked = match m.qkv.get(&tensor_key(&w.in_proj_qkv.weight)) {
        Some(s) if rows == 1 => Some(pass.product_with(xn, &s.weight)?),
        _ => None,
    };
    if let Some(mut all) = stacked {
        let (qkv_len, z_len) = (shape.conv_dim(), shape.value_heads * shape.value_dim);
        let hv = shape.value_heads;
        if all.len() != qkv_len + z_len + 2 * hv {
            return Err(Error::Device(format!(
                "gated deltanet: stacked input projections give {} values, expected {}",
                all.len(),
                qkv_len + z_len + 2 * hv
            )));
        }
        let (mut qkv, mut rest) = all.split_at_mut(qkv_len);
        let (z, mut rest) = rest.split_at_mut(z_len);
        let (b, a) = rest.split_at_mut(hv);
        return deltanet_core(pass, lp, (conv_offset, rec_offset), w, &mut qkv, &z, &b, &a);
    }
    let mut qkv = pass.linear(xn, &w.in_proj_qkv)?;
    let z = pass.linear(xn, &w.in_proj_z)?;
    let b = pass.linear(xn, &w.in_proj_b)?;
    let a = pass.linear(xn, &w.in_proj_a)?;
    deltanet_core(pass, lp, (conv_offset, rec_offset), w, &mut qkv, &z, &b, &a)
}

/// The layer after its input projections: conv + SiLU, gates, the delta rule from each
/// sequence's state, gated RMSNorm with z, `out_proj`.
#[allow(clippy::too_many_arguments)] // the four projections' outputs, each its own buffer
fn deltanet_core(
    pass: &mut CudaPass,
    lp: &LinearPlacement,
    (conv_offset, rec_offset): (usize, usize),
    w: &GatedDeltaNetWeights,
    qkv: &mut (impl DevicePtrMut<f32> + DevicePtr<f32>),
    z: &impl DevicePtr<f32>,
    b: &impl DevicePtr<f32>,
    a: &impl DevicePtr<f32>,
) -> Result<DeviceBuffer<f32>> {
    let shape = lp.shape;
    let rows = lp.rows;
    if qkv.len() != rows * shape.conv_dim() {
        return Err(Error::Device(format!(
            "gated deltanet: {} input rows but the placement has {rows}",
            qkv.len() / shape.conv_dim().max(1)
        )));
    }
    let m = pass.model();
    let dev = &m.dev;
    let seqs = DeltaSeqs {
        seq_start: &lp.seq_start,
        seq_len: &lp.seq_len,
        states: &lp.states,
        rows,
    };
    dev.deltanet_conv_silu(qkv, m.vec(&w.conv1d_taps)?, shape, &seqs, conv_offset)
        .map_err(dev_err)?;
    let hv = shape.value_heads;
    let mut beta = pass.alloc(rows * hv)?;
    let mut g = pass.alloc(rows * hv)?;
    dev.deltanet_gates(
        qkv,
        shape,
        b,
        a,
        m.vec(&w.a_log)?,
        m.vec(&w.dt_bias)?,
        &mut beta,
        &mut g,
    )
    .map_err(dev_err)?;
    let mut core = pass.alloc(rows * hv * shape.value_dim)?;
    dev.gated_delta_recurrent(qkv, &beta, &g, shape, &seqs, rec_offset, &mut core)
        .map_err(dev_err)?;
    dev.gated_rms_norm(&mut core, z, m.vec(&w.norm)?, lp.eps)
        .map_err(dev_err)?;
    pass.linear(&core, &w.out_proj)
}
