#!/usr/bin/env bash
# One device call for the NCCL group and the EP daemon tests (issue 14):
# GPU_TESTS_ONLY=nccl of scripts/run-gpu-tests.sh (two ranks on the one GPU
# under MPS) and tests/gpu/test_ep_daemon.py; logs under $OUT (or
# build-cuda/gpu-logs). Carry build-cuda and .device.
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-build-cuda/gpu-logs}
mkdir -p "$LOG"
# NCCL_STACKS_AFTER=S: S seconds in, every moed's host threads' stacks
# (cuda-gdb attaches; the machine has no gdb) to $LOG/stacks-PID.txt
if [ -n "${NCCL_STACKS_AFTER:-}" ]; then
    (sleep "$NCCL_STACKS_AFTER"
     for p in $(pgrep -x moed); do
         timeout 60 cuda-gdb -batch -p "$p" -ex "info threads" -ex "thread apply all bt" \
             > "$LOG/stacks-$p.txt" 2>&1
     done) &
fi
BUILD=build-cuda GPU_TESTS_ONLY=nccl GPU_TEST_PY_TIMEOUT=${NCCL_TEST_TIMEOUT:-240} OUT="$LOG/nccl" \
    scripts/device-gpu.sh test > "$LOG/nccl.txt" 2>&1
rc=$?
tail -4 "$LOG/nccl.txt"
grep -E '::.*(PASSED|FAILED|SKIPPED|ERROR)|rank 0 exited' "$LOG/nccl/pytest-nccl.log"
. scripts/device-env.sh
PYTHONPATH="$PWD/ipc/python" MOED_BUILD=build-cuda timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_ep_daemon.py > "$LOG/ep-daemon.txt" 2>&1 || rc=1
tail -1 "$LOG/ep-daemon.txt"
exit $rc
