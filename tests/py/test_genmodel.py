"""`moectl gen-model` (engine/genmodel.c): determinism, checkpoint layout,
ModelOpt quantization rules and command-line errors."""

import filecmp
import json
import os
import subprocess

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from conftest import (MOECTL, E2M1_VALUES, checkpoint_files, dequant, e2m1_codes, gen_model,
                      load_checkpoint, load_config, read_safetensors_header)

PROJ = ("gate_proj", "up_proj", "down_proj")
SUFFIX = {"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": "F32", "input_scale": "F32"}


def files_of(d):
    return sorted(os.listdir(d))


def same_tree(a, b):
    fa, fb = files_of(a), files_of(b)
    return fa == fb and all(filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False)
                            for f in fa)


def test_same_seed_identical_any_thread_count(tmp_path):
    gen_model("tiny", 2, 5, tmp_path / "a", threads=1)
    gen_model("tiny", 2, 5, tmp_path / "b", threads=2)
    gen_model("tiny", 2, 5, tmp_path / "c", threads=7)
    assert same_tree(tmp_path / "a", tmp_path / "b")
    assert same_tree(tmp_path / "a", tmp_path / "c")


def test_different_seed_different_weights(tmp_path):
    gen_model("tiny", 1, 5, tmp_path / "a")
    gen_model("tiny", 1, 6, tmp_path / "b")
    ta, tb = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    assert sorted(ta) == sorted(tb)
    w = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert (ta[w] != tb[w]).mean() > 0.5
    # Layers and experts draw from different streams too.
    assert not np.array_equal(ta["model.layers.0.mlp.experts.0.gate_proj.weight"],
                              ta["model.layers.0.mlp.experts.1.gate_proj.weight"])
    assert not np.array_equal(ta["model.layers.0.mlp.experts.0.gate_proj.weight"],
                              ta["model.layers.0.mlp.experts.0.up_proj.weight"])


