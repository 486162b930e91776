#!/usr/bin/env bash
# GPU tests (`make test-gpu`, or scripts/device-gpu.sh on the GPU machine).
# Each step runs in its own process with a timeout; the last line is
# "gpu tests: N passed, N failed" (the C test's own checks + one per step).
#   BUILD=build-cuda  build dir with moed, moectl and tests/gpu_* (CUDA=1)
#   LOGDIR=dir        where the logs go (default $BUILD/gpu-logs)
#   GPU_TESTS_QUICK=1 skip the deepseek-v3 shape (needs ~16 GB host memory)
#   GPU_TESTS_ONLY=zero-copy|doorbell|nccl  run step 6, 7 or 8 alone (under MPS;
#                 doorbell-model, doorbell-memcheck: one file of 7);
#                 base: steps 1-5 only (kernel: 1-2, daemon: 3-5); mps: 6 to
#                 8 only (each part fits one device call of 10 minutes, the
#                 whole may not)
set -u
. "$(dirname "$0")/mps.sh"
. "$(dirname "$0")/moed-start.sh"
BUILD=${BUILD:-build}
LOGDIR=${LOGDIR:-$BUILD/gpu-logs}
mkdir -p "$LOGDIR"
passed=0
failed=0
rows=()

step() { # name status detail
    rows+=("$(printf '%-34s %-5s %s' "$1" "$2" "$3")")
    if [ "$2" = PASS ]; then passed=$((passed + 1)); elif [ "$2" = FAIL ]; then failed=$((failed + 1)); fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    > "$LOGDIR/nvidia-smi.txt" 2>&1 || true

ONLY=${GPU_TESTS_ONLY:-}
case "$ONLY" in
    ""|base|kernel|daemon|mps|zero-copy|doorbell|doorbell-model|doorbell-memcheck|nccl) ;;
    *) echo "GPU_TESTS_ONLY=$ONLY: not one of base, kernel, daemon, mps, zero-copy, doorbell," \
            "doorbell-model, doorbell-memcheck, nccl" >&2
       exit 2 ;;
esac
part() { [ -z "$ONLY" ] || [ "$ONLY" = base ] || [ "$ONLY" = "$1" ]; } # steps 1-5: kernel, daemon
if part kernel; then
# 1. correctness, determinism, stream, idle exit, cycles, deadline
T=$BUILD/tests/gpu_test_moe_gpu
args=()
[ "${GPU_TESTS_QUICK:-0}" = 1 ] && args+=(--no-deepseek)
timeout "${GPU_TEST_TIMEOUT:-1500}" "$T" "${args[@]}" > "$LOGDIR/gpu_test_moe_gpu.log" 2>&1
rc=$?
grep -E '^(PASS|FAIL)|^      cuda:' "$LOGDIR/gpu_test_moe_gpu.log"
line=$(grep -E '^gpu tests: ' "$LOGDIR/gpu_test_moe_gpu.log" | tail -1)
if [ -n "$line" ]; then
    p=$(echo "$line" | sed -E 's/gpu tests: ([0-9]+) passed.*/\1/')
    f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    step "gpu_test_moe_gpu (checks)" "$([ "$f" = 0 ] && [ $rc = 0 ] && echo PASS || echo FAIL)" \
        "$p passed, $f failed, exit $rc"
else
    tail -20 "$LOGDIR/gpu_test_moe_gpu.log"
    step "gpu_test_moe_gpu (checks)" FAIL "no summary, exit $rc"
fi

# A C GPU test of its own (when built): name, binary, timeout (s), step text.
c_test() {
    [ -x "$2" ] || return 0
    timeout "$3" "$2" > "$LOGDIR/$1.log" 2>&1
    local rc=$? line f
    grep -E '^(PASS|FAIL)' "$LOGDIR/$1.log"
    line=$(grep -E '^gpu tests: ' "$LOGDIR/$1.log" | tail -1)
    f=$(echo "$line" | sed -nE 's/.* ([0-9]+) failed.*/\1/p')
    step "$4" "$([ "${f:-1}" = 0 ] && [ $rc = 0 ] && echo PASS || echo FAIL)" \
        "${line:-no summary}, exit $rc"
}

