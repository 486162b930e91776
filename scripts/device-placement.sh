#!/usr/bin/env bash
# Where a persistent grid's CTAs land under MPS and whether another process's
# kernels run beside it (bench/probe/sm_placement.cu; bench/NOTES.md,
# 2026-12-01 late). On the GPU machine, after building the probe here:
#   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
#     -o build-cuda/sm_placement bench/probe/sm_placement.cu
# Carry build-cuda. Each case: `hold` (moed's shape: 128 threads, 36992 B of
# shared memory per CTA) for HOLD_S seconds, and 2 s into it one `probe`
# per line of PROBES from another process. Logs in $OUT (or
# build-cuda/gpu-logs/placement.txt); a line per case.
#   HOLDS   "272 528"  grids to hold (moed's with engine.sms_free 64, and 0)
#   PROBES  "132 256 0;1 1024 0;132 128 200000"  probe <ctas> <threads> <smem>
#   PCTS    "100 52"   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the holding process
set -u
cd "$(dirname "$0")/.." || exit 2
BIN=${BIN:-build-cuda/sm_placement}
OUT=${OUT:-build-cuda/gpu-logs}
HOLD_S=${HOLD_S:-8}
mkdir -p "$OUT"
log="$OUT/placement.txt"
[ -x "$BIN" ] || { echo "$BIN not built (see the comment at the top)" >&2; exit 2; }
. scripts/mps.sh
mps_start
: > "$log"
IFS=';' read -r -a probes <<< "${PROBES:-132 256 0;1 1024 0;132 128 200000}"
for pct in ${PCTS:-100 52}; do
    for ctas in ${HOLDS:-272 528}; do
        echo "== hold $ctas CTAs, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct" | tee -a "$log"
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout -k 5 $((HOLD_S + 20)) \
            "$BIN" hold "$ctas" 36992 "$HOLD_S" >> "$log" 2>&1 &
        hp=$!
        sleep 2
        for pr in "${probes[@]}"; do
            # shellcheck disable=SC2086 # the three numbers of a probe line
            timeout -k 5 $((HOLD_S + 30)) "$BIN" probe $pr >> "$log" 2>&1 ||
                echo "probe $pr: exit $?" >> "$log"
        done
        wait $hp || echo "hold: exit $?" >> "$log"
    done
done
mps_stop "$OUT/mps-log-placement"
cat "$log"
