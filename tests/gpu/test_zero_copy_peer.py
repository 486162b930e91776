"""GPU: the dedicated expert GPU (docs/ZERO_COPY.md): moed on GPU 0, a torch
client on GPU 1 of the same host, peer access (NVLink) between them, no MPS.
FORWARD by descriptor over a buffer on the client's GPU (moed's kernel reads
x and writes y there across the link) and the doorbell in a CUDA graph (the
ring and arena in moed's memory, the client's copies and its kernel on its
own GPU) must equal the inline path bit for bit; the doorbell's p50 added
latency over the kernel is printed.

Run by scripts/run-gpu-tests.sh (step 4c, without MPS: a client on another
GPU needs none). Skips cleanly without torch, with fewer than 2 GPUs or
without peer access both ways between GPU 0 and GPU 1. The test process is
the client: it never touches GPU 0 (no context there), as a serving engine
on its own GPU would not.
"""

import json
import os
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "py"))

import daemon_util as du  # noqa: E402

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices (moed on GPU 0, the client on GPU 1)",
                allow_module_level=True)
if not (torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)):
    pytest.skip("no peer access both ways between GPU 0 and GPU 1", allow_module_level=True)

import moed_client as mc  # noqa: E402
import moed_client.cuda as mcc  # noqa: E402

DEV = torch.device("cuda", 1)  # the client's GPU
MOED_GPU = 0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peer")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port(),
                         engine__backend="cuda", engine__gpus=[MOED_GPU],
                         engine__max_channels=4)
    torch.cuda.set_device(DEV)
    with du.Daemon(tmp, cfg) as d:
        yield d
        assert d.alive(), d.log()[-4000:]
        assert d.stop() == 0, d.log()[-4000:]


def status(daemon):
    url = "http://127.0.0.1:%d/status" % daemon.http_port()
    with urllib.request.urlopen(url, timeout=du.wait_s(5)) as r:
        return json.loads(r.read().decode())


def batch(info, t, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, info.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(info.n_experts, generator=g)[:info.top_k]
                       for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, info.top_k, generator=g)
    return x, ids, w


def bits(t):
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def inline(c, layer, x, ids, w):
    return np.asarray(c.forward(layer, bits(x), ids.cpu().numpy(), w.cpu().numpy()))


def test_descriptor_from_the_peer_gpu_equals_inline(daemon):
    """CudaSession on GPU 1 (its buffer there, named by GPU 1's UUID):
    accepted as a peer mapping, y equal to the inline path's bit for bit."""
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c, \
            mcc.CudaSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60)),
                            device=DEV) as s:
        info = c.hello()
        assert info.backend == "cuda"
        rb = status(daemon)["registered_buffers"]
        assert (rb["mappings"], rb["peer_mappings"]) == (1, 1), rb
        for i, t in enumerate([1, 3, 16, info.max_tokens]):
            layer = info.moe_layers[i % len(info.moe_layers)]
            x, ids, w = batch(info, t, i)
            y = s.fused_experts(x.to(DEV), w.to(DEV), ids.to(DEV), layer)
            assert y.device == DEV and tuple(y.shape) == (t, info.hidden)
            got, want = bits(y), inline(c, layer, x, ids, w)
            assert np.array_equal(got, want), (t, int((got != want).sum()))


def test_doorbell_graph_from_the_peer_gpu_equals_inline(daemon):
    """DoorbellSession on GPU 1: the channel and arena lie on GPU 0
    (Channel.peer_gpu), /status lists the client's GPU; a captured graph of
    layers (x_{i+1} = y_i) on GPU 1 equals the inline path bit for bit, and
    so does a replay."""
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c, \
            mcc.DoorbellSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60)),
                                max_tokens=16, device=DEV) as s:
        info = c.hello()
        assert s.channel.peer_gpu == MOED_GPU and s.channel.arena.device == DEV
        mine = [e for e in status(daemon)["channels"]["list"] if e["id"] == s.channel.chan_id]
        assert mine and mine[0]["peer_gpu"] == 1, mine
        layers = [info.moe_layers[i % len(info.moe_layers)] for i in range(4)]
        for t in (1, 5, 16):
            x0, ids, w = batch(info, t, 40 + t)
            x0, ids, w = x0.to(DEV), ids.to(DEV), w.to(DEV)
            s.fused_experts(x0, w, ids, layers[0])  # eager warm-up (module load)
            torch.cuda.synchronize(DEV)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ys, x = [], x0
                for layer in layers:
                    x = s.fused_experts(x, w, ids, layer)
                    ys.append(x)
            g.replay()
            torch.cuda.synchronize(DEV)
            s.check()
            x_in = x0
            for i, (layer, y) in enumerate(zip(layers, ys)):
                assert y.device == DEV
                want = inline(c, layer, x_in, ids, w)
                got = bits(y)
                assert np.array_equal(got, want), (t, i, int((got != want).sum()))
                x_in = y.clone()
            last = bits(ys[-1])
            g.replay()
            torch.cuda.synchronize(DEV)
            assert np.array_equal(bits(ys[-1]), last)
            s.check()
            del g


def test_doorbell_latency_over_the_kernel(daemon):
    """Not a pass/fail check beyond every call answered OK: the p50 of the
    doorbell's added latency over moed's kernel, from the channel's stamps
    (rang -> seen on the client's clock, taken -> answered on moed's: each
    difference on one GPU's clock), and the per-call time of graph replays."""
    n, per = 2000, 10
    with mcc.DoorbellSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60)),
                             max_tokens=8, device=DEV) as s:
        ch, info = s.channel, s.info
        x, ids, w = (a.to(DEV) for a in batch(info, 1, 5))
        layer = info.moe_layers[0]
        s.fused_experts(x, w, ids, layer)
        torch.cuda.synchronize(DEV)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(per):
                s.fused_experts(x, w, ids, layer)
        added, kern = [], []
        t0 = time.perf_counter()
        for i in range(n // per):
            g.replay()
            if i % 10 == 9:  # the stamps of the last 8 calls, while they are there
                torch.cuda.synchronize(DEV)
                _, done, _ = ch.ring()
                for rang, taken, answered, seen in ch.stamps(done):
                    added.append((seen - rang) - (answered - taken))
                    kern.append(answered - taken)
        torch.cuda.synchronize(DEV)
        dt = time.perf_counter() - t0
        assert ch.error_word() == 0
        med = lambda v: sorted(v)[len(v) // 2] / 1e3  # noqa: E731
        print("peer doorbell (client GPU 1, moed GPU 0, T=1): p50 added latency over the "
              "kernel %.2f us (p50 kernel %.2f us, %d samples); %.2f us per call in graph "
              "replays (%d calls, with the copies in and out over NVLink)"
              % (med(added), med(kern), len(added), dt / n * 1e6, n))
