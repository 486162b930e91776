"""Buffers the backend uses in place, through the real socket.

With a backend host allocator (the CPU backend's test switch
MOED_TEST_CPU_HOST_ALLOC=1 here; CUDA's pinned memory when MOED_TEST_BACKEND=cuda)
read buffers, reply frames and batch memory come from it, and batches mark
them MOED_BUF_PINNED. Replies must still be the reference's, also when the
cap (server.pinned_pool_bytes) is small enough that pinned and ordinary
buffers mix; the pinned bytes held (/status "buffers") must stay under the cap
however many frames come; once warm, a steady client makes the daemon
allocate nothing more; bad input is answered as without them. Without an
allocator, or with a cap of 0, nothing is pinned.
"""

import json
import urllib.request

import numpy as np
import pytest

import daemon_util as du
from daemon_util import E, MSG_FORWARD, MSG_PING, REPLY

SMALL_CAP = 512 << 10   # 8 buffers of 64 KiB: several connections outgrow it
KEEP = 256 << 10        # server.read_buffer_keep_bytes
SPARES = 16             # MOED_BUFPOOL_SPARES


HOST_ALLOC = {"MOED_TEST_CPU_HOST_ALLOC": "1"}  # the CPU backend's test switch


def start(tmp_path_factory, name, env=None, **over):
    tmp = tmp_path_factory.mktemp(name)
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory),
                         status__port=du.free_port(), **over)
    return du.Daemon(tmp, cfg, env=env)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with start(tmp_path_factory, "buffers", server__pinned_pool_bytes=SMALL_CAP,
               server__read_buffer_keep_bytes=KEEP, env=HOST_ALLOC) as d:
        yield d
        assert d.alive(), d.log()
        assert d.stop() == 0, d.log()[-4000:]  # clean exit (and no leak under ASan)


@pytest.fixture(scope="module")
def cases(daemon, dims):
    return du.reference_cases(daemon, dims, n=6, max_t=dims["max_tokens"], seed=17)


def buffers(daemon):
    url = "http://127.0.0.1:%d/status" % daemon.http_port()
    with urllib.request.urlopen(url, timeout=du.wait_s(5)) as r:
        return json.loads(r.read().decode())["buffers"]


def test_stream_matches_reference_under_the_cap(daemon, dims, cases):
    """Four connections, lone requests and bursts, many rounds: every reply is
    the reference's, pinned and ordinary buffers mix (the cap is small), and
    neither the pinned bytes nor the kept spares ever pass their bounds."""
    conns = [daemon.connect() for _ in range(4)]
    rid = 0
    for rnd in range(6):
        rid = du.forward_lone_and_burst(conns, cases, rid)
        b = buffers(daemon)
        assert 0 < b["pinned_bytes"] <= SMALL_CAP, b
        assert b["pinned_limit_bytes"] == SMALL_CAP, b
        assert b["pinned_free_bytes"] <= b["pinned_bytes"], b
        assert b["spare_bytes"] <= SPARES * KEEP, b
    # the cap was what bounded it: the working set of four connections is larger
    assert b["pinned_bytes"] > SMALL_CAP // 2, b
    for conn in conns:
        conn.close()
    assert daemon.alive()


def test_bad_input_answered_as_without(daemon, dims, cases):
    """Request-level errors keep the connection (and its pinned read buffer);
    a frame cut off by the end of the stream is a framing error; the good
    request after them is still right."""
    layer, x, ids, w, ref = cases[0]
    s = daemon.connect()
    bad_ids = np.full_like(ids, dims["n_experts"])
    s.sendall(du.frame(MSG_FORWARD, 5, du.forward_payload(layer, x.tobytes(), bad_ids, w)))
    du.expect_error(s, E["inval"], "is out of range", rid=5)
    short = du.forward_payload(layer, x.tobytes(), ids, w)[:-4]
    s.sendall(du.frame(MSG_FORWARD, 6, short))
    du.expect_error(s, E["inval"], "need", rid=6)
    s.sendall(du.frame(99, 7, b"\0" * 70000))  # unknown type: skipped, connection kept
    du.expect_error(s, E["type"], "unknown message type 99", rid=7)
    s.sendall(du.frame(MSG_FORWARD, 8, du.forward_payload(layer, x.tobytes(), ids, w)))
    du.check_forward_reply(s, {8: ref})
    s.sendall(du.frame(MSG_PING, 9, b"ok"))
    assert du.read_frame(s)[:2] == (MSG_PING | REPLY, 9)
    # half a FORWARD, then the end of the stream
    full = du.frame(MSG_FORWARD, 10, du.forward_payload(layer, x.tobytes(), ids, w))
    s.sendall(full[:len(full) // 2])
    s.shutdown(1)
    du.expect_error(s, E["proto"], "connection closed mid-frame", rid=0)
    du.expect_closed(s)
    s.close()
    b = buffers(daemon)
    assert b["pinned_bytes"] <= SMALL_CAP, b


def test_steady_client_allocates_nothing(tmp_path_factory):
    """One client, one request at a time (the SGLang pattern): the daemon holds
    a small fixed set of pinned buffers (a read buffer, the one the next
    frame is read into, a reply frame, at most one more) and takes no more
    from the backend, however long the stream. Which of the set a run needs
    depends on timing: with the loop spinning (engine.loop_spin_us on the
    CUDA backend) the next request can be read before the last reply's write
    has completed, so the bound is checked, not the count after warm-up."""
    with start(tmp_path_factory, "buffers-steady", server__pinned_pool_bytes=16 << 20,
               env=HOST_ALLOC) as d:
        s = d.connect()
        info = du.hello(s)
        (layer, x, ids, w, ref), = du.reference_cases(d, info, n=1, max_t=info["max_tokens"],
                                                     seed=3)
        f = du.frame(MSG_FORWARD, 1, du.forward_payload(layer, x.tobytes(), ids, w))
        for _ in range(10):
            s.sendall(f)
            du.check_forward_reply(s, {1: ref})
        for _ in range(2):
            for _ in range(200):
                s.sendall(f)
                du.check_forward_reply(s, {1: ref})
            after = buffers(d)
            assert 0 < after["pinned_allocations"] <= 4, after
            assert 0 < after["pinned_bytes"] <= 4 * 64 << 10, after
        s.close()
        assert d.stop() == 0, d.log()[-4000:]


@pytest.mark.parametrize("over", [{"server__pinned_pool_bytes": 0, "env": HOST_ALLOC},
                                  {}], ids=["cap-0", "no-allocator"])
def test_nothing_pinned_without(tmp_path_factory, over):
    """A cap of 0 turns the pinned path off on any backend; the plain CPU
    backend has no allocator at all. Replies are the reference's either way."""
    if not over and du.TEST_BACKEND != "cpu":
        pytest.skip("only the CPU backend has no host allocator")
    import moed_client
    with start(tmp_path_factory, "buffers-off", **over) as d:
        s = d.connect()
        info = du.hello(s)
        s.close()
        with moed_client.Client(d.sock_path) as c:
            for layer, x, ids, w, ref in du.reference_cases(d, info, n=3, max_t=8, seed=4):
                assert du.rel_l2(c.forward(layer, x, ids, w), ref) < 1e-2
        b = buffers(d)
        assert b["pinned_bytes"] == 0 and b["pinned_allocations"] == 0, b
        assert b["pinned_limit_bytes"] == 0, b
        assert "buffers: ordinary memory" in d.log()
        assert d.stop() == 0, d.log()[-4000:]
