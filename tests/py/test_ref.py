"""The C CPU reference (kernels/moe_ref.c through tests/tools/ref_forward)
against the independent float64 reference of conftest.F64Reference, on
generated tiny and qwen3-30b-a3b checkpoints.

Inputs are random with a fresh seed per run (printed on failure): x ~ N(0, 1)
in bf16, distinct top-k ids per token like a router, positive weights that
sum to 1. Tolerance: relative L2 < 1e-2 (the C side differs only by fp32
accumulation, bf16 output and rare bf16 flips of h).
"""

import os

import numpy as np
import pytest

from conftest import F64Reference, bf16_bits, bf16_to_f64, ref_forward, rel_l2

TOL = 1e-2


@pytest.fixture(scope="module")
def refs(tiny_model, qwen3_model):
    return {"tiny": (tiny_model, F64Reference(tiny_model)),
            "qwen3": (qwen3_model, F64Reference(qwen3_model))}


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little")


def router_inputs(rng, ref, T):
    x = bf16_bits(rng.standard_normal((T, ref.hidden)).astype(np.float32))
    ids = np.stack([rng.choice(ref.n_experts, ref.top_k, replace=False)
                    for _ in range(T)]).astype(np.int32)
    w = rng.random((T, ref.top_k)).astype(np.float32) + 0.05
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    return x, ids, w


def check(model_dir, ref, layer, x, ids, w, what, threads=0):
    y = ref_forward(model_dir, layer, x, ids, w, threads=threads)
    assert y.shape == x.shape
    yf = bf16_to_f64(y)
    assert not np.isnan(yf).any(), "%s: NaN in output" % what
    r = ref.forward(layer, x, ids, w)
    assert np.linalg.norm(r) > 0
    err = rel_l2(y, r)
    assert err < TOL, "%s: relative L2 error %.3g" % (what, err)
    return y


@pytest.mark.parametrize("model", ["tiny", "qwen3"])
@pytest.mark.parametrize("T", [1, 3, 16, 64])
def test_random(refs, model, T):
    model_dir, ref = refs[model]
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layers = range(ref.config["num_hidden_layers"])
    for layer in layers:
        x, ids, w = router_inputs(rng, ref, T)
        check(model_dir, ref, layer, x, ids, w, "%s T=%d layer %d seed %d" % (model, T, layer,
                                                                               seed))


@pytest.mark.parametrize("model", ["tiny", "qwen3"])
def test_all_tokens_one_expert(refs, model):
    """Every token routes to the same experts (slot 0 = the same expert)."""
    model_dir, ref = refs[model]
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    T = 32
    x, _, w = router_inputs(rng, ref, T)
    e = int(rng.integers(ref.n_experts))
    others = [o for o in range(ref.n_experts) if o != e][:ref.top_k - 1]
    ids = np.tile(np.array([e] + others, dtype=np.int32), (T, 1))
    check(model_dir, ref, 0, x, ids, w, "%s one-expert seed %d" % (model, seed))


@pytest.mark.parametrize("model", ["tiny", "qwen3"])
def test_every_expert_hit(refs, model):
    """A batch whose slots cover every routed expert at least once."""
    model_dir, ref = refs[model]
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    T = -(-ref.n_experts // ref.top_k)  # ceil(E / k)
    x, _, w = router_inputs(rng, ref, T)
    perm = rng.permutation(ref.n_experts)
    flat = np.concatenate([perm, rng.permutation(ref.n_experts)])[:T * ref.top_k]
    ids = flat.reshape(T, ref.top_k).astype(np.int32)
    assert set(ids.ravel().tolist()) == set(range(ref.n_experts))
    check(model_dir, ref, 0, x, ids, w, "%s every-expert seed %d" % (model, seed))


def test_thread_count_does_not_change_bits(refs):
    model_dir, ref = refs["qwen3"]
    rng = np.random.default_rng(fresh_seed())
    x, ids, w = router_inputs(rng, ref, 8)
    ys = [ref_forward(model_dir, 0, x, ids, w, threads=n) for n in (1, 3)]
    assert (ys[0] == ys[1]).all()


def test_duplicate_ids_and_zero_weight(refs):
    """A token may list one expert twice; a zero weight contributes nothing."""
    model_dir, ref = refs["tiny"]
    rng = np.random.default_rng(fresh_seed())
    x, ids, w = router_inputs(rng, ref, 4)
    ids[:, :] = ids[:, :1]
    w[0, :] = 0.0
    check(model_dir, ref, 1, x, ids, w, "duplicates")


def test_invalid_expert_id_rejected(refs):
    model_dir, ref = refs["tiny"]
    rng = np.random.default_rng(1)
    x, ids, w = router_inputs(rng, ref, 2)
    for bad in (ref.n_experts, -1):
        ids2 = ids.copy()
        ids2[1, 0] = bad
        with pytest.raises(RuntimeError, match="moe_ref_forward: invalid request"):
            ref_forward(model_dir, 0, x, ids2, w)


def test_bad_layer_rejected(refs):
    model_dir, ref = refs["tiny"]
    rng = np.random.default_rng(2)
    x, ids, w = router_inputs(rng, ref, 1)
    with pytest.raises(RuntimeError, match="layer 2 is not an MoE layer"):
        ref_forward(model_dir, 2, x, ids, w)
