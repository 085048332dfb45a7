//! Every kernel file compiles with NVRTC for Hopper (sm_90), without spilling registers. Needs
//! only the NVRTC library, no GPU: it runs wherever `libnvrtc.so.13` can be loaded and skips
//! elsewhere.

use moerun_cuda::compile::{compile, KERNEL_FILES};
use moerun_cuda::probe::nvrtc_available;

#[test]
fn every_kernel_file_compiles_for_sm90_without_spills() {
    if !nvrtc_available() {
        println!("skipped: CUDA is unavailable: libnvrtc.so.13 not found");
        return;
    }
    for file in KERNEL_FILES {
        let c = compile(file, "sm_90", true).unwrap_or_else(|e| panic!("{e}"));
        assert!(!c.cubin.is_empty(), "{}: empty cubin", file.name);
        println!(
            "== {}.cu: {} bytes of cubin\n{}",
            file.name,
            c.cubin.len(),
            c.log
        );
        for line in c.log.lines().filter(|l| l.contains("spill")) {
            assert!(
                line.contains("0 bytes spill stores, 0 bytes spill loads"),
                "{}: {line}",
                file.name
            );
        }
    }
}
