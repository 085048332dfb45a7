#!/usr/bin/env bash
# On the GPU machine (carry .gpu-bin, built by scripts/gpu-build.sh): A/B of environment
# settings on one binary, runs alternating so drift hits both sides alike.
#
#   bash scripts/gpu-ab.sh ROUNDS 'ENV_A' 'ENV_B' [moerun bench args...]
# A setting that starts with `@NAME` runs moerun-NAME instead (`@base`: GPU_BUILD_BASE of
# scripts/gpu-build.sh; others: its GPU_BUILD_ALSO), with the rest of the setting, after a space,
# as its environment: two builds, alternating:
#   bash scripts/gpu-ab.sh 3 '@base' '' --like qwen3-30b-a3b --prompt 512 --gen 256
#   bash scripts/gpu-ab.sh 2 'MOERUN_CUDA_FUSED_ROUTE=0' 'MOERUN_CUDA_FUSED_ROUTE=1' \
#       --like qwen3-30b-a3b --prompt 512 --gen 256
# A setting is split as `env -S` splits its string, so a value with spaces is quoted inside it:
#   bash scripts/gpu-ab.sh 2 '' 'MOERUN_CUDA_DEFINES="-DMOERUN_PROBE -DMOERUN_PROBE_FROM=6000"' ...
#
# Prints one line per run: the setting, decode tok/s and prefill tok/s (from --json).
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
rounds=$1 a=$2 b=$3
shift 3
bin=${GPU_BIN:-$(mktemp -d)}
[ -x "$bin/moerun" ] || tar -C "$bin" -xJf .gpu-bin/moerun-gpu.tar.xz ||
    { echo "no .gpu-bin (run scripts/gpu-build.sh)"; exit 2; }
for ((r = 1; r <= rounds; r++)); do
    for setting in "$a" "$b"; do
        exe=$bin/moerun vars=$setting
        case "$setting" in
        @*)
            name=${setting%% *} vars=${setting#"$name"}
            exe=$bin/moerun-${name#@}
            ;;
        esac
        [ -x "$exe" ] || { echo "no $(basename "$exe") in .gpu-bin (GPU_BUILD_BASE/ALSO)"; exit 2; }
        json=$(env -S "$vars" "$exe" bench "$@" --device cuda --json 2>/dev/null)
        printf '%-40s %s\n' "${setting:-(default)}" "$(python3 -c '
import json, sys
j = json.loads(sys.argv[1])
print("decode %8.1f tok/s  prefill %9.1f tok/s" % (j["decode_tok_per_s"], j["prefill_tok_per_s"]))
' "$json" 2>/dev/null || echo "no result")"
    done
done
