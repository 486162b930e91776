#!/usr/bin/env bash
# `make bench`: the GPU benchmark table (bench/NOTES.md says what it measures).
#   BUILD=build-cuda   build dir with bench/bench_moe (CUDA=1)
#   LOGDIR=dir         bench.csv, e2e log and bench.png go there (default $BUILD/bench-logs)
#   BENCH_TABLE=0      skip the kernel table (bench_moe on both shapes, bench.csv)
#   BENCH_E2E=0        skip the daemon end-to-end step
#   BENCH_SWEEP=0      skip the latency sweep over T = 1..512 (sweep.csv, sweep.png)
#   BENCH_ZC=0         skip the three client paths (inline, descriptor, doorbell) under MPS
#   BENCH_ZC_*         bench/zero_copy.py's own settings (models, T list, iterations)
#   BENCH_ZC_PEER=0    skip the dedicated-GPU run of it (moed on GPU 0, the client on
#                      GPU 1: only with two GPUs and peer access; zero_copy_peer.md)
#   BENCH_MPS=0        skip bench/mps_share.py (moed's SM share under MPS); BENCH_MPS_* its settings
#   BENCH_DS_TOKENS, BENCH_QWEN_TOKENS, BENCH_SWEEP_TOKENS, BENCH_SWEEP_ITERS: the T lists
#   BENCH_ENERGY_MS=300 per T, ms of batches back to back under the board's
#                      energy counter (NVML): J/GB, W, SM clock (0: none)
set -u
. "$(dirname "$0")/mps.sh"
. "$(dirname "$0")/moed-start.sh"
BUILD=${BUILD:-build}
LOGDIR=${LOGDIR:-$BUILD/bench-logs}
mkdir -p "$LOGDIR"
B=$BUILD/bench/bench_moe
[ -x "$B" ] || { echo "$B not built (make BUILD=$BUILD CUDA=1 bench)"; exit 1; }
# cuBLAS (baseline b): CUDA's lib64 (rpath), else the pip wheel's copy
if ! ldd "$B" | grep -q 'libcublas.so.*=> /'; then
    nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
    cub=$( [ -n "$nv" ] && find "$nv" -name 'libcublas.so.*' 2>/dev/null | head -1)
    [ -n "$cub" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(dirname "$cub")"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | sed 's/^/# /'
# .device/COMMIT (written by scripts/device-gpu.sh prepare) names what the binaries were built
# from, $BUILD/COMMIT where a build carries its own (a variant's full build); a .git on the GPU
# machine may be a stale copy
commit=$(cat "$BUILD/COMMIT" .device/COMMIT 2>/dev/null | head -1)
[ -n "$commit" ] || commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "# $(date -u +%Y-%m-%dT%H:%MZ) commit $commit"
export BENCH_CSV="$LOGDIR/bench.csv"
rm -f "$BENCH_CSV"
rc=0
if [ "${BENCH_TABLE:-1}" = 1 ]; then
    timeout "${BENCH_TIMEOUT:-600}" "$B" --preset deepseek-v3 --layers 4 \
        --tokens "${BENCH_DS_TOKENS:-1,4,8,16,32,64,128,256}" || rc=1
    timeout "${BENCH_TIMEOUT:-300}" "$B" --preset qwen3-30b-a3b --layers 24 \
        --tokens "${BENCH_QWEN_TOKENS:-1,4,8,16,32,64,128,256}" || rc=1
fi

# Latency against T from 1 to 512 (kernel and end to end, no baselines), so
# that no batch size falls in a hole between the table's points:
# $LOGDIR/sweep.csv and sweep.png
if [ "${BENCH_SWEEP:-1}" = 1 ]; then
    SW=${BENCH_SWEEP_TOKENS:-1,2,3,4,6,8,12,16,24,32,48,64,96,128,192,256,384,512}
    rm -f "$LOGDIR/sweep.csv"
    for m in "deepseek-v3 --layers 4" "qwen3-30b-a3b --layers 24"; do
        # shellcheck disable=SC2086
        BENCH_CSV="$LOGDIR/sweep.csv" timeout "${BENCH_TIMEOUT:-300}" "$B" --preset $m \
            --tokens "$SW" --no-baselines --iters "${BENCH_SWEEP_ITERS:-50}" |
            sed 's/^/# sweep: /'
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    done
fi

# End to end through the socket (inline payloads), qwen3-30b-a3b shape, T=64:
# a synthetic 1-layer checkpoint served by moed with backend cuda; moectl
# bench with one connection, one request in flight.
if [ "${BENCH_E2E:-1}" = 1 ] && [ -x "$BUILD/moed" ] && [ -x "$BUILD/moectl" ]; then
    tmp=$(mktemp -d)
    cat > "$tmp/moed.json" <<JSON
{"server": {"socket": "$tmp/moed.sock"}, "status": {"port": 0},
 "model": {"path": "synthetic:qwen3-30b-a3b:layers=1:seed=3", "synthetic_dir": "$tmp/models"},
 "engine": {"backend": "cuda", "max_tokens": 64, "batch_deadline_ms": 5000},
 "log": {"level": "info"}}
JSON
    t0=$(date +%s)
    ok=0
    moed_start "$tmp/moed.json" "$LOGDIR/e2e-moed.log" "${BENCH_E2E_START_S:-120}" && ok=1
    pid=$MOED_PID
    echo "# e2e: moed ready=$ok after $(( $(date +%s) - t0 )) s (synthetic qwen3-30b-a3b, 1 layer, backend cuda)"
    if [ $ok = 1 ]; then
        timeout 60 "$BUILD/moectl" bench --socket "$tmp/moed.sock" --tokens 64 --connections 1 \
            --inflight 1 --duration 3 2>&1 | tee "$LOGDIR/e2e-moectl.txt" | sed 's/^/# e2e: /'
        timeout 60 "$BUILD/moectl" bench --socket "$tmp/moed.sock" --tokens 1 --connections 1 \
            --inflight 1 --duration 2 2>&1 | tee -a "$LOGDIR/e2e-moectl.txt" | sed 's/^/# e2e T=1: /'
    else
        tail -5 "$LOGDIR/e2e-moed.log" | sed 's/^/# e2e moed: /'
    fi
    kill -TERM $pid 2>/dev/null
    wait $pid 2>/dev/null
    rm -rf "$tmp"
fi

# The three client paths side by side (bench/zero_copy.py: inline socket,
# REGISTER + FORWARD_DESC, doorbell in a CUDA graph; qwen3-30b-a3b and
# deepseek-v3 shapes, T = 1..256), a torch client on moed's GPU under MPS
# (started and stopped here); the markdown table goes to $LOGDIR/zero_copy.md
if [ "${BENCH_ZC:-1}" = 1 ] && [ -x "$BUILD/moed" ] && command -v nvidia-cuda-mps-control >/dev/null &&
        python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    mps_start
    PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" \
        timeout "${BENCH_ZC_TIMEOUT:-900}" python3 bench/zero_copy.py 2>&1 | tee "$LOGDIR/zero_copy.md"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    # moed's kernel time and the engine's step time against moed's SM share
    # (bench/mps_share.py; BENCH_MPS=0 skips it)
    if [ "${BENCH_MPS:-1}" = 1 ]; then
        PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" \
            timeout "${BENCH_MPS_TIMEOUT:-600}" python3 bench/mps_share.py 2>&1 | tee "$LOGDIR/mps_share.md"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    fi
    mps_stop
fi
# The dedicated expert GPU (docs/ZERO_COPY.md "Mode 2"): the same paths with the
# client on GPU 1 and moed on GPU 0 over peer access, no MPS (issue 14's target:
# the doorbell <= 8 us over the kernel); two GPUs only
if [ "${BENCH_ZC_PEER:-1}" = 1 ] && [ -x "$BUILD/moed" ] &&
        python3 -c 'import torch; assert torch.cuda.device_count() >= 2' 2>/dev/null; then
    BENCH_ZC_CLIENT_GPU=1 BENCH_ZC_MODELS=${BENCH_ZC_MODELS:-deepseek-v3} \
        PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" \
        timeout "${BENCH_ZC_TIMEOUT:-900}" python3 bench/zero_copy.py 2>&1 | tee "$LOGDIR/zero_copy_peer.md"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi

if python3 -c 'import matplotlib' 2>/dev/null; then
    [ -s "$BENCH_CSV" ] && { python3 scripts/plot_bench.py "$BENCH_CSV" "$LOGDIR/bench.png" || true; }
    [ -s "$LOGDIR/sweep.csv" ] &&
        { python3 scripts/plot_bench.py "$LOGDIR/sweep.csv" "$LOGDIR/sweep.png" || true; }
fi
exit $rc
