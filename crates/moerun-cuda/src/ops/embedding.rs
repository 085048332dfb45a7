//! Embedding gather (`kernels/embedding.cu`): rows of a bf16, f16 or f32 table widened to f32.
//!
//! Launch: grid (tokens), block 256; block t copies row `ids[t]`.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use moerun_core::DType;

use super::to_i32;
use crate::device::dtype_slot;
use crate::error::{ensure, CudaError, DriverContext, Result};
use crate::{CudaDevice, DeviceMatrix};

impl CudaDevice {
    /// `out[t, :] = table[ids[t], :]` widened to f32, `out` being `[ids.len(), table.cols()]`.
    /// The ids are checked against the table on the host, then uploaded.
    pub fn embed(
        &self,
        table: &DeviceMatrix,
        ids: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let hidden = table.cols();
        ensure(out.len() == ids.len() * hidden, || {
            format!(
                "embed: out holds {}, expected {} tokens x {hidden}",
                out.len(),
                ids.len()
            )
        })?;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows()) {
            return Err(CudaError::InvalidArgument(format!(
                "token id {bad} is out of range (vocabulary size {})",
                table.rows()
            )));
        }
        if ids.is_empty() || hidden == 0 {
            return Ok(());
        }
        let ids_dev = self.upload(ids)?;
        // `ids_dev` is freed on this stream after the kernel (stream-ordered free).
        self.embed_ids(table, &ids_dev, out)
    }

    /// [`CudaDevice::embed`] with the ids already on the device (`out` is
    /// `[ids.len(), table.cols()]`): what a CUDA graph, whose inputs are device buffers, runs. An
    /// id outside the table gives a row of NaN, never an out-of-bounds read.
    pub fn embed_ids(
        &self,
        table: &DeviceMatrix,
        ids: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (hidden, n) = (table.cols(), ids.len());
        ensure(out.len() == n * hidden, || {
            format!(
                "embed: out holds {}, expected {n} tokens x {hidden}",
                out.len()
            )
        })?;
        if n == 0 || hidden == 0 {
            return Ok(());
        }
        let t = table.device_ptr(self, "embed table")?;
        let i = self.ptr(ids, "embed ids")?;
        let o = self.ptr_mut(out, "embed out")?;
        let hidden_i = to_i32(hidden, "hidden")?;
        let rows = u32::try_from(table.rows())
            .map_err(|_| CudaError::InvalidArgument("embedding table too large".into()))?;
        let func = &self.kernels.embed[dtype_slot(table.dtype())];
        let cfg = LaunchConfig {
            grid_dim: (to_i32(n, "tokens")? as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(func);
        b.arg(&t).arg(&i).arg(&o).arg(&hidden_i).arg(&rows);
        // SAFETY: the kernel reads table rows only for ids < rows (others give NaN); the table
        // holds rows * hidden elements of the kernel's dtype (DeviceMatrix invariant), out holds
        // n * hidden f32, ids n u32.
        unsafe { b.launch(cfg) }.ctx(match table.dtype() {
            DType::BF16 => "embed_bf16",
            DType::F16 => "embed_f16",
            DType::F32 => "embed_f32",
        })?;
        Ok(())
    }
}
