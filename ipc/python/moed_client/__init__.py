"""Python client for the moed MoE expert daemon (wire protocol versions 1 and 2).

Standard library only; numpy, ml_dtypes and torch are used when importable.
The byte layout is ipc/PROTOCOL.md (and ipc/moed_proto.h): every message is a
32-byte little-endian header followed by its payload.

Typical use::

    from moed_client import Client
    with Client("/tmp/moed.sock") as c:
        info = c.hello()                      # dims: hidden, top_k, n_experts, ...
        y = c.forward(layer, x, topk_ids, topk_weights)
        y = c.forward(layer, x, ids, w, routed_only=True, empty_slots=True)

T = 0 is answered with an empty [0, H] result; T over the daemon's max_tokens
is split into chunks of at most max_tokens tokens that are pipelined (several
sent before the first reply is read, at most ``max_inflight`` at a time) and
concatenated in order.

Arrays:

* ``hidden_states`` ``[T, H]``: a numpy array of bf16 (``ml_dtypes.bfloat16``,
  or ``uint16`` holding bf16 bit patterns), or float16/float32 (rounded to
  bf16 on the way out), or a torch tensor of any float dtype on any device, or
  (without numpy) a bytes-like object of ``T*H*2`` bytes of little-endian bf16.
* ``topk_ids`` ``[T, k]`` integers (sent as int32), ``topk_weights`` ``[T, k]``
  floats (sent as fp32): numpy arrays, torch tensors or nested sequences.
* The result has the kind of ``hidden_states``: a torch tensor of the same
  dtype and device; a numpy array of the same dtype (uint16 bit patterns for a
  uint16 input); bytes for a bytes-like input.

Errors from the daemon are raised as :class:`MoedError` (``code``, ``name``,
``message``, ``request_id``); local failures (connection lost, timeout,
malformed reply) as :class:`MoedError` with ``request_id`` None, after which
the client is closed.
"""

import os
import select
import socket
import struct
import threading
import time

__all__ = [
    "Client", "MoedError", "Hello", "ChanInfo", "fused_experts", "encode_frame",
    "decode_header", "encode_forward", "ERROR_NAMES", "DEFAULT_SOCKET", "__version__",
]

__version__ = "0.1.0"  # the daemon's version it was released with (Makefile VERSION)

PROTO_MAGIC = 0x44454F4D  # b"MOED" read as a little-endian u32
PROTO_VERSION = 2  # the highest this client speaks
PROTO_MIN_VERSION = 1
HDR_SIZE = 32
RX_AHEAD = 4096  # bytes a spinning wait reads at once (a FORWARD_DESC reply is 40)
REPLY = 0x8000
MAX_ERRMSG = 1024
MAX_PING = 64
MAX_STATUS_BYTES = 16 << 20
MAX_LAYERS = 1024          # MoE layer ids in a version-2 HELLO reply, at most
HELLO_V1_BYTES = 64

# FORWARD flags (protocol version 2)
FORWARD_ROUTED_ONLY = 0x1  # routed experts only: no shared-expert term
FORWARD_EMPTY_SLOTS = 0x2  # an id of EXPERT_NONE (-1) is an empty slot
EXPERT_NONE = -1

MSG_HELLO = 1
MSG_FORWARD = 2
MSG_STATUS = 3
MSG_PING = 4
MSG_ERROR = 5
MSG_REGISTER_BUF = 16
MSG_UNREGISTER_BUF = 17
MSG_FORWARD_DESC = 18
MSG_CHAN_OPEN = 19
MSG_CHAN_CLOSE = 20

# GPU doorbell channels (PROTOCOL.md section 10, kernels/moe_gpu_abi.h)
CHAN_BUFS = 16             # registered buffers a channel names (MOED_PROTO_CHAN_BUFS)
CHAN_SLOTS = 8             # descriptors in flight per channel (MOE_GPU_CHAN_SLOTS)
GPU_ABI_VERSION = 3        # MOE_GPU_ABI_VERSION the channel layout below follows
CHAN_STRUCT_BYTES = 128 + 8 * CHAN_SLOTS + (96 + 32) * CHAN_SLOTS  # sizeof(struct moe_gpu_chan)
MAX_CHAN_KERNEL_BYTES = 16 << 20  # the client kernel's fatbin in a CHAN_OPEN reply, at most
CHAN_ARENA_OFF = 4096      # a channel's arena starts here in its mapping (MOE_GPU_CHAN_ARENA_OFF)

DEFAULT_SOCKET = "/tmp/moed.sock"

