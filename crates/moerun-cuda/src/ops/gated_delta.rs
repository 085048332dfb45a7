//! Qwen3.5's ops (`kernels/gated_delta.cu`): the attention output gate (split of the doubled
//! q_proj, sigmoid gate) and the Gated DeltaNet's steps: causal conv + SiLU from each sequence's
//! conv window, l2norm of q/k with β and the decay, the gated delta rule from each sequence's
//! recurrent state (token after token, exact: a warp per 8-32 state columns of a (value head,
//! sequence) for key_dim 16/32/64/128, a block per (value head, sequence) splitting the state's
//! rows for other key_dims), gated RMSNorm.
//!
//! The per-sequence state lives in device buffers owned by the caller (one per state slot);
//! [`DeltaSeqs`] names, per sequence of the batch, its rows and the address of its slot, all in
//! device memory so that a CUDA graph can replay a decode step with other slots.

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::{blocks, elementwise_grid, to_i32};
use crate::error::{ensure, DriverContext, Result};
use crate::CudaDevice;

/// Most conv taps the conv kernel keeps in registers.
pub const DELTA_MAX_TAPS: usize = 8;
/// Most key_dim the recurrent kernel takes (its shared q/k rows).
pub const DELTA_MAX_KEY_DIM: usize = 256;
/// Rows of the state one thread keeps in registers: one kernel instantiation each.
const DELTA_ROWS: [usize; 3] = [8, 16, 32];
/// key_dims of the column-split recurrent kernel (one instantiation each, lanes per column
/// `key_dim / 32` at least 1); other key_dims take the row-split kernel.
const DELTA_COLUMN_KEY_DIMS: [usize; 4] = [16, 32, 64, 128];
/// Threads of a recurrent block at most.
const DELTA_MAX_THREADS: usize = 512;

/// Handles of `kernels/gated_delta.cu`.
pub(crate) struct GatedDeltaKernels {
    split_query_gate: CudaFunction,
    sigmoid_gate: CudaFunction,
    conv: CudaFunction,
    gates: CudaFunction,
    /// The row-split kernel, by [`DELTA_ROWS`].
    recurrent: [CudaFunction; 3],
    /// The column-split kernel, by [`DELTA_COLUMN_KEY_DIMS`].
    columns: [CudaFunction; 4],
    gated_norm: CudaFunction,
}

impl GatedDeltaKernels {
    pub(crate) fn load(get: impl Fn(&str) -> Result<CudaFunction>) -> Result<Self> {
        Ok(GatedDeltaKernels {
            split_query_gate: get("split_query_gate_f32")?,
            sigmoid_gate: get("sigmoid_gate_f32")?,
            conv: get("deltanet_conv_silu_f32")?,
            gates: get("deltanet_gates_f32")?,
            recurrent: [
                get("gated_delta_recurrent_r8_f32")?,
                get("gated_delta_recurrent_r16_f32")?,
                get("gated_delta_recurrent_r32_f32")?,
            ],
            columns: [
                get("gated_delta_columns_k16_f32")?,
                get("gated_delta_columns_k32_f32")?,
                get("gated_delta_columns_k64_f32")?,
                get("gated_delta_columns_k128_f32")?,
            ],
            gated_norm: get("gated_rms_norm_f32")?,
        })
    }
}

/// Head shapes of a Gated DeltaNet layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

impl DeltaShape {
    /// Channels of the conv: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// The recurrent kernel's rows per thread (index into [`DELTA_ROWS`]) and row groups: the
    /// fewest rows per thread (the most threads) that fit a block.
    fn layout(&self) -> Option<(usize, usize)> {
        DELTA_ROWS.iter().enumerate().find_map(|(i, &rows)| {
            let groups = self.key_dim / rows;
            (self.key_dim.is_multiple_of(rows) && self.value_dim * groups <= DELTA_MAX_THREADS)
                .then_some((i, groups))
        })
    }

    /// Whether the kernels take this shape: an error naming the limits otherwise.
    pub fn check(&self) -> Result<()> {
        let ok = self.key_heads > 0
            && self.value_heads.is_multiple_of(self.key_heads)
            && self.key_dim > 0
            && self.key_dim <= DELTA_MAX_KEY_DIM
            && self.value_dim > 0
            && self.layout().is_some()
            && (2..=DELTA_MAX_TAPS).contains(&self.conv_kernel);
        ensure(ok, || {
            format!(
                "gated delta: unsupported shape {self:?} (key_dim a multiple of 8 up to \
                 {DELTA_MAX_KEY_DIM}, value_dim * key_dim / 32 <= {DELTA_MAX_THREADS}, \
                 2..={DELTA_MAX_TAPS} conv taps, value heads a multiple of key heads)"
            )
        })
    }
}

