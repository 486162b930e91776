#!/usr/bin/env bash
# `make test-integration`: the SGLang / vLLM plugin tests against the real
# framework packages, in their own venv ($INTEG_VENV, default .venv-integ),
# on the CPU backend. Not part of `make test` (the install is several GB).
#
# What is installed, and why this way:
# - torch $TORCH_VERSION: from the PyTorch CPU index when it answers, else
#   from PyPI (the CUDA build with its nvidia-* wheels; it imports and runs
#   on a machine without a GPU);
# - sglang $SGLANG_VERSION and vllm $VLLM_VERSION with --no-deps: their full
#   dependency sets pull GPU-only wheels (flashinfer, sglang-kernel,
#   deep-gemm, cutlass-dsl, ...) and pin two different torch versions;
# - then scripts/integ_deps.py installs, one at a time, the dependencies they
#   declare that the imports of the tests need;
# - the client package from the tree (its entry points register the plugins).
# A test whose framework does not import says why and skips.
# The venv is reused while scripts/test-integration.sh and the versions are
# unchanged ($INTEG_VENV/.stamp).
set -eu
INTEG_VENV=${INTEG_VENV:-.venv-integ}
PYTHON=${PYTHON:-python3}
BUILD=${BUILD:-build}
TORCH_VERSION=${TORCH_VERSION:-2.14.1}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
PY="$INTEG_VENV/bin/python"
PIP="$PY -m pip install -q"
stamp="torch=$TORCH_VERSION sglang=$SGLANG_VERSION vllm=$VLLM_VERSION $(cksum < "$0" | cut -d' ' -f1)"

MODULES=(
    sglang.srt.plugins
    sglang.srt.layers.moe.topk
    sglang.srt.layers.moe.token_dispatcher.standard
    sglang.srt.layers.moe.fused_moe_triton
    sglang.srt.layers.quantization.modelopt_quant
    vllm.plugins
    vllm.model_executor.layers.fused_moe.routed_experts
    vllm.model_executor.layers.fused_moe.expert_map_manager
    vllm.model_executor.layers.quantization.modelopt
)

if [ "$(cat "$INTEG_VENV/.stamp" 2>/dev/null)" != "$stamp" ]; then
    test -x "$PY" || "$PYTHON" -m venv "$INTEG_VENV"
    if ! $PIP --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION" 2>/dev/null; then
        echo "test-integration: the PyTorch CPU index is not reachable; torch $TORCH_VERSION from PyPI"
        $PIP "torch==$TORCH_VERSION"
    fi
    $PIP -r tests/requirements.txt
    $PIP --no-deps "sglang==$SGLANG_VERSION" "vllm==$VLLM_VERSION"
    # what the frameworks declare and every import below needs at once
    $PIP 'transformers==5.19.0' pyyaml requests tqdm psutil 'pydantic>=2.12' regex \
        cachetools sentencepiece msgspec orjson cloudpickle pyzmq einops filelock \
        typing_extensions blake3 py-cpuinfo huggingface_hub tokenizers protobuf pillow \
        setproctitle pybase64 cbor2 2>/dev/null
    "$PY" scripts/integ_deps.py "${MODULES[@]}" || \
        echo "test-integration: not every framework module imports; its tests will skip"
    echo "$stamp" > "$INTEG_VENV/.stamp"
fi
$PIP --no-deps --no-build-isolation --force-reinstall ./ipc/python
"$PY" - <<'PY'
import importlib.metadata as md
for d in ("torch", "sglang", "vllm", "transformers"):
    try:
        print("test-integration: %s %s" % (d, md.version(d)))
    except md.PackageNotFoundError:
        print("test-integration: %s not installed" % d)
PY
run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/moedt-integ-XXXXXX")
trap 'rm -rf "$run_tmp"' EXIT
TMPDIR="$run_tmp" MOED_BUILD="$BUILD" "$PY" -m pytest -q -rs -p no:cacheprovider \
    --basetemp="$run_tmp/pytest" tests/py/test_plugin_logic.py tests/py/test_plugins_sglang.py \
    tests/py/test_plugins_vllm.py
