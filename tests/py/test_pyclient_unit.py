"""Unit tests of the Python client (ipc/python/moed_client) against a tiny
in-test fake daemon on a temporary Unix socket.

The fake daemon decodes requests by hand from the offsets of ipc/PROTOCOL.md
(not with the client's own structs), so a layout mistake on either side shows.
When the C client library is built ($MOED_BUILD/libmoedclient.so), the
client's header bytes are also compared with the C encoder's.
"""
import ctypes
import os
import socket
import struct
import sys
import subprocess
import tempfile
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "ipc", "python"))  # test the tree, not an old install

import moed_client as mc  # noqa: E402

np = pytest.importorskip("numpy")

H, INTER, E, K, MAX_T = 8, 16, 4, 2, 16
MOE_LAYERS = range(1, 4)


def u32(b, o):
    return int.from_bytes(b[o:o + 4], "little")


def hdr(mtype, rid, plen):
    """A header built byte by byte from PROTOCOL.md."""
    return (b"MOED" + (1).to_bytes(2, "little") + mtype.to_bytes(2, "little") + bytes(8) +
            rid.to_bytes(8, "little") + plen.to_bytes(8, "little"))


def error_frame(rid, code, msg):
    m = msg.encode()
    return hdr(0x8005, rid, 8 + len(m)) + code.to_bytes(4, "little", signed=True) + \
        len(m).to_bytes(4, "little") + m


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f):
    u = f.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


class FakeDaemon:
    """Serves one connection at a time. FORWARD computes y = x * sum_j w[t, j]
    (bf16-rounded). Pipelined FORWARDs are answered in reverse order once
    `batch` of them have arrived. Every raw request frame is kept in .seen."""

    def __init__(self, batch=1, script=None):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "moed.sock")
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lsock.bind(self.path)
        self.lsock.listen(4)
        self.batch = batch
        self.script = script  # optional fn(conn, type, rid, payload) -> True if handled
        self.seen = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def close(self):
        self.lsock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.rmdir(self.dir)

    @staticmethod
    def recv_exact(conn, n):
        b = b""
        while len(b) < n:
            r = conn.recv(n - len(b))
            if not r:
                raise EOFError
            b += r
        return b

    def run(self):
        while True:
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return
            try:
                self.serve(conn)
            except (EOFError, OSError):
                pass
            finally:
                conn.close()

    def forward_reply(self, rid, p):
        layer, t, k, flags = struct.unpack_from("<IIII", p)
        if layer not in MOE_LAYERS:
            return error_frame(rid, -12, "layer %d is not an MoE layer of this model" % layer)
        assert flags == 0 and k == K and len(p) == 16 + 2 * t * H + 8 * t * k
        x = np.frombuffer(p, dtype="<u2", count=t * H, offset=16).reshape(t, H)
        ids = np.frombuffer(p, dtype="<i4", count=t * k, offset=16 + 2 * t * H).reshape(t, k)
        w = np.frombuffer(p, dtype="<f4", count=t * k, offset=16 + 2 * t * H + 4 * t * k)
        assert ((ids >= 0) & (ids < E)).all()
        y = f32_to_bf16(bf16_to_f32(x) * w.reshape(t, k).sum(axis=1, keepdims=True))
        body = struct.pack("<II", t, H) + y.astype("<u2").tobytes()
        return hdr(0x8002, rid, len(body)) + body

    def serve(self, conn):
        queued = []
        while True:
            h = self.recv_exact(conn, 32)
            assert h[:4] == b"MOED"
            mtype = int.from_bytes(h[6:8], "little")
            rid = int.from_bytes(h[16:24], "little")
            plen = int.from_bytes(h[24:32], "little")
            p = self.recv_exact(conn, plen)
            self.seen.append(h + p)
            if self.script and self.script(conn, mtype, rid, p):
                continue
            if mtype == 1:
                assert plen == 8 and p[:4] == b"\x01\x00\x02\x00"  # offers 1..2
                # and this fake daemon picks version 1 (64 bytes, no layer list)
                rep = struct.pack("<HHIIIIIIIIIQ16s", 1, 0, H, INTER, E, K, 1, 4, 1, MAX_T, 0,
                                  1 << 20, b"fake")
                conn.sendall(hdr(0x8001, rid, 64) + rep)
            elif mtype == 2:
                queued.append(self.forward_reply(rid, p))
                if len(queued) >= self.batch:
                    for f in reversed(queued):
                        conn.sendall(f)
                    queued = []
            elif mtype == 3:
                js = b'{"model": {"hidden": 8}, "ok": true}'
                conn.sendall(hdr(0x8003, rid, len(js)) + js)
            elif mtype == 4:
                conn.sendall(hdr(0x8004, rid, plen) + p)
            else:
                conn.sendall(error_frame(rid, -17, "type %d is not supported" % mtype))


