"""Load and limits through the real socket: many pipelined clients with every
reply checked against its own input's reference, the client cap, the
per-client pending limit and a client that never reads its replies.
"""

import socket
import threading
import time

import numpy as np
import pytest

import daemon_util as du
from daemon_util import E, MSG_FORWARD, MSG_PING, REPLY

N_CLIENTS = 32
N_REQUESTS = 1000
WINDOW = 16
MAX_CLIENTS = 40


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory),
                         server__max_clients=MAX_CLIENTS, server__max_pending_per_client=8,
                         server__max_frame_bytes=1 << 20,
                         server__max_client_buffer_bytes=1 << 20,
                         server__frame_timeout_ms=300)
    with du.Daemon(tmp, cfg) as d:
        yield d
        assert d.alive(), d.log()
        assert d.stop() == 0, d.log()[-4000:]  # clean exit (and no leak under ASan)


@pytest.fixture(scope="module")
def expected(daemon, dims):
    """A few dozen small inputs and the exact reply bytes for each: the first
    reply is checked against the float64 reference, and the daemon computes
    each token independently of its batch-mates, so every later reply to the
    same input must be bit-identical."""
    cases = du.reference_cases(daemon, dims, n=40, max_t=1, seed=21)
    out = []
    s = daemon.connect()
    for i, (layer, x, ids, w, ref) in enumerate(cases):
        s.sendall(du.frame(MSG_FORWARD, i + 1, du.forward_payload(layer, x.tobytes(), ids, w)))
        mtype, rid, p = du.read_frame(s)
        assert (mtype, rid) == (MSG_FORWARD | REPLY, i + 1)
        _, _, y = du.forward_reply(p)
        assert du.rel_l2(np.frombuffer(y, np.uint16).reshape(ref.shape), ref) < 1e-2
        out.append((layer, x, ids, w, y))
    s.close()
    return out


