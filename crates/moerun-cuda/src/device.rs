//! [`CudaDevice`]: one GPU, one stream, one cuBLAS handle and the loaded kernels; buffers on it;
//! weight matrices uploaded once ([`DeviceMatrix`]).
//!
//! All work of a device is ordered on its single stream. That is what lets it switch off cudarc's
//! per-buffer event tracking (an event record and wait per buffer per launch): every op first
//! checks that each buffer it is given was allocated on this device's stream and refuses others.

use std::mem::ManuallyDrop;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{self, CUdevice_attribute, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use moerun_core::{DType, MatRef};

use crate::compile::{self, CacheReport, KERNEL_FILES};
use crate::error::{ensure, CudaError, DriverContext, Result};
use crate::probe;

/// What the driver says about the device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
    /// The NVRTC target the kernels were built for, e.g. `sm_90`.
    pub arch: String,
    pub total_memory: usize,
    pub multiprocessors: u32,
    pub l2_bytes: usize,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "{} (device {}, compute capability {major}.{minor}, {} SMs, {:.1} GiB, {} MiB L2)",
            self.name,
            self.ordinal,
            self.multiprocessors,
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.l2_bytes >> 20
        )
    }
}

/// Entry points of the kernel files, loaded once per device.
pub(crate) struct Kernels {
    pub rms_norm: CudaFunction,
    pub rope: CudaFunction,
    pub silu_mul: CudaFunction,
    pub f32_to_bf16: CudaFunction,
    pub f32_to_bf16_split: CudaFunction,
    /// Indexed by log2 of the experts each lane holds (1, 2, 4, 8, 16; see ops::router).
    pub route_topk: [CudaFunction; 5],
    /// By weight dtype ([`dtype_slot`]), then experts per lane of the routing warp (1, 2, 4).
    pub gemv_route: [[CudaFunction; 3]; 3],
    /// `gemv_route_norm_<dt>_l<L>`, indexed as `gemv_route`.
    pub gemv_route_norm: [[CudaFunction; 3]; 3],
    /// `gemv_rows_route_<dt>_l<L>` (o_proj with the route ahead), indexed as `gemv_route`.
    pub gemv_rows_route: [[CudaFunction; 3]; 3],
    /// `route_fold_<dt>`, by [`dtype_slot`].
    pub route_fold: [CudaFunction; 3],
    /// Indexed by [`dtype_slot`].
    pub embed: [CudaFunction; 3],
    /// `[layout][dtype_slot][i]` for x-row counts `GEMV_ROWS[i]`; layout 0 is warp per row,
    /// 1 block per rows (see `ops::gemv`).
    pub gemv: [[[CudaFunction; 4]; 3]; 2],
    /// `gemv_rows_norm_<dt>` (one token's add+norm folded into the GEMV), by [`dtype_slot`].
    pub gemv_rows_norm: [CudaFunction; 3],
    /// `gemv_rows_norm_strided_<dt>`: [`crate::AddNormGrid::Strided`].
    pub gemv_rows_norm_strided: [CudaFunction; 3],
    pub elementwise: crate::ops::ElementwiseKernels,
    pub fused: crate::ops::FusedKernels,
    pub moe: crate::ops::MoeKernels,
    /// Indexed by [`crate::ops::KvDtype::slot`]: the builds for f32 and bf16 KV pools.
    pub attention: [crate::ops::AttentionKernels; 2],
    pub gemma: crate::ops::GemmaKernels,
    pub gated_delta: crate::ops::GatedDeltaKernels,
}

/// Rows of x one GEMV launch handles, one kernel instantiation each.
pub(crate) const GEMV_ROWS: [usize; 4] = [1, 2, 4, 8];

