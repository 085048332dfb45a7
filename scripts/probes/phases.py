#!/usr/bin/env python3
"""Summarise the phase probes of a MOERUN_PROBE build (kernels/common.cuh: probe_begin,
probe_mark, probe_end): where each block of a latency-bound kernel spends its time, launch by
launch. On the device (carry .gpu-bin):

    MOERUN_CUDA_DEFINES="-DMOERUN_PROBE -DMOERUN_PROBE_FROM=6000" \\
        moerun bench --like qwen3-30b-a3b --device cuda --prompt 512 --gen 160 2>&1 |
        python3 scripts/probes/phases.py

MOERUN_PROBE_FROM is the first launch of the probed kernel printed (per kernel file; the bench's
warm-up and prefill launch some too), MOERUN_PROBE_LAUNCHES how many (3). Per launch: how many
blocks printed, how far apart they started and ended (ns, %globaltimer), and per mark the min /
median / max cycles since each block's start (clock64; the kernel's comment says what each mark
is). Lines that are not probe lines are ignored.

`--by EXPR` also prints each mark's median per group of blocks, EXPR a Python expression of the
block's x, y, z (e.g. `--by y%8`: the cluster rank of the decode attention's (1, 8, 1) clusters),
to find the block a cluster waits for.
"""
import argparse
import re
import statistics
import sys
from collections import defaultdict

LINE = re.compile(r"PROBE (\S+) launch (\d+) block (\d+) (\d+) (\d+) sm (\d+) t0 (\d+) t1 (\d+) "
                  r"marks ((?:-?\d+ ?)+)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--by", help="group blocks by this expression of x, y, z")
    args = ap.parse_args()
    launches = defaultdict(list)
    for line in sys.stdin:
        m = LINE.search(line)
        if m:
            name, launch = m.group(1), int(m.group(2))
            block = tuple(int(m.group(i)) for i in (3, 4, 5))
            t0, t1 = int(m.group(7)), int(m.group(8))
            marks = [int(v) for v in m.group(9).split()]
            launches[(name, launch)].append((block, int(m.group(6)), t0, t1, marks))
    if not launches:
        sys.exit("no PROBE lines (was the build made with MOERUN_CUDA_DEFINES=-DMOERUN_PROBE, and "
                 "did the kernel run MOERUN_PROBE_FROM times?)")
    for (name, launch), blocks in sorted(launches.items()):
        t0 = min(b[2] for b in blocks)
        starts = [b[2] - t0 for b in blocks]
        ends = [b[3] - t0 for b in blocks]
        print(f"{name} launch {launch}: {len(blocks)} blocks; starts 0..{max(starts)} ns, "
              f"ends {min(ends)}..{max(ends)} ns after the first start")
        for i in range(len(blocks[0][4])):
            vals = sorted(b[4][i] for b in blocks if b[4][i] >= 0)
            if vals:
                print(f"   mark {i + 1}: cycles min {vals[0]:7d}  median "
                      f"{int(statistics.median(vals)):7d}  max {vals[-1]:7d}  ({len(vals)} blocks)")
        if args.by:
            groups = defaultdict(list)
            for b in blocks:
                x, y, z = b[0]
                groups[eval(args.by, {}, {"x": x, "y": y, "z": z})].append(b)
            print(f"   by {args.by}: median cycles of marks 1..{len(blocks[0][4])} (-: not reached)")
            for g in sorted(groups):
                meds = []
                for i in range(len(blocks[0][4])):
                    vals = [b[4][i] for b in groups[g] if b[4][i] >= 0]
                    meds.append(f"{int(statistics.median(vals)):6d}" if vals else "     -")
                print(f"   {str(g):>6s}:" + "".join(meds))


if __name__ == "__main__":
    main()
