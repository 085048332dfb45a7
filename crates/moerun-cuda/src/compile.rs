//! Run-time compilation of the kernel files with NVRTC, and the on-disk cache of the results.
//!
//! Each `.cu` file under `kernels/` is one kernel family. Its text (with `kernels/common.cuh`
//! prepended) is embedded in the binary, compiled by NVRTC for the device's real architecture
//! (`sm_90` on an H100/H200) straight to a **cubin**, and cached as
//! `<cache>/moerun/cuda/<file>-<arch>-<hash>.cubin`, where `<cache>` is `$XDG_CACHE_HOME` or
//! `$HOME/.cache`. The hash covers the source text, the NVRTC options, the architecture and the
//! NVRTC version, so an edited kernel, another GPU or another toolkit never loads a stale file.
//!
//! Why cubin rather than PTX: a cubin is machine code for exactly this architecture, so the driver
//! loads it without a second (JIT) compilation, and it does not depend on the driver accepting the
//! PTX version of a possibly newer NVRTC. The cost is one cached file per architecture, which is
//! what the key already separates. A cache that cannot be read or written is not an error: the
//! kernels are compiled in memory and the engine runs, only its start is slower.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::result as nvrtc;
use cudarc::nvrtc::sys;

use crate::error::{CudaError, Result};

/// Text prepended to every kernel file: typedefs, bf16/f16 widening, warp reductions.
const PRELUDE: &str = include_str!("../kernels/common.cuh");

/// Text prepended (after [`PRELUDE`]) to the files of [`SM90A_FILES`] only: mbarriers, cp.async
/// and wgmma wrappers.
const HOPPER_PRELUDE: &str = include_str!("../kernels/hopper.cuh");

/// Text prepended (after the others) to the files of [`ATTENTION_FILES`]: the attention kernels'
/// argument struct, pool addressing and tile rule.
const ATTENTION_PRELUDE: &str = include_str!("../kernels/attention_common.cuh");

/// The kernel builds that take [`ATTENTION_PRELUDE`].
const ATTENTION_FILES: &[&str] = &[
    "attention",
    "attention_wgmma",
    "attention_kvbf16",
    "attention_wgmma_kvbf16",
    "attention_cl16",
    "attention_cl16_kvbf16",
];

macro_rules! kv_bf16_define {
    () => {
        "#define MOERUN_KV_BF16 1\n"
    };
}
macro_rules! cl16_defines {
    () => {
        "#define CL_SIZE 16\n#define ATTN_CLUSTER_ONLY 1\n"
    };
}
/// The attention files built a second time for a bf16 KV pool (`kv_t`, attention_common.cuh):
/// the builds named `<file>_kvbf16` ([`crate::ops::KvDtype`] picks one at each call).
const KV_BF16_DEFINES: &str = kv_bf16_define!();
/// attention.cu's cluster decode kernels alone, in clusters of 16 blocks (Hopper's non-portable
/// size) instead of 8: the builds named `attention_cl16[_kvbf16]`, which the host plans with
/// where a cluster of 16 beats one of 8 (ops/attention.rs `choose_cluster`).
const CL16_DEFINES: &str = cl16_defines!();
const CL16_KV_BF16_DEFINES: &str = concat!(cl16_defines!(), kv_bf16_define!());

/// The preludes of `file`, in the order they precede its text (its defines first).
fn preludes(file: &KernelFile) -> Vec<&'static str> {
    let mut parts = Vec::new();
    if !file.defines.is_empty() {
        parts.push(file.defines);
    }
    parts.push(PRELUDE);
    if SM90A_FILES.contains(&file.name) {
        parts.push(HOPPER_PRELUDE);
    }
    if ATTENTION_FILES.contains(&file.name) {
        parts.push(ATTENTION_PRELUDE);
    }
    parts
}

/// The whole text NVRTC compiles for `file`.
fn full_source(file: &KernelFile) -> String {
    let mut text = preludes(file).join("\n");
    text.push('\n');
    text.push_str(file.source);
    text
}

/// One kernel family: a `.cu` file and the `extern "C"` entry points it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelFile {
    /// The build's name (a module, a cache file): the file's name under `kernels/`, without `.cu`,
    /// or for a second build of a file, that name and a suffix.
    pub name: &'static str,
    /// The file's text.
    pub source: &'static str,
    /// Text put before everything else (the preludes included): `#define`s that pick a build.
    pub defines: &'static str,
}

