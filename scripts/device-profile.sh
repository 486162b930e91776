#!/usr/bin/env bash
# Disassembly and Nsight Compute profile of the kernel's task code (bench/NOTES.md).
# Runs on the GPU machine from the tracked sources (nothing to carry): builds
# bench/probe/tile_probe.cu with the given -D switches, dumps its SASS, times it,
# and profiles one launch (instruction mix, pipes, stalls, per-instruction counts).
#
#   scripts/device-profile.sh [NAME:DEFS ...]     DEFS: comma list of -D switches
#   e.g. scripts/device-profile.sh base: ph:-DMOE_GPU_PHASES=1
# (tuning values are constants in kernels/moe_gpu/config.cuh: a variant of one
# is a tree that edits it, profiled with PROF_SRC)
# Logs go to $OUT (or build-var/profile): NAME.sass, NAME-time.txt, NAME-ncu.txt,
# NAME-src.csv (SASS with executed-instruction counts).
# PROF_ARGS: tile_probe arguments for the profile (default "gu 1 1 1").
# PROF_TIMES: the timed tile_probe runs, ';'-separated argument lists (default:
# DeepSeek-V3's gate_up and down at 1 and 8 tokens, 1 and 4 tiles per task).
# PROF_SRC: a tree with kernels/, common/ and bench/probe/ to build from instead
# (e.g. an older commit's, for an A/B of the task code); NCU=none: no profile.
#
#   scripts/device-profile.sh dram [PRESET:T,T,... ...]
# DRAM bytes per batch (issue 12: no batch reads an expert's weights from HBM
# more than once): bench_moe (BENCH_BIN, default build-cuda/bench/bench_moe,
# carried with .device) under Nsight Compute's application range replay, each
# T's timed batches one range (BENCH_PROFILE_RANGE=1: cudaProfilerStart/Stop
# with the kernel idle at both ends); dram__bytes_read.sum of the range over
# the distinct experts' bytes of its batches, per T: NAME-dram.txt.
# DRAM_ITERS batches per T (default 20).
#
#   scripts/device-profile.sh range [PRESET:T,T,... ...]
# Where the busy kernel's warps stall and which pipes and memories are busy:
# bench_moe (BENCH_BIN) with BENCH_PROFILE_RANGE=busy (per T, BENCH_PROFILE_MS
# of batches back to back, default 500; the range ends with the kernel's 20 ms
# idle exit, 4 % of it) under Nsight Compute's application range replay with
# the sections RANGE_SECTIONS (default: SpeedOfLight, WarpStateStats,
# SchedulerStats, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis,
# InstructionStats), or with RANGE_METRICS (a comma list for ncu --metrics,
# regex: entries allowed) those metrics instead; clocks as the GPU runs them
# (--clock-control none: under ncu's default base clock the kernel ran 1.5x
# slower at Qwen3 T = 64 and 256, H200 2026-12-04): NAME-range.txt per
# preset, one report per T. (The timed
# batches' range, BENCH_PROFILE_RANGE=1, is 85 % idle kernel at Qwen3 T = 64:
# 30 batches of 125 us, then the 20 ms idle exit; H200 2026-12-04.)
#
#   scripts/device-profile.sh wgmma
# bench/probe/wgmma_probe.cu (the gate_up task with its dequant feeding wgmma,
# bench/NOTES.md 2026-12-04) built here from the tracked sources: its check
# (outputs against mma.sync's) at N = 8, 16, 32 on both shapes, plain,
# pipelined (pN), pipelined with 8-tile tasks (qN), and pN / qN with mbarrier
# stages (mN / nN), then their timings beside tile_probe's 4-tile gate_up at 8
# and 16 tokens: probes-wgmma.txt. WG_SHAPES, WG_CHECKS, WG_FORMS, WG_TILE
# (space lists) narrow it down.
#
#   scripts/device-profile.sh splitm
# bench/probe/splitm_probe.cu (split-M tasks: each warp one tile over the
# whole K, the rows in a CTA-shared ring; bench/NOTES.md 2026-12-06 stop 37):
# its check against the same chains without a pipeline, gate_up and down, N =
# 8, 16, 32 and in split-K's order of sums (r8, r16, r32), on both shapes,
# then its timing beside tile_probe's 4-tile tasks at 8 and 16 tokens:
# probes-splitm.txt (SM_SHAPES, SM_FORMS, SM_TILE narrow it down).
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-build-var/profile}
LOG=$(mkdir -p "$LOG" && cd "$LOG" && pwd)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
# build_probe PROBE BIN LOGNAME [-D...]: bench/probe/PROBE.cu (sm_90a) into BIN,
# ptxas's report in $LOG/LOGNAME-build.txt; its tail on failure
build_probe() {
    local probe=$1 bin=$2 name=$3
    shift 3
    "$NVCC" -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Icommon -Ikernels \
        -DMOED_HAVE_CUDA=1 "$@" -Xptxas -v -o "$bin" "bench/probe/$probe.cu" \
        kernels/moe_gpu_pack.c common/moed_err.c common/moed_log.c common/moed_check_cuda.c \
        > "$LOG/$name-build.txt" 2>&1 || { tail -30 "$LOG/$name-build.txt"; return 1; }
}
# bench_moe under Nsight Compute (modes range, dram): the carried binary and libraries
bench_env() {
    B=${BENCH_BIN:-build-cuda/bench/bench_moe}
    export LD_LIBRARY_PATH="$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
if [ "${1:-}" = wgmma ]; then
    mkdir -p build-var
    rc=0
    for p in wgmma_probe tile_probe; do
        build_probe "$p" "build-var/$p" "$p" || exit 1
    done
    out=$LOG/probes-wgmma.txt
    : > "$out"
    for m in ${WG_SHAPES:-deepseek-v3 qwen3-30b-a3b}; do
        for n in ${WG_CHECKS:-8 16 32 p8 p16 p32 q8 q16 q32 m8 m16 m32 n8 n16 n32}; do
            echo "== check $n $m" >> "$out"
            timeout 120 build-var/wgmma_probe check "$n" "$m" >> "$out" 2>&1 || { rc=1; echo "FAIL check $n $m" >> "$out"; }
        done
        for n in ${WG_FORMS:-8 16 32 p8 p16 p32 q8 q16 q32 m8 m16 m32 n8 n16 n32}; do
            timeout 120 build-var/wgmma_probe "$n" 20 "$m" >> "$out" 2>&1 || rc=1
        done
        for n in ${WG_TILE:-8 16}; do
            timeout 120 build-var/tile_probe gu "$n" 20 4 "$m" >> "$out" 2>&1 || rc=1
        done
    done
    cat "$out"
    exit $rc
fi
if [ "${1:-}" = splitm ]; then
    mkdir -p build-var
    rc=0
    for p in splitm_probe tile_probe; do
        build_probe "$p" "build-var/$p" "$p" || exit 1
    done
    out=$LOG/probes-splitm.txt
    : > "$out"
    for m in ${SM_SHAPES:-deepseek-v3 qwen3-30b-a3b}; do
        for ph in gu dn; do
            for n in ${SM_FORMS:-8 16 32 r8 r16 r32}; do
                timeout 120 build-var/splitm_probe check "$ph" "$n" "$m" >> "$out" 2>&1 || rc=1
            done
            for n in ${SM_FORMS:-8 16 32 r8 r16 r32}; do
                timeout 120 build-var/splitm_probe "$ph" "$n" 20 "$m" >> "$out" 2>&1 || rc=1
            done
            for n in ${SM_TILE:-8 16}; do
                timeout 120 build-var/tile_probe "$ph" "$n" 20 4 "$m" >> "$out" 2>&1 || rc=1
            done
        done
    done
    cat "$out"
    exit $rc
fi
if [ "${1:-}" = range ]; then
    shift
    bench_env
    [ $# = 0 ] && set -- qwen3-30b-a3b:64,256 deepseek-v3:64,256
    secs=()
    for s in ${RANGE_SECTIONS:-SpeedOfLight WarpStateStats SchedulerStats ComputeWorkloadAnalysis MemoryWorkloadAnalysis InstructionStats}; do
        secs+=(--section "$s")
    done
    [ -n "${RANGE_METRICS:-}" ] && secs=(--metrics "$RANGE_METRICS")
    rc=0
    for spec in "$@"; do
        m=${spec%%:*}
        BENCH_PROFILE_RANGE=busy BENCH_ENERGY_MS=0 timeout "${RANGE_TIMEOUT:-400}" "$NCU" \
            --replay-mode app-range --clock-control none "${secs[@]}" --log-file "$LOG/$m-range.txt" "$B" \
            --preset "$m" --tokens "${spec#*:}" --no-baselines --iters "${RANGE_ITERS:-20}" \
            > "$LOG/$m-range-bench.txt" 2>&1 || rc=1
        grep -E "^# profile-range|==ERROR==" "$LOG/$m-range-bench.txt" | sort -u
    done
    exit $rc
fi
if [ "${1:-}" = dram ]; then
    shift
    bench_env
    [ $# = 0 ] && set -- deepseek-v3:1,4,8,16,32,64,128,256 qwen3-30b-a3b:1,4,8,16,32,64,128,256
    rc=0
    for spec in "$@"; do
        m=${spec%%:*}
        toks=${spec#*:}
        BENCH_PROFILE_RANGE=1 timeout "${DRAM_TIMEOUT:-240}" "$NCU" --replay-mode app-range \
            --metrics dram__bytes_read.sum,dram__bytes_write.sum --print-units base --csv \
            --log-file "$LOG/$m-ncu.csv" "$B" --preset "$m" --tokens "$toks" --no-baselines \
            --iters "${DRAM_ITERS:-20}" > "$LOG/$m-bench.txt" 2>&1 || rc=1
        python3 - "$LOG/$m-ncu.csv" "$LOG/$m-bench.txt" "$m" <<'PY' | tee "$LOG/$m-dram.txt"
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if len(r) > 3]
hdr = next((r for r in rows if "Metric Name" in r), None)
vals = {"dram__bytes_read.sum": [], "dram__bytes_write.sum": []}
if hdr:
    iname, ival = hdr.index("Metric Name"), hdr.index("Metric Value")
    for r in rows:
        if r is not hdr and r[iname] in vals:
            vals[r[iname]].append(float(r[ival].replace(",", "")))
rng = [tuple(map(float, m.groups())) for m in
       re.finditer(r"profile-range T=(\d+) batches=(\d+) distinct_bytes=(\d+)",
                   open(sys.argv[2]).read())]
print("# %s: DRAM bytes per batch (ncu dram__bytes_read.sum per range / batches) over the "
      "distinct experts' bytes" % sys.argv[3])
print("%-14s %5s %8s %14s %14s %8s %14s" % ("model", "T", "batches", "distinct_MB", "dram_read_MB",
                                            "ratio", "dram_write_MB"))
rd, wr = vals["dram__bytes_read.sum"], vals["dram__bytes_write.sum"]
for i, (T, n, db) in enumerate(rng):
    if i >= len(rd):
        print("%-14s %5d  (no ncu range)" % (sys.argv[3], T))
        continue
    w = wr[i] / n / 1e6 if i < len(wr) else float("nan")
    print("%-14s %5d %8d %14.1f %14.1f %8.3f %14.1f" % (sys.argv[3], T, n, db / n / 1e6,
                                                       rd[i] / n / 1e6, rd[i] / db, w))
PY
    done
    exit $rc
fi
mkdir -p build-var
BIN=$PWD/build-var
[ -n "${PROF_SRC:-}" ] && cd "$PROF_SRC"
CUOBJDUMP=${CUOBJDUMP:-$(dirname "$NVCC")/cuobjdump}
ARGS=${PROF_ARGS:-gu 1 1 1}
# tile_probe runs timed for every build: phase, tokens per task, reps, tiles per task
TIMES=("gu 1 20 1" "gu 8 20 1" "dn 1 20 1" "gu 1 20 4" "gu 8 20 4" "dn 1 20 4" "dn 8 20 4")
[ -n "${PROF_TIMES:-}" ] && IFS=';' read -r -a TIMES <<< "$PROF_TIMES"
[ $# = 0 ] && set -- base:
for v in "$@"; do
    name=${v%%:*}
    defs=$(echo "${v#*:}" | tr ',' ' ')
    [ "$name" = "$v" ] && defs=""
    bin=$BIN/tile_probe-$name
    echo "== $name: ${defs:-(defaults)}"
    # shellcheck disable=SC2086
    build_probe tile_probe "$bin" "$name" $defs || continue
    grep -E "tile_probe|spill|registers" "$LOG/$name-build.txt" | head -6
    "$CUOBJDUMP" -sass -fun tile_probe "$bin" > "$LOG/$name.sass" 2>&1 || "$CUOBJDUMP" -sass "$bin" > "$LOG/$name.sass" 2>&1
    for a in "${TIMES[@]}"; do
        # shellcheck disable=SC2086
        echo "args $a: $(timeout 60 "$bin" $a 2>&1 | tail -1)"
    done > "$LOG/$name-time.txt"
    cat "$LOG/$name-time.txt"
    [ "$NCU" = none ] && continue
    # shellcheck disable=SC2086
    timeout 240 "$NCU" --clock-control none --launch-skip 1 --launch-count 1 \
        --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SpeedOfLight --section SourceCounters \
        "$bin" $ARGS > "$LOG/$name-ncu.txt" 2>&1
    # shellcheck disable=SC2086
    timeout 240 "$NCU" --clock-control none --launch-skip 1 --launch-count 1 \
        --section SourceCounters --page source --print-source sass --csv \
        "$bin" $ARGS > "$LOG/$name-src.csv" 2>&1
    wc -l "$LOG/$name-src.csv"
done