# magic u32, version u16, type u16, flags u32, reserved u32, request_id u64, payload_len u64
_HDR = struct.Struct("<IHHIIQQ")
_HELLO_REQ = struct.Struct("<HHI")
# version u16, reserved0 u16, hidden, inter, n_experts, top_k, n_shared, n_layers,
# first_moe_layer, max_tokens, reserved1 (u32 each), max_frame_bytes u64, backend char[16]
_HELLO_REP = struct.Struct("<HHIIIIIIIIIQ16s")
_FWD_REQ = struct.Struct("<IIII")
_FWD_REP = struct.Struct("<II")
_ERR_REP = struct.Struct("<iI")
# REGISTER_BUF: handle 64s, offset u64, size u64, uuid 16s; reply: buf_id u32, reserved u32
_REG_REQ = struct.Struct("<64sQQ16s")
_REG_REP = struct.Struct("<II")
# FORWARD_DESC: the FORWARD head, then (buf_id u32, reserved u32, offset u64) for x, ids, w, y
_DESC_REQ = struct.Struct("<IIII" + "IIQ" * 4)
# FORWARD_DESC flag TIMES: the reply is n_tokens u32, hidden u32, kernel_ns u64, daemon_ns u64,
# rx_ns u64, queued_ns u64 (the daemon's CLOCK_MONOTONIC)
DESC_TIMES = 0x100
_DESC_TIMES_REP = struct.Struct("<IIQQQQ")
# CHAN_OPEN: uuid 16s, n_bufs u32, flags u32, buf_ids u32[16], arena_bytes u64 (the 88-byte
# form leaves it out); reply head: chan_id u32, slots u32, key u64, handle 64s, size u64,
# abi_version u32, kernel_bytes u32, arena_off u64, arena_bytes u64 (then the fatbin)
_CHAN_OPEN_REQ = struct.Struct("<16sII%dIQ" % CHAN_BUFS)
_CHAN_OPEN_REP = struct.Struct("<IIQ64sQIIQQ")
_CHAN_CLOSE_REQ = struct.Struct("<II")
assert _REG_REQ.size == 96 and _DESC_REQ.size == 80
assert _CHAN_OPEN_REQ.size == 96 and _CHAN_OPEN_REP.size == 112
assert _HDR.size == HDR_SIZE and _HELLO_REP.size == 64 and _HELLO_REQ.size == 8

# MOED_E_* codes (common/moed_err.h) -> stable names (common/moed_err.c).
ERROR_NAMES = {
    0: "ok", -1: "nomem", -2: "io", -3: "format", -4: "range", -5: "config", -6: "model",
    -7: "nofit", -8: "proto", -9: "version", -10: "type", -11: "toobig", -12: "inval",
    -13: "busy", -14: "timeout", -15: "shutdown", -16: "backend", -17: "unsupported",
    -18: "perm", -19: "notready", -20: "conn",
}
E_PROTO, E_VERSION, E_TOOBIG, E_INVAL, E_TIMEOUT, E_CONN = -8, -9, -11, -12, -14, -20


# After a failed write, how long to wait for the daemon's ERROR frame that
# says why it closed (normally in the receive queue already).
PENDING_ERROR_WAIT_S = 0.1


class MoedError(Exception):
    """An error reply from the daemon, or a local failure.

    code: negative MOED_E_* value; name: its short name ("inval", "toobig", ...);
    message: the daemon's message (or the local reason); request_id: the id of
    the request the daemon refused, 0 for a connection-level error from the
    daemon, None for a local failure.
    """

    def __init__(self, code, message, request_id=None):
        self.code = int(code)
        self.name = ERROR_NAMES.get(self.code, "unknown")
        self.message = message
        self.request_id = request_id
        super().__init__("moed error %d (%s)%s: %s" % (
            self.code, self.name,
            "" if request_id is None else " for request %d" % request_id, message))


class ChanInfo:
    """The CHAN_OPEN reply: chan_id (CHAN_CLOSE names it), slots (descriptors
    in flight), key (every descriptor carries it), handle (64-byte CUDA IPC
    handle of the channel's allocation: ring and arena), size (bytes of
    struct moe_gpu_chan at its start), abi_version (MOE_GPU_ABI_VERSION),
    arena_off and arena_bytes (the arena's place in that mapping; 0, 0
    without one) and kernel (the client kernel's fatbin bytes, entry
    moed_chan_call)."""

    __slots__ = ("chan_id", "slots", "key", "handle", "size", "abi_version", "arena_off",
                 "arena_bytes", "kernel")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])

    def __repr__(self):
        return "ChanInfo(chan_id=%d, slots=%d, key=0x%x, size=%d, abi_version=%d, " \
            "arena=%d bytes at %d, kernel=%d bytes)" % (
                self.chan_id, self.slots, self.key, self.size, self.abi_version,
                self.arena_bytes, self.arena_off, len(self.kernel))


class Hello:
    """The HELLO reply: the model's dims and the daemon's limits."""

    __slots__ = ("version", "hidden", "inter", "n_experts", "top_k", "n_shared", "n_layers",
                 "first_moe_layer", "max_tokens", "max_frame_bytes", "backend", "moe_layers")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self):
        return "Hello(%s)" % ", ".join("%s=%r" % kv for kv in self.as_dict().items())


def frame_version(msg_type):
    """The frame version a message type travels in (moed_type_min_version):
    2 for the registered-buffer types (16..31), 1 for the others."""
    return 2 if 16 <= (msg_type & ~REPLY) <= 31 else 1


def encode_frame(msg_type, request_id, payload=b""):
    """Header + payload bytes of one frame (flags and reserved are 0)."""
    return _HDR.pack(PROTO_MAGIC, frame_version(msg_type), msg_type, 0, 0, request_id,
                     len(payload)) + bytes(payload)


def decode_header(buf, max_payload=None):
    """Decode and check a 32-byte header; returns (type, request_id, payload_len).

    Raises MoedError with the code moed_frame_parse would return (proto,
    version, toobig, type) for a bad header.
    """
    if len(buf) < HDR_SIZE:
        raise MoedError(E_PROTO, "header is %d bytes, need %d" % (len(buf), HDR_SIZE))
    magic, version, mtype, flags, reserved, rid, plen = _HDR.unpack_from(buf)
    if magic != PROTO_MAGIC:
        raise MoedError(E_PROTO, "bad magic 0x%08x" % magic)
    if not PROTO_MIN_VERSION <= version <= PROTO_VERSION:
        raise MoedError(E_VERSION, "frame version %d, expected %d..%d"
                        % (version, PROTO_MIN_VERSION, PROTO_VERSION))
    if flags or reserved:
        raise MoedError(E_PROTO, "flags 0x%x / reserved 0x%x are not 0" % (flags, reserved))
    if max_payload is not None and plen > max_payload:
        raise MoedError(E_TOOBIG, "payload_len %d is over the maximum %d" % (plen, max_payload))
    return mtype, rid, plen