/// Every kernel family of the backend, in the order [`crate::CudaDevice::open`] loads them.
pub const KERNEL_FILES: &[KernelFile] = &[
    KernelFile {
        name: "norm",
        source: include_str!("../kernels/norm.cu"),
        defines: "",
    },
    KernelFile {
        name: "rope",
        source: include_str!("../kernels/rope.cu"),
        defines: "",
    },
    KernelFile {
        name: "activation",
        source: include_str!("../kernels/activation.cu"),
        defines: "",
    },
    KernelFile {
        name: "convert",
        source: include_str!("../kernels/convert.cu"),
        defines: "",
    },
    KernelFile {
        name: "embedding",
        source: include_str!("../kernels/embedding.cu"),
        defines: "",
    },
    KernelFile {
        name: "router",
        source: include_str!("../kernels/router.cu"),
        defines: "",
    },
    KernelFile {
        name: "gemv",
        source: include_str!("../kernels/gemv.cu"),
        defines: "",
    },
    KernelFile {
        name: "attention",
        source: include_str!("../kernels/attention.cu"),
        defines: "",
    },
    KernelFile {
        name: "attention_wgmma",
        source: include_str!("../kernels/attention_wgmma.cu"),
        defines: "",
    },
    KernelFile {
        name: "attention_kvbf16",
        source: include_str!("../kernels/attention.cu"),
        defines: KV_BF16_DEFINES,
    },
    KernelFile {
        name: "attention_wgmma_kvbf16",
        source: include_str!("../kernels/attention_wgmma.cu"),
        defines: KV_BF16_DEFINES,
    },
    KernelFile {
        name: "attention_cl16",
        source: include_str!("../kernels/attention.cu"),
        defines: CL16_DEFINES,
    },
    KernelFile {
        name: "attention_cl16_kvbf16",
        source: include_str!("../kernels/attention.cu"),
        defines: CL16_KV_BF16_DEFINES,
    },
    KernelFile {
        name: "moe",
        source: include_str!("../kernels/moe.cu"),
        defines: "",
    },
    KernelFile {
        name: "moe_prefill",
        source: include_str!("../kernels/moe_prefill.cu"),
        defines: "",
    },
    KernelFile {
        name: "moe_wgmma",
        source: include_str!("../kernels/moe_wgmma.cu"),
        defines: "",
    },
    KernelFile {
        name: "gemma",
        source: include_str!("../kernels/gemma.cu"),
        defines: "",
    },
    KernelFile {
        name: "elementwise",
        source: include_str!("../kernels/elementwise.cu"),
        defines: "",
    },
    KernelFile {
        name: "fused",
        source: include_str!("../kernels/fused.cu"),
        defines: "",
    },
    KernelFile {
        name: "gated_delta",
        source: include_str!("../kernels/gated_delta.cu"),
        defines: "",
    },
];

/// Kernel files built for the architecture-specific target `sm_90a` on compute capability 9.0
/// devices (wgmma, setmaxnreg exist only there). Each guards its bodies with
/// `__CUDA_ARCH_FEAT_SM90_ALL`, so on any other architecture it compiles to entry points that are
/// never launched.
pub const SM90A_FILES: &[&str] = &["moe_wgmma", "attention_wgmma", "attention_wgmma_kvbf16"];

/// The target `file` is compiled for on a device whose plain target is `arch`: `sm_90a` (or
/// `compute_90a`) for the files of [`SM90A_FILES`] on sm_90, else `arch` itself.
pub fn target_arch(file: &KernelFile, arch: &str) -> String {
    let specific = SM90A_FILES.contains(&file.name);
    match arch {
        "sm_90" | "compute_90" if specific => format!("{arch}a"),
        _ => arch.to_string(),
    }
}

/// The NVRTC target name of a compute capability, e.g. `sm_90` for (9, 0).
pub fn arch_name(major: u32, minor: u32) -> String {
    format!("sm_{major}{minor}")
}

/// A compiled kernel file.
#[derive(Debug)]
pub struct Compiled {
    /// The cubin image.
    pub cubin: Vec<u8>,
    /// NVRTC's log (empty unless it warned, or `verbose` asked for ptxas' resource report).
    pub log: String,
}

/// Where the kernels came from on this open: how many files were read from the cache and how
/// many were compiled (and where the cache lives, if anywhere).
#[derive(Clone, Debug, Default)]
pub struct CacheReport {
    pub dir: Option<PathBuf>,
    pub hits: usize,
    pub compiled: usize,
}

