//! Activation buffers of a captured decode step, carved out of one preallocated region.
//!
//! Why: a buffer allocated while a CUDA graph is being captured becomes a memory-allocation node
//! of the graph (and its drop a free node). Those nodes sit between the kernels that write and
//! read the buffer, so the graph has no kernel-to-kernel edges left to make programmatic (see
//! `graph.rs`): every kernel waits for the one before it to drain. A pass that takes its outputs
//! from an [`ActivationArena`] allocates nothing on the stream, and the captured graph is a plain
//! chain of kernels.
//!
//! The arena is a first-fit allocator over one device allocation: [`ActivationArena::begin`]
//! frees the whole region, every [`CudaDevice::activation`] takes the lowest free aligned range
//! that fits, and a dropped buffer gives its range back, so a layer's buffers reuse the ranges
//! the layer before freed, as the graph's own allocator would (the step's activations stay
//! within a few hot megabytes). Reuse is safe under programmatic launch too: a kernel writes its
//! output only after `griddepcontrol.wait`, when every kernel before it has finished. Slices of
//! two passes overlap, so a pass's buffers must not outlive it: the decode graphs copy their
//! logits into a buffer of their own before the capture ends, and a graph's replay only ever
//! follows the previous replay on the same stream. When the region is too small the allocation falls back to an ordinary one (correct, just not
//! allocation-free) and the arena remembers how much the pass wanted, so the owner can grow it
//! between captures ([`ActivationArena::grow`]; growing moves the region, so graphs captured over
//! the old one must be dropped).

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
};

use crate::error::{DriverContext, Result};
use crate::CudaDevice;

/// Alignment of every slice (bytes): the kernels load 16-byte vectors; 256 matches what the
/// driver's own allocations give.
const ALIGN: usize = 256;

/// A device buffer that is either its own allocation (freed on drop) or a slice of an
/// [`ActivationArena`] (its range given back to the arena on drop). Everything else about it is
/// its [`CudaSlice`].
pub struct DeviceBuffer<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    /// For an arena slice: the arena's free list and the slice's (offset, bytes) in the region.
    home: Option<(Arc<Mutex<FreeList>>, usize, usize)>,
    /// The same values rounded to bf16, when the kernel that wrote them also wrote this copy
    /// ([`DeviceBuffer::attach_bf16`]): a bf16 GEMM then reads it instead of converting. Any
    /// mutable access to the buffer drops it, so it never goes stale.
    bf16: Option<Box<DeviceBuffer<u16>>>,
}

impl<T> DeviceBuffer<T> {
    /// A buffer that owns `slice`.
    pub fn owned(slice: CudaSlice<T>) -> DeviceBuffer<T> {
        DeviceBuffer {
            slice: ManuallyDrop::new(slice),
            home: None,
            bf16: None,
        }
    }

    /// Keep `copy` as this buffer's values rounded to bf16 (round to nearest even, as
    /// `f32_to_bf16` rounds). The caller vouches that the work already enqueued writes exactly
    /// that into `copy`; the next mutable access to this buffer drops it.
    pub fn attach_bf16(&mut self, copy: DeviceBuffer<u16>) {
        debug_assert_eq!(copy.len(), self.slice.len());
        self.bf16 = Some(Box::new(copy));
    }

    /// The bf16 copy of these values, if one was attached and the buffer has not been mutably
    /// accessed since.
    pub fn bf16(&self) -> Option<&DeviceBuffer<u16>> {
        self.bf16.as_deref()
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken exactly once, here, and not used afterwards.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match self.home.take() {
            None => drop(slice),
            Some((free, offset, bytes)) => {
                // The arena owns the memory: release the handle's bookkeeping, not the memory,
                // and give the range back for the pass's next buffers.
                let _ = slice.leak();
                if let Ok(mut f) = free.lock() {
                    f.give_back(offset, bytes);
                }
            }
        }
    }
}

/// A copy on the device, in memory of its own (never in the arena).
impl<T: DeviceRepr> Clone for DeviceBuffer<T> {
    fn clone(&self) -> DeviceBuffer<T> {
        DeviceBuffer::owned((*self.slice).clone())
    }
}

impl<T> Deref for DeviceBuffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for DeviceBuffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        self.bf16 = None; // the values may change: the copy would go stale
        &mut self.slice
    }
}

impl<T> DeviceSlice<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl<T> DevicePtr<T> for DeviceBuffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.bf16 = None; // the values may change: the copy would go stale
        self.slice.device_ptr_mut(stream)
    }
}

/// The free ranges of an arena's region, `(offset, bytes)` sorted by offset and coalesced, and
/// the highest end offset handed out since the pass began.
#[derive(Default)]
struct FreeList {
    ranges: Vec<(usize, usize)>,
    high: usize,
    /// Bytes asked for that no free range could hold (the pass then allocated them itself).
    missed: usize,
}

impl FreeList {
    /// Everything free again: `capacity` bytes from offset 0.
    fn reset(&mut self, capacity: usize) {
        self.ranges.clear();
        if capacity > 0 {
            self.ranges.push((0, capacity));
        }
        self.high = 0;
        self.missed = 0;
    }

    /// The lowest free range that holds `bytes` (first fit), or None.
    fn take(&mut self, bytes: usize) -> Option<usize> {
        let i = self.ranges.iter().position(|&(_, len)| len >= bytes);
        let Some(i) = i else {
            self.missed += bytes;
            return None;
        };
        let (at, len) = self.ranges[i];
        if len == bytes {
            self.ranges.remove(i);
        } else {
            self.ranges[i] = (at + bytes, len - bytes);
        }
        self.high = self.high.max(at + bytes);
        Some(at)
    }

