//! CUDA graphs: the work a closure enqueues on the device's stream, captured once and replayed
//! with one launch. A decode step is hundreds of small kernels whose launch cost, not their run
//! time, would otherwise set the speed.
//!
//! Capture records kernels instead of running them, so the captured work must not synchronise or
//! copy from host memory; buffers it allocates become the graph's own. Whatever buffers it reads
//! or writes outside must outlive the graph: their addresses are baked in.

use std::ffi::CStr;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUstreamCaptureMode};
use cudarc::driver::{CudaStream, DriverError};

use crate::device::capture_guard;
use crate::error::{CudaError, DriverContext, Result};
use crate::CudaDevice;

/// Kernels whose every block calls `pdl_entry()` (kernels/common.cuh) before touching memory an
/// earlier kernel wrote or reads: in a captured graph the edge into such a kernel is made
/// programmatic, so it launches (and prefetches its weights) while its predecessor runs. Any
/// other kernel keeps its ordinary edge.
pub const PDL_KERNELS: &[&str] = &[
    "add_bias_f32",
    "add_f32",
    "add_rms_norm_f32",
    "add_sigmoid_scaled_f32",
    "attn_cluster_d*",
    "attn_split_d*",
    "clamp_f32",
    "deltanet_conv_silu_f32",
    "deltanet_gates_f32",
    "embed_bf16",
    "embed_f16",
    "embed_f32",
    "gated_delta_columns_k*",
    "gated_delta_recurrent_r*",
    "gated_rms_norm_f32",
    "gather_rows_f32",
    "gelu_tanh_mul_f32",
    "gemma4_attn_tail_f32",
    "gemma4_ffn_tail_f32",
    "gemv_bf16_m*",
    "gemv_f16_m*",
    "gemv_f32_m*",
    "gemv_route_*",
    "gemv_rows_*",
    "moe_tiny_down_*",
    "moe_tiny_gate_up_*",
    "qkv_split_norm_rope_early_f32",
    "qkv_split_norm_rope_f32",
    "rms_norm_block_f32",
    "rms_norm_f32",
    "rope_rotate_half_f32",
    "route_topk_f32_l*",
    "scale_f32",
    "sigmoid_gate_f32",
    "silu_mul_f32",
    "softcap_f32",
    "split_query_gate_f32",
];

/// Kernels of [`PDL_KERNELS`] that let their successor launch *before* they wait
/// (`pdl_entry_launch_first`, kernels/common.cuh): latency-bound kernels of few blocks whose
/// successor streams weights. Their successor's pre-wait part may then run while the kernel
/// before them still runs.
pub const LAUNCH_FIRST_KERNELS: &[&str] = &[
    "add_rms_norm_f32",
    "gemma4_attn_tail_f32",
    "gemma4_ffn_tail_f32",
    "qkv_split_norm_rope_*",
    "rms_norm_block_f32",
    "route_topk_f32_l*",
];

/// Kernels of [`PDL_KERNELS`] whose pre-wait part reads activations an earlier kernel of the pass
/// wrote (add_rms_norm, the Gemma 4 tails, gemv_route_norm, gemv_rows_norm and gemv_rows_route
/// the residual, moe_tiny_down its expert ids): safe behind a kernel that waits before it lets them launch,
/// not behind one of [`LAUNCH_FIRST_KERNELS`]. Such an edge keeps its ordinary dependency. (No
/// kernel *writes* a pass buffer before its wait: until then an earlier kernel may still be using
/// those bytes. moe_tiny_gate_up_norm's pre-wait polls read ids that gemv_rows_route reset after
/// its own wait, before it let gate_up launch.)
pub const EARLY_ACTIVATION_READERS: &[&str] = &[
    "add_rms_norm_f32",
    "gemma4_attn_tail_f32",
    "gemma4_ffn_tail_f32",
    "gemv_route_norm_*",
    "gemv_rows_norm_*",
    "gemv_rows_route_*",
    "moe_tiny_down_*",
];

fn named_in(list: &[&str], name: &str) -> bool {
    list.iter().any(|k| pdl_entry_names(k, name))
}

/// Whether `name` is in [`LAUNCH_FIRST_KERNELS`].
pub fn is_launch_first_kernel(name: &str) -> bool {
    named_in(LAUNCH_FIRST_KERNELS, name)
}

