"""The Python copies of the wire constants and error codes, checked against
the C headers they mirror (ipc/moed_proto.h, common/moed_err.h and the names
in common/moed_err.c): the Python client (ipc/python/moed_client) is the one
Python copy, and the daemon tests' helpers (daemon_util) take theirs from it.
A constant changed in C and not in Python fails here, not on the wire."""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "ipc", "python"))  # the tree's client, not an old install

import moed_client as mc  # noqa: E402

import chan_frames as cf  # noqa: E402
import daemon_util as du  # noqa: E402


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def c_defines(text, prefix):
    return {m.group(1): int(m.group(2), 0)
            for m in re.finditer(r"#define %s(\w+)\s+(0x[0-9A-Fa-f]+|\d+)u?\b" % prefix, text)}


def c_enum(text, prefix):
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"\b%s(\w+)\s*=\s*(-?\d+)" % prefix, text)}


def test_frame_constants_match_moed_proto_h():
    proto = read("ipc/moed_proto.h")
    d = c_defines(proto, "MOED_PROTO_")
    assert d["MAGIC"] == mc.PROTO_MAGIC == du.MAGIC
    assert d["VERSION"] == mc.PROTO_VERSION == 2
    assert d["MIN_VERSION"] == mc.PROTO_MIN_VERSION == du.VERSION == 1
    assert d["HDR_SIZE"] == mc.HDR_SIZE == du.HDR.size
    assert d["REPLY"] == mc.REPLY == du.REPLY
    assert d["MAX_ERRMSG"] == mc.MAX_ERRMSG
    assert d["MAX_PING"] == mc.MAX_PING
    msgs = c_enum(proto, "MOED_MSG_")
    assert len(msgs) >= 9, msgs
    for name, v in msgs.items():
        assert getattr(mc, "MSG_" + name) == v, name
        assert getattr(du, "MSG_" + name, v) == v, name
        assert getattr(cf, "MSG_" + name, v) == v, name


def test_error_codes_match_moed_err():
    codes = c_enum(read("common/moed_err.h"), "MOED_E_")
    codes.pop("_COUNT", None)
    names = dict(re.findall(r'\[(\d+)\]\s*=\s*\{"(\w+)"', read("common/moed_err.c")))
    assert len(codes) >= 20, codes
    assert mc.ERROR_NAMES[0] == names["0"] == "ok"
    for enum_name, v in codes.items():
        assert mc.ERROR_NAMES[v] == names[str(-v)], enum_name
        assert du.E[names[str(-v)]] == v, enum_name
    assert set(mc.ERROR_NAMES) == set(codes.values()) | {0}
    for attr in ("E_PROTO", "E_VERSION", "E_TOOBIG", "E_INVAL", "E_TIMEOUT", "E_CONN"):
        assert getattr(mc, attr) == codes[attr[2:]], attr


def test_version2_constants_match_moed_proto_h():
    proto = read("ipc/moed_proto.h")
    d = c_defines(proto, "MOED_PROTO_")
    assert d["VERSION"] == mc.PROTO_VERSION == 2
    assert d["MIN_VERSION"] == mc.PROTO_MIN_VERSION == 1
    assert d["MAX_LAYERS"] == mc.MAX_LAYERS
    assert c_defines(proto, "MOED_HELLO_")["V1_BYTES"] == mc.HELLO_V1_BYTES == 64
    f = c_defines(proto, "MOED_FORWARD_")
    assert f["ROUTED_ONLY"] == mc.FORWARD_ROUTED_ONLY
    assert f["EMPTY_SLOTS"] == mc.FORWARD_EMPTY_SLOTS
    assert re.search(r"#define MOED_EXPERT_NONE \((-\d+)\)", proto).group(1) == \
        str(mc.EXPERT_NONE)


def test_frame_versions_match_moed_type_min_version():
    """Which version each type's frames carry: moed_type_min_version in
    ipc/proto.c (2 for 16..31) and the Python client's frame_version."""
    src = read("ipc/proto.c")
    assert "base >= 16 && base <= 31 ? 2 : 1" in src
    for t in range(0, 40):
        for reply in (0, mc.REPLY):
            assert mc.frame_version(t | reply) == (2 if 16 <= t <= 31 else 1), t


def struct_size(text, name):
    """The size a _Static_assert in the header gives struct `name`."""
    m = re.search(r"_Static_assert\(sizeof\(struct %s\) == (\d+)" % name, text)
    assert m, name
    return int(m.group(1))


