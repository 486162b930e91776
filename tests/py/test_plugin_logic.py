"""The framework-free logic of the SGLang / vLLM plugins
(moed_client/_plugin_common.py) against a real daemon on the tiny model:
tensor- and expert-parallel ranks whose outputs summed give the layer's
output, EPLB physical ids, fused shared-expert columns, the routed scaling
applied once, T = 0 and T over max_tokens. The plugins themselves, inside
the real frameworks' structures, are tested by `make test-integration`
(tests/integ/)."""

import numpy as np
import pytest

import daemon_util as du
import moed_client
import plugin_cases as cases
from moed_client import _plugin_common as pc

TOL = 1e-2


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models_dir):
    yield from du.module_daemon(tmp_path_factory, models_dir, "plugin")


@pytest.fixture(scope="module")
def noshared(tmp_path_factory):
    yield from cases.noshared_daemon(tmp_path_factory, "plugin-noshared")


def experts_of(d):
    return pc.Experts(moed_client.Client(d.sock_path, timeout=du.wait_s(30)))


def layer_of(ex):
    """The model's last MoE layer."""
    return ex.info().n_layers - 1


def needs(ex, keyword):
    if not pc.client_supports(ex.client, keyword):
        pytest.skip("this moed_client's forward() has no %r keyword (protocol version 2, "
                    "issue 11's client side)" % keyword)


# --- pure logic ----------------------------------------------------------------

def test_enabled_by_the_socket_setting():
    assert not pc.enabled({})
    assert not pc.enabled({"MOED_SOCKET": " "})
    assert pc.enabled({"MOED_SOCKET": "/run/moed/moed.sock"})
    assert not pc.enabled({"MOED_SOCKET": "/run/moed/moed.sock", "MOED_PLUGIN": "0"})
    assert pc.enabled({"MOED_SOCKET": "/run/moed/moed.sock", "MOED_PLUGIN": "1"})
    assert not pc.enabled({"MOED_PLUGIN": "1"})


def test_id_table_maps_ranks_slots_and_eplb():
    # plain: the identity, fused shared slots after the routed ids -> -1
    t = pc.id_table(10, 8, n_routed_incoming=8)
    assert t.tolist() == list(range(8)) + [-1, -1]
    # EP rank 1 of 2: local id l is physical 4 + l
    t = pc.id_table(5, 8, n_routed_incoming=4, offset=4)
    assert t.tolist() == [4, 5, 6, 7, -1]
    # EPLB: physical -> logical through the map
    p2l = np.array([3, 1, 0, 2, 3, 1], dtype=np.int64)
    assert pc.id_table(6, 4, p2l=p2l).tolist() == p2l.tolist()
    # redundant physical experts without a map land outside the model
    with pytest.raises(pc.MoedPluginError, match="outside the daemon's 8 experts"):
        pc.id_table(12, 8)


def test_p2l_inverts_the_eplb_map():
    l2p = np.array([[0, 5], [1, -1], [2, 4], [3, -1]])
    p2l = pc.p2l_from_l2p(l2p, 6)
    assert p2l.tolist() == [0, 1, 2, 3, 2, 0]
    for logical, row in enumerate(l2p):
        for p in row[row >= 0]:
            assert p2l[p] == logical
    with pytest.raises(pc.MoedPluginError):
        pc.p2l_from_l2p(np.array([[7]]), 6)


def test_map_ids_keeps_empty_slots_and_refuses_out_of_range():
    table = pc.id_table(4, 8, offset=4)
    ids, empty = pc.map_ids(np.array([[0, -1], [3, 2]]), table)
    assert ids.tolist() == [[4, -1], [7, 6]] and empty
    ids, empty = pc.map_ids(np.array([[0, 1]]), table)
    assert not empty
    with pytest.raises(pc.MoedPluginError, match="topk id 4"):
        pc.map_ids(np.array([[4, 0]]), table)
    with pytest.raises(pc.MoedPluginError, match="topk id -2"):
        pc.map_ids(np.array([[-2, 0]]), table)


def test_rank_roles_count_every_term_once():
    for tp in (1, 2, 4):
        for ep in (1, 2, 4):
            for fw_shared in (False, True):
                roles = [pc.rank_role(t, e, fw_shared) for t in range(tp) for e in range(ep)]
                computing = [(t, e) for (t, e), (c, _) in
                             zip([(t, e) for t in range(tp) for e in range(ep)], roles) if c]
                # one computing rank per EP rank: each expert's term once
                assert sorted(e for _, e in computing) == list(range(ep))
                # moed's shared term once, and never when the framework has it
                n_shared = sum(1 for c, ro in roles if c and not ro)
                assert n_shared == (0 if fw_shared else 1)