/// The options every kernel is compiled with, `defines` (`-DNAME[=VALUE]`) last. No include path:
/// the kernels need no headers.
fn options(arch: &str, verbose: bool, defines: &[String]) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    if verbose {
        o.push("--ptxas-options=-v".into());
    }
    o.extend(defines.iter().cloned());
    o
}

/// `MOERUN_CUDA_DEFINES`: preprocessor defines for every kernel file, `-DNAME[=VALUE]` separated
/// by spaces, read once. For measuring builds without rebuilding the binary: `-DMOERUN_PROBE`
/// turns on the phase probes (common.cuh; scripts/probes/phases.py reads what they print). They
/// are part of the cache key, so such cubins never stand in for the plain ones. Anything that
/// is not a define is refused by name when the kernels are compiled.
pub fn env_defines() -> Result<&'static [String]> {
    static DEFINES: std::sync::OnceLock<std::result::Result<Vec<String>, String>> =
        std::sync::OnceLock::new();
    DEFINES
        .get_or_init(|| {
            let raw = std::env::var("MOERUN_CUDA_DEFINES").unwrap_or_default();
            // A bad MOERUN_CUDA_CLUSTER_SIZE is refused with the kernels, before any call plans.
            cluster_size_knob()?;
            parse_defines(&raw)
        })
        .as_deref()
        .map_err(|bad| CudaError::InvalidArgument(bad.clone()))
}

/// `MOERUN_CUDA_CLUSTER_SIZE`, read once: forces the blocks per thread-block cluster of the
/// cluster decode attention kernel to 8 (the portable maximum) or 16 (non-portable on Hopper:
/// fewer keys per block); unset, each call's plan picks (ops/attention.rs `choose_cluster`). A
/// measuring knob; any other value is refused by name when the kernels are compiled.
pub(crate) fn cluster_size_knob() -> std::result::Result<Option<usize>, String> {
    static SIZE: std::sync::OnceLock<std::result::Result<Option<usize>, String>> =
        std::sync::OnceLock::new();
    SIZE.get_or_init(|| {
        let raw = std::env::var("MOERUN_CUDA_CLUSTER_SIZE").unwrap_or_default();
        parse_cluster_size(&raw)
    })
    .clone()
}

/// The cluster size a `MOERUN_CUDA_CLUSTER_SIZE` value forces (empty: none, the plan picks).
fn parse_cluster_size(raw: &str) -> std::result::Result<Option<usize>, String> {
    match raw.trim() {
        "" => Ok(None),
        "8" => Ok(Some(8)),
        "16" => Ok(Some(16)),
        other => Err(format!(
            "MOERUN_CUDA_CLUSTER_SIZE: `{other}` is not a cluster size (8 or 16)"
        )),
    }
}

/// The defines of a `MOERUN_CUDA_DEFINES` value, or the message naming its first non-define.
/// `CL_SIZE` is refused too: the host plans each build with its own cluster size (8, or 16 for
/// the `attention_cl16` builds); `MOERUN_CUDA_CLUSTER_SIZE` picks between them.
fn parse_defines(raw: &str) -> std::result::Result<Vec<String>, String> {
    raw.split_whitespace()
        .map(|d| {
            let name = d.strip_prefix("-D").unwrap_or("");
            let ident = name.split('=').next().unwrap_or("");
            let ok = ident.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && ident.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if ok && ident == "CL_SIZE" {
                Err(
                    "MOERUN_CUDA_DEFINES: pick the cluster size by MOERUN_CUDA_CLUSTER_SIZE, not \
                     -DCL_SIZE"
                        .to_string(),
                )
            } else if ok {
                Ok(d.to_string())
            } else {
                Err(format!(
                    "MOERUN_CUDA_DEFINES: `{d}` is not a define (-DNAME or -DNAME=VALUE)"
                ))
            }
        })
        .collect()
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: FFI call writing two ints through valid pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Unavailable(format!("NVRTC does not answer: {e:?}")))?;
    Ok((major, minor))
}

/// Compile one kernel file for `arch` with NVRTC, without touching the cache. Needs only the NVRTC
/// library, no GPU: tests use it to check every kernel compiles. `verbose` adds ptxas' register
/// and spill report to the log.
pub fn compile(file: &KernelFile, arch: &str, verbose: bool) -> Result<Compiled> {
    compile_with(file, arch, verbose, env_defines()?)
}

