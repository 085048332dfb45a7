//! The device's memory: how much is free, and its roofline as `moerun bench` uses it: a device-to-device copy of a buffer far
//! larger than L2, timed with events, counted as bytes read plus bytes written.

use crate::error::{DriverContext, Result};
use crate::CudaDevice;

impl CudaDevice {
    /// (free, total) bytes of device memory, as the driver reports them now.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().ctx("reading the memory size")
    }

    /// Bytes per second a large device-to-device copy moves (read + written), best of `reps`.
    pub fn measure_copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        let n = (bytes / 4).max(1);
        let src = self.zeros::<f32>(n)?;
        let mut dst = self.zeros::<f32>(n)?;
        let mut best = f32::INFINITY;
        for _ in 0..reps.max(1) + 1 {
            let ms = self.elapsed_ms(|| self.stream.memcpy_dtod(&src, &mut dst).ctx("copy"))?;
            best = best.min(ms);
        }
        Ok(2.0 * (n * 4) as f64 / (best as f64 * 1e-3))
    }
}
