#!/usr/bin/env bash
# Build, on this (GPU-less) machine, everything the GPU machine runs, and pack it for the trip.
#
#   scripts/gpu-build.sh
#
# 1. The moerun binary without the embedded default model (MOERUN_NO_EMBEDDED_MODEL=1: the
#    working tree plus what is carried must stay under the device tool's 64 MiB; the default
#    model travels anyway as models/default/), stripped.
# 2. The GPU test executables: every moerun-cuda test target (`cargo test --release -p
#    moerun-cuda --no-run`), moerun-model's unit tests (the backend ops, CPU vs GPU) and
#    moerun-engine's conformance_gpu, plus the ops_bench example, stripped.
# Optional, for A/Bs of several builds in one device run (scripts/gpu-ab.sh's `@NAME`):
#   GPU_BUILD_BASE=<git revision>   also packs that revision's moerun as moerun-base (built from a
#                                   git worktree; the working tree and its target stay as they are)
#   GPU_BUILD_ALSO="NAME=<git revision> ..."  also packs each revision's moerun as moerun-NAME
#                                   (scripts/gpu-ab.sh's `@NAME`): several branches in one device run
#   GPU_BUILD_TESTS="conformance_gpu graph ..."   packs only these test executables, and ops_bench
#                                   only if listed (the device tool carries at most ~5.4 MB beside
#                                   the ~61.6 MB tree)
# All packed into .gpu-bin/moerun-gpu.tar.xz. .gpu-bin/ is git-ignored (.git/info/exclude);
# scripts/gpu-check.sh travels with the working tree. The normal build (with the embedded model)
# is restored at the end.
#
# Then, on the device machine (the `run` tool, carrying .gpu-bin):
#   bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

exclude=.git/info/exclude
if [ -d .git ] && ! grep -qxsF '/.gpu-bin/' "$exclude"; then
    mkdir -p .git/info
    echo '/.gpu-bin/' >>"$exclude"
fi

rm -rf .gpu-bin
mkdir -p .gpu-bin/stage
MOERUN_NO_EMBEDDED_MODEL=1 cargo build --release -p moerun-cli
cp target/release/moerun .gpu-bin/stage/moerun
cargo build --release -p moerun-cuda --example ops_bench
cp target/release/examples/ops_bench .gpu-bin/stage/ops_bench
tests_json=$( (cargo test --release -p moerun-cuda --no-run --message-format=json &&
    cargo test --release -p moerun-model --lib --no-run --message-format=json &&
    cargo test --release -p moerun-engine --test conformance_gpu --no-run --message-format=json))
# Each test target's executable, named after its target (the crate's name for unit tests).
echo "$tests_json" | jq -r 'select(.reason == "compiler-artifact" and .executable != null
        and .profile.test == true) | "\(.target.name) \(.target.kind[0]) \(.executable)"' |
    while read -r name kind exe; do
        cp "$exe" ".gpu-bin/stage/test-$name"
    done
if [ -n "${GPU_BUILD_TESTS:-}" ]; then
    for f in .gpu-bin/stage/test-*; do
        case " $GPU_BUILD_TESTS " in *" ${f#.gpu-bin/stage/test-} "*) ;; *) rm -f "$f" ;; esac
    done
    case " $GPU_BUILD_TESTS " in *" ops_bench "*) ;; *) rm -f .gpu-bin/stage/ops_bench ;; esac
fi
# pack_revision NAME REV: REV's moerun as moerun-NAME, built from a git worktree (the working
# tree stays as it is) into a target directory of its own, kept between runs (target/revisions).
# Not the working tree's: cargo names a workspace crate's artifacts the same from any path and
# judges them fresh by mtime, so a revision built there would be taken for the working tree's
# newer-looking build of the same crate.
pack_revision() {
    local name=$1 rev=$2 tmp root=$PWD
    tmp=$(mktemp -d)
    git worktree add --detach "$tmp/tree" "$rev" >/dev/null
    (cd "$tmp/tree" && MOERUN_NO_EMBEDDED_MODEL=1 CARGO_TARGET_DIR="$root/target/revisions" \
        cargo build --release -p moerun-cli)
    cp target/revisions/release/moerun ".gpu-bin/stage/moerun-$name"
    git worktree remove --force "$tmp/tree"
    rm -rf "$tmp"
}
if [ -n "${GPU_BUILD_BASE:-}" ]; then
    pack_revision base "$GPU_BUILD_BASE"
fi
for also in ${GPU_BUILD_ALSO:-}; do
    pack_revision "${also%%=*}" "${also#*=}"
done
strip .gpu-bin/stage/*
# xz -9e: the working tree (~61 MB tracked) plus what is carried must stay under 64 MiB.
XZ_OPT=-9e tar -C .gpu-bin/stage -cJf .gpu-bin/moerun-gpu.tar.xz .
rm -rf .gpu-bin/stage
# Put back the everyday binary with the default model embedded.
cargo build --release -p moerun-cli
ls -l .gpu-bin
echo "packed: $(du -h .gpu-bin/moerun-gpu.tar.xz | cut -f1); carry .gpu-bin and run: bash scripts/gpu-check.sh"
