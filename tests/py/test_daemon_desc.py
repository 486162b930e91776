"""Registered buffers and FORWARD by descriptor (protocol version 2), through
the real socket with the real clients.

The CPU backend cannot open CUDA IPC handles, so with its test switch
MOED_TEST_CPU_SHM_IPC=1 it plays a GPU (engine/test_hooks.h): its UUID is
MOED_TEST_CPU_UUID and an "IPC handle" names a POSIX shared memory object,
which it maps whole. Everything in front of the open (the request's checks,
the registration table, the limit, the ranges of every FORWARD_DESC, the
references a request holds, closing on disconnect) is the daemon's own code,
the same on both backends. Without the switch the CPU backend refuses
REGISTER_BUF with a typed error (test_pyclient_unit).
"""

import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from multiprocessing import shared_memory

import numpy as np
import pytest

import daemon_util as du
import moed_client as mc
from daemon_util import E

UUID = b"moed-cpu-test-id"  # MOED_TEST_CPU_UUID (engine/test_hooks.h)
LIMIT = 4                   # server.max_registered_buffers here
SHM_IPC = {"MOED_TEST_CPU_SHM_IPC": "1"}

# The CPU backend's test switch: on the CUDA backend (make test-gpu) the same
# path runs with real CUDA IPC handles in tests/gpu/test_zero_copy.py.
pytestmark = pytest.mark.skipif(du.TEST_BACKEND != "cpu",
                                reason="CPU backend test switch (GPU: tests/gpu/test_zero_copy.py)")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("desc")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port(),
                         server__max_registered_buffers=LIMIT)
    with du.Daemon(tmp, cfg, env=SHM_IPC) as d:
        yield d
        assert d.alive(), d.log()
        assert d.stop() == 0, d.log()[-4000:]


@pytest.fixture(scope="module")
def cases(daemon, dims):
    return du.reference_cases(daemon, dims, n=6, max_t=dims["max_tokens"], seed=23)


class Shm:
    """A shared memory object the CPU backend maps as a client "allocation"."""

    def __init__(self, size):
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.size = size
        self.handle = ("/" + self.shm.name).encode().ljust(64, b"\0")
        self.buf = np.ndarray((size,), dtype=np.uint8, buffer=self.shm.buf)

    def put(self, off, arr):
        b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        self.buf[off:off + b.size] = b

    def get(self, off, n, dtype):
        return self.buf[off:off + n * np.dtype(dtype).itemsize].view(dtype).copy()

    def close(self):
        del self.buf
        self.shm.close()
        self.shm.unlink()


def layout(dims, t):
    """Offsets of x | ids | w | y in one buffer, each 16-aligned; total bytes."""
    H, k = dims["hidden"], dims["top_k"]
    a = lambda n: (n + 15) // 16 * 16  # noqa: E731
    ox = 0
    oi = a(ox + 2 * t * H)
    ow = a(oi + 4 * t * k)
    oy = a(ow + 4 * t * k)
    return ox, oi, ow, oy, a(oy + 2 * t * H)


def status(daemon):
    url = "http://127.0.0.1:%d/status" % daemon.http_port()
    with urllib.request.urlopen(url, timeout=du.wait_s(5)) as r:
        return json.loads(r.read().decode())["registered_buffers"]


def wait_status(daemon, **want):
    """Poll /status until its registered_buffers fields read `want` (the
    daemon releases them when it sees the client's socket close)."""
    deadline = time.monotonic() + du.wait_s(20)
    while True:
        st = status(daemon)
        if all(st[k] == v for k, v in want.items()):
            return st
        assert time.monotonic() < deadline, "registered_buffers %r, want %r" % (st, want)
        time.sleep(0.02)


def forward_by_desc(c, shm, dims, bid, layer, x, ids, w):
    """One layer by descriptor over registration bid of shm (x | ids | w |
    y as layout() places them, y first filled with 0xFFFF): y's bits [T, H]."""
    t = x.shape[0]
    ox, oi, ow, oy, _ = layout(dims, t)
    shm.put(ox, x)
    shm.put(oi, ids)
    shm.put(ow, w)
    shm.put(oy, np.full(t * dims["hidden"], 0xFFFF, np.uint16))
    c.forward_desc(layer, t, (bid, ox), (bid, oi), (bid, ow), (bid, oy))
    return shm.get(oy, t * dims["hidden"], np.uint16).reshape(t, -1)


