#!/usr/bin/env python3
"""Compile one kernel file to PTX with NVRTC (no GPU needed) and count, per kernel, the
instructions a change is meant to move: shuffles, local-memory accesses (a register array
indexed at run time lands there), f32 FMAs, branches.

    LD_LIBRARY_PATH=/tmp/nvrtc/nvidia/cu13/lib python3 scripts/probes/ptx_counts.py \
        crates/moerun-cuda/kernels/gemv.cu [substring ...]

NVRTC comes from `pip install nvidia-cuda-nvrtc` (set NVRTC_LIB to its libnvrtc.so.13 if it is
not on the library path). The file is compiled as compile.rs does it (nvrtc_build.py:
kernels/common.cuh prepended, and attention_common.cuh for attention*.cu), for compute_90; the sm_90a files
(moe_wgmma.cu, attention_wgmma.cu: hopper.cuh, wgmma) are not handled. Counts are static (each
unrolled copy counts once), which is what compares two versions of the same kernel.
"""
import re
import sys

from nvrtc_build import compile_source, source

COUNTS = {"shfl": "shfl.sync", "local": ".local", "fma": "fma.rn.f32", "bra": "bra"}


def ptx_of(path):
    return compile_source(source(path), "compute_90")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    ptx = ptx_of(sys.argv[1])
    wanted = sys.argv[2:]
    for part in ptx.split(".entry ")[1:]:
        name = re.match(r"\w+", part).group(0)
        if wanted and not any(w in name for w in wanted):
            continue
        counts = "  ".join(f"{k} {part.count(v):4d}" for k, v in COUNTS.items())
        print(f"{name:48} {counts}")


if __name__ == "__main__":
    main()