from ._arrays import (  # noqa: F401 (re-exported for the plugins and tests)
    _np, _bf16_dtype, _is_torch, _f32_to_bf16_bits, _bf16_bits_to_f32, _Kind,
    _hidden_to_wire, _routing_to_wire, _wire_to_hidden, _rows, _concat)


def encode_forward(layer, x_raw, n_tokens, ids_raw, w_raw, top_k, flags=0):
    """FORWARD payload: 16-byte head (layer, n_tokens, top_k, flags), x, ids, w."""
    return _FWD_REQ.pack(layer, n_tokens, top_k, flags) + x_raw + ids_raw + w_raw


def _forward_flags(routed_only, empty_slots):
    return (FORWARD_ROUTED_ONLY if routed_only else 0) | \
        (FORWARD_EMPTY_SLOTS if empty_slots else 0)


# --- the client ---------------------------------------------------------------

class Client:
    """One connection to the daemon (not thread-safe: one Client per thread).

    path: the daemon's Unix socket (default: $MOED_SOCKET or /tmp/moed.sock).
    timeout: seconds to wait for a connect and for each reply (None: forever).
    sock: an already connected stream socket to use instead of path (tests).
    spin_us: how long forward_desc polls the socket for its reply without
    sleeping (one core busy) before it blocks; default 10000, longer than a
    decode layer on the GPU: a thread asleep through a layer wakes up tens
    of microseconds late (bench/NOTES.md, 2026-12-02); 0: block at once.
    Only with a timeout (a socket without one, timeout None, blocks).
    The constructor connects at once (MoedError "conn" if it cannot); hello()
    is sent lazily by the first forward()/send_forward() if not called.
    """

    def __init__(self, path=None, timeout=30.0, sock=None, max_inflight=8, spin_us=10000):
        self.path = path or os.environ.get("MOED_SOCKET") or DEFAULT_SOCKET
        self.timeout = timeout
        self.spin_s = max(0, int(spin_us)) / 1e6
        self.max_inflight = max(1, int(max_inflight))  # chunks of a split forward in flight
        self.info = None
        self._next_id = 0
        self._pending = {}  # pipelined request id -> (T, kind)
        self._rx = b""  # bytes read ahead of a reply (by _spin_for_reply)
        self.desc_stamps = None  # forward_desc(times=True): (write begun, reply in hand), ns
        self._write_ns = 0
        if sock is not None:  # an already connected socket (tests, socketpair)
            self._sock = sock
        else:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._sock.settimeout(timeout)
                self._sock.connect(self.path)
            except OSError as e:
                self._sock.close()
                self._sock = None
                raise MoedError(E_CONN, "connect to %s: %s" % (self.path, e)) from None
        self._sock.settimeout(timeout)

    # context manager
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close the socket; pending pipelined replies are dropped."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._pending.clear()
        self._rx = b""

    @property
    def inflight(self):
        """Number of pipelined requests sent and not yet answered."""
        return len(self._pending)

    # low level ----------------------------------------------------------------
    def _fail(self, code, msg):
        self.close()
        raise MoedError(code, msg)

    def _check_open(self, blocking):
        if self._sock is None:
            raise MoedError(E_CONN, "connection is closed")
        if blocking and self._pending:
            raise MoedError(E_INVAL, "%d pipelined requests are outstanding; recv() them first"
                            % len(self._pending))

    def _send(self, msg_type, request_id, payload=b""):
        hdr = _HDR.pack(PROTO_MAGIC, frame_version(msg_type), msg_type, 0, 0, request_id,
                        len(payload))
        self._write_ns = time.monotonic_ns()  # desc_stamps: the write begins
        try:
            # header and payload in one call: the daemon wakes up once
            if self.timeout is not None and len(payload) <= RX_AHEAD:
                # a small frame straight to the (non-blocking: the socket has
                # a timeout) descriptor: no poll() first, as the socket's own
                # send does; a full socket buffer falls back to sendall
                try:
                    sent = os.write(self._sock.fileno(), b"".join((hdr, payload)))
                except (BlockingIOError, InterruptedError):
                    sent = 0
            else:
                sent = self._sock.sendmsg((hdr, payload)) if payload else self._sock.send(hdr)
            if sent < HDR_SIZE:
                self._sock.sendall(hdr[sent:])
                sent = HDR_SIZE
            if sent < HDR_SIZE + len(payload):
                self._sock.sendall(memoryview(payload)[sent - HDR_SIZE:])
        except socket.timeout:
            self._fail(E_TIMEOUT, "write to the daemon timed out after %s s" % self.timeout)
        except (BrokenPipeError, ConnectionResetError) as e:
            # The daemon closed the connection, usually after an ERROR saying
            # why (busy, peer not allowed): report that, not the bare EPIPE.
            self._raise_pending_error()
            self._fail(E_CONN, "write to the daemon: %s" % e)
        except OSError as e:
            self._fail(E_CONN, "write to the daemon: %s" % e)

    def _raise_pending_error(self):
        """Raise the daemon's ERROR if one is waiting in the receive queue."""
        try:
            self._sock.settimeout(PENDING_ERROR_WAIT_S)
            self._read_frame()
        except MoedError as e:
            if e.request_id is not None:  # an ERROR frame from the daemon
                self.close()
                raise
        except OSError:
            pass

    def _spin_for_reply(self):
        """Poll the socket without sleeping for up to spin_s, until bytes of
        a reply (or the end of the connection) are there; what arrives is
        kept in _rx for the reads that follow."""
        # read(2) on the descriptor, non-blocking since the socket has a
        # timeout (without one it is blocking: no spin then)
        if not self.spin_s or self._rx or self.timeout is None:
            return
        fd = self._sock.fileno()
        end = time.perf_counter() + self.spin_s
        while True:
            try:
                self._rx = os.read(fd, RX_AHEAD)  # b"": closed, read as such below
                return
            except (BlockingIOError, InterruptedError):
                if time.perf_counter() > end:
                    return
            except OSError:
                return  # the read below reports it

    def _recv_exact(self, n):
        if self._rx:
            if len(self._rx) >= n:
                out, self._rx = self._rx[:n], self._rx[n:]
                return out
            head, self._rx = self._rx, b""
            return head + self._recv_exact(n - len(head))
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                r = self._sock.recv_into(view[got:], n - got)
            except socket.timeout:
                self._fail(E_TIMEOUT, "no reply from the daemon within %s s" % self.timeout)
            except InterruptedError:
                continue
            except OSError as e:
                self._fail(E_CONN, "read from the daemon: %s" % e)
            if r == 0:
                self._fail(E_CONN, "the daemon closed the connection%s"
                           % (" in the middle of a reply" if got else ""))
            got += r
        return bytes(buf)

    def _reply_bound(self, mtype):
        if mtype == MSG_HELLO | REPLY:
            return HELLO_V1_BYTES + 4 + 4 * MAX_LAYERS
        if mtype == MSG_FORWARD | REPLY:
            if self.info is None:
                return None
            return 8 + 2 * self.info.max_tokens * self.info.hidden
        if mtype == MSG_STATUS | REPLY:
            return MAX_STATUS_BYTES
        if mtype == MSG_PING | REPLY:
            return MAX_PING
        if mtype == MSG_ERROR | REPLY:
            return 8 + MAX_ERRMSG
        if mtype == MSG_REGISTER_BUF | REPLY:
            return 8
        if mtype == MSG_FORWARD_DESC | REPLY:  # with times (DESC_TIMES) 24
            return _DESC_TIMES_REP.size
        if mtype in (MSG_UNREGISTER_BUF | REPLY, MSG_CHAN_CLOSE | REPLY):
            return 0
        if mtype == MSG_CHAN_OPEN | REPLY:
            return _CHAN_OPEN_REP.size + MAX_CHAN_KERNEL_BYTES
        return None

    def _read_frame(self):
        """One reply: (type, request_id, payload); ERROR replies are raised."""
        hb = self._recv_exact(HDR_SIZE)
        try:
            mtype, rid, plen = decode_header(hb)
        except MoedError as e:
            self._fail(E_PROTO, "malformed reply header: %s" % e.message)
        bound = self._reply_bound(mtype)
        if bound is None:
            self._fail(E_PROTO, "unexpected frame type 0x%04x from the daemon" % mtype)
        if plen > bound:
            self._fail(E_PROTO, "reply type 0x%04x has a %d-byte payload, over its bound %d"
                       % (mtype, plen, bound))
        payload = self._recv_exact(plen)
        if mtype == MSG_ERROR | REPLY:
            if plen < 8:
                self._fail(E_PROTO, "ERROR reply of %d bytes, shorter than its 8-byte head"
                           % plen)
            code, mlen = _ERR_REP.unpack_from(payload)
            if mlen != plen - 8:
                self._fail(E_PROTO, "ERROR reply says msg_len %d but carries %d bytes"
                           % (mlen, plen - 8))
            if code >= 0:
                code = E_PROTO
            raise MoedError(code, payload[8:].decode("utf-8", "replace"), rid)
        return mtype, rid, payload

    def _call(self, msg_type, payload=b"", spin=False, expect=None, stamps=False,
              expect_len=None):
        """One request and its reply's payload. spin: poll for the reply
        first (_spin_for_reply); expect(rid): the one reply payload that
        needs no parsing (compared as bytes, header included); expect_len:
        the length of the reply expected (its header compared as bytes, the
        payload taken as it is: one comparison instead of the frame parse);
        stamps: the request's write begun and the spin's end into
        desc_stamps (time.monotonic_ns: CLOCK_MONOTONIC, the daemon's
        clock)."""
        self._check_open(True)
        self._next_id += 1
        rid = self._next_id
        self._send(msg_type, rid, payload)
        if spin:
            self._spin_for_reply()
            if stamps:  # the reply in hand: now, or (the spin gave up) after the read below
                self.desc_stamps = (self._write_ns, time.monotonic_ns() if self._rx else None)
            if expect is not None:
                want = encode_frame(msg_type | REPLY, rid, expect)
                if self._rx[:len(want)] == want:
                    self._rx = self._rx[len(want):]
                    return expect
            elif expect_len is not None and len(self._rx) >= HDR_SIZE + expect_len:
                rx, n = self._rx, HDR_SIZE + expect_len
                if rx[:HDR_SIZE] == _HDR.pack(PROTO_MAGIC, frame_version(msg_type),
                                              msg_type | REPLY, 0, 0, rid, expect_len):
                    self._rx = rx[n:]
                    return rx[HDR_SIZE:n]
        try:
            mtype, got, reply = self._read_frame()
        except MoedError as e:
            if e.request_id not in (None, 0, rid):
                self._fail(E_PROTO, "error reply carries request id %d, expected %d"
                           % (e.request_id, rid))
            raise
        if stamps and self.desc_stamps and self.desc_stamps[1] is None:
            self.desc_stamps = (self.desc_stamps[0], time.monotonic_ns())
        if got != rid:
            self._fail(E_PROTO, "reply carries request id %d, expected %d" % (got, rid))
        if mtype != msg_type | REPLY:
            self._fail(E_PROTO, "reply type 0x%04x does not answer request type 0x%04x"
                       % (mtype, msg_type))
        return reply

    # requests -----------------------------------------------------------------
    def hello(self):
        """Negotiate version 2 (or 1 with an older daemon); returns (and caches
        in .info) a Hello with the model's dims (hidden, inter, n_experts,
        top_k, n_shared, n_layers, first_moe_layer, moe_layers: the MoE layer
        ids, a tuple), max_tokens, max_frame_bytes and backend name."""
        rep = self._call(MSG_HELLO, _HELLO_REQ.pack(PROTO_MIN_VERSION, PROTO_VERSION, 0))
        if len(rep) < HELLO_V1_BYTES:
            self._fail(E_PROTO, "HELLO reply is %d bytes, expected at least 64" % len(rep))
        f = _HELLO_REP.unpack_from(rep)
        version = f[0]
        if not PROTO_MIN_VERSION <= version <= PROTO_VERSION:
            self._fail(E_VERSION, "daemon chose protocol version %d; this client speaks %d..%d"
                       % (version, PROTO_MIN_VERSION, PROTO_VERSION))
        hidden, top_k, n_experts, max_tokens = f[2], f[5], f[4], f[9]
        if not (1 <= hidden <= 1 << 20 and 1 <= max_tokens <= 1 << 24 and
                1 <= top_k <= n_experts):
            self._fail(E_PROTO, "HELLO reply has implausible dims: hidden %d, max_tokens %d, "
                       "top_k %d, n_experts %d" % (hidden, max_tokens, top_k, n_experts))
        n_layers, first = f[7], f[8]
        if n_layers > MAX_LAYERS:
            self._fail(E_PROTO, "HELLO reply has n_layers %d, over %d" % (n_layers, MAX_LAYERS))
        if version == 1:
            if len(rep) != HELLO_V1_BYTES:
                self._fail(E_PROTO, "version-1 HELLO reply is %d bytes, expected 64" % len(rep))
            moe_layers = tuple(range(first, n_layers))
        else:
            n = struct.unpack_from("<I", rep, HELLO_V1_BYTES)[0] \
                if len(rep) >= HELLO_V1_BYTES + 4 else -1
            if n < 0 or n > MAX_LAYERS or len(rep) != HELLO_V1_BYTES + 4 + 4 * n:
                self._fail(E_PROTO, "version-2 HELLO reply of %d bytes does not hold its "
                           "layer list (n_moe_layers %d)" % (len(rep), n))
            moe_layers = struct.unpack_from("<%dI" % n, rep, HELLO_V1_BYTES + 4)
            if any(b <= a for a, b in zip(moe_layers, moe_layers[1:])) or \
                    any(l >= n_layers for l in moe_layers):
                self._fail(E_PROTO, "HELLO layer list %s is not ascending ids < %d"
                           % (moe_layers[:8], n_layers))
        self.info = Hello(version=version, hidden=f[2], inter=f[3], n_experts=f[4], top_k=f[5],
                          n_shared=f[6], n_layers=n_layers, first_moe_layer=first,
                          max_tokens=f[9], max_frame_bytes=f[11],
                          backend=f[12].split(b"\0", 1)[0].decode("ascii", "replace"),
                          moe_layers=tuple(moe_layers))
        return self.info

    def status(self):
        """The daemon's status JSON, parsed into a dict."""
        import json
        return json.loads(self._call(MSG_STATUS).decode("utf-8"))

    def ping(self, payload=None):
        """Round-trip a PING; returns the round-trip time in seconds."""
        payload = payload if payload is not None else struct.pack("<Q", time.monotonic_ns())
        if len(payload) > MAX_PING:
            raise MoedError(E_INVAL, "ping payload is %d bytes, over %d" % (len(payload),
                                                                             MAX_PING))
        t0 = time.perf_counter()
        rep = self._call(MSG_PING, payload)
        dt = time.perf_counter() - t0
        if rep != bytes(payload):
            self._fail(E_PROTO, "PING reply does not echo its payload")
        return dt

    # version 2: registered buffers ---------------------------------------------
    def _v2(self):
        if self.info is None:
            self.hello()
        if self.info.version < 2:
            raise MoedError(-17, "the daemon speaks protocol version %d; registered buffers "
                            "need 2" % self.info.version)

    def register_buf(self, handle, offset, size, uuid):
        """REGISTER_BUF: a range [offset, offset + size) of the allocation whose
        64-byte CUDA IPC handle is `handle`, on the GPU with the 16-byte `uuid`.
        Returns the buffer id (this connection's). The daemon checks it all
        (MoedError: inval, range, busy, unsupported, io) before it maps it."""
        self._v2()
        handle, uuid = bytes(handle), bytes(uuid)
        if len(handle) != 64 or len(uuid) != 16:
            raise MoedError(E_INVAL, "handle must be 64 bytes and uuid 16 (got %d, %d)"
                            % (len(handle), len(uuid)))
        rep = self._call(MSG_REGISTER_BUF, _REG_REQ.pack(handle, offset, size, uuid))
        if len(rep) != 8:
            self._fail(E_PROTO, "REGISTER_BUF reply is %d bytes, expected 8" % len(rep))
        return _REG_REP.unpack(rep)[0]

    def unregister_buf(self, buf_id):
        """UNREGISTER_BUF: the id is gone at once; the mapping stays until the
        last request using it has completed."""
        self._v2()
        self._call(MSG_UNREGISTER_BUF, _REG_REP.pack(buf_id, 0))

    def forward_desc(self, layer, n_tokens, x, ids, w, y, top_k=None, times=False):
        """FORWARD_DESC: one MoE layer on registered buffers; x, ids, w, y are
        (buf_id, offset) pairs (x bf16 [T, H], ids int32 [T, k], w fp32 [T, k],
        y bf16 [T, H] written by the daemon). Returns when y is written: None,
        or with times (flag DESC_TIMES, for benchmarks) the request's
        (kernel_ns, daemon_ns, rx_ns, queued_ns): its batch's kernel time (0:
        not measured), its time in the daemon (the frame's first byte read to
        the reply queued) and those two instants on the daemon's
        CLOCK_MONOTONIC; desc_stamps then holds the time.monotonic_ns()
        instants (the same clock on the same host) at which the request's
        write began and the reply's first bytes were in hand."""
        self._v2()
        k = self.info.top_k if top_k is None else top_k
        req = _DESC_REQ.pack(layer, n_tokens, k, DESC_TIMES if times else 0, x[0], 0, x[1],
                             ids[0], 0, ids[1], w[0], 0, w[1], y[0], 0, y[1])
        if times:
            rep = self._call(MSG_FORWARD_DESC, req, spin=True, stamps=True,
                             expect_len=_DESC_TIMES_REP.size)
            f = _DESC_TIMES_REP.unpack(rep) if len(rep) == _DESC_TIMES_REP.size else None
            if f is None or f[0] != n_tokens:
                self._fail(E_PROTO, "FORWARD_DESC reply with times is %d bytes or does not "
                           "echo T=%d" % (len(rep), n_tokens))
            return f[2:]
        rep = self._call(MSG_FORWARD_DESC, req, spin=True,
                         expect=_FWD_REP.pack(n_tokens, self.info.hidden))
        if len(rep) != 8 or _FWD_REP.unpack(rep)[0] != n_tokens:
            self._fail(E_PROTO, "FORWARD_DESC reply does not echo T=%d" % n_tokens)
        return None

    def chan_open(self, buf_ids, uuid, arena_bytes=0):
        """CHAN_OPEN: a GPU doorbell channel for kernels on the GPU with the
        16-byte `uuid`, whose descriptors name an arena of `arena_bytes` (0:
        none; daemon memory in the channel's own mapping, buffer 0) and the
        registered buffers `buf_ids` (ids of this connection: without an
        arena 1..16, buffer i is buf_ids[i]; with one 0..15, buffer i + 1).
        Returns a ChanInfo. Most callers want moed_client.cuda.Channel, which
        also maps and drives the channel."""
        self._v2()
        buf_ids, uuid, arena_bytes = [int(b) for b in buf_ids], bytes(uuid), int(arena_bytes)
        lo, hi = (0, CHAN_BUFS - 1) if arena_bytes else (1, CHAN_BUFS)
        if not lo <= len(buf_ids) <= hi or len(uuid) != 16 or \
                any(not 0 < b < 1 << 32 for b in buf_ids) or not 0 <= arena_bytes < 1 << 64:
            raise MoedError(E_INVAL, "chan_open needs %d..%d buffer ids (non-zero u32)%s, a "
                            "16-byte uuid and arena_bytes a u64 (got %d ids, %d bytes, "
                            "arena_bytes %d)" % (lo, hi, " besides the arena" if arena_bytes
                                                 else "", len(buf_ids), len(uuid),
                                                 arena_bytes))
        req = _CHAN_OPEN_REQ.pack(uuid, len(buf_ids), 0,
                                  *(buf_ids + [0] * (CHAN_BUFS - len(buf_ids))), arena_bytes)
        # without an arena the 88-byte form
        rep = self._call(MSG_CHAN_OPEN, req if arena_bytes else req[:88])
        if len(rep) < _CHAN_OPEN_REP.size:
            self._fail(E_PROTO, "CHAN_OPEN reply is %d bytes, shorter than its head" % len(rep))
        cid, slots, key, handle, size, abi, kbytes, a_off, a_bytes = \
            _CHAN_OPEN_REP.unpack_from(rep)
        for bad, why in ((cid == 0, "chan_id 0"),
                         (kbytes == 0 or len(rep) != _CHAN_OPEN_REP.size + kbytes,
                          "a %d-byte fatbin in %d bytes"
                          % (kbytes, len(rep) - _CHAN_OPEN_REP.size)),
                         (slots != CHAN_SLOTS, "slots %d, expected %d" % (slots, CHAN_SLOTS)),
                         (size < CHAN_STRUCT_BYTES, "size %d, under %d"
                          % (size, CHAN_STRUCT_BYTES)),
                         (a_bytes != arena_bytes, "an arena of %d bytes for the %d asked"
                          % (a_bytes, arena_bytes)),
                         ((a_off < size or a_off % CHAN_ARENA_OFF) if a_bytes else a_off,
                          "arena_off %d for arena_bytes %d (an arena lies 4096-aligned past "
                          "the channel; none has offset 0)" % (a_off, a_bytes))):
            if bad:
                self._fail(E_PROTO, "malformed CHAN_OPEN reply: " + why)
        if abi != GPU_ABI_VERSION:  # the daemon is fine; this client cannot drive it
            self.chan_close(cid)
            raise MoedError(E_VERSION, "the daemon's channel ABI is version %d; this client "
                            "knows %d" % (abi, GPU_ABI_VERSION))
        return ChanInfo(chan_id=cid, slots=slots, key=key, handle=handle, size=size,
                        abi_version=abi, arena_off=a_off, arena_bytes=a_bytes,
                        kernel=rep[_CHAN_OPEN_REP.size:])

    def chan_close(self, chan_id):
        """CHAN_CLOSE: the channel ends (its buffers can be unregistered
        again); a call rung after this is not answered."""
        self._v2()
        self._call(MSG_CHAN_CLOSE, _CHAN_CLOSE_REQ.pack(chan_id, 0))

    def _encode_forward(self, layer, hidden_states, topk_ids, topk_weights, flags=0):
        if self.info is None:
            self.hello()
        x_raw, t, h, kind = _hidden_to_wire(hidden_states)
        ids_raw, ti, k = _routing_to_wire(topk_ids, "i", "topk_ids")
        w_raw, tw, kw = _routing_to_wire(topk_weights, "f", "topk_weights")
        if t is None:  # raw bytes: T from the routing arrays
            t, h = ti, self.info.hidden
            if len(x_raw) != 2 * t * h:
                raise ValueError("hidden_states is %d bytes, need T*H*2 = %d"
                                 % (len(x_raw), 2 * t * h))
        if h != self.info.hidden:
            raise ValueError("hidden_states has H=%d, the model's hidden size is %d"
                             % (h, self.info.hidden))
        if t == 0 and ti == tw == 0:  # [0, k] routing may come as [0, anything]
            k = kw = self.info.top_k
        if (ti, k) != (t, kw) or tw != t:
            raise ValueError("topk_ids %s and topk_weights %s must both be [T=%d, k]"
                             % ((ti, k), (tw, kw), t))
        if not 0 <= t <= self.info.max_tokens:
            raise MoedError(E_INVAL, "n_tokens %d is out of range [0, %d]"
                            % (t, self.info.max_tokens))
        if flags and self.info.version < 2:
            raise MoedError(E_VERSION, "forward flags 0x%x need protocol version 2; the "
                            "daemon speaks version %d" % (flags, self.info.version))
        payload = encode_forward(layer, x_raw, t, ids_raw, w_raw, k, flags)
        if len(payload) > self.info.max_frame_bytes:
            raise MoedError(E_TOOBIG, "FORWARD payload of %d bytes is over the daemon's max "
                            "frame %d" % (len(payload), self.info.max_frame_bytes))
        return payload, t, kind

    def _decode_forward(self, payload, t_expected, kind):
        if len(payload) < 8:
            self._fail(E_PROTO, "FORWARD reply of %d bytes, shorter than its head"
                       % len(payload))
        t, h = _FWD_REP.unpack_from(payload)
        if h != self.info.hidden or t != t_expected or len(payload) != 8 + 2 * t * h:
            self._fail(E_PROTO, "FORWARD reply says T=%d, H=%d in %d bytes; expected T=%s, "
                       "H=%d" % (t, h, len(payload), t_expected, self.info.hidden))
        return _wire_to_hidden(payload[8:], t, h, kind)

    def _n_tokens(self, hidden_states, topk_ids):
        if isinstance(hidden_states, (bytes, bytearray, memoryview)):
            return len(topk_ids)
        return int(hidden_states.shape[0])

    def forward(self, layer, hidden_states, topk_ids, topk_weights, *, routed_only=False,
                empty_slots=False):
        """One MoE layer: y[T, H] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) (+ shared).

        layer: absolute layer id (an MoE layer of the model); hidden_states
        [T, H]; topk_ids [T, k] (int32 on the wire); topk_weights [T, k] (fp32,
        final: any routed scaling already applied). routed_only: leave out the
        daemon's shared experts (FORWARD flag 0x1); empty_slots: an id of -1
        is an empty slot that adds nothing (flag 0x2; expert parallelism's
        non-local experts). T = 0 gives an empty [0, H] result; T over the
        daemon's max_tokens is split into pipelined chunks. Returns y in the
        kind of hidden_states (see the module docstring). Raises MoedError.
        """
        self._check_open(True)
        if self.info is None:
            self.hello()
        flags = _forward_flags(routed_only, empty_slots)
        T, mt = self._n_tokens(hidden_states, topk_ids), self.info.max_tokens
        if T == 0 and self.info.version < 2:
            # a version-1 daemon refuses T = 0: the empty result, shapes checked here
            kind = self._encode_forward(layer, hidden_states, topk_ids, topk_weights)[2]
            return _wire_to_hidden(b"", 0, self.info.hidden, kind)
        if T > mt:
            if len(topk_ids) != T or len(topk_weights) != T:
                raise ValueError("topk_ids and topk_weights have %d and %d rows; hidden_states "
                                 "has T=%d" % (len(topk_ids), len(topk_weights), T))
            bounds = [(t0, min(t0 + mt, T)) for t0 in range(0, T, mt)]
            chunks = [(_rows(hidden_states, a, b), _rows(topk_ids, a, b),
                       _rows(topk_weights, a, b)) for a, b in bounds]
            return self._forward_pipelined(layer, chunks, flags)
        payload, t, kind = self._encode_forward(layer, hidden_states, topk_ids, topk_weights,
                                                flags)
        rep = self._call(MSG_FORWARD, payload)
        return self._decode_forward(rep, t, kind)

    def _forward_pipelined(self, layer, chunks, flags):
        """Send the chunks' FORWARDs, at most max_inflight unanswered, reading
        replies whenever the daemon has one (also while a large request is
        still being written: the daemon stops reading a client whose replies
        pile up, so a writer that never reads could stall both); returns the
        outputs concatenated in chunk order."""
        out, pending, kind0 = [None] * len(chunks), {}, None
        base = self._next_id
        self._next_id += len(chunks)
        sent = 0
        try:
            while sent < len(chunks) or pending:
                if sent < len(chunks) and len(pending) < self.max_inflight:
                    x, ids, w = chunks[sent]
                    payload, t, kind = self._encode_forward(layer, x, ids, w, flags)
                    kind0 = kind0 or kind
                    rid = base + 1 + sent
                    pending[rid] = (sent, t, kind)
                    self._send_reading(MSG_FORWARD, rid, payload, pending, out)
                    sent += 1
                else:
                    self._recv_chunk(pending, out)
        except BaseException:
            # replies of chunks already sent would be read by the next call
            if pending:
                self.close()
            raise
        return _concat(out, kind0)

    def _recv_chunk(self, pending, out):
        mtype, rid, payload = self._read_frame()
        if mtype != MSG_FORWARD | REPLY or rid not in pending:
            self._fail(E_PROTO, "reply type 0x%04x id %d does not answer a FORWARD in flight"
                       % (mtype, rid))
        i, t, kind = pending.pop(rid)
        out[i] = self._decode_forward(payload, t, kind)

    def _send_reading(self, msg_type, rid, payload, pending, out):
        """Write one frame; whenever the socket has a reply to read meanwhile,
        read it (into out)."""
        data = memoryview(_HDR.pack(PROTO_MAGIC, frame_version(msg_type), msg_type, 0, 0, rid,
                                    len(payload)) + payload)
        while data:
            try:
                r, w, _ = select.select([self._sock], [self._sock], [], self.timeout)
            except (OSError, ValueError) as e:
                self._fail(E_CONN, "select on the daemon's socket: %s" % e)
            r = r or self._rx  # bytes read ahead count as readable
            if not r and not w:
                self._fail(E_TIMEOUT, "write to the daemon timed out after %s s" % self.timeout)
            if r and len(pending) > 1:  # a reply to an earlier request
                self._recv_chunk(pending, out)
                continue
            if w:
                try:
                    n = self._sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError) as e:
                    self._raise_pending_error()
                    self._fail(E_CONN, "write to the daemon: %s" % e)
                except OSError as e:
                    self._fail(E_CONN, "write to the daemon: %s" % e)
                data = data[n:]
            elif r:  # readable with only this request in flight: an ERROR, or EOF
                self._raise_pending_error()
                self._fail(E_CONN, "the daemon answered before the request was written")

    def send_forward(self, request_id, layer, hidden_states, topk_ids, topk_weights, *,
                     routed_only=False, empty_slots=False):
        """Pipelined FORWARD: send and return at once. Collect the reply with
        recv(). request_id (u64) is chosen by the caller, unique among the
        requests in flight. At most max_tokens tokens (no splitting here)."""
        self._check_open(False)
        if request_id in self._pending:
            raise MoedError(E_INVAL, "request id %d is already in flight" % request_id)
        payload, t, kind = self._encode_forward(layer, hidden_states, topk_ids, topk_weights,
                                                _forward_flags(routed_only, empty_slots))
        self._send(MSG_FORWARD, request_id, payload)
        self._pending[request_id] = (t, kind)

    def recv(self):
        """Next pipelined reply, in whatever order the daemon answers:
        returns (request_id, y). An error reply for one request raises
        MoedError with that request_id (the connection stays usable)."""
        self._check_open(False)
        if not self._pending:
            raise MoedError(E_INVAL, "recv: no request is in flight")
        try:
            mtype, rid, payload = self._read_frame()
        except MoedError as e:
            if e.request_id:
                self._pending.pop(e.request_id, None)
            raise
        if mtype != MSG_FORWARD | REPLY or rid not in self._pending:
            self._fail(E_PROTO, "reply type 0x%04x id %d does not answer a FORWARD in flight"
                       % (mtype, rid))
        t, kind = self._pending.pop(rid)
        return rid, self._decode_forward(payload, t, kind)