def daemon_maps(daemon, shm):
    with open("/proc/%d/maps" % daemon.pid) as f:
        return [l for l in f if shm.shm.name in l]


def test_forward_desc_equals_inline_bit_for_bit(daemon, dims, cases):
    """Every case by descriptor gives the inline FORWARD's y bit for bit (and
    the float64 reference's within the tolerance the inline tests use)."""
    tmax = max(c[1].shape[0] for c in cases)
    shm = Shm(layout(dims, tmax)[4])
    try:
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
            assert c.hello().version == 2
            bid = c.register_buf(shm.handle, 0, shm.size, UUID)
            assert bid > 0
            for layer, x, ids, w, ref in cases:
                y = forward_by_desc(c, shm, dims, bid, layer, x, ids, w)
                y_inline = c.forward(layer, x, ids, w)
                assert np.array_equal(y, np.asarray(y_inline).view(np.uint16)), layer
                assert du.rel_l2(du.bf16_to_f64(y), ref) < 2e-2
            c.unregister_buf(bid)
        st = status(daemon)
        assert st["descriptor_requests"] >= len(cases), st
    finally:
        shm.close()


def test_register_checks_every_input(daemon, dims):
    """Each bad REGISTER_BUF gets its typed error, nothing is mapped, the
    connection stays usable; the per-connection limit holds and frees."""
    shm = Shm(1 << 16)
    try:
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
            bad = [
                ((shm.handle, 0, 4096, b"x" * 16), "inval", "not on this daemon's GPU"),
                ((b"/moedt-no-such-shm".ljust(64, b"\0"), 0, 4096, UUID), "io", "will not open"),
                ((shm.handle, 0, shm.size + 16, UUID), "range", "past the end"),
                ((shm.handle, 1 << 20, 16, UUID), "range", "past the end"),
                ((shm.handle, 16, (1 << 64) - 16, UUID), "range", "overflows"),
                ((shm.handle, 8, 64, UUID), "inval", "multiple of 16"),
                ((shm.handle, 0, 0, UUID), "inval", "size is 0"),
            ]
            for args, name, text in bad:
                with pytest.raises(mc.MoedError) as e:
                    c.register_buf(*args)
                assert e.value.name == name and text in e.value.message, (args[1:3], e.value)
                assert c.ping() >= 0
            assert status(daemon)["mappings"] == 0
            assert not daemon_maps(daemon, shm)
            # a payload of the wrong size, from a raw socket
            s = daemon.connect()
            s.sendall(du.frame(du.MSG_REGISTER_BUF, 7, b"\0" * 95, version=2))
            du.expect_error(s, E["inval"], "expected 96", rid=7)
            s.close()
            # the limit: LIMIT registrations (one mapping: the same handle), then busy
            ids = [c.register_buf(shm.handle, 4096 * i, 4096, UUID) for i in range(LIMIT)]
            assert len(set(ids)) == LIMIT
            st = status(daemon)
            assert st["registered"] == LIMIT and st["mappings"] == 1, st
            with pytest.raises(mc.MoedError) as e:
                c.register_buf(shm.handle, 0, 4096, UUID)
            assert e.value.name == "busy" and "max_registered_buffers" in e.value.message
            c.unregister_buf(ids[0])
            with pytest.raises(mc.MoedError) as e:
                c.unregister_buf(ids[0])
            assert e.value.name == "inval" and "not registered" in e.value.message
            ids[0] = c.register_buf(shm.handle, 0, 4096, UUID)
            for i in ids:
                c.unregister_buf(i)
        wait_status(daemon, registered=0, mappings=0)
        assert not daemon_maps(daemon, shm)
    finally:
        shm.close()


