#!/usr/bin/env bash
# Where the persistent kernel spills, by source line, on this machine (no GPU):
# compiles kernels/moe_gpu.cu with -lineinfo for sm_90a and sm_120a (with the
# given -D switches), prints ptxas's spill line for moe_persistent and counts
# the local stores and loads (STL / LDL) of its SASS per source line. A spill
# in a K loop costs every weight unit; one in the task loop, every task
# (bench/NOTES.md v23, 2026-12-04).
#
#   scripts/sass-spills.sh [-DFOO=1 ...]
#   SRC=dir       a tree with kernels/ and common/ to compile instead (a worktree
#                 with a patch applied: scripts/device-variants.sh's +P.patch)
#   ARCHS="90a"   the architectures (default "90a 120a")
# nvdisasm: $NVDISASM, else the CUDA toolkit's, else the one of the PyPI wheel
# nvidia-cuda-nvdisasm, installed with pip into .venv-sass on first use.
set -eu
cd "$(dirname "$0")/.."
ROOT=$PWD
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
ND=${NVDISASM:-$(dirname "$NVCC")/nvdisasm}
if [ ! -x "$ND" ]; then
    ND=$(find "$ROOT/.venv-sass" -path '*/bin/nvdisasm' -type f 2>/dev/null | head -1)
    if [ -z "$ND" ]; then
        python3 -m venv "$ROOT/.venv-sass"
        "$ROOT/.venv-sass/bin/pip" install -q nvidia-cuda-nvdisasm
        ND=$(find "$ROOT/.venv-sass" -path '*/bin/nvdisasm' -type f | head -1)
    fi
fi
cd "${SRC:-$ROOT}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for a in ${ARCHS:-90a 120a}; do
    "$NVCC" -std=c++17 -O3 -lineinfo -Xptxas -v "-gencode=arch=compute_$a,code=sm_$a" \
        -Icommon -Ikernels -DMOED_HAVE_CUDA=1 "$@" -cubin -o "$tmp/k.cubin" kernels/moe_gpu.cu \
        2> "$tmp/ptxas.txt" || { cat "$tmp/ptxas.txt"; exit 1; }
    echo "== sm_$a: $(grep -A2 "entry function '_Z14moe_persistent" "$tmp/ptxas.txt" | tail -2 |
        tr -s ' ' | tr '\n' ';')"
    "$ND" -g -c "$tmp/k.cubin" > "$tmp/k.sass"
    python3 - "$tmp/k.sass" <<'PY'
import re, sys
fun = cur = None
n = {}
for line in open(sys.argv[1]):
    m = re.search(r"\.text\.(\S+):", line)
    if m:
        fun = m.group(1)
    m = re.search(r'//## File "([^"]+)", line (\d+)', line)
    if m:
        cur = "%s:%s" % (m.group(1).split("/")[-1], m.group(2))
    if fun and fun.startswith("_Z14moe_persistent") and re.search(r"\b(STL|LDL)\b", line):
        k = (cur or "?", "STL" if "STL" in line else "LDL")
        n[k] = n.get(k, 0) + 1
if not n:
    print("   no local loads or stores in moe_persistent")
for (where, op), c in sorted(n.items()):
    print("   %-28s %s x%d" % (where, op, c))
PY
done