def expected_tensors(layer, E, S, H, I):
    out = {}
    for e in range(E + S):
        if e < E:
            base = "model.layers.%d.mlp.experts.%d." % (layer, e)
        else:
            base = "model.layers.%d.mlp.shared_experts." % layer
        for p in PROJ:
            n, k = (I, H) if p != "down_proj" else (H, I)
            shapes = {"weight": [n, k // 2], "weight_scale": [n, k // 16],
                      "weight_scale_2": [], "input_scale": []}
            for s, dt in SUFFIX.items():
                out[base + p + "." + s] = (dt, shapes[s])
    return out


def test_layout_tiny_two_layers(tiny_model):
    d = tiny_model
    assert files_of(d) == ["config.json", "hf_quant_config.json",
                           "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json"]
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        idx = json.load(f)
    total = 0
    for layer in range(2):
        shard = "model-%05d-of-00002.safetensors" % (layer + 1)
        head, _ = read_safetensors_header(os.path.join(d, shard))
        want = expected_tensors(layer, 8, 1, 256, 128)
        assert sorted(head) == sorted(want)
        for name, (dt, shape) in want.items():
            assert head[name]["dtype"] == dt and head[name]["shape"] == shape, name
            assert idx["weight_map"][name] == shard
            b, e = head[name]["data_offsets"]
            total += e - b
        # The safetensors package reads the same header.
        with safe_open(os.path.join(d, shard), framework="numpy") as f:
            assert sorted(f.keys()) == sorted(want)
    assert len(idx["weight_map"]) == 2 * 9 * 3 * 4
    assert idx["metadata"]["total_size"] == total


def test_layout_single_layer_and_configs(qwen3_model, tiny_model):
    assert files_of(qwen3_model) == ["config.json", "hf_quant_config.json", "model.safetensors"]
    head, _ = read_safetensors_header(os.path.join(qwen3_model, "model.safetensors"))
    want = expected_tensors(0, 128, 0, 2048, 768)
    assert sorted(head) == sorted(want)
    for name, (dt, shape) in want.items():
        assert head[name]["dtype"] == dt and head[name]["shape"] == shape, name

    q = load_config(qwen3_model)
    assert q["model_type"] == "qwen3_moe"
    assert (q["hidden_size"], q["moe_intermediate_size"], q["num_experts"],
            q["num_experts_per_tok"], q["num_hidden_layers"]) == (2048, 768, 128, 8, 1)
    assert q["decoder_sparse_step"] == 1 and q["mlp_only_layers"] == []
    assert "n_routed_experts" not in q

    t = load_config(tiny_model)
    assert t["model_type"] == "moed_tiny"
    assert (t["hidden_size"], t["moe_intermediate_size"], t["n_routed_experts"],
            t["num_experts_per_tok"], t["n_shared_experts"], t["num_hidden_layers"],
            t["first_k_dense_replace"]) == (256, 128, 8, 2, 1, 2, 0)
    for d in (qwen3_model, tiny_model):
        with open(os.path.join(d, "hf_quant_config.json")) as f:
            hq = json.load(f)
        assert hq["producer"]["name"] == "modelopt"
        assert hq["quantization"]["quant_algo"] == "NVFP4"
        assert hq["quantization"]["group_size"] == 16
        assert hq["quantization"]["exclude_modules"] == ["lm_head"]
        assert load_config(d)["quantization_config"]["quant_algo"] == "NVFP4"


def check_modelopt(weight, scale, s2):
    """ModelOpt rules on one quantized tensor (rows may be a gate+up stack)."""
    s2 = float(s2)
    sc_codes = np.asarray(scale).view(np.uint8)
    sc = np.asarray(scale).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    codes = e2m1_codes(weight)
    mag = np.abs(E2M1_VALUES[codes]).reshape(codes.shape[0], -1, 16).max(axis=2)
    # The tensor's amax block got block scale amax/(6*s2) = 448 exactly.
    assert sc_codes.max() == 0x7E and sc.max() == 448.0
    # w / (scale * s2) of a block's amax lands in [6*15/16, 6*17/16] after the
    # E4M3 rounding of the scale, which E2M1 rounds to 6: every block holds a
    # code of magnitude 6, in particular the 448 block.
    assert (mag == 6.0).all()
    deq = dequant(weight, scale, s2)
    amax = np.abs(deq).max()
    assert amax == pytest.approx(6 * 448 * s2, rel=1e-6)
    assert s2 == pytest.approx(amax / (6 * 448), rel=1e-6)
    return deq


def test_quantization_follows_modelopt(tiny_model, qwen3_model):
    for d, layer, E, S, H, I in ((tiny_model, 1, 8, 1, 256, 128), (qwen3_model, 0, 128, 0, 2048, 768)):
        t = load_checkpoint(d)
        for e in sorted({0, 1, E - 1} | ({E} if S else set())):
            base = ("model.layers.%d.mlp.experts.%d." % (layer, e) if e < E
                    else "model.layers.%d.mlp.shared_experts." % layer)
            g, u, dn = (base + p + "." for p in PROJ)
            # gate and up share weight_scale_2 (ModelOpt fuses their amax):
            # check the rules on their row stack.
            assert t[g + "weight_scale_2"] == t[u + "weight_scale_2"]
            gu = check_modelopt(np.concatenate([t[g + "weight"], t[u + "weight"]]),
                                np.concatenate([t[g + "weight_scale"], t[u + "weight_scale"]]),
                                t[g + "weight_scale_2"])
            dd = check_modelopt(t[dn + "weight"], t[dn + "weight_scale"], t[dn + "weight_scale_2"])
            # Gaussian with std 1/sqrt(K); quantization noise adds a little.
            assert gu.std() == pytest.approx(1 / np.sqrt(H), rel=0.08)
            assert dd.std() == pytest.approx(1 / np.sqrt(I), rel=0.08)
            assert abs(gu.mean()) < 0.05 / np.sqrt(H)
            for p in (g, u, dn):
                s = float(t[p + "input_scale"])
                assert np.isfinite(s) and 0 < s < 1, (p, s)


def run_moectl(*args):
    return subprocess.run([MOECTL, "gen-model", *args], capture_output=True, text=True,
                          timeout=120)


def test_unknown_preset(tmp_path):
    r = run_moectl("--preset", "llama-moe", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert "unknown preset 'llama-moe' (allowed: tiny, qwen3-30b-a3b, deepseek-v3)" in r.stderr
    assert not (tmp_path / "x").exists()


def test_usage_errors(tmp_path):
    cases = [
        (["--preset", "tiny"], "missing --out DIR"),
        (["--out", str(tmp_path / "x"), "--bogus", "1"], "unknown option '--bogus'"),
        (["--out", str(tmp_path / "x"), "--layers", "0"], "--layers '0' is not an integer in 1..1024"),
        (["--out", str(tmp_path / "x"), "--layers", "2x"], "--layers '2x' is not an integer"),
        (["--out", str(tmp_path / "x"), "--seed", "-1"], "--seed '-1' is not an integer"),
        (["--out", str(tmp_path / "x"), "--threads", "999"], "--threads '999' is not an integer in 0..256"),
        (["--out"], "option --out needs a value"),
    ]
    for args, msg in cases:
        r = run_moectl(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr, (args, r.stderr)
    r = run_moectl("--help")
    assert r.returncode == 0 and "usage: moectl gen-model" in r.stdout


def test_output_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = run_moectl("--preset", "tiny", "--out", str(f / "sub"))
    assert r.returncode == 1
    assert "cannot create directory %s" % (f / "sub") in r.stderr or \
        "cannot create directory %s" % f in r.stderr, r.stderr
    r = run_moectl("--preset", "tiny", "--out", str(f))
    assert r.returncode == 1 and "%s exists and is not a directory" % f in r.stderr


def test_equals_syntax_and_defaults(tmp_path):
    r = run_moectl("--out=%s" % (tmp_path / "m"), "--seed=3")
    assert r.returncode == 0, r.stderr
    cfg = load_config(tmp_path / "m")
    assert cfg["model_type"] == "moed_tiny" and cfg["num_hidden_layers"] == 1
    assert [os.path.basename(p) for p in checkpoint_files(tmp_path / "m")] == ["model.safetensors"]


def test_regenerate_single_layer_over_sharded(tmp_path):
    """Writing 1 layer where a 2-layer model was drops the stale index, so
    loaders read the new model.safetensors."""
    d = tmp_path / "m"
    gen_model("tiny", 2, 1, d)
    r = gen_model("tiny", 1, 1, d)
    assert "removed stale" in r.stderr
    assert not (d / "model.safetensors.index.json").exists()
    assert load_config(d)["num_hidden_layers"] == 1
