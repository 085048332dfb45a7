//! Shared vocabulary of moerun: element types, weight tensors that borrow their bytes from a file
//! mapping (or own them), the error type, and the paged-KV block allocation policy.
//!
//! Everything here is backend-neutral: the CPU and CUDA backends and the model code all speak it.

pub mod blocks;
pub mod device;
pub mod dtype;
pub mod error;
pub mod tensor;

pub use blocks::{BlockAllocator, BlockTable, RELEASED_BLOCK};
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use tensor::{MatRef, SharedBytes, Tensor};
