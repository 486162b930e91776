"""GPU: the doorbell channel (protocol version 2, CHAN_OPEN) driven by torch
clients on the daemon's GPU, inside CUDA graphs. DoorbellSession runs on the
channel's arena (moed's memory, CHAN_OPEN arena_bytes); one test drives a
channel over the client's own registered tensors, alone and with an arena.

Run by scripts/run-gpu-tests.sh under MPS (it starts and stops the MPS
control daemon); skips cleanly without torch, a GPU or MPS. The daemon
leaves SMs free (engine.sms_free) so that the clients' kernels (the copies
into the arena, the one-thread doorbell kernel spinning for its answer)
always find room next to moed's resident kernel.

  MOED_TEST_KILLS (100), MOED_TEST_KILL_PAR (10): clients killed, and how
  many at a time, in test_killed_clients_with_open_channels_leave_nothing
  MOED_TEST_REPLAYS (10000): calls of test_replays_each_answered_once
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_util import du, torch, np, batch, status  # noqa: E402

import moed_client as mc  # noqa: E402
import moed_client.cuda as mcc  # noqa: E402
from moed_client import _chan  # noqa: E402

SMS_FREE = int(os.environ.get("MOED_TEST_SMS_FREE", "64"))


def doorbell_config(tmp, models, **over):
    """base_config for the doorbell: backend cuda, SMs left free, 16 channels
    (each a keyword the caller may override)."""
    kw = dict(status__port=du.free_port(), engine__backend="cuda", engine__sms_free=SMS_FREE,
              engine__max_channels=16, server__max_clients=200)
    kw.update(over)
    return du.base_config(str(tmp), models, **kw)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("db")
    with du.Daemon(tmp, doorbell_config(tmp, du.models_dir(tmp_path_factory))) as d:
        yield d
        assert d.alive(), d.log()[-4000:]
        assert d.stop() == 0, d.log()[-4000:]


# The test with a daemon of its own comes first, before the module's daemon
# is made (at the first test that asks for it): under MPS one moed serves a
# GPU, and a second is refused at start (the GPU's lock file).
# test_doorbell_memcheck.py runs the bad descriptors under memcheck.


def test_arena_outgrows_its_allocation(tmp_path_factory):
    """engine.max_tokens 4096: a first channel with a small arena gets the
    entry a 2 MiB allocation; once it is closed, a channel with the largest
    arena (about 4.3 MB on the tiny model) needs more, so the entry gets a
    new allocation and the old one is freed later with no kernel resident
    (the debug log says so). A call whose y lies past 2 MiB into the arena
    is answered bit for bit like the inline path."""
    tmp = tmp_path_factory.mktemp("db-grow")
    cfg = doorbell_config(tmp, du.models_dir(tmp_path_factory), engine__max_tokens=4096,
                          engine__max_channels=1, server__max_frame_bytes=4 << 20,
                          server__max_client_buffer_bytes=16 << 20)
    cfg["log"]["level"] = "debug"
    with du.Daemon(tmp, cfg) as d, mc.Client(d.sock_path, timeout=du.wait_s(60)) as c:
        info = c.hello()
        with mcc.DoorbellSession(mc.Client(d.sock_path, timeout=du.wait_s(60)),
                                 max_tokens=4) as s:
            x, ids, w = batch(info, 4, 31, "cuda")
            s.fused_experts(x, w, ids, info.moe_layers[0])
            torch.cuda.synchronize()
            s.check()
        wait_idle(d)
        with mcc.DoorbellSession(mc.Client(d.sock_path, timeout=du.wait_s(60)),
                                 max_tokens=4096) as s:
            assert s.arena.off_y > 2 << 20 and s.channel.arena.numel() > 4 << 20
            x, ids, w = batch(info, 8, 37, "cuda")
            y = s.fused_experts(x, w, ids, info.moe_layers[0])
            torch.cuda.synchronize()
            s.check()
            assert np.array_equal(bits(y), inline(c, info.moe_layers[0], x, ids, w))
            deadline = time.monotonic() + du.wait_s(20)
            while "1 channel allocations freed" not in d.log():
                assert time.monotonic() < deadline, d.log()[-4000:]
                time.sleep(0.02)
        wait_idle(d)
        assert d.alive()
        assert d.stop() == 0, d.log()[-4000:]


def chan_status(daemon):
    """/status channels: open, draining, doorbell_requests, doorbell_refused
    (since start, all channels), list (per channel)."""
    return status(daemon)["channels"]


def wait_counts(daemon, chan_id, **want):
    """/status channels once the kernel's counters say `want` (the totals,
    and the keys of `list` for channel chan_id as list_<key>): the counters
    live in mapped host memory that the kernel writes as it answers."""
    deadline = time.monotonic() + du.wait_s(10)
    while True:
        db = chan_status(daemon)
        mine = [e for e in db["list"] if e["id"] == chan_id]
        got = {k: (mine[0][k[5:]] if mine else None) if k.startswith("list_") else db[k]
               for k in want}
        if got == want:
            return db
        assert time.monotonic() < deadline, (got, want, db)
        time.sleep(0.01)


def wait_idle(daemon):
    """No registration, mapping, channel or arena left (a closed or killed
    client)."""
    deadline = time.monotonic() + du.wait_s(30)
    while True:
        st = status(daemon)
        rb, db = st["registered_buffers"], st["channels"]
        if rb["registered"] == 0 and rb["mappings"] == 0 and db["open"] == 0 and \
                db["draining"] == 0 and db["arena_bytes"] == 0:
            return st
        assert time.monotonic() < deadline, (rb, db)
        time.sleep(0.02)


def bits(t):
    """A bf16 tensor's bit patterns as a numpy uint16 array (host)."""
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def inline(c, layer, x, ids, w):
    """The inline socket path's y bits for the same batch (x: a bf16 tensor
    or its bits)."""
    xb = x if isinstance(x, np.ndarray) else bits(x)
    return np.asarray(c.forward(layer, xb, ids.cpu().numpy(), w.cpu().numpy()))


