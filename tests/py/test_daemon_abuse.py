"""Reliability under abuse (issue 10): no client can stall, starve or exhaust
the daemon, and no accepted request is lost. Each test is one drill through
the real socket, with a good client measured alongside where it matters.
"""

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

import daemon_util as du
from daemon_util import E, MSG_FORWARD, MSG_HELLO, MSG_PING, MSG_STATUS, REPLY

# A latency bound in a plain build; scaled like every wait (x1 plain, x10/3
# under sanitizers).
P99_BOUND_S = 0.050 * du.TIME_SCALE / 3


def start(tmp_path_factory, name, **over):
    tmp = tmp_path_factory.mktemp(name)
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), **over)
    return du.Daemon(tmp, cfg)


def http_get(daemon, path, timeout):
    url = "http://127.0.0.1:%d%s" % (daemon.http_port(), path)
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def http_status(daemon):
    return json.loads(http_get(daemon, "/status", du.wait_s(5))[1])


def big_forward(dims, rid, t=None, seed=0):
    t = t or dims["max_tokens"]
    rng = np.random.default_rng(seed)
    x = du.bf16_bits(rng.standard_normal((t, dims["hidden"])).astype(np.float32))
    ids = np.stack([rng.choice(dims["n_experts"], dims["top_k"], replace=False)
                    for _ in range(t)]).astype(np.int32)
    w = rng.random((t, dims["top_k"])).astype(np.float32)
    return du.frame(MSG_FORWARD, rid, du.forward_payload(dims["first_moe_layer"], x.tobytes(),
                                                         ids, w))


def hello_dims(daemon):
    s = daemon.connect()
    d = du.hello(s)
    s.close()
    return d


def vm_kb(daemon, field):
    with open("/proc/%d/status" % daemon.pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def wait_log(daemon, text, timeout):
    deadline = time.monotonic() + du.wait_s(timeout)
    while text not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.02)
    return text in daemon.log()


# ---- item 2: a STATUS flood does not freeze the loop ---------------------------

# The flooder runs in its own process (no GIL shared with the good client):
# one write of N pipelined STATUS frames, its replies read by a thread.
FLOODER = r"""
import socket, struct, sys, threading
path, n = sys.argv[1], int(sys.argv[2])
HDR = struct.Struct("<IHHIIQQ")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
got = [0]
def reader():
    buf = bytearray()
    while got[0] < n:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
        off = 0
        while len(buf) - off >= 32:
            plen = HDR.unpack_from(buf, off)[6]
            if len(buf) - off < 32 + plen:
                break
            off += 32 + plen
            got[0] += 1
        del buf[:off]
th = threading.Thread(target=reader)
th.start()
print("sending", flush=True)
s.sendall(b"".join(HDR.pack(0x44454F4D, 1, 3, 0, 0, i + 1, 0) for i in range(n)))
th.join()
print("replies", got[0], flush=True)
"""

N_FLOOD = 65536  # 2 MiB of STATUS frames in one write
PING_EVERY_S = 0.005


