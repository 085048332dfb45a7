//! Opening a device: a clear reason where there is none, its description where there is, the
//! kernel cache, and the refusal of buffers that belong to another device's stream.

use moerun_cuda::compile::KERNEL_FILES;
use moerun_cuda::{CudaDevice, CudaError};

#[test]
fn open_describes_the_device_or_says_why_cuda_is_unavailable() {
    match CudaDevice::open(0) {
        Err(e @ CudaError::Unavailable(_)) => {
            let msg = e.to_string();
            assert!(msg.starts_with("CUDA is unavailable: "), "{msg}");
            println!("skipped: {msg}");
        }
        Err(e) => panic!("open failed for another reason than availability: {e}"),
        Ok(dev) => {
            let info = dev.info();
            println!("{info}");
            let (major, minor) = info.compute_capability;
            assert!(major >= 8);
            assert_eq!(info.arch, format!("sm_{major}{minor}"));
            assert!(info.total_memory > 0 && info.multiprocessors > 0);
            let cache = dev.kernel_cache();
            println!(
                "kernel cache {:?}: {} read, {} compiled",
                cache.dir, cache.hits, cache.compiled
            );
            assert_eq!(cache.hits + cache.compiled, KERNEL_FILES.len());
            // A second open finds every kernel in the cache (when there is a writable one).
            let again = CudaDevice::open(0).unwrap();
            if cache.dir.is_some() {
                assert_eq!(again.kernel_cache().hits, KERNEL_FILES.len());
            }
        }
    }
}

#[test]
fn an_unknown_ordinal_is_an_error_not_a_panic() {
    match CudaDevice::open(4096) {
        Err(CudaError::Unavailable(m)) => println!("skipped: CUDA is unavailable: {m}"),
        Err(CudaError::InvalidArgument(m)) => assert!(m.contains("4096"), "{m}"),
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("device 4096 opened"),
    }
}

#[test]
fn ops_refuse_buffers_of_another_device_stream() {
    let (a, b) = match (CudaDevice::open(0), CudaDevice::open(0)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return println!("skipped: {e}"),
    };
    let x = a.upload(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let mut up = b.upload(&[1.0f32; 4]).unwrap();
    let err = b.silu_mul(&mut up, &x).unwrap_err();
    assert!(
        matches!(err, CudaError::InvalidArgument(ref m) if m.contains("another device")),
        "{err}"
    );
    assert!(b.download(&x).is_err());
}
