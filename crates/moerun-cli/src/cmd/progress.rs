//! A load progress bar on stderr, shown only when stderr is a terminal (nothing otherwise, so
//! logs and pipes stay clean). Used while the mapped weights of a large checkpoint are paged in.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use moerun_model::Model;

/// Below this many weight bytes paging in is too quick to be worth a bar.
const MIN_BYTES_FOR_BAR: u64 = 256 << 20;

/// Page in `model`'s weights with a progress bar when stderr is a terminal and the model is
/// large; otherwise do nothing (the kernels fault pages in as they go).
pub fn load_weights_with_progress(model: &Model) {
    let total = model.checkpoint().weight_bytes();
    if total < MIN_BYTES_FOR_BAR || !std::io::stderr().is_terminal() {
        return;
    }
    let shown = AtomicU64::new(0);
    let lock = Mutex::new(());
    model.checkpoint().prefault(|done| {
        let percent = done * 100 / total.max(1);
        // Redraw only when the whole percentage moves.
        if shown.fetch_max(percent, Ordering::Relaxed) < percent {
            if let Ok(_guard) = lock.lock() {
                let filled = (percent / 4) as usize;
                eprint!(
                    "\rloading weights [{}{}] {percent:3}% of {:.2} GB",
                    "#".repeat(filled),
                    " ".repeat(25 - filled.min(25)),
                    total as f64 / 1e9
                );
                let _ = std::io::stderr().flush();
            }
        }
    });
    eprintln!();
}