def test_status_flood_good_client_p99(tmp_path_factory):
    """One client writes 65,536 pipelined STATUS frames at once (and reads
    the replies); a good client's PINGs, sent every 5 ms, keep a p99 latency
    (from when each was due: a freeze counts for every PING it held up) under
    50 ms meanwhile, and /healthz keeps answering. (Before the fix the loop
    handled every buffered frame in one read callback, rendering each
    STATUS: 8,192 frames froze every other client for 7 s.)"""
    with start(tmp_path_factory, "flood", status__port=du.free_port(),
               server__max_client_buffer_bytes=256 << 20,
               server__max_pending_per_client=64) as d:
        good = d.connect()
        du.hello(good)
        health, stop = [], threading.Event()

        def probe():
            while not stop.is_set():
                t0 = time.monotonic()
                st, _ = http_get(d, "/healthz", du.wait_s(30))
                health.append((st, time.monotonic() - t0))
                stop.wait(0.1)

        fl = subprocess.Popen([sys.executable, "-c", FLOODER, d.sock_path, str(N_FLOOD)],
                              stdout=subprocess.PIPE, text=True)
        assert fl.stdout.readline().strip() == "sending"
        prober = threading.Thread(target=probe)
        prober.start()
        lat, rid = [], 0
        t_start = time.monotonic()
        deadline = t_start + du.wait_s(60)
        while fl.poll() is None and time.monotonic() < deadline:
            due = t_start + rid * PING_EVERY_S
            rid += 1
            if time.monotonic() < due:
                time.sleep(due - time.monotonic())
            good.sendall(du.frame(MSG_PING, rid, b"x" * 8))
            mtype, r, p = du.read_frame(good)
            lat.append(time.monotonic() - due)
            assert mtype == MSG_PING | REPLY and r == rid
        stop.set()
        prober.join()
        out = fl.communicate(timeout=du.wait_s(60))[0]
        assert fl.returncode == 0
        assert ("replies %d" % N_FLOOD) in out, out
        assert len(lat) >= 20, "the flood was over before the good client measured anything"
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        assert p99 < P99_BOUND_S, "good client's PING p99 %.1f ms (max %.1f ms, %d samples) " \
            "during the STATUS flood" % (p99 * 1e3, lat[-1] * 1e3, len(lat))
        assert health and all(st == 200 for st, _ in health), health
        worst = max(t for _, t in health)
        assert worst < 10 * P99_BOUND_S, "/healthz took %.0f ms during the flood" % (worst * 1e3)
        assert d.stop() == 0, d.log()[-3000:]


# ---- item 3: SIGTERM drains everything that was accepted ----------------------

def test_sigterm_drain_follows_progress(tmp_path_factory):
    """8 clients keep many requests of T=512 in flight at SIGTERM, enough for
    the drain to last about four times its no-progress deadline (batch_deadline_ms
    + drain_stall_ms); every completed batch restarts that deadline, so every
    accepted request is answered and the exit code is 0. (Before the fix the
    deadline counted from the signal: 8 x 64 such requests, 265 lost, exit 4.)
    The number of requests follows this machine's speed (one request timed
    first), so the drill outlasts the deadline anywhere."""
    deadline_ms = int(du.wait_s(1) * 1000)
    with start(tmp_path_factory, "drain", status__port=du.free_port(),
               engine__max_tokens=512, server__max_frame_bytes=1 << 20,
               engine__batch_deadline_ms=deadline_ms, engine__drain_stall_ms=1,
               server__max_pending_per_client=128,
               # a client's replies queue up unread until the signal: 128 of
               # T=512 each on a fast backend
               server__max_client_buffer_bytes=256 << 20,
               server__frame_timeout_ms=int(du.wait_s(5) * 1000)) as d:
        dims = hello_dims(d)
        n_clients = 8
        probe = d.connect(timeout=120)
        rtt = []
        for i in range(3):
            t0 = time.monotonic()
            probe.sendall(big_forward(dims, i + 1, seed=i))
            assert du.read_frame(probe)[0] == MSG_FORWARD | REPLY
            rtt.append(time.monotonic() - t0)
        probe.close()
        # requests enough for about four times the deadline at the probe's
        # pace (the probe may be slowed by load that is gone by the drain, and
        # pipelined requests go faster than one at a time: at twice, a CI run
        # drained in 2.6 s of a 3 s deadline), at most 128 a client
        # (max_pending_per_client): a fast backend (the GPU: ~6 ms a request
        # with its socket transfer) gets more clients instead
        need = 4 * deadline_ms / 1000 / min(rtt)
        n_clients = max(n_clients, int(need / 128) + 1)
        assert n_clients <= 32, "one T=512 request takes only %.2f ms here" % (min(rtt) * 1e3)
        per = int(need / n_clients) + 1
        frames = [big_forward(dims, i + 1, seed=i) for i in range(per)]
        conns = []
        for _ in range(n_clients):
            s = d.connect(timeout=120)
            s.sendall(b"".join(frames))
            conns.append(s)
        # every request taken by the engine before the signal
        t_end = time.monotonic() + du.wait_s(10)
        while time.monotonic() < t_end:
            st = http_status(d)["requests"]
            if st["in_flight"] + st["served"] == n_clients * per + 3:
                break
            time.sleep(0.01)
        assert st["in_flight"] + st["served"] == n_clients * per + 3, st
        t_signal = time.monotonic()
        d.signal()
        results = [None] * n_clients

        def read_all(i):
            got = set()
            try:
                for _ in range(per):
                    mtype, rid, p = du.read_frame(conns[i])
                    if mtype != MSG_FORWARD | REPLY:
                        results[i] = du.parse_error(p)
                        return
                    got.add(rid)
                results[i] = got
            except (OSError, EOFError) as e:
                results[i] = "after %d replies: %r" % (len(got), e)

        readers = [threading.Thread(target=read_all, args=(i,)) for i in range(n_clients)]
        for th in readers:
            th.start()
        for th in readers:
            th.join(du.wait_s(120))
        assert results == [set(range(1, per + 1))] * n_clients, results
        assert d.wait(120) == 0, d.log()[-3000:]
        assert "giving up" not in d.log()
        drain_s = time.monotonic() - t_signal
        # On the CPU backend the drill outlasts the no-progress deadline (the
        # point of it). The GPU drains 512-token requests at ~0.3 ms each
        # when pipelined, so no request count the limits allow lasts seconds
        # there: the test then checks only that every one was answered, exit 0.
        if du.TEST_BACKEND == "cpu":
            assert drain_s > deadline_ms / 1000, \
                "the drain (%.1f s) did not outlast its deadline; the drill proves nothing" % drain_s


