"""Protocol version 2 through the daemon's real socket: HELLO negotiation and
its MoE layer list, FORWARD flags (routed-only, empty slots), T = 0, the
clients' splitting of T > max_tokens, and max_tokens up to 16384. Outputs are
checked against the float64 reference (conftest.F64Reference), which reads
the checkpoint itself."""
import os
import struct
import subprocess

import numpy as np
import pytest

import daemon_util as du
import moed_client as mc
from daemon_util import E, MSG_FORWARD, MSG_HELLO, REPLY

TOL = 1e-2  # bf16 output against float64 (as test_daemon's reference checks)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models_dir):
    yield from du.module_daemon(tmp_path_factory, models_dir, "daemon_v2")


@pytest.fixture(scope="module")
def ref(daemon):
    return du.F64Reference(du.synth_dir(daemon.cfg["model"]["synthetic_dir"]))


def routing(info, t, seed):
    rng = np.random.default_rng(seed)
    x = du.bf16_bits(rng.standard_normal((t, info.hidden)).astype(np.float32))
    ids = np.stack([rng.choice(info.n_experts, info.top_k, replace=False) for _ in range(t)])
    w = rng.random((t, info.top_k)).astype(np.float32) + 0.1
    return x, ids.astype(np.int32), w


def hello_raw(s, rid, lo, hi):
    s.sendall(du.frame(MSG_HELLO, rid, struct.pack("<HHI", lo, hi, 0)))
    mtype, r, p = du.read_frame(s)
    assert (mtype, r) == (MSG_HELLO | REPLY, rid)
    return p


# ---- HELLO --------------------------------------------------------------------

def test_hello_versions(daemon):
    n_layers = du.SYNTH_LAYERS
    s = daemon.connect()
    v1 = hello_raw(s, 1, 1, 1)
    assert len(v1) == 64 and struct.unpack_from("<H", v1)[0] == 1
    s.sendall(du.frame(MSG_HELLO, 2))  # empty payload: version 1 only
    mtype, _, p = du.read_frame(s)
    assert len(p) == 64 and p == v1
    for lo, hi in ((1, 2), (2, 2), (1, 9)):
        v2 = hello_raw(s, 3, lo, hi)
        assert struct.unpack_from("<H", v2)[0] == 2
        assert v2[2:64] == v1[2:64]  # the version-1 part is the same
        n = struct.unpack_from("<I", v2, 64)[0]
        assert len(v2) == 68 + 4 * n
        layers = struct.unpack_from("<%dI" % n, v2, 68)
        # the synthetic model: every layer from first_moe_layer on is MoE
        first = struct.unpack_from("<I", v1, 28)[0]
        assert layers == tuple(range(first, n_layers)) and n >= 1
    s.sendall(du.frame(MSG_HELLO, 4, struct.pack("<HHI", 3, 4, 0)))
    du.expect_error(s, E["version"], "client speaks versions 3..4; this daemon speaks 1..2",
                    rid=4)
    s.close()


def test_python_client_hello_v2(daemon):
    with mc.Client(daemon.sock_path) as c:
        info = c.hello()
        assert info.version == 2
        assert info.moe_layers == tuple(range(info.first_moe_layer, info.n_layers))
        assert info.n_shared == 1  # the tiny preset: the routed-only tests need one


# ---- FORWARD flags --------------------------------------------------------------

def test_unknown_flag_bits_refused(daemon):
    with mc.Client(daemon.sock_path) as c:
        info = c.hello()
        x, ids, w = routing(info, 2, 1)
        s = daemon.connect()
        p = du.forward_payload(info.moe_layers[0], x.tobytes(), ids, w, flags=0x6)
        s.sendall(du.frame(MSG_FORWARD, 9, p))
        du.expect_error(s, E["inval"], "forward flags 0x6 has unknown bits 0x4", rid=9)
        # -1 without the empty-slot flag is refused, naming the flag
        ids2 = ids.copy()
        ids2[1, 0] = -1
        s.sendall(du.frame(MSG_FORWARD, 10, du.forward_payload(info.moe_layers[0], x.tobytes(),
                                                               ids2, w)))
        du.expect_error(s, E["inval"], "(-1 is an empty slot only with forward flag 0x2)",
                        rid=10)
        with pytest.raises(mc.MoedError) as ei:
            c.forward(info.moe_layers[0], x, np.where(ids2 < 0, -2, ids2), w, empty_slots=True)
        assert ei.value.name == "inval" and "expert id -2" in ei.value.message
        s.close()


