"""Doorbell channels, the daemon's side (protocol version 2, PROTOCOL.md
section 10): CHAN_OPEN / CHAN_CLOSE through the real socket with raw frames
(chan_frames.py) and the C client.

The CPU backend has no channels; with its test switch MOED_TEST_CPU_CHANNELS
(engine/test_hooks.h) it gets fake channel ops (a table of
engine.max_channels entries that serve nothing and report a closed entry
quiet a few polls later), and with MOED_TEST_CPU_SHM_IPC it plays a GPU for
registered buffers. Everything else here is the daemon's own code, the same
on both backends: the checks and their messages, the references a channel
holds on its registrations, UNREGISTER_BUF refused while a channel names the
buffer, draining and reaping on CHAN_CLOSE and on disconnect, /status and
/metrics. The GPU path (the kernel serving a channel) is tests/gpu/.
"""
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import chan_frames as cf
import daemon_util as du
import moed_client as mc
from test_daemon_desc import Shm

UUID = b"moed-cpu-test-id"  # MOED_TEST_CPU_UUID (engine/test_hooks.h)
MAX_CHANS = 2               # engine.max_channels here
LIMIT = 8                   # server.max_registered_buffers here
ENV = {"MOED_TEST_CPU_SHM_IPC": "1", "MOED_TEST_CPU_CHANNELS": "1"}
KERNEL = b"moed-cpu-test-kernel"  # the fake backend's "fatbin" (backend_cpu.c)

pytestmark = pytest.mark.skipif(du.TEST_BACKEND != "cpu",
                                reason="CPU backend test switch (GPU: tests/gpu/)")


def abi_version():
    with open(os.path.join(du.ROOT, "kernels", "moe_gpu_abi.h")) as f:
        for line in f:
            if line.startswith("#define MOE_GPU_ABI_VERSION"):
                return int(line.split()[2].rstrip("u"))
    raise AssertionError("MOE_GPU_ABI_VERSION not found")


def start(tmp_path_factory, name, env, **over):
    tmp = tmp_path_factory.mktemp(name)
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port(),
                         **over)
    return du.Daemon(tmp, cfg, env=env)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with start(tmp_path_factory, "chan", ENV, server__max_registered_buffers=LIMIT,
               engine__max_channels=MAX_CHANS) as d:
        yield d
        assert d.alive(), d.log()
        assert d.stop() == 0, d.log()[-4000:]


@pytest.fixture(scope="module")
def cases(daemon, dims):
    return du.reference_cases(daemon, dims, n=2, max_t=4, seed=29)


def same(y, want):
    return np.array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.fixture
def shm():
    s = Shm(1 << 16)
    yield s
    s.close()


def get(daemon, path):
    url = "http://127.0.0.1:%d%s" % (daemon.http_port(), path)
    with urllib.request.urlopen(url, timeout=du.wait_s(5)) as r:
        return r.read().decode()


def status(daemon):
    st = json.loads(get(daemon, "/status"))
    return st["channels"], st["registered_buffers"]


def wait_idle(daemon):
    """Poll /status until no channel is open or draining and nothing is
    registered (the daemon reaps a closed channel once the backend reports
    it quiet, and releases a client's registrations when it sees its socket
    close)."""
    deadline = time.monotonic() + du.wait_s(20)
    while True:
        ch, rb = status(daemon)
        if ch["open"] == ch["draining"] == 0 and not ch["list"] and \
                rb["registered"] == rb["mappings"] == 0:
            return ch
        assert time.monotonic() < deadline, (ch, rb)
        time.sleep(0.02)


def let_go_and_serving(daemon, shm):
    """Nothing open, draining or registered, the object no longer mapped in
    the daemon (/proc/PID/maps), and the daemon still serving."""
    wait_idle(daemon)
    with open("/proc/%d/maps" % daemon.pid) as f:
        assert shm.shm.name not in f.read()
    assert daemon.alive()
    a = cf.Raw(daemon)
    a.ping()
    a.close()