# ---- item 4: reply memory is bounded -------------------------------------------

def pipeline_until_stalled(s, frame_bytes, stall_s=0.5, limit_s=20):
    """Send pipelined frames without reading until the daemon stops reading
    (no progress for stall_s); returns the bytes sent."""
    s.setblocking(False)
    sent = 0
    stall_since = None
    deadline = time.monotonic() + du.wait_s(limit_s)
    view = memoryview(frame_bytes)
    off = 0
    while time.monotonic() < deadline:
        try:
            n = s.send(view[off:])
            sent += n
            off = (off + n) % len(frame_bytes)
            stall_since = None
        except BlockingIOError:
            stall_since = stall_since or time.monotonic()
            if time.monotonic() - stall_since > stall_s:
                return sent
            time.sleep(0.005)
    raise AssertionError("the daemon kept reading after %d bytes" % sent)


def test_reply_memory_bounded(tmp_path_factory):
    """Three clients pipeline requests and never read the replies (two PING
    floods, one STATUS flood): the daemon's RSS grows by less than 1.5x the
    sum of their max_client_buffer_bytes, and a good client is served.
    (Before the fix, tiny PING replies cost ~4x the bytes counted: one such
    client grew RSS by 1,017 MB against a 256 MiB limit.)"""
    limit = 16 << 20
    with start(tmp_path_factory, "replymem", server__max_client_buffer_bytes=limit,
               server__max_pending_per_client=4096,
               server__frame_timeout_ms=int(du.wait_s(20) * 1000)) as d:
        good = d.connect()
        du.hello(good)
        base = d.rss_kb()
        pings = b"".join(du.frame(MSG_PING, i + 1) for i in range(4096))
        statuses = b"".join(du.frame(MSG_STATUS, i + 1) for i in range(4096))
        floods = []
        for burst in (pings, pings, statuses):
            s = d.connect()
            pipeline_until_stalled(s, burst)
            floods.append(s)
        grown_mb = (d.rss_kb() - base) / 1024
        good.sendall(du.frame(MSG_PING, 7, b"ok"))
        assert du.read_frame(good)[:2] == (MSG_PING | REPLY, 7)
        if not d.sanitized():
            assert grown_mb < 1.5 * 3 * limit / 2**20, \
                "RSS grew by %.0f MB for 3 clients of a %d MiB limit" % (grown_mb, limit >> 20)
        for s in floods:
            s.close()
        assert d.stop() == 0, d.log()[-3000:]


