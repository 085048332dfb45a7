#!/usr/bin/env bash
# On the GPU machine (carry .gpu-bin): what each decode kernel adds to a step as the CUDA graph
# really runs it. Each setting names kernels to leave out (MOERUN_CUDA_SKIP, src/skip.rs: outputs
# are wrong, timing only); the step time without them, against the full step, is their share.
#
#   bash scripts/gpu-marginal.sh ROUNDS [moerun bench args...]
#   bash scripts/gpu-marginal.sh 2 --like qwen3-30b-a3b --layers 8 --prompt 512 --gen 128
#
# Prints per setting the median decode step (µs) and the difference from the full step, per
# layer (divided by --layers when given, else 48).
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
rounds=$1
shift
layers=48
for ((i = 1; i <= $#; i++)); do [ "${!i}" = --layers ] && { j=$((i + 1)); layers=${!j}; }; done
bin=${GPU_BIN:-$(mktemp -d)}
[ -x "$bin/moerun" ] || tar -C "$bin" -xJf .gpu-bin/moerun-gpu.tar.xz ||
    { echo "no .gpu-bin (run scripts/gpu-build.sh)"; exit 2; }
settings=${MARGINAL_SETTINGS:-"none add_rms_norm qkv_prologue attention route_topk moe_gate_up moe_down gemv:5120 gemv:2048 gemv:128 argmax add_rms_norm,qkv_prologue,attention,route_topk,gemv:128"}
log=$(mktemp)
for ((r = 1; r <= rounds; r++)); do
    for s in $settings; do
        skip=$s
        [ "$s" = none ] && skip=
        tps=$(MOERUN_CUDA_SKIP=$skip "$bin/moerun" bench "$@" --device cuda --json 2>/dev/null |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tok_per_s"])' 2>/dev/null)
        echo "$s ${tps:-0}" >>"$log"
    done
done
python3 - "$log" "$layers" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    s, t = line.split()
    if float(t) > 0:
        runs[s].append(1e6 / float(t))
layers = int(sys.argv[2])
base = statistics.median(runs["none"]) if runs.get("none") else None
print(f"{'left out':60s} {'step us':>9s} {'saved/layer us':>15s}")
for s, v in runs.items():
    m = statistics.median(v)
    d = f"{(base - m) / layers:15.2f}" if base else ""
    print(f"{s:60s} {m:9.1f} {d}")
PY