# 1b. doorbell channels in one process (the client kernel from the embedded fatbin)
c_test gpu_test_chan_gpu "$BUILD/tests/gpu_test_chan_gpu" "${GPU_TEST_TIMEOUT:-600}" \
    "gpu_test_chan_gpu (doorbell checks)"

# 1c. expert parallelism on this GPU: ROWS + COMBINE = the plain batch bit for
# bit, devices with partial placements (tests/gpu/test_ep_gpu.c)
c_test gpu_test_ep_gpu "$BUILD/tests/gpu_test_ep_gpu" "${GPU_TEST_TIMEOUT:-900}" \
    "gpu_test_ep_gpu (expert parallelism)"

# 2. compute-sanitizer memcheck and racecheck on the tiny cases
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
    if [ -x "$CS" ]; then
        timeout "${SAN_TIMEOUT:-900}" "$CS" --tool "$tool" --error-exitcode 9 "$T" --quick \
            > "$LOGDIR/sanitizer-$tool.log" 2>&1
        rc=$?
        summ=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGDIR/sanitizer-$tool.log" | tail -1)
        ok=$([ $rc = 0 ] && grep -q 'gpu tests: [0-9]* passed, 0 failed' "$LOGDIR/sanitizer-$tool.log" \
             && echo PASS || echo FAIL)
        step "compute-sanitizer $tool (tiny)" "$ok" "exit $rc; ${summ:-no summary}"
    else
        step "compute-sanitizer $tool (tiny)" SKIP "compute-sanitizer not found"
    fi
done
fi # kernel

if part daemon; then

# 3. the daemon with backend cuda: start-up self-check against the CPU reference
if [ -x "$BUILD/moed" ]; then
    tmp=$(mktemp -d)
    cat > "$tmp/moed.json" <<JSON
{"server": {"socket": "$tmp/moed.sock"}, "status": {"port": 0},
 "model": {"path": "synthetic:tiny:layers=2:seed=7", "synthetic_dir": "$tmp/models"},
 "engine": {"backend": "cuda", "max_tokens": 64, "batch_deadline_ms": 2000},
 "log": {"level": "info"}}
JSON
    ok=FAIL
    moed_start "$tmp/moed.json" "$LOGDIR/moed-cuda.log" 60 && ok=PASS
    pid=$MOED_PID
    detail=$(grep -oE 'self-check passed[^"]*' "$LOGDIR/moed-cuda.log" | head -1)
    [ -n "$detail" ] || { ok=FAIL; detail="no self-check line (see moed-cuda.log)"; }
    if [ $ok = PASS ] && [ -x "$BUILD/moectl" ]; then
        "$BUILD/moectl" status --socket "$tmp/moed.sock" > "$LOGDIR/moectl-status.txt" 2>&1 || true
    fi
    kill -TERM $pid 2>/dev/null
    wait $pid
    rc=$?
    [ $rc = 0 ] || { ok=FAIL; detail="$detail; exit $rc after SIGTERM"; }
    step "moed backend=cuda start + self-check" $ok "$detail"
    rm -rf "$tmp"
else
    step "moed backend=cuda start + self-check" SKIP "$BUILD/moed not built"
fi

# 4. the daemon socket suite with backend cuda
if grep -q MOED_TEST_BACKEND tests/py/daemon_util.py 2>/dev/null; then
    # the client package from the tree (the GPU machine cannot pip-install)
    PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" MOED_TEST_BACKEND=cuda \
        timeout 1500 python3 -m pytest -q -p no:cacheprovider tests/py \
        --ignore=tests/py/test_e2e_transformers.py > "$LOGDIR/pytest-cuda.log" 2>&1
    rc=$?
    # the failures' one-line summaries, in the step's output (the log may not come back)
    grep -E '^(FAILED|ERROR) ' "$LOGDIR/pytest-cuda.log" | cut -c1-300 | sed 's/^/    /'
    step "pytest tests/py (MOED_TEST_BACKEND=cuda)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
        "$(tail -1 "$LOGDIR/pytest-cuda.log")"