/// Whether the edge from kernel `from` into kernel `to` may be programmatic.
pub fn edge_may_be_programmatic(from: &str, to: &str) -> bool {
    is_pdl_kernel(to) && !(is_launch_first_kernel(from) && named_in(EARLY_ACTIVATION_READERS, to))
}

/// Whether the [`PDL_KERNELS`] entry `entry` names kernel `name` (an entry ending in `*` names a
/// template's family by prefix).
pub fn pdl_entry_names(entry: &str, name: &str) -> bool {
    match entry.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == entry,
    }
}

/// Whether `name` is in [`PDL_KERNELS`].
pub fn is_pdl_kernel(name: &str) -> bool {
    named_in(PDL_KERNELS, name)
}

/// Whether captured graphs get programmatic edges: on for Hopper and later, off with
/// `MOERUN_CUDA_PDL=0` (to measure what they buy).
fn pdl_wanted(device: &CudaDevice) -> bool {
    device.info().compute_capability.0 >= 9
        && std::env::var_os("MOERUN_CUDA_PDL").is_none_or(|v| v != "0")
}

/// A captured, instantiated graph of this device's stream.
pub struct DeviceGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
    /// Edges made programmatic (programmatic dependent launch), for reports.
    programmatic_edges: usize,
    /// Nodes of the graph (kernels, copies, allocations), for reports.
    nodes: usize,
}

// SAFETY: the graph and its executable are only used through `&self` calls that the owner
// serialises (DeviceGraph is not Sync); moving them between threads is allowed by the driver.
unsafe impl Send for DeviceGraph {}

impl DeviceGraph {
    /// Replay the captured work on the device's stream.
    pub fn launch(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .ctx("binding the device")?;
        // SAFETY: `exec` is a live executable graph of this stream's context.
        unsafe { sys::cuGraphLaunch(self.exec, self.stream.cu_stream()) }
            .result()
            .ctx("launching a CUDA graph")
    }

    /// How many kernel-to-kernel edges launch programmatically.
    pub fn programmatic_edges(&self) -> usize {
        self.programmatic_edges
    }

    /// How many nodes the graph has.
    pub fn nodes(&self) -> usize {
        self.nodes
    }
}

impl Drop for DeviceGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `capture` and are destroyed once, here; errors
        // at teardown have nowhere to go.
        unsafe {
            let _ = self.stream.context().bind_to_thread();
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

impl CudaDevice {
    /// Capture what `work` enqueues into a graph. If `work` fails, capture is ended and its
    /// error returned; if the driver refuses the capture (an op that cannot be captured), the
    /// error says so. On Hopper, the edges into kernels of [`PDL_KERNELS`] are made
    /// programmatic before the graph is instantiated.
    pub fn capture(&self, work: impl FnOnce() -> Result<()>) -> Result<DeviceGraph> {
        let _no_device_comes_or_goes = capture_guard();
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .ctx("beginning a graph capture")?;
        let worked = work();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (begun above, on this thread); the graph out-pointer
        // is valid.
        let ended =
            unsafe { sys::cuStreamEndCapture(self.stream.cu_stream(), &mut graph) }.result();
        if worked.is_err() || ended.is_err() {
            // Buffers dropped inside a failed capture record their free's error on the context,
            // where cudarc would hand it to the next, unrelated call (an upload after the caller
            // falls back to running eagerly). That error is this capture's, reported below.
            let _ = self.ctx.check_err();
        }
        if let Err(e) = worked {
            if !graph.is_null() {
                // SAFETY: the graph came from the capture and is not used again.
                unsafe { sys::cuGraphDestroy(graph) };
            }
            return Err(e);
        }
        ended.ctx("ending a graph capture")?;
        if graph.is_null() {
            return Err(CudaError::Unsupported(
                "the graph capture recorded nothing".into(),
            ));
        }
        let programmatic_edges = if pdl_wanted(self) {
            // SAFETY: `graph` is the live graph just captured, not yet instantiated.
            unsafe { make_edges_programmatic(graph) }.unwrap_or(0)
        } else {
            0
        };
        let mut nodes = 0usize;
        // SAFETY: `graph` is live; a null node array asks for the count only.
        unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes) }
            .result()
            .ctx("counting graph nodes")?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is live; `exec` is a valid out-pointer.
        if let Err(e) = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result() {
            // SAFETY: not used again.
            unsafe { sys::cuGraphDestroy(graph) };
            return Err(e).ctx("instantiating a CUDA graph");
        }
        let g = DeviceGraph {
            graph,
            exec,
            stream: self.stream.clone(),
            programmatic_edges,
            nodes,
        };
        // SAFETY: `exec` is live, on this stream's context.
        unsafe { sys::cuGraphUpload(g.exec, self.stream.cu_stream()) }
            .result()
            .ctx("uploading a CUDA graph")?;
        Ok(g)
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

/// The kernel a graph node launches, by name (`None` for other nodes).
///
/// # Safety
/// `node` must be a live node of a live graph.
unsafe fn kernel_name(node: sys::CUgraphNode) -> Option<String> {
    let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    sys::cuGraphNodeGetType(node, &mut kind).result().ok()?;
    if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return None;
    }
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
    sys::cuGraphKernelNodeGetParams_v2(node, &mut params)
        .result()
        .ok()?;
    let mut name: *const std::ffi::c_char = std::ptr::null();
    sys::cuFuncGetName(&mut name, params.func).result().ok()?;
    (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy().into_owned())
}

