#!/usr/bin/env bash
# Build, on this (GPU-less) machine, everything the GPU machine runs, and pack it for the trip.
#
#   scripts/gpu-build.sh
#
# 1. `cargo build --release` of the moerun binary (a check that the release build holds; the
#    binary itself is not packed: it is larger than what a device call may carry).
# 2. The moerun-cuda test executables (`cargo test --release -p moerun-cuda --no-run`) and the
#    ops_bench example, stripped and packed into .gpu-bin/moerun-cuda-gpu.tar.gz. .gpu-bin/ is
#    git-ignored (.git/info/exclude); scripts/gpu-check.sh travels with the working tree.
#
# Then, on the device machine (the `run` tool, carrying .gpu-bin):
#   bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

exclude=.git/info/exclude
if [ -f "$exclude" ] && ! grep -qxF '/.gpu-bin/' "$exclude"; then
    echo '/.gpu-bin/' >>"$exclude"
fi

cargo build --release -p moerun-cli
cargo build --release -p moerun-cuda --example ops_bench
tests_json=$(cargo test --release -p moerun-cuda --no-run --message-format=json)

rm -rf .gpu-bin
mkdir -p .gpu-bin/stage
# Each test target's executable, named after its target ("lib" for the unit tests).
echo "$tests_json" | jq -r 'select(.reason == "compiler-artifact" and .executable != null
        and .profile.test == true) | "\(.target.name) \(.target.kind[0]) \(.executable)"' |
    while read -r name kind exe; do
        [ "$kind" = lib ] && name=lib
        cp "$exe" ".gpu-bin/stage/test-$name"
    done
cp target/release/examples/ops_bench .gpu-bin/stage/ops_bench
strip --strip-debug .gpu-bin/stage/*
tar -C .gpu-bin/stage -czf .gpu-bin/moerun-cuda-gpu.tar.gz .
rm -rf .gpu-bin/stage
ls -l .gpu-bin
echo "packed: $(du -h .gpu-bin/moerun-cuda-gpu.tar.gz | cut -f1); carry .gpu-bin and run: bash scripts/gpu-check.sh"
