#!/usr/bin/env bash
# The doorbell path on the GPU machine in one short call (after
# `BUILD=build-cuda scripts/device-gpu.sh prepare` here; carry build-cuda and
# .device): the one-process channel test, then under MPS the torch doorbell
# tests named by DB_TESTS (a pytest -k expression), the three-path table
# (BENCH_ZC_* settings, default qwen3 only) and the SM-share table
# (BENCH_MPS_*); CHAN_AB names a second build whose channel test runs
# beside this one's. Logs in $OUT (the daemons' own logs in daemon-logs.tgz, at
# MOED_TEST_LOG_LEVEL, default debug); a line per stage with its exit status.
# Every stage has a hard limit (SIGINT, then SIGKILL 20 s later).
set -u
cd "$(dirname "$0")/.."
. scripts/device-env.sh
BUILD=${BUILD:-build-cuda}
OUT=${OUT:-$BUILD/gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/ipc/python" MOED_BUILD="$BUILD" MOED_TEST_MPS=1 MOED_TEST_BACKEND=cuda
export MOED_TEST_LOG_LEVEL=${MOED_TEST_LOG_LEVEL:-debug}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
timeout -k 10 60 "$BUILD/tests/gpu_test_chan_gpu" > "$OUT/chan.log" 2>&1
echo "== chan (C, one process) rc=$? at $(el) s: $(tail -1 "$OUT/chan.log")"
# CHAN_AB=<another build dir>: its channel test and this build's, twice each,
# alternating (the doorbell figure and its stamps, A/B of a kernel variant)
for i in ${CHAN_AB:+1 2}; do
    for b in "$BUILD" "$CHAN_AB"; do
        log="$OUT/chan-ab-$(basename "$b")-$i.log"
        timeout -k 10 60 "$b/tests/gpu_test_chan_gpu" > "$log" 2>&1
        echo "== chan A/B $b #$i rc=$?: $(grep -E 'graph of 10|stamps' "$log" | tr '\n' ' ')"
    done
done
. scripts/mps.sh
mps_start
if [ -n "${DB_TESTS:-}" ]; then
    timeout -s INT -k 20 "${DB_TIMEOUT:-120}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_doorbell.py \
        tests/gpu/test_doorbell_model.py -k "$DB_TESTS" > "$OUT/doorbell.log" 2>&1
    echo "== doorbell tests rc=$? at $(el) s: $(tail -1 "$OUT/doorbell.log")"
fi
if [ "${BENCH_ZC:-1}" = 1 ]; then
    BENCH_ZC_MODELS=${BENCH_ZC_MODELS:-qwen3-30b-a3b} timeout -s INT -k 20 "${BENCH_ZC_TIMEOUT:-120}" \
        python3 bench/zero_copy.py > "$OUT/zero_copy.md" 2>&1
    echo "== zero_copy bench rc=$? at $(el) s"
fi
if [ "${BENCH_MPS:-1}" = 1 ]; then
    timeout -s INT -k 20 "${BENCH_MPS_TIMEOUT:-120}" python3 bench/mps_share.py > "$OUT/mps_share.md" 2>&1
    echo "== mps_share bench rc=$? at $(el) s"
fi
mps_stop "$OUT/mps-log"
# the test daemons' own logs (pytest's temporary directories), one archive
find /tmp/pytest-of-"$(id -un)" -name moed.log -mmin -30 2>/dev/null | tar czf "$OUT/daemon-logs.tgz" -T - 2>/dev/null
echo "== end at $(el) s"
