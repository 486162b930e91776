#!/usr/bin/env bash
# `make bench-ep`: one DeepSeek-V3 layer served by moed on one GPU and with
# expert parallelism over several (engine.gpus), side by side (issue 14's
# bench; docs/MULTI_GPU.md). Per configuration a daemon on a synthetic
# 1-layer checkpoint (generated once, kept in $LOGDIR/models), then per T
# `moectl bench` with one connection and one request in flight: the end to
# end p50 (what a decode step waits for) and the daemon's kernel-stage p50.
#   BUILD=build-cuda          build dir with moed and moectl (CUDA=1)
#   LOGDIR=dir                logs, ep.md and the model cache (default $BUILD/bench-logs)
#   BENCH_EP_GPUS=0,1         the GPUs of the parallel configuration; the first
#                             alone is the one-GPU configuration
#   BENCH_EP_TOKENS=1,4,16,64,256, BENCH_EP_DURATION=3 (seconds per point)
#   BENCH_EP_PLACEMENT=file   engine.placement for the parallel one (default:
#                             balanced by expert count)
#   BENCH_EP_PRESET=deepseek-v3  another synthetic shape (moectl gen-model's presets)
# Target (issue 14): at T = 64 the parallel configuration at most 0.55x the
# one-GPU latency. A list that names one GPU twice (0,0) runs the same code
# on one GPU: a check that the path works, not a measurement of the target.
set -u
. "$(dirname "$0")/moed-start.sh"
BUILD=${BUILD:-build-cuda}
LOGDIR=${LOGDIR:-$BUILD/bench-logs}
GPUS=${BENCH_EP_GPUS:-0,1}
TOKENS=${BENCH_EP_TOKENS:-1,4,16,64,256}
DUR=${BENCH_EP_DURATION:-3}
PRESET=${BENCH_EP_PRESET:-deepseek-v3}
mkdir -p "$LOGDIR/models"
for b in moed moectl; do
    [ -x "$BUILD/$b" ] || { echo "$BUILD/$b not built (make BUILD=$BUILD CUDA=1)"; exit 1; }
done
case "$GPUS" in
    *[!0-9,]*|,*|*,|*,,*) echo "BENCH_EP_GPUS=$GPUS: a comma-separated list of GPU numbers"; exit 2 ;;
esac
first=${GPUS%%,*}
n=$(echo "$GPUS" | tr ',' '\n' | wc -l)
distinct=$(echo "$GPUS" | tr ',' '\n' | sort -u | wc -l)
[ "$n" -ge 2 ] || { echo "BENCH_EP_GPUS=$GPUS: two GPUs at least"; exit 2; }
place=""
if [ -n "${BENCH_EP_PLACEMENT:-}" ]; then
    [ -r "$BENCH_EP_PLACEMENT" ] || { echo "BENCH_EP_PLACEMENT=$BENCH_EP_PLACEMENT: not readable"; exit 2; }
    place=", \"placement\": \"$(cd "$(dirname "$BENCH_EP_PLACEMENT")" && pwd)/$(basename "$BENCH_EP_PLACEMENT")\""
fi
commit=$(cat .device/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
max_t=$(echo "$TOKENS" | tr ',' '\n' | sort -n | tail -1)

# one configuration: start moed on engine.gpus $1, bench every T into
# $LOGDIR/ep-$2-T.txt; prints "T e2e_p50 kernel_p50" lines
run_conf() {
    local gl=$1 tag=$2 tmp pid ok T
    tmp=$(mktemp -d)
    local extra=""
    [ "$tag" = ep ] && extra=$place
    cat > "$tmp/moed.json" <<JSON
{"server": {"socket": "$tmp/moed.sock"}, "status": {"port": 0},
 "model": {"path": "synthetic:$PRESET:layers=1:seed=3", "synthetic_dir": "$LOGDIR/models"},
 "engine": {"backend": "cuda", "gpus": [$gl], "max_tokens": $max_t,
            "batch_deadline_ms": 20000$extra},
 "log": {"level": "info"}}
JSON
    ok=0
    moed_start "$tmp/moed.json" "$LOGDIR/ep-$tag-moed.log" "${BENCH_EP_START_S:-900}" && ok=1
    pid=$MOED_PID
    if [ $ok = 1 ]; then
        for T in $(echo "$TOKENS" | tr ',' ' '); do
            timeout $((DUR * 4 + 60)) "$BUILD/moectl" bench --socket "$tmp/moed.sock" --tokens "$T" \
                --connections 1 --inflight 1 --duration "$DUR" > "$LOGDIR/ep-$tag-$T.txt" 2>&1
            e2e=$(sed -n 's/^latency: p50 \([0-9.]*\) us.*/\1/p' "$LOGDIR/ep-$tag-$T.txt")
            # the stage line: "..., kernel P50 / MEAN, added_kernel ..."
            kern=$(sed -n 's/.*[ ,]kernel \([0-9.]*\) \/ .*/\1/p' "$LOGDIR/ep-$tag-$T.txt" | head -1)
            echo "$T ${e2e:-nan} ${kern:-nan}"
        done
    else
        echo "moed (engine.gpus [$gl]) did not become ready:" >&2
        tail -5 "$LOGDIR/ep-$tag-moed.log" >&2
    fi
    kill -TERM $pid 2>/dev/null
    wait $pid 2>/dev/null
    rm -rf "$tmp"
    [ $ok = 1 ]
}

# "T one_p50 one_kernel ep_p50 ep_kernel" per T of both runs, in the T list's order
pair() {
    awk 'NR == FNR { a[$1] = $2 " " $3; next } ($1 in a) { print $1, a[$1], $2, $3 }' \
        "$LOGDIR/ep-one.dat" "$LOGDIR/ep-ep.dat"
}

rc=0
run_conf "$first" one > "$LOGDIR/ep-one.dat" || rc=1
run_conf "$GPUS" ep > "$LOGDIR/ep-ep.dat" || rc=1
{
    echo "# bench-ep: one $PRESET layer (synthetic), moectl bench, 1 connection x 1 in flight," \
         "${DUR} s per point; $(date -u +%Y-%m-%dT%H:%MZ), commit $commit"
    nvidia-smi --query-gpu=index,name --format=csv,noheader 2>/dev/null | sed 's/^/# GPU /'
    [ "$distinct" -lt "$n" ] &&
        echo "# engine.gpus [$GPUS] names a GPU more than once: the path on shared SMs, not the target"
    echo
    echo "| T | 1 GPU p50 us | 1 GPU kernel us | $n GPUs [$GPUS] p50 us | $n GPUs kernel us | p50 ratio |"
    echo "|---:|---:|---:|---:|---:|---:|"
    pair | while read -r T a ak b bk; do
        r=$(awk -v a="$a" -v b="$b" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.3f", b / a; else print "nan" }')
        echo "| $T | $a | $ak | $b | $bk | $r |"
    done
    r64=$(pair | awk '$1 == 64 && $2 > 0 && $4 > 0 { printf "%.3f", $4 / $2 }')
    echo
    if [ -z "$r64" ]; then
        echo "target (T = 64, $n GPUs at most 0.55x one): not measured (no T = 64 point)"
    elif [ "$distinct" -lt "$n" ]; then
        echo "target (T = 64, at most 0.55x): not applicable (one GPU listed twice; ratio $r64)"
    else
        echo "target (T = 64, $n GPUs at most 0.55x one): ratio $r64:" \
             "$(awk -v r="$r64" 'BEGIN { print (r <= 0.55 ? "met" : "not met") }')"
    fi
} | tee "$LOGDIR/ep.md"
exit $rc
