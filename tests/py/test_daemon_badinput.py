"""Bad input through the real socket: every case gets its typed ERROR (and
the connection is kept or closed as the protocol says), while a well-behaved
client runs in a thread for the whole module and must see no failure; the
daemon's resident memory must not grow when the whole suite runs again.

Framing errors (bad magic/version/flags, payload too big, truncated frame,
frame deadline) close the connection; request-level errors (unknown type,
bad FORWARD fields) answer ERROR and keep it.
"""

import os
import random
import socket
import struct
import threading
import time

import numpy as np
import pytest

import daemon_util as du
from daemon_util import E, MSG_FORWARD, MSG_HELLO, MSG_PING, REPLY

MAX_FRAME = 1 << 20
FRAME_TIMEOUT_MS = 300


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("badinput")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory),
                         server__max_frame_bytes=MAX_FRAME,
                         server__frame_timeout_ms=FRAME_TIMEOUT_MS)
    with du.Daemon(tmp, cfg) as d:
        yield d
        assert d.alive(), d.log()
        # A clean exit after the whole suite (under ASan this also runs the
        # leak check, which makes the exit code non-zero on a leak).
        assert d.stop() == 0, d.log()[-4000:]


@pytest.fixture(scope="module")
def good_client(daemon, dims):
    """A well-behaved client forwarding known inputs for the whole module; each
    reply must match the reference output of its own input."""
    cases = du.reference_cases(daemon, dims, n=4, max_t=8, seed=11)
    state = {"ok": 0, "fail": [], "stop": False}

    def run():
        import moed_client
        try:
            c = moed_client.Client(daemon.sock_path, timeout=du.wait_s(30))
            c.hello()
            i = 0
            while not state["stop"]:
                layer, x, ids, w, ref = cases[i % len(cases)]
                y = c.forward(layer, x, ids, w)
                err = du.rel_l2(y, ref)
                if not err < 1e-2:
                    state["fail"].append("case %d: rel L2 %.3g" % (i % len(cases), err))
                state["ok"] += 1
                i += 1
                time.sleep(0.002)
            c.close()
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            state["fail"].append(repr(e))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    yield state
    # It must have been served all along and still be: wait for a few more
    # replies than it had (an event, not a rate, which a loaded machine or a
    # sanitizer build would not keep up).
    want = max(state["ok"] + 3, 11)
    deadline = time.monotonic() + du.wait_s(30)
    while state["ok"] < want and not state["fail"] and th.is_alive() \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    state["stop"] = True
    th.join(du.wait_s(30))
    assert not th.is_alive()
    assert state["fail"] == []
    assert state["ok"] >= want, state["ok"]


def ping_ok(s, rid=777):
    """The connection still works."""
    s.sendall(du.frame(MSG_PING, rid, b"alive"))
    mtype, r, p = du.read_frame(s)
    assert (mtype, r, p) == (MSG_PING | REPLY, rid, b"alive")


def good_payload(dims, layer=None, t=2, seed=0):
    rng = np.random.default_rng(seed)
    h, k = dims["hidden"], dims["top_k"]
    x = du.bf16_bits(rng.standard_normal((t, h)).astype(np.float32))
    ids = rng.integers(0, dims["n_experts"], size=(t, k)).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    layer = dims["first_moe_layer"] if layer is None else layer
    return layer, x, ids, w


def fwd(dims, **kw):
    layer, x, ids, w = good_payload(dims)
    layer = kw.get("layer", layer)
    x = kw.get("x", x)
    ids = kw.get("ids", ids)
    w = kw.get("w", w)
    return du.forward_payload(layer, x.tobytes(), ids, w, n_tokens=kw.get("n_tokens"),
                              top_k=kw.get("top_k"), flags=kw.get("flags", 0))


# ---- the cases: each takes (daemon, dims) ----------------------------------------

def case_bad_magic(d, dims):
    s = d.connect()
    s.sendall(du.frame(MSG_PING, 5, b"x", magic=0x12345678))
    du.expect_error(s, E["proto"], "bad magic 0x12345678", rid=5)
    du.expect_closed(s)


def case_wrong_version(d, dims):
    s = d.connect()
    s.sendall(du.frame(MSG_PING, 6, b"x", version=3))
    du.expect_error(s, E["version"], "protocol version 3 not supported", rid=6)
    du.expect_closed(s)


def case_nonzero_flags(d, dims):
    s = d.connect()
    s.sendall(du.frame(MSG_PING, 7, b"x", flags=1))
    du.expect_error(s, E["proto"], "must be 0", rid=7)
    du.expect_closed(s)


def case_unknown_type(d, dims):
    s = d.connect()
    s.sendall(du.frame(99, 8, b"0123456789"))
    du.expect_error(s, E["type"], "unknown message type 99", rid=8)
    ping_ok(s)  # the payload was skipped, the stream is in sync
    s.close()


