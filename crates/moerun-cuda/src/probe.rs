//! Finding out, without panicking, whether this machine can run the CUDA backend.
//!
//! cudarc loads the CUDA libraries lazily and panics when one is missing. Before the first cudarc
//! call this module tries to load each library the backend needs (the driver's `libcuda.so.1`,
//! NVRTC and cuBLAS) and, when one is absent, returns [`CudaError::Unavailable`] naming it, so a
//! CPU-only machine (and CI) gets one clear sentence instead of a panic.

use crate::error::{CudaError, Result};

/// A shared library the backend needs, and what to tell a user who lacks it.
struct Library {
    name: &'static str,
    present: fn() -> bool,
    hint: &'static str,
}

fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the candidate names and closes what it opened.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn nvrtc_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn cublas_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

const LIBRARIES: [Library; 3] = [
    Library {
        name: "libcuda.so.1",
        present: driver_present,
        hint: "no NVIDIA driver on this machine",
    },
    Library {
        name: "libnvrtc.so.13",
        present: nvrtc_present,
        hint: "the CUDA toolkit's NVRTC; add its lib64 folder, e.g. /usr/local/cuda/lib64, to \
               LD_LIBRARY_PATH",
    },
    Library {
        name: "libcublas.so.13",
        present: cublas_present,
        hint: "the CUDA toolkit's cuBLAS; add its lib64 folder, e.g. /usr/local/cuda/lib64, to \
               LD_LIBRARY_PATH",
    },
];

/// Check that every library the backend needs can be loaded.
pub fn check_libraries() -> Result<()> {
    for lib in &LIBRARIES {
        if !(lib.present)() {
            return Err(CudaError::Unavailable(format!(
                "{} not found ({})",
                lib.name, lib.hint
            )));
        }
    }
    Ok(())
}

/// Whether NVRTC alone can be loaded (enough to compile kernels, e.g. in a test, without a GPU).
pub fn nvrtc_available() -> bool {
    nvrtc_present()
}

/// Run `f`, turning a panic inside cudarc (a symbol missing from an older driver, say) into
/// [`CudaError::Unavailable`].
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(CudaError::Unavailable(format!("{what}: {msg}")))
        }
    }
}
