#!/usr/bin/env python3
"""Two probed kernels on one clock: where the blocks of kernel B stand against the end of kernel
A's launch of the same number (phase probes, kernels/common.cuh; probe each kernel in its own
file, and A and B must launch equally often, e.g. a layer's router and its gate_up). On the
device (carry .gpu-bin):

    MOERUN_CUDA_DEFINES="-DMOERUN_PROBE -DMOERUN_PROBE_FROM=6000" \\
        moerun bench --like qwen3-30b-a3b --device cuda --prompt 512 --gen 160 2>&1 |
        python3 scripts/probes/align.py gemv_route moe_tiny_gate_up

Per launch: ns from A's last block end (%globaltimer) to B's block starts, each of B's marks
(block start + cycles / GHZ, default 1.98) and B's block ends: min / median / max over B's
blocks. Negative: before A ended.
"""
import os
import re
import statistics
import sys
from collections import defaultdict

LINE = re.compile(r"PROBE (\S+) launch (\d+) block (\d+) (\d+) (\d+) sm (\d+) t0 (\d+) t1 (\d+) "
                  r"marks ((?:-?\d+ ?)+)")


def spread(vals):
    vals = sorted(vals)
    return f"{vals[0]:8.0f} {statistics.median(vals):8.0f} {vals[-1]:8.0f}"


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: align.py KERNEL_A KERNEL_B < probe output")
    a_name, b_name = sys.argv[1], sys.argv[2]
    ghz = float(os.environ.get("GHZ", "1.98"))
    blocks = defaultdict(list)
    for line in sys.stdin:
        m = LINE.search(line)
        if m and m.group(1) in (a_name, b_name):
            marks = [int(v) for v in m.group(9).split()]
            blocks[(m.group(1), int(m.group(2)))].append((int(m.group(7)), int(m.group(8)), marks))
    launches = sorted({n for (k, n) in blocks if k == a_name} & {n for (k, n) in blocks if k == b_name})
    if not launches:
        sys.exit(f"no launch number printed by both {a_name} and {b_name}")
    print("ns from the end of", a_name, "(its last block), over", b_name + "'s blocks: min median max")
    for n in launches:
        ref = max(t1 for (_, t1, _) in blocks[(a_name, n)])
        bs = blocks[(b_name, n)]
        print(f"launch {n}: {len(bs)} blocks")
        print(f"   start   {spread([t0 - ref for (t0, _, _) in bs])}")
        for i in range(len(bs[0][2])):
            vals = [t0 + mk[i] / ghz - ref for (t0, _, mk) in bs if mk[i] >= 0]
            if vals:
                print(f"   mark {i + 1:2d} {spread(vals)}")
        print(f"   end     {spread([t1 - ref for (_, t1, _) in bs])}")


if __name__ == "__main__":
    main()
