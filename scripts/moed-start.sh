# scripts/moed-start.sh - sourced by scripts/run-gpu-tests.sh, run-bench.sh and
# bench-ep.sh: start a moed in the background and wait until it is ready.
#   moed_start CONFIG LOG SECONDS   starts $BUILD/moed --config CONFIG, its
#                                   output to LOG; sets MOED_PID; returns 0
#                                   once LOG says "ready: socket", 1 if moed
#                                   exits first or SECONDS pass
moed_start() {
    "$BUILD/moed" --config "$1" > "$2" 2>&1 &
    MOED_PID=$!
    local _
    for _ in $(seq 1 "${3}0"); do
        grep -q 'ready: socket' "$2" && return 0
        kill -0 "$MOED_PID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}