/// Index of a weight dtype in the per-dtype kernel tables.
pub(crate) fn dtype_slot(dtype: DType) -> usize {
    match dtype {
        DType::BF16 => 0,
        DType::F16 => 1,
        DType::F32 => 2,
    }
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>, arch: &str, report: &mut CacheReport) -> Result<Kernels> {
        let mut modules: Vec<(&str, Arc<CudaModule>)> = Vec::new();
        for (file, cubin) in KERNEL_FILES
            .iter()
            .zip(compile::cubins(KERNEL_FILES, arch, report)?)
        {
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .ctx(&format!("loading {}.cu", file.name))?;
            modules.push((file.name, module));
        }
        let get = |file: &str, func: &str| -> Result<CudaFunction> {
            let (_, m) = modules
                .iter()
                .find(|(n, _)| *n == file)
                .expect("every kernel file is compiled above");
            m.load_function(func)
                .ctx(&format!("loading {func} from {file}.cu"))
        };
        let gemv = |prefix: &str, dt: &str| -> Result<[CudaFunction; 4]> {
            Ok([
                get("gemv", &format!("{prefix}_{dt}_m1"))?,
                get("gemv", &format!("{prefix}_{dt}_m2"))?,
                get("gemv", &format!("{prefix}_{dt}_m4"))?,
                get("gemv", &format!("{prefix}_{dt}_m8"))?,
            ])
        };
        let layout = |prefix: &str| -> Result<[[CudaFunction; 4]; 3]> {
            Ok([
                gemv(prefix, "bf16")?,
                gemv(prefix, "f16")?,
                gemv(prefix, "f32")?,
            ])
        };
        // A routing table `<prefix>_<dt>_l<L>`: [dtype][lane slot (1, 2, 4 experts a lane)].
        let route_table = |prefix: &str| -> Result<[[CudaFunction; 3]; 3]> {
            let row = |dt: &str| -> Result<[CudaFunction; 3]> {
                Ok([
                    get("gemv", &format!("{prefix}_{dt}_l1"))?,
                    get("gemv", &format!("{prefix}_{dt}_l2"))?,
                    get("gemv", &format!("{prefix}_{dt}_l4"))?,
                ])
            };
            Ok([row("bf16")?, row("f16")?, row("f32")?])
        };
        Ok(Kernels {
            rms_norm: get("norm", "rms_norm_f32")?,
            rope: get("rope", "rope_rotate_half_f32")?,
            silu_mul: get("activation", "silu_mul_f32")?,
            f32_to_bf16: get("convert", "f32_to_bf16")?,
            f32_to_bf16_split: get("convert", "f32_to_bf16_split")?,
            gemv_route: route_table("gemv_route")?,
            gemv_route_norm: route_table("gemv_route_norm")?,
            gemv_rows_route: route_table("gemv_rows_route")?,
            route_fold: [
                get("gemv", "route_fold_bf16")?,
                get("gemv", "route_fold_f16")?,
                get("gemv", "route_fold_f32")?,
            ],
            route_topk: [
                get("router", "route_topk_f32_l1")?,
                get("router", "route_topk_f32_l2")?,
                get("router", "route_topk_f32_l4")?,
                get("router", "route_topk_f32_l8")?,
                get("router", "route_topk_f32_l16")?,
            ],
            embed: [
                get("embedding", "embed_bf16")?,
                get("embedding", "embed_f16")?,
                get("embedding", "embed_f32")?,
            ],
            gemv: [layout("gemv")?, layout("gemv_rows")?],
            gemv_rows_norm: [
                get("gemv", "gemv_rows_norm_bf16")?,
                get("gemv", "gemv_rows_norm_f16")?,
                get("gemv", "gemv_rows_norm_f32")?,
            ],
            gemv_rows_norm_strided: [
                get("gemv", "gemv_rows_norm_strided_bf16")?,
                get("gemv", "gemv_rows_norm_strided_f16")?,
                get("gemv", "gemv_rows_norm_strided_f32")?,
            ],
            elementwise: crate::ops::ElementwiseKernels::load(|f| get("elementwise", f))?,
            fused: crate::ops::FusedKernels::load(|f| get("fused", f))?,
            moe: crate::ops::MoeKernels::load(get)?,
            attention: [
                crate::ops::AttentionKernels::load(&get, "")?,
                crate::ops::AttentionKernels::load(&get, "_kvbf16")?,
            ],
            gemma: crate::ops::GemmaKernels::load(|f| get("gemma", f))?,
            gated_delta: crate::ops::GatedDeltaKernels::load(|f| get("gated_delta", f))?,
        })
    }
}

