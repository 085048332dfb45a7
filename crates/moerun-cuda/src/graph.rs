//! CUDA graphs: the work a closure enqueues on the device's stream, captured once and replayed
//! with one launch. A decode step is hundreds of small kernels whose launch cost, not their run
//! time, would otherwise set the speed.
//!
//! Capture records kernels instead of running them, so the captured work must not synchronise or
//! copy from host memory; buffers it allocates become the graph's own. Whatever buffers it reads
//! or writes outside must outlive the graph: their addresses are baked in.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use crate::error::{CudaError, DriverContext, Result};
use crate::CudaDevice;

/// A captured, instantiated graph of this device's stream.
pub struct DeviceGraph {
    graph: CudaGraph,
}

// SAFETY: a CudaGraph is only launched through `&mut self`-free calls that the owner serialises
// (DeviceGraph is not Sync); moving it between threads is allowed by the driver.
unsafe impl Send for DeviceGraph {}

impl DeviceGraph {
    /// Replay the captured work on the device's stream.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().ctx("launching a CUDA graph")
    }
}

impl CudaDevice {
    /// Capture what `work` enqueues into a graph. If `work` fails, capture is ended and its
    /// error returned; if the driver refuses the capture (an op that cannot be captured), the
    /// error says so.
    pub fn capture(&self, work: impl FnOnce() -> Result<()>) -> Result<DeviceGraph> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .ctx("beginning a graph capture")?;
        let worked = work();
        let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
        worked?;
        let graph = ended
            .ctx("ending a graph capture")?
            .ok_or_else(|| CudaError::Unsupported("the graph capture recorded nothing".into()))?;
        graph.upload().ctx("uploading a CUDA graph")?;
        Ok(DeviceGraph { graph })
    }

    /// Copy a device buffer into another (the first `src.len()` values of `dst`), in stream
    /// order.
    pub fn copy_within<T>(
        &self,
        src: &impl cudarc::driver::DevicePtr<T>,
        dst: &mut impl cudarc::driver::DevicePtrMut<T>,
    ) -> Result<()> {
        crate::error::ensure(src.len() <= dst.len(), || {
            format!(
                "copy_within: {} values into a buffer of {}",
                src.len(),
                dst.len()
            )
        })?;
        self.stream
            .memcpy_dtod(src, dst)
            .ctx("copying on the device")
    }

    /// Copy host values into an existing device buffer (a graph's input), in stream order.
    pub fn copy_to_device<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &[T],
        dst: &mut impl cudarc::driver::DevicePtrMut<T>,
    ) -> Result<()> {
        crate::error::ensure(src.len() <= dst.len(), || {
            format!(
                "copy_to_device: {} values into a buffer of {}",
                src.len(),
                dst.len()
            )
        })?;
        self.stream
            .memcpy_htod(src, dst)
            .ctx("copying to the device")
    }
}
