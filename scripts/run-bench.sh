#!/usr/bin/env bash
# `make bench`: the GPU benchmark table (bench/NOTES.md says what it measures).
#   BUILD=build-cuda   build dir with bench/bench_moe (CUDA=1)
set -u
BUILD=${BUILD:-build}
B=$BUILD/bench/bench_moe
[ -x "$B" ] || { echo "$B not built (make BUILD=$BUILD CUDA=1 bench)"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | sed 's/^/# /'
commit=$(git rev-parse --short HEAD 2>/dev/null || cat .device/COMMIT 2>/dev/null || echo unknown)
echo "# $(date -u +%Y-%m-%dT%H:%MZ) commit $commit"
rc=0
timeout "${BENCH_TIMEOUT:-600}" "$B" --preset deepseek-v3 --layers 4 --tokens 1,4,16,64,256 || rc=1
timeout "${BENCH_TIMEOUT:-300}" "$B" --preset qwen3-30b-a3b --layers 24 --tokens 1,4,64,256 || rc=1
exit $rc
