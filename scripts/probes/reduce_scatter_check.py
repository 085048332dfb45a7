#!/usr/bin/env python3
"""Emulate common.cuh's warp_reduce_scatter on 32 lanes of float32 and check, bit for bit, that
every total it leaves equals warp_sum's butterfly total of that value (same tree of additions),
and that the writer lanes (scatter_writer) cover every value exactly once (scatter_first).

    .venv/bin/python scripts/probes/reduce_scatter_check.py      (numpy)
"""
import numpy as np


def log2(v):
    return 0 if v <= 1 else 1 + log2(v >> 1)


def reduce_scatter(x, nv, keep):
    xs = [list(x[lane]) for lane in range(32)]
    for k in range(5):
        o = 16 >> k
        if (keep << k) < nv:
            half = nv >> (k + 1)
            new = []
            for lane in range(32):
                up, partner = (lane & o) != 0, lane ^ o
                partner_up = (partner & o) != 0
                mine = list(xs[lane])
                for j in range(half):
                    send = xs[partner][j] if partner_up else xs[partner][j + half]
                    keep_v = xs[lane][j + half] if up else xs[lane][j]
                    mine[j] = np.float32(keep_v + send)
                new.append(mine)
            xs = new
        else:
            xs = [[np.float32(xs[lane][j] + xs[lane ^ o][j]) for j in range(keep)] + xs[lane][keep:]
                  for lane in range(32)]
    return xs


def main():
    rng = np.random.default_rng(11)
    for nv in [1, 2, 4, 8, 16, 32, 64]:
        for keep in [1, 2]:
            if keep > nv or nv // keep > 32:
                continue
            for _ in range(50):
                x = (rng.standard_normal((32, nv)) * 10 ** rng.uniform(-3, 3, (32, nv))).astype(np.float32)
                butterfly = x.copy()
                for o in [16, 8, 4, 2, 1]:
                    butterfly = (butterfly + butterfly[np.arange(32) ^ o]).astype(np.float32)
                xs = reduce_scatter(x, nv, keep)
                nh = log2(nv // keep)
                written = []
                for lane in range(32):
                    first = sum(nv >> (k + 1) for k in range(nh) if lane & (16 >> k))
                    for j in range(keep):
                        assert xs[lane][j].tobytes() == butterfly[lane][first + j].tobytes(), (nv, keep, lane)
                    if lane & ((32 >> nh) - 1) == 0:
                        written += [first + j for j in range(keep)]
                assert sorted(written) == list(range(nv)), (nv, keep, written)
    print("warp_reduce_scatter == warp_sum bit for bit (KEEP 1 and 2, 1-64 values); writers cover each value once")


if __name__ == "__main__":
    main()
