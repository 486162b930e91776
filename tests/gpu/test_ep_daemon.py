"""GPU: expert parallelism through the real socket. The daemon with
engine.gpus [0, 0] (two devices on one GPU, each kernel on half its SMs) and a
skewed engine.placement map (device 1 holds two routed experts, one of them
also on device 0; device 0 the rest) answers every MoE layer of the model bit
for bit as the daemon with engine.gpus [0] does, at T = 1, 4, 16, 64 and 256,
with and without the shared experts and with empty slots (moed_client).

Run by scripts/run-gpu-tests.sh (step 4b); skips without a GPU. numpy only,
no torch, no MPS: the two daemons run one after the other.
"""

import json
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "py"))

import daemon_util as du  # noqa: E402

np = pytest.importorskip("numpy")
import moed_client as mc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ep_cases import TOKENS, batches, differ, skewed_map  # noqa: E402

def gpu_count():
    r = subprocess.run([du.MOED, "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"; (\d+) devices? visible", r.stdout)
    return int(m.group(1)) if m else 0


if not os.path.exists(du.MOED) or gpu_count() < 1:
    pytest.skip("needs a CUDA build of moed and a GPU", allow_module_level=True)


def run_all(tmp, models, gpus, placement, cases=None):
    cfg = du.base_config(str(tmp), models, status__port=du.free_port(), engine__backend="cuda",
                         engine__gpus=gpus, engine__placement=placement,
                         engine__max_tokens=max(TOKENS), server__max_frame_bytes=4 << 20,
                         server__max_client_buffer_bytes=16 << 20)
    with du.Daemon(tmp, cfg) as d:
        with mc.Client(d.sock_path, timeout=du.wait_s(60)) as c:
            info = c.hello()
            # more than one device: the EP driver over the CUDA devices
            assert info.backend == ("ep" if len(gpus) > 1 else "cuda"), info.backend
            if cases is None:
                cases = batches(info, 2026)
            ys = [np.asarray(c.forward(layer, x, ids, w, routed_only=ro, empty_slots=em))
                  .view(np.uint16).copy()
                  for layer, t, ro, em, x, ids, w in cases]
        log = d.log()
        assert d.stop() == 0, log[-4000:]
    return info, cases, ys, log


def test_two_devices_on_one_gpu_equal_one_device_bit_for_bit(tmp_path, tmp_path_factory):
    models_dir = du.models_dir(tmp_path_factory)
    one = tmp_path / "one"
    one.mkdir()
    info, cases, want, _ = run_all(one, models_dir, [0], "")
    pmap = tmp_path / "placement.json"
    skewed_map(info, pmap)
    two = tmp_path / "two"
    two.mkdir()
    _, _, got, log = run_all(two, models_dir, [0, 0], str(pmap), cases)
    assert "expert parallelism over 2 devices" in log, log[-4000:]
    bad = differ(cases, got, want)
    assert not bad, bad
    assert len(cases) == len(info.moe_layers) * len(TOKENS) * 3


def test_bad_placement_map_refused_naming_file(tmp_path, tmp_path_factory):
    models_dir = du.models_dir(tmp_path_factory)
    pmap = tmp_path / "bad.json"
    pmap.write_text(json.dumps({"gpus": 3, "n_experts": 1, "n_shared": 0, "layers": []}))
    cfg = du.base_config(str(tmp_path), models_dir, status__port=du.free_port(),
                         engine__backend="cuda", engine__gpus=[0, 0],
                         engine__placement=str(pmap))
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    r = subprocess.run([du.MOED, "--config", str(p)], capture_output=True, text=True,
                       timeout=du.wait_s(120))
    assert r.returncode != 0, r.stdout + r.stderr
    assert str(pmap) in r.stderr and '"gpus" is 3 but engine.gpus lists 2' in r.stderr, r.stderr
