"""The vLLM plugin's method (moed_client/vllm_plugin.py) under EPLB and data
parallelism, without vLLM: its layer, configs, router and runner are fakes
shaped like vLLM's own classes, the daemon is real (CPU backend, the tiny
model without a shared expert: vLLM computes shared experts itself, so the
method asks for routed experts only). `make test-integration` runs the
method inside the real vLLM package (tests/py/test_plugins_vllm.py).

Mirrored (vllm-project/vllm, the stored versions named by commit):
- FusedMoEParallelConfig fields and make()'s flattening of TP across DP
  (tp_rank = dp_rank * tp_size + tp_rank without EP; ep_rank = that, tp 1
  with EP): vllm/model_executor/layers/fused_moe/config.py,
  flatten_tp_across_dp_and_pcp / make;
- RoutedExperts: layer_name, global_num_experts, local_num_experts, the
  _expert_map buffer behind the expert_map property, get_expert_weights
  (each parameter viewed [local experts, -1], input scales left out):
  fused_moe/routed_experts.py @ 002d6073;
- the router's EPLB step: per flattened top-k slot i of logical expert e,
  replica i % max(1, logical_replica_count[e]) of logical_to_physical_map[e]
  and an add of 1 into expert_load_view[physical]:
  fused_moe/router/base_router.py @ 03919875, _eplb_map_and_record_i32_kernel;
- the maps: logical_to_physical_map[e] lists e's physical slots in physical
  order, -1 padded (distributed/eplb/eplb_state.py, compute_logical_maps),
  committed in place on a rearrangement (_commit_eplb_maps: copy_);
- the runner: MoERunner.eplb_state -> its router's EplbLayerState, found
  by layer_name (runner/moe_runner.py @ 01cb3084, get_layer_from_name);
- data parallelism: the runner's naive dispatch all-gathers every DP rank's
  tokens before apply and combine sums the ranks' outputs
  (MoERunner._maybe_dispatch / _maybe_combine, AgRsAll2AllManager in
  distributed/device_communicators/all2all.py);
- linear expert placement under EP: rank r holds physical experts
  [r * n_local, (r + 1) * n_local) (expert_map_manager.determine_expert_map).
"""

import types
from dataclasses import dataclass

import numpy as np
import pytest

import daemon_util as du
import moed_client
import plugin_cases as cases
from moed_client import _plugin_common as pc
from moed_client import vllm_plugin as vp

torch = pytest.importorskip("torch")

TOL = 1e-2


@pytest.fixture(scope="module")
def noshared(tmp_path_factory):
    yield from cases.noshared_daemon(tmp_path_factory, "vllm-fakes")


@dataclass
class ParallelConfig:
    """FusedMoEParallelConfig's fields (config.py)."""
    tp_size: int
    pcp_size: int
    dp_size: int
    ep_size: int
    tp_rank: int
    pcp_rank: int
    dp_rank: int
    ep_rank: int
    sp_size: int
    use_ep: bool
    all2all_backend: str
    enable_eplb: bool

    @staticmethod
    def make(tp=(0, 1), dp=(0, 1), ep=False, backend="allgather_reducescatter", eplb=False,
             pcp=1):
        """As FusedMoEParallelConfig.make: TP flattened across DP; with EP
        the flattened ranks become EP ranks."""
        flat_size, flat_rank = dp[1] * pcp * tp[1], dp[0] * pcp * tp[1] + tp[0]
        if not ep:
            return ParallelConfig(flat_size, pcp, dp[1], 1, flat_rank, 0, dp[0], 0, 1, False,
                                  backend, eplb)
        return ParallelConfig(1, pcp, dp[1], flat_size, 0, 0, dp[0], flat_rank, 1, True,
                              backend, eplb)


@dataclass
class MoEConfig:
    """The FusedMoEConfig fields the method reads."""
    num_experts: int          # physical, redundant EPLB experts included
    num_logical_experts: int
    num_local_experts: int
    moe_parallel_config: ParallelConfig


class RoutedExperts(torch.nn.Module):
    """routed_experts.py's RoutedExperts as the method sees it."""

    NON_EXPERT_WEIGHTS = {"e_score_correction_bias", "w13_input_scale", "w2_input_scale"}

    def __init__(self, layer_name, moe, expert_map):
        super().__init__()
        self.layer_name = layer_name
        self.global_num_experts = moe.num_experts
        self.local_num_experts = moe.num_local_experts
        self.register_buffer("_expert_map", expert_map, persistent=False)

    @property
    def expert_map(self):
        return self._expert_map

    def get_expert_weights(self):
        return [w.view(self.local_num_experts, -1) for n, w in self.named_parameters()
                if n not in self.NON_EXPERT_WEIGHTS and w.shape != torch.Size([])]