@pytest.fixture
def daemon():
    d = FakeDaemon()
    yield d
    d.close()


def rand_batch(t, seed=0):
    rng = np.random.default_rng(seed)
    x = f32_to_bf16(rng.standard_normal((t, H)).astype(np.float32))
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
    w = rng.random((t, K)).astype(np.float32)
    return x, ids, w


def expected(x, w):
    return f32_to_bf16(bf16_to_f32(x) * w.sum(axis=1, keepdims=True))


def test_header_layout_by_hand():
    f = mc.encode_frame(mc.MSG_FORWARD | mc.REPLY, 0x0102030405060708, b"abc")
    assert f[:32] == hdr(0x8002, 0x0102030405060708, 3)
    assert f[:8] == b"MOED\x01\x00\x02\x80"
    assert f[16:24] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert f[32:] == b"abc"
    assert mc.decode_header(f) == (0x8002, 0x0102030405060708, 3)


def test_protocol_md_example_bytes():
    """The worked example of PROTOCOL.md section 8, byte for byte."""
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)
    raw = f32_to_bf16(x).astype("<u2").tobytes()
    p = mc.encode_forward(3, raw, 1, np.array([0, 5], "<i4").tobytes(),
                          np.array([0.75, 0.25], "<f4").tobytes(), 2)
    frame = mc.encode_frame(mc.MSG_FORWARD, 2, p)
    assert frame.hex(" ") == " ".join([
        "4d 4f 45 44 01 00 02 00 00 00 00 00 00 00 00 00",
        "02 00 00 00 00 00 00 00 28 00 00 00 00 00 00 00",
        "03 00 00 00 01 00 00 00 02 00 00 00 00 00 00 00",
        "80 3f 00 40 40 40 80 40",
        "00 00 00 00 05 00 00 00",
        "00 00 40 3f 00 00 80 3e"])


def test_header_matches_c_encoder(tmp_path):
    build = os.environ.get("MOED_BUILD", "build")
    # libmoedclient.so exports the moedc_* API only: link the client's own
    # objects (protocol encoder included) into a throwaway library instead
    objs = [os.path.join(ROOT, build, "client", o) for o in ("ipc/proto.o", "common/moed_err.o")]
    if not all(os.path.exists(o) for o in objs):
        pytest.skip("%s not built" % objs)
    if os.environ.get("MOED_SANITIZE") == "1":
        # An ASan-instrumented library cannot be dlopen'ed into an uninstrumented
        # Python (the ASan runtime must load first); the plain build covers this.
        pytest.skip("sanitizer build: library not loadable into python")
    lib = str(tmp_path / "libproto.so")
    subprocess.run(["cc", "-shared", "-o", lib, *objs], check=True, timeout=60)
    so = ctypes.CDLL(lib)
    so.moed_frame_encode.argtypes = [ctypes.c_char_p, ctypes.c_uint16, ctypes.c_uint64,
                                     ctypes.c_uint64]
    so.moed_forward_payload_len.restype = ctypes.c_uint64
    so.moed_forward_payload_len.argtypes = [ctypes.c_uint64] * 3
    for t, rid, n in [(1, 0, 0), (2, 1 << 63, 1056), (0x8005, 12345, 2 ** 40)]:
        buf = ctypes.create_string_buffer(32)
        so.moed_frame_encode(buf, t, rid, n)
        assert buf.raw == mc.encode_frame(t, rid, b"")[:24] + n.to_bytes(8, "little")
    x, ids, w = rand_batch(3)
    p = mc.encode_forward(2, x.tobytes(), 3, ids.tobytes(), w.tobytes(), K)
    assert len(p) == so.moed_forward_payload_len(3, H, K)


def test_decode_header_errors():
    good = hdr(1, 5, 8)
    with pytest.raises(mc.MoedError) as e:
        mc.decode_header(b"X" + good[1:])
    assert e.value.code == -8 and e.value.name == "proto"
    with pytest.raises(mc.MoedError) as e:
        mc.decode_header(good[:4] + b"\x03\x00" + good[6:])
    assert e.value.name == "version"
    with pytest.raises(mc.MoedError) as e:
        mc.decode_header(good[:8] + b"\x01" + good[9:])
    assert e.value.name == "proto"
    with pytest.raises(mc.MoedError) as e:
        mc.decode_header(hdr(1, 5, 2 ** 64 - 1), max_payload=1 << 20)
    assert e.value.name == "toobig"