def case_unknown_type_split(d, dims):
    """Unknown type whose payload arrives in pieces after the error."""
    s = d.connect()
    s.sendall(du.header(1234, 9, 3000))
    du.expect_error(s, E["type"], "unknown message type 1234", rid=9)
    for _ in range(3):
        s.sendall(b"z" * 1000)
        time.sleep(0.01)
    ping_ok(s)
    s.close()


def case_register_unsupported(d, dims):
    s = d.connect()
    # a version-1 frame of a version-2 type: refused as version 1 always did
    s.sendall(du.frame(du.MSG_REGISTER_BUF, 10, b"\0" * 16))
    du.expect_error(s, E["unsupported"], "needs protocol version 2 frames", rid=10)
    ping_ok(s)
    s.close()


def case_forward_len0(d, dims):
    s = d.connect()
    s.sendall(du.frame(MSG_FORWARD, 11, b""))
    du.expect_error(s, E["inval"], "payload is 0 bytes, shorter than the 16-byte FORWARD head",
                    rid=11)
    ping_ok(s)
    s.close()


def case_len_max_plus_1(d, dims):
    s = d.connect()
    s.sendall(du.header(MSG_FORWARD, 12, MAX_FRAME + 1))
    du.expect_error(s, E["toobig"], "payload_len %d is over the limit %d" % (MAX_FRAME + 1,
                                                                           MAX_FRAME), rid=12)
    du.expect_closed(s)


def case_len_u64_max(d, dims):
    s = d.connect()
    s.sendall(du.header(MSG_FORWARD, 13, 2**64 - 1))
    du.expect_error(s, E["toobig"], "payload_len %d is over the limit" % (2**64 - 1), rid=13)
    du.expect_closed(s)


def case_truncated_header_eof(d, dims):
    s = d.connect()
    s.sendall(du.header(MSG_PING, 14, 4)[:20])
    s.shutdown(socket.SHUT_WR)
    du.expect_error(s, E["proto"], "connection closed mid-frame (20 bytes")
    du.expect_closed(s)


def case_truncated_after_valid_requests(d, dims):
    """Whole FORWARDs, then a partial frame and EOF: the partial frame gets
    its ERROR and every request before it still gets its reply."""
    s = d.connect()
    n = 4
    for i in range(n):
        layer, x, ids, w = good_payload(dims, t=8, seed=40 + i)
        s.sendall(du.frame(MSG_FORWARD, 300 + i, du.forward_payload(layer, x.tobytes(), ids, w)))
    s.sendall(du.header(MSG_PING, 399, 4)[:20])
    s.shutdown(socket.SHUT_WR)
    got, errors = set(), []
    for _ in range(n + 1):
        mtype, rid, p = du.read_frame(s)
        if mtype == MSG_FORWARD | REPLY:
            got.add(rid)
        else:
            errors.append(du.parse_error(p))
    assert got == set(range(300, 300 + n))
    assert len(errors) == 1 and "connection closed mid-frame (20 bytes" in errors[0][1], errors
    du.expect_closed(s)


def case_body_never_comes(d, dims):
    s = d.connect()
    t0 = time.monotonic()
    s.sendall(du.header(MSG_FORWARD, 15, 1000) + b"abc")
    du.expect_error(s, E["timeout"], "frame not complete within %d ms" % FRAME_TIMEOUT_MS,
                    rid=15)
    dt = time.monotonic() - t0
    assert FRAME_TIMEOUT_MS / 1000 * 0.9 <= dt < FRAME_TIMEOUT_MS / 1000 + 2.0, dt
    du.expect_closed(s)


def case_t_zero_with_rows(d, dims):
    # T = 0 is valid (an empty reply), but only with the 16-byte head alone
    s = d.connect()
    p = fwd(dims, n_tokens=0)
    s.sendall(du.frame(MSG_FORWARD, 16, p))
    du.expect_error(s, E["inval"], "payload is %d bytes but T=0, H=%d, k=%d need 16"
                    % (len(p), dims["hidden"], dims["top_k"]), rid=16)
    ping_ok(s)
    s.close()


def case_t_over_limit(d, dims):
    t = dims["max_tokens"] + 1
    layer, x, ids, w = good_payload(dims, t=t)
    s = d.connect()
    s.sendall(du.frame(MSG_FORWARD, 17, du.forward_payload(layer, x.tobytes(), ids, w)))
    du.expect_error(s, E["inval"], "n_tokens %d is out of range [0, %d]" % (t, dims["max_tokens"]),
                    rid=17)
    ping_ok(s)
    s.close()


def case_topk_mismatch(d, dims):
    k = dims["top_k"]
    s = d.connect()
    s.sendall(du.frame(MSG_FORWARD, 18, fwd(dims, top_k=k + 1)))
    du.expect_error(s, E["inval"], "top_k %d does not match the model's %d" % (k + 1, k), rid=18)
    ping_ok(s)
    s.close()


