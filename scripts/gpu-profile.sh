#!/usr/bin/env bash
# On the GPU machine (carry .gpu-bin, built by scripts/gpu-build.sh): where a Qwen3-30B-A3B-shaped
# model (8 of its layers, random bf16 weights) spends its device time, kernel by kernel.
#
#   bash scripts/gpu-profile.sh [decode|prefill|ops|all]
#
# - decode: ncu over one decode step at batch 1 (no graphs, so every kernel is its own launch),
#   per-kernel device time summed over the profiled launches; divide by 8 for one layer.
# - prefill: ncu over a 4096-token prefill's kernels (fills and copies of the random weights
#   skipped), same summary.
# - ops: MOERUN_CUDA_PROFILE=1 op totals (each backend op bracketed by events and waited for,
#   host work of the op included) for the 4096-token prefill and a batch-1 decode.
# Summaries go to stdout (sorted, µs) and the raw CSVs to $OUT (or /tmp/gpu-profile).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-profile}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mode=${1:-all}
bin=$(mktemp -d)
tar -C "$bin" -xJf .gpu-bin/moerun-gpu.tar.xz || { echo "no .gpu-bin (run scripts/gpu-build.sh)"; exit 2; }
m="$bin/moerun"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)

# summarise CSV (ncu --csv --page raw: one row per launch, the metric a column, its unit in the
# second row): kernel name, total µs, launches, mean, median; sorted by total.
summarise() {
    python3 - "$1" <<'PY'
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
if len(rows) < 3:
    sys.exit("no ncu rows")
head = rows[0]
ki, vi = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(rows[1][vi], 1e-3)
each = collections.defaultdict(list)
for r in rows[2:]:
    each[r[ki].split("(")[0]].append(float(r[vi].replace(",", "")) * scale)
for name, v in sorted(each.items(), key=lambda x: -sum(x[1])):
    v.sort()
    print(f"{sum(v):10.1f} us {len(v):6d} x mean {sum(v) / len(v):8.2f} median {v[len(v) // 2]:8.2f}  {name[:70]}")
print(f"{sum(map(sum, each.values())):10.1f} us total")
PY
}

profile() { # label, ncu args..., -- moerun args...
    local label=$1
    shift
    MOERUN_CUDA_GRAPHS=0 "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --csv --page raw "$@" >"$out/$label.csv" 2>"$out/$label.err" || tail -5 "$out/$label.err"
    echo "== $label (ncu)"
    summarise "$out/$label.csv"
}

if [ "$mode" = decode ] || [ "$mode" = all ]; then
    # Weight fills skipped; a 512-token prefill then 4 decode steps: the decode kernels
    # (gemv_*, moe_tiny_*, attn_split_*) are decode's own, the shared ones read by their median.
    profile decode -k 'regex:^(?!fill_random|copy|read_sum)' --launch-count 1500 \
        "$m" bench --like qwen3-30b-a3b --layers 8 --device cuda --prompt 512 --gen 4
fi
if [ "$mode" = prefill ] || [ "$mode" = all ]; then
    profile prefill -k 'regex:^(?!fill_random|copy|read_sum)' --launch-count 400 \
        "$m" bench --like qwen3-30b-a3b --layers 8 --device cuda --prompt 4096 --gen 1
fi
if [ "$mode" = ops ] || [ "$mode" = all ]; then
    echo "== ops, prefill 4096 (MOERUN_CUDA_PROFILE=1)"
    MOERUN_CUDA_PROFILE=1 "$m" bench --like qwen3-30b-a3b --layers 8 --device cuda --prompt 4096 --gen 2 2>&1 | tail -40
fi