def test_chan_open_and_close_check_every_input(daemon, dims, shm, cases):
    """Each bad CHAN_OPEN / CHAN_CLOSE gets its code and message, takes
    nothing, and leaves the connection and another client's traffic as they
    were."""
    a, b = cf.Raw(daemon), cf.Raw(daemon)
    other = mc.Client(daemon.sock_path, timeout=du.wait_s(30))
    layer, x, ids, w, _ = cases[0]
    want = other.forward(layer, x, ids, w)
    try:
        bid = a.register(shm.handle, 0, 4096, UUID)
        b_bid = b.register(shm.handle, 4096, 4096, UUID)
        assert b_bid == bid  # ids are per connection: the same number means another buffer
        b_only = b.register(shm.handle, 8192, 4096, UUID)
        ch0, _ = status(daemon)
        good = cf.open_payload(UUID, [bid])
        bad = [
            (good[:-1], "inval", "CHAN_OPEN payload is 87 bytes; expected 88 or 96"),
            (good + b"\0", "inval", "CHAN_OPEN payload is 89 bytes; expected 88 or 96"),
            (good + bytes(9), "inval", "CHAN_OPEN payload is 97 bytes; expected 88 or 96"),
            (good + bytes(7), "inval", "CHAN_OPEN payload is 95 bytes; expected 88 or 96"),
            (b"", "inval", "CHAN_OPEN payload is 0 bytes"),
            # with an arena it is buffer 0: 15 ids at most
            (cf.open_payload(UUID, [bid] * 16, arena_bytes=64), "inval",
             "CHAN_OPEN n_bufs 16 is out of range [0, 15] (with an arena, buffer 0 is the "
             "arena)"),
            (cf.open_payload(UUID, [], n_bufs=0), "inval", "n_bufs 0 is out of range [1, 16]"),
            (cf.open_payload(UUID, [bid] * 16, n_bufs=17), "inval",
             "n_bufs 17 is out of range [1, 16]"),
            (cf.open_payload(UUID, [bid, 0, 5], n_bufs=1), "inval",
             "buf_ids[2] is 5 past n_bufs 1 (unused ids must be 0)"),
            (cf.open_payload(UUID, [bid, 0], n_bufs=2), "inval", "buf_ids[1] is 0"),
            (cf.open_payload(UUID, [bid], flags=1), "inval", "CHAN_OPEN flags 0x1 are not 0"),
        ]
        for payload, code, text in bad:
            a.expect_error(cf.MSG_CHAN_OPEN, payload, code, text)
            a.ping()
        decoded = len(bad)
        # the daemon's checks (after the payload decoded)
        bad = [
            (cf.open_payload(UUID, [bid, 999]), "inval",
             "buf_ids[1]: buffer id 999 is not registered on this connection"),
            (cf.open_payload(UUID, [b_only]), "inval",  # b's id, not a's
             "buf_ids[0]: buffer id %d is not registered on this connection" % b_only),
            (cf.open_payload(b"x" * 16, [bid]), "inval",
             "the client's kernels run on GPU 78787878787878787878787878787878, not on this "
             "daemon's GPU"),
        ]
        for payload, code, text in bad:
            a.expect_error(cf.MSG_CHAN_OPEN, payload, code, text)
            a.ping()
            # the other client is served as before, bit for bit
            assert same(other.forward(layer, x, ids, w), want)
        # a version-1 frame of the type: unsupported, the connection stays
        a.expect_error(cf.MSG_CHAN_OPEN, good, "unsupported", "needs protocol version 2 frames",
                       version=1)
        a.ping()
        ch, rb = status(daemon)
        assert ch["open"] == 0 and ch["opened"] == ch0["opened"], ch
        assert ch["refused"] == ch0["refused"] + len(bad), (ch, ch0, decoded)
        # CHAN_CLOSE: length, reserved, a channel that is not open here
        opened = b.chan_open(UUID, [b_bid])
        for payload, code, text in [
                (cf.close_payload(opened["chan_id"])[:7], "inval",
                 "CHAN_CLOSE payload is 7 bytes; expected 8"),
                (cf.close_payload(opened["chan_id"]) + b"\0", "inval",
                 "CHAN_CLOSE payload is 9 bytes"),
                (cf.close_payload(opened["chan_id"], reserved=1), "inval",
                 "CHAN_CLOSE reserved is 1, not 0"),
                (cf.close_payload(0), "inval", "unknown channel 0"),
                (cf.close_payload(12345), "inval", "unknown channel 12345"),
                # b's channel, named on a: unknown there, and still open on b
                (cf.close_payload(opened["chan_id"]), "inval",
                 "unknown channel %d (not open on this connection)" % opened["chan_id"])]:
            a.expect_error(cf.MSG_CHAN_CLOSE, payload, code, text)
        a.expect_error(cf.MSG_CHAN_CLOSE, cf.close_payload(opened["chan_id"]), "unsupported",
                       "needs protocol version 2 frames", version=1)
        assert status(daemon)[0]["open"] == 1
        b.chan_close(opened["chan_id"])
        b.expect_error(cf.MSG_CHAN_CLOSE, cf.close_payload(opened["chan_id"]), "inval",
                       "unknown channel %d" % opened["chan_id"])
        b.ping()
        assert same(other.forward(layer, x, ids, w), want)
    finally:
        a.close()
        b.close()
        other.close()
    wait_idle(daemon)