def case_expert_minus_one(d, dims):
    layer, x, ids, w = good_payload(dims)
    ids[1, 0] = -1
    s = d.connect()
    s.sendall(du.frame(MSG_FORWARD, 19, du.forward_payload(layer, x.tobytes(), ids, w)))
    du.expect_error(s, E["inval"], "expert id -1 at token 1 slot 0 is out of range [0, %d)"
                    % dims["n_experts"], rid=19)
    ping_ok(s)
    s.close()


def case_expert_e(d, dims):
    layer, x, ids, w = good_payload(dims)
    ids[0, 1] = dims["n_experts"]
    s = d.connect()
    s.sendall(du.frame(MSG_FORWARD, 20, du.forward_payload(layer, x.tobytes(), ids, w)))
    du.expect_error(s, E["inval"], "expert id %d at token 0 slot 1 is out of range"
                    % dims["n_experts"], rid=20)
    ping_ok(s)
    s.close()


def case_layer_out_of_range(d, dims):
    s = d.connect()
    bad = dims["n_layers"]
    s.sendall(du.frame(MSG_FORWARD, 21, fwd(dims, layer=bad)))
    du.expect_error(s, E["inval"], "layer %d is not an MoE layer" % bad, rid=21)
    s.sendall(du.frame(MSG_FORWARD, 22, fwd(dims, layer=0xFFFFFFFF)))
    du.expect_error(s, E["inval"], "layer 4294967295 is not an MoE layer", rid=22)
    ping_ok(s)
    s.close()


def case_len_mismatch(d, dims):
    p = fwd(dims)  # T=2
    s = d.connect()
    s.sendall(du.frame(MSG_FORWARD, 23, p[:-4]))
    du.expect_error(s, E["inval"], "payload is %d bytes but T=2" % (len(p) - 4), rid=23)
    s.sendall(du.frame(MSG_FORWARD, 24, p + b"\0" * 8))
    du.expect_error(s, E["inval"], "payload is %d bytes but T=2" % (len(p) + 8), rid=24)
    ping_ok(s)
    s.close()


def case_random_garbage(d, dims):
    rng = random.Random(1234)
    s = d.connect()
    data = bytes(rng.getrandbits(8) for _ in range(4096))
    assert data[:4] != b"MOED"
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass
    du.expect_error(s, E["proto"], "bad magic")
    du.expect_closed(s)


def case_disconnect_mid_frame(d, dims):
    p = fwd(dims)
    s = d.connect()
    s.sendall(du.header(MSG_FORWARD, 25, len(p)) + p[: len(p) // 2])
    s.close()


def case_disconnect_mid_request(d, dims):
    """Whole FORWARDs sent, the client leaves before the replies: the batches
    complete and their replies are dropped."""
    s = d.connect()
    for i in range(8):
        layer, x, ids, w = good_payload(dims, t=8, seed=i)
        s.sendall(du.frame(MSG_FORWARD, 100 + i, du.forward_payload(layer, x.tobytes(), ids, w)))
    s.close()


def case_hello_bad_version_range(d, dims):
    s = d.connect()
    s.sendall(du.frame(MSG_HELLO, 26, struct.pack("<HHI", 3, 4, 0)))
    du.expect_error(s, E["version"], "client speaks versions 3..4", rid=26)
    ping_ok(s)
    s.close()


def case_ping_too_long(d, dims):
    s = d.connect()
    s.sendall(du.frame(MSG_PING, 27, b"p" * 65))
    du.expect_error(s, E["inval"], "PING payload is 65 bytes; at most 64", rid=27)
    ping_ok(s)
    s.close()


def case_one_byte_fragments(d, dims):
    """A good FORWARD dribbled one byte at a time (within the deadline) works."""
    p = fwd(dims)
    s = d.connect()
    data = du.frame(MSG_FORWARD, 28, p)
    for i in range(0, 64):
        s.send(data[i:i + 1])
    s.sendall(data[64:])
    mtype, r, payload = du.read_frame(s)
    assert (mtype, r) == (MSG_FORWARD | REPLY, 28)
    s.close()


CASES = [v for k, v in sorted(globals().items()) if k.startswith("case_")]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[5:] for c in CASES])
def test_bad_input(daemon, dims, good_client, case):
    case(daemon, dims)
    assert daemon.alive(), daemon.log()


def test_rss_stable_across_suite(daemon, dims, good_client):
    """Run every case again and again: RSS after pass 3 must not exceed RSS
    after pass 2 by more than a small allocator slack."""
    if daemon.sanitized():
        pytest.skip("ASan's quarantine keeps freed memory resident; the leak check at exit covers this")

    def suite():
        for c in CASES:
            c(daemon, dims)
    suite()
    suite()
    time.sleep(0.3)
    rss2 = daemon.rss_kb()
    suite()
    time.sleep(0.3)
    rss3 = daemon.rss_kb()
    assert rss3 - rss2 < 2048, "RSS grew from %d kB to %d kB" % (rss2, rss3)


def test_status_counts_errors(daemon, dims, good_client):
    import moed_client
    with moed_client.Client(daemon.sock_path) as c:
        st = c.status()
    text = repr(st)
    assert "inval" in text and "proto" in text, text[:2000]
