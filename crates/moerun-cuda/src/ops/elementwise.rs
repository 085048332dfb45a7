//! Small elementwise ops between the big kernels (`kernels/elementwise.cu`): residual and bias
//! adds, clamp, row gather, the sigmoid-gated shared-expert add, and the random fill that gives
//! benchmark models their weights on the device.
//!
//! Launch: 1-D grid-stride, block 256, grid ceil(n / 256) capped at 32 blocks per SM;
//! `gather_rows` one block per gathered row.

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use moerun_core::DType;

use super::{elementwise_grid, to_i32};
use crate::error::{ensure, CudaError, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix, MappedHostU32};

/// Handles of `kernels/elementwise.cu`.
pub(crate) struct ElementwiseKernels {
    add: CudaFunction,
    add_bias: CudaFunction,
    clamp: CudaFunction,
    add_sigmoid_scaled: CudaFunction,
    gather_rows: CudaFunction,
    fill_random_bf16: CudaFunction,
    fill_random_f32: CudaFunction,
    argmax_part: CudaFunction,
    argmax_finish: CudaFunction,
}

impl ElementwiseKernels {
    pub(crate) fn load(get: impl Fn(&str) -> Result<CudaFunction>) -> Result<Self> {
        Ok(ElementwiseKernels {
            add: get("add_f32")?,
            add_bias: get("add_bias_f32")?,
            clamp: get("clamp_f32")?,
            add_sigmoid_scaled: get("add_sigmoid_scaled_f32")?,
            gather_rows: get("gather_rows_f32")?,
            fill_random_bf16: get("fill_random_bf16")?,
            fill_random_f32: get("fill_random_f32")?,
            argmax_part: get("argmax_part_f32")?,
            argmax_finish: get("argmax_finish_f32")?,
        })
    }
}

/// Most parts a row of [`CudaDevice::argmax_rows`] is split into (one warp merges them).
const ARGMAX_MAX_PARTS: usize = 32;

/// The inputs of a decode step's graph that [`CudaDevice::argmax_rows_advancing`] moves on to
/// the next step of a greedy chain: row r's token becomes its pick, its position (in both forms
/// the graph reads) one further.
pub struct NextStepInputs<'a> {
    pub tokens: &'a mut CudaSlice<u32>,
    pub positions: &'a mut CudaSlice<i32>,
    pub positions_u32: &'a mut CudaSlice<u32>,
    /// Page-locked host memory ([`CudaDevice::mapped_u32`]) the picks are also written to,
    /// straight from the kernel: readable once an event recorded after the call has completed,
    /// with no copy on the stream. At least one entry per row.
    pub host_picks: Option<&'a mut MappedHostU32>,
}

/// Reusable scratch of [`CudaDevice::argmax_rows_advancing`]: the rows' parts (a per-call
/// allocation is two more stream operations between a chain's steps).
pub struct ArgmaxScratch {
    part_v: CudaSlice<f32>,
    part_i: CudaSlice<u32>,
}

impl ArgmaxScratch {
    /// Room for `rows` rows' parts.
    pub fn new(dev: &CudaDevice, rows: usize) -> Result<ArgmaxScratch> {
        Ok(ArgmaxScratch {
            part_v: dev.alloc_f32(rows * ARGMAX_MAX_PARTS)?,
            part_i: dev.alloc_u32(rows * ARGMAX_MAX_PARTS)?,
        })
    }
}