/// Creating or destroying a cuBLAS handle synchronises the whole device, and loading or unloading
/// kernel modules may: done while another thread of the process captures a graph, that capture
/// is invalidated (and cudarc's drop of a cuBLAS handle whose destroy fails panics). So graph
/// captures hold this lock shared ([`capture_guard`]), and opening or dropping a device holds it
/// exclusively: two models in two threads may each capture, but never while a device comes or
/// goes.
static DEVICE_LIFECYCLE: RwLock<()> = RwLock::new(());

/// Held by a graph capture for its whole life (see [`DEVICE_LIFECYCLE`]).
pub(crate) fn capture_guard() -> RwLockReadGuard<'static, ()> {
    // The lock guards no data: a panic while it was held leaves nothing inconsistent.
    DEVICE_LIFECYCLE
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn lifecycle_guard() -> RwLockWriteGuard<'static, ()> {
    DEVICE_LIFECYCLE
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One GPU with its stream, cuBLAS handle and kernels. Ops are methods (see [`crate::ops`]); they
/// enqueue work on the stream and return; [`CudaDevice::download`] waits for it.
pub struct CudaDevice {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Dropped by hand, under [`DEVICE_LIFECYCLE`] (see `Drop`).
    pub(crate) blas: ManuallyDrop<CudaBlas>,
    /// Dropped by hand, under [`DEVICE_LIFECYCLE`] (their modules unload with them).
    pub(crate) kernels: ManuallyDrop<Kernels>,
    info: DeviceInfo,
    cache: CacheReport,
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _alone = lifecycle_guard();
        // SAFETY: neither field is touched again: the device is being dropped.
        unsafe {
            ManuallyDrop::drop(&mut self.blas);
            ManuallyDrop::drop(&mut self.kernels);
        }
    }
}