def expert_map(n_physical, ep_size, ep_rank):
    """determine_expert_map, linear placement: None without EP."""
    if ep_size == 1:
        return None
    n_local = n_physical // ep_size
    m = torch.full((n_physical,), -1, dtype=torch.int32)
    m[ep_rank * n_local:(ep_rank + 1) * n_local] = torch.arange(n_local, dtype=torch.int32)
    return m


def logical_maps(p2l, n_logical, slots):
    """compute_logical_maps for one layer: (logical_to_physical [E, slots]
    -1 padded, logical_replica_count [E])."""
    l2p = torch.full((n_logical, slots), -1, dtype=torch.int64)
    count = torch.zeros(n_logical, dtype=torch.int64)
    for p, e in enumerate(p2l.tolist()):
        if e >= 0:
            l2p[e, count[e]] = p
            count[e] += 1
    return l2p, count


def eplb_route(logical_ids, state):
    """The router's EPLB step (base_router.py): logical -> physical ids,
    the load recorded into expert_load_view."""
    flat = logical_ids.reshape(-1).long()
    count = state.logical_replica_count[flat].clamp(min=1)
    replica = torch.arange(flat.numel()) % count
    phys = state.logical_to_physical_map[flat, replica]
    state.expert_load_view.index_add_(0, phys, torch.ones_like(phys))
    return phys.reshape(logical_ids.shape).to(torch.int32)


class Runner:
    """MoERunner: eplb_state is its router's EplbLayerState."""

    def __init__(self, state):
        self.router = types.SimpleNamespace(eplb_state=state)

    @property
    def eplb_state(self):
        return self.router.eplb_state


def method_cls():
    """_Method on a stand-in for FusedMoEMethodBase, whose __init__ sets
    self.moe (fused_moe_method_base.py)."""
    return type("MoedNvFp4FusedMoE", (vp._Method,),
                {"_base_init": lambda self, moe: setattr(self, "moe", moe)})


def build(sock, ref, lid, par, n_physical=None, layers=None):
    """A RoutedExperts and its moed method, created as RoutedExperts.__init__
    creates them (quant method, then create_weights with the local count)."""
    n_physical = n_physical or ref.n_experts
    n_local = n_physical // par.ep_size
    moe = MoEConfig(n_physical, ref.n_experts, n_local, par)
    name = "model.layers.%d.mlp.experts" % lid
    layer = RoutedExperts(name, moe, expert_map(n_physical, par.ep_size, par.ep_rank))
    method = method_cls()(quant_config=None, moe_config=moe,
                          experts=pc.Experts(moed_client.Client(sock, timeout=du.wait_s(30))))
    method._layers = layers
    method.create_weights(layer, n_local, ref.hidden, ref.inter, torch.bfloat16)
    method.process_weights_after_loading(layer)
    return layer, method


def apply(method, layer, x, ids, w):
    return method.apply(layer, cases.torch_x(x), torch.from_numpy(np.asarray(w, np.float32)),
                        torch.as_tensor(ids), None, None)


def random_p2l(rng, n_logical, n_physical):
    """Every logical expert at least once, the rest redundant copies."""
    extra = rng.choice(n_logical, n_physical - n_logical, replace=True)
    return torch.from_numpy(rng.permutation(np.concatenate([np.arange(n_logical), extra])))


# ------------------------------------------------------------------------------

