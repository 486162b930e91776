#!/usr/bin/env bash
# Run the GPU tests and the benchmark on a GPU machine that has the NVIDIA
# driver and CUDA 13 but not libuv/cJSON/libsystemd (the lent H200 machines).
#
#   scripts/device-gpu.sh prepare        here: build with CUDA=1 into
#                                         $BUILD (build-cuda), copy the shared
#                                         libraries the binaries need (ldd)
#                                         into .device/lib (git-ignored)
#   scripts/device-gpu.sh test|bench|all  there: run scripts/run-gpu-tests.sh
#                                         and/or scripts/run-bench.sh with
#                                         LD_LIBRARY_PATH=.device/lib; logs to
#                                         $OUT (or $BUILD/gpu-logs)
#   scripts/device-gpu.sh bench-ep        there: scripts/bench-ep.sh (one GPU
#                                         against BENCH_EP_GPUS)
# Carry $BUILD and .device to the GPU machine with the working tree.
# The device tool returns at most 8 files from $OUT: with more, the logs go
# into $OUT/logs.tgz and only the summaries stay beside it (pack_out).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
mode=${1:-all}

if [ "$mode" = prepare ]; then
    set -e
    make BUILD="$BUILD" CUDA=1 all "$BUILD/bench/bench_moe" \
        $(ls tests/gpu/*.c | sed -E "s|tests/gpu/(.*)\.c|$BUILD/tests/gpu_\1|")
    make BUILD="$BUILD" CUDA=1 $(ls tests/tools/*.c 2>/dev/null | sed -E "s|tests/tools/(.*)\.c|$BUILD/tools/\1|")
    rm -rf .device/lib
    mkdir -p .device/lib
    for b in "$BUILD/moed" "$BUILD/moectl" "$BUILD"/tests/gpu_* "$BUILD/bench/bench_moe"; do
        ldd "$b" | awk '/=> \//{print $3}'
    done | sort -u | while read -r lib; do
        case "$(basename "$lib")" in
            libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++*|libgcc_s*) ;;
            libcuda.so*|libnccl*) ;; # driver's own; NCCL is found on the machine (below)
            libcublas*) ;; # bench only; CUDA 13's cuBLAS is on the GPU machine (and ~600 MB)
            *) cp -L "$lib" .device/lib/ ;;
        esac
    done
    # the GPU machine gets the tree without .git: record what was built
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- kernels engine bench || echo +dirty)" \
        > .device/COMMIT
    du -sh "$BUILD" .device
    exit 0
fi

# ---- on the GPU machine ----
. scripts/device-env.sh
LOGDIR=${OUT:-$BUILD/gpu-logs}
export LOGDIR
rc=0
if [ "$mode" = test ] || [ "$mode" = all ]; then
    BUILD="$BUILD" scripts/run-gpu-tests.sh || rc=1
fi
if [ "$mode" = bench-ep ]; then
    BUILD="$BUILD" LOGDIR="$LOGDIR" scripts/bench-ep.sh || rc=1
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
    BUILD="$BUILD" scripts/run-bench.sh 2>&1 | tee "$LOGDIR/bench.txt" || rc=1
fi

# ---- at most 8 files come back from $OUT: the summaries and one archive ----
# (the logs, not the synthetic models that bench-ep caches under $OUT/models,
# nor any file over 8 MB)
pack_out() {
    [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
    [ "$(find "$OUT" -type f | wc -l)" -le 8 ] && return 0
    (cd "$OUT" && find . -path ./models -prune -o -type f -size -8M -print |
         tar czf /tmp/moed-logs.tgz -T -) || return 0
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name test-gpu.txt ! -name bench.txt ! -name bench.csv \
        ! -name bench.png ! -name sweep.csv ! -name sweep.png ! -name ep.md ! -name bench-ep.txt \
        -exec rm -rf {} +
    mv /tmp/moed-logs.tgz "$OUT/logs.tgz"
}
pack_out
exit $rc