def test_global_reply_cap_drops_the_biggest(tmp_path_factory):
    """server.max_reply_bytes caps what all clients' unread replies hold
    together: past it the client holding the most is dropped, and the others
    (a good client among them) keep working."""
    with start(tmp_path_factory, "replycap", server__max_client_buffer_bytes=8 << 20,
               server__max_reply_bytes=12 << 20, server__max_pending_per_client=4096,
               server__frame_timeout_ms=int(du.wait_s(20) * 1000)) as d:
        good = d.connect()
        du.hello(good)
        statuses = b"".join(du.frame(MSG_STATUS, i + 1) for i in range(4096))
        floods = []
        for _ in range(2):
            s = d.connect()
            try:
                pipeline_until_stalled(s, statuses)
            except OSError:
                pass  # dropped while sending
            floods.append(s)
        assert wait_log(d, "server.max_reply_bytes", 10), d.log()[-3000:]
        good.sendall(du.frame(MSG_PING, 9))
        assert du.read_frame(good)[:2] == (MSG_PING | REPLY, 9)
        for s in floods:
            s.close()
        assert d.stop() == 0, d.log()[-3000:]


# ---- item 5: a client that closed frees its slot ---------------------------------

def test_closed_clients_free_their_slots(tmp_path_factory):
    """12 clients in turn (max_clients 4) each send 16 T=512 FORWARDs and
    close their socket at once: each slot is freed at EOF (the close is told
    from a half-close), so a new client's PING is answered at once, and the
    engine skips requests of gone clients it has not started. (Before the
    fix, the slots stayed taken until every reply was computed: the 5th client
    on was refused busy.)"""
    # The probe sends all 16 before it reads a reply: their 16 x 256 KB of
    # replies (T = 512 x hidden 256 x bf16) must fit the client's reply
    # buffer, else a backend that answers while the probe still sends (the
    # GPU) pauses it at the base config's 4 MiB and drops it once no reply
    # leaves for frame_timeout_ms: a BrokenPipeError in the probe's sendall
    # (H200 2026-12-04, once in a few runs)
    with start(tmp_path_factory, "gone", status__port=du.free_port(), server__max_clients=4,
               engine__max_tokens=512, server__max_frame_bytes=1 << 20,
               server__max_client_buffer_bytes=16 << 20) as d:
        dims = hello_dims(d)
        per = 16
        frames = b"".join(big_forward(dims, i + 1, seed=i) for i in range(per))
        # how long one client's requests take to compute: on a fast backend
        # (the GPU) they are all done before the close is seen, and there is
        # nothing left to skip
        probe = d.connect()
        t0 = time.monotonic()
        try:
            probe.sendall(frames)
        except OSError as e:
            pytest.fail("the probe client was dropped while sending (%s); daemon log:\n%s"
                        % (e, d.log()[-3000:]))
        for _ in range(per):
            assert du.read_frame(probe)[0] == MSG_FORWARD | REPLY
        work_s = time.monotonic() - t0
        probe.close()
        before = http_status(d)["batches"]["count"]
        for _ in range(12):
            s = d.connect()
            try:
                s.sendall(frames)
            except OSError:
                pass  # refused busy while sending: the old behaviour
            s.close()
            time.sleep(0.01)
        # a new client: answered, not busy (a short wait for the last EOFs)
        deadline = time.monotonic() + du.wait_s(0.3)
        while True:
            s = d.connect()
            s.sendall(du.frame(MSG_PING, 1))
            mtype, rid, p = du.read_frame(s)
            s.close()
            if mtype == MSG_PING | REPLY or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert mtype == MSG_PING | REPLY, du.parse_error(p)
        t_end = time.monotonic() + du.wait_s(30)
        while time.monotonic() < t_end:
            st = http_status(d)
            if st["requests"]["in_flight"] == 0:
                break
            time.sleep(0.05)
        assert st["requests"]["in_flight"] == 0
        assert st["clients"]["refused"] == 0, st["clients"]
        # most of the 192 requests were never computed (before: 80 batches,
        # every request of the 5 clients that got a slot), where computing
        # them takes long enough to see the close first (the CPU backend:
        # about 1 s for one client's 16)
        if work_s > 0.2:
            assert st["batches"]["count"] - before < 12 * per // 4, st["batches"]
        assert d.stop() == 0, d.log()[-3000:]