def test_forward_desc_checks_every_range(daemon, dims, cases):
    """Bad FORWARD_DESCs get typed errors before anything is queued, a second
    client's inline traffic is unaffected, and a good request still works."""
    layer, x, ids, w, ref = cases[0]
    t = x.shape[0]
    ox, oi, ow, oy, total = layout(dims, t)
    shm = Shm(total + 4096)
    other = [c for c in cases if c is not cases[0]][:2]
    try:
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c, \
                mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c2:
            bid = c.register_buf(shm.handle, 0, total, UUID)
            small = c.register_buf(shm.handle, 0, 64, UUID)
            twin = c.register_buf(shm.handle, 0, total, UUID)  # the same bytes again
            shm.put(ox, x)
            shm.put(oi, ids)
            shm.put(ow, w)
            good = dict(x=(bid, ox), ids=(bid, oi), w=(bid, ow), y=(bid, oy))
            big = (1 << 64) - 16
            bad = [
                (dict(x=(999, ox)), "inval", "not registered"),
                (dict(y=(bid, total)), "range", "past the end"),
                (dict(x=(small, 0)), "range", "past the end"),
                (dict(w=(bid, big)), "range", "past the end"),
                (dict(x=(bid, ox + 8)), "inval", "multiple of 16"),
                (dict(ids=(bid, oi + 2)), "inval", "multiple of 4"),
                (dict(y=(bid, ox)), "inval", "y overlaps x"),
                (dict(y=(twin, ox)), "inval", "y overlaps x"),
                (dict(y=(bid, oi - 16 if oi >= 16 else 0)), "inval", "y overlaps"),
                (dict(x=(0, ox)), "inval", "must be non-zero"),
            ]
            for over, name, text in bad:
                r = dict(good, **over)
                with pytest.raises(mc.MoedError) as e:
                    c.forward_desc(layer, t, r["x"], r["ids"], r["w"], r["y"])
                assert e.value.name == name and text in e.value.message, (over, e.value)
                # the other client is served as usual in between
                l2, x2, ids2, w2, _ = other[len(text) % len(other)]
                y2 = c2.forward(l2, x2, ids2, w2)
                assert np.array_equal(np.asarray(y2).view(np.uint16),
                                      np.asarray(c2.forward(l2, x2, ids2, w2)).view(np.uint16))
            for tt, lay, text in ((0, layer, "n_tokens 0"),
                                  (dims["max_tokens"] + 1, layer, "out of range"),
                                  (t, dims["n_layers"] + 5, "not an MoE layer")):
                with pytest.raises(mc.MoedError) as e:
                    c.forward_desc(lay, tt, good["x"], good["ids"], good["w"], good["y"])
                assert e.value.name == "inval" and text in e.value.message
            # another connection's buffer ids mean nothing here
            with pytest.raises(mc.MoedError) as e:
                c2.forward_desc(layer, t, good["x"], good["ids"], good["w"], good["y"])
            assert e.value.name == "inval" and "not registered" in e.value.message
            # an expert id out of range in the client's memory: the backend
            # refuses the batch (the host cannot read GPU ids; CPU checks here)
            bad_ids = ids.copy()
            bad_ids[0, 0] = dims["n_experts"]
            shm.put(oi, bad_ids)
            with pytest.raises(mc.MoedError) as e:
                c.forward_desc(layer, t, good["x"], good["ids"], good["w"], good["y"])
            assert e.value.name == "inval", e.value
            shm.put(oi, ids)
            c.forward_desc(layer, t, good["x"], good["ids"], good["w"], good["y"])
            y = shm.get(oy, t * dims["hidden"], np.uint16).reshape(t, -1)
            assert np.array_equal(y, np.asarray(c.forward(layer, x, ids, w)).view(np.uint16))
    finally:
        shm.close()
    wait_status(daemon, registered=0, mappings=0)