impl CudaDevice {
    /// Open device `ordinal`: check that the driver, NVRTC and cuBLAS can be loaded, create a
    /// stream and a cuBLAS handle, and load the kernels (compiled with NVRTC for this device's
    /// architecture, or read from the on-disk cache). On a machine without CUDA this returns
    /// [`CudaError::Unavailable`] with the reason; it never panics.
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        probe::check_libraries()?;
        probe::guard("CUDA initialisation failed", || Self::open_checked(ordinal))
    }

    fn open_checked(ordinal: usize) -> Result<CudaDevice> {
        let _alone = lifecycle_guard();
        cudarc::driver::result::init().map_err(|e| {
            CudaError::Unavailable(format!("the NVIDIA driver did not initialise ({e})"))
        })?;
        let count = cudarc::driver::result::device::get_count().ctx("counting devices")?;
        if count <= 0 {
            return Err(CudaError::Unavailable("no CUDA device found".into()));
        }
        ensure(ordinal < count as usize, || {
            format!("CUDA device {ordinal} does not exist ({count} present)")
        })?;
        let ctx = CudaContext::new(ordinal).ctx("creating the device context")?;
        let (major, minor) = ctx
            .compute_capability()
            .ctx("reading the compute capability")?;
        let (major, minor) = (major as u32, minor as u32);
        if major < 8 {
            return Err(CudaError::Unavailable(format!(
                "compute capability {major}.{minor} is below 8.0, the least this backend \
                 supports (bf16 arithmetic)"
            )));
        }
        let attr = |a| ctx.attribute(a).ctx("reading a device attribute");
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().ctx("reading the device name")?,
            compute_capability: (major, minor),
            arch: compile::arch_name(major, minor),
            total_memory: ctx.total_mem().ctx("reading the memory size")?,
            multiprocessors: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                as u32,
            l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
        };
        // SAFETY: only buffers created after this call go untracked, i.e. every buffer this
        // device allocates. All of them live on `stream` below, and every op refuses buffers of
        // another stream (`ptr`/`ptr_mut`), so each buffer's uses and its (stream-ordered) free
        // are ordered on one stream: there is no cross-stream hazard to track.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory_pooled(&ctx)?;
        let stream = ctx.new_stream().ctx("creating the stream")?;
        let blas = CudaBlas::new(stream.clone()).ctx("creating the cuBLAS handle")?;
        let mut cache = CacheReport {
            dir: compile::cache_dir(),
            ..CacheReport::default()
        };
        let kernels = Kernels::load(&ctx, &info.arch, &mut cache)?;
        Ok(CudaDevice {
            ctx,
            stream,
            blas: ManuallyDrop::new(blas),
            kernels: ManuallyDrop::new(kernels),
            info,
            cache,
        })
    }

    /// Name, compute capability, memory, SM count.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Where this open's kernels came from (cache hits vs. fresh compilations).
    pub fn kernel_cache(&self) -> &CacheReport {
        &self.cache
    }

    /// The stream all of this device's work goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A buffer of `len` zeros.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros(len).ctx("allocating")
    }

    /// A buffer of `len` f32 whose contents are unspecified until written: for op outputs that
    /// the op writes in full, saving the memset of [`CudaDevice::zeros`] (a launch per buffer,
    /// which adds up in a decode step). Any bit pattern is a valid f32, so reading it back
    /// early gives arbitrary values, never undefined behaviour.
    pub fn alloc_f32(&self, len: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: device memory is never read by Rust directly; every f32 bit pattern is valid.
        unsafe { self.stream.alloc::<f32>(len) }.ctx("allocating")
    }

    /// [`CudaDevice::alloc_f32`] for u32 outputs (the router's expert choices).
    pub fn alloc_u32(&self, len: usize) -> Result<CudaSlice<u32>> {
        // SAFETY: as alloc_f32; every u32 bit pattern is valid.
        unsafe { self.stream.alloc::<u32>(len) }.ctx("allocating")
    }

    /// `len` values of page-locked host memory, for copies the host reads without waiting for
    /// the whole stream ([`CudaDevice::copy_to_host_async`]). Unset until a copy lands: read it
    /// only after that copy's event.
    pub fn pinned_u32(&self, len: usize) -> Result<PinnedHostSlice<u32>> {
        // SAFETY: the memory is unset after this call (the function's one requirement): every
        // bit pattern is a valid u32, so a read before a copy lands gives a wrong value, never
        // undefined behaviour, and the callers read only after the copy's event
        // (copy_to_host_async's `done`).
        unsafe { self.ctx.alloc_pinned_with_flags::<u32>(len, 0) }
            .ctx("allocating page-locked host memory")
    }

    /// Enqueue a copy of `src` into `dst`, then record `done` after it: `dst` holds the values
    /// once `done.synchronize()` returns, which waits for nothing the stream holds after the
    /// copy. (The slice's own event is not recorded: this device switches off cudarc's event
    /// tracking, see `open_checked`.)
    pub fn copy_to_host_async(
        &self,
        src: &CudaSlice<u32>,
        dst: &mut PinnedHostSlice<u32>,
        done: &CudaEvent,
    ) -> Result<()> {
        self.check_stream(src.stream(), "copy_to_host_async")?;
        self.stream
            .memcpy_dtoh(src, dst)
            .ctx("copying to the host")?;
        self.record(done)
    }

    /// `len` values of page-locked host memory that kernels write straight into (an arg-max's
    /// picks): the buffer with its device address, looked up once here (the device has unified
    /// addressing, so all page-locked memory is mapped). Unset until a kernel writes it.
    pub fn mapped_u32(&self, len: usize) -> Result<MappedHostU32> {
        let mut host = self.pinned_u32(len)?;
        let p = host
            .as_mut_ptr()
            .ctx("reading a page-locked buffer's address")?;
        self.ctx
            .bind_to_thread()
            .ctx("binding the device's context")?;
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `p` is the start of a live page-locked allocation of this context; addr is a
        // valid out pointer; flags must be 0.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut addr, p.cast(), 0) }
            .result()
            .ctx("mapping page-locked host memory into the device's address space")?;
        Ok(MappedHostU32 { host, addr })
    }

    /// Record `done` on this device's stream: it completes once everything enqueued before it
    /// has.
    pub fn record(&self, done: &CudaEvent) -> Result<()> {
        done.record(&self.stream).ctx("recording an event")
    }

    /// An event to record on this device's stream ([`CudaDevice::copy_to_host_async`]).
    pub fn new_event(&self) -> Result<CudaEvent> {
        self.ctx.new_event(None).ctx("creating an event")
    }

    /// Copy host values into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, values: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(values).ctx("uploading")
    }

    /// Wait for the stream, then copy a device buffer back.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &impl DevicePtr<T>,
    ) -> Result<Vec<T>> {
        self.check_stream(buf.stream(), "download")?;
        let v = self.stream.clone_dtoh(buf).ctx("downloading")?;
        self.synchronize()?;
        Ok(v)
    }

    /// Wait until all enqueued work has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().ctx("synchronising the stream")
    }

    /// Upload a weight matrix once, keeping its stored dtype (bf16 stays bf16).
    pub fn upload_matrix(&self, w: MatRef<'_>) -> Result<DeviceMatrix> {
        ensure(w.data.len() == w.rows * w.cols * w.dtype.size(), || {
            format!(
                "matrix [{}, {}] of {} needs {} bytes, got {}",
                w.rows,
                w.cols,
                w.dtype,
                w.rows * w.cols * w.dtype.size(),
                w.data.len()
            )
        })?;
        Ok(DeviceMatrix {
            dtype: w.dtype,
            rows: w.rows,
            cols: w.cols,
            data: Arc::new(self.upload(w.data)?),
            offset: 0,
        })
    }

    /// Milliseconds the stream spends on the work `f` enqueues (CUDA events around it).
    pub fn elapsed_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags).ctx("recording an event")?;
        f()?;
        let end = self.stream.record_event(flags).ctx("recording an event")?;
        end.synchronize().ctx("waiting for an event")?;
        start.elapsed_ms(&end).ctx("reading an event")
    }

    fn check_stream(&self, s: &Arc<CudaStream>, what: &str) -> Result<()> {
        ensure(Arc::ptr_eq(s, &self.stream) || **s == *self.stream, || {
            format!("{what}: a buffer of another device or stream was passed")
        })
    }

    /// The device address of a buffer this device owns, for a kernel argument.
    pub(crate) fn ptr<T, B: DevicePtr<T> + ?Sized>(&self, buf: &B, what: &str) -> Result<u64> {
        self.check_stream(buf.stream(), what)?;
        let (p, _no_event) = buf.device_ptr(&self.stream);
        Ok(p)
    }

    /// Like [`CudaDevice::ptr`], for a buffer the kernel writes.
    pub(crate) fn ptr_mut<T, B: DevicePtrMut<T> + ?Sized>(
        &self,
        buf: &mut B,
        what: &str,
    ) -> Result<u64> {
        self.check_stream(buf.stream(), what)?;
        let (p, _no_event) = buf.device_ptr_mut(&self.stream);
        Ok(p)
    }
}

