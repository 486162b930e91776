"""The Python client's doorbell channel pieces without a GPU: CHAN_OPEN /
CHAN_CLOSE frames against a fake daemon (request bytes read at the offsets of
ipc/moed_proto.h by hand, replies built by hand), the descriptor packing, the
lookup of a tensor's (table index, offset) by address, the status names and
the error a failed call raises. The ctypes driver layer is checked only where
libcuda.so.1 loads (it is skipped otherwise); the GPU path itself is
tests/gpu/test_doorbell.py."""
import ctypes
import os
import struct
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "ipc", "python"))  # test the tree, not an old install

import moed_client as mc  # noqa: E402
from moed_client import _chan  # noqa: E402

pytest.importorskip("numpy")  # test_pyclient_unit's fake daemon uses it
from test_pyclient_unit import FakeDaemon, H, INTER, E, K, MAX_T, hdr, error_frame  # noqa: E402

UUID = bytes(range(16))
FATBIN = b"\x50\xed\x55\xba" + bytes(range(200))


def u32(b, o):
    return int.from_bytes(b[o:o + 4], "little")


def u64(b, o):
    return int.from_bytes(b[o:o + 8], "little")


def hello_v2(rid):
    rep = struct.pack("<HHIIIIIIIIIQ16s", 2, 0, H, INTER, E, K, 1, 4, 1, MAX_T, 0, 1 << 20,
                      b"cuda") + struct.pack("<4I", 3, 1, 2, 3)
    return hdr(0x8001, rid, len(rep)) + rep


def chan_rep(rid, chan_id=5, slots=8, key=0x1122334455667788, size=mc.CHAN_STRUCT_BYTES, abi=mc.GPU_ABI_VERSION, kernel=FATBIN,
             kernel_bytes=None, arena_off=0, arena_bytes=0):
    head = (chan_id.to_bytes(4, "little") + slots.to_bytes(4, "little") +
            key.to_bytes(8, "little") + bytes(range(100, 164)) + size.to_bytes(8, "little") +
            abi.to_bytes(4, "little") +
            (len(kernel) if kernel_bytes is None else kernel_bytes).to_bytes(4, "little") +
            arena_off.to_bytes(8, "little") + arena_bytes.to_bytes(8, "little"))
    assert len(head) == 112
    return hdr(0x8013, rid, 112 + len(kernel)) + head + kernel


def arena_rep(rid, p, **kw):
    """A reply with the arena the request asked for (its u64 at 88, if any)."""
    n = u64(p, 88) if len(p) == 96 else 0
    return chan_rep(rid, arena_off=4096 if n else 0, arena_bytes=n, **kw)


def v2_daemon(chan_reply=arena_rep):
    """HELLO answers version 2; CHAN_OPEN chan_reply(rid, payload); CHAN_CLOSE
    empty."""
    def script(conn, mtype, rid, p):
        if mtype == 1:
            conn.sendall(hello_v2(rid))
        elif mtype == 19:
            conn.sendall(chan_reply(rid, p))
        elif mtype == 20:
            conn.sendall(hdr(0x8014, rid, 0))
        else:
            return False
        return True
    return FakeDaemon(script=script)


@pytest.fixture
def d2():
    d = v2_daemon()
    yield d
    d.close()


def frames_of(d, mtype):
    return [f for f in d.seen if int.from_bytes(f[6:8], "little") == mtype]


def test_chan_open_request_and_reply_layout(d2):
    with mc.Client(d2.path, timeout=5) as c:
        ci = c.chan_open([7, 9, 11], UUID)
        assert (ci.chan_id, ci.slots, ci.key, ci.size, ci.abi_version) == \
            (5, 8, 0x1122334455667788, mc.CHAN_STRUCT_BYTES, mc.GPU_ABI_VERSION)
        assert ci.handle == bytes(range(100, 164)) and ci.kernel == FATBIN
        c.chan_close(ci.chan_id)
        assert c.ping() >= 0
    (f,) = frames_of(d2, 19)
    assert u32(f, 4) & 0xFFFF == 2 and u64(f, 24) == 88  # a version-2 frame of 88 bytes
    p = f[32:]
    assert p[:16] == UUID and u32(p, 16) == 3 and u32(p, 20) == 0
    assert [u32(p, 24 + 4 * i) for i in range(16)] == [7, 9, 11] + [0] * 13
    (f,) = frames_of(d2, 20)
    assert u32(f, 4) & 0xFFFF == 2 and u64(f, 24) == 8
    assert u32(f, 32) == 5 and u32(f, 36) == 0
    assert (ci.arena_off, ci.arena_bytes) == (0, 0)


