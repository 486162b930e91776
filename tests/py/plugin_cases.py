"""Cases shared by the plugin tests of `make test` (test_plugin_logic.py,
numpy only) and of `make test-integration` (tests/integ/, the real SGLang
and vLLM packages): random batches on the tiny synthetic model, the
float64 reference of what the whole layer (all ranks summed) must give,
and a copy of that model without its shared expert."""

import json
import os
import shutil

import ml_dtypes
import numpy as np

import daemon_util as du
from conftest import F64Reference, gen_model


def batch(ref, t, seed, k=None):
    """(x bf16 [t, H] as ml_dtypes.bfloat16, ids int32 [t, k] distinct per row,
    w float32 [t, k])."""
    rng = np.random.default_rng(seed)
    k = ref.top_k if k is None else k
    x = rng.standard_normal((t, ref.hidden)).astype(np.float32).astype(ml_dtypes.bfloat16)
    ids = np.array([rng.choice(ref.n_experts, k, replace=False) for _ in range(t)],
                   dtype=np.int32).reshape(t, k)
    w = rng.random((t, k)).astype(np.float32)
    return x, ids, w


def expect(ref, layer, x, ids, w, shared=True):
    """float64 reference of the layer's output (the shared experts with
    weight 1 when shared, else the routed experts only); ids of -1 are
    empty slots (weight 0)."""
    ids = np.asarray(ids)
    w = np.where(ids < 0, 0.0, w).astype(np.float32)
    ids = np.where(ids < 0, 0, ids)
    saved = ref.n_shared
    ref.n_shared = saved if shared else 0
    try:
        return ref.forward(layer, x.view(np.uint16), ids, w)
    finally:
        ref.n_shared = saved


def f64(y):
    """A bf16 result (numpy ml_dtypes or torch) as float64 numpy."""
    if type(y).__module__.split(".")[0] == "torch":
        return y.float().cpu().numpy().astype(np.float64)
    return np.asarray(y).astype(np.float64)


def tiny_reference(daemon):
    return F64Reference(du.synth_dir(daemon.cfg["model"]["synthetic_dir"]))


def noshared_model(out_dir):
    """The tiny preset (seed 13, 2 layers) with n_shared_experts set to 0 in
    its config.json: a model whose layer is routed experts only (its shared
    tensors stay in the files, unused)."""
    src = os.path.join(str(out_dir), "tiny-src")
    gen_model("tiny", 2, 13, src)
    dst = os.path.join(str(out_dir), "tiny-noshared")
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["n_shared_experts"] = 0
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def ep_local_ids(ids, ep_rank, n_local):
    """What SGLang's StandardDispatcher hands EP rank ep_rank: global id g
    of this rank's block [ep_rank*n_local, (ep_rank+1)*n_local) becomes
    g - ep_rank*n_local, any other id -1 (token_dispatcher/standard.py,
    _map_topk_ids_to_local_experts)."""
    lo = ep_rank * n_local
    mine = (ids >= lo) & (ids < lo + n_local)
    return np.where(mine, ids - lo, -1).astype(np.int32)


def noshared_daemon(tmp_path_factory, name):
    """Body of a module-scoped fixture (`yield from` it): a daemon on
    noshared_model, which must exit cleanly at the end."""
    tmp = tmp_path_factory.mktemp(name)
    cfg = du.base_config(str(tmp), str(tmp), status__port=du.free_port(),
                         model__path=noshared_model(tmp))
    with du.Daemon(tmp, cfg) as d:
        yield d
        assert d.stop() == 0, d.log()[-4000:]


def model_reference(d):
    """F64Reference of the model a daemon serves."""
    path = d.cfg["model"]["path"]
    return tiny_reference(d) if path.startswith("synthetic:") else F64Reference(path)


def last_layer(d):
    """The last (MoE) layer of the daemon's model."""
    import moed_client
    with moed_client.Client(d.sock_path) as c:
        return c.hello().n_layers - 1


def torch_x(x):
    """A bf16 numpy batch as a torch bf16 tensor."""
    import torch
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