/// Page-locked host memory with its device address ([`CudaDevice::mapped_u32`]): a kernel
/// given [`MappedHostU32::device_address`] writes into it, and the host reads it once an event
/// recorded after that kernel has completed.
pub struct MappedHostU32 {
    host: PinnedHostSlice<u32>,
    addr: u64,
}

impl MappedHostU32 {
    /// Values held.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether it holds no value.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The address kernels write to.
    pub(crate) fn device_address(&self) -> u64 {
        self.addr
    }

    /// The values, for reading once what wrote them has completed.
    pub fn as_slice(&self) -> Result<&[u32]> {
        self.host.as_slice().ctx("reading page-locked host memory")
    }

    /// The page-locked buffer itself (a copy's destination, [`CudaDevice::copy_to_host_async`]).
    pub fn pinned_mut(&mut self) -> &mut PinnedHostSlice<u32> {
        &mut self.host
    }
}

/// Buffers are allocated from the device's stream-ordered memory pool. By default the pool hands
/// freed memory back to the driver at every synchronisation, so the next allocation maps it again
/// (measured: +60 µs on a 2048-row GEMM's scratch). Keep it pooled instead.
fn keep_freed_memory_pooled(ctx: &Arc<CudaContext>) -> Result<()> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: FFI calls on this context's device with valid out/in pointers; `keep` outlives the
    // call that reads it.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .ctx("reading the memory pool")?;
        let mut keep = u64::MAX;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
        .result()
        .ctx("setting the memory pool's release threshold")?;
    }
    Ok(())
}