def test_graph_of_layers_equals_inline_and_reference(daemon):
    """A captured graph of L doorbell calls, each layer's input the previous
    layer's output (x_{i+1} = y_i): every output equals the inline path's bit
    for bit and the float64 reference within the suite's tolerance."""
    ref = du.F64Reference(du.synth_dir(daemon.cfg["model"]["synthetic_dir"]))
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c, \
            mcc.DoorbellSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60)),
                                max_tokens=16) as s:
        info = c.hello()
        layers = [info.moe_layers[i % len(info.moe_layers)] for i in range(6)]
        for t in (1, 5, 16):
            x0, ids, w = batch(info, t, t, "cuda")
            ids_l = [ids.roll(i, 1) for i in range(len(layers))]  # other id / weight pairs
            s.fused_experts(x0, w, ids_l[0], layers[0])  # eager warm-up (and module load)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ys, x = [], x0
                for layer, idl in zip(layers, ids_l):
                    x = s.fused_experts(x, w, idl, layer)
                    ys.append(x)
            g.replay()
            torch.cuda.synchronize()
            s.check()
            x_in = bits(x0)
            for i, (layer, y) in enumerate(zip(layers, ys)):
                assert y.is_cuda and y.dtype == torch.bfloat16 and tuple(y.shape) == (t, info.hidden)
                want = inline(c, layer, x_in, ids_l[i], w)
                got = bits(y)
                assert np.array_equal(got, want), (t, i, int((got != want).sum()))
                assert du.rel_l2(got, ref.forward(layer, x_in, ids_l[i].cpu().numpy(),
                                                  w.cpu().numpy())) < 1e-2, (t, i)
                x_in = got
            g.replay()  # a replay answers the same again
            torch.cuda.synchronize()
            assert np.array_equal(bits(ys[-1]), x_in)
            s.check()
            del g