def test_final_weights_scale_once():
    w = np.array([[0.25, 0.5]], dtype=np.float32)
    assert pc.final_weights(w, 2.5, fused_in_topk=True).tolist() == w.tolist()
    assert np.array_equal(pc.final_weights(w, 2.5, fused_in_topk=False), w * np.float32(2.5))
    assert pc.final_weights(w, None, fused_in_topk=False).tolist() == w.tolist()


def test_drop_shared_columns_refuses_routed_ids():
    ids = np.array([[1, 2, 8]])
    w = np.array([[0.5, 0.5, 1.0]], dtype=np.float32)
    i2, w2 = pc.drop_shared_columns(ids, w, 1, 8)
    assert i2.tolist() == [[1, 2]] and w2.tolist() == [[0.5, 0.5]]
    with pytest.raises(pc.MoedPluginError, match="fused shared"):
        pc.drop_shared_columns(np.array([[1, 8, 2]]), w, 1, 8)


# --- against the daemon ---------------------------------------------------------

def test_tp2_one_rank_computes_the_sum_is_the_layer(daemon):
    ex = experts_of(daemon)
    ref = cases.tiny_reference(daemon)
    layer = layer_of(ex)
    x, ids, w = cases.batch(ref, 5, seed=1)
    total = np.zeros((5, ref.hidden))
    for tp_rank in range(2):
        compute, routed_only = pc.rank_role(tp_rank, 0, framework_serves_shared=False)
        if compute:
            y = ex.forward(layer, x, ids, w, routed_only=routed_only, empty_slots=False)
            assert y.dtype == x.dtype and y.shape == x.shape
            total += cases.f64(y)
    assert du.rel_l2(total, cases.expect(ref, layer, x, ids, w)) < TOL


def _ep_sum(ex, ref, layer, x, ids, w, ep, fw_shared):
    n_local = ref.n_experts // ep
    total = np.zeros((x.shape[0], ref.hidden))
    for ep_rank in range(ep):
        local = cases.ep_local_ids(ids, ep_rank, n_local)
        table = pc.id_table(n_local, ref.n_experts, offset=ep_rank * n_local)
        lids, empty = pc.map_ids(local, table)
        compute, routed_only = pc.rank_role(0, ep_rank, fw_shared)
        assert compute
        y = ex.forward(layer, x, lids, w, routed_only=routed_only, empty_slots=empty)
        total += cases.f64(y)
    return total


@pytest.mark.parametrize("model", ["noshared", "daemon"])
def test_ep2_local_ids_empty_slots_shared_once(model, request):
    """EP=2 on the model without a shared expert, and on the one with it
    (moed's shared term asked for by EP rank 0 only: needs routed_only)."""
    d = request.getfixturevalue(model)
    ex = experts_of(d)
    if model == "daemon":
        needs(ex, "routed_only")
    ref = cases.model_reference(d)
    assert (ref.n_shared == 0) == (model == "noshared") and ex.info().n_shared == ref.n_shared
    layer = layer_of(ex)
    x, ids, w = cases.batch(ref, 7, seed=2)
    ids[0] = [0, 1]  # a token all on rank 0: rank 1's slots are all empty
    total = _ep_sum(ex, ref, layer, x, ids, w, ep=2, fw_shared=False)
    assert du.rel_l2(total, cases.expect(ref, layer, x, ids, w)) < TOL


def test_routed_only_when_the_framework_has_the_shared_expert(daemon):
    ex = experts_of(daemon)
    needs(ex, "routed_only")
    ref = cases.tiny_reference(daemon)
    layer = layer_of(ex)
    x, ids, w = cases.batch(ref, 4, seed=4)
    y = ex.forward(layer, x, ids, w, routed_only=True, empty_slots=False)
    assert du.rel_l2(cases.f64(y), cases.expect(ref, layer, x, ids, w, shared=False)) < TOL


def test_routed_only_refused_without_the_client_feature(daemon):
    ex = experts_of(daemon)
    if pc.client_supports(ex.client, "routed_only"):
        pytest.skip("this client has routed_only (the refusal is for version-1 clients)")
    ref = cases.tiny_reference(daemon)
    x, ids, w = cases.batch(ref, 2, seed=5)
    with pytest.raises(pc.MoedPluginError, match="routed experts only"):
        ex.forward(layer_of(ex), x, ids, w, routed_only=True, empty_slots=False)


