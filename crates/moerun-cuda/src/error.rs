//! The error type of the CUDA backend. Every failure is a value: a machine without a driver, a
//! kernel that does not compile, a shape that does not fit the buffers, a failed launch. Nothing
//! here panics on a machine without CUDA.

use cudarc::cublas::result::CublasError;
use cudarc::driver::result::DriverError;
use cudarc::nvrtc::result::NvrtcError;

/// What can go wrong in the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA on this machine: a library is missing, no device is present, the device is
    /// too old. The message says which and is meant for a user.
    #[error("CUDA is unavailable: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {context}: {source}")]
    Driver {
        context: String,
        #[source]
        source: DriverError,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS error in {context}: {source:?}")]
    Cublas {
        context: String,
        source: CublasError,
    },
    /// NVRTC refused a kernel file; `log` is the compiler's own report.
    #[error("NVRTC could not compile {file} for {arch}: {source:?}\n{log}")]
    Compile {
        file: String,
        arch: String,
        source: NvrtcError,
        log: String,
    },
    /// An argument does not fit the op (shape, length, dtype, out-of-range id).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A dtype or size this backend does not implement (yet); refused by name, never emulated.
    #[error("unsupported on CUDA: {0}")]
    Unsupported(String),
}

/// Results of this crate.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Attach a context string to a driver result.
pub(crate) trait DriverContext<T> {
    fn ctx(self, context: &str) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, DriverError> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|source| CudaError::Driver {
            context: context.to_string(),
            source,
        })
    }
}

impl<T> DriverContext<T> for std::result::Result<T, CublasError> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|source| CudaError::Cublas {
            context: context.to_string(),
            source,
        })
    }
}

/// Fail with [`CudaError::InvalidArgument`] unless `cond` holds.
pub(crate) fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(CudaError::InvalidArgument(msg()))
    }
}
