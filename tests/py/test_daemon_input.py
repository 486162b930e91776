"""Bad checkpoint and start-up input, through the real daemon binary: a NaN
block scale is refused at load (exit 3, naming the tensor, row and block)
wherever it sits; hidden and intermediate sizes that are whole 16-weight scale
blocks (272, 48) load and serve on the CPU backend, others are refused with
the real reason; a socket in a missing directory is named as such, before the
model is loaded.
"""

import json
import os
import shutil
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest

import daemon_util as du
from conftest import (F64Reference, bf16_bits, gen_model, read_safetensors_header, rel_l2,
                      write_safetensors)

EXIT_RUNTIME, EXIT_MODEL = 1, 3


def run_moed(tmp_path, cfg, timeout=120):
    """Start moed on cfg and wait for it to exit by itself (it must: every
    case here is a start-up failure); returns (exit code, log)."""
    path = os.path.join(str(tmp_path), "moed.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    r = subprocess.run([du.MOED, "--config", path], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=du.wait_s(timeout), env=env)
    return r.returncode, r.stdout + r.stderr


def config_for(tmp_path, model_dir, **over):
    return du.base_config(str(tmp_path), str(tmp_path / "synth"), model__path=str(model_dir),
                          engine__backend="cpu", **over)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("input-models") / "tiny-l2-s21"
    gen_model("tiny", 2, 21, d)
    return d


def tensor_offset(model_dir, name):
    """(file, absolute byte offset, shape) of tensor `name` in a checkpoint."""
    for fn in sorted(os.listdir(model_dir)):
        if not fn.endswith(".safetensors"):
            continue
        p = os.path.join(str(model_dir), fn)
        head, off = read_safetensors_header(p)
        if name in head:
            return p, off + head[name]["data_offsets"][0], head[name]["shape"]
    raise KeyError(name)


# A routed expert's scale (the daemon used to start healthy and answer NaN for
# every token routed there) and the shared expert's (the self-check used to
# fail, blaming the backend: exit 4), with both NaN codes.
NAN_CASES = [
    ("model.layers.1.mlp.experts.3.up_proj.weight_scale", 5, 2, 0x7F),
    ("model.layers.0.mlp.shared_experts.down_proj.weight_scale", 0, 0, 0xFF),
    ("model.layers.0.mlp.experts.7.gate_proj.weight_scale", 127, 15, 0xFF),
]


@pytest.mark.parametrize("tensor,row,block,code", NAN_CASES)
def test_nan_block_scale_refused(tmp_path, tiny_ckpt, tensor, row, block, code):
    model = tmp_path / "model"
    shutil.copytree(str(tiny_ckpt), str(model))
    path, off, shape = tensor_offset(model, tensor)
    assert row < shape[0] and block < shape[1]
    with open(path, "r+b") as f:
        f.seek(off + row * shape[1] + block)
        f.write(bytes([code]))
    rc, log = run_moed(tmp_path, config_for(tmp_path, model))
    want = ("tensor '%s': block scale at row %d, block %d (weights %d..%d of the row) is NaN "
            "(E4M3 byte 0x%02x)" % (tensor, row, block, 16 * block, 16 * block + 15, code))
    assert rc == EXIT_MODEL, log[-3000:]
    assert want in log, log[-3000:]
    assert "ready: socket" not in log


# ---- a checkpoint of any dims, written here (numpy + the safetensors layout)

def write_checkpoint(d, H, I, E=4, k=2, S=1, layers=1, seed=5):
    """An NVFP4 checkpoint with random codes and finite block scales."""
    rng = np.random.default_rng(seed)
    os.makedirs(str(d), exist_ok=True)
    with open(os.path.join(str(d), "config.json"), "w") as f:
        json.dump({"model_type": "deepseek_v3", "hidden_size": H, "moe_intermediate_size": I,
                   "n_routed_experts": E, "num_experts_per_tok": k, "n_shared_experts": S,
                   "num_hidden_layers": layers, "first_k_dense_replace": 0}, f)
    with open(os.path.join(str(d), "hf_quant_config.json"), "w") as f:
        json.dump({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}, f)
    t = {}
    for l in range(layers):
        for e in range(E + S):
            base = ("model.layers.%d.mlp.experts.%d." % (l, e) if e < E else
                    "model.layers.%d.mlp.shared_experts." % l)
            for proj, (n, kk) in (("gate_proj", (I, H)), ("up_proj", (I, H)),
                                  ("down_proj", (H, I))):
                scales = rng.uniform(0.5, 4.0, (n, kk // 16)).astype(ml_dtypes.float8_e4m3fn)
                t[base + proj + ".weight"] = (
                    "U8", rng.integers(0, 256, (n, kk // 2), dtype=np.uint8))
                t[base + proj + ".weight_scale"] = ("F8_E4M3", scales.view(np.uint8))
                t[base + proj + ".weight_scale_2"] = (
                    "F32", np.array(0.02 / np.sqrt(kk), dtype="<f4"))
    write_safetensors(os.path.join(str(d), "model.safetensors"), t)


def test_hidden_multiple_of_16_serves(tmp_path):
    """H=272 and I=48 are whole bytes and whole 16-weight scale blocks but not
    multiples of 32 (refused before): the CPU backend loads and serves them,
    matching the float64 reference."""
    import moed_client
    model = tmp_path / "h272"
    write_checkpoint(model, H=272, I=48)
    cfg = config_for(tmp_path, model)
    with du.Daemon(tmp_path, cfg) as d:
        c = moed_client.Client(d.sock_path, timeout=du.wait_s(30))
        info = c.hello()
        assert (info.hidden, info.inter) == (272, 48)
        ref = F64Reference(str(model))
        rng = np.random.default_rng(3)
        for t in (1, 5, 16):
            x = bf16_bits(rng.standard_normal((t, 272)).astype(np.float32))
            ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(t)]).astype(np.int32)
            w = rng.random((t, 2)).astype(np.float32)
            y = c.forward(0, x, ids, w)
            assert rel_l2(np.asarray(y), ref.forward(0, x, ids, w)) < 1e-2
        c.close()
        assert d.stop() == 0, d.log()[-3000:]


@pytest.mark.parametrize("H,I,what,n", [(280, 48, "hidden_size", 280),
                                        (272, 40, "moe_intermediate_size", 40)])
def test_size_not_whole_scale_blocks(tmp_path, H, I, what, n):
    model = tmp_path / "bad"
    write_checkpoint(model, H=H, I=I)
    rc, log = run_moed(tmp_path, config_for(tmp_path, model))
    assert rc == EXIT_MODEL, log[-3000:]
    assert ("config.json: %s %d is not a multiple of 16 (an NVFP4 row is whole 16-weight "
            "scale blocks: one E4M3 scale per 16 weights)" % (what, n)) in log, log[-3000:]


def test_socket_directory_missing(tmp_path, tiny_ckpt):
    """Named as a missing directory (it used to say "bind: permission
    denied"), and found before the model is loaded."""
    sock = str(tmp_path / "no" / "such" / "moed.sock")
    rc, log = run_moed(tmp_path, config_for(tmp_path, tiny_ckpt, server__socket=sock))
    assert rc == EXIT_RUNTIME, log[-3000:]
    assert ("server.socket %s: socket directory %s does not exist"
            % (sock, os.path.dirname(sock))) in log, log[-3000:]
    assert "loading model" not in log
    # a file where the directory should be
    (tmp_path / "file").write_text("")
    sock = str(tmp_path / "file" / "moed.sock")
    rc, log = run_moed(tmp_path, config_for(tmp_path, tiny_ckpt, server__socket=sock))
    assert rc == EXIT_RUNTIME, log[-3000:]
    assert "server.socket %s: %s is not a directory" % (
        sock, os.path.dirname(sock)) in log, log[-3000:]