def test_hello_status_ping(daemon):
    with mc.Client(daemon.path, timeout=5) as c:
        info = c.hello()
        assert (info.hidden, info.inter, info.n_experts, info.top_k) == (H, INTER, E, K)
        assert (info.n_shared, info.n_layers, info.first_moe_layer) == (1, 4, 1)
        assert info.max_tokens == MAX_T and info.max_frame_bytes == 1 << 20
        assert info.backend == "fake"
        assert info.version == 1 and info.moe_layers == (1, 2, 3)  # first_moe_layer..n_layers
        with pytest.raises(mc.MoedError) as e:  # flags need version 2: refused unsent
            c.forward(2, *rand_batch(1, seed=0), routed_only=True)
        assert e.value.name == "version"
        assert c.status() == {"model": {"hidden": 8}, "ok": True}
        assert c.ping() >= 0
    # request ids are distinct and echoed
    ids = [int.from_bytes(f[16:24], "little") for f in daemon.seen]
    assert len(set(ids)) == len(ids)


def test_forward_numpy_uint16_and_payload_bytes(daemon):
    x, ids, w = rand_batch(5, seed=1)
    with mc.Client(daemon.path, timeout=5) as c:
        y = c.forward(2, x, ids, w)
    assert y.dtype == np.uint16 and y.shape == (5, H)
    np.testing.assert_array_equal(y, expected(x, w))
    f = daemon.seen[-1]
    p = f[32:]
    assert int.from_bytes(f[6:8], "little") == 2
    assert int.from_bytes(f[24:32], "little") == len(p) == 16 + 2 * 5 * H + 8 * 5 * K
    assert (u32(p, 0), u32(p, 4), u32(p, 8), u32(p, 12)) == (2, 5, K, 0)
    assert p[16:16 + 2 * 5 * H] == x.astype("<u2").tobytes()
    assert p[16 + 2 * 5 * H:16 + 2 * 5 * H + 4 * 5 * K] == ids.astype("<i4").tobytes()
    assert p[16 + 2 * 5 * H + 4 * 5 * K:] == w.astype("<f4").tobytes()


def test_forward_ml_dtypes_and_float(daemon):
    ml = pytest.importorskip("ml_dtypes")
    x, ids, w = rand_batch(3, seed=2)
    with mc.Client(daemon.path, timeout=5) as c:
        y = c.forward(1, x.view(ml.bfloat16), ids, w)
        assert y.dtype == ml.bfloat16
        np.testing.assert_array_equal(y.view(np.uint16), expected(x, w))
        yf = c.forward(1, bf16_to_f32(x), ids.tolist(), w.tolist())
        assert yf.dtype == np.float32
        np.testing.assert_array_equal(yf, bf16_to_f32(expected(x, w)))


def test_error_reply_is_moederror_and_connection_survives(daemon):
    x, ids, w = rand_batch(2)
    with mc.Client(daemon.path, timeout=5) as c:
        with pytest.raises(mc.MoedError) as e:
            c.forward(7, x, ids, w)
        assert e.value.code == -12 and e.value.name == "inval"
        assert e.value.message == "layer 7 is not an MoE layer of this model"
        assert e.value.request_id == int.from_bytes(daemon.seen[-1][16:24], "little")
        np.testing.assert_array_equal(c.forward(3, x, ids, w), expected(x, w))


def test_client_side_checks(daemon):
    x, ids, w = rand_batch(2)
    with mc.Client(daemon.path, timeout=5) as c:
        with pytest.raises(ValueError, match="H=4, the model's hidden size is 8"):
            c.forward(1, x[:, :4], ids, w)
        with pytest.raises(ValueError, match="must both be"):
            c.forward(1, x, ids[:1], w)
        xb, ib, wb = rand_batch(MAX_T + 1)
        with pytest.raises(mc.MoedError, match=r"n_tokens 17 is out of range \[0, 16\]"):
            c.send_forward(7, 1, xb, ib, wb)  # no splitting in the pipelined call
        # forward() splits T over max_tokens: chunks of 16 and 1, in order
        n = len(daemon.seen)
        np.testing.assert_array_equal(c.forward(1, xb, ib, wb), expected(xb, wb))
        ts = [u32(f[32:], 4) for f in daemon.seen[n:] if int.from_bytes(f[6:8], "little") == 2]
        assert ts == [MAX_T, 1]
        # a batch to split whose routing rows do not match: refused before
        # anything is sent, and the connection stays usable
        n = len(daemon.seen)
        with pytest.raises(ValueError, match="have 16 and 17 rows; hidden_states has T=17"):
            c.forward(1, xb, ib[:MAX_T], wb)
        assert len(daemon.seen) == n
        np.testing.assert_array_equal(c.forward(1, x, ids, w), expected(x, w))
        # T = 0 with this version-1 daemon (which refuses it): the empty
        # result without a round trip
        y0 = c.forward(1, x[:0], ids[:0], w[:0])
        assert y0.shape == (0, H) and len(daemon.seen) == n + 1


