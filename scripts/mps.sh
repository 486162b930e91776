# scripts/mps.sh - sourced by scripts/run-gpu-tests.sh and scripts/run-bench.sh:
# start the CUDA MPS control daemon in a temporary pipe/log directory (both
# moed and the test's or bench's torch clients run under it) and stop it.
#   mps_start        exports CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY
#   mps_stop [dir]   stops any moed left running, quits MPS (30 s at most),
#                    copies its log to dir (if given), unsets them
mps_start() {
    MPS_TMP=$(mktemp -d)
    export CUDA_MPS_PIPE_DIRECTORY="$MPS_TMP/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_TMP/log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    # L2 for persisting lines (moed keeps h there, docs/GPU.md): under MPS only
    # the server's start sets it aside, 13 % >= the L2 / 8 moed asks for
    CUDA_DEVICE_DEFAULT_PERSISTING_L2_CACHE_PERCENTAGE_LIMIT=${CUDA_DEVICE_DEFAULT_PERSISTING_L2_CACHE_PERCENTAGE_LIMIT:-13} \
        nvidia-cuda-mps-control -d
}
mps_stop() {
    # a client left hanging (a test cut by its timeout) keeps MPS from quitting
    pkill -x moed 2>/dev/null && sleep 1
    pkill -KILL -x moed 2>/dev/null
    echo quit | timeout 30 nvidia-cuda-mps-control || echo "mps_stop: MPS did not quit in 30 s" >&2
    [ -n "${1:-}" ] && { cp -r "$CUDA_MPS_LOG_DIRECTORY" "$1" 2>/dev/null || true; }
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    rm -rf "$MPS_TMP"
}