def test_channel_over_registered_tensors(daemon):
    """A Channel over the client's own registered tensor (no arena: buffer 0
    is the tensor), eager and replayed in a graph, and one with an arena and
    the tensor (buffer 0 the arena, 1 the tensor: x, ids, w read from the
    tensor, y written into the arena): each call equals the inline path bit
    for bit."""
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c, \
            mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as cc:
        info = c.hello()
        T = 6
        layer = info.moe_layers[-1]
        x, ids, w = batch(info, T, 17, "cuda")
        want = inline(c, layer, x, ids, w)
        own = mcc._Arena.alloc(info, 8, "cuda")
        ch = mcc.Channel(cc, [own.mem])
        try:
            assert ch.arena is None and ch.ref(own.y[:T]) == (0, own.off_y)
            xr, idr, wr, yr = own.fill(x, w, ids, info, 8)
            ch.call(xr, idr, wr, yr, layer)
            torch.cuda.synchronize()
            ch.check()
            assert np.array_equal(bits(yr), want)
            yr.zero_()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ch.call(xr, idr, wr, yr, layer)
            g.replay()
            torch.cuda.synchronize()
            ch.check()
            assert np.array_equal(bits(yr), want)
            del g
        finally:
            ch.close()
        mixed = mcc.Channel(cc, [own.mem], arena_bytes=2 * T * info.hidden)
        try:
            y = mixed.arena.view(torch.bfloat16).view(T, info.hidden)
            assert mixed.ref(y) == (0, 0) and mixed.ref(own.x[:T]) == (1, 0)
            assert mixed.ref(own.ids[:T]) == (1, own.off_ids)
            assert int(torch.count_nonzero(mixed.arena)) == 0  # zeroed at open
            mixed.call(own.x[:T], own.ids[:T], own.w[:T], y, layer)
            torch.cuda.synchronize()
            mixed.check()
            assert np.array_equal(bits(y), want)
        finally:
            mixed.close()
    wait_idle(daemon)


def test_arena_zeroed_for_a_new_owner(daemon):
    """A channel's allocation (ring and arena) is zeroed at every open: after
    one session filled its arena and closed, the next session's whole
    mapping reads 0 before its first call (the table entry and its
    allocation are reused)."""
    with mcc.DoorbellSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60)),
                             max_tokens=8) as s:
        x, ids, w = batch(s.info, 8, 23, "cuda")
        s.fused_experts(x, w, ids, s.info.moe_layers[0])
        torch.cuda.synchronize()
        s.check()
        assert int(torch.count_nonzero(s.channel.arena)) > 0
    wait_idle(daemon)
    with mcc.DoorbellSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60)),
                             max_tokens=8) as s:
        raw = mcc._cudrv.read_device(s.channel._chan, 2 << 20)  # MOE_GPU_CHAN_ALLOC
        assert raw.count(0) == len(raw), len(raw) - raw.count(0)
    wait_idle(daemon)


