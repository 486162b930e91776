"""Doorbell channel pieces that need no GPU: the descriptor's byte layout
(struct moe_gpu_chan_desc, kernels/moe_gpu_abi.h), the status codes and their
names, the error a failed call raises, and the host-side lookup of a tensor's
(table index, offset) by address. moed_client.cuda drives them; the CPU tests
(tests/py/test_client_chan.py) check them."""

import struct

from . import MoedError, CHAN_BUFS, CHAN_SLOTS, E_CONN, E_INVAL, E_TIMEOUT

# enum moe_gpu_chan_status: the low 8 bits of a status word (seq << 8 | code)
CHAN_STATUS = {
    0: "OK", 1: "TOKENS", 2: "LAYER", 3: "BUF", 4: "RANGE", 5: "ALIGN", 6: "OVERLAP",
    7: "EXPERT", 8: "SEQ", 9: "KEY", 10: "FLAGS", 11: "TIMEOUT", 12: "CLOSED",
}
CHAN_OK, CHAN_E_TIMEOUT, CHAN_E_CLOSED = 0, 11, 12
CHAN_ROUTED_ONLY = 0x1  # MOE_GPU_CHAN_ROUTED_ONLY (the FORWARD flags)
CHAN_EMPTY_SLOTS = 0x2  # MOE_GPU_CHAN_EMPTY_SLOTS
_CHAN_FLAGS = CHAN_ROUTED_ONLY | CHAN_EMPTY_SLOTS

# layer u32, n_tokens u32, seq u64, key u64, flags u32, pad u32, then x, ids, w, y as
# (buf u32, pad u32, off u64)
DESC = struct.Struct("<IIQQII" + "IIQ" * 4)
assert DESC.size == 96
# struct moe_gpu_chan: bell, closed, pad[6], done, pad[7], status[SLOTS], slot[SLOTS]
CHAN_HEAD = struct.Struct("<QQ48xQ56x%dQ" % CHAN_SLOTS)
assert CHAN_HEAD.size == 128 + 8 * CHAN_SLOTS
# then stamp[SLOTS][4] u64 (%globaltimer ns: rang, taken, answered, seen)
STAMPS_OFF = CHAN_HEAD.size + DESC.size * CHAN_SLOTS
STAMPS = struct.Struct("<%dQ" % (4 * CHAN_SLOTS))


def status_name(code):
    """'MOE_GPU_CHAN_E_RANGE' for 4, 'MOE_GPU_CHAN_OK' for 0."""
    n = CHAN_STATUS.get(code)
    if n is None:
        return "unknown status %d" % code
    return "MOE_GPU_CHAN_" + ("OK" if code == 0 else "E_" + n)


class ChannelError(MoedError):
    """A doorbell call that was not answered OK: the first such status word
    the channel's err word kept. status: the MOE_GPU_CHAN_E_* code; status_name
    its name; seq: the sequence number of the call it answered; chan_id.
    code is MOED_E_TIMEOUT for a call that got no answer in time,
    MOED_E_CONN for one the daemon closed the channel under (CHAN_CLOSE, the
    connection's close, its shutdown or failure), MOED_E_INVAL for a
    descriptor the daemon's kernel refused."""

    def __init__(self, word, chan_id=0):
        self.word, self.chan_id = int(word), chan_id
        self.status, self.seq = self.word & 0xFF, self.word >> 8
        self.status_name = status_name(self.status)
        code = {CHAN_E_TIMEOUT: E_TIMEOUT, CHAN_E_CLOSED: E_CONN}.get(self.status, E_INVAL)
        super().__init__(code,
                         "doorbell channel %d: call seq %d answered %s"
                         % (chan_id, self.seq, self.status_name))


def pack_desc(buf, layer, n_tokens, key, flags, refs):
    """Write a descriptor into buf (96 writable bytes, e.g. a ctypes array):
    refs = ((index, offset) of x, ids, w, y); seq 0 (the client kernel sets
    it from the bell)."""
    (xi, xo), (ii, io), (wi, wo), (yi, yo) = refs
    DESC.pack_into(buf, 0, layer, n_tokens, 0, key, flags, 0, xi, 0, xo, ii, 0, io, wi, 0, wo,
                   yi, 0, yo)


def call_flags(routed_only=False, empty_slots=False):
    return (CHAN_ROUTED_ONLY if routed_only else 0) | (CHAN_EMPTY_SLOTS if empty_slots else 0)


class RangeTable:
    """The channel's buffers as the client sees them: index i is the range
    [base, base + size) of its process's address space that buffer i of the
    channel is: with an arena, 0 is the arena as mapped here and i + 1 what
    CHAN_OPEN's buf_ids[i] registered; without, i is buf_ids[i]."""

    def __init__(self, ranges):
        if not 1 <= len(ranges) <= CHAN_BUFS:
            raise MoedError(E_INVAL, "a channel names 1..%d buffers, got %d"
                            % (CHAN_BUFS, len(ranges)))
        self.ranges = tuple((int(b), int(s)) for b, s in ranges)

    def find(self, ptr, nbytes, what="tensor"):
        """(index, offset) of the registered range that holds [ptr, ptr +
        nbytes); the first one that does. ValueError if none does."""
        for i, (base, size) in enumerate(self.ranges):
            if base <= ptr and ptr + nbytes <= base + size:
                return i, ptr - base
        raise ValueError("%s at 0x%x (%d bytes) lies in none of the channel's %d registered "
                         "buffers" % (what, ptr, nbytes, len(self.ranges)))


def check_flags(flags):
    if flags & ~_CHAN_FLAGS:
        raise ValueError("unknown doorbell flags 0x%x (known: 0x%x)" % (flags, _CHAN_FLAGS))