@pytest.mark.parametrize("ids", [[], [7], list(range(1, 16))])
def test_chan_open_with_an_arena(d2, ids):
    """arena_bytes: the 96-byte form (the u64 at 88), with 0..15 ids; the
    reply's arena_off and arena_bytes come back in the ChanInfo."""
    with mc.Client(d2.path, timeout=5) as c:
        ci = c.chan_open(ids, UUID, arena_bytes=0x123456789)
        assert (ci.arena_off, ci.arena_bytes) == (4096, 0x123456789)
        assert "arena=4886718345 bytes at 4096" in repr(ci)
    (f,) = frames_of(d2, 19)
    assert u64(f, 24) == 96
    p = f[32:]
    assert u32(p, 16) == len(ids) and u32(p, 20) == 0
    assert [u32(p, 24 + 4 * i) for i in range(16)] == ids + [0] * (16 - len(ids))
    assert u64(p, 88) == 0x123456789

@pytest.mark.parametrize("ids,uuid,arena", [
    ([], UUID, 0), (list(range(1, 18)), UUID, 0), ([1, 0], UUID, 0), ([1 << 32], UUID, 0),
    ([1], b"short", 0),
    (list(range(1, 17)), UUID, 64),  # the arena and 16 ids: 17 buffers
    ([1], UUID, -1), ([1], UUID, 1 << 64)])
def test_chan_open_bad_arguments_send_nothing(d2, ids, uuid, arena):
    with mc.Client(d2.path, timeout=5) as c:
        c.hello()
        n = len(d2.seen)
        with pytest.raises(mc.MoedError) as e:
            c.chan_open(ids, uuid, arena)
        assert e.value.name == "inval" and e.value.request_id is None
        assert len(d2.seen) == n
        assert c.ping() >= 0


@pytest.mark.parametrize("kw,match", [
    (dict(chan_id=0), "chan_id 0"),
    (dict(kernel=b""), "a 0-byte fatbin"),
    (dict(kernel_bytes=len(FATBIN) + 1), "fatbin in"),
    (dict(slots=4), "slots 4, expected 8"),
    (dict(size=64), "size 64, under %d" % mc.CHAN_STRUCT_BYTES),
    # the arena: as asked (64 bytes here), 4096-aligned past the ring, none at 0
    (dict(arena_off=4096, arena_bytes=128), "an arena of 128 bytes for the 64 asked"),
    (dict(arena_off=4096 + 16, arena_bytes=64), "arena_off 4112 for arena_bytes 64"),
    (dict(arena_off=0, arena_bytes=64), "arena_off 0 for arena_bytes 64"),
    (dict(arena_off=4096, arena_bytes=0, arena=0), "arena_off 4096 for arena_bytes 0"),
    (dict(arena_off=0, arena_bytes=0), "an arena of 0 bytes for the 64 asked"),
])
def test_malformed_chan_open_reply_closes_the_client(kw, match):
    arena = kw.pop("arena", 64)
    d = v2_daemon(lambda rid, p: chan_rep(rid, **kw))
    try:
        c = mc.Client(d.path, timeout=5)
        with pytest.raises(mc.MoedError, match=match) as e:
            c.chan_open([1], UUID, arena)
        assert e.value.name == "proto"
        with pytest.raises(mc.MoedError, match="closed"):
            c.ping()
    finally:
        d.close()


def test_chan_open_reply_over_the_fatbin_bound_is_refused():
    d = v2_daemon(lambda rid, p: hdr(0x8013, rid, 112 + mc.MAX_CHAN_KERNEL_BYTES + 1))
    try:
        with pytest.raises(mc.MoedError, match="over its bound"):
            mc.Client(d.path, timeout=5).chan_open([1], UUID)
    finally:
        d.close()