def test_eplb_physical_ids_map_back_to_logical(daemon):
    ex = experts_of(daemon)
    ref = cases.tiny_reference(daemon)
    layer = layer_of(ex)
    rng = np.random.default_rng(6)
    # 12 physical experts: every logical one once plus 4 redundant copies
    p2l = rng.permutation(np.concatenate([np.arange(8), rng.choice(8, 4, replace=False)]))
    table = pc.id_table(12, 8, p2l=p2l)
    rows = []
    while len(rows) < 6:
        p = rng.choice(12, 2, replace=False)
        if p2l[p[0]] != p2l[p[1]]:
            rows.append(p)
    phys = np.array(rows, dtype=np.int32)
    x, _, w = cases.batch(ref, 6, seed=7)
    ids, empty = pc.map_ids(phys, table)
    assert not empty and (ids == p2l[phys]).all()
    y = ex.forward(layer, x, ids, w, routed_only=False, empty_slots=False)
    assert du.rel_l2(cases.f64(y), cases.expect(ref, layer, x, p2l[phys], w)) < TOL


def test_fused_shared_column_dropped_moed_adds_the_shared_expert(daemon):
    ex = experts_of(daemon)
    ref = cases.tiny_reference(daemon)
    layer = layer_of(ex)
    x, ids, w = cases.batch(ref, 5, seed=8)
    # SGLang's fused layout: one more column naming the shared slot (id E)
    ids3 = np.concatenate([ids, np.full((5, 1), ref.n_experts, np.int32)], axis=1)
    w3 = np.concatenate([w, w.sum(axis=1, keepdims=True)], axis=1)
    table = pc.id_table(ref.n_experts + 1, ref.n_experts, n_routed_incoming=ref.n_experts)
    i2, w2 = pc.drop_shared_columns(ids3, w3, 1, ref.n_experts)
    i2, empty = pc.map_ids(i2, table)
    assert not empty
    y = ex.forward(layer, x, i2, w2, routed_only=False, empty_slots=False)
    assert du.rel_l2(cases.f64(y), cases.expect(ref, layer, x, ids, w)) < TOL


def test_routed_scaling_applied_once(daemon):
    ex = experts_of(daemon)
    ref = cases.tiny_reference(daemon)
    layer = layer_of(ex)
    x, ids, w = cases.batch(ref, 3, seed=9)
    want = cases.expect(ref, layer, x, ids, w * np.float32(2.5))
    for fused, given in ((True, w * np.float32(2.5)), (False, w)):
        wf = pc.final_weights(given, 2.5, fused_in_topk=fused)
        y = ex.forward(layer, x, ids, wf, routed_only=False, empty_slots=False)
        assert du.rel_l2(cases.f64(y), want) < TOL, fused


def test_empty_slots_contribute_nothing(daemon):
    ex = experts_of(daemon)
    ref = cases.tiny_reference(daemon)
    layer = layer_of(ex)
    x, ids, w = cases.batch(ref, 4, seed=10)
    ids[1, 0] = -1
    ids[3, 1] = -1
    y = ex.forward(layer, x, ids, w, routed_only=False, empty_slots=True)
    assert du.rel_l2(cases.f64(y), cases.expect(ref, layer, x, ids, w)) < TOL


def test_zero_tokens_answer_an_empty_output(daemon):
    ex = experts_of(daemon)
    ref = cases.tiny_reference(daemon)
    x, ids, w = cases.batch(ref, 0, seed=11)
    y = ex.forward(layer_of(ex), x, ids, w, routed_only=False, empty_slots=False)
    assert y.shape == (0, ref.hidden) and y.dtype == x.dtype


def test_batch_over_max_tokens_is_split(daemon):
    ex = experts_of(daemon)
    ref = cases.tiny_reference(daemon)
    layer = layer_of(ex)
    t = 2 * ex.info().max_tokens + 22
    x, ids, w = cases.batch(ref, t, seed=12)
    y = ex.forward(layer, x, ids, w, routed_only=False, empty_slots=False)
    assert y.shape == (t, ref.hidden)
    assert du.rel_l2(cases.f64(y), cases.expect(ref, layer, x, ids, w)) < TOL


def test_check_layer_refuses_what_the_daemon_does_not_serve(daemon):
    ex = experts_of(daemon)
    info = ex.info()
    with pytest.raises(pc.MoedPluginError, match="not an MoE layer"):
        ex.check_layer(info.n_layers, info.n_experts)
    with pytest.raises(pc.MoedPluginError, match="not the same checkpoint"):
        ex.check_layer(layer_of(ex), info.n_experts + 4)
    assert ex.check_layer(layer_of(ex), info.n_experts) is info


# ---- MOED_ZERO_COPY=doorbell: the routing on the device, the session calls ----

