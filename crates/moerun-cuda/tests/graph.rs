//! CUDA graphs with programmatic dependent launch: on Hopper the edges between kernels that call
//! `pdl_entry()` are made programmatic, and a long chain of dependent kernels replayed from such a
//! graph gives exactly what running them one after another gives.

mod common;

use moerun_cuda::graph::PDL_KERNELS;

#[test]
fn a_chain_of_dependent_kernels_replays_exactly_with_programmatic_edges() {
    let Some(dev) = common::device() else { return };
    // Big enough that each add runs long and the next one launches while it does.
    let n = 1 << 22;
    let steps = 64;
    let x0: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let y0: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut x = dev.upload(&x0).unwrap();
    let y = dev.upload(&y0).unwrap();
    dev.synchronize().unwrap();
    // x += y, again and again: every kernel reads what the one before wrote.
    let graph = dev
        .capture(|| {
            for _ in 0..steps {
                dev.add_assign(&mut x, &y)?;
            }
            Ok(())
        })
        .unwrap();
    let (major, _) = dev.info().compute_capability;
    let wanted = std::env::var_os("MOERUN_CUDA_PDL").is_none_or(|v| v != "0");
    let edges = graph.programmatic_edges();
    println!("{edges} of {} edges programmatic", steps - 1);
    if major >= 9 && wanted {
        assert_eq!(edges, steps - 1, "every edge programmatic");
    } else {
        assert_eq!(edges, 0);
    }
    let replays = 3;
    for _ in 0..replays {
        graph.launch().unwrap();
    }
    // Small integers: every sum is exact in f32, so any read of a stale x shows.
    let got = dev.download(&x).unwrap();
    let bad = (0..n)
        .filter(|&i| got[i] != x0[i] + (replays * steps) as f32 * y0[i])
        .count();
    assert_eq!(
        bad, 0,
        "{bad} of {n} values differ from {replays} x {steps} adds"
    );
    assert!(PDL_KERNELS.contains(&"add_f32"));
}
