//! Run-time choice of the SIMD instruction set the kernels use, and the per-ISA kernel code.
//!
//! The best path the CPU supports is detected once (`is_x86_feature_detected!`) and cached; the
//! CLI logs it through [`active_isa`] and can force a lower one with [`force_isa`] (for debugging
//! and for comparing paths). Tests call the kernels with an explicit [`Isa`] instead, so that
//! tests running in parallel never race on the global override.
//!
//! Layout: `kernels` (the decode GEMV and the summation order every product follows) and `gemm`
//! (the packed prefill GEMM) are written once against the `kernels::Simd` vector abstraction,
//! so both drivers share one dot-product structure; `avx512`, `avx2` and `scalar` implement that
//! abstraction and expose `#[target_feature]` entry points. Only this module calls those entry
//! points, and only for an ISA whose support has been checked.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use moerun_core::{Error, Result};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod gemm;
pub(crate) mod kernels;
mod scalar;

/// An instruction-set path of the kernels, from the portable fallback up to AVX-512.
///
/// Each path sums a dot product in its own fixed order (16 lanes on AVX-512, 8 on AVX2 and
/// scalar), so results are reproducible bit for bit on one path but may differ between paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust (what non-x86 builds run); 8 lanes, separate multiply and add.
    Scalar,
    /// AVX2 + FMA + F16C: 8-lane fused multiply-add.
    Avx2,
    /// AVX-512 F/BW/VL: 16-lane fused multiply-add, masked tails.
    Avx512,
}

impl Isa {
    /// Every path, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The name logged and accepted by [`Isa::parse`]: `"scalar"`, `"avx2"`, `"avx512"`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The path called `name` (as [`Isa::name`] spells it), if any.
    pub fn parse(name: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name().eq_ignore_ascii_case(name))
    }

    /// Whether this CPU can run the path. The answer is cached, so this is cheap.
    pub fn is_supported(self) -> bool {
        self <= detected()
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The best path this CPU supports, detected on first use.
pub fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    // The AVX-512 path also uses BW/VL for masked 16-bit tail loads; AVX2 needs FMA for its
    // multiply-adds and F16C to widen f16 weights.
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        Isa::Avx512
    } else if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Scalar
}

/// Every path this CPU supports, lowest first (what the tests iterate over).
pub fn available_isas() -> Vec<Isa> {
    Isa::ALL
        .into_iter()
        .filter(|isa| isa.is_supported())
        .collect()
}

/// 0 = no override, otherwise `1 + Isa as u8`.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// Make [`active`] return `isa` instead of the detected best path (`None` undoes it). Fails if the
/// CPU cannot run `isa`. Process-wide: meant for the CLI, not for tests running in parallel.
pub fn force_isa(isa: Option<Isa>) -> Result<()> {
    match isa {
        None => FORCED.store(0, Ordering::Relaxed),
        Some(isa) if isa.is_supported() => FORCED.store(1 + isa as u8, Ordering::Relaxed),
        Some(isa) => {
            return Err(Error::Unsupported(format!(
                "SIMD path {isa} (this CPU supports up to {})",
                detected()
            )))
        }
    }
    Ok(())
}

/// The path the kernels use: the forced one if any, else the detected best.
pub fn active() -> Isa {
    match FORCED.load(Ordering::Relaxed) {
        0 => detected(),
        v => Isa::ALL[usize::from(v - 1)],
    }
}

/// The name of the path the kernels use (`"avx512"`, `"avx2"` or `"scalar"`), for logs.
pub fn active_isa() -> &'static str {
    active().name()
}

/// How a block of output rows is computed (see `kernels` and `gemm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Weights read straight from storage and widened in registers (decode, small m).
    Stream,
    /// Weights widened once into an f32 panel buffer and reused across all m rows (prefill).
    Packed,
}

/// One block of a product: `out[i * n + j] = dot(x[i, ..], w[j, ..])` for all `n` rows of `w` and
/// all `m` rows of `x`, on one thread. Panics if `isa` is not supported or the lengths disagree.
pub(crate) fn matmul_t_block(
    isa: Isa,
    mode: Mode,
    x: &[f32],
    m: usize,
    w: moerun_core::MatRef<'_>,
    out: &mut [f32],
) {
    let (n, k) = (w.rows, w.cols);
    assert!(isa.is_supported(), "SIMD path {isa} is not supported here");
    assert_eq!(x.len(), m * k, "x must be [m, k]");
    assert_eq!(out.len(), m * n, "out must be [m, n]");
    assert_eq!(w.data.len(), n * k * w.dtype.size(), "weight bytes");
    let args = kernels::Args {
        x: x.as_ptr(),
        m,
        k,
        w: w.data.as_ptr(),
        n,
        out: out.as_mut_ptr(),
    };
    match isa {
        // SAFETY: the assertions above make every pointer in `args` valid for the extents it
        // describes, and `is_supported` has confirmed the CPU features the entry point enables.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::matmul_t_block(mode, w.dtype, args) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::matmul_t_block(mode, w.dtype, args) },
        // SAFETY: as above (the scalar path needs no CPU feature).
        _ => unsafe { scalar::matmul_t_block(mode, w.dtype, args) },
    }
}

/// Sum of `data` with the path's widest loads (for the bandwidth probe: the sum keeps the loads
/// from being optimised away, its value is meaningless).
pub(crate) fn read_sum(isa: Isa, data: &[f32]) -> f32 {
    assert!(isa.is_supported(), "SIMD path {isa} is not supported here");
    match isa {
        // SAFETY: `data` is a valid slice and the CPU supports the entry point's features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::read_sum(data.as_ptr(), data.len()) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::read_sum(data.as_ptr(), data.len()) },
        // SAFETY: as above.
        _ => unsafe { scalar::read_sum(data.as_ptr(), data.len()) },
    }
}
