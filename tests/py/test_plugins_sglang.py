"""The SGLang plugin (moed_client/sglang_plugin.py) inside the real SGLang
package, against a real daemon on the CPU backend: `make test-integration`
installs SGLang into .venv-integ (without its GPU-only dependencies); in
plain `make test` SGLang is absent and every test here skips saying so.

What runs for real: SGLang's plugin loader (load_plugins, the entry point
of the installed client package), ModelOptFp4Config and its
get_quant_method on a FusedMoE instance, FusedMoE.make_expert_params_mapping
for the loader's names of the tiny checkpoint's expert tensors (written by
moectl gen-model in the ModelOpt NVFP4 layout),
_fuses_routed_scaling_factor_in_topk, MoeRunnerConfig, the dispatcher's
_map_topk_ids_to_local_experts (EP), StandardTopKOutput /
StandardDispatchOutput / StandardCombineInput, TritonKernelTopKOutput. The
FusedMoE object is made without its __init__ (which needs SGLang's server
args and process groups): its attributes are set as __init__ sets them for
the TP / EP layout under test.
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
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.fused_moe_triton import layer as fm_layer
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher import standard as sd
    from sglang.srt.layers.moe.topk import StandardTopKOutput, TritonKernelTopKOutput
    from sglang.srt.layers.quantization import modelopt_quant as mq
    import sglang
    SKIP = None
except Exception as e:  # ImportError, or a GPU-only module failing at import
    SKIP = "SGLang does not import here (%s: %s); `make test-integration` installs it" % (
        type(e).__name__, str(e).splitlines()[0] if str(e) else "")

if SKIP is not None:
    pytest.skip(SKIP, allow_module_level=True)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models_dir):
    yield from du.module_daemon(tmp_path_factory, models_dir, "sglang-plugin")


@pytest.fixture(scope="module")
def noshared(tmp_path_factory):
    yield from cases.noshared_daemon(tmp_path_factory, "sglang-noshared")


@pytest.fixture(scope="module")
def registered(daemon):
    """SGLang's own plugin loader run with MOED_SOCKET set."""
    from sglang.srt.plugins import load_plugins
    old = os.environ.get("MOED_SOCKET")
    os.environ["MOED_SOCKET"] = daemon.sock_path
    try:
        load_plugins()
    finally:
        if old is None:
            os.environ.pop("MOED_SOCKET")
        else:
            os.environ["MOED_SOCKET"] = old
    return mq.ModelOptFp4Config.get_quant_method


def quant_config():
    return mq.ModelOptFp4Config.from_config({"quant_algo": "NVFP4", "group_size": 16,
                                              "ignore": ["lm_head"]})


def make_layer(ref, layer_id, *, tp=(0, 1), ep=(0, 1), fused_shared=0, rsf=None):
    """A FusedMoE with the attributes FusedMoE.__init__ sets (fused_moe_triton/layer.py)
    for moe_tp_rank/size tp and moe_ep_rank/size ep."""
    layer = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(layer)
    n_routed = ref.n_experts
    layer.layer_id = layer_id
    layer.top_k = ref.top_k + fused_shared
    layer.hidden_size = ref.hidden
    layer.num_experts = n_routed + fused_shared
    layer.num_fused_shared_experts = fused_shared
    layer.moe_tp_rank, layer.moe_tp_size = tp
    layer.moe_ep_rank, layer.moe_ep_size = ep
    layer._num_global_routed = n_routed
    layer.num_local_experts = n_routed // ep[1] + fused_shared
    layer.intermediate_size_per_partition = ref.inter // tp[1]
    layer.moe_runner_config = MoeRunnerConfig(
        num_experts=layer.num_experts, num_local_experts=layer.num_local_experts,
        hidden_size=ref.hidden, intermediate_size_per_partition=layer.intermediate_size_per_partition,
        layer_id=layer_id, top_k=layer.top_k, num_fused_shared_experts=fused_shared,
        params_dtype=torch.bfloat16, routed_scaling_factor=rsf, layer=layer)
    return layer