def test_unregister_while_in_flight_keeps_the_mapping(daemon, dims, cases):
    """FORWARD_DESC then UNREGISTER pipelined on one socket: the request holds
    its buffer, completes correctly, and the mapping goes after it."""
    layer, x, ids, w, ref = cases[1]
    t = x.shape[0]
    ox, oi, ow, oy, total = layout(dims, t)
    shm = Shm(total)
    try:
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
            bid = c.register_buf(shm.handle, 0, total, UUID)
            want = np.asarray(c.forward(layer, x, ids, w)).view(np.uint16)
            s = daemon.connect()
            du.hello(s)
            # ids are per connection: register on the raw socket too
            s.sendall(du.frame(du.MSG_REGISTER_BUF, 2,
                               struct.pack("<64sQQ16s", shm.handle, 0, total, UUID), version=2))
            mtype, rid, p = du.read_frame(s)
            assert mtype == du.MSG_REGISTER_BUF | du.REPLY, mtype
            rbid = struct.unpack("<II", p)[0]
            shm.put(ox, x)
            shm.put(oi, ids)
            shm.put(ow, w)
            desc = struct.pack("<IIII" + "IIQ" * 4, layer, t, dims["top_k"], 0, rbid, 0, ox,
                               rbid, 0, oi, rbid, 0, ow, rbid, 0, oy)
            s.sendall(du.frame(du.MSG_FORWARD_DESC, 3, desc, version=2) +
                      du.frame(du.MSG_UNREGISTER_BUF, 4, struct.pack("<II", rbid, 0), version=2))
            got = {}
            for _ in range(2):
                mtype, rid, p = du.read_frame(s)
                got[rid] = (mtype, p)
            assert got[3][0] == du.MSG_FORWARD_DESC | du.REPLY, got
            assert struct.unpack("<II", got[3][1]) == (t, dims["hidden"])
            assert got[4][0] == du.MSG_UNREGISTER_BUF | du.REPLY and got[4][1] == b""
            y = shm.get(oy, t * dims["hidden"], np.uint16).reshape(t, -1)
            assert np.array_equal(y, want)
            s.close()
            st = status(daemon)
            assert st["mappings"] == 1  # c's registration still holds it
            c.unregister_buf(bid)
        wait_status(daemon, registered=0, mappings=0)
    finally:
        shm.close()


CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[3])
import moed_client as mc
c = mc.Client(sys.argv[1], timeout=30)
for i in range(3):
    c.register_buf(sys.argv[2].encode().ljust(64, b"\0"), 4096 * i, 4096, b"moed-cpu-test-id")
