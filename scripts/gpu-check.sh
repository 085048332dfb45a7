#!/usr/bin/env bash
# On the GPU machine: run every moerun-cuda test binary and the ops bench that
# scripts/gpu-build.sh packed into .gpu-bin/, then print a short table: each op's relative error
# against its CPU/f64 reference with pass/fail, and the bench's GB/s and TFLOP/s. Full logs go to
# $OUT (the device tool's output folder; /tmp/gpu-check elsewhere): tests.log, bench.log,
# memcheck.log, nvidia-smi.txt (few files: the device tool brings back at most 8).
#
#   bash scripts/gpu-check.sh            # exit status 0 only if every test passed on the GPU
#
# The CUDA toolkit's libraries (NVRTC, cuBLAS) are found through LD_LIBRARY_PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
rm -f "$out/tests.log" "$out/memcheck.log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$(mktemp -d)
tar -C "$bin" -xzf .gpu-bin/moerun-cuda-gpu.tar.gz || { echo "no .gpu-bin (run scripts/gpu-build.sh, carry .gpu-bin)"; exit 2; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv |
    tee "$out/nvidia-smi.txt"
status=0

echo "== tests"
for t in "$bin"/test-*; do
    name=$(basename "$t")
    start=$(date +%s%N)
    log=$(mktemp)
    if "$t" --nocapture --test-threads=4 >"$log" 2>&1; then verdict=ok; else verdict=FAILED; status=1; fi
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
"$bin/ops_bench" >"$out/bench.log" 2>&1 || { status=1; tail -5 "$out/bench.log"; }

echo "== compute-sanitizer memcheck (ops, matmul)"
if command -v compute-sanitizer >/dev/null; then
    for name in test-ops test-matmul; do
        log=$(mktemp)
        timeout 100 compute-sanitizer --tool memcheck --print-limit 20 "$bin/$name" --test-threads=1 \
            >"$log" 2>&1
        rc=$?
        { echo "##### $name"; cat "$log"; } >>"$out/memcheck.log"
        echo "$name: $(grep -E 'ERROR SUMMARY' "$log" | tail -1) (exit $rc)"
        [ $rc = 0 ] || status=1
    done
else
    echo "compute-sanitizer not on PATH"
fi

echo
echo "== correctness: relative error ||gpu - ref|| / ||ref|| (ref: moerun-cpu or an f64 loop)"
printf '%-44s %10s %8s %s\n' op rel_err tol verdict
grep '^RESULT|' "$out/tests.log" | sort -u |
    awk -F'|' '{ printf "%-44s %10s %8s %s\n", $2, $3, $4, $5 }'
echo
echo "== speed (scripts/gpu-check.sh -> ops_bench)"
sed -n '/^device-to-device copy/,$p' "$out/bench.log"
head -1 "$out/bench.log"
echo "overall: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
