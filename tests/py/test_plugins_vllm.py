"""The vLLM plugin (moed_client/vllm_plugin.py) inside the real vLLM package,
against a real daemon on the CPU backend: `make test-integration` installs
vLLM into .venv-integ (without its GPU-only dependencies); in plain
`make test` vLLM is absent and every test here skips saying so.

What runs for real: vLLM's plugin loader (load_general_plugins, the entry
point of the installed client package), ModelOptNvFp4Config.FusedMoEMethodCls,
FusedMoEParallelConfig / FusedMoEConfig, RoutedExperts.load_weights with the
tiny checkpoint's expert tensors (ModelOpt NVFP4 layout, moectl gen-model),
determine_expert_map (EP). The RoutedExperts object is made without its
__init__ (which needs a vLLM config and process groups): its attributes are
set as __init__ sets them for the TP / EP layout under test.
"""

import os

import numpy as np
import pytest

import daemon_util as du
import moed_client
import plugin_cases as cases
from moed_client import _plugin_common as pc

TOL = 1e-2

try:
    import torch
    import vllm
    from vllm.model_executor.layers.fused_moe import config as fmc
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization import modelopt as mo
    SKIP = None
except Exception as e:  # ImportError, or a GPU-only module failing at import
    SKIP = "vLLM does not import here (%s: %s); `make test-integration` installs it" % (
        type(e).__name__, str(e).splitlines()[0] if str(e) else "")

if SKIP is not None:
    pytest.skip(SKIP, allow_module_level=True)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models_dir):
    yield from du.module_daemon(tmp_path_factory, models_dir, "vllm-plugin")


@pytest.fixture(scope="module")
def noshared(tmp_path_factory):
    yield from cases.noshared_daemon(tmp_path_factory, "vllm-noshared")


@pytest.fixture(scope="module")
def method_cls(noshared):
    """vLLM's own general-plugin loader run with MOED_SOCKET set."""
    from vllm.plugins import load_general_plugins
    env = {"MOED_SOCKET": noshared.sock_path, "VLLM_PLUGINS": "moed"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        load_general_plugins()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    return mo.ModelOptNvFp4Config.FusedMoEMethodCls


def parallel(tp=(0, 1), ep=(0, 1), dp=1, backend="naive", eplb=False):
    return fmc.FusedMoEParallelConfig(
        tp_size=tp[1], pcp_size=1, dp_size=dp, ep_size=ep[1], tp_rank=tp[0], pcp_rank=0,
        dp_rank=0, ep_rank=ep[0], sp_size=1, use_ep=ep[1] > 1, all2all_backend=backend,
        enable_eplb=eplb)


def moe_config(ref, par, n_local):
    return fmc.FusedMoEConfig(
        num_experts=ref.n_experts, experts_per_token=ref.top_k, hidden_dim=ref.hidden,
        intermediate_size=ref.inter, num_local_experts=n_local,
        num_logical_experts=ref.n_experts, activation=MoEActivation.SILU, device="cpu",
        routing_method=fmc.RoutingMethodType.Renormalize, moe_parallel_config=par,
        in_dtype=torch.bfloat16)


def quant_config():
    return mo.ModelOptNvFp4Config.from_config({"quant_algo": "NVFP4", "group_size": 16,
                                               "exclude_modules": []})


def build(method_cls, sock, ref, layer_id, tp=(0, 1), ep=(0, 1)):
    """A RoutedExperts with the attributes its __init__ sets, and its quant
    method built as ModelOptQuantConfigBase.get_quant_method builds it."""
    n_local, expert_map, _ = determine_expert_map(ep[1], ep[0], ref.n_experts)
    mc = moe_config(ref, parallel(tp, ep), n_local)
    layer = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(layer)
    layer.layer_name = "model.layers.%d.mlp.experts" % layer_id
    layer.moe_config = mc
    layer.ckpt_gate_proj_name, layer.ckpt_down_proj_name, layer.ckpt_up_proj_name = (
        "gate_proj", "down_proj", "up_proj")
    layer.is_fused_checkpoint_transposed = False
    layer.lora_base_layer_prefix = ""
    layer.global_num_experts = ref.n_experts
    layer.local_num_experts = n_local
    layer._expert_map = expert_map

    class _Maps:  # RoutedExperts.expert_map_manager: only this is read here
        num_fused_shared_experts = 0
    layer.expert_map_manager = _Maps()
    method = method_cls(quant_config=quant_config(), moe_config=mc)
    method.experts = pc.Experts(moed_client.Client(sock, timeout=du.wait_s(30)))
    layer.quant_method = method
    method.create_weights(layer, n_local, ref.hidden, ref.inter // tp[1], torch.bfloat16,
                          weight_loader=None, global_num_experts=ref.n_experts)
    return layer, method


def apply(method, layer, x, ids, w):
    return method.apply(layer, cases.torch_x(x), torch.from_numpy(np.asarray(w, np.float32)),
                        torch.from_numpy(np.asarray(ids, np.int32)), None, None)


# ------------------------------------------------------------------------------

def test_entry_point_sets_the_nvfp4_moe_method(method_cls):
    import importlib.metadata as md
    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "moed"]
    assert len(eps) == 1 and eps[0].value == "moed_client.vllm_plugin:register"
    assert method_cls.__name__ == "MoedNvFp4FusedMoE"
    print("vllm", vllm.__version__)


