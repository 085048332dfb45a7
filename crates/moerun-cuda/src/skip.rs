//! `MOERUN_CUDA_SKIP`: a measuring tool, not a feature. A comma-separated list of op names whose
//! kernels are then not launched at all, so that `moerun bench` shows what each one adds to a
//! decode step as the CUDA graph really runs it (ncu times kernels one at a time, without the
//! overlap that programmatic dependent launch gives inside a graph). **Outputs are wrong** while
//! anything is skipped; only the timing means something.
//!
//! Names: `add_rms_norm`, `qkv_prologue`, `attention` (the decode kernels), `route_topk`,
//! `moe_gate_up`, `moe_down` (the tiny decode pass), `gemv` (every GEMV) or `gemv:<rows>` (the
//! GEMVs with that many output rows), `argmax`.

use std::sync::OnceLock;

/// Whether `op` is in `MOERUN_CUDA_SKIP` (read once per process).
pub(crate) fn skipped(op: &str) -> bool {
    list().iter().any(|s| s == op)
}

/// Whether the GEMVs of `rows` output rows are skipped (`gemv` or `gemv:<rows>`); formats the
/// name only when something is skipped at all.
pub(crate) fn gemv_skipped(rows: usize) -> bool {
    let list = list();
    !list.is_empty() && (skipped("gemv") || skipped(&format!("gemv:{rows}")))
}

fn list() -> &'static [String] {
    static LIST: OnceLock<Vec<String>> = OnceLock::new();
    LIST.get_or_init(|| {
        let list: Vec<String> = std::env::var("MOERUN_CUDA_SKIP")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if !list.is_empty() {
            eprintln!("MOERUN_CUDA_SKIP: not launching {list:?}; outputs are wrong (timing only)");
        }
        list
    })
}