def arena_limit(info):
    """CHAN_OPEN's arena_bytes limit (PROTOCOL.md 10.1): max_tokens rows of
    x, ids, w and y, + 64."""
    return info.max_tokens * (4 * info.hidden + 8 * info.top_k) + 64


def test_chan_open_with_an_arena(daemon, shm):
    """CHAN_OPEN with arena_bytes through the Python client: the reply's
    arena_off (4096) and arena_bytes, with no ids (the arena alone) or with
    15 (the table's other entries); /status lists each channel's arena and
    the total, /metrics the gauge; the limit is accepted, one byte more
    refused with its message; closed and reaped, the arenas are gone from
    the totals."""
    with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
        info = c.hello()
        limit = arena_limit(info)
        bid = c.register_buf(shm.handle, 0, 4096, UUID)
        ch0, _ = status(daemon)
        a = c.chan_open([], UUID, arena_bytes=limit)
        assert (a.arena_off, a.arena_bytes) == (cf.ARENA_OFF, limit), a
        assert a.chan_id > 0 and a.size == cf.CHAN_BYTES and a.kernel == KERNEL
        b = c.chan_open([bid] * 15, UUID, arena_bytes=4096)
        assert (b.arena_off, b.arena_bytes) == (cf.ARENA_OFF, 4096), b
        ch, _ = status(daemon)
        assert ch["arena_bytes"] == limit + 4096 and ch["open"] == 2, ch
        assert sorted((x["id"], x["buffers"], x["arena_bytes"]) for x in ch["list"]) == \
            sorted([(a.chan_id, 0, limit), (b.chan_id, 15, 4096)]), ch
        m = dict(line.split() for line in get(daemon, "/metrics").splitlines()
                 if line.startswith("moed_channel_arena_bytes "))
        assert float(m["moed_channel_arena_bytes"]) == limit + 4096, m
        c.chan_close(a.chan_id)
        # one byte over the limit: refused, counted, nothing taken
        with pytest.raises(mc.MoedError) as e:
            c.chan_open([], UUID, arena_bytes=limit + 1)
        assert (e.value.name, e.value.message) == (
            "inval", "CHAN_OPEN arena_bytes %d is over the limit %d (max_tokens rows of x, ids, "
            "w and y for this model)" % (limit + 1, limit)), e.value
        ch, _ = status(daemon)
        assert ch["refused"] == ch0["refused"] + 1 and ch["open"] == 1, ch
        # draining, the closed channel's arena still counts until it is reaped
        c.chan_close(b.chan_id)
        c.unregister_buf(bid)
    ch = wait_idle(daemon)
    assert ch["arena_bytes"] == 0 and ch["opened"] == ch0["opened"] + 2, ch


def test_chan_open_both_forms_without_an_arena(daemon, shm):
    """The 88-byte form (no arena_bytes) and the 96-byte form with
    arena_bytes 0 both open a channel without an arena (arena_off and
    arena_bytes 0 in the reply), over the registered buffers as before."""
    a = cf.Raw(daemon)
    try:
        bid = a.register(shm.handle, 0, 4096, UUID)
        short = a.chan_open(UUID, [bid])
        assert len(cf.open_payload(UUID, [bid])) == cf.OPEN_REQ_SHORT
        zero = a.chan_open(UUID, [bid], arena_bytes=0)
        for r in (short, zero):
            assert (r["arena_off"], r["arena_bytes"]) == (0, 0), r
            assert r["chan_id"] > 0 and r["kernel"] == KERNEL
        ch, _ = status(daemon)
        assert ch["arena_bytes"] == 0 and [x["arena_bytes"] for x in ch["list"]] == [0, 0], ch
        for r in (short, zero):
            a.chan_close(r["chan_id"])
        t, p = a.unregister(bid)
        assert t == du.MSG_UNREGISTER_BUF | du.REPLY, du.parse_error(p)
    finally:
        a.close()
    wait_idle(daemon)


