#!/usr/bin/env bash
# One GPU call that runs several of issue 12's steps in order, each timed,
# and prints their short results last (the device tool returns the end of
# the output). On the GPU machine, after `scripts/device-gpu.sh prepare` and,
# for `variants`, `scripts/device-variants.sh prepare ...` here (carry
# build-cuda, .device and build-var):
#
#   scripts/device-session.sh STEP ...
#     gpu            the card, its clocks and power limit (nvidia-smi)
#     wgmma          scripts/device-profile.sh wgmma (WG_* narrow it down)
#     splitm         scripts/device-profile.sh splitm (SM_SHAPES narrows it)
#     variants=A,B   scripts/device-variants.sh run A B (a name twice runs twice)
#     tasklog=A,B    task logs of variants built with -DMOE_GPU_TASK_LOG=1
#                    (BENCH_TASKLOG; scripts/tasklog.py --rate --start per T)
#     check=A,B      the GPU checks (gpu_test_moe_gpu) of variants A, B
#     test           make test-gpu (BUILD=build-cuda scripts/device-gpu.sh test)
#     bench          make bench (scripts/device-gpu.sh bench, BENCH_* as set)
#                    of BENCH_BUILD (default build-cuda; build-var/NAME: a
#                    variant's bench_moe)
#     dram[=A,B]     scripts/device-profile.sh dram (DRAM bytes per batch) of
#                    build-cuda's bench_moe, or of variants A, B; DRAM_SPECS
#                    (PRESET:T,T,... list) narrows the points
#     pick=V         the later test, bench and dram steps use build-V (a full
#                    CUDA=1 build of variant V's tree, carried beside build-cuda)
#                    when V passed its check step and its kernel us over the
#                    variants steps' runs, geometric mean of V / base per point,
#                    are below 0.997; else they keep build-cuda (or BENCH_BUILD).
#                    It needs check=...V... and variants=...base...V... before
#                    it in the same call, and build-V/moed, else the call stops
#                    before its first step; build-V must keep its objects (the
#                    suite's packaging tests run make install against it)
#     h200:STEP      STEP only if the card is an H200 (issue 12's lines are
#                    H200 fractions; the nvidia-h200 kind may give an H100)
#     h100:STEP      STEP only if the card is not an H200 (what a call does
#                    instead when the H200-only steps are skipped)
#     picked:STEP    STEP only if an earlier pick=V chose build-V (e.g. the
#                    suite on the variant about to be merged, not again on
#                    build-cuda when it was kept); it needs pick=V before it
#     gate=V         scripts/variant_gate.py V $GATE: V's kernel us against
#                    base's over the variants steps' runs, mean per point,
#                    and the rules in GATE, written before the call (e.g.
#                    GATE="deepseek-v3:256<=0.985 *<=1.015"); it needs
#                    variants=...base...V... before it and GATE set
#     gated:STEP     STEP only if the last gate=V before it passed (e.g. the
#                    table of build-cuda, built with V's patch applied, when V
#                    won); it needs gate=V before it
# The prefixes combine (h200:picked:test): each must hold for the step to run.
# Every step's whole log is kept in /tmp/session and packed into
# $OUT/session.tgz after each step; each step's summary is printed when it
# ends, the steps' times at the end.
set -u
cd "$(dirname "$0")/.." || exit 2
S=/tmp/session
# pick=V's inputs come from earlier steps of this call: check them all before
# any runs (and before the last call's logs in $S are cleared)
seen_check=" " seen_var=" " seen_pick=no seen_gate=no
# STEP=V (pick, gate) compares V's runs with base's: both in an earlier variants step
needs_variants() {
    case "$seen_var" in *" base "*) ;; *)
        echo "device-session: $1=$2 needs variants=base,... before it in the same call" >&2; exit 2 ;; esac
    case "$seen_var" in *" $2 "*) ;; *)
        echo "device-session: $1=$2 needs variants=...,$2 before it in the same call" >&2; exit 2 ;; esac
}
for step in "$@"; do
    while :; do
        case "$step" in
            h200:* | h100:*) step=${step#h[12]00:} ;;
            picked:*)
                [ $seen_pick = yes ] || {
                    echo "device-session: $step needs pick=V before it in the same call" >&2; exit 2; }
                step=${step#picked:} ;;
            gated:*)
                [ $seen_gate = yes ] || {
                    echo "device-session: $step needs gate=V before it in the same call" >&2; exit 2; }
                step=${step#gated:} ;;
            *) break ;;
        esac
    done
    case "$step" in
        gate=*)
            v=${step#gate=}
            needs_variants gate "$v"
            [ -n "${GATE:-}" ] || {
                echo "device-session: gate=$v needs GATE (its rules, e.g. GATE=\"*<=1.0\")" >&2; exit 2; }
            read -r -a rules <<< "$GATE" # (no globbing of *<=R)
            msg=$(python3 scripts/variant_gate.py --check "$v" "${rules[@]}" 2>&1) || {
                echo "device-session: gate=$v: ${msg#variant_gate: }" >&2; exit 2; }
            seen_gate=yes ;;
        check=*) seen_check="$seen_check$(echo "${step#check=}" | tr ',' ' ') " ;;
        variants=*) seen_var="$seen_var$(echo "${step#variants=}" | tr ',' ' ') " ;;
        pick=*)
            v=${step#pick=}
            case "$seen_check" in *" $v "*) ;; *)
                echo "device-session: pick=$v needs check=$v before it in the same call" >&2; exit 2 ;; esac
            needs_variants pick "$v"
            [ -x "build-$v/moed" ] || {
                echo "device-session: pick=$v needs build-$v (a full CUDA=1 build of $v's tree, carried)" >&2; exit 2; }
            seen_pick=yes ;;
    esac