def test_chan_open_other_abi_is_closed_again():
    """A channel of an ABI this client cannot drive: closed at once, a typed
    error, the connection still usable."""
    d = v2_daemon(lambda rid, p: chan_rep(rid, chan_id=3, abi=mc.GPU_ABI_VERSION + 1))
    try:
        with mc.Client(d.path, timeout=5) as c:
            with pytest.raises(mc.MoedError, match="ABI is version %d" % (mc.GPU_ABI_VERSION + 1)) as e:
                c.chan_open([1], UUID)
            assert e.value.name == "version"
            (f,) = frames_of(d, 20)
            assert u32(f, 32) == 3
            assert c.ping() >= 0
    finally:
        d.close()


def test_chan_open_error_reply_is_typed():
    d = v2_daemon(lambda rid, p: error_frame(rid, -17, "doorbell channels need the cuda backend"))
    try:
        with mc.Client(d.path, timeout=5) as c:
            with pytest.raises(mc.MoedError, match="need the cuda backend") as e:
                c.chan_open([1], UUID)
            assert e.value.name == "unsupported" and e.value.request_id > 0
            assert c.ping() >= 0
    finally:
        d.close()


def test_desc_layout_by_hand():
    buf = (ctypes.c_char * 96)()
    _chan.pack_desc(buf, 0x0A0B0C0D, 33, 0xDEADBEEFCAFEF00D, 3,
                    ((1, 16), (2, 0x100000004), (3, 8), (15, 0x7FFFFFFFFFFFFFF0)))
    b = bytes(buf)
    assert u32(b, 0) == 0x0A0B0C0D and u32(b, 4) == 33 and u64(b, 8) == 0
    assert u64(b, 16) == 0xDEADBEEFCAFEF00D and u32(b, 24) == 3 and u32(b, 28) == 0
    got = [(u32(b, o), u32(b, o + 4), u64(b, o + 8)) for o in (32, 48, 64, 80)]
    assert got == [(1, 0, 16), (2, 0, 0x100000004), (3, 0, 8), (15, 0, 0x7FFFFFFFFFFFFFF0)]


def test_range_lookup_by_address():
    t = _chan.RangeTable([(0x1000, 0x100), (0x8000, 0x40), (0x1080, 0x100)])
    assert t.find(0x1000, 0x100) == (0, 0)
    assert t.find(0x1010, 0x10) == (0, 0x10)
    assert t.find(0x8000, 0x40) == (1, 0)
    assert t.find(0x10F0, 0x20) == (2, 0x70)  # past range 0's end: the next that holds it
    for ptr, n in ((0x0FFF, 2), (0x8020, 0x21), (0x2000, 1), (0x8040, 1)):
        with pytest.raises(ValueError, match="none of the channel's 3"):
            t.find(ptr, n)
    with pytest.raises(mc.MoedError):
        _chan.RangeTable([])
    with pytest.raises(mc.MoedError):
        _chan.RangeTable([(0x1000, 16)] * 17)


def test_range_lookup_with_an_arena_first():
    """A channel with an arena (moed_client.cuda.Channel): the arena as
    mapped here is index 0, the registered tensors follow from 1; a range in
    the arena is named (0, offset into the arena), one in a tensor (i + 1,
    offset), one straddling the arena's end in none."""
    arena, n = 0x7F0000001000, 4096 * 3
    t = _chan.RangeTable([(arena, n), (0x1000, 0x100), (0x9000, 0x40)])
    assert t.find(arena, 16) == (0, 0)
    assert t.find(arena + 0x2000, 0x100) == (0, 0x2000)
    assert t.find(arena + n - 16, 16) == (0, n - 16)
    assert t.find(0x1010, 0x10) == (1, 0x10)
    assert t.find(0x9000, 0x40) == (2, 0)
    with pytest.raises(ValueError, match="none of the channel's 3"):
        t.find(arena + n - 8, 16)
    _chan.RangeTable([(arena, n)])  # an arena alone: a channel of one buffer
    _chan.RangeTable([(arena, n)] + [(0x1000, 16)] * 15)