def test_no_expert_weights_and_load_weights_skips_the_checkpoint(method_cls, noshared):
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    layer, method = build(method_cls, noshared.sock_path, ref, lid)
    assert sum(p.numel() for p in layer.parameters()) == 0
    assert not method.is_monolithic
    base = layer.layer_name + "."
    weights = [(n[len(base):], torch.from_numpy(np.ascontiguousarray(t).view(np.uint8)))
               for n, t in ref.tensors.items() if n.startswith(base)]
    loaded = list(RoutedExperts.load_weights(layer, iter(weights)))
    assert len(weights) >= 3 * 3 * ref.n_experts and len(loaded) == len(weights)
    method.process_weights_after_loading(layer)
    assert sum(p.numel() for p in layer.parameters()) == 0


def test_tp2_one_rank_computes_routed_only(method_cls, noshared):
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    x, ids, w = cases.batch(ref, 6, seed=31)
    total = np.zeros((6, ref.hidden))
    for r in range(2):
        layer, method = build(method_cls, noshared.sock_path, ref, lid, tp=(r, 2))
        y = apply(method, layer, x, ids, w)
        assert y.dtype == torch.bfloat16 and tuple(y.shape) == (6, ref.hidden)
        total += cases.f64(y)
    assert du.rel_l2(total, cases.expect(ref, lid, x, ids, w, shared=False)) < TOL


def test_ep2_expert_map(method_cls, noshared):
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    x, ids, w = cases.batch(ref, 7, seed=32)
    ids[0] = [0, 1]
    total = np.zeros((7, ref.hidden))
    for r in range(2):
        layer, method = build(method_cls, noshared.sock_path, ref, lid, ep=(r, 2))
        assert layer._expert_map is not None
        total += cases.f64(apply(method, layer, x, ids, w))
    assert du.rel_l2(total, cases.expect(ref, lid, x, ids, w, shared=False)) < TOL


def test_shared_experts_stay_with_vllm(method_cls, daemon):
    """Against a model with a shared expert the plugin asks for the routed
    experts only (or refuses, with a version-1 client)."""
    ref = cases.tiny_reference(daemon)
    lid = cases.last_layer(daemon)
    layer, method = build(method_cls, daemon.sock_path, ref, lid)
    x, ids, w = cases.batch(ref, 3, seed=33)
    if not pc.client_supports(method.experts.client, "routed_only"):
        with pytest.raises(pc.MoedPluginError, match="routed experts only"):
            apply(method, layer, x, ids, w)
        pytest.skip("this moed_client's forward() has no 'routed_only' keyword")
    y = apply(method, layer, x, ids, w)
    assert du.rel_l2(cases.f64(y), cases.expect(ref, lid, x, ids, w, shared=False)) < TOL


def test_zero_tokens_and_a_batch_over_max_tokens(method_cls, noshared):
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    layer, method = build(method_cls, noshared.sock_path, ref, lid)
    x, ids, w = cases.batch(ref, 0, seed=34)
    assert tuple(apply(method, layer, x, ids, w).shape) == (0, ref.hidden)
    t = 2 * method.experts.info().max_tokens + 5
    x, ids, w = cases.batch(ref, t, seed=35)
    y = apply(method, layer, x, ids, w)
    assert du.rel_l2(cases.f64(y), cases.expect(ref, lid, x, ids, w, shared=False)) < TOL


def test_data_parallel_all2all_kernels_refused_eplb_supported(method_cls, noshared):
    """DP with EP over an all2all backend with kernels of its own is refused
    (vLLM would replace the method); DP over the gathering backends and
    EPLB are served (tests/py/test_plugin_vllm_fakes.py checks the sums)."""
    ref = cases.model_reference(noshared)
    mc = moe_config(ref, parallel(dp=2, ep=(0, 2), backend="deepep_low_latency"),
                    ref.n_experts // 2)
    with pytest.raises(pc.MoedPluginError, match="all2all backend 'deepep_low_latency'"):
        method_cls(quant_config=quant_config(), moe_config=mc)
    for par in (parallel(dp=2), parallel(dp=2, ep=(0, 2), backend="allgather_reducescatter")):
        method_cls(quant_config=quant_config(), moe_config=moe_config(ref, par, ref.n_experts))
    mc = moe_config(ref, parallel(eplb=True), ref.n_experts)
    method = method_cls(quant_config=quant_config(), moe_config=mc)
    assert method.supports_eplb is True
    layer = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(layer)
    layer.local_num_experts = ref.n_experts
    method.create_weights(layer, ref.n_experts, ref.hidden, ref.inter, torch.bfloat16)
    # EPLB's weight registration views every expert parameter [local, -1]
    shapes = [tuple(w.shape) for w in RoutedExperts.get_expert_weights(layer)]
    assert shapes and all(sh == (ref.n_experts, 1) for sh in shapes)