def test_channel_constants_match_the_headers():
    """The channel payloads (ipc/moed_proto.h) and the channel's layout
    (kernels/moe_gpu_abi.h) as the tests' raw frames (chan_frames) pack
    them, and the type's frame version (2)."""
    proto = read("ipc/moed_proto.h")
    abi = read("kernels/moe_gpu_abi.h")
    d = c_defines(proto, "MOED_PROTO_")
    assert d["CHAN_BUFS"] == cf.CHAN_BUFS == c_defines(abi, "MOE_GPU_")["CHAN_BUFS"]
    m = re.search(r"#define MOED_PROTO_MAX_CHAN_KERNEL \((\d+)u << (\d+)\)", proto)
    assert int(m.group(1)) << int(m.group(2)) == cf.MAX_CHAN_KERNEL
    assert struct_size(proto, "moed_chan_open_req") == cf.OPEN_REQ_BYTES == \
        len(cf.open_payload(b"u" * 16, [1], arena_bytes=0))
    assert d["CHAN_OPEN_SHORT"] == cf.OPEN_REQ_SHORT == len(cf.open_payload(b"u" * 16, [1]))
    assert d["CHAN_ARENA_OFF"] == cf.ARENA_OFF == c_defines(abi, "MOE_GPU_")["CHAN_ARENA_OFF"] \
        == mc.CHAN_ARENA_OFF
    assert struct_size(proto, "moed_chan_open_rep") == cf.OPEN_REP_BYTES == cf.OPEN_REP.size
    assert struct_size(proto, "moed_chan_close_req") == cf.CLOSE_REQ_BYTES == \
        len(cf.close_payload(1))
    g = c_defines(abi, "MOE_GPU_")
    assert g["CHAN_SLOTS"] == cf.CHAN_SLOTS
    # engine.max_channels' bound in the config table is the kernel's table size
    keys = open(os.path.join(ROOT, "config", "config_keys.c")).read()
    m = re.search(r'"engine\.max_channels".*?\.max = (\d+)', keys, re.S)
    assert m and int(m.group(1)) == g["MAX_CHANS"] == 16
    for t in (cf.MSG_CHAN_OPEN, cf.MSG_CHAN_CLOSE):
        assert mc.frame_version(t) == mc.frame_version(t | mc.REPLY) == 2


def test_doorbell_constants_match_the_headers():
    """The channel constants of the Python client (moed_client, _chan) against
    ipc/moed_proto.h and kernels/moe_gpu_abi.h: counts, the ABI version, the
    FORWARD-like flags, every MOE_GPU_CHAN_E_* status code and its name, and
    the descriptor's and the channel's byte layout (its _Static_asserts)."""
    from moed_client import _chan
    proto, abi = read("ipc/moed_proto.h"), read("kernels/moe_gpu_abi.h")
    assert c_defines(proto, "MOED_PROTO_")["CHAN_BUFS"] == mc.CHAN_BUFS
    g = c_defines(abi, "MOE_GPU_")
    assert g["CHAN_SLOTS"] == mc.CHAN_SLOTS and g["CHAN_BUFS"] == mc.CHAN_BUFS
    assert g["ABI_VERSION"] == mc.GPU_ABI_VERSION
    assert g["CHAN_ROUTED_ONLY"] == _chan.CHAN_ROUTED_ONLY == mc.FORWARD_ROUTED_ONLY
    assert g["CHAN_EMPTY_SLOTS"] == _chan.CHAN_EMPTY_SLOTS == mc.FORWARD_EMPTY_SLOTS
    codes = c_enum(abi, "MOE_GPU_CHAN_")
    assert len(codes) >= 12, codes
    assert {v: ("OK" if k == "OK" else k[2:]) for k, v in codes.items()} == _chan.CHAN_STATUS
    assert codes["E_TIMEOUT"] == _chan.CHAN_E_TIMEOUT and codes["E_CLOSED"] == _chan.CHAN_E_CLOSED
    assert "offsetof(struct moe_gpu_chan, closed) == 8" in abi  # CHAN_HEAD's second word
    assert "sizeof(struct moe_gpu_chan_desc) == 96" in abi and _chan.DESC.size == 96
    for field, off in (("seq", 8), ("key", 16), ("flags", 24), ("x", 32), ("y", 80)):
        assert "offsetof(struct moe_gpu_chan_desc, %s) == %d" % (field, off) in abi, field
    assert "offsetof(struct moe_gpu_chan, done) == 64" in abi
    assert "offsetof(struct moe_gpu_chan, status) == 128" in abi
    assert _chan.CHAN_HEAD.size == 128 + 8 * mc.CHAN_SLOTS
    assert mc.CHAN_STRUCT_BYTES == 128 + 8 * mc.CHAN_SLOTS + (96 + 32) * mc.CHAN_SLOTS
    assert "offsetof(struct moe_gpu_chan, stamp) ==\n" \
        "                              128 + 8 * MOE_GPU_CHAN_SLOTS + MOE_GPU_CHAN_SLOTS * 96" in abi
    assert _chan.STAMPS_OFF == 128 + 8 * mc.CHAN_SLOTS + 96 * mc.CHAN_SLOTS
