"""What the torch GPU tests (tests/gpu/test_*.py, run by scripts/run-gpu-tests.sh
under MPS) share: the skips without torch, numpy, a GPU or MPS, the daemon's
/status, and random batches."""

import json
import os
import sys
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "py"))

import daemon_util as du  # noqa: E402

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)
if os.environ.get("MOED_TEST_MPS") != "1":
    pytest.skip("needs MPS (scripts/run-gpu-tests.sh starts it)", allow_module_level=True)


def status(daemon):
    """The daemon's /status JSON."""
    url = "http://127.0.0.1:%d/status" % daemon.http_port()
    with urllib.request.urlopen(url, timeout=du.wait_s(5)) as r:
        return json.loads(r.read().decode())


def batch(info, t, seed, device="cpu"):
    """A random batch of T tokens: x bf16 [T, H], distinct ids int32 [T, k],
    weights fp32 [T, k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, info.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(info.n_experts, generator=g)[:info.top_k]
                       for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, info.top_k, generator=g)
    return x.to(device), ids.to(device), w.to(device)
