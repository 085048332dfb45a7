//! Every kernel file compiles with NVRTC for Hopper (sm_90), without spilling registers. Needs
//! only the NVRTC library, no GPU: it runs wherever `libnvrtc.so.13` can be loaded and skips
//! elsewhere.

use moerun_cuda::compile::{compile, compile_ptx, compile_with, KERNEL_FILES, SM90A_FILES};
use moerun_cuda::graph::{
    is_launch_first_kernel, is_pdl_kernel, pdl_entry_names, LAUNCH_FIRST_KERNELS, PDL_KERNELS,
};
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

/// Each kernel file named by `files`, compiled for each of `archs` with `defines`, gives a
/// cubin (a compile error fails the test with NVRTC's log).
fn files_compile(files: &[&str], archs: &[&str], defines: &[String]) {
    for file in KERNEL_FILES.iter().filter(|f| files.contains(&f.name)) {
        for &arch in archs {
            let c = compile_with(file, arch, false, defines).unwrap_or_else(|e| panic!("{e}"));
            assert!(!c.cubin.is_empty(), "{} for {arch}: empty cubin", file.name);
        }
    }
}

/// The measuring builds (`MOERUN_CUDA_DEFINES="-DMOERUN_PROBE"`: the phase probes of
/// common.cuh, with the marks in the cluster attention and gemv_route kernels) still compile,
/// for Hopper and for an older architecture.
#[test]
fn the_probe_builds_compile() {
    if !nvrtc_available() {
        println!("skipped: CUDA is unavailable: libnvrtc.so.13 not found");
        return;
    }
    let probe = [
        "-DMOERUN_PROBE".to_string(),
        "-DMOERUN_PROBE_FROM=10".to_string(),
    ];
    files_compile(
        &["attention", "attention_kvbf16", "gemv"],
        &["sm_90", "sm_80"],
        &probe,
    );
}

/// The 16-block cluster builds (`attention_cl16[_kvbf16]`) hold every cluster decode kernel the
/// host loads from them (ops/attention.rs `ClusterKernels::load`) and none of the plain build's
/// other kernels (compiled once, there); the probe builds of them compile too.
#[test]
fn the_16_block_cluster_builds_hold_the_cluster_kernels_alone() {
    if !nvrtc_available() {
        println!("skipped: CUDA is unavailable: libnvrtc.so.13 not found");
        return;
    }
    for name in ["attention_cl16", "attention_cl16_kvbf16"] {
        let file = KERNEL_FILES.iter().find(|f| f.name == name).unwrap();
        let ptx = compile_ptx(file, "compute_90").unwrap_or_else(|e| panic!("{e}"));
        let entries: Vec<&str> = ptx
            .split(".entry ")
            .skip(1)
            .map(|e| e.split('(').next().unwrap_or("").trim())
            .collect();
        for d in [16, 32, 64, 128, 256] {
            for g in [1, 2, 4, 8] {
                let want = format!("attn_cluster_d{d}_g{g}");
                assert!(entries.contains(&want.as_str()), "{name}: no {want}");
            }
        }
        for want in [
            "attn_cluster_d512_g1",
            "attn_cluster_d512_g2",
            "attn_cluster_d128_g4_pro",
        ] {
            assert!(entries.contains(&want), "{name}: no {want}");
        }
        assert!(
            entries.iter().all(|e| e.starts_with("attn_cluster_")),
            "{name}: {entries:?}"
        );
    }
    let probe = [
        "-DMOERUN_PROBE".to_string(),
        "-DMOERUN_PROBE_FROM=10".to_string(),
    ];
    files_compile(
        &["attention_cl16", "attention_cl16_kvbf16"],
        &["sm_90"],
        &probe,
    );
}

/// The files built for `sm_90a` on Hopper (`compile::SM90A_FILES`) still compile for other
/// architectures, to entry points that are never launched (their bodies are guarded).
#[test]
fn sm90a_files_compile_for_other_architectures() {
    if !nvrtc_available() {
        println!("skipped: CUDA is unavailable: libnvrtc.so.13 not found");
        return;
    }
    files_compile(SM90A_FILES, &["sm_80", "sm_89", "sm_100"], &[]);
}

/// Every kernel that graph capture may launch early (`graph::PDL_KERNELS`) waits for the kernel
/// before it (`griddepcontrol.wait`, from `pdl_entry()`): one that did not could read its inputs
/// before they are written. Read from each entry's PTX, so templates and macros count as they
/// are instantiated. Every name in the list matches some kernel (no stale entries).
#[test]
fn every_early_launched_kernel_waits_for_the_one_before() {
    if !nvrtc_available() {
        println!("skipped: CUDA is unavailable: libnvrtc.so.13 not found");
        return;
    }
    let mut matched = vec![false; PDL_KERNELS.len()];
    let mut matched_first = vec![false; LAUNCH_FIRST_KERNELS.len()];
    for file in KERNEL_FILES {
        let ptx = compile_ptx(file, "compute_90").unwrap_or_else(|e| panic!("{e}"));
        let mut entries = ptx.split(".entry ").skip(1);
        for body in &mut entries {
            let name = body.split('(').next().unwrap_or("").trim();
            if !is_pdl_kernel(name) {
                continue;
            }
            for (hit, k) in matched.iter_mut().zip(PDL_KERNELS) {
                *hit |= pdl_entry_names(k, name);
            }
            for (hit, k) in matched_first.iter_mut().zip(LAUNCH_FIRST_KERNELS) {
                *hit |= pdl_entry_names(k, name);
            }
            assert!(
                body.contains("griddepcontrol.wait"),
                "{}.cu: {name} is launched early in graphs but never waits for the kernel before",
                file.name
            );
            // Whether it lets its successor launch before it waits: graph.rs must know, to keep
            // plain the edges into kernels that read activations before their wait.
            let (wait, launch) = (
                body.find("griddepcontrol.wait"),
                body.find("griddepcontrol.launch_dependents"),
            );
            let launches_first = matches!((wait, launch), (Some(w), Some(l)) if l < w);
            assert_eq!(
                launches_first,
                is_launch_first_kernel(name),
                "{}.cu: {name} {} its successor launch before it waits, which \
                 graph::LAUNCH_FIRST_KERNELS {}",
                file.name,
                if launches_first {
                    "lets"
                } else {
                    "does not let"
                },
                if launches_first {
                    "does not list"
                } else {
                    "lists"
                },
            );
        }
    }
    for (k, hit) in PDL_KERNELS.iter().zip(matched) {
        assert!(hit, "PDL_KERNELS names {k}, which is no kernel");
    }
    for (k, hit) in LAUNCH_FIRST_KERNELS.iter().zip(matched_first) {
        assert!(
            hit,
            "LAUNCH_FIRST_KERNELS names {k}, which is no kernel of PDL_KERNELS"
        );
    }
}