def test_half_closed_client_still_answered(tmp_path_factory):
    """The counterpart: a client that only shuts down its write side after its
    requests still gets every reply."""
    with start(tmp_path_factory, "halfclose") as d:
        dims = hello_dims(d)
        s = d.connect()
        s.sendall(b"".join(big_forward(dims, i + 1, t=4, seed=i) for i in range(6)))
        s.shutdown(socket.SHUT_WR)
        got = [du.read_frame(s)[:2] for _ in range(6)]
        assert sorted(got) == [(MSG_FORWARD | REPLY, i + 1) for i in range(6)]
        du.expect_closed(s)
        assert d.stop() == 0


# ---- item 6: a FORWARD before a framing error is answered -------------------------

def test_forward_before_framing_error_answered(tmp_path_factory):
    """FORWARD, PING, FORWARD, then a frame with a bad magic, in one write:
    both FORWARDs and the PING are answered first, then the proto error, then
    the connection closes. (Before the fix the FORWARDs were dropped
    silently: only the error came back.)"""
    with start(tmp_path_factory, "framing") as d:
        dims = hello_dims(d)
        cases = du.reference_cases(d, dims, n=2, max_t=8, seed=3)
        s = d.connect()
        want = {}
        data = b""
        for i, (layer, x, ids, w, ref) in enumerate(cases):
            rid = 10 + 2 * i
            want[rid] = ref
            data += du.frame(MSG_FORWARD, rid, du.forward_payload(layer, x.tobytes(), ids, w))
            data += du.frame(MSG_PING, rid + 1)
        data += du.header(MSG_PING, 99, magic=0x12345678)
        s.sendall(data)
        pings = 0
        while want or pings < 2:
            mtype, rid, p = du.read_frame(s)
            if mtype == MSG_PING | REPLY:
                pings += 1
                continue
            assert mtype == MSG_FORWARD | REPLY, du.parse_error(p)
            y = np.frombuffer(du.forward_reply(p)[2], np.uint16).reshape(want[rid].shape)
            assert du.rel_l2(y, want.pop(rid)) < 1e-2
        du.expect_error(s, E["proto"], "bad magic")
        du.expect_closed(s)
        assert d.stop() == 0


# ---- item 7: refused clients read the daemon's error -----------------------------

def test_refused_clients_see_busy(tmp_path_factory):
    """With max_clients 1 taken, the Python client and the C client
    (moectl ping) both report the daemon's busy error, never a bare broken
    pipe, on every one of 20 tries."""
    import moed_client
    with start(tmp_path_factory, "busy", server__max_clients=1) as d:
        holder = d.connect()
        du.hello(holder)
        for i in range(20):
            c = moed_client.Client(d.sock_path, timeout=du.wait_s(5))
            with pytest.raises(moed_client.MoedError) as ei:
                c.hello()
            assert ei.value.name == "busy", str(ei.value)
            assert "too many clients (limit 1)" in ei.value.message
            c.close()
        for i in range(10):
            r = subprocess.run([du.MOECTL, "ping", "--socket", d.sock_path, "--count", "1"],
                               capture_output=True, text=True, timeout=du.wait_s(10))
            assert r.returncode != 0
            assert "too many clients (limit 1)" in r.stderr, r.stderr
        holder.close()
        assert d.stop() == 0