/// Replace every edge from a kernel into a kernel of [`PDL_KERNELS`] by a programmatic one
/// (the destination may launch once every block of the source has triggered, `pdl_entry`),
/// except where [`edge_may_be_programmatic`] says no. An edge the driver will not convert is put
/// back as it was. Returns how many were converted.
///
/// # Safety
/// `graph` must be a live graph that is not instantiated or used elsewhere meanwhile.
unsafe fn make_edges_programmatic(graph: sys::CUgraph) -> std::result::Result<usize, DriverError> {
    let mut count = 0usize;
    sys::cuGraphGetEdges_v2(
        graph,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        &mut count,
    )
    .result()?;
    let mut from = vec![std::ptr::null_mut(); count];
    let mut to = vec![std::ptr::null_mut(); count];
    let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); count];
    sys::cuGraphGetEdges_v2(
        graph,
        from.as_mut_ptr(),
        to.as_mut_ptr(),
        data.as_mut_ptr(),
        &mut count,
    )
    .result()?;
    let mut converted = 0;
    for i in 0..count {
        let plain = data[i].type_ == 0 && data[i].from_port == 0;
        if !plain {
            continue;
        }
        let (Some(src), Some(dst)) = (kernel_name(from[i]), kernel_name(to[i])) else {
            continue;
        };
        if !edge_may_be_programmatic(&src, &dst) {
            continue;
        }
        sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &data[i], 1).result()?;
        let mut edge: sys::CUgraphEdgeData = std::mem::zeroed();
        edge.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
        edge.type_ = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        match sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &edge, 1).result() {
            Ok(()) => converted += 1,
            Err(_) => {
                sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &data[i], 1).result()?
            }
        }
    }
    Ok(converted)
}

#[cfg(test)]
mod tests {
    use super::{edge_may_be_programmatic, is_pdl_kernel};

    #[test]
    fn a_launch_first_kernel_keeps_a_plain_edge_into_an_early_activation_reader() {
        assert!(edge_may_be_programmatic(
            "gemv_rows_bf16_m1",
            "add_rms_norm_f32"
        ));
        assert!(edge_may_be_programmatic(
            "add_rms_norm_f32",
            "gemv_rows_bf16_m1"
        ));
        assert!(edge_may_be_programmatic(
            "route_topk_f32_l4",
            "moe_tiny_gate_up_bf16"
        ));
        assert!(edge_may_be_programmatic(
            "moe_tiny_gate_up_bf16",
            "moe_tiny_down_bf16"
        ));
        assert!(!edge_may_be_programmatic(
            "route_topk_f32_l4",
            "moe_tiny_down_bf16"
        ));
        assert!(!edge_may_be_programmatic(
            "add_rms_norm_f32",
            "add_rms_norm_f32"
        ));
        assert!(!edge_may_be_programmatic(
            "qkv_split_norm_rope_early_f32",
            "add_rms_norm_f32"
        ));
        assert!(!edge_may_be_programmatic(
            "gemv_rows_bf16_m1",
            "moe_gate_up_bf16_m4"
        ));
    }

    #[test]
    fn kernel_families_are_matched_by_prefix_and_others_exactly() {
        for name in ["gemv_rows_bf16_m1", "moe_tiny_down_bf16", "add_f32"] {
            assert!(is_pdl_kernel(name), "{name}");
        }
        for name in [
            "add_f32_extra",
            "moe_gate_up_bf16_m4",
            "attn_tile_f32_c1",
            "fill_random_f32",
        ] {
            assert!(!is_pdl_kernel(name), "{name}");
        }
    }
}