def build(registered, sock, ref, layer_id, prefix=None, **kw):
    """The layer's quant method the way FusedMoE.__init__ gets and sets it up."""
    layer = make_layer(ref, layer_id, **kw)
    method = quant_config().get_quant_method(
        layer, prefix or "model.layers.%d.mlp.experts" % layer_id)
    assert type(method).__name__ == "MoedFusedMoEMethod"
    method.experts = pc.Experts(moed_client.Client(sock, timeout=du.wait_s(30)))
    layer.quant_method = method
    method.create_weights(layer=layer, num_experts=layer.num_local_experts,
                          hidden_size=ref.hidden,
                          intermediate_size_per_partition=layer.intermediate_size_per_partition,
                          params_dtype=torch.bfloat16, weight_loader=None, with_bias=False,
                          moe_intermediate_size=ref.inter)
    method.create_moe_runner(layer, layer.moe_runner_config)
    layer.runner_backend = method.get_moe_runner_backend(layer)
    layer.should_fuse_routed_scaling_factor_in_topk = \
        fm_layer._fuses_routed_scaling_factor_in_topk(method, layer.runner_backend)
    return layer, method


def dispatch(x, ids, w):
    topk = StandardTopKOutput(topk_weights=torch.from_numpy(np.asarray(w, np.float32)),
                              topk_ids=torch.from_numpy(np.asarray(ids, np.int32)),
                              router_logits=torch.zeros(len(ids), 1))
    return sd.StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                     topk_output=topk)


# ------------------------------------------------------------------------------

def test_entry_point_patches_modelopt_fp4(registered):
    import importlib.metadata as md
    eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "moed"]
    assert len(eps) == 1 and eps[0].value == "moed_client.sglang_plugin:register"
    assert registered.__wrapped__ is not None
    print("sglang", sglang.__version__)


def test_no_expert_weights_and_the_loader_skips_the_checkpoint(registered, daemon):
    ref = cases.tiny_reference(daemon)
    lid = cases.last_layer(daemon)
    layer, method = build(registered, daemon.sock_path, ref, lid)
    params = dict(layer.named_parameters())
    assert set(params) == set(pc.EXPERT_PARAMS)
    assert sum(p.numel() for p in params.values()) == 0
    # every expert tensor of the checkpoint, named as FusedMoE's mapping
    # names it (the model's load_weights, e.g. models/qwen3_moe.py), lands
    # on a placeholder whose loader drops it
    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj", num_experts=ref.n_experts)
    base = "model.layers.%d.mlp." % lid
    n = 0
    for name, tensor in ref.tensors.items():
        if not name.startswith(base + "experts."):
            continue
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                mapped = name.replace(weight_name, param_name)[len(base + "experts."):]
                p = params[mapped]
                assert p.weight_loader(p, torch.from_numpy(np.ascontiguousarray(tensor).view(
                    np.uint8)), mapped, shard_id=shard_id, expert_id=expert_id) is True
                n += 1
                break
        else:
            raise AssertionError("expert tensor %s has no placeholder" % name)
    assert n >= 3 * 3 * ref.n_experts  # weight, weight_scale, weight_scale_2 of 3 projections
    method.process_weights_after_loading(layer)
    assert sum(p.numel() for p in layer.parameters()) == 0


def test_shared_expert_kept_by_sglang_means_routed_only(registered, daemon):
    """SGLang computes the (unfused) shared expert itself: moed must leave
    its own out, or refuse when the client cannot ask for that."""
    ref = cases.tiny_reference(daemon)
    lid = cases.last_layer(daemon)
    layer, method = build(registered, daemon.sock_path, ref, lid)
    x, ids, w = cases.batch(ref, 3, seed=29)
    d = dispatch(cases.torch_x(x), ids, w)
    if not pc.client_supports(method.experts.client, "routed_only"):
        with pytest.raises(pc.MoedPluginError, match="routed experts only"):
            method.apply(layer, d)
        pytest.skip("this moed_client's forward() has no 'routed_only' keyword")
    y = method.apply(layer, d).hidden_states
    assert du.rel_l2(cases.f64(y), cases.expect(ref, lid, x, ids, w, shared=False)) < TOL