def test_python_client_reads_error_after_epipe():
    """The Python client's write fails with EPIPE (the peer wrote an ERROR and
    closed without reading): it raises the pending ERROR, not the EPIPE."""
    import moed_client
    a, b = socket.socketpair()
    code, msg = E["busy"], b"too many clients (limit 1)"
    b.sendall(du.frame(du.MSG_ERROR | REPLY, 0, struct.pack("<iI", code, len(msg)) + msg))
    b.close()
    c = moed_client.Client(sock=a, timeout=5)
    with pytest.raises(moed_client.MoedError) as ei:
        c._send(MSG_PING, 1, b"x" * 60)
        c._send(MSG_PING, 2, b"x" * 60)
    assert ei.value.name == "busy" and ei.value.message == msg.decode(), str(ei.value)


# ---- item 9: idle connections and header-only clients ------------------------------

def test_idle_client_closed(tmp_path_factory):
    """server.idle_timeout_ms: a client with nothing in progress for that long
    gets a timeout error and is closed; one that keeps pinging stays."""
    idle_ms = int(du.wait_s(0.3) * 1000)
    with start(tmp_path_factory, "idle", server__idle_timeout_ms=idle_ms) as d:
        busy = d.connect()
        idle = d.connect()
        du.hello(idle)
        t0 = time.monotonic()
        rid = 0
        while time.monotonic() - t0 < 2.5 * idle_ms / 1000:
            rid += 1
            busy.sendall(du.frame(MSG_PING, rid))
            assert du.read_frame(busy)[:2] == (MSG_PING | REPLY, rid)
            time.sleep(idle_ms / 1000 / 4)
        idle.settimeout(du.wait_s(5))
        du.expect_error(idle, E["timeout"], "idle for %d ms (server.idle_timeout_ms)" % idle_ms)
        du.expect_closed(idle)
        busy.sendall(du.frame(MSG_PING, 1000))
        assert du.read_frame(busy)[:2] == (MSG_PING | REPLY, 1000)
        assert d.stop() == 0


def test_idle_timeout_off_by_default(tmp_path_factory):
    """Without the key, an idle connection stays open (documented default)."""
    with start(tmp_path_factory, "noidle", server__frame_timeout_ms=100) as d:
        s = d.connect()
        du.hello(s)
        time.sleep(0.5)
        s.sendall(du.frame(MSG_PING, 2))
        assert du.read_frame(s)[:2] == (MSG_PING | REPLY, 2)
        assert d.stop() == 0


def test_header_only_clients_reserve_nothing(tmp_path_factory):
    """40 clients each send only a header announcing a max_frame_bytes
    payload: the daemon's virtual size and RSS do not grow by
    max_frame_bytes per client (the read buffer grows as bytes arrive).
    (Before the fix 60 such headers reserved 3.8 GiB of virtual memory.)"""
    max_frame = 64 << 20
    n = 40
    with start(tmp_path_factory, "hdronly", server__max_frame_bytes=max_frame, server__max_clients=64,
               server__max_client_buffer_bytes=max_frame,
               server__frame_timeout_ms=int(du.wait_s(20) * 1000)) as d:
        base_vm, base_rss = vm_kb(d, "VmSize"), vm_kb(d, "VmRSS")
        conns = []
        for i in range(n):
            s = d.connect()
            s.sendall(du.header(MSG_FORWARD, i + 1, plen=max_frame))
            conns.append(s)
        # the daemon has read every header once a later client is answered
        probe = d.connect()
        du.hello(probe)
        time.sleep(0.2)
        grown_vm = (vm_kb(d, "VmSize") - base_vm) * 1024
        grown_rss = (vm_kb(d, "VmRSS") - base_rss) * 1024
        assert grown_vm < 2 * max_frame, "VmSize grew by %d MiB for %d headers" % (
            grown_vm >> 20, n)
        if not d.sanitized():
            assert grown_rss < 2 * max_frame, grown_rss
        for s in conns:
            s.close()
        assert d.stop() == 0
