#!/usr/bin/env bash
# Kernel variants for the experiments in bench/NOTES.md: build several
# bench_moe binaries that differ only in compile-time switches here, then
# time them all in one call on the GPU machine.
#
#   scripts/device-variants.sh prepare NAME:DEFS ...   here: DEFS is a comma list of
#                                                       -D switches (may be empty; the
#                                                       kernel's instrumentation switches:
#                                                       docs/GPU.md, e.g. MOE_GPU_PHASES),
#                                                       or @REV: the tree of git revision
#                                                       REV (a branch that edits a tuning
#                                                       constant in kernels/moe_gpu/
#                                                       config.cuh, an older commit),
#                                                       or +P1[+P2...][,-DX...]: HEAD's tree
#                                                       with the patches P applied in order
#                                                       (and the -D switches after them)
#                                                       (bench/variants/*.patch: kept in
#                                                       the tree, a branch does not
#                                                       outlive its session's checkout);
#                                                       builds build-var/NAME/bench/bench_moe
#                                                       and its GPU checks, build-var/NAME/
#                                                       gpu_test_moe_gpu (sm_90a only);
#                                                       needs .device/lib
#                                                       from scripts/device-gpu.sh prepare
#   scripts/device-variants.sh run [NAME ...]          there: every built variant (or those
#                                                       named) with VAR_DS_ARGS and
#                                                       VAR_QWEN_ARGS; one log per variant
#                                                       in $OUT (or build-var/logs) and a
#                                                       summary table, variants-summary.txt;
#                                                       a name given twice runs twice (run
#                                                       a b a b: alternately), and the
#                                                       summary ends with each variant's
#                                                       kernel us per run
# Carry build-var and .device (and build-cuda if the GPU tests run in the same call).
#
# e.g. scripts/device-variants.sh prepare base: ph:-DMOE_GPU_PHASES=1 old:@f5b1759 \
#          exp:+bench/variants/EXPERIMENT.patch
set -u
cd "$(dirname "$0")/.."
mode=${1:-}
shift || true

if [ "$mode" = prepare ]; then
    set -e
    rm -rf build-var
    for v in "$@"; do
        name=${v%%:*}
        defs=$(echo "${v#*:}" | tr ',' ' ')
        [ "$name" = "$v" ] && defs=""
        echo "== $name: ${defs:-(defaults)}"
        src=$PWD
        case "$defs" in
            @*) # the tree of a revision, in a temporary worktree
                src=$(mktemp -d)/tree
                git worktree add --detach "$src" "${defs#@}" > /dev/null
                defs="" ;;
            +*) # HEAD's tree with patches applied, in a temporary worktree
                src=$(mktemp -d)/tree
                git worktree add --detach "$src" HEAD > /dev/null
                pdefs=""
                for pf in $(echo "${defs#+}" | tr '+' ' '); do
                    case "$pf" in -D*) pdefs="$pdefs $pf"; continue ;; esac # the switches after them
                    git -C "$src" apply "$PWD/$pf" || { echo "$name: $pf does not apply"; exit 1; }
                done
                defs=$pdefs ;;
        esac
        (cd "$src" && NVCCFLAGS="$defs" CFLAGS="$defs" make -s BUILD="$src/build-var-$name" CUDA=1 \
            CUDA_ARCHS=90a "$src/build-var-$name/bench/bench_moe" \
            "$src/build-var-$name/tests/gpu_test_moe_gpu") > "/tmp/variant-$name.log" 2>&1 ||
            { tail -20 "/tmp/variant-$name.log"; exit 1; }
        mkdir -p "build-var/$name/bench"
        mv "$src/build-var-$name/bench/bench_moe" "build-var/$name/bench/bench_moe"
        mv "$src/build-var-$name/tests/gpu_test_moe_gpu" "build-var/$name/gpu_test_moe_gpu"
        rm -rf "$src/build-var-$name"
        [ "$src" = "$PWD" ] || git worktree remove --force "$src"
        [ "$name" = "$v" ] || case "${v#*:}" in @*|+*) defs="${v#*:}" ;; esac
        echo "$defs" > "build-var/$name/DEFS" # only the binary travels
    done
    du -sh build-var
    exit 0
fi
[ "$mode" = run ] || { sed -n 2,19p "$0"; exit 2; }

export LD_LIBRARY_PATH="$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
cub=$( [ -n "$nv" ] && find "$nv" -name 'libcublas.so.*' 2>/dev/null | head -1)
[ -n "$cub" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$cub")"
LOGDIR=${OUT:-build-var/logs}
mkdir -p "$LOGDIR"
DS=${VAR_DS_ARGS:---preset deepseek-v3 --layers 4 --tokens 1,4,16,64,256 --no-baselines --iters 100}
QW=${VAR_QWEN_ARGS:---preset qwen3-30b-a3b --layers 24 --tokens 1,4,64,256 --no-baselines --iters 200}
names=("$@")
[ ${#names[@]} = 0 ] && names=($(ls build-var | grep -v '^logs$'))
sum="$LOGDIR/variants-summary.txt"
: > "$sum"
for n in "${names[@]}"; do
    b=build-var/$n/bench/bench_moe
    [ -x "$b" ] || { echo "$n: not built" | tee -a "$sum"; continue; }
    log=$LOGDIR/variant-$n.txt
    echo "# $n: $(cat "build-var/$n/DEFS")" > "$log"
    BENCH_CSV="$LOGDIR/variant-$n.csv" timeout "${VAR_TIMEOUT:-240}" "$b" $DS >> "$log" 2>&1
    [ -n "$QW" ] && BENCH_CSV="$LOGDIR/variant-$n.csv" timeout "${VAR_TIMEOUT:-240}" "$b" $QW >> "$log" 2>&1
    {
        echo "== $n ($(cat "build-var/$n/DEFS"))"
        cat "$LOGDIR/variant-$n.csv" 2>/dev/null
    } >> "$sum"
done
cat "$sum"
# kernel us (bench_moe's kernel_us) of every run of each variant, per model and T
# (a name given twice runs twice: its rows append), each with the SM clock
# NVML saw while those batches were timed (@MHz; timed_sm_MHz, where measured)
echo "== kernel us per run (variant model T: runs, @ SM MHz while timed)" | tee -a "$sum"
for n in $(printf '%s\n' "${names[@]}" | awk '!s[$0]++'); do
    [ -f "$LOGDIR/variant-$n.csv" ] || continue
    awk -F, -v v="$n" '$1 != "model" { k = $1 " " $2; if (!(k in r)) o[++m] = k
                                       r[k] = r[k] " " $14 (NF >= 23 && $23 > 0 ? "@" $23 : "") }
        END { for (i = 1; i <= m; i++) print v, o[i] ":" r[o[i]] }' "$LOGDIR/variant-$n.csv"
done | tee -a "$sum"