def test_pipelined_out_of_order():
    d = FakeDaemon(batch=3)
    try:
        batches = {100 + i: rand_batch(i + 1, seed=i) for i in range(3)}
        with mc.Client(d.path, timeout=5) as c:
            for rid, (x, ids, w) in batches.items():
                c.send_forward(rid, 1, x, ids, w)
            assert c.inflight == 3
            with pytest.raises(mc.MoedError, match="outstanding"):
                c.ping()
            got = [c.recv() for _ in range(3)]
            assert [r for r, _ in got] == [102, 101, 100]  # fake answers in reverse
            for rid, y in got:
                x, _, w = batches[rid]
                np.testing.assert_array_equal(y, expected(x, w))
            assert c.inflight == 0
            with pytest.raises(mc.MoedError, match="no request is in flight"):
                c.recv()
    finally:
        d.close()


def test_pipelined_error_carries_request_id(daemon):
    x, ids, w = rand_batch(2)
    with mc.Client(daemon.path, timeout=5) as c:
        c.send_forward(41, 0, x, ids, w)
        with pytest.raises(mc.MoedError) as e:
            c.recv()
        assert e.value.request_id == 41 and e.value.name == "inval"
        assert c.inflight == 0
        c.send_forward(42, 1, x, ids, w)
        rid, y = c.recv()
        assert rid == 42


def test_registered_buffers_need_version_2(daemon):
    """A daemon that chose version 1: the version-2 calls fail locally with a
    typed error, nothing is sent, the connection stays usable."""
    with mc.Client(daemon.path, timeout=5) as c:
        assert c.hello().version == 1
        n = len(daemon.seen)
        for call in (lambda: c.register_buf(b"\1" * 64, 0, 4096, b"\2" * 16),
                     lambda: c.unregister_buf(1),
                     lambda: c.forward_desc(1, 1, (1, 0), (1, 0), (1, 0), (1, 0))):
            with pytest.raises(mc.MoedError) as e:
                call()
            assert e.value.name == "unsupported" and "need 2" in e.value.message
        assert len(daemon.seen) == n
        assert c.ping() >= 0


def script_daemon(reply, close_after=False):
    """A daemon that answers every request with reply(rid) (then hangs up)."""
    def script(conn, mtype, rid, p):
        conn.sendall(reply(rid))
        if close_after:
            conn.shutdown(socket.SHUT_RDWR)
        return True
    return FakeDaemon(script=script)


@pytest.mark.parametrize("reply,match,close_after", [
    (lambda rid: hdr(0x8004, rid, 1 << 30), "over its bound", False),  # huge payload
    (lambda rid: b"MOEX" + hdr(0x8004, rid, 8)[4:] + bytes(8), "bad magic", False),
    (lambda rid: hdr(0x8004, rid + 1, 8) + bytes(8), "request id", False),
    (lambda rid: hdr(0x0004, rid, 8) + bytes(8), "unexpected frame type", False),
    (lambda rid: hdr(0x8005, rid, 8) + struct.pack("<iI", -12, 500), "msg_len 500", False),
    (lambda rid: hdr(0x8004, rid, 8), "closed the connection", True),  # truncated
])
def test_bad_replies_are_errors_not_crashes(reply, match, close_after):
    d = script_daemon(reply, close_after)
    try:
        c = mc.Client(d.path, timeout=5)
        with pytest.raises(mc.MoedError, match=match) as e:
            c.ping(bytes(8))
        assert e.value.request_id is None
        with pytest.raises(mc.MoedError, match="closed"):
            c.ping()
    finally:
        d.close()