@pytest.mark.parametrize("H,k,T", [(64, 4, 8), (7168, 8, 256), (2048, 8, 1), (4096, 6, 33),
                                   (72, 3, 5)])
def test_arena_layout_within_the_daemons_limit(H, k, T):
    """The DoorbellSession arena (moed_client.cuda.arena_layout): x at 0,
    ids, w, y each 16-aligned after the one before, in at most the bytes the
    daemon allows for CHAN_OPEN arena_bytes (PROTOCOL.md 10.1:
    max_tokens * (4 H + 8 k) + 64)."""
    from moed_client import cuda as mcc  # torch is imported only when used
    off_ids, off_w, off_y, n = mcc.arena_layout(H, k, T)
    assert off_ids >= 2 * T * H and off_w >= off_ids + 4 * T * k
    assert off_y >= off_w + 4 * T * k and n >= off_y + 2 * T * H
    assert off_ids % 16 == off_w % 16 == off_y % 16 == n % 16 == 0
    assert n - (4 * T * H + 8 * T * k) < 64
    assert n <= T * (4 * H + 8 * k) + 64


def test_status_names_and_channel_error():
    assert _chan.status_name(0) == "MOE_GPU_CHAN_OK"
    assert _chan.status_name(4) == "MOE_GPU_CHAN_E_RANGE"
    assert _chan.status_name(11) == "MOE_GPU_CHAN_E_TIMEOUT"
    assert "unknown" in _chan.status_name(200)
    e = _chan.ChannelError(12345 << 8 | 7, chan_id=2)
    assert isinstance(e, mc.MoedError)
    assert (e.status, e.seq, e.status_name, e.name) == (7, 12345, "MOE_GPU_CHAN_E_EXPERT",
                                                         "inval")
    assert "seq 12345" in str(e) and "MOE_GPU_CHAN_E_EXPERT" in str(e) and "channel 2" in str(e)
    t = _chan.ChannelError(9 << 8 | 11)
    assert t.name == "timeout" and t.seq == 9
    c = _chan.ChannelError(4 << 8 | 12, chan_id=1)  # the daemon closed the channel
    assert (c.status_name, c.name, c.seq) == ("MOE_GPU_CHAN_E_CLOSED", "conn", 4)
    assert _chan.call_flags() == 0 and _chan.call_flags(True, True) == 3
    with pytest.raises(ValueError):
        _chan.check_flags(4)


def test_launch_block_points_at_its_arguments():
    """What cuLaunchKernel gets (a stand-in records it; no driver needed):
    grid 1, block 32, no shared memory, the stream, and an argument array
    pointing at chan, the descriptor by value (96 bytes), err and the timeout;
    a later call rewrites the same block in place."""
    from moed_client import _cudrv
    seen = []

    def launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        p = [params[i] for i in range(4)]
        seen.append((fn.value, (gx, gy, gz, bx, by, bz, smem), stream, extra,
                     ctypes.c_uint64.from_address(p[0]).value, ctypes.string_at(p[1], 96),
                     ctypes.c_uint64.from_address(p[2]).value,
                     ctypes.c_uint64.from_address(p[3]).value))
        return 0
    la = _cudrv.ChanLaunch(0x1234, 0xC0FFEE00, 0xE0000008, 5 * 10**9, launch=launch)
    _chan.pack_desc(la.desc, 3, 2, 77, 0, ((0, 0),) * 4)
    la.launch(0x5000, 0)
    _chan.pack_desc(la.desc, 4, 9, 78, 2, ((1, 16),) * 4)
    la.launch(None, 0)
    (f0, g0, s0, e0, c0, d0, r0, t0), (f1, g1, s1, _, c1, d1, r1, t1) = seen
    assert f0 == f1 == 0x1234 and g0 == g1 == (1, 1, 1, 32, 1, 1, 0) and e0 is None
    assert (s0, s1) == (0x5000, None)
    assert c0 == c1 == 0xC0FFEE00 and r0 == r1 == 0xE0000008 and t0 == t1 == 5 * 10**9
    assert (u32(d0, 0), u32(d0, 4), u64(d0, 16)) == (3, 2, 77)
    assert (u32(d1, 0), u32(d1, 4), u64(d1, 16), u32(d1, 24), u32(d1, 32), u64(d1, 40)) == \
        (4, 9, 78, 2, 1, 16)