def test_excluded_and_dense_layers_keep_sglangs_methods(registered, daemon):
    ref = cases.tiny_reference(daemon)
    layer = make_layer(ref, 0)
    qc = mq.ModelOptFp4Config.from_config({"quant_algo": "NVFP4", "group_size": 16,
                                            "ignore": ["model.layers.0.mlp.experts"]})
    assert qc.get_quant_method(layer, "model.layers.0.mlp.experts") is None


def test_tp2_one_rank_computes(registered, noshared):
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    x, ids, w = cases.batch(ref, 6, seed=21)
    total = np.zeros((6, ref.hidden))
    for r in range(2):
        layer, method = build(registered, noshared.sock_path, ref, lid, tp=(r, 2))
        out = method.apply(layer, dispatch(cases.torch_x(x), ids, w))
        assert isinstance(out, sd.StandardCombineInput)
        y = out.hidden_states
        assert y.dtype == torch.bfloat16 and tuple(y.shape) == (6, ref.hidden)
        if r:
            assert not y.any()
        total += cases.f64(y)
    assert du.rel_l2(total, cases.expect(ref, lid, x, ids, w)) < TOL


def test_ep2_dispatcher_local_ids(registered, noshared):
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    x, ids, w = cases.batch(ref, 7, seed=22)
    ids[0] = [0, 1]
    total = np.zeros((7, ref.hidden))
    n_local = ref.n_experts // 2
    for r in range(2):
        layer, method = build(registered, noshared.sock_path, ref, lid, ep=(r, 2))
        mapping = torch.full((ref.n_experts,), -1, dtype=torch.int32)  # as StandardDispatcher
        mapping[r * n_local:(r + 1) * n_local] = torch.arange(n_local, dtype=torch.int32)
        local = sd._map_topk_ids_to_local_experts(torch.from_numpy(ids), mapping)
        y = method.apply(layer, dispatch(cases.torch_x(x), local.numpy(), w)).hidden_states
        total += cases.f64(y)
    assert du.rel_l2(total, cases.expect(ref, lid, x, ids, w)) < TOL


def test_ep2_with_a_shared_expert_needs_routed_only(registered, daemon):
    if not pc.client_supports(moed_client.Client, "routed_only"):
        pytest.skip("this moed_client's forward() has no 'routed_only' keyword")
    ref = cases.tiny_reference(daemon)
    lid = cases.last_layer(daemon)
    x, ids, w = cases.batch(ref, 5, seed=23)
    total = np.zeros((5, ref.hidden))
    n_local = ref.n_experts // 2
    for r in range(2):
        layer, method = build(registered, daemon.sock_path, ref, lid, ep=(r, 2),
                              fused_shared=1)
        local = cases.ep_local_ids(ids, r, n_local)
        local = np.concatenate([local, np.full((5, 1), n_local, np.int32)], axis=1)
        w3 = np.concatenate([w, np.ones((5, 1), np.float32)], axis=1)
        total += cases.f64(method.apply(layer, dispatch(cases.torch_x(x), local, w3)).hidden_states)
    assert du.rel_l2(total, cases.expect(ref, lid, x, ids, w)) < TOL


