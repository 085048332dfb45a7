#!/usr/bin/env python3
"""Compile one kernel file to PTX with NVRTC (no GPU needed) and count, per kernel, the
instructions a change is meant to move: shuffles, local-memory accesses (a register array
indexed at run time lands there), f32 FMAs, branches.

    LD_LIBRARY_PATH=/tmp/nvrtc/nvidia/cu13/lib python3 scripts/probes/ptx_counts.py \
        crates/moerun-cuda/kernels/gemv.cu [substring ...]

NVRTC comes from `pip install nvidia-cuda-nvrtc` (set NVRTC_LIB to its libnvrtc.so.13 if it is
not on the library path). The file is compiled as compile.rs does it: kernels/common.cuh
prepended (and attention_common.cuh for attention*.cu), for compute_90; the sm_90a files
(moe_wgmma.cu, attention_wgmma.cu: hopper.cuh, wgmma) are not handled. Counts are static (each
unrolled copy counts once), which is what compares two versions of the same kernel.
"""
import ctypes
import os
import re
import sys

COUNTS = {"shfl": "shfl.sync", "local": ".local", "fma": "fma.rn.f32", "bra": "bra"}


def ptx_of(path):
    lib = ctypes.CDLL(os.environ.get("NVRTC_LIB", "libnvrtc.so.13"))
    kernels = os.path.dirname(path)
    src = open(os.path.join(kernels, "common.cuh")).read() + "\n"
    if os.path.basename(path).startswith("attention"):
        src += open(os.path.join(kernels, "attention_common.cuh")).read() + "\n"
    src += open(path).read()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=compute_90", b"-default-device", b"-std=c++17"]
    failed = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if failed:
        sys.exit(log.value.decode())
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


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