def test_empty_slots_and_routed_only_match_reference(daemon, ref):
    with mc.Client(daemon.sock_path) as c:
        info = c.hello()
        layer = info.moe_layers[-1]
        x, ids, w = routing(info, 13, 2)
        ids[::3, 0] = -1   # some empty slots (their weights stay nonzero: ignored)
        ids[4] = -1        # a token with every slot empty
        full = c.forward(layer, x, ids, w, empty_slots=True)
        routed = c.forward(layer, x, ids, w, empty_slots=True, routed_only=True)
        plain = c.forward(layer, x, np.maximum(ids, 0), np.where(ids < 0, 0, w))
    want_full = ref.forward(layer, x, ids, w)
    want_routed = ref.forward(layer, x, ids, w, routed_only=True)
    assert du.rel_l2(full, want_full) < TOL
    assert du.rel_l2(routed, want_routed) < TOL
    # an empty slot adds exactly what a zero weight adds: nothing
    assert np.array_equal(full, plain)
    # the all-empty token: routed-only gives exact zeros, the full output its shared term
    assert not du.bf16_to_f64(routed[4]).any()
    assert np.abs(du.bf16_to_f64(full[4])).max() > 0
    # the shared term is what routed-only leaves out
    shared = want_full - want_routed
    assert np.linalg.norm(shared) > 0.1 * np.linalg.norm(want_full)
    assert du.rel_l2(full, want_routed) > 10 * TOL


def test_flags_not_merged_across_requests(daemon, ref):
    """Routed-only and full requests of one layer pipelined on two connections:
    the engine batches only requests with the same flags, so each gets its own
    answer."""
    with mc.Client(daemon.sock_path) as a, mc.Client(daemon.sock_path) as b:
        info = a.hello()
        b.hello()
        layer = info.moe_layers[0]
        reqs = [routing(info, 3 + i % 4, 10 + i) for i in range(12)]
        for i, (x, ids, w) in enumerate(reqs):
            (a if i % 2 else b).send_forward(i + 1, layer, x, ids, w, routed_only=bool(i % 2))
        got = {}
        while a.inflight or b.inflight:
            for c in (a, b):
                if c.inflight:
                    rid, y = c.recv()
                    got[rid - 1] = y
    for i, (x, ids, w) in enumerate(reqs):
        assert du.rel_l2(got[i], ref.forward(layer, x, ids, w, routed_only=bool(i % 2))) < TOL, i


