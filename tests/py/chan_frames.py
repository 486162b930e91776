"""Raw CHAN_OPEN / CHAN_CLOSE frames for the daemon tests (PROTOCOL.md
section 10), packed with struct from the byte layouts; the constants mirror
ipc/moed_proto.h and kernels/moe_gpu_abi.h (test_constants.py checks them).
The Python client package gains its own channel calls separately; these
helpers are the tests' independent copy of the wire format."""
import struct

import daemon_util as du

MSG_CHAN_OPEN = 19
MSG_CHAN_CLOSE = 20
CHAN_BUFS = 16              # MOED_PROTO_CHAN_BUFS
OPEN_REQ_BYTES = 96         # struct moed_chan_open_req (with arena_bytes)
OPEN_REQ_SHORT = 88         # MOED_PROTO_CHAN_OPEN_SHORT: the form without arena_bytes
OPEN_REP_BYTES = 112        # struct moed_chan_open_rep (the head)
ARENA_OFF = 4096            # MOED_PROTO_CHAN_ARENA_OFF, MOE_GPU_CHAN_ARENA_OFF
CLOSE_REQ_BYTES = 8         # struct moed_chan_close_req
MAX_CHAN_KERNEL = 16 << 20  # MOED_PROTO_MAX_CHAN_KERNEL
CHAN_SLOTS = 8              # MOE_GPU_CHAN_SLOTS
# struct moe_gpu_chan: bell + 7 pad, done + 7 pad, status[8], slot[8] of 96 bytes,
# stamp[8][4] u64
CHAN_BYTES = 8 * 8 + 8 * 8 + 8 * CHAN_SLOTS + 96 * CHAN_SLOTS + 32 * CHAN_SLOTS

OPEN_REP = struct.Struct("<IIQ64sQIIQQ")
assert OPEN_REP.size == OPEN_REP_BYTES


def open_payload(uuid, ids, n_bufs=None, flags=0, arena_bytes=None):
    """CHAN_OPEN payload: uuid, n_bufs (default len(ids)), flags, 16 ids
    (ids padded with 0; a longer list is packed as given, for bad input),
    then arena_bytes as a u64 if given (the 96-byte form; None: 88 bytes)."""
    ids = list(ids) + [0] * (CHAN_BUFS - len(ids))
    n = len([i for i in ids if i]) if n_bufs is None else n_bufs
    p = struct.pack("<16sII%dI" % len(ids), uuid, n, flags, *ids)
    return p if arena_bytes is None else p + struct.pack("<Q", arena_bytes)


def close_payload(chan_id, reserved=0):
    return struct.pack("<II", chan_id, reserved)


def parse_open_reply(p):
    """-> dict of the reply head, and the kernel bytes after it."""
    chan_id, slots, key, handle, size, abi, kbytes, arena_off, arena_bytes = \
        OPEN_REP.unpack_from(p)
    assert len(p) == OPEN_REP_BYTES + kbytes, (len(p), kbytes)
    return dict(chan_id=chan_id, slots=slots, key=key, handle=handle, size=size,
                abi_version=abi, arena_off=arena_off, arena_bytes=arena_bytes,
                kernel=p[OPEN_REP_BYTES:])


class Raw:
    """A raw version-2 connection: HELLO, REGISTER_BUF, CHAN_OPEN, CHAN_CLOSE
    as frames; each call returns (reply type, payload)."""

    def __init__(self, daemon):
        self.s = daemon.connect()
        self.rid = 100
        du.hello(self.s)

    def call(self, mtype, payload, version=2):
        self.rid += 1
        self.s.sendall(du.frame(mtype, self.rid, payload, version=version))
        t, rid, p = du.read_frame(self.s)
        assert rid == self.rid, (rid, self.rid)
        return t, p

    def expect_error(self, mtype, payload, code, text, version=2):
        self.rid += 1
        self.s.sendall(du.frame(mtype, self.rid, payload, version=version))
        return du.expect_error(self.s, du.E[code], text, rid=self.rid)

    def register(self, handle, off, size, uuid):
        t, p = self.call(du.MSG_REGISTER_BUF, struct.pack("<64sQQ16s", handle, off, size, uuid))
        assert t == du.MSG_REGISTER_BUF | du.REPLY, du.parse_error(p)
        return struct.unpack("<II", p)[0]

    def unregister(self, buf_id):
        return self.call(du.MSG_UNREGISTER_BUF, struct.pack("<II", buf_id, 0))

    def chan_open(self, uuid, ids, **kw):
        t, p = self.call(MSG_CHAN_OPEN, open_payload(uuid, ids, **kw))
        assert t == MSG_CHAN_OPEN | du.REPLY, du.parse_error(p)
        return parse_open_reply(p)

    def chan_close(self, chan_id):
        t, p = self.call(MSG_CHAN_CLOSE, close_payload(chan_id))
        assert t == MSG_CHAN_CLOSE | du.REPLY and p == b"", (t, p)

    def ping(self):
        t, p = self.call(du.MSG_PING, b"12345678", version=1)
        assert t == du.MSG_PING | du.REPLY and p == b"12345678"

    def close(self):
        self.s.close()