/// The batch's sequences as the Gated DeltaNet kernels see them, all on the device: sequence
/// `s` is rows `seq_start[s] .. seq_start[s] + seq_len[s]` and its state slot starts at address
/// `states[s]` (unused when it has no rows).
pub struct DeltaSeqs<'a> {
    pub seq_start: &'a CudaSlice<i32>,
    pub seq_len: &'a CudaSlice<i32>,
    pub states: &'a CudaSlice<u64>,
    /// Rows of the batch (the sum of `seq_len`).
    pub rows: usize,
}

impl DeltaSeqs<'_> {
    fn sequences(&self) -> Result<usize> {
        let n = self.seq_start.len();
        ensure(self.seq_len.len() == n && self.states.len() == n, || {
            format!(
                "gated delta: {n} sequence starts, {} lengths, {} state addresses",
                self.seq_len.len(),
                self.states.len()
            )
        })?;
        Ok(n)
    }
}

impl CudaDevice {
    fn delta_grid_stride(&self, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (elementwise_grid(n, self.info().multiprocessors), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The device address of a state slot buffer, for [`DeltaSeqs::states`].
    pub fn state_address(&self, slot: &CudaSlice<f32>) -> Result<u64> {
        self.ptr(slot, "state slot")
    }

    /// Split Qwen3.5's doubled q_proj output (each head's query then its gate, `2 * head_dim`
    /// values) into queries and gates (`[rows, heads * head_dim]` each).
    pub fn split_query_gate(
        &self,
        src: &impl DevicePtr<f32>,
        head_dim: usize,
        q: &mut impl DevicePtrMut<f32>,
        gate: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let n = q.len();
        ensure(
            head_dim > 0 && src.len() == 2 * n && gate.len() == n && n.is_multiple_of(head_dim),
            || {
                format!(
                    "split_query_gate: src {}, q {n}, gate {}, head_dim {head_dim}",
                    src.len(),
                    gate.len()
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        let sp = self.ptr(src, "split_query_gate src")?;
        let qp = self.ptr_mut(q, "split_query_gate q")?;
        let gp = self.ptr_mut(gate, "split_query_gate gate")?;
        let (n64, d) = (n as u64, to_i32(head_dim, "head_dim")?);
        let mut b = self
            .stream
            .launch_builder(&self.kernels.gated_delta.split_query_gate);
        b.arg(&sp).arg(&qp).arg(&gp).arg(&n64).arg(&d);
        // SAFETY: src holds 2n f32, q and gate n each; the argument list matches the kernel's.
        unsafe { b.launch(self.delta_grid_stride(n)) }.ctx("split_query_gate_f32")?;
        Ok(())
    }

    /// `x *= sigmoid(gate)`.
    pub fn sigmoid_gate(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        gate: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let n = x.len();
        ensure(gate.len() == n, || {
            format!("sigmoid_gate: x holds {n}, gate {}", gate.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, "sigmoid_gate x")?;
        let gp = self.ptr(gate, "sigmoid_gate gate")?;
        let n64 = n as u64;
        let mut b = self
            .stream
            .launch_builder(&self.kernels.gated_delta.sigmoid_gate);
        b.arg(&xp).arg(&gp).arg(&n64);
        // SAFETY: x and gate hold n f32; the argument list matches the kernel's.
        unsafe { b.launch(self.delta_grid_stride(n)) }.ctx("sigmoid_gate_f32")?;
        Ok(())
    }

    /// Causal depthwise conv1d then SiLU over each sequence's rows of `x` (`[rows, conv_dim]`,
    /// in place), from the conv window at `conv_offset` f32 into its state slot, which is left
    /// holding the last `conv_kernel - 1` inputs. `taps` is `[conv_kernel, conv_dim]`.
    pub fn deltanet_conv_silu(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        taps: &impl DevicePtr<f32>,
        shape: DeltaShape,
        seqs: &DeltaSeqs,
        conv_offset: usize,
    ) -> Result<()> {
        shape.check()?;
        let channels = shape.conv_dim();
        let n = seqs.sequences()?;
        ensure(
            x.len() == seqs.rows * channels && taps.len() == shape.conv_kernel * channels,
            || {
                format!(
                    "deltanet_conv_silu: x {} for {} rows of {channels}, taps {}",
                    x.len(),
                    seqs.rows,
                    taps.len()
                )
            },
        )?;
        if n == 0 || seqs.rows == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, "conv x")?;
        let tp = self.ptr(taps, "conv taps")?;
        let (stp, ssp, slp) = (
            self.ptr(seqs.states, "conv states")?,
            self.ptr(seqs.seq_start, "conv seq_start")?,
            self.ptr(seqs.seq_len, "conv seq_len")?,
        );
        let off = conv_offset as u64;
        let (ch, k) = (
            to_i32(channels, "conv_dim")?,
            to_i32(shape.conv_kernel, "conv kernel")?,
        );
        let cfg = LaunchConfig {
            grid_dim: (blocks(channels, 256)?, n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.kernels.gated_delta.conv);
        b.arg(&xp)
            .arg(&tp)
            .arg(&stp)
            .arg(&ssp)
            .arg(&slp)
            .arg(&off)
            .arg(&ch)
            .arg(&k);
        // SAFETY: x holds rows * channels f32 and the sequences' rows lie within it (the caller
        // built seq_start/seq_len from the batch); each state address is a slot buffer holding
        // the window at conv_offset; the argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("deltanet_conv_silu_f32")?;
        Ok(())
    }

    /// On the conv output `qkv` (`[rows, conv_dim]`): l2-normalise each q and k head in place,
    /// and write `beta = sigmoid(b)` and `g = -exp(a_log) * softplus(a + dt_bias)`
    /// (`[rows, value_heads]` each).
    #[allow(clippy::too_many_arguments)]
    pub fn deltanet_gates(
        &self,
        qkv: &mut impl DevicePtrMut<f32>,
        shape: DeltaShape,
        b_in: &impl DevicePtr<f32>,
        a_in: &impl DevicePtr<f32>,
        a_log: &impl DevicePtr<f32>,
        dt_bias: &impl DevicePtr<f32>,
        beta: &mut impl DevicePtrMut<f32>,
        g: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        shape.check()?;
        let conv_dim = shape.conv_dim();
        let rows = qkv.len() / conv_dim;
        let hv = shape.value_heads;
        ensure(
            qkv.len() == rows * conv_dim
                && [b_in.len(), a_in.len(), beta.len(), g.len()] == [rows * hv; 4]
                && a_log.len() == hv
                && dt_bias.len() == hv,
            || {
                format!(
                    "deltanet_gates: qkv {}, b {}, a {}, beta {}, g {}, A_log {}, dt_bias {} \
                     for {rows} rows of {hv} heads",
                    qkv.len(),
                    b_in.len(),
                    a_in.len(),
                    beta.len(),
                    g.len(),
                    a_log.len(),
                    dt_bias.len()
                )
            },
        )?;
        if rows == 0 {
            return Ok(());
        }
        let qp = self.ptr_mut(qkv, "gates qkv")?;
        let (bp, ap, alp, dtp) = (
            self.ptr(b_in, "gates b")?,
            self.ptr(a_in, "gates a")?,
            self.ptr(a_log, "gates A_log")?,
            self.ptr(dt_bias, "gates dt_bias")?,
        );
        let betap = self.ptr_mut(beta, "gates beta")?;
        let gp = self.ptr_mut(g, "gates g")?;
        let (cd, kh, kd, vh) = (
            to_i32(conv_dim, "conv_dim")?,
            to_i32(shape.key_heads, "key heads")?,
            to_i32(shape.key_dim, "key_dim")?,
            to_i32(hv, "value heads")?,
        );
        // A warp per q/k head, up to 32 warps (heads past that loop).
        let warps = (2 * shape.key_heads).clamp(1, 32) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks(rows, 1)?, 1, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.kernels.gated_delta.gates);
        b.arg(&qp)
            .arg(&bp)
            .arg(&ap)
            .arg(&alp)
            .arg(&dtp)
            .arg(&betap)
            .arg(&gp)
            .arg(&cd)
            .arg(&kh)
            .arg(&kd)
            .arg(&vh);
        // SAFETY: all lengths checked above; the argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("deltanet_gates_f32")?;
        Ok(())
    }

    /// The gated delta rule over each sequence's rows, token after token, from (and advancing)
    /// the recurrent state at `rec_offset` f32 into its slot. `qkv` is the normalised conv
    /// output, `out` `[rows, value_heads * value_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_recurrent(
        &self,
        qkv: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        g: &impl DevicePtr<f32>,
        shape: DeltaShape,
        seqs: &DeltaSeqs,
        rec_offset: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        shape.check()?;
        let n = seqs.sequences()?;
        let (conv_dim, hv, dv) = (shape.conv_dim(), shape.value_heads, shape.value_dim);
        let rows = seqs.rows;
        ensure(
            qkv.len() == rows * conv_dim
                && beta.len() == rows * hv
                && g.len() == rows * hv
                && out.len() == rows * hv * dv,
            || {
                format!(
                    "gated_delta_recurrent: qkv {}, beta {}, g {}, out {} for {rows} rows",
                    qkv.len(),
                    beta.len(),
                    g.len(),
                    out.len()
                )
            },
        )?;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        let (qp, bp, gp) = (
            self.ptr(qkv, "delta qkv")?,
            self.ptr(beta, "delta beta")?,
            self.ptr(g, "delta g")?,
        );
        let (stp, ssp, slp) = (
            self.ptr(seqs.states, "delta states")?,
            self.ptr(seqs.seq_start, "delta seq_start")?,
            self.ptr(seqs.seq_len, "delta seq_len")?,
        );
        let op = self.ptr_mut(out, "delta out")?;
        let off = rec_offset as u64;
        let (kh, vh, vd, cd) = (
            to_i32(shape.key_heads, "key heads")?,
            to_i32(hv, "value heads")?,
            to_i32(dv, "value_dim")?,
            to_i32(conv_dim, "conv_dim")?,
        );
        if let Some(i) = DELTA_COLUMN_KEY_DIMS
            .iter()
            .position(|&k| k == shape.key_dim)
        {
            // Column split: 32 / lanes-per-column columns per warp.
            let columns_per_warp = 32 / (shape.key_dim / 32).max(1);
            let cfg = LaunchConfig {
                grid_dim: (blocks(dv, columns_per_warp)?, hv as u32, n as u32),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self
                .stream
                .launch_builder(&self.kernels.gated_delta.columns[i]);
            b.arg(&qp)
                .arg(&bp)
                .arg(&gp)
                .arg(&stp)
                .arg(&ssp)
                .arg(&slp)
                .arg(&off)
                .arg(&kh)
                .arg(&vh)
                .arg(&vd)
                .arg(&cd)
                .arg(&op);
            // SAFETY: lengths checked above; the sequences' rows lie within the batch and each
            // state address is a slot buffer holding the layer's recurrent state at
            // rec_offset; key_dim is the kernel's DK; the argument list matches the kernel's.
            unsafe { b.launch(cfg) }.ctx("gated_delta_columns_f32")?;
            return Ok(());
        }
        let (kernel, groups) = shape.layout().expect("checked above");
        let args = [
            kh,
            vh,
            to_i32(shape.key_dim, "key_dim")?,
            vd,
            to_i32(groups, "groups")?,
            cd,
        ];
        let cfg = LaunchConfig {
            grid_dim: (hv as u32, n as u32, 1),
            block_dim: ((dv * groups) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(&self.kernels.gated_delta.recurrent[kernel]);
        b.arg(&qp)
            .arg(&bp)
            .arg(&gp)
            .arg(&stp)
            .arg(&ssp)
            .arg(&slp)
            .arg(&off);
        for a in &args {
            b.arg(a);
        }
        b.arg(&op);
        // SAFETY: lengths checked above; the sequences' rows lie within the batch and each
        // state address is a slot buffer holding the layer's recurrent state at rec_offset;
        // key_dim = groups * rows, dv * groups <= 512 threads, key_dim <= 256 (shape.check);
        // the argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("gated_delta_recurrent_f32")?;
        Ok(())
    }

    /// The Gated DeltaNet's output norm in place: each row of `weight.len()` values of `x`
    /// becomes `(weight * (x * inv_rms)) * silu(z)` (`z` shaped as `x`).
    pub fn gated_rms_norm(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        z: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
    ) -> Result<()> {
        let (len, width) = (x.len(), weight.len());
        ensure(
            width > 0 && len.is_multiple_of(width) && z.len() == len,
            || format!("gated_rms_norm: x {len}, z {}, weight {width}", z.len()),
        )?;
        let rows = len / width;
        if rows == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, "gated_rms_norm x")?;
        let zp = self.ptr(z, "gated_rms_norm z")?;
        let wp = self.ptr(weight, "gated_rms_norm weight")?;
        let (r, w) = (to_i32(rows, "rows")?, to_i32(width, "width")?);
        let cfg = LaunchConfig {
            grid_dim: (blocks(rows, 4)?, 1, 1),
            block_dim: (32, 4, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(&self.kernels.gated_delta.gated_norm);
        b.arg(&xp).arg(&zp).arg(&wp).arg(&r).arg(&w).arg(&eps);
        // SAFETY: x and z hold rows * width f32, weight width; args match the kernel.
        unsafe { b.launch(cfg) }.ctx("gated_rms_norm_f32")?;
        Ok(())
    }
}
