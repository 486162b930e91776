#!/usr/bin/env bash
# Run every libFuzzer target (or those named) for RUNS executions each and
# print one line per target: executions, seconds, exec/s, corpus entries and
# the result. Exit 1 on the first target that finds a crash (the input is
# left in $BUILD/fuzz/ as crash-*, leak-*, timeout-* or oom-*).
#
#   BUILD=build RUNS=100000 tests/fuzz/run.sh [frame http safetensors ...]
#
# Seeds: tests/fuzz/corpus/<name>/ (read only); new inputs go to
# $BUILD/fuzz/corpus/<name>/, kept between runs. JSON targets get
# tests/fuzz/json.dict.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
RUNS=${RUNS:-100000}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    for f in tests/fuzz/fuzz_*.c; do
        n=$(basename "$f" .c)
        targets+=("${n#fuzz_}")
    done
fi
printf '%-14s %10s %8s %9s %7s  %s\n' target execs seconds exec/s corpus result
rc=0
for t in "${targets[@]}"; do
    bin=$BUILD/fuzz/fuzz_$t
    out=$BUILD/fuzz/corpus/$t
    log=$BUILD/fuzz/$t.log
    mkdir -p "$out"
    args=(-runs="$RUNS" -artifact_prefix="$BUILD/fuzz/" -print_final_stats=1)
    case $t in
    http) args+=(-max_len=9000) ;;
    safetensors | model_config | config) args+=(-dict=tests/fuzz/json.dict -max_len=8192) ;;
    esac
    dirs=("$out")
    [ -d "tests/fuzz/corpus/$t" ] && dirs+=("tests/fuzz/corpus/$t")
    start=$(date +%s.%N)
    if "$bin" "${args[@]}" "${dirs[@]}" > "$log" 2>&1; then
        result="ok, 0 findings"
    else
        result="FAILED (see $log)"
        rc=1
    fi
    end=$(date +%s.%N)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    secs=$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')
    rate=$(awk -v n="${execs:-0}" -v s="$secs" 'BEGIN { printf "%.0f", (s > 0 ? n / s : 0) }')
    printf '%-14s %10s %8.1f %9s %7s  %s\n' "$t" "${execs:-?}" "$secs" "${rate:-?}" \
        "$(ls "$out" | wc -l)" "$result"
    if [ $rc -ne 0 ]; then
        tail -40 "$log"
        exit 1
    fi
done