def test_hello_with_absurd_n_layers_is_refused():
    """A version-1 HELLO's n_layers becomes the layer list: bounded by
    MAX_LAYERS like a version-2 list, not a 4-billion-entry range."""
    rep = struct.pack("<HHIIIIIIIIIQ16s", 1, 0, H, INTER, E, K, 1, 0xFFFFFFF0, 1, MAX_T, 0,
                      1 << 20, b"fake")
    d = script_daemon(lambda rid: hdr(0x8001, rid, 64) + rep)
    try:
        c = mc.Client(d.path, timeout=5)
        with pytest.raises(mc.MoedError, match="n_layers 4294967280, over 1024"):
            c.hello()
    finally:
        d.close()


def test_timeout():
    d = FakeDaemon(script=lambda conn, mtype, rid, p: True)  # never answers
    try:
        c = mc.Client(d.path, timeout=0.2)
        with pytest.raises(mc.MoedError) as e:
            c.ping()
        assert e.value.name == "timeout"
    finally:
        d.close()


def test_connect_refused():
    with pytest.raises(mc.MoedError) as e:
        mc.Client("/nonexistent/moed.sock", timeout=1)
    assert e.value.name == "conn" and "/nonexistent/moed.sock" in e.value.message


def test_fused_experts_and_torch(daemon):
    x, ids, w = rand_batch(4, seed=5)
    c = mc.Client(daemon.path, timeout=5)
    y = mc.fused_experts(x, w, ids, layer=2, client=c)
    np.testing.assert_array_equal(y, expected(x, w))
    torch = pytest.importorskip("torch")
    xt = torch.from_numpy(bf16_to_f32(x)).to(torch.bfloat16)
    yt = mc.fused_experts(xt, torch.from_numpy(w), torch.from_numpy(ids).long(), layer=2,
                          client=c)
    assert yt.dtype == torch.bfloat16 and yt.device == xt.device and tuple(yt.shape) == (4, H)
    np.testing.assert_array_equal(yt.float().numpy(), bf16_to_f32(expected(x, w)))
    c.close()


def desc_daemon(mode):
    """A version-2 daemon whose FORWARD_DESC reply (n_tokens, hidden; with
    flag DESC_TIMES also kernel_ns 1234, daemon_ns 5678, rx_ns 10**9 and
    queued_ns 10**9 + 5678) comes after a
    pause: in one write ("whole"), header and payload apart ("split"), as an
    ERROR ("error"), without the times that were asked for ("short-times"),
    or whole with the next request's id ("wrong-id")."""
    import time

    def script(conn, mtype, rid, p):
        if mtype == 1:
            rep = struct.pack("<HHIIIIIIIIIQ16s", 2, 0, H, INTER, E, K, 1, 4, 1, MAX_T, 0,
                              1 << 20, b"fake") + struct.pack("<IIII", 3, 1, 2, 3)
            conn.sendall(hdr(0x8001, rid, len(rep)) + rep)
            return True
        if mtype != 18:
            return False
        t = u32(p, 4)
        time.sleep(0.02)
        v2 = lambda h: h[:4] + (2).to_bytes(2, "little") + h[6:]  # noqa: E731
        body = struct.pack("<II", t, H)
        if u32(p, 12) & mc.DESC_TIMES and mode != "short-times":  # times asked: 40 bytes
            body += struct.pack("<QQQQ", 1234, 5678, 10**9, 10**9 + 5678)
        if mode in ("whole", "short-times", "wrong-id"):
            conn.sendall(v2(hdr(0x8012, rid + (mode == "wrong-id"), len(body))) + body)
        elif mode == "split":
            conn.sendall(v2(hdr(0x8012, rid, len(body))))
            time.sleep(0.02)
            conn.sendall(body)
        else:
            conn.sendall(error_frame(rid, -4, "x range past the end of buffer 1"))
        return True
    return FakeDaemon(script=script)


@pytest.mark.parametrize("spin_us", [0, 10000, 200000])
@pytest.mark.parametrize("mode", ["whole", "split", "error"])
def test_forward_desc_reply_with_and_without_spin(spin_us, mode):
    """forward_desc polls for its reply (spin_us) and takes the one expected
    reply without parsing; any other reply, a reply in pieces, or one that
    comes after the spin gave up, goes through the full read, with the same
    result. The request is one write (header and payload together)."""
    d = desc_daemon(mode)
    try:
        with mc.Client(d.path, timeout=5, spin_us=spin_us) as c:
            assert c.hello().version == 2
            for i in range(3):
                if mode == "error":
                    with pytest.raises(mc.MoedError) as e:
                        c.forward_desc(1, 5, (1, 0), (1, 4096), (1, 8192), (1, 65536))
                    assert e.value.name == "range" and "past the end" in e.value.message
                else:
                    assert c.forward_desc(1, 5, (1, 0), (1, 4096), (1, 8192), (1, 65536)) is None
            assert c._rx == b""  # nothing read ahead is left over
            assert c.ping() >= 0
        req = [f for f in d.seen if int.from_bytes(f[6:8], "little") == 18]
        assert len(req) == 3 and all(len(f) == 32 + 80 for f in req)
        assert u32(req[0][32:], 4) == 5 and int.from_bytes(req[0][32 + 64 + 8:32 + 80], "little") \
            == 65536
    finally:
        d.close()


