#!/usr/bin/env python3
"""Summarise a ktrace timeline (scripts/probes/ktrace.cpp) of `moerun bench` decode steps.

    python3 scripts/probes/ktrace_report.py trace.txt [--first-kernel embed] [--show N] [--rank R]

A step is the run of kernels from one launch of the first kernel (the embedding) to the next;
the steps whose kernel sequence is the most common one (`--rank 2`: the second most common,
e.g. the 8-sequence steps of `bench --concurrency 8`) are the decode steps of one batch size,
and the later half of them (warm) is summarised. For each kernel of the step, in order:
  dur   its own span (first block in to last block out; with PDL the first block comes in early)
  inc   how far it moved the end of the step: end of this kernel minus the latest end before it
  lead  how long before the previous kernel's end its first block came in (PDL overlap)
Medians over the steps. `inc` sums to the step's time, so it is the cost to plan with.
"""
import argparse
import collections
import statistics


def load(path):
    rows = []
    for line in open(path):
        parts = line.split(None, 6)
        if len(parts) < 7:
            continue
        s, e, gx, gy, gz, bx, name = parts
        rows.append((int(s), int(e), (int(gx), int(gy), int(gz)), int(bx), name.strip()))
    rows.sort()
    return rows


def short(name):
    return name.split("(")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--first-kernel", default="embed")
    ap.add_argument("--show", type=int, default=40, help="kernels of the step to list in order")
    ap.add_argument("--rank", type=int, default=1, help="which step sequence, by how common")
    a = ap.parse_args()
    rows = load(a.trace)
    steps, cur = [], []
    for r in rows:
        if a.first_kernel in short(r[4]) and cur:
            steps.append(cur)
            cur = []
        cur.append(r)
    if cur:
        steps.append(cur)
    # Each step's kernel sequence, by name: the key that groups steps of one batch size.
    keys = [tuple(short(r[4]) for r in s) for s in steps]
    common = collections.Counter(keys).most_common()
    for i, (sq, c) in enumerate(common[:4]):
        first = steps[keys.index(sq)]
        print(f"sequence {i + 1}: {c} steps of {len(sq)} kernels, "
              f"the 3rd on grid {first[min(2, len(sq) - 1)][2]}")
    if not 1 <= a.rank <= len(common):
        raise SystemExit(f"--rank {a.rank}: the trace has {len(common)} step sequences")
    seq, count = common[a.rank - 1]
    decode = [s for s, k in zip(steps, keys) if k == seq]
    warm = decode[len(decode) // 2:]
    print(f"{len(rows)} kernels, {len(steps)} steps, {count} with sequence {a.rank}, of "
          f"{len(seq)} kernels; summarising the last {len(warm)}")
    step_us = [(max(r[1] for r in s) - s[0][0]) / 1e3 for s in warm]
    print(f"step: median {statistics.median(step_us):.1f} us (min {min(step_us):.1f}, "
          f"max {max(step_us):.1f})")
    # What the GPU spends outside the step's kernels: from one step's last end to the next
    # step's first start (input copies, the graph's launch, the host), and the period from start
    # to start, which is what tok/s sees.
    at = {id(s): j for j, s in enumerate(steps)}
    gaps, periods = [], []
    for s in warm:
        j = at[id(s)]
        if j + 1 < len(steps) and keys[j + 1] == seq:
            nxt = steps[j + 1]
            gaps.append((nxt[0][0] - max(r[1] for r in s)) / 1e3)
            periods.append((nxt[0][0] - s[0][0]) / 1e3)
    if gaps:
        print(f"between steps: median {statistics.median(gaps):.1f} us idle (min {min(gaps):.1f}, "
              f"max {max(gaps):.1f}); start to start {statistics.median(periods):.1f} us")
    n = len(seq)
    dur = [[] for _ in range(n)]
    inc = [[] for _ in range(n)]
    lead = [[] for _ in range(n)]
    for s in warm:
        latest = s[0][0]
        for i, r in enumerate(s):
            dur[i].append((r[1] - r[0]) / 1e3)
            inc[i].append((max(r[1], latest) - latest) / 1e3)
            lead[i].append((latest - r[0]) / 1e3 if i else 0.0)
            latest = max(latest, r[1])
    med = statistics.median
    by_name = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for i, name in enumerate(seq):
        b = by_name[name]
        b[0] += 1
        b[1] += med(inc[i])
        b[2] += med(dur[i])
    total = sum(med(v) for v in inc)
    print(f"\nper kernel name (sum over the step of median inc / dur; inc total {total:.1f} us)")
    print(f"{'kernel':48s} {'n':>4s} {'inc us':>9s} {'inc/each':>9s} {'dur/each':>9s} {'share':>6s}")
    for name, (c, i_sum, d_sum) in sorted(by_name.items(), key=lambda x: -x[1][1]):
        print(f"{name[:48]:48s} {c:4d} {i_sum:9.1f} {i_sum / c:9.2f} {d_sum / c:9.2f} "
              f"{100 * i_sum / total:5.1f}%")
    print(f"\nthe step in order (first {a.show}; grid; medians in us)")
    print(f"{'#':>3s} {'kernel':44s} {'grid':>14s} {'dur':>7s} {'inc':>7s} {'lead':>7s}")
    ref = warm[-1]
    for i in range(min(a.show, n)):
        g = ref[i][2]
        print(f"{i:3d} {seq[i][:44]:44s} {g[0]:>4d},{g[1]:>4d},{g[2]:>4d} {med(dur[i]):7.2f} "
              f"{med(inc[i]):7.2f} {med(lead[i]):7.2f}")


if __name__ == "__main__":
    main()
