//! ptxas' resource report (registers, shared memory, spills) of the kernel files, for sm_90, as
//! NVRTC builds them here: `cargo run --release -p moerun-cuda --example ptxas_report -- [FILE
//! ...] [--kernel SUBSTRING] [-DNAME[=VALUE] ...]`. Needs libnvrtc.so.13 on the library path (no
//! GPU). Used to see how a change moves a kernel's registers, and so its residency beside the
//! kernels it overlaps under programmatic dependent launch.

use moerun_cuda::compile::{compile_with, KERNEL_FILES};

fn main() {
    if !moerun_cuda::probe::nvrtc_available() {
        eprintln!(
            "ptxas_report: NVRTC is unavailable (libnvrtc.so.13 not found on the library path)"
        );
        std::process::exit(2);
    }
    let mut files = Vec::new();
    let mut defines = Vec::new();
    let mut kernel: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--kernel" {
            let Some(k) = args.next() else {
                eprintln!("ptxas_report: --kernel needs a name (a substring of kernel names)");
                std::process::exit(2);
            };
            kernel = Some(k);
        } else if a.starts_with("-D") {
            defines.push(a);
        } else {
            files.push(a);
        }
    }
    if let Some(unknown) = files
        .iter()
        .find(|n| !KERNEL_FILES.iter().any(|f| f.name == n.as_str()))
    {
        let known: Vec<&str> = KERNEL_FILES.iter().map(|f| f.name).collect();
        eprintln!(
            "ptxas_report: no kernel file named {unknown:?} (known: {})",
            known.join(", ")
        );
        std::process::exit(2);
    }
    for file in KERNEL_FILES
        .iter()
        .filter(|f| files.is_empty() || files.iter().any(|n| n == f.name))
    {
        let c = match compile_with(file, "sm_90", true, &defines) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{}: {e}", file.name);
                std::process::exit(1);
            }
        };
        // ptxas reports a kernel in two lines: "Compiling entry function 'NAME'" and, a few lines
        // later, "Used N registers, ..."; print the ones whose name matches.
        let mut current = String::new();
        for line in c.log.lines() {
            if let Some(rest) = line.split("entry function '").nth(1) {
                current = rest.split('\'').next().unwrap_or(rest).to_string();
            }
            let wanted = kernel.as_deref().is_none_or(|k| current.contains(k));
            if wanted && (line.contains("Used") || line.contains("spill")) {
                println!("{}: {current}: {}", file.name, line.trim());
            }
        }
    }
}