    /// Return `[offset, offset + bytes)`, merging it with its free neighbours.
    fn give_back(&mut self, offset: usize, bytes: usize) {
        let i = self.ranges.partition_point(|&(at, _)| at < offset);
        self.ranges.insert(i, (offset, bytes));
        if i + 1 < self.ranges.len() && offset + bytes == self.ranges[i + 1].0 {
            self.ranges[i].1 += self.ranges[i + 1].1;
            self.ranges.remove(i + 1);
        }
        if i > 0 && self.ranges[i - 1].0 + self.ranges[i - 1].1 == offset {
            self.ranges[i - 1].1 += self.ranges[i].1;
            self.ranges.remove(i);
        }
    }
}

/// One device region handed out in aligned slices, pass by pass (see the module doc).
#[derive(Default)]
pub struct ActivationArena {
    region: Option<CudaSlice<u8>>,
    base: CUdeviceptr,
    capacity: usize,
    free: Arc<Mutex<FreeList>>,
    /// Whether a pass is drawing from the arena.
    open: AtomicBool,
}

impl ActivationArena {
    /// An arena with no region yet: every allocation falls back until it is grown.
    pub fn new() -> ActivationArena {
        ActivationArena::default()
    }

    /// Start a pass: the whole region is free again. Every buffer of the previous pass must be
    /// gone (its memory is about to be reused).
    pub fn begin(&self) {
        if let Ok(mut f) = self.free.lock() {
            f.reset(self.capacity);
        }
        self.open.store(true, Ordering::Relaxed);
    }

    /// End the pass; returns the bytes it needed: the region's high-water mark, plus what fell
    /// back to ordinary allocations (so growing to it makes the pass fit next time).
    pub fn end(&self) -> usize {
        self.open.store(false, Ordering::Relaxed);
        self.free.lock().map_or(0, |f| f.high + f.missed)
    }

    /// Bytes the region holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Replace the region by one of at least `bytes` (a new address: graphs captured over the
    /// old region must be dropped first).
    pub fn grow(&mut self, dev: &CudaDevice, bytes: usize) -> Result<()> {
        self.region = None;
        self.capacity = 0;
        let bytes = bytes.div_ceil(ALIGN) * ALIGN;
        // SAFETY: the region is only ever handed out as f32/u32 slices that kernels write before
        // reading; every bit pattern is a valid value.
        let region =
            unsafe { dev.stream.alloc::<u8>(bytes) }.ctx("allocating the activation arena")?;
        let (base, sync) = region.device_ptr(&dev.stream);
        drop(sync);
        self.base = base;
        self.region = Some(region);
        self.capacity = bytes;
        Ok(())
    }

    /// A free slice of `len` elements, if a pass is open and one fits.
    fn take<T>(&self, stream: &Arc<CudaStream>, len: usize) -> Option<DeviceBuffer<T>> {
        if !self.open.load(Ordering::Relaxed) {
            return None;
        }
        let bytes = (len * std::mem::size_of::<T>()).max(1).div_ceil(ALIGN) * ALIGN;
        let at = self.free.lock().ok()?.take(bytes)?;
        // SAFETY: [base + at, base + at + bytes) is a free range of the live region, aligned to
        // ALIGN; the handle is leaked, never freed, on drop (DeviceBuffer::drop), and the range
        // goes back to the free list then.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(self.base + at as u64, len) };
        Some(DeviceBuffer {
            slice: ManuallyDrop::new(slice),
            home: Some((self.free.clone(), at, bytes)),
            bf16: None,
        })
    }
}

impl CudaDevice {
    /// An output buffer of `len` elements: a slice of `arena` while a pass is open there and it
    /// fits, else an ordinary allocation. Its contents are undefined until a kernel writes it.
    pub fn activation<T: DeviceRepr>(
        &self,
        arena: Option<&ActivationArena>,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        if let Some(buf) = arena.and_then(|a| a.take(&self.stream, len)) {
            return Ok(buf);
        }
        // SAFETY: as alloc_f32: device memory the caller's kernel writes before it is read.
        let slice = unsafe { self.stream.alloc::<T>(len) }.ctx("allocating")?;
        Ok(DeviceBuffer::owned(slice))
    }
}

#[cfg(test)]
mod tests {
    use super::FreeList;

    #[test]
    fn freed_ranges_are_reused_first_fit_and_coalesce() {
        let mut f = FreeList::default();
        f.reset(1024);
        let a = f.take(256).unwrap();
        let b = f.take(256).unwrap();
        let c = f.take(256).unwrap();
        assert_eq!((a, b, c), (0, 256, 512));
        // A freed range is taken again before the untouched tail.
        f.give_back(b, 256);
        assert_eq!(f.take(256), Some(256));
        // Neighbours merge: freeing a, b and c leaves one range covering the region.
        f.give_back(a, 256);
        f.give_back(c, 256);
        f.give_back(256, 256);
        assert_eq!(f.ranges, vec![(0, 1024)]);
        assert_eq!(f.high, 768);
        // What does not fit is counted, so the owner can grow the region to it.
        assert_eq!(f.take(2048), None);
        assert_eq!(f.high + f.missed, 768 + 2048);
        f.reset(1024);
        assert_eq!(
            (f.high, f.missed, f.ranges.clone()),
            (0, 0, vec![(0, 1024)])
        );
    }
}