done
rm -rf "$S" && mkdir -p "$S"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
t0=$(date +%s)
rc=0
i=0
main=build-cuda # the build that test, bench and dram use (pick=V may change it)
picked=no       # whether a pick=V chose build-V
gated=no        # whether the last gate=V passed
for step in "$@"; do
    while :; do
        case "$step" in
            h200:*)
                case "$gpu" in *H200*) step=${step#h200:} ;; *) echo "== $step: skipped ($gpu)" >> "$S/summary"; continue 2 ;; esac ;;
            h100:*)
                case "$gpu" in *H200*) echo "== $step: skipped ($gpu)" >> "$S/summary"; continue 2 ;; *) step=${step#h100:} ;; esac ;;
            picked:*)
                [ $picked = yes ] || { echo "== $step: skipped (no variant picked)" >> "$S/summary"; continue 2; }
                step=${step#picked:} ;;
            gated:*)
                [ $gated = yes ] || { echo "== $step: skipped (the gate did not pass)" >> "$S/summary"; continue 2; }
                step=${step#gated:} ;;
            *) break ;;
        esac
    done
    ts=$(date +%s)
    i=$((i + 1))
    name=$i-${step%%=*} # (a step may come twice: variants=a,b ... variants=c,d)
    log=$S/$name.txt
    mkdir -p "$S/$name"
    case "$step" in
        gpu)
            nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total \
                --format=csv > "$log" 2>&1
            cp "$log" "$S/$name.sum" ;;
        wgmma)
            OUT=$S/$name scripts/device-profile.sh wgmma > "$log" 2>&1 || rc=1
            grep -E '^wgmma_probe|^tile_probe|FAIL|error' "$log" > "$S/$name.sum" ;;
        splitm)
            OUT=$S/$name scripts/device-profile.sh splitm > "$log" 2>&1 || rc=1
            grep -E '^splitm_probe|^tile_probe|FAIL|error' "$log" > "$S/$name.sum" ;;
        variants=*)
            read -r -a names <<< "$(echo "${step#variants=}" | tr ',' ' ')"
            OUT=$S/$name scripts/device-variants.sh run "${names[@]}" > "$log" 2>&1 || rc=1
            sed -n '/== kernel us per run/,$p' "$log" > "$S/$name.sum" ;;
        tasklog=*)
            for v in $(echo "${step#tasklog=}" | tr ',' ' '); do
                mkdir -p "$S/$name/$v"
                BENCH_TASKLOG=$S/$name/$v OUT=$S/$name/$v-run scripts/device-variants.sh run "$v" \
                    >> "$log" 2>&1 || rc=1
                for f in "$S/$name/$v"/*.bin; do
                    [ -f "$f" ] || continue
                    echo "== $v $(basename "$f" .bin)"
                    python3 scripts/tasklog.py --rate --start "$f" 2>&1 |
                        grep -E '^==|CTA time|pairs:|combine:|span|timeline|TB/s|start|staged|routed|first|/[0-9]+/'
                done >> "$S/$name.sum"
            done ;;
        check=*)
            for v in $(echo "${step#check=}" | tr ',' ' '); do
                LD_LIBRARY_PATH="$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
                    timeout 600 "build-var/$v/gpu_test_moe_gpu" > "$S/$name/$v.txt" 2>&1
                echo $? > "$S/$name/$v.rc"
                [ "$(cat "$S/$name/$v.rc")" = 0 ] || rc=1
                { echo "== $v"; grep -E '^FAIL' "$S/$name/$v.txt" | head -5; tail -1 "$S/$name/$v.txt"; } \
                    >> "$S/$name.sum"
            done ;;
        test)
            OUT=$S/$name BUILD=$main scripts/device-gpu.sh test > "$log" 2>&1 || rc=1
            tail -22 "$log" > "$S/$name.sum" ;;
        bench)
            OUT=$S/$name BUILD=${BENCH_BUILD:-$main} scripts/device-gpu.sh bench > "$log" 2>&1 || rc=1
            grep -E '^\|' "$log" | tail -24 > "$S/$name.sum"
            grep -iE 'stream|sweep' "$log" | tail -6 >> "$S/$name.sum"
            for f in bench.csv sweep.csv bench.png sweep.png; do
                [ -f "$S/$name/$f" ] && [ -n "${OUT:-}" ] && cp "$S/$name/$f" "$OUT/"
            done ;;
        dram|dram=*)
            vs=${step#dram}
            for v in $(echo "${vs#=}" | tr ',' ' ') ""; do
                [ -z "$v" ] && [ -n "$vs" ] && continue
                b=$main/bench/bench_moe
                [ -n "$v" ] && b=build-var/$v/bench/bench_moe
                mkdir -p "$S/$name/${v:-cuda}"
                OUT=$S/$name/${v:-cuda} BENCH_BIN=$b scripts/device-profile.sh dram ${DRAM_SPECS:-} \
                    >> "$log" 2>&1 || rc=1
                { echo "== dram ${v:-$main}"; cat "$S/$name/${v:-cuda}"/*-dram.txt; } \
                    >> "$S/$name.sum" 2>/dev/null
                [ -z "$vs" ] && break
            done ;;
        pick=*)
            v=${step#pick=}
            # per model and T, the mean of each variant's runs (bench_moe's kernel_us, column 14)
            g=$(cat "$S"/*-variants/variant-base.csv /dev/null | sed 's/^/base,/'
                cat "$S"/*-variants/variant-"$v".csv /dev/null | sed 's/^/V,/')
            g=$(echo "$g" | awk -F, '$2 != "model" && NF > 14 { k = $2 " " $3; s[$1, k] += $15; n[$1, k]++; K[k] = 1 }
                END { m = 0; l = 0
                      for (k in K) if (n["base", k] && n["V", k]) { l += log((s["V", k] / n["V", k]) / (s["base", k] / n["base", k])); m++ }
                      if (m) printf "%.4f %d\n", exp(l / m), m; else print "none 0" }')
            ok=no # its check step ran and exited 0
            [ "$(cat "$S"/*-check/"$v".rc 2>/dev/null | sort -u)" = 0 ] && ok=yes
            read -r gm gn <<< "$g"
            if [ "$ok" = yes ] && [ "$gm" != none ] && awk -v r="$gm" 'BEGIN { exit !(r < 0.997) }' &&
                [ -x "build-$v/moed" ]; then
                main=build-$v
                picked=yes
            fi
            echo "$v / base geometric mean $gm over $gn points, check passed: $ok; test, bench, dram use $main" |
                tee "$S/$name.sum" > "$log" ;;
        gate=*)
            gated=no
            dirs=()
            for d in "$S"/*-variants; do [ -d "$d" ] && dirs+=(--dir "$d"); done
            read -r -a rules <<< "$GATE"
            python3 scripts/variant_gate.py "${dirs[@]}" "${step#gate=}" "${rules[@]}" > "$log" 2>&1 &&
                gated=yes
            cp "$log" "$S/$name.sum" ;;
        *)
            echo "device-session: unknown step $step" >&2
            exit 2 ;;
    esac
    echo "== $step: $(( $(date +%s) - ts )) s" >> "$S/summary"
    # each step's summary as soon as it ends, and the logs so far in $OUT, so
    # that a call cut off by its time limit still returns the steps it finished
    { echo "== $name ($step, $(( $(date +%s) - ts )) s)"; cat "$S/$name.sum" 2>/dev/null; }
    [ -n "${OUT:-}" ] && tar czf "$OUT/session.tgz" -C /tmp session 2>/dev/null
done
echo "== $gpu, $(( $(date +%s) - t0 )) s in all"
cat "$S/summary"
exit $rc