def test_fused_shared_column_and_routed_scaling(registered, daemon):
    ref = cases.tiny_reference(daemon)
    lid = cases.last_layer(daemon)
    x, ids, w = cases.batch(ref, 5, seed=24)
    rsf = 2.5
    want = cases.expect(ref, lid, x, ids, w * np.float32(rsf))
    ids3 = np.concatenate([ids, np.full((5, 1), ref.n_experts, np.int32)], axis=1)
    layer, method = build(registered, daemon.sock_path, ref, lid, fused_shared=1, rsf=rsf)
    # SGLang folds the factor into top-k for this method (its flag)
    assert layer.should_fuse_routed_scaling_factor_in_topk
    w3 = np.concatenate([w * np.float32(rsf), np.ones((5, 1), np.float32)], axis=1)
    y = method.apply(layer, dispatch(cases.torch_x(x), ids3, w3)).hidden_states
    assert du.rel_l2(cases.f64(y), want) < TOL
    # a layer whose top-k did not fold it: the plugin multiplies it in once
    layer.should_fuse_routed_scaling_factor_in_topk = False
    w3 = np.concatenate([w, np.ones((5, 1), np.float32)], axis=1)
    y = method.apply(layer, dispatch(cases.torch_x(x), ids3, w3)).hidden_states
    assert du.rel_l2(cases.f64(y), want) < TOL


def test_eplb_physical_ids(registered, noshared, monkeypatch):
    import sglang.srt.eplb.expert_location_dispatch as eld
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    rng = np.random.default_rng(25)
    p2l = rng.permutation(np.concatenate([np.arange(8), rng.choice(8, 4, replace=False)]))

    class Meta:  # the attribute KTEPWrapperMethod reads
        physical_to_logical_map_cpu = {lid: torch.from_numpy(p2l)}

    monkeypatch.setattr(eld, "get_global_expert_location_metadata", lambda: Meta)
    layer, method = build(registered, noshared.sock_path, ref, lid)
    layer.num_experts = layer._num_global_routed = layer.num_local_experts = 12
    rows = []
    while len(rows) < 5:
        p = rng.choice(12, 2, replace=False)
        if p2l[p[0]] != p2l[p[1]]:
            rows.append(p)
    phys = np.array(rows, dtype=np.int32)
    x, _, w = cases.batch(ref, 5, seed=26)
    y = method.apply(layer, dispatch(cases.torch_x(x), phys, w)).hidden_states
    assert du.rel_l2(cases.f64(y), cases.expect(ref, lid, x, p2l[phys], w)) < TOL
    # without EPLB's map, redundant physical ids are refused, not guessed
    monkeypatch.setattr(eld, "get_global_expert_location_metadata", lambda: None)
    layer2, method2 = build(registered, noshared.sock_path, ref, lid)
    layer2.num_experts = layer2._num_global_routed = layer2.num_local_experts = 12
    with pytest.raises(pc.MoedPluginError, match="12 routed experts, the daemon.s model 8"):
        method2.apply(layer2, dispatch(cases.torch_x(x), phys, w))


def test_zero_tokens_and_a_batch_over_max_tokens(registered, noshared):
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    layer, method = build(registered, noshared.sock_path, ref, lid)
    x, ids, w = cases.batch(ref, 0, seed=27)
    y = method.apply(layer, dispatch(cases.torch_x(x), ids, w)).hidden_states
    assert tuple(y.shape) == (0, ref.hidden)
    t = 2 * method.experts.info().max_tokens + 9
    x, ids, w = cases.batch(ref, t, seed=28)
    y = method.apply(layer, dispatch(cases.torch_x(x), ids, w)).hidden_states
    assert du.rel_l2(cases.f64(y), cases.expect(ref, lid, x, ids, w, shared=False)) < TOL


def test_unsupported_outputs_refused(registered, daemon):
    ref = cases.tiny_reference(daemon)
    lid = cases.last_layer(daemon)
    layer, method = build(registered, daemon.sock_path, ref, lid)
    x = torch.zeros(2, ref.hidden, dtype=torch.bfloat16)
    tk = TritonKernelTopKOutput(None, None, None, None, 2)
    with pytest.raises(pc.MoedPluginError, match="TritonKernelTopKOutput"):
        method.apply(layer, sd.StandardDispatchOutput(x, None, tk))

    class DeepEPLike:  # DeepEP's dispatch outputs carry ids, not topk_output
        hidden_states = x
        topk_ids = torch.zeros(2, 2, dtype=torch.int32)

    with pytest.raises(pc.MoedPluginError, match="DeepEP"):
        method.apply(layer, DeepEPLike())
