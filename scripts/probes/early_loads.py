#!/usr/bin/env python3
"""Which kernels issue global loads before their programmatic wait, read from the SASS ptxas
actually produced (no GPU needed).

A kernel launched under programmatic dependent launch may load what the kernel before it does
not write (weights, older K/V rows) before `griddepcontrol.wait` (ACQBULK in SASS), so that its
blocks stream while the previous kernel finishes. The PTX order is not enough: ptxas may hoist
the wait above loads it sees as independent of it, and did so for every `ld.global.nc` weight
load of the GEMVs (docs/perf/cuda-model.md v14), which then ran after the wait. This compiles
each file as compile.rs does (nvrtc_build.py: the preludes, the bf16-KV define for the `_kvbf16`
builds) to an sm_90 cubin, disassembles it, and per kernel counts the global loads (LDG) before the first
ACQBULK. `--check` fails (exit 1) if a kernel meant to load early (EARLY) has none there, or if
a launch-first kernel (LAUNCH_FIRST) does not trigger its successor (PREEXIT) before its wait.

    LD_LIBRARY_PATH=/tmp/nvrtc/nvidia/cu13/lib PATH=/tmp/nvdis/nvidia/cu13/bin:$PATH \\
        CUOBJDUMP=/tmp/cuobj/nvidia/cu13/bin/cuobjdump \\
        python3 scripts/probes/early_loads.py [--check] [file ...]

NVRTC from `pip install --target /tmp/nvrtc 'nvidia-cuda-nvrtc==13.0.*'` (the device machine's
version), cuobjdump and nvdisasm from `pip install --target /tmp/cuobj nvidia-cuda-cuobjdump`
and `--target /tmp/nvdis nvidia-cuda-nvdisasm` (13.2 reads 13.0's cubins). Default files: gemv,
moe, attention, attention_kvbf16, fused and router. The sm_90a files (wgmma) are not handled.
"""
import os
import re
import subprocess
import sys
import tempfile

from nvrtc_build import KERNELS, compile_source, source

# Kernels whose loads are meant to go out before their wait (name prefixes), and the files they
# are in: the GEMVs (weight rows), the tiny MoE down kernel (its experts' rows once it has read
# the ids), the decode attention kernels (K/V rows older than the token's own), the decode norms
# and attention prologue (their weights and constants).
EARLY = ("gemv_", "moe_tiny_down_", "attn_cluster_", "attn_split_", "add_rms_norm_",
         "rms_norm_block_", "qkv_split_norm_rope_early_")
# graph::LAUNCH_FIRST_KERNELS (prefixes): they let their successor launch (launch_dependents,
# PREEXIT in SASS) before they wait; kernels_compile checks the PTX, this the SASS.
LAUNCH_FIRST = ("add_rms_norm_f32", "qkv_split_norm_rope_", "rms_norm_block_f32", "route_topk_f32_l")
DEFAULT_FILES = ["gemv", "moe", "attention", "attention_kvbf16", "fused", "router"]


def kernels_sass(name):
    """{kernel: [SASS instruction text]} of file `name`."""
    base = name.removesuffix("_kvbf16")
    text = source(os.path.join(KERNELS, base + ".cu"), bf16_kv=name != base)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compile_source(text, "sm_90"))
        f.flush()
        dump = subprocess.run([os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass", f.name],
                              check=True, capture_output=True, text=True).stdout
    out, cur = {}, None
    for line in dump.splitlines():
        if "Function : " in line:
            cur = line.split()[-1]
            out[cur] = []
        elif cur and re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            out[cur].append(line.split("*/", 1)[1].split(";")[0].strip())
    return out


def main():
    args = sys.argv[1:]
    check = "--check" in args
    files = [a for a in args if a != "--check"] or DEFAULT_FILES
    bad = []
    for name in files:
        for kernel, sass in sorted(kernels_sass(name).items()):
            waits = [i for i, ins in enumerate(sass) if "ACQBULK" in ins]
            if not waits:
                continue
            early = sum(1 for ins in sass[: waits[0]] if re.search(r"\bLDG\b|\bLDG\.", ins))
            loads = sum(1 for ins in sass if re.search(r"\bLDG\b|\bLDG\.", ins))
            triggers = [i for i, ins in enumerate(sass) if "PREEXIT" in ins]
            flag = ""
            if kernel.startswith(EARLY) and early == 0:
                flag = "  <- meant to load early"
            if kernel.startswith(LAUNCH_FIRST) and not (triggers and triggers[0] < waits[0]):
                flag += "  <- meant to launch its successor before waiting"
            print(f"{name:18} {kernel:36} loads before the wait {early:3d} of {loads:4d}{flag}")
            if flag:
                bad.append(f"{name}:{kernel}")
    if check and bad:
        sys.exit(f"programmatic launch not as meant in: {', '.join(bad)}")


if __name__ == "__main__":
    main()
