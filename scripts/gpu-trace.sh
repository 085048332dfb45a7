#!/usr/bin/env bash
# On the GPU machine (carry .gpu-bin, built by scripts/gpu-build.sh): the kernel timeline of
# decode steps as the CUDA graph runs them (programmatic dependent launch overlaps included),
# from CUPTI's concurrent-kernel activity (scripts/probes/ktrace.cpp; the machine has no nsys).
#
#   bash scripts/gpu-trace.sh [moerun bench args...]
#   bash scripts/gpu-trace.sh --like qwen3-30b-a3b --prompt 512 --gen 48
#
# Prints the bench's figures without and with the tracer (tracing costs ~10%; the per-kernel
# `inc` figures are what to plan with), then scripts/probes/ktrace_report.py's summary of the
# most common step. KTRACE_RANK=2 summarises the second most common instead (the 8-sequence
# steps of `--concurrency 8`, say), KTRACE_SHOW=N lists N kernels of the step in order,
# KTRACE_UNTRACED=0 skips the untraced run. The raw trace goes to $OUT (or /tmp), xz-packed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=${GPU_BIN:-$(mktemp -d)}
[ -x "$bin/moerun" ] || tar -C "$bin" -xJf .gpu-bin/moerun-gpu.tar.xz ||
    { echo "no .gpu-bin (run scripts/gpu-build.sh)"; exit 2; }
[ $# -gt 0 ] || set -- --like qwen3-30b-a3b --prompt 512 --gen 48
cupti=
for d in /usr/local/cuda/extras/CUPTI /usr/local/cuda; do
    [ -f "$d/include/cupti.h" ] && { cupti=$d; break; }
done
[ -n "$cupti" ] || { echo "no cupti.h under /usr/local/cuda"; exit 2; }
lib=$(ls "$cupti"/lib64/libcupti.so* 2>/dev/null | head -1)
[ -n "$lib" ] || { echo "no libcupti under $cupti"; exit 2; }
built=
for v in 11 10 9; do
    if nvcc -O2 -shared -Xcompiler -fPIC -DKREC=CUpti_ActivityKernel$v -I"$cupti/include" \
        -o "$bin/libktrace.so" scripts/probes/ktrace.cpp -L"$(dirname "$lib")" -lcupti 2>/dev/null; then
        built=$v
        break
    fi
done
[ -n "$built" ] || { echo "ktrace.cpp did not build against $cupti"; exit 2; }
export LD_LIBRARY_PATH=$(dirname "$lib"):$LD_LIBRARY_PATH
echo "ktrace built with CUpti_ActivityKernel$built ($cupti)"
[ "${KTRACE_UNTRACED:-1}" = 0 ] || echo "untraced: $("$bin/moerun" bench "$@" --device cuda 2>&1 | grep -E '^(prefill|decode)' | tr '\n' ' ')"
CUDA_INJECTION64_PATH="$bin/libktrace.so" KTRACE_OUT="$out/ktrace.txt" \
    "$bin/moerun" bench "$@" --device cuda 2>&1 | grep -E '^(prefill|decode)|ktrace' | sed 's/^/traced:   /'
python3 scripts/probes/ktrace_report.py "$out/ktrace.txt" --show "${KTRACE_SHOW:-30}" --rank "${KTRACE_RANK:-1}"
xz -f "$out/ktrace.txt"