/// [`compile`] with explicit `defines` (`-DNAME[=VALUE]`) instead of `MOERUN_CUDA_DEFINES`'.
pub fn compile_with(
    file: &KernelFile,
    arch: &str,
    verbose: bool,
    defines: &[String],
) -> Result<Compiled> {
    let arch = &target_arch(file, arch);
    let full = full_source(file);
    let fail = |source, log: String| CudaError::Compile {
        file: format!("{}.cu", file.name),
        arch: arch.to_string(),
        source,
        log,
    };
    let src = CString::new(full).map_err(|_| CudaError::InvalidArgument("NUL in kernel".into()))?;
    let name = CString::new(format!("{}.cu", file.name))
        .map_err(|_| CudaError::InvalidArgument("NUL in kernel name".into()))?;
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| fail(e, String::new()))?;
    let opts = options(arch, verbose, defines);
    // SAFETY: `prog` was just created and is destroyed exactly once below; `src` and `name`
    // outlive it.
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    // SAFETY: as above; the log is readable whether or not compilation succeeded.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|raw| c_chars_to_string(&raw))
        .unwrap_or_default();
    let result = compiled
        .map_err(|e| fail(e, log.clone()))
        // SAFETY: `prog` compiled successfully, so its cubin can be read.
        .and_then(|()| unsafe { read_cubin(prog) }.map_err(|e| fail(e, log.clone())));
    // SAFETY: `prog` came from create_program and is not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    Ok(Compiled {
        cubin: result?,
        log,
    })
}

/// The PTX of one kernel file for the virtual architecture `arch` (say `compute_90`), as NVRTC
/// writes it before assembly. Tests read it to check what each kernel entry does (no GPU needed).
pub fn compile_ptx(file: &KernelFile, arch: &'static str) -> Result<String> {
    let arch = if target_arch(file, arch) == "compute_90a" {
        "compute_90a"
    } else {
        arch
    };
    let full = full_source(file);
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        name: Some(format!("{}.cu", file.name)),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(full, opts)
        .map(|ptx| ptx.to_src())
        .map_err(|e| CudaError::Compile {
            file: format!("{}.cu", file.name),
            arch: arch.to_string(),
            source: nvrtc::NvrtcError(sys::nvrtcResult::NVRTC_ERROR_COMPILATION),
            log: format!("{e:?}"),
        })
}

/// Read the cubin of a compiled program.
///
/// # Safety
/// `prog` must be a live, successfully compiled NVRTC program for a real architecture.
unsafe fn read_cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, nvrtc::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: the caller guarantees `prog`; `size` is a valid out pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds exactly the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }.result()?;
    Ok(cubin)
}

fn c_chars_to_string(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// The cache folder: `$XDG_CACHE_HOME/moerun/cuda` or `$HOME/.cache/moerun/cuda`.
pub fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("moerun").join("cuda"))
}

/// The cache file name of `file` for `arch`: the hash covers everything that shapes the cubin.
pub fn cache_file_name(
    file: &KernelFile,
    arch: &str,
    nvrtc: (i32, i32),
    defines: &[String],
) -> String {
    let arch = &target_arch(file, arch);
    let mut h = Fnv64::new();
    let options = options(arch, false, defines).join(" ");
    let parts = preludes(file).into_iter();
    for part in parts.chain([file.source, arch.as_str(), options.as_str()]) {
        h.write(part.as_bytes());
        h.write(&[0xff]);
    }
    h.write(&nvrtc.0.to_le_bytes());
    h.write(&nvrtc.1.to_le_bytes());
    format!("{}-{arch}-{:016x}.cubin", file.name, h.finish())
}

/// The cubin of `file` for `arch`: from the cache when present, else compiled and stored there
/// (written to a temporary name, then renamed, so concurrent processes never read half a file).
fn cubin(file: &KernelFile, arch: &str, report: &mut CacheReport) -> Result<Vec<u8>> {
    let path = match &report.dir {
        Some(dir) => Some(dir.join(cache_file_name(
            file,
            arch,
            nvrtc_version()?,
            env_defines()?,
        ))),
        None => None,
    };
    if let Some(bytes) = path.as_deref().and_then(|p| std::fs::read(p).ok()) {
        if !bytes.is_empty() {
            report.hits += 1;
            return Ok(bytes);
        }
    }
    let compiled = compile(file, arch, false)?;
    report.compiled += 1;
    if let Some(path) = path {
        store(&path, &compiled.cubin);
    }
    Ok(compiled.cubin)
}

