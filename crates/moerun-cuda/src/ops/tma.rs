//! Tensor maps (`CUtensorMap`) for the Hopper kernels' TMA loads (`cp.async.bulk.tensor`): the
//! MoE wgmma pair kernels' weights and the wgmma attention's batch copy. Both read bf16 boxes in
//! the 128-byte swizzle wgmma expects.

use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::DeviceRepr;

use crate::error::{DriverContext, Result};

/// A `CUtensorMap` as the kernels take it (`WgMap`, `FaMap`: by value, 128 bytes, 64-byte
/// aligned); zeros where a build or a call needs none.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct TensorMap([u64; 16]);

// SAFETY: plain bytes, laid out as the kernels' map parameters (128 bytes, 64-aligned).
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    pub(crate) const NONE: TensorMap = TensorMap([0; 16]);

    /// A rank-R map of bf16 elements at `addr`: `dims` innermost first, `strides` the byte
    /// strides of dimensions 1.. (R - 1 of them, multiples of 16), read in boxes of `boxes`
    /// with the 128-byte swizzle; reads past an edge give zeros. `what` names the map in errors.
    pub(crate) fn bf16_swizzled<const R: usize>(
        addr: u64,
        dims: [u64; R],
        strides: &[u64],
        boxes: [u32; R],
        what: &str,
    ) -> Result<TensorMap> {
        assert_eq!(strides.len() + 1, R, "a rank-{R} map has {} strides", R - 1);
        let steps = [1u32; R];
        let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
        // SAFETY: dims, boxes and steps hold R entries and strides R - 1, as a rank-R map
        // reads; the callers pass a device allocation at addr that covers dims (16-byte aligned,
        // strides multiples of 16).
        unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                R as u32,
                addr as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .ctx(&format!("cuTensorMapEncodeTiled ({what})"))?;
        // SAFETY: the call above succeeded, so it wrote the map.
        Ok(TensorMap(unsafe { map.assume_init() }.opaque))
    }
}