@pytest.mark.parametrize("mode", ["whole", "split", "error"])
def test_forward_desc_on_a_blocking_socket(mode):
    """Client(timeout=None): the socket blocks, so forward_desc does not spin
    (a read would wait) and the replies come through the blocking reads."""
    d = desc_daemon(mode)
    try:
        with mc.Client(d.path, timeout=None) as c:
            assert c.hello().version == 2
            if mode == "error":
                with pytest.raises(mc.MoedError) as e:
                    c.forward_desc(1, 3, (1, 0), (1, 4096), (1, 8192), (1, 65536))
                assert e.value.name == "range"
            else:
                assert c.forward_desc(1, 3, (1, 0), (1, 4096), (1, 8192), (1, 65536)) is None
            assert c._rx == b"" and c.ping() >= 0
    finally:
        d.close()


def test_small_frame_with_a_full_socket_buffer_is_sent_whole():
    """A small frame goes out in one write to the descriptor; when the socket
    buffer is full (that write fails or is short) the rest goes through
    sendall, and the peer gets every byte in order."""
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        filler = 0
        for chunk in (4096, 1):  # until not one byte more fits
            try:
                while True:
                    filler += a.send(b"\0" * chunk)
            except BlockingIOError:
                pass
        c = mc.Client(sock=a, timeout=5)
        got = bytearray()

        def drain():
            import time
            time.sleep(0.05)
            while len(got) < filler + 32 + 80:
                got.extend(b.recv(1 << 16))
        t = threading.Thread(target=drain)
        t.start()
        c._send(18, 9, bytes(range(80)))
        t.join(5)
        assert len(got) == filler + 32 + 80
        frame = bytes(got[filler:])
        assert frame[:4] == b"MOED" and u32(frame, 24) == 80 and frame[32:] == bytes(range(80))
        assert int.from_bytes(frame[16:24], "little") == 9
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("spin_us", [0, 200000])
@pytest.mark.parametrize("mode", ["whole", "split", "short-times", "wrong-id"])
def test_forward_desc_times_reply(mode, spin_us):
    """forward_desc(times=True) sends flag 0x100 and returns the reply's
    (kernel_ns, daemon_ns, rx_ns, queued_ns), with desc_stamps in order,
    whether the reply is taken in one piece by the spin (its header compared
    as bytes) or read after it; a reply without the times it asked for is a
    protocol error naming its length, and one with another request's id a
    protocol error naming the ids."""
    d = desc_daemon(mode)
    try:
        with mc.Client(d.path, timeout=5, spin_us=spin_us) as c:
            assert c.hello().version == 2
            if mode in ("short-times", "wrong-id"):
                with pytest.raises(mc.MoedError) as e:
                    c.forward_desc(1, 5, (1, 0), (1, 4096), (1, 8192), (1, 65536), times=True)
                assert e.value.name == "proto" and (
                    "with times is 8 bytes" if mode == "short-times"
                    else "reply carries request id 3, expected 2") in e.value.message, e.value
                return
            if mode == "whole" and spin_us:  # in hand within the spin: no frame parse
                c._read_frame = lambda: pytest.fail("the reply was parsed")
            assert c.forward_desc(1, 5, (1, 0), (1, 4096), (1, 8192), (1, 65536),
                                  times=True) == (1234, 5678, 10**9, 10**9 + 5678)
            c.__dict__.pop("_read_frame", None)
            sent, got = c.desc_stamps
            assert sent <= got
            assert c.forward_desc(1, 5, (1, 0), (1, 4096), (1, 8192), (1, 65536)) is None
        req = [f for f in d.seen if int.from_bytes(f[6:8], "little") == 18]
        assert [u32(f[32:], 12) for f in req] == [mc.DESC_TIMES, 0]
    finally:
        d.close()