def test_zero_copy_switch():
    assert pc.zero_copy({}) is None
    for off in ("", "0", "off", "No"):
        assert pc.zero_copy({pc.ENV_ZERO_COPY: off}) is None
    assert pc.zero_copy({pc.ENV_ZERO_COPY: " Doorbell "}) == "doorbell"
    with pytest.raises(pc.MoedPluginError, match="MOED_ZERO_COPY='inline': expected doorbell or off"):
        pc.zero_copy({pc.ENV_ZERO_COPY: "inline"})


def test_device_routing_is_the_host_routing():
    """device_routing (torch ops, no host sync) gives what drop_shared_columns
    + map_ids + final_weights give on the host, for an EP rank's table with
    EPLB redundancy and a fused shared column; an id outside the table
    becomes n_logical (which moed refuses) where the host path raises."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    n_logical, n_routed_in, n_shared_cols, T = 8, 12, 1, 37
    p2l = rng.integers(0, n_logical, size=n_routed_in)
    table = pc.id_table(n_routed_in + 1, n_logical, n_routed_incoming=n_routed_in, p2l=p2l)
    table[3] = -1  # another rank's expert
    ids = rng.integers(-1, n_routed_in, size=(T, 3)).astype(np.int64)
    ids[:, -1] = n_routed_in  # the shared slot
    w = rng.random((T, 3)).astype(np.float32)
    h_ids, h_w = pc.drop_shared_columns(ids, w, n_shared_cols, n_routed_in)
    h_ids, _ = pc.map_ids(h_ids, table)
    h_w = pc.final_weights(h_w, 2.5, fused_in_topk=False)
    d_ids, d_w = pc.device_routing(torch.from_numpy(ids), torch.from_numpy(w),
                                   pc.device_table(table, "cpu"), n_logical,
                                   n_shared_cols=n_shared_cols, scale=2.5)
    assert d_ids.dtype == torch.int32 and d_w.dtype == torch.float32
    np.testing.assert_array_equal(d_ids.numpy(), h_ids)
    np.testing.assert_array_equal(d_w.numpy(), h_w)
    assert (d_ids.numpy() == -1).any()  # empty slots survive
    bad = ids.copy()
    bad[0, 0], bad[1, 1] = n_routed_in + 1, -7
    d_ids, _ = pc.device_routing(torch.from_numpy(bad), torch.from_numpy(w),
                                 pc.device_table(table, "cpu"), n_logical,
                                 n_shared_cols=n_shared_cols)
    assert d_ids[0, 0] == n_logical and d_ids[1, 1] == n_logical
    with pytest.raises(pc.MoedPluginError, match="outside the 13 ids"):
        pc.map_ids(bad[:, :-1], table)


class _FakeSession:
    """Records what the doorbell path asks of a DoorbellSession."""

    def __init__(self, max_tokens, n_shared):
        self.max_tokens = max_tokens
        self.info = type("Info", (), {"n_shared": n_shared})()
        self.calls = []

    def fused_experts(self, x, w, ids, layer, *, routed_only, empty_slots):
        import torch
        self.calls.append((x.shape[0], layer, routed_only, empty_slots))
        return torch.full_like(x, float(len(self.calls)))


def test_doorbell_path_splits_and_sets_the_flags():
    """The plugins' doorbell path: one session per device, a batch over its
    max_tokens in chunks (in order), empty slots always allowed, routed-only
    asked only when the daemon has shared experts; T = 0 makes no call."""
    torch = pytest.importorskip("torch")
    fake = _FakeSession(max_tokens=16, n_shared=1)
    ex = pc.Experts(zero_copy_mode="doorbell", sessions={"cpu": fake})
    x = torch.zeros((40, 8), dtype=torch.bfloat16)
    ids = torch.zeros((40, 2), dtype=torch.int32)
    w = torch.ones((40, 2))
    y = ex._forward_doorbell(3, x, ids, w, routed_only=True)
    assert fake.calls == [(16, 3, True, True), (16, 3, True, True), (8, 3, True, True)]
    assert y.shape == x.shape and y[0, 0] == 1 and y[16, 0] == 2 and y[39, 0] == 3
    fake2 = _FakeSession(max_tokens=64, n_shared=0)
    ex2 = pc.Experts(zero_copy_mode="doorbell", sessions={"cpu": fake2})
    ex2._forward_doorbell(5, x, ids, w, routed_only=True)
    assert fake2.calls == [(40, 5, False, True)]
    # CPU tensors never take the doorbell (it is a GPU path), T = 0 makes no call
    assert not ex.on_device(x)
    assert ex.forward(3, x[:0], ids[:0], w[:0], routed_only=True, empty_slots=True).shape == (0, 8)
    assert len(fake.calls) == 3