/// [`cubin`] for every file of `files`, in their order: the files missing from the cache compile
/// at once, one thread each up to the machine's cores (NVRTC compiles distinct programs
/// concurrently; a cold cache took ~100 s one file after another on the H200's host).
pub(crate) fn cubins(
    files: &[KernelFile],
    arch: &str,
    report: &mut CacheReport,
) -> Result<Vec<Vec<u8>>> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, files.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let dir = &report.dir;
    // Each worker takes the next file index until none is left: (index, its cubin, its report).
    type Built = (usize, Result<Vec<u8>>, CacheReport);
    let mut built: Vec<Built> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(file) = files.get(i) else { break };
                        let mut own = CacheReport {
                            dir: dir.clone(),
                            hits: 0,
                            compiled: 0,
                        };
                        let bytes = cubin(file, arch, &mut own);
                        mine.push((i, bytes, own));
                    }
                    mine
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    built.sort_by_key(|b| b.0);
    let mut out = Vec::with_capacity(files.len());
    for (_, bytes, own) in built {
        report.hits += own.hits;
        report.compiled += own.compiled;
        out.push(bytes?);
    }
    Ok(out)
}

/// Best effort: a cache that cannot be written only costs a recompilation next time.
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// FNV-1a, 64 bits: a stable hash for cache keys (std's hashers may change between releases).
struct Fnv64(u64);

impl Fnv64 {
    fn new() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_arch_source_defines_and_nvrtc_version() {
        let f = KERNEL_FILES[0];
        let g = KernelFile {
            name: f.name,
            source: "// edited",
            defines: "",
        };
        let h = KernelFile {
            defines: "#define X 1\n",
            ..f
        };
        let key = |file: &KernelFile, arch: &str, nvrtc: (i32, i32)| {
            cache_file_name(file, arch, nvrtc, &[])
        };
        let a = key(&f, "sm_90", (13, 0));
        assert_ne!(a, key(&f, "sm_80", (13, 0)));
        assert_ne!(a, key(&g, "sm_90", (13, 0)));
        assert_ne!(a, key(&h, "sm_90", (13, 0)));
        assert_ne!(a, key(&f, "sm_90", (13, 1)));
        let probe = ["-DMOERUN_PROBE".to_string()];
        assert_ne!(a, cache_file_name(&f, "sm_90", (13, 0), &probe));
        assert_eq!(a, key(&f, "sm_90", (13, 0)), "stable");
        assert!(a.starts_with("norm-sm_90-") && a.ends_with(".cubin"));
    }

    #[test]
    fn defines_are_taken_and_anything_else_is_refused_by_name() {
        assert_eq!(parse_defines(""), Ok(vec![]));
        assert_eq!(
            parse_defines(" -DMOERUN_PROBE  -DMOERUN_PROBE_FROM=6000 "),
            Ok(vec![
                "-DMOERUN_PROBE".to_string(),
                "-DMOERUN_PROBE_FROM=6000".to_string()
            ])
        );
        for bad in ["MOERUN_PROBE", "-D", "-D9X", "--use_fast_math", "-DA-B"] {
            let err = parse_defines(&format!("-DOK {bad}")).unwrap_err();
            assert!(err.contains(&format!("`{bad}`")), "{bad}: {err}");
        }
        let err = parse_defines("-DCL_SIZE=16").unwrap_err();
        assert!(err.contains("MOERUN_CUDA_CLUSTER_SIZE"), "{err}");
    }

    #[test]
    fn the_cluster_size_is_8_or_16_and_anything_else_is_refused_by_name() {
        assert_eq!(parse_cluster_size(""), Ok(None));
        assert_eq!(parse_cluster_size("8"), Ok(Some(8)));
        assert_eq!(parse_cluster_size(" 16 "), Ok(Some(16)));
        for bad in ["4", "32", "sixteen", "-1"] {
            let err = parse_cluster_size(bad).unwrap_err();
            assert!(err.contains(&format!("`{bad}`")), "{bad}: {err}");
        }
    }

    #[test]
    fn only_the_listed_files_get_sm90a_and_only_on_sm90() {
        let wgmma = KERNEL_FILES.iter().find(|f| f.name == "moe_wgmma").unwrap();
        assert_eq!(target_arch(wgmma, "sm_90"), "sm_90a");
        assert_eq!(target_arch(wgmma, "compute_90"), "compute_90a");
        assert_eq!(target_arch(wgmma, "sm_100"), "sm_100");
        assert_eq!(target_arch(&KERNEL_FILES[0], "sm_90"), "sm_90");
        assert!(cache_file_name(wgmma, "sm_90", (13, 0), &[]).starts_with("moe_wgmma-sm_90a-"));
    }
}
