#!/usr/bin/env bash
# On the GPU machine: run every GPU test binary that scripts/gpu-build.sh packed into .gpu-bin/
# (moerun-cuda's op tests, moerun-engine's conformance_gpu: every fixture against transformers
# and the CPU), the ops bench, and `moerun bench` on the shapes of Qwen3-30B-A3B, Qwen3.5-35B-A3B
# and Gemma-4-26B-A4B (random bf16 weights drawn on the GPU): decode at batch 1 and a 4096-token
# prefill for each, decode at 8/32/128 sequences for the first. Ends with short tables: each check's relative error with pass/fail, the op speeds,
# the model figures against the rooflines. Full logs go to $OUT (the device tool's output
# folder; /tmp/gpu-check elsewhere): tests.log, bench.log, memcheck.log, nvidia-smi.txt,
# model-bench.log, bench-models.json, trace.log and early-loads.log (the device tool brings back
# at most 8 files).
#
#   bash scripts/gpu-check.sh            # tests, op bench, memcheck, model bench
#   bash scripts/gpu-check.sh tests      # tests and memcheck only
#   bash scripts/gpu-check.sh bench      # model bench only
# GPU_CHECK_MEMCHECK=0, GPU_CHECK_OPS_BENCH=0 skip memcheck and the op bench; GPU_CHECK_SHORT=1
# skips the Qwen3.5 and Gemma 4 prefill benches (to fit a short device budget); GPU_CHECK_TRACE=0
# skips the kernel timeline of a decode step (scripts/gpu-trace.sh, ~30 s).
# Exit status 0 only if every test passed on the GPU.
#
# The CUDA toolkit's libraries (NVRTC, cuBLAS) are found through LD_LIBRARY_PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
rm -f "$out/tests.log" "$out/memcheck.log" "$out/trace.log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mode=${1:-all}
bin=$(mktemp -d)
tar -C "$bin" -xJf .gpu-bin/moerun-gpu.tar.xz || { echo "no .gpu-bin (run scripts/gpu-build.sh, carry .gpu-bin)"; exit 2; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv |
    tee "$out/nvidia-smi.txt"
status=0

if [ "$mode" != bench ]; then
echo "== tests"
# One test at a time, so that each binary's time is its own. (Tests in parallel threads used to
# fail or crash: a device opened or dropped in one thread invalidated a graph capture in another.
# Captures and device lifecycles now exclude each other (moerun-cuda device.rs), and
# conformance_gpu's graphs_captured_while_another_thread_opens_and_drops_devices test holds it.)
for t in "$bin"/test-*; do
    name=$(basename "$t")
    start=$(date +%s%N)
    log=$(mktemp)
    if "$t" --nocapture --test-threads=1 >"$log" 2>&1; then verdict=ok; else verdict=FAILED; status=1; fi
    { echo "##### $name"; cat "$log"; } >>"$out/tests.log"
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf '%-24s %-6s %6d ms  %s\n' "$name" "$verdict" "$ms" \
        "$(grep -E '^test result' "$log" | tail -1)"
    # On the GPU machine a skip means CUDA was not found: that is a failure here.
    if grep -q '^skipped: ' "$log" && [ "$name" != test-kernels_compile ]; then
        grep -m1 '^skipped: ' "$log"
        status=1
    fi
    grep -E -A2 'panicked|FAILED' "$log" | head -20
done

echo "== bench"
if [ "${GPU_CHECK_OPS_BENCH:-1}" = 0 ]; then
    echo "skipped (GPU_CHECK_OPS_BENCH=0)"
    : >"$out/bench.log"
else
    "$bin/ops_bench" >"$out/bench.log" 2>&1 || { status=1; tail -5 "$out/bench.log"; }
fi

# Loads meant to go out before a kernel's programmatic wait are there in the SASS ptxas made
# (scripts/probes/early_loads.py: ptxas once hoisted the wait above every GEMV's weight loads).
echo "== loads before the programmatic wait, launch-first order, in the SASS (scripts/probes/early_loads.py --check)"
if [ -x /usr/local/cuda/bin/cuobjdump ]; then
    PATH=/usr/local/cuda/bin:$PATH CUOBJDUMP=/usr/local/cuda/bin/cuobjdump \
        python3 scripts/probes/early_loads.py --check >"$out/early-loads.log" 2>&1 &&
        echo "ok ($(grep -c 'loads before the wait' "$out/early-loads.log") kernels)" ||
        { status=1; tail -3 "$out/early-loads.log"; }
else
    echo "skipped (no /usr/local/cuda/bin/cuobjdump)"
fi

echo "== compute-sanitizer memcheck (ops, matmul, tensor-core prefill attention)"
if [ "${GPU_CHECK_MEMCHECK:-1}" = 0 ]; then
    echo "skipped (GPU_CHECK_MEMCHECK=0)"
elif command -v compute-sanitizer >/dev/null; then
    for run in test-ops test-matmul "test-attention tensor_core"; do
        name=${run%% *}
        filter=${run#"$name"}
        log=$(mktemp)
        # shellcheck disable=SC2086 # the filter is one word or nothing
        timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$bin/$name" $filter \
            --test-threads=1 >"$log" 2>&1
        rc=$?
        { echo "##### $name"; cat "$log"; } >>"$out/memcheck.log"
        echo "$run: $(grep -E 'ERROR SUMMARY' "$log" | tail -1) (exit $rc)"
        [ $rc = 0 ] || status=1
    done
else
    echo "compute-sanitizer not on PATH"
fi

fi

if [ "$mode" != tests ]; then
    echo "== moerun bench (synthetic flagship shapes, bf16, random weights drawn on the GPU)"
    m="$bin/moerun"
    "$m" generate --model models/default --device cuda --max-tokens 32 --temperature 0 \
        "Once upon a time" 2>&1 | tail -3
    runs=$(mktemp -d)
    : >"$out/model-bench.log"
    # bench LABEL ARGS...: one `moerun bench --json` run, its JSON kept under LABEL.
    bench() {
        local label=$1
        shift
        "$m" bench "$@" --device cuda --json >"$runs/$label.json" 2>>"$out/model-bench.log" ||
            { status=1; rm -f "$runs/$label.json"; }
    }
    bench qwen3-decode --like qwen3-30b-a3b --prompt 512 --gen 256
    bench qwen3-prefill --like qwen3-30b-a3b --prompt 4096 --gen 8
    bench qwen3-concurrent --like qwen3-30b-a3b --prompt 512 --gen 64 --concurrency 8,32,128
    bench qwen3.5-decode --like qwen3.5-35b-a3b --prompt 512 --gen 256
    [ "${GPU_CHECK_SHORT:-0}" = 1 ] ||
        bench qwen3.5-prefill --like qwen3.5-35b-a3b --prompt 4096 --gen 8
    bench gemma4-decode --like gemma-4-26b-a4b --prompt 512 --gen 256
    [ "${GPU_CHECK_SHORT:-0}" = 1 ] ||
        bench gemma4-prefill --like gemma-4-26b-a4b --prompt 4096 --gen 8
    # All runs in one file (the device tool brings back at most 8).
    python3 - "$runs" "$out/bench-models.json" <<'PY'
import json, os, sys
runs, dest = sys.argv[1], sys.argv[2]
all_runs = {f[:-5]: json.load(open(os.path.join(runs, f))) for f in sorted(os.listdir(runs))}
json.dump(all_runs, open(dest, "w"), indent=1)
PY
    tail -5 "$out/model-bench.log"
    # Where a batch-1 decode step's time goes, kernel by kernel, overlaps included (a CUPTI
    # timeline; GPU_CHECK_TRACE=0 skips it). Informational: it does not change the status.
    if [ "${GPU_CHECK_TRACE:-1}" = 1 ]; then
        OUT=$(mktemp -d) GPU_BIN="$bin" KTRACE_UNTRACED=0 KTRACE_SHOW=0 \
            bash scripts/gpu-trace.sh --like qwen3-30b-a3b --prompt 512 --gen 48 \
            >"$out/trace.log" 2>&1 || echo "timeline failed (trace.log)"
    fi
fi

if [ "$mode" != bench ]; then
echo
echo "== correctness: relative error ||gpu - ref|| / ||ref|| (ref: moerun-cpu or an f64 loop)"
printf '%-44s %10s %8s %s\n' op rel_err tol verdict
grep '^RESULT|' "$out/tests.log" | sort -u |
    awk -F'|' '{ printf "%-44s %10s %8s %s\n", $2, $3, $4, $5 }'
echo
echo "== speed (scripts/gpu-check.sh -> ops_bench)"
sed -n '/^device-to-device copy/,$p' "$out/bench.log"
head -1 "$out/bench.log"
fi
if [ "$mode" != tests ] && [ -s "$out/trace.log" ]; then
    echo
    echo "== timeline of a Qwen3-30B-A3B decode step at batch 1 (scripts/gpu-trace.sh; traced runs are ~10% slower)"
    sed -n '/^step: /p; /^per kernel name/,/^$/p' "$out/trace.log"
fi
if [ "$mode" != tests ]; then
    echo
    echo "== models (scripts/gpu-check.sh -> moerun bench --like NAME --device cuda)"
    python3 - "$out/bench-models.json" <<'PY' || status=1
import json, sys
try:
    runs = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no bench results ({e})")
print(f"{'model':18} {'figure':30} {'value':>12} {'against':>24}")
for name in ["qwen3", "qwen3.5", "gemma4"]:
    d, p, c = (runs.get(f"{name}-{k}") for k in ["decode", "prefill", "concurrent"])
    if d:
        roof = d["decode_roofline_tok_per_s"]
        print(f"{name:18} {'decode batch 1 (prompt 512)':30} {d['decode_tok_per_s']:>8.1f} t/s "
              f"{d['decode_bandwidth_pct']:>8.1f}% of {roof:.0f} t/s")
    if p:
        tf = 2 * p["params_active"] * p["prompt_tokens"] / p["prefill_seconds"] / 1e12
        print(f"{name:18} {'prefill 4096 tokens':30} {p['prefill_tok_per_s']:>8.0f} t/s "
              f"{tf:>10.0f} TFLOP/s")
    for r in (c or {}).get("concurrent_decode", []):
        print(f"{name:18} {'decode ' + str(r['sequences']) + ' sequences':30} {r['tok_per_s']:>8.0f} t/s")
    if d is None:
        print(f"{name:18} no decode result: see model-bench.log")
any_run = next(iter(runs.values()), None)
if any_run:
    print(f"gpu: {any_run.get('gpu')}; copy bandwidth {any_run['read_bandwidth_bytes_per_s']/1e9:.0f} GB/s")
PY
fi
echo "overall: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