impl CudaDevice {
    fn grid_stride(&self, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (elementwise_grid(n, self.info().multiprocessors), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The greedy pick of each row of `width` values in `x`: the index of the largest, the lowest
    /// among equal ones, NaN never chosen, 0 for a row with nothing above -inf (the engine's
    /// greedy sampling), into `out` (one per row). Only the ids then cross to the host. Each row
    /// is split into parts scanned by blocks across the GPU, then merged (two launches; the
    /// parts' scratch is allocated here, outside any graph).
    pub fn argmax_rows(
        &self,
        x: &impl DevicePtr<f32>,
        width: usize,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        self.argmax_rows_with(x, width, out, None, None)
    }

    /// [`CudaDevice::argmax_rows`] with its parts in `scratch`, writing each row's next-step
    /// inputs in `next` as well (`next`'s buffers hold one entry per row).
    pub fn argmax_rows_advancing(
        &self,
        x: &impl DevicePtr<f32>,
        width: usize,
        out: &mut impl DevicePtrMut<u32>,
        scratch: &mut ArgmaxScratch,
        next: NextStepInputs<'_>,
    ) -> Result<()> {
        self.argmax_rows_with(x, width, out, Some(scratch), Some(next))
    }

    fn argmax_rows_with(
        &self,
        x: &impl DevicePtr<f32>,
        width: usize,
        out: &mut impl DevicePtrMut<u32>,
        scratch: Option<&mut ArgmaxScratch>,
        next: Option<NextStepInputs<'_>>,
    ) -> Result<()> {
        ensure(width > 0 && x.len().is_multiple_of(width), || {
            format!("argmax_rows: {} values are not rows of {width}", x.len())
        })?;
        let rows = x.len() / width;
        ensure(out.len() == rows, || {
            format!("argmax_rows: {rows} rows but room for {} ids", out.len())
        })?;
        if rows == 0 {
            return Ok(());
        }
        // About two blocks per SM in all, at most 32 parts (one warp merges them), none empty.
        let sms = self.info().multiprocessors as usize;
        let parts = (2 * sms)
            .div_ceil(rows)
            .clamp(1, ARGMAX_MAX_PARTS)
            .min(width);
        if let Some(n) = &next {
            ensure(
                n.tokens.len() >= rows
                    && n.positions.len() >= rows
                    && n.positions_u32.len() >= rows
                    && n.host_picks.as_ref().is_none_or(|h| h.len() >= rows),
                || format!("argmax_rows: next-step inputs for fewer than {rows} rows"),
            )?;
        }
        let mut owned;
        let (part_v, part_i) = match scratch {
            Some(s) => {
                ensure(s.part_v.len() >= rows * parts, || {
                    format!("argmax_rows: scratch for fewer than {rows} rows")
                })?;
                (&mut s.part_v, &mut s.part_i)
            }
            None => {
                owned = (self.alloc_f32(rows * parts)?, self.alloc_u32(rows * parts)?);
                (&mut owned.0, &mut owned.1)
            }
        };
        let xp = self.ptr(x, "argmax_rows x")?;
        let op = self.ptr_mut(out, "argmax_rows out")?;
        let (vp, ip) = (
            self.ptr_mut(part_v, "argmax_rows parts")?,
            self.ptr_mut(part_i, "argmax_rows parts")?,
        );
        let (tp, pp, pu, hp) = match next {
            Some(n) => (
                self.ptr_mut(n.tokens, "argmax_rows next tokens")?,
                self.ptr_mut(n.positions, "argmax_rows next positions")?,
                self.ptr_mut(n.positions_u32, "argmax_rows next positions")?,
                n.host_picks.map_or(0, |h| h.device_address()),
            ),
            None => (0u64, 0u64, 0u64, 0u64),
        };
        let (width_i, parts_i) = (
            super::to_i32(width, "width")?,
            super::to_i32(parts, "parts")?,
        );
        let k = &self.kernels.elementwise;
        let cfg = LaunchConfig {
            grid_dim: (super::blocks(rows, 1)?, parts as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        if crate::skip::skipped("argmax") {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(&k.argmax_part);
        b.arg(&xp).arg(&width_i).arg(&vp).arg(&ip);
        // SAFETY: x holds rows * width f32; the parts hold rows * parts entries each (parts <=
        // 32 = ARGMAX_MAX_PARTS, <= width); the argument list matches the kernel's.
        unsafe { b.launch(cfg) }.ctx("argmax_part_f32")?;
        let cfg = LaunchConfig {
            grid_dim: (super::blocks(rows, 1)?, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&k.argmax_finish);
        b.arg(&vp).arg(&ip).arg(&parts_i).arg(&op);
        b.arg(&tp).arg(&pp).arg(&pu).arg(&hp);
        // SAFETY: the parts were written above for every (row, part); out holds rows u32; the
        // next-step buffers and the host picks (the device address of page-locked host memory)
        // are null or hold at least rows entries each (checked above).
        unsafe { b.launch(cfg) }.ctx("argmax_finish_f32")?;
        Ok(())
    }

    /// `x += y`.
    pub fn add_assign(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let n = x.len();
        ensure(y.len() == n, || format!("add: x holds {n}, y {}", y.len()))?;
        if n == 0 {
            return Ok(());
        }
        let (xp, yp) = (self.ptr_mut(x, "add x")?, self.ptr(y, "add y")?);
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.elementwise.add);
        b.arg(&xp).arg(&yp).arg(&n64);
        // SAFETY: x and y hold n f32; the argument list matches the kernel's.
        unsafe { b.launch(self.grid_stride(n)) }.ctx("add_f32")?;
        Ok(())
    }

    /// `x[r, :] += bias` for every row of `x` (rows of `bias.len()`).
    pub fn add_bias(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        bias: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let (n, width) = (x.len(), bias.len());
        ensure(width > 0 && n.is_multiple_of(width), || {
            format!("add_bias: {n} values are not rows of {width}")
        })?;
        if n == 0 {
            return Ok(());
        }
        let (xp, bp) = (
            self.ptr_mut(x, "add_bias x")?,
            self.ptr(bias, "add_bias bias")?,
        );
        let (n64, w) = (n as u64, to_i32(width, "bias width")?);
        let mut b = self
            .stream
            .launch_builder(&self.kernels.elementwise.add_bias);
        b.arg(&xp).arg(&bp).arg(&n64).arg(&w);
        // SAFETY: x holds n f32 (whole rows of width), bias width f32; args match the kernel.
        unsafe { b.launch(self.grid_stride(n)) }.ctx("add_bias_f32")?;
        Ok(())
    }

    /// Clamp every value of `x` to `[-c, c]`.
    pub fn clamp(&self, x: &mut impl DevicePtrMut<f32>, c: f32) -> Result<()> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let xp = self.ptr_mut(x, "clamp x")?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.elementwise.clamp);
        b.arg(&xp).arg(&c).arg(&n64);
        // SAFETY: x holds n f32; the argument list matches the kernel's.
        unsafe { b.launch(self.grid_stride(n)) }.ctx("clamp_f32")?;
        Ok(())
    }

    /// `out[t, :] += sigmoid(gate[t]) * s[t, :]` (scale 1 without a gate), rows of `width`.
    pub fn add_sigmoid_scaled<G: DevicePtr<f32>>(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        s: &impl DevicePtr<f32>,
        gate: Option<&G>,
        width: usize,
    ) -> Result<()> {
        let n = out.len();
        ensure(s.len() == n && width > 0 && n.is_multiple_of(width), || {
            format!("add_sigmoid_scaled: out {n}, s {}, width {width}", s.len())
        })?;
        if let Some(g) = gate {
            ensure(g.len() == n / width, || {
                format!(
                    "add_sigmoid_scaled: {} gates for {} rows",
                    g.len(),
                    n / width
                )
            })?;
        }
        if n == 0 {
            return Ok(());
        }
        let op = self.ptr_mut(out, "add_sigmoid_scaled out")?;
        let sp = self.ptr(s, "add_sigmoid_scaled s")?;
        let gp = match gate {
            Some(g) => self.ptr(g, "add_sigmoid_scaled gate")?,
            None => 0u64,
        };
        let (n64, w) = (n as u64, to_i32(width, "width")?);
        let mut b = self
            .stream
            .launch_builder(&self.kernels.elementwise.add_sigmoid_scaled);
        b.arg(&op).arg(&sp).arg(&gp).arg(&n64).arg(&w);
        // SAFETY: out and s hold n f32, gate (when non-null) n / width; args match the kernel.
        unsafe { b.launch(self.grid_stride(n)) }.ctx("add_sigmoid_scaled_f32")?;
        Ok(())
    }

    /// `out[j, :] = x[rows[j], :]` for rows of `width`; `rows` are device i32 indices, each
    /// `< x.len() / width` (checked by the caller, which built them).
    pub fn gather_rows(
        &self,
        x: &impl DevicePtr<f32>,
        rows: &impl DevicePtr<i32>,
        width: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let m = rows.len();
        ensure(out.len() == m * width && width > 0, || {
            format!(
                "gather_rows: out holds {}, expected {m} x {width}",
                out.len()
            )
        })?;
        if m == 0 {
            return Ok(());
        }
        let xp = self.ptr(x, "gather_rows x")?;
        let rp = self.ptr(rows, "gather_rows rows")?;
        let op = self.ptr_mut(out, "gather_rows out")?;
        let w = to_i32(width, "width")?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(m)
                    .map_err(|_| CudaError::InvalidArgument(format!("gather_rows: {m} rows")))?,
                1,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(&self.kernels.elementwise.gather_rows);
        b.arg(&xp).arg(&rp).arg(&op).arg(&w);
        // SAFETY: rows holds m in-range row indices of x (caller's contract), out m * width f32.
        unsafe { b.launch(cfg) }.ctx("gather_rows_f32")?;
        Ok(())
    }

    /// A `[rows, cols]` matrix of `dtype` (bf16 or f32) filled on the device with uniform values
    /// in `[-scale, scale)` derived from `seed`: the weights of synthetic benchmark models, made
    /// where they are used so that tens of GB need not cross PCIe.
    pub fn random_matrix(
        &self,
        dtype: DType,
        rows: usize,
        cols: usize,
        seed: u64,
        scale: f32,
    ) -> Result<DeviceMatrix> {
        let n = rows * cols;
        let mut data = self
            .stream
            .alloc_zeros::<u8>(n * dtype.size())
            .ctx("allocating")?;
        self.fill_random(&mut data, dtype, seed, scale)?;
        DeviceMatrix::from_parts(dtype, rows, cols, data)
    }

    /// Fill `data` (bit patterns of `dtype`, bf16 or f32) with uniform values in
    /// `[-scale, scale)` derived from `seed`.
    pub fn fill_random(
        &self,
        data: &mut CudaSlice<u8>,
        dtype: DType,
        seed: u64,
        scale: f32,
    ) -> Result<()> {
        let kernel = match dtype {
            DType::BF16 => &self.kernels.elementwise.fill_random_bf16,
            DType::F32 => &self.kernels.elementwise.fill_random_f32,
            DType::F16 => {
                return Err(CudaError::Unsupported("random f16 weights".into()));
            }
        };
        let n = data.len() / dtype.size();
        if n == 0 {
            return Ok(());
        }
        let p = self.ptr_mut(data, "fill_random")?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(kernel);
        b.arg(&p).arg(&n64).arg(&seed).arg(&scale);
        // SAFETY: data holds n elements of dtype; the argument list matches the kernel's.
        unsafe { b.launch(self.grid_stride(n)) }.ctx("fill_random")?;
        Ok(())
    }
}
