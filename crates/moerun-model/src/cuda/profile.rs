//! Where a GPU forward pass spends its time, op by op: with `MOERUN_CUDA_PROFILE=1` every
//! backend op of an eager pass is bracketed by CUDA events (and waited for, so passes get slower
//! but each op's device time is its own), and the totals are kept per op name until
//! [`report`] prints them. Graphs are off while profiling: a replayed graph has no ops to time.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use moerun_core::Result;
use moerun_cuda::CudaDevice;

use super::dev_err;

fn table() -> &'static Mutex<BTreeMap<&'static str, (u64, f64)>> {
    static TABLE: OnceLock<Mutex<BTreeMap<&'static str, (u64, f64)>>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// Whether `MOERUN_CUDA_PROFILE=1` is set.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("MOERUN_CUDA_PROFILE").is_some_and(|v| v == "1"))
}

/// Run `op`, adding its device time to `name` when profiling.
pub(crate) fn timed<T>(
    dev: &CudaDevice,
    name: &'static str,
    op: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if !enabled() {
        return op();
    }
    let mut out = None;
    let ms = dev
        .elapsed_ms(|| {
            out = Some(op());
            Ok(())
        })
        .map_err(dev_err)?;
    if let Ok(mut t) = table().lock() {
        let e = t.entry(name).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += ms as f64;
    }
    out.expect("op ran")
}

/// The profile so far, one line per op, most time first; empty when profiling is off.
pub fn report() -> String {
    let Ok(t) = table().lock() else {
        return String::new();
    };
    let total: f64 = t.values().map(|v| v.1).sum();
    let mut rows: Vec<_> = t.iter().collect();
    rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    let mut s = String::new();
    if total > 0.0 {
        s.push_str(&format!(
            "{:<16} {:>8} {:>10} {:>9} {:>6}\n",
            "op", "calls", "ms", "us/call", "%"
        ));
        for (name, (n, ms)) in rows {
            s.push_str(&format!(
                "{name:<16} {n:>8} {ms:>10.2} {:>9.1} {:>5.1}%\n",
                1e3 * ms / *n as f64,
                100.0 * ms / total
            ));
        }
    }
    s
}
