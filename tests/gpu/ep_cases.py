"""The expert-parallel daemon tests' batches and skewed placement map
(tests/gpu/test_ep_daemon.py, test_nccl_daemon.py). numpy only."""

import json

import numpy as np

TOKENS = (1, 4, 16, 64, 256)


def batches(info, seed, tokens=TOKENS):
    """(layer, T, routed_only, empty, x, ids, w) for every MoE layer, T and
    variant: all slots, routed only, every third token's first slot empty."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in info.moe_layers:
        for t in tokens:
            for routed_only, empty in ((False, False), (True, False), (False, True)):
                x = rng.standard_normal((t, info.hidden), dtype=np.float32)
                x_bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation
                ids = np.stack([rng.permutation(info.n_experts)[:info.top_k]
                                for _ in range(t)]).astype(np.int32)
                w = rng.random((t, info.top_k), dtype=np.float32)
                if empty:
                    ids[::3, 0] = -1
                    w[::3, 0] = 0.0
                out.append((layer, t, routed_only, empty, x_bits, ids, w))
    return out


def skewed_map(info, path):
    """Device 1: routed experts 0 and 1 (expert 1 also on device 0); device 0:
    every other expert."""
    layers = [{"layer": l,
               "experts": [[1] if e == 0 else [1, 0] if e == 1 else [0]
                           for e in range(info.n_experts)]}
              for l in info.moe_layers]
    path.write_text(json.dumps({"gpus": 2, "max_replicas": 2, "hot": 1.0,
                                "n_experts": info.n_experts, "n_shared": info.n_shared,
                                "layers": layers}))


def differ(cases, got, want):
    """(layer, T, routed_only, empty, differing values) of every case that differs."""
    return [(layer, t, ro, em, int((g != w).sum()))
            for (layer, t, ro, em, *_), g, w in zip(cases, got, want) if not np.array_equal(g, w)]