/// A weight matrix `[rows, cols]` (row-major, as stored in the checkpoint) resident on a device,
/// in its stored dtype.
pub struct DeviceMatrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    /// The allocation this matrix lies in: its own, or one it shares with the other row ranges
    /// of a stacked matrix ([`DeviceMatrix::row_range`]).
    data: Arc<CudaSlice<u8>>,
    /// Where in `data` its first row starts, in bytes.
    offset: usize,
}

impl DeviceMatrix {
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes of its rows (a row range counts its own rows, not the allocation it shares).
    pub fn byte_len(&self) -> usize {
        self.rows * self.cols * self.dtype.size()
    }
    /// The device address of its first row, for a kernel on `dev`'s stream.
    pub(crate) fn device_ptr(&self, dev: &CudaDevice, what: &str) -> Result<u64> {
        Ok(dev.ptr(&*self.data, what)? + self.offset as u64)
    }
    /// A matrix over `data`, which must hold `rows * cols` values of `dtype`.
    pub fn from_parts(dtype: DType, rows: usize, cols: usize, data: CudaSlice<u8>) -> Result<Self> {
        ensure(data.len() == rows * cols * dtype.size(), || {
            format!(
                "matrix [{rows}, {cols}] of {dtype} needs {} bytes, got {}",
                rows * cols * dtype.size(),
                data.len()
            )
        })?;
        Ok(DeviceMatrix {
            dtype,
            rows,
            cols,
            data: Arc::new(data),
            offset: 0,
        })
    }

    /// Rows `first..first + rows` as a matrix of their own, sharing this one's memory: the parts
    /// of a stacked matrix (q, k and v; a shared expert's gate and up) without a second copy.
    /// Every kernel needs its rows 16-byte aligned, so the range must start on a 16-byte
    /// boundary.
    pub fn row_range(&self, first: usize, rows: usize) -> Result<DeviceMatrix> {
        ensure(
            first.checked_add(rows).is_some_and(|end| end <= self.rows),
            || {
                format!(
                    "row range {first}..{} of a matrix of {} rows",
                    first.saturating_add(rows),
                    self.rows
                )
            },
        )?;
        let offset = self.offset + first * self.cols * self.dtype.size();
        ensure(offset.is_multiple_of(16), || {
            format!("row range at row {first} starts at byte {offset}, not 16-byte aligned")
        })?;
        Ok(DeviceMatrix {
            dtype: self.dtype,
            rows,
            cols: self.cols,
            data: self.data.clone(),
            offset,
        })
    }
}