else
    step "pytest tests/py (MOED_TEST_BACKEND=cuda)" SKIP "tests/py/daemon_util.py has no MOED_TEST_BACKEND"
fi

# 4b. expert parallelism through the socket: engine.gpus [0, 0] with a skewed
# placement map = engine.gpus [0] bit for bit (numpy only, no MPS)
if python3 -c 'import numpy, pytest' 2>/dev/null; then
    PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" \
        timeout 900 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_ep_daemon.py \
        > "$LOGDIR/pytest-ep-daemon.log" 2>&1
    rc=$?
    grep -E '(PASSED|FAILED|SKIPPED|ERROR)' "$LOGDIR/pytest-ep-daemon.log" | grep '::' | sed 's/^/    /'
    step "expert parallelism daemon (gpus [0, 0])" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
        "$(tail -1 "$LOGDIR/pytest-ep-daemon.log")"
else
    step "expert parallelism daemon (gpus [0, 0])" SKIP "numpy or pytest missing"
fi

# 4c. the dedicated expert GPU: moed on GPU 0, a torch client on GPU 1, peer
# access, no MPS (tests/gpu/test_zero_copy_peer.py: descriptor and doorbell
# graph = inline bit for bit, the doorbell's added latency printed); SKIP with
# one GPU or without peer access
if python3 -c 'import torch, numpy, pytest; assert torch.cuda.device_count() >= 2' 2>/dev/null; then
    PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" \
        timeout 600 python3 -m pytest -v -s -rs -p no:cacheprovider tests/gpu/test_zero_copy_peer.py \
        > "$LOGDIR/pytest-peer.log" 2>&1
    rc=$?
    grep -E '(PASSED|FAILED|SKIPPED|ERROR)|peer doorbell' "$LOGDIR/pytest-peer.log" | sed 's/^/    /'
    if grep -qE '^SKIPPED|[0-9]+ skipped in' "$LOGDIR/pytest-peer.log" &&
            ! grep -q ' passed' "$LOGDIR/pytest-peer.log"; then
        step "peer GPU client (GPU 1 -> moed GPU 0)" SKIP "$(tail -1 "$LOGDIR/pytest-peer.log")"
    else
        step "peer GPU client (GPU 1 -> moed GPU 0)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
            "$(tail -1 "$LOGDIR/pytest-peer.log")"
    fi
else
    step "peer GPU client (GPU 1 -> moed GPU 0)" SKIP "fewer than 2 GPUs, or torch/numpy/pytest missing"
fi

# 4d. the NCCL group on two GPUs of this host (rank r on GPU r, no MPS,
# tests/gpu/test_nccl_daemon.py with MOED_TEST_NCCL_GPUS=2: one daemon bit for
# bit, the environment bootstrap, a stopped peer, a group that never forms,
# SIGKILL of either rank); SKIP with one GPU
if python3 -c 'import numpy, pytest, torch; assert torch.cuda.device_count() >= 2' 2>/dev/null; then
    PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" MOED_TEST_NCCL_GPUS=2 \
        timeout 900 python3 -m pytest -v -s -rs -p no:cacheprovider tests/gpu/test_nccl_daemon.py \
        > "$LOGDIR/pytest-nccl-2gpu.log" 2>&1
    rc=$?
    grep -E '::.*(PASSED|FAILED|SKIPPED|ERROR)|exited' "$LOGDIR/pytest-nccl-2gpu.log" | sed 's/^/    /'
    step "NCCL group on GPUs 0 and 1" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
        "$(tail -1 "$LOGDIR/pytest-nccl-2gpu.log")"
else
    step "NCCL group on GPUs 0 and 1" SKIP "fewer than 2 GPUs, or torch/numpy/pytest missing"
fi