def test_peer_view_is_the_memory_on_the_device_named():
    """The view of a daemon's arena on another GPU (moed_client.cuda
    _PeerRange: DLPack, the device given, not the one the pointer's owner
    is): checked on the CPU, kDLCPU over a numpy buffer, so the struct
    layout torch reads is the one written: the tensor is those very bytes
    (writes through it land there), its length the range's, uint8."""
    torch = pytest.importorskip("torch")
    from moed_client import cuda as mcc
    buf = np.zeros(4096 + 7, np.uint8)
    ptr = buf.ctypes.data + 7  # not aligned on purpose: the address as given
    rng = mcc._PeerRange(ptr, 4096, mcc.DL_CPU, 0)
    t = rng.tensor()
    assert (t.data_ptr(), t.numel(), t.dtype, t.device.type) == (ptr, 4096, torch.uint8, "cpu")
    t[0], t[4095] = 0x5A, 0xA5
    assert (buf[7], buf[4095 + 7], buf[6], int(buf.sum())) == (0x5A, 0xA5, 0, 0x5A + 0xA5)
    assert t.view(torch.bfloat16).shape == (2048,)


def test_ipc_handle_by_value_holds_every_byte():
    """The 64-byte handle as the by-value struct cuIpcOpenMemHandle gets: all
    64 bytes, NULs included (a c_char array would stop at the first NUL)."""
    from moed_client import _cudrv
    raw = bytes([0, 7, 0, 0]) + bytes(range(1, 61))
    h = _cudrv.ipc_handle(raw)
    assert ctypes.sizeof(h) == 64 and bytes(memoryview(h)) == raw
    assert ctypes.string_at(ctypes.addressof(h), 64) == raw
    with pytest.raises(mc.MoedError):
        _cudrv.ipc_handle(raw[:63])


def test_driver_error_names_the_call():
    """A failing driver call is MoedError 'backend' naming the call and the
    CUresult (needs libcuda.so.1: skipped without it)."""
    from moed_client import _cudrv
    try:
        _cudrv.lib()
    except mc.MoedError as e:
        assert e.name == "backend" and "libcuda.so.1" in e.message
        pytest.skip("no usable CUDA driver here: %s" % e.message)
    with pytest.raises(mc.MoedError, match=r"cuModuleLoadData: CUDA_ERROR_\w+") as e:
        _cudrv.module_load(b"not a fatbin")
    assert e.value.name == "backend"


# ---- against the real daemon: the CPU backend's fake channels ----------------

def test_chan_open_against_the_daemon(tmp_path_factory):
    """Client.chan_open / chan_close through the real socket against the CPU
    backend's fake channel ops (MOED_TEST_CPU_CHANNELS, engine/test_hooks.h):
    the reply decodes (id, slots, key, size, ABI, the fake "fatbin"), a
    daemon refusal is a typed error, and a buffer named by an open channel
    cannot be unregistered until it is closed."""
    import daemon_util as du
    from test_daemon_desc import Shm
    if du.TEST_BACKEND != "cpu":
        pytest.skip("CPU backend test switch (GPU: tests/gpu/test_doorbell.py)")
    tmp = tmp_path_factory.mktemp("chan-py")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port(),
                         engine__max_channels=1)
    uuid = b"moed-cpu-test-id"  # MOED_TEST_CPU_UUID
    shm = Shm(1 << 16)
    try:
        with du.Daemon(tmp, cfg, env={"MOED_TEST_CPU_SHM_IPC": "1",
                                      "MOED_TEST_CPU_CHANNELS": "1"}) as d, \
                mc.Client(d.sock_path, timeout=du.wait_s(30)) as c:
            b1 = c.register_buf(shm.handle, 0, 4096, uuid)
            b2 = c.register_buf(shm.handle, 4096, 4096, uuid)
            ci = c.chan_open([b1, b2], uuid)
            assert ci.chan_id > 0 and ci.slots == mc.CHAN_SLOTS and ci.key != 0
            assert ci.size == mc.CHAN_STRUCT_BYTES and ci.abi_version == mc.GPU_ABI_VERSION
            assert ci.kernel == b"moed-cpu-test-kernel"  # backend_cpu.c's stand-in
            for call, name in ((lambda: c.unregister_buf(b1), "busy"),
                               (lambda: c.chan_open([b2], uuid), "busy"),  # max_channels 1
                               (lambda: c.chan_open([b2], b"\1" * 16), "inval"),
                               (lambda: c.chan_open([b2 + 7], uuid), "inval")):
                with pytest.raises(mc.MoedError) as e:
                    call()
                assert e.value.name == name and e.value.request_id, e.value
            c.chan_close(ci.chan_id)
            with pytest.raises(mc.MoedError) as e:
                c.chan_close(ci.chan_id)
            assert e.value.name == "inval"
            c.unregister_buf(b1)
            c.unregister_buf(b2)
            assert c.ping() >= 0
            assert d.stop() == 0, d.log()[-4000:]
    finally:
        shm.close()