def test_eplb_physical_ids_through_the_layers_own_map(noshared):
    """EP=2 with 4 redundant experts (12 physical): each rank maps the
    router's physical ids back through the runner's logical_to_physical_map,
    the ranks' sum is the layer; after an in-place rearrangement the new map
    is used (the old one would give another layer); the method records no
    load of its own (the router does)."""
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    E, P, slots = ref.n_experts, ref.n_experts + 4, 3
    rng = np.random.default_rng(41)
    l2p, count = logical_maps(random_p2l(rng, E, P), E, slots)
    state = types.SimpleNamespace(logical_to_physical_map=l2p, logical_replica_count=count,
                                  expert_load_view=torch.zeros(P, dtype=torch.int64))
    ranks = []
    for r in range(2):
        par = ParallelConfig.make(tp=(r, 2), ep=True, eplb=True)
        layer, method = build(noshared.sock_path, ref, lid, par, n_physical=P)
        layers = {layer.layer_name: Runner(state)}
        method._layers = layers
        assert method.supports_eplb
        # EPLB's weight registration works on the placeholders: one byte per expert
        assert [tuple(w.shape) for w in layer.get_expert_weights()] == [(P // 2, 1)] * 6
        ranks.append((layer, method))

    def layer_sum(x, phys, w):
        return sum(cases.f64(apply(m, ly, x, phys, w)) for ly, m in ranks)

    x, ids, w = cases.batch(ref, 9, seed=42)
    phys = eplb_route(torch.from_numpy(ids), state)
    assert (phys >= E).any()  # redundant copies are routed to
    load = state.expert_load_view.clone()
    assert int(load.sum()) == ids.size
    y = layer_sum(x, phys, w)
    assert torch.equal(state.expert_load_view, load)
    assert du.rel_l2(y, cases.expect(ref, lid, x, ids, w, shared=False)) < TOL

    # EPLB rearranges: the committed map changes in place
    old = l2p.clone()
    l2p2, count2 = logical_maps(random_p2l(rng, E, P), E, slots)
    state.logical_to_physical_map.copy_(l2p2)
    state.logical_replica_count.copy_(count2)
    phys2 = eplb_route(torch.from_numpy(ids), state)
    y2 = layer_sum(x, phys2, w)
    assert du.rel_l2(y2, cases.expect(ref, lid, x, ids, w, shared=False)) < TOL
    # what the old map would have made of the new physical ids: another layer
    stale = pc.p2l_from_l2p(old, P)[phys2.numpy()]
    assert du.rel_l2(cases.expect(ref, lid, x, stale, w, shared=False),
                     cases.expect(ref, lid, x, ids, w, shared=False)) > 0.1


def test_eplb_without_a_runner_state_is_refused(noshared):
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    par = ParallelConfig.make(eplb=True)
    layer, method = build(noshared.sock_path, ref, lid, par, layers={})
    x, ids, w = cases.batch(ref, 2, seed=43)
    with pytest.raises(pc.MoedPluginError, match="no EPLB map"):
        apply(method, layer, x, ids, w)


def test_eplb_device_table_is_the_host_table():
    """device_p2l (the doorbell path's, on the map's device) inverts the map
    as p2l_from_l2p does, unused physical slots -1."""
    rng = np.random.default_rng(44)
    p2l = random_p2l(rng, 8, 12)
    p2l[5] = -1  # a slot holding no expert (elastic EP scale-up)
    l2p, _ = logical_maps(p2l, 8, 4)
    host = pc.p2l_from_l2p(l2p, 12)
    assert host.tolist() == p2l.tolist()
    assert pc.device_p2l(l2p, 12).tolist() == host.tolist()
    t = pc.id_table(12, 8, p2l=host)
    assert t[5] == -1 and (t[np.arange(12) != 5] >= 0).all()


@pytest.mark.parametrize("dp,tp,ep", [(2, 1, False), (2, 2, False), (2, 1, True),
                                      (2, 2, True)])
def test_data_parallel_ranks_sum_to_the_gathered_layer(noshared, dp, tp, ep):
    """DP ranks: apply() sees every DP rank's tokens (the runner's
    all-gather); the sum over all DP x TP ranks (combine, then the TP
    all-reduce) is the layer for the gathered batch. Without EP one rank of
    the flattened group computes; with EP each computes its own experts."""
    ref = cases.model_reference(noshared)
    lid = cases.last_layer(noshared)
    parts = [cases.batch(ref, 3 + 2 * d, seed=50 + d) for d in range(dp)]
    x = np.concatenate([p[0] for p in parts])
    ids = np.concatenate([p[1] for p in parts])
    w = np.concatenate([p[2] for p in parts])
    total, computing = np.zeros((x.shape[0], ref.hidden)), 0
    for d in range(dp):
        for t in range(tp):
            par = ParallelConfig.make(tp=(t, tp), dp=(d, dp), ep=ep)
            layer, method = build(noshared.sock_path, ref, lid, par)
            y = cases.f64(apply(method, layer, x, ids, w))
            computing += bool(np.abs(y).sum())
            total += y
    n_local = ref.n_experts // (dp * tp)
    assert computing == (len(set((ids // n_local).ravel().tolist())) if ep else 1)
    assert du.rel_l2(total, cases.expect(ref, lid, x, ids, w, shared=False)) < TOL


def test_parallel_layouts_refused_with_a_reason():
    for backend in ("deepep_low_latency", "deepep_high_throughput", "mori",
                    "flashinfer_nvlink_one_sided"):
        with pytest.raises(pc.MoedPluginError, match="all2all backend '%s'" % backend):
            vp.check_parallel(ParallelConfig.make(dp=(0, 2), ep=True, backend=backend))
    with pytest.raises(pc.MoedPluginError, match="prefill context parallelism"):
        vp.check_parallel(ParallelConfig.make(tp=(0, 2), ep=True, pcp=2))
    for ok in (ParallelConfig.make(dp=(1, 2)),
               ParallelConfig.make(dp=(1, 2), ep=True),
               ParallelConfig.make(dp=(1, 2), ep=True, backend="naive"),
               ParallelConfig.make(tp=(1, 2), ep=True, backend="deepep_low_latency"),
               ParallelConfig.make(pcp=2)):
        vp.check_parallel(ok)