# 5. a real transformers model (Qwen3-MoE, DeepSeek-V3) on the GPU with its MoE
# layers served by moed on the CUDA backend (inline path, idle exit 20 ms)
if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
    PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" MOED_TEST_BACKEND=cuda \
        timeout 900 python3 -m pytest -q -s -p no:cacheprovider -W ignore::FutureWarning \
        tests/py/test_e2e_transformers.py > "$LOGDIR/e2e-transformers-cuda.log" 2>&1
    rc=$?
    grep -E 'rel-L2' "$LOGDIR/e2e-transformers-cuda.log"
    step "e2e transformers (cuda)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
        "$(tail -1 "$LOGDIR/e2e-transformers-cuda.log")"
else
    step "e2e transformers (cuda)" SKIP "torch with CUDA or transformers not importable"
fi
fi # daemon

# 6. zero-copy: registered buffers + FORWARD by descriptor, and 7. the GPU
#    doorbell in CUDA graphs (tests/gpu/test_doorbell.py: graph = inline bit
#    for bit, 10,000 replays, 100 killed clients, bad descriptors;
#    test_doorbell_model.py: a transformers model served through the plugins'
#    doorbell path; test_doorbell_memcheck.py, last: the bad descriptors
#    under memcheck), torch clients on the daemon's GPU under MPS (started
#    here, stopped after); and 8. an NCCL group of two daemons on the one GPU
#    (tests/gpu/test_nccl_daemon.py, numpy only: ranks = one daemon bit for
#    bit, a peer that stops answering, a group that never forms)
if [ "$ONLY" = base ] || [ "$ONLY" = kernel ] || [ "$ONLY" = daemon ]; then
    : # steps 1-5 only
elif python3 -c 'import torch, numpy, pytest; assert torch.cuda.is_available()' 2>/dev/null &&
        command -v nvidia-cuda-mps-control >/dev/null; then
    mps_start
    # each file in its own pytest process with its own limit (GPU_TEST_PY_TIMEOUT, s),
    # verbose (a test that hangs shows where); SIGINT first, so that the fixtures
    # stop their daemons, and no moed of a file outlives it
    export PYTHONPATH="$PWD/ipc/python${PYTHONPATH:+:$PYTHONPATH}" MOED_BUILD="$BUILD" MOED_TEST_MPS=1 LOGDIR
    for t in zero-copy:test_zero_copy.py doorbell:test_doorbell.py doorbell-model:test_doorbell_model.py \
             doorbell-memcheck:test_doorbell_memcheck.py nccl:test_nccl_daemon.py; do
        name=${t%%:*}
        [ -z "$ONLY" ] || [ "$ONLY" = mps ] || [ "$ONLY" = "${name%%-*}" ] || [ "$ONLY" = "$name" ] ||
            continue
        timeout -s INT -k 20 "${GPU_TEST_PY_TIMEOUT:-600}" python3 -m pytest -v -s -rs -p no:cacheprovider \
            -W ignore::FutureWarning "tests/gpu/${t#*:}" > "$LOGDIR/pytest-$name.log" 2>&1
        rc=$?
        pkill -x moed 2>/dev/null && sleep 1 # the daemon by its name (a pattern would match this shell)
        grep -E '(PASSED|FAILED|SKIPPED|ERROR)' "$LOGDIR/pytest-$name.log" | grep '::' | sed 's/^/    /'
        step "$name under MPS (torch)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
            "rc $rc: $(tail -1 "$LOGDIR/pytest-$name.log")"
    done
    mps_stop "$LOGDIR/mps-log"
    # the test daemons' own logs (in pytest's temporary directories)
    find /tmp/pytest-of-"$(id -un)" -name moed.log -mmin -120 2>/dev/null |
        tar czf "$LOGDIR/daemon-logs.tgz" -T - 2>/dev/null
else
    step "zero-copy, doorbell under MPS (torch)" SKIP "torch with CUDA, numpy, pytest or MPS missing"
fi

echo
echo "step                               result detail"
for r in "${rows[@]}"; do echo "$r"; done
echo "gpu tests: $passed passed, $failed failed"
[ $failed = 0 ]