def test_arena_views_and_fill_on_host_memory():
    """_Arena (the DoorbellSession's x | ids | w | y views, over the
    channel's arena on the GPU) on a host uint8 tensor: the views lie at
    arena_layout's offsets, fill() copies T rows into them and returns
    those rows; a buffer too small or of another dtype is refused."""
    torch = pytest.importorskip("torch")

    class Info:
        hidden, top_k = 24, 3
    from moed_client import cuda as mcc
    off_ids, off_w, off_y, n = mcc.arena_layout(24, 3, 5)
    mem = torch.zeros(n, dtype=torch.uint8)
    a = mcc._Arena(Info, 5, mem)
    base = mem.data_ptr()
    assert (a.x.data_ptr() - base, a.ids.data_ptr() - base, a.w.data_ptr() - base,
            a.y.data_ptr() - base) == (0, off_ids, off_w, off_y)
    assert tuple(a.x.shape) == (5, 24) and tuple(a.ids.shape) == (5, 3)
    x = torch.randn(2, 24).to(torch.bfloat16)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    w = torch.rand(2, 3)
    xr, ir, wr, yr = a.fill(x, w, ids, Info, 5)
    assert torch.equal(xr, x) and torch.equal(ir, ids) and torch.equal(wr, w)
    assert yr.data_ptr() == base + off_y and tuple(yr.shape) == (2, 24)
    assert torch.equal(a.x[:2], x) and int(torch.count_nonzero(a.x[2:])) == 0
    with pytest.raises(ValueError, match="shapes"):
        a.fill(torch.zeros(6, 24, dtype=torch.bfloat16), torch.zeros(6, 3),
               torch.zeros(6, 3, dtype=torch.int32), Info, 5)
    with pytest.raises(ValueError, match="needs %d bytes of uint8, got %d" % (n, n - 1)):
        mcc._Arena(Info, 5, torch.zeros(n - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mcc._Arena(Info, 5, torch.zeros(n, dtype=torch.int16))


def test_channel_needs_an_arena_or_cuda_tensors(d2):
    """Channel(): neither an arena nor a tensor, a host tensor, or 16
    tensors besides an arena are refused before anything is registered or
    opened (the fake daemon sees only HELLO)."""
    torch = pytest.importorskip("torch")
    from moed_client import cuda as mcc
    with mc.Client(d2.path, timeout=5) as c:
        for kw in (dict(), dict(tensors=[torch.zeros(16, dtype=torch.uint8)]),
                   dict(tensors=[torch.zeros(16, dtype=torch.uint8)], arena_bytes=64)):
            with pytest.raises(mc.MoedError, match="a channel needs an arena or 1..16 CUDA "
                               "tensors") as e:
                mcc.Channel(c, **kw)
            assert e.value.name == "inval"
        assert not frames_of(d2, 19) and not frames_of(d2, 3)
        assert c.ping() >= 0