def test_chan_lifetime_references_and_table(daemon, shm):
    """A good CHAN_OPEN: the reply head and the fatbin, /status lists the
    channel; a buffer it names cannot be unregistered (busy, naming the
    channel), one it does not name can; the table holds engine.max_channels;
    CHAN_CLOSE drains the channel, which is reaped, and its buffers then
    unregister; a later channel gets a new id and key."""
    a = cf.Raw(daemon)
    try:
        b0 = a.register(shm.handle, 0, 4096, UUID)
        b1 = a.register(shm.handle, 4096, 4096, UUID)
        free = a.register(shm.handle, 8192, 4096, UUID)
        ch0, _ = status(daemon)
        r = a.chan_open(UUID, [b0, b1, b0])
        assert r["chan_id"] > 0 and r["slots"] == cf.CHAN_SLOTS, r
        assert r["handle"].rstrip(b"\0").startswith(b"moed-cpu-test-chan-"), r
        assert r["size"] == cf.CHAN_BYTES and r["abi_version"] == abi_version(), r
        assert r["kernel"] == KERNEL
        ch, rb = status(daemon)
        assert ch["open"] == 1 and ch["opened"] == ch0["opened"] + 1, ch
        assert [(c["id"], c["buffers"], c["draining"]) for c in ch["list"]] == \
            [(r["chan_id"], 3, False)], ch
        assert ch["list"][0]["requests"] == ch["list"][0]["refused"] == 0
        for bid in (b0, b1):
            a.expect_error(du.MSG_UNREGISTER_BUF, struct.pack("<II", bid, 0), "busy",
                           "buffer id %d is named by open channel %d" % (bid, r["chan_id"]))
        t, p = a.unregister(free)
        assert t == du.MSG_UNREGISTER_BUF | du.REPLY, du.parse_error(p)
        # the table: MAX_CHANS entries, the backend says busy past them
        more = [a.chan_open(UUID, [b1]) for _ in range(MAX_CHANS - 1)]
        a.expect_error(cf.MSG_CHAN_OPEN, cf.open_payload(UUID, [b0]), "busy",
                       "all %d channel entries are taken" % MAX_CHANS)
        ids = {r["chan_id"]} | {m["chan_id"] for m in more}
        assert len(ids) == MAX_CHANS
        for m in more + [r]:
            a.chan_close(m["chan_id"])
        # reaped once quiet: the entries are free again, the buffers unnamed
        deadline = time.monotonic() + du.wait_s(20)
        while status(daemon)[0]["draining"] or status(daemon)[0]["open"]:
            assert time.monotonic() < deadline, status(daemon)
            time.sleep(0.02)
        again = a.chan_open(UUID, [b0])
        assert again["chan_id"] not in ids and again["key"] != r["key"], (again, r)
        a.chan_close(again["chan_id"])
        for bid in (b0, b1):
            t, p = a.unregister(bid)
            assert t == du.MSG_UNREGISTER_BUF | du.REPLY, du.parse_error(p)
        a.ping()
    finally:
        a.close()
    ch = wait_idle(daemon)
    assert ch["opened"] >= ch0["opened"] + MAX_CHANS + 1


CHILD = r"""
import struct, sys, time
sys.path.insert(0, sys.argv[3])
sys.path.insert(0, sys.argv[4])
import chan_frames as cf

class D:
    def __init__(self, path): self.path = path
    def connect(self):
        import daemon_util as du
        return du.raw_connect(self.path, 30)

c = cf.Raw(D(sys.argv[1]))
h = sys.argv[2].encode().ljust(64, b"\0")
ids = [c.register(h, 4096 * i, 4096, b"moed-cpu-test-id") for i in range(2)]
c.chan_open(b"moed-cpu-test-id", ids)
print("open", flush=True)
time.sleep(600)
"""