def test_32_clients_1000_requests_pipelined(daemon, dims, expected):
    import moed_client
    errors = []
    counts = [0] * N_CLIENTS

    def client(ci):
        rng = np.random.default_rng(ci)
        try:
            with moed_client.Client(daemon.sock_path, timeout=du.wait_s(60)) as c:
                c.hello()
                pending = {}
                sent = 0
                while sent < N_REQUESTS or pending:
                    while sent < N_REQUESTS and len(pending) < WINDOW:
                        k = int(rng.integers(len(expected)))
                        layer, x, ids, w, _ = expected[k]
                        rid = (ci << 32) | (sent + 1)  # unique per client and request
                        c.send_forward(rid, layer, x, ids, w)
                        pending[rid] = k
                        sent += 1
                    rid, y = c.recv()
                    if rid not in pending:
                        errors.append("client %d: unexpected or duplicate reply %d" % (ci, rid))
                        return
                    k = pending.pop(rid)
                    if y.tobytes() != expected[k][4]:
                        errors.append("client %d: reply %d does not match input %d" % (ci, rid, k))
                        return
                    counts[ci] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append("client %d: %r" % (ci, e))

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(N_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    dt = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert counts == [N_REQUESTS] * N_CLIENTS
    with moed_client.Client(daemon.sock_path) as c:
        st = c.status()
    assert st["requests"]["in_flight"] == 0
    assert st["batches"]["mean_tokens"] > 1.0, st["batches"]  # requests were merged
    print("32x1000 requests in %.1f s, %d batches" % (dt, st["batches"]["count"]))


def test_client_cap_refuses_exactly_10(daemon, dims):
    """max_clients + 10 connections (the status client counts as one): exactly
    10 are refused with a BUSY error frame and closed."""
    import moed_client
    c = moed_client.Client(daemon.sock_path)
    socks, refused, served = [], 0, 0
    try:
        # earlier tests' clients are gone once the daemon has seen their EOF
        deadline = time.monotonic() + 10
        while c.status()["clients"]["connected"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.status()["clients"]["connected"] == 1  # just this status client
        refused_before = c.status()["clients"]["refused"]
        for i in range(MAX_CLIENTS - 1 + 10):
            s = daemon.connect()
            socks.append(s)
            try:
                s.sendall(du.frame(MSG_PING, i + 1, b"x"))
            except (BrokenPipeError, ConnectionResetError):
                pass  # a refused client may be closed before it writes; the ERROR is readable
            mtype, rid, p = du.read_frame(s)
            if mtype == MSG_PING | REPLY:
                served += 1
            else:
                code, msg = du.parse_error(p)
                assert code == E["busy"], msg
                assert msg == "too many clients (limit %d)" % MAX_CLIENTS
                du.expect_closed(s)
                refused += 1
        assert (served, refused) == (MAX_CLIENTS - 1, 10)
        st = c.status()
        assert st["clients"]["connected"] == MAX_CLIENTS
        assert st["clients"]["refused"] - refused_before == 10
        # one leaves: a new client is served again
        socks.pop(0).close()
        deadline = time.monotonic() + 10
        while c.status()["clients"]["connected"] != MAX_CLIENTS - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        s = daemon.connect()
        socks.append(s)
        s.sendall(du.frame(MSG_PING, 99, b"y"))
        assert du.read_frame(s)[0] == MSG_PING | REPLY
    finally:
        for s in socks:
            s.close()
        c.close()


def test_pending_limit_pauses_not_fails(daemon, dims, expected):
    """200 requests pipelined in one write with max_pending_per_client 8: the
    daemon stops reading at the limit and resumes; every request is answered."""
    s = daemon.connect(timeout=60)
    frames = []
    for i in range(200):
        layer, x, ids, w, _ = expected[i % len(expected)]
        frames.append(du.frame(MSG_FORWARD, i + 1, du.forward_payload(layer, x.tobytes(), ids, w)))
    sender = threading.Thread(target=s.sendall, args=(b"".join(frames),))
    sender.start()
    got = set()
    for _ in range(200):
        mtype, rid, p = du.read_frame(s)
        assert mtype == MSG_FORWARD | REPLY, du.parse_error(p)
        assert du.forward_reply(p)[2] == expected[(rid - 1) % len(expected)][4]
        got.add(rid)
    sender.join(10)
    assert got == set(range(1, 201))
    s.close()


def test_half_close_over_pending_limit(daemon, dims, expected):
    """More requests than max_pending_per_client, then SHUT_WR: the daemon
    still reads and answers every one of them before it closes."""
    s = daemon.connect(timeout=60)
    n = 50
    buf = b"".join(du.frame(MSG_FORWARD, i + 1, du.forward_payload(
        expected[i % len(expected)][0], expected[i % len(expected)][1].tobytes(),
        expected[i % len(expected)][2], expected[i % len(expected)][3])) for i in range(n))
    s.sendall(buf)
    s.shutdown(socket.SHUT_WR)
    got = set()
    for _ in range(n):
        mtype, rid, p = du.read_frame(s)
        assert mtype == MSG_FORWARD | REPLY, du.parse_error(p)
        assert du.forward_reply(p)[2] == expected[(rid - 1) % len(expected)][4]
        got.add(rid)
    assert got == set(range(1, n + 1))
    du.expect_closed(s)


def test_slow_reader_disconnected(daemon, dims):
    """A client that sends big requests and never reads: the daemon stops
    reading it once its queued replies pass max_client_buffer_bytes, and
    disconnects it when they do not drain within the frame deadline. Other
    clients are not affected."""
    import moed_client
    t = dims["max_tokens"]
    rng = np.random.default_rng(0)
    x = du.bf16_bits(rng.standard_normal((t, dims["hidden"])).astype(np.float32))
    ids = rng.integers(0, dims["n_experts"], size=(t, dims["top_k"])).astype(np.int32)
    w = rng.random((t, dims["top_k"])).astype(np.float32)
    payload = du.forward_payload(dims["first_moe_layer"], x.tobytes(), ids, w)
    s = daemon.connect(timeout=30)
    result = {}

    def send():
        try:
            for i in range(400):  # ~13 MiB of requests, ~13 MiB of replies
                s.sendall(du.frame(MSG_FORWARD, i + 1, payload))
            result["sent"] = "all"
        except OSError as e:
            result["sent"] = repr(e)

    th = threading.Thread(target=send)
    th.start()
    th.join(60)
    assert not th.is_alive()
    assert result["sent"] != "all", "the daemon kept reading a client that never reads"
    deadline = time.monotonic() + 10
    while "not read within" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "reply bytes not read within 300 ms; disconnecting" in daemon.log()
    s.close()
    with moed_client.Client(daemon.sock_path) as c:
        y = c.forward(dims["first_moe_layer"], x, ids, w)
        assert y.shape == (t, dims["hidden"])
        assert c.status()["requests"]["in_flight"] == 0