def test_c_client_flags_and_zero_tokens(daemon, ref, tmp_path):
    """The C client library (tests/tools/client_forward) with FORWARD flags,
    blocking and pipelined, and with T = 0."""
    tool = os.path.join(du.BUILD, "tools", "client_forward")
    with mc.Client(daemon.sock_path) as c:
        info = c.hello()
    layer = info.moe_layers[0]
    x, ids, w = routing(info, 6, 7)
    ids[1, :] = -1
    ids[3, 1] = -1
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.write_bytes(x.tobytes() + ids.astype("<i4").tobytes() + w.astype("<f4").tobytes())
    for repeat, flags in (("1", "3"), ("5", "3"), ("1", "2")):
        r = subprocess.run([tool, daemon.sock_path, str(layer), "6", str(inp), str(out), repeat,
                            flags], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        y = np.frombuffer(out.read_bytes(), dtype=np.uint16).reshape(6, info.hidden)
        assert du.rel_l2(y, ref.forward(layer, x, ids, w, routed_only=flags == "3")) < TOL
    r = subprocess.run([tool, daemon.sock_path, str(layer), "6", str(inp), str(out), "1", "0"],
                       capture_output=True, text=True, timeout=60)  # -1 without flag 0x2
    assert r.returncode == 1 and "empty slot only with forward flag 0x2" in r.stderr
    (tmp_path / "empty").write_bytes(b"")
    for repeat in ("1", "3"):
        r = subprocess.run([tool, daemon.sock_path, str(layer), "0", str(tmp_path / "empty"),
                            str(out), repeat], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert out.read_bytes() == b""


# ---- T = 0 ------------------------------------------------------------------------

def test_zero_tokens(daemon):
    with mc.Client(daemon.sock_path) as c:
        info = c.hello()
        layer = info.moe_layers[0]
        s = daemon.connect()
        x, ids, w = routing(info, 2, 3)
        # pipelined: T=0 between two real requests, every reply by its id
        s.sendall(du.frame(MSG_FORWARD, 1, du.forward_payload(layer, x.tobytes(), ids, w)) +
                  du.frame(MSG_FORWARD, 2, struct.pack("<IIII", layer, 0, info.top_k, 0)) +
                  du.frame(MSG_FORWARD, 3, du.forward_payload(layer, x.tobytes(), ids, w)))
        replies = {}
        for _ in range(3):
            mtype, rid, p = du.read_frame(s)
            assert mtype == MSG_FORWARD | REPLY
            replies[rid] = p
        assert replies[2] == struct.pack("<II", 0, info.hidden)
        assert replies[1] == replies[3] and len(replies[1]) == 8 + 4 * info.hidden
        # still validated: a T=0 request for a dense layer or with bytes after its head
        s.sendall(du.frame(MSG_FORWARD, 4, struct.pack("<IIII", layer, 0, info.top_k, 0) + b"x"))
        du.expect_error(s, E["inval"], "payload is 17 bytes but T=0", rid=4)
        s.close()
        # the Python client: an empty [0, H] of the input's kind and dtype
        for dt in (np.float32, np.uint16):
            y = c.forward(layer, np.zeros((0, info.hidden), dt), np.zeros((0, info.top_k),
                                                                          np.int32),
                          np.zeros((0, info.top_k), np.float32))
            assert y.shape == (0, info.hidden) and y.dtype == dt
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:  # a torch tensor in: an empty tensor of its dtype out
            y = c.forward(layer, torch.zeros((0, info.hidden), dtype=torch.float16),
                          torch.zeros((0, info.top_k), dtype=torch.int64),
                          torch.zeros((0, info.top_k)))
            assert tuple(y.shape) == (0, info.hidden) and y.dtype == torch.float16
        assert c.status()["requests"]["served"] >= 3


# ---- T over max_tokens: split by the client -------------------------------------------

def test_client_splits_over_max_tokens(daemon, ref):
    with mc.Client(daemon.sock_path, max_inflight=3) as c:
        info = c.hello()
        layer = info.moe_layers[0]
        T = 5 * info.max_tokens + 7   # 6 chunks, 3 in flight at a time
        x, ids, w = routing(info, T, 4)
        y = c.forward(layer, x, ids, w)
        assert y.shape == (T, info.hidden)
        assert du.rel_l2(y, ref.forward(layer, x, ids, w)) < TOL
        # each chunk's rows are exactly what the same rows give alone
        m = info.max_tokens
        alone = c.forward(layer, x[m:2 * m], ids[m:2 * m], w[m:2 * m])
        assert np.array_equal(y[m:2 * m], alone)
        st = c.status()
    assert st["requests"]["served"] >= 7


def test_max_tokens_16384(tmp_path, models_dir):
    """engine.max_tokens 16384 is accepted and one 16384-token request is
    served (the CPU backend computes it 1024 tokens at a time; the CUDA
    backend in one batch, whose h buffer of the tiny model is then exactly
    12 MiB: its last row's loads must stay inside, MOE_GPU_ROW_TAIL_BYTES)."""
    T = 16384
    cfg = du.base_config(str(tmp_path), models_dir, engine__max_tokens=T,
                         server__max_frame_bytes=64 << 20,
                         server__max_client_buffer_bytes=64 << 20,
                         server__frame_timeout_ms=int(du.wait_s(30) * 1000))
    with du.Daemon(tmp_path, cfg) as d:
        with mc.Client(d.sock_path, timeout=du.wait_s(120)) as c:
            info = c.hello()
            assert info.max_tokens == T
            x, ids, w = routing(info, T, 5)
            try:
                y = c.forward(info.moe_layers[0], x, ids, w)
            except mc.MoedError as ex:
                pytest.fail("%s; daemon log: %s" % (ex, d.log()[-3000:]))
            ref = du.F64Reference(du.synth_dir(models_dir))
            rows = np.r_[0:3, 1023:1026, T - 3:T]  # across the CPU backend's chunk seams
            want = ref.forward(info.moe_layers[0], x[rows], ids[rows], w[rows])
            assert du.rel_l2(y[rows], want) < TOL
        assert d.stop() == 0, d.log()[-4000:]