print("registered", flush=True)
time.sleep(600)
"""


def test_killed_clients_leave_no_mapping(daemon, dims):
    """Clients that register and are killed with SIGKILL: once the daemon sees
    the sockets close, every registration and mapping is gone (its
    /proc/PID/maps no longer names the object) and it keeps serving."""
    shm = Shm(1 << 16)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, daemon.sock_path, "/" + shm.shm.name,
                                   os.path.join(du.ROOT, "ipc", "python")],
                                  stdout=subprocess.PIPE, text=True) for _ in range(3)]
        for p in procs:
            assert p.stdout.readline().strip() == "registered"
        st = status(daemon)
        assert st["registered"] == 9 and st["mappings"] == 1, st
        assert daemon_maps(daemon, shm)
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
            p.stdout.close()
        wait_status(daemon, registered=0, mappings=0)
        assert not daemon_maps(daemon, shm)
        assert daemon.alive()
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
            assert c.ping() >= 0
    finally:
        shm.close()


def test_cpu_backend_refuses_register_with_a_typed_error(tmp_path_factory):
    """Without the test switch the CPU backend cannot open CUDA IPC handles: a
    well-formed REGISTER_BUF, after its checks, is answered unsupported with
    the reason, and the connection stays usable."""
    tmp = tmp_path_factory.mktemp("desc-cpu")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory))
    with du.Daemon(tmp, cfg) as d:
        with mc.Client(d.sock_path, timeout=du.wait_s(30)) as c:
            assert c.hello().version == 2
            with pytest.raises(mc.MoedError) as e:
                c.register_buf(b"\1" * 64, 8, 4096, UUID)
            assert e.value.name == "inval" and "multiple of 16" in e.value.message
            with pytest.raises(mc.MoedError) as e:
                c.register_buf(b"\1" * 64, 0, 4096, UUID)
            assert e.value.name == "unsupported" and "cannot open CUDA IPC" in e.value.message
            with pytest.raises(mc.MoedError) as e:
                c.forward_desc(c.info.first_moe_layer, 1, (1, 0), (1, 0), (1, 0), (1, 16))
            assert e.value.name == "inval" and "not registered" in e.value.message
            assert c.ping() >= 0
        assert d.stop() == 0, d.log()[-4000:]


def test_c_client_register_and_forward_desc(daemon, dims, cases):
    """The C library's calls (moed_client.h) against the daemon: register,
    forward by descriptor (y equal to the inline path's), with its times, a
    bad range's typed error, unregister."""
    tool = os.path.join(du.BUILD, "tools", "client_desc")
    layer, x, ids, w, ref = cases[2]
    t = x.shape[0]
    ox, oi, ow, oy, total = layout(dims, t)
    shm = Shm(total)
    try:
        shm.put(ox, x)
        shm.put(oi, ids)
        shm.put(ow, w)
        out = subprocess.run([tool, daemon.sock_path, "/" + shm.shm.name, str(total), str(layer),
                              str(t), str(ox), str(oi), str(ow), str(oy)],
                             capture_output=True, text=True, timeout=du.wait_s(60))
        assert out.returncode == 0, out.stdout + out.stderr
        assert "bad range: range" in out.stdout, out.stdout
        # the times call: no kernel time on this CPU backend, some time in the
        # daemon, whose two instants lie on this host's CLOCK_MONOTONIC inside
        # the call as the tool saw it
        times = [l.split() for l in out.stdout.splitlines() if l.startswith("times:")]
        assert len(times) == 1, out.stdout
        v = dict(zip(times[0][1::2], map(int, times[0][2::2])))
        assert v["kernel_ns"] == 0 and v["daemon_ns"] > 0, out.stdout
        assert v["queued_ns"] - v["rx_ns"] == v["daemon_ns"], out.stdout
        assert v["before_ns"] < v["rx_ns"] < v["queued_ns"] < v["after_ns"], out.stdout
        y = shm.get(oy, t * dims["hidden"], np.uint16).reshape(t, -1)
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
            assert np.array_equal(y, np.asarray(c.forward(layer, x, ids, w)).view(np.uint16))
    finally:
        shm.close()
    wait_status(daemon, registered=0, mappings=0)


def test_desc_lat_tool(daemon, dims, cases):
    """tests/tools/desc_lat (bench/zero_copy.py's C client): registers the
    range, times its calls with their times and prints their p50s, each
    piece inside the latency; y equals the inline path's; bad arguments are
    refused with exit 2 and the argument's name."""
    tool = os.path.join(du.BUILD, "tools", "desc_lat")
    layer, x, ids, w, ref = cases[3]
    t = x.shape[0]
    ox, oi, ow, oy, total = layout(dims, t)
    shm = Shm(total)
    try:
        shm.put(ox, x)
        shm.put(oi, ids)
        shm.put(ow, w)
        handle = ("/" + shm.shm.name).encode().ljust(64, b"\0").hex()
        args = [tool, daemon.sock_path, handle, "0", str(total), UUID.hex(), str(layer), str(t),
                str(ox), str(oi), str(ow), str(oy)]
        out = subprocess.run(args + ["20"], capture_output=True, text=True,
                             timeout=du.wait_s(120))
        assert out.returncode == 0, out.stdout + out.stderr
        f = out.stdout.split()
        assert f[:4] == ["desc_lat", "T", str(t), "iters"] and f[4] == "20", out.stdout
        v = {k[:-3]: float(n) for k, n in zip(f[5::2], f[6::2])}
        assert sorted(v) == ["back", "client", "idle_probe", "lat", "over", "probe", "to"], \
            out.stdout
        assert v["probe"] > 0 and v["idle_probe"] > 0, v
        # no kernel time on this backend: over the kernel is the latency
        assert v["lat"] > 0 and v["over"] == v["lat"], v
        assert 0 < v["client"] < v["lat"] and v["to"] > 0 and v["back"] > 0, v
        assert v["to"] + v["back"] < v["lat"] + 1.0, v  # p50s of parts of each call
        y = shm.get(oy, t * dims["hidden"], np.uint16).reshape(t, -1)
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
            assert np.array_equal(y, np.asarray(c.forward(layer, x, ids, w)).view(np.uint16))
        for i, bad, name in ((2, "abc", "HANDLE_HEX"), (3, "-1", "OFFSET"),
                             (7, "x", "T"), (12, "0", "ITERS")):
            a = list(args + ["20"])
            a[i] = bad
            out = subprocess.run(a, capture_output=True, text=True, timeout=du.wait_s(30))
            assert out.returncode == 2 and name in out.stderr, (a, out.stderr)
    finally:
        shm.close()
    wait_status(daemon, registered=0, mappings=0)


def test_forward_desc_times(daemon, dims, cases, tmp_path_factory):
    """Flag 0x100 (DESC_TIMES): the reply carries the request's kernel time
    and its time in the daemon. Without a kernel time (this CPU backend) the
    first is 0; with the CPU backend's MOED_TEST_CPU_KERNEL_TIME it is the
    batch's compute time, inside the daemon time. y is the same either way,
    and another flag bit is refused with its name."""
    layer, x, ids, w, ref = cases[1]
    t = x.shape[0]
    ox, oi, ow, oy, total = layout(dims, t)
    shm = Shm(total)
    tmp = tmp_path_factory.mktemp("desc-times")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port())
    try:
        shm.put(ox, x)
        shm.put(oi, ids)
        shm.put(ow, w)
        refs = [(None, o) for o in (ox, oi, ow, oy)]
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
            bid = c.register_buf(shm.handle, 0, total, UUID)
            r = [(bid, o) for _, o in refs]
            y_inline = np.asarray(c.forward(layer, x, ids, w)).view(np.uint16)
            assert c.forward_desc(layer, t, *r) is None
            assert c.desc_stamps is None  # set by calls with times only
            t_before = time.monotonic_ns()
            kernel_ns, daemon_ns, rx_ns, queued_ns = c.forward_desc(layer, t, *r, times=True)
            assert kernel_ns == 0 and daemon_ns > 0, (kernel_ns, daemon_ns)
            sent, got = c.desc_stamps  # the request's write begun, then the reply in hand
            # the daemon's instants on this host's CLOCK_MONOTONIC, inside the call
            assert queued_ns - rx_ns == daemon_ns, (rx_ns, queued_ns, daemon_ns)
            assert t_before <= sent < rx_ns < queued_ns < got <= time.monotonic_ns(), \
                (t_before, sent, rx_ns, queued_ns, got)
            assert np.array_equal(shm.get(oy, t * dims["hidden"], np.uint16).reshape(t, -1),
                                  y_inline)
            req = mc._DESC_REQ.pack(layer, t, dims["top_k"], 0x300, *[v for b, o in r
                                                                     for v in (b, 0, o)])
            with pytest.raises(mc.MoedError) as e:
                c._call(mc.MSG_FORWARD_DESC, req)
            assert e.value.name == "inval" and "unknown bits 0x200" in e.value.message, e.value
            c.unregister_buf(bid)
        with du.Daemon(tmp, cfg, env=dict(SHM_IPC, MOED_TEST_CPU_KERNEL_TIME="1")) as d2, \
                mc.Client(d2.sock_path, timeout=du.wait_s(30)) as c:
            bid = c.register_buf(shm.handle, 0, total, UUID)
            for _ in range(3):
                kernel_ns, daemon_ns, rx_ns, queued_ns = c.forward_desc(
                    layer, t, *[(bid, o) for _, o in refs], times=True)
                assert 0 < kernel_ns < daemon_ns == queued_ns - rx_ns, \
                    (kernel_ns, daemon_ns, rx_ns, queued_ns)
            assert np.array_equal(shm.get(oy, t * dims["hidden"], np.uint16).reshape(t, -1),
                                  y_inline)
            c.unregister_buf(bid)
            assert d2.stop() == 0, d2.log()[-4000:]
    finally:
        shm.close()
    wait_status(daemon, registered=0, mappings=0)