# --- drop-in for a serving framework's fused MoE call ------------------------

_local = threading.local()


def _default_client():
    c = getattr(_local, "client", None)
    if c is None or c._sock is None:
        c = Client()
        _local.client = c
    return c


def fused_experts(hidden_states, topk_weights, topk_ids, layer, client=None, *,
                  routed_only=False, empty_slots=False):
    """Run one MoE layer in moed in place of a framework's fused-experts kernel.

    The argument order follows SGLang's fused-experts call (hidden_states,
    then the router's topk_weights and topk_ids); ``layer`` is the absolute
    layer id (SGLang's ``layer.layer_id`` / ``moe_runner_config.layer_id``).
    Returns the combined expert output [T, H] with hidden_states' dtype and
    device. topk_weights must be final: multiply in routed_scaling_factor
    first if the framework applies it inside its kernel. ``client`` defaults
    to one Client per thread on $MOED_SOCKET (or /tmp/moed.sock).

    Serving frameworks: the SGLang and vLLM plugins of this package
    (moed_client.sglang_plugin, moed_client.vllm_plugin; on when MOED_SOCKET
    is set) call this for every ModelOpt NVFP4 MoE layer and keep the expert
    weights off the serving GPUs: docs/SGLANG.md, docs/VLLM.md. This inline
    path copies the activations to the host and makes a socket round trip
    per layer, so it is not CUDA-graph safe (run the framework with CUDA
    graphs off); registered GPU buffers (Client.register_buf, forward_desc,
    moed_client.cuda) avoid the copies: docs/ZERO_COPY.md.

    routed_only / empty_slots: see Client.forward (the plugins set them from
    the framework's shared-expert fusion and expert-parallel maps).
    """
    c = client if client is not None else _default_client()
    return c.forward(layer, hidden_states, topk_ids, topk_weights, routed_only=routed_only,
                     empty_slots=empty_slots)