def test_replays_each_answered_once(daemon):
    """N calls by graph replay (a graph of 10 calls): the channel's done
    advances by exactly N, the err word stays 0, /status counts them."""
    n = int(os.environ.get("MOED_TEST_REPLAYS", "10000"))
    per = 10
    with mcc.DoorbellSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60)),
                             max_tokens=8) as s:
        info, ch = s.info, s.channel
        x, ids, w = batch(info, 4, 3, "cuda")
        layer = info.moe_layers[0]
        y0 = s.fused_experts(x, w, ids, layer)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ys = [s.fused_experts(x, w, ids, layer) for _ in range(per)]
        torch.cuda.synchronize()
        bell0, done0, _ = ch.ring()
        db0 = chan_status(daemon)
        served0, refused0 = db0["doorbell_requests"], db0["doorbell_refused"]
        assert bell0 == done0 and bell0 >= 1
        t0 = time.perf_counter()
        for _ in range(n // per):
            g.replay()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        bell, done, words = ch.ring()
        assert bell == done == done0 + n // per * per, (bell0, done0, bell, done)
        assert ch.error_word() == 0
        for i, wd in enumerate(words):  # every slot's last answer: OK, for a seq of its slot
            assert wd & 0xFF == 0 and (wd >> 8) % len(words) == i, (i, hex(wd))
        assert all(torch.equal(y, y0) for y in ys)
        wait_counts(daemon, ch.chan_id, doorbell_requests=served0 + n // per * per,
                    doorbell_refused=refused0, list_requests=1 + n // per * per,
                    list_refused=0)
        print("doorbell replays: %d calls in %.3f s (%.2f us per call, tiny model, T=4)"
              % (n, dt, dt / n * 1e6))
        # where the last calls' time went (the channel's %globaltimer stamps)
        st = ch.stamps(done)
        assert all(0 < a[0] <= a[1] <= a[2] <= a[3] for a in st), st
        assert all(p[3] <= a[0] for p, a in zip(st, st[1:])), st
        med = lambda v: sorted(v)[len(v) // 2] / 1e3  # noqa: E731
        print("doorbell stamps, medians of %d calls: rang->taken %.2f us, kernel %.2f us, "
              "answered->seen %.2f us, seen->next ring %.2f us (the copies in and out)"
              % (len(st), med([a[1] - a[0] for a in st]), med([a[2] - a[1] for a in st]),
                 med([a[3] - a[2] for a in st]), med([b[0] - a[3] for a, b in zip(st, st[1:])])))


CHILD = r"""
import sys, time
sys.path[:0] = sys.argv[2].split(":")
import torch, moed_client as mc, moed_client.cuda as mcc
s = mcc.DoorbellSession(mc.Client(sys.argv[1], timeout=60), max_tokens=4)
x = torch.randn(2, s.info.hidden, device="cuda").to(torch.bfloat16)
ids = torch.zeros(2, s.info.top_k, dtype=torch.int32, device="cuda")
w = torch.ones(2, s.info.top_k, device="cuda")
s.fused_experts(x, w, ids, s.info.moe_layers[0])
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(50):
        s.fused_experts(x, w, ids, s.info.moe_layers[0])
for _ in range(20):
    g.replay()
torch.cuda.synchronize()  # idle when killed: see the test's docstring
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_killed_clients_with_open_channels_leave_nothing(daemon):
    """Clients (DoorbellSession: the channel's arena, nothing registered)
    killed with SIGKILL after their graph of doorbell calls, channel open:
    each time the daemon closes their channels (/status back to 0, arenas
    included), device memory does not grow, and the daemon keeps serving.

    Not mid-graph: under MPS, a client process killed while a kernel of its
    own runs gives every other client on the GPU a fatal error, moed
    included, whatever that kernel is (on the H200, clients replaying a
    graph of plain torch matmuls, never connected to moed, killed this way
    took moed down with "an illegal memory access": scripts/probe_mps_kill.py,
    bench/NOTES.md 2026-12-01 late). The MPS server tears down such a
    client's work itself; moed cannot contain it. A client on another GPU
    (peer access, no MPS) can be killed mid-graph."""
    n = int(os.environ.get("MOED_TEST_KILLS", "100"))
    par = max(1, int(os.environ.get("MOED_TEST_KILL_PAR", "10")))
    path = os.pathsep.join(p for p in sys.path if p)
    free0 = None
    done = 0
    while done < n:
        k = min(par, n - done)
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, daemon.sock_path, path],
                                  stdout=subprocess.PIPE, text=True) for _ in range(k)]
        for i, p in enumerate(procs):
            line = p.stdout.readline().strip()
            assert line == "ready", (done + i, line)
        assert chan_status(daemon)["open"] == k
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
            p.stdout.close()
        done += k
        wait_idle(daemon)
        print("killed %d of %d clients after their graphs; device free %d MiB"
              % (done, n, torch.cuda.mem_get_info()[0] >> 20), flush=True)
        if free0 is None and done >= 2 * par:  # after the allocators' warm-up
            free0 = torch.cuda.mem_get_info()[0]
    assert daemon.alive()
    free = torch.cuda.mem_get_info()[0]
    print("device free after %d kills: %d MiB (after %d: %s MiB)"
          % (n, free >> 20, 2 * par, None if free0 is None else free0 >> 20))
    if free0 is not None:
        assert free >= free0 - (64 << 20), (free0 >> 20, free >> 20)
    with mcc.DoorbellSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60)),
                             max_tokens=4) as s:  # still serving
        x, ids, w = batch(s.info, 2, 5, "cuda")
        y = s.fused_experts(x, w, ids, s.info.moe_layers[0])
        torch.cuda.synchronize()
        s.check()
        with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c:
            assert np.array_equal(bits(y), inline(c, s.info.moe_layers[0], x, ids, w))


def bad_descriptors(s):
    """(name, expected status, a function that rings it) on session s's
    channel: descriptors no host check has seen, passed by value to the
    client kernel, so moed's kernel must refuse them itself."""
    info, ch, a = s.info, s.channel, s.arena
    size = a.mem.numel()
    good = ((0, a.off_x), (0, a.off_ids), (0, a.off_w), (0, a.off_y))
    layer, T = info.moe_layers[0], 2
    bad_ids = torch.full((T, info.top_k), info.n_experts, dtype=torch.int32, device=s.device)

    def expert():
        a.ids[:T].copy_(bad_ids)
        ch.call_desc(layer, T, good)
    return [
        ("T too large", 1, lambda: ch.call_desc(layer, s.info.max_tokens + 1, good)),
        ("T = 0", 1, lambda: ch.call_desc(layer, 0, good)),
        ("not an MoE layer", 2, lambda: ch.call_desc(info.n_layers + 3, T, good)),
        ("unregistered buffer index", 3,
         lambda: ch.call_desc(layer, T, ((5, 0),) + good[1:])),
        ("offset past the registration", 4,
         lambda: ch.call_desc(layer, T, ((0, size),) + good[1:])),
        ("offset overflow", 4,
         lambda: ch.call_desc(layer, T, ((0, (1 << 64) - 16),) + good[1:])),
        ("misaligned x", 5, lambda: ch.call_desc(layer, T, ((0, 2),) + good[1:])),
        ("y over x", 6, lambda: ch.call_desc(layer, T, good[:3] + ((0, a.off_x),))),
        ("expert id out of range", 7, expert),
        ("wrong key", 9, lambda: ch.call_desc(layer, T, good, key=ch.key ^ 1)),
        ("unknown flags", 10, lambda: ch.call_desc(layer, T, good, flags=0x80)),
    ]


def run_bad_descriptors(daemon, c, timeout_s=mcc.DEFAULT_CALL_TIMEOUT_S, two=True):
    """Every bad descriptor on one channel, each followed by a good call on a
    second channel (another client; two=False: the same channel): the bad one
    gets its status in err (and y stays untouched), the other channel keeps
    answering correctly."""
    with contextlib.ExitStack() as stack:
        def session():
            return stack.enter_context(mcc.DoorbellSession(
                mc.Client(daemon.sock_path, timeout=du.wait_s(120)), max_tokens=8,
                timeout_s=timeout_s))
        s = session()
        other = session() if two else s
        info = s.info
        x, ids, w = batch(info, 2, 11, "cuda")
        layer = info.moe_layers[0]
        want = inline(c, layer, x, ids, w)
        refused0 = chan_status(daemon)["doorbell_refused"]
        cases = bad_descriptors(s)
        for name, code, ring in cases:
            s.arena.fill(x, w, ids, info, s.max_tokens)
            s.arena.y.fill_(7)
            ring()
            with pytest.raises(mc.MoedError) as e:
                s.check()
            assert isinstance(e.value, mcc.ChannelError)
            assert e.value.status == code, (name, e.value)
            assert e.value.status_name == _chan.status_name(code)
            assert e.value.seq == s.channel.ring()[1], (name, e.value.seq)
            assert torch.all(s.arena.y == 7), name
            y = other.fused_experts(x, w, ids, layer)
            torch.cuda.synchronize()
            other.check()
            assert np.array_equal(bits(y), want), name
        y = s.fused_experts(x, w, ids, layer)  # the refusing channel itself still serves
        torch.cuda.synchronize()
        s.check()
        assert np.array_equal(bits(y), want)
        wait_counts(daemon, s.channel.chan_id, doorbell_refused=refused0 + len(cases),
                    list_refused=len(cases))
        return len(cases)


def test_malformed_descriptors_from_the_gpu(daemon):
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c:
        run_bad_descriptors(daemon, c)
    assert daemon.alive()
    wait_idle(daemon)