def test_killed_client_leaves_no_channel_and_no_mapping(daemon, shm):
    """A client killed with SIGKILL while its channel is open: the daemon
    closes the channel, drains and reaps it, then releases the registrations
    and the mapping (/proc/PID/maps no longer names the object), and keeps
    serving."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, daemon.sock_path, "/" + shm.shm.name,
                               os.path.join(du.ROOT, "ipc", "python"),
                               os.path.dirname(os.path.abspath(__file__))],
                              stdout=subprocess.PIPE, text=True) for _ in range(MAX_CHANS)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "open"
        ch, rb = status(daemon)
        assert ch["open"] == MAX_CHANS and rb["registered"] == 2 * MAX_CHANS, (ch, rb)
        with open("/proc/%d/maps" % daemon.pid) as f:
            assert shm.shm.name in f.read()
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
            p.stdout.close()
    let_go_and_serving(daemon, shm)


QUIET_POLLS = 3  # the fake backend's CPU_CHAN_QUIET_POLLS: its "served" count at reaping


def test_closed_channels_counts_are_kept(daemon, shm):
    """The doorbell totals are every channel's since start: a channel's
    final counts (the backend's, read once it is quiet) stay in them after
    it is reaped, while an open channel's are listed with it."""
    before = wait_idle(daemon)
    a = cf.Raw(daemon)
    try:
        bid = a.register(shm.handle, 0, 4096, UUID)
        chans = [a.chan_open(UUID, [bid]) for _ in range(MAX_CHANS)]
        ch, _ = status(daemon)
        assert ch["doorbell_requests"] == before["doorbell_requests"], ch
        assert [c["requests"] for c in ch["list"]] == [0] * MAX_CHANS
        for c in chans:
            a.chan_close(c["chan_id"])
    finally:
        a.close()
    after = wait_idle(daemon)
    assert after["doorbell_requests"] == before["doorbell_requests"] + MAX_CHANS * QUIET_POLLS
    assert after["doorbell_refused"] == before["doorbell_refused"]
    assert abs(after["doorbell_kernel_seconds"] - before["doorbell_kernel_seconds"] -
               MAX_CHANS * QUIET_POLLS * 1e-6) < 1e-9, (after, before)


def test_status_and_metrics_agree(daemon, shm):
    """/metrics carries the channel counters /status shows."""
    a = cf.Raw(daemon)
    try:
        bid = a.register(shm.handle, 0, 4096, UUID)
        r = a.chan_open(UUID, [bid])
        ch, _ = status(daemon)
        m = {}
        for line in get(daemon, "/metrics").splitlines():
            if line.startswith("moed_channel") or line.startswith("moed_doorbell"):
                k, v = line.split()
                m[k] = float(v)
        assert m["moed_channels_open"] == ch["open"] == 1
        assert m["moed_channels_draining"] == ch["draining"]
        assert m["moed_channel_opens_total"] == ch["opened"] >= 1
        assert m["moed_channel_refused_total"] == ch["refused"]
        assert m["moed_doorbell_requests_total"] == ch["doorbell_requests"]
        assert m["moed_doorbell_refused_total"] == ch["doorbell_refused"]
        assert m["moed_doorbell_kernel_seconds_total"] == ch["doorbell_kernel_seconds"]
        a.chan_close(r["chan_id"])
    finally:
        a.close()
    wait_idle(daemon)


@pytest.mark.parametrize("env,over,text", [
    # the CPU backend without the switch: no chan ops
    ({"MOED_TEST_CPU_SHM_IPC": "1"}, {},
     "doorbell channels need the cuda backend (backend cpu has none)"),
    # the client on moed's GPU without MPS
    (dict(ENV, MOED_TEST_CPU_NO_MPS="1"), {},
     "the client's GPU is moed's GPU and MPS is off: the client's kernels cannot run while "
     "moed's persistent kernel is resident; start MPS (docs/ZERO_COPY.md)"),
    (ENV, {"engine__max_channels": 0}, "engine.max_channels is 0"),
])
def test_chan_open_unsupported(tmp_path_factory, shm, env, over, text):
    """A well-formed CHAN_OPEN over a registered buffer, where channels
    cannot be: unsupported with the reason; the connection stays."""
    with start(tmp_path_factory, "chan-unsup", env, **over) as d:
        a = cf.Raw(d)
        bid = a.register(shm.handle, 0, 4096, UUID)
        a.expect_error(cf.MSG_CHAN_OPEN, cf.open_payload(UUID, [bid]), "unsupported", text)
        a.ping()
        a.close()
        assert status(d)[0]["refused"] == 1
        assert d.stop() == 0, d.log()[-4000:]


def test_arena_channel_needs_no_registration(tmp_path_factory):
    """Registration off (server.max_registered_buffers 0): a channel with an
    arena alone names nothing registered and opens; one that names an id is
    refused as before."""
    with start(tmp_path_factory, "chan-arena-noreg", ENV, server__max_registered_buffers=0,
               engine__max_channels=MAX_CHANS) as d:
        with mc.Client(d.sock_path, timeout=du.wait_s(30)) as c:
            ci = c.chan_open([], UUID, arena_bytes=256)
            assert (ci.arena_off, ci.arena_bytes) == (cf.ARENA_OFF, 256)
            with pytest.raises(mc.MoedError) as e:
                c.chan_open([1], UUID, arena_bytes=256)
            assert e.value.name == "unsupported" and "registration is off" in e.value.message
            assert status(d)[0]["arena_bytes"] == 256
            c.chan_close(ci.chan_id)
        assert d.stop() == 0, d.log()[-4000:]


def test_chan_open_needs_registration(tmp_path_factory):
    """Plain CPU backend, registration off: CHAN_OPEN is unsupported, saying
    why, before any buffer id is looked at."""
    with start(tmp_path_factory, "chan-noreg", None, server__max_registered_buffers=0) as d:
        a = cf.Raw(d)
        a.expect_error(cf.MSG_CHAN_OPEN, cf.open_payload(UUID, [1]), "unsupported",
                       "registration is off (server.max_registered_buffers is 0)")
        a.ping()
        a.close()
        assert d.stop() == 0, d.log()[-4000:]


def test_c_client_chan_open_and_close(daemon, shm):
    """The C library's calls (moed_client.h): moedc_chan_open's info (id,
    slots, key, size, the fatbin copy), a buffer the channel names refused
    unregistration, a bad id's typed error, close, a second close refused."""
    tool = os.path.join(du.BUILD, "tools", "client_chan")
    out = subprocess.run([tool, daemon.sock_path, "/" + shm.shm.name], capture_output=True,
                         text=True, timeout=du.wait_s(60))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(l.split(": ", 1) for l in out.stdout.splitlines())
    assert int(lines["chan_id"]) > 0 and lines["slots"] == str(cf.CHAN_SLOTS), lines
    assert lines["size"] == str(cf.CHAN_BYTES) and lines["abi"] == str(abi_version())
    assert lines["kernel"] == KERNEL.decode()
    assert lines["unregister named"].startswith("busy (buffer id"), lines
    assert lines["unknown id"].startswith("inval (buf_ids[0]: buffer id 999"), lines
    assert lines["n_bufs 17"].startswith("inval (moedc_chan_open: 17 buffers"), lines
    # an arena alone (no ids); the local and the daemon's arena checks
    assert lines["arena"] == "4096 at 4096", lines
    assert lines["arena and 16"] == "inval (moedc_chan_open: 16 buffers; a channel names 0..15 " \
        "besides its arena)", lines
    assert lines["arena over"].startswith("inval (CHAN_OPEN arena_bytes 1099511627776 is over "
                                          "the limit "), lines
    assert lines["close again"].startswith("inval (unknown channel"), lines
    wait_idle(daemon)


def test_shutdown_with_channels_open_and_draining(tmp_path_factory, shm):
    """SIGTERM while a client holds one channel open and has just closed
    another: the daemon closes the client, lets go of both channels and
    their registrations, and exits 0 (under ASan: with nothing leaked)."""
    with start(tmp_path_factory, "chan-stop", ENV) as d:
        a = cf.Raw(d)
        bid = a.register(shm.handle, 0, 4096, UUID)
        keep = a.chan_open(UUID, [bid])
        gone = a.chan_open(UUID, [bid])
        a.chan_close(gone["chan_id"])
        assert keep["chan_id"] != gone["chan_id"]
        assert d.stop() == 0, d.log()[-4000:]
        a.close()


def test_idle_timeout_spares_an_open_channel(tmp_path_factory, shm):
    """server.idle_timeout_ms: a connection whose channel is open is not
    idle (its client submits on the GPU, with no socket traffic): it stays
    open, channel and all, well past the timeout; once the channel is
    closed the connection idles out as any other. (Before the fix the
    daemon closed it after idle_timeout_ms, and the channel with it.)"""
    idle_ms = int(du.wait_s(0.3) * 1000)
    with start(tmp_path_factory, "chan-idle", ENV, server__idle_timeout_ms=idle_ms,
               server__max_registered_buffers=LIMIT, engine__max_channels=MAX_CHANS) as d:
        a = cf.Raw(d)
        bid = a.register(shm.handle, 0, 4096, UUID)
        r = a.chan_open(UUID, [bid])
        time.sleep(3 * idle_ms / 1000)
        ch, rb = status(d)
        assert ch["open"] == 1 and rb["registered"] == 1, (ch, rb, d.log()[-2000:])
        a.ping()
        a.chan_close(r["chan_id"])
        a.s.settimeout(du.wait_s(5))
        du.expect_error(a.s, du.E["timeout"], "idle for %d ms (server.idle_timeout_ms)" % idle_ms)
        du.expect_closed(a.s)
        assert d.stop() == 0, d.log()[-4000:]


def test_channel_churn_and_abrupt_disconnects(daemon, shm):
    """Abuse, several clients at once: open channels (busy past the table
    is fine), close some, drop the socket with others open, send a CHAN_OPEN
    and hang up without reading the reply, hang up mid-frame, unregister a
    buffer of a channel just closed (draining: allowed, the channel's
    reference keeps the mapping). Afterwards nothing is open, draining,
    registered or mapped, and the daemon serves (under ASan: nothing
    leaked at its exit, which the fixture checks)."""
    import random
    import threading
    errors = []
    handle = shm.handle

    def one(seed):
        rnd = random.Random(seed)
        for _ in range(12):
            a = cf.Raw(daemon)
            try:
                ids = [a.register(handle, 4096 * rnd.randrange(8), 4096, UUID) for _ in range(2)]
                how = rnd.randrange(5)
                if how == 2:  # CHAN_OPEN, then gone before the reply
                    a.s.sendall(du.frame(cf.MSG_CHAN_OPEN, 7, cf.open_payload(UUID, ids)))
                    continue
                if how == 3:  # gone mid-frame
                    f = du.frame(cf.MSG_CHAN_OPEN, 7, cf.open_payload(UUID, ids))
                    a.s.sendall(f[:40])
                    continue
                t, p = a.call(cf.MSG_CHAN_OPEN, cf.open_payload(UUID, ids))
                if t != cf.MSG_CHAN_OPEN | du.REPLY:
                    code, msg = du.parse_error(p)[:2]
                    assert "channel entries are taken" in msg, (code, msg)
                    continue
                r = cf.parse_open_reply(p)
                if how == 0:
                    a.chan_close(r["chan_id"])
                elif how == 4:
                    a.expect_error(du.MSG_UNREGISTER_BUF, struct.pack("<II", ids[0], 0), "busy",
                                   "is named by open channel %d" % r["chan_id"])
                    a.chan_close(r["chan_id"])
                    t, p = a.unregister(ids[0])
                    assert t == du.MSG_UNREGISTER_BUF | du.REPLY, du.parse_error(p)
                a.ping()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
                return
            finally:
                a.close()

    threads = [threading.Thread(target=one, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    let_go_and_serving(daemon, shm)


def test_channels_per_connection_are_capped(tmp_path_factory, shm):
    """server.max_channels_per_client: a connection with that many channels
    open gets MOED_E_BUSY naming the key for one more, while another
    connection still opens one from the same table; once one of the first
    connection's channels is closed it may open again."""
    per = 2
    with start(tmp_path_factory, "chan-per", ENV, server__max_registered_buffers=LIMIT,
               engine__max_channels=per + 2, server__max_channels_per_client=per) as d:
        a, b = cf.Raw(d), cf.Raw(d)
        try:
            ba = a.register(shm.handle, 0, 4096, UUID)
            bb = b.register(shm.handle, 4096, 4096, UUID)
            mine = [a.chan_open(UUID, [ba]) for _ in range(per)]
            a.expect_error(cf.MSG_CHAN_OPEN, cf.open_payload(UUID, [ba]), "busy",
                           "this connection has %d doorbell channels open "
                           "(server.max_channels_per_client %d); close one first" % (per, per))
            other = b.chan_open(UUID, [bb])  # the table has room: another client is served
            assert status(d)[0]["open"] == per + 1
            a.chan_close(mine[0]["chan_id"])
            again = a.chan_open(UUID, [ba])  # a closed (draining) channel no longer counts
            assert again["chan_id"] not in {m["chan_id"] for m in mine}
            for r, cl in ((mine[1], a), (again, a), (other, b)):
                cl.chan_close(r["chan_id"])
        finally:
            a.close()
            b.close()
        assert d.stop() == 0, d.log()[-4000:]
