"""The zero-copy paths across GPUs of one host (the dedicated expert GPU,
docs/ZERO_COPY.md): REGISTER_BUF and CHAN_OPEN from a client whose GPU is
another GPU than moed's, through the real socket with the real Python
client.

The CPU backend plays the GPUs (engine/test_hooks.h): with
MOED_TEST_CPU_SHM_IPC its own "GPU" is MOED_TEST_CPU_UUID (here not under
MPS: MOED_TEST_CPU_NO_MPS), and MOED_TEST_CPU_PEERS lists the other GPUs it
sees, one of them without peer access; any other UUID is not visible. The
checks, their messages, the mappings and /status are the daemon's own code,
the same on the CUDA backend, whose peer_gpu asks the driver
(backend_ipc_cuda.c; its GPU test is tests/gpu/test_zero_copy_peer.py).
"""
import json
import urllib.request

import numpy as np
import pytest

import daemon_util as du
import moed_client as mc
from test_daemon_desc import Shm, forward_by_desc, layout

OWN = b"moed-cpu-test-id"   # MOED_TEST_CPU_UUID: moed's GPU, ordinal 0
PEER = b"moed-peer-gpu-01"  # ordinal 1, peer access both ways
NOPEER = b"moed-peer-gpu-02"  # ordinal 2, no peer access
UNKNOWN = b"moed-not-a-gpu-3"
VISIBLE = "0,1,2"           # CUDA_VISIBLE_DEVICES as the daemon sees it
ENV = {"MOED_TEST_CPU_SHM_IPC": "1", "MOED_TEST_CPU_CHANNELS": "1",
       "MOED_TEST_CPU_NO_MPS": "1", "MOED_TEST_CPU_PEERS": "%s,%s!" % (PEER.decode(),
                                                                      NOPEER.decode()),
       "CUDA_VISIBLE_DEVICES": VISIBLE}

pytestmark = pytest.mark.skipif(du.TEST_BACKEND != "cpu",
                                reason="CPU backend test switch (GPU: tests/gpu/)")


def start(tmp_path_factory, name, env):
    tmp = tmp_path_factory.mktemp(name)
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port(),
                         server__max_registered_buffers=8, engine__max_channels=4)
    return du.Daemon(tmp, cfg, env=env)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with start(tmp_path_factory, "peer", ENV) as d:
        yield d
        assert d.alive(), d.log()
        assert d.stop() == 0, d.log()[-4000:]


@pytest.fixture
def shm():
    s = Shm(1 << 16)
    yield s
    s.close()


def status(daemon):
    url = "http://127.0.0.1:%d/status" % daemon.http_port()
    with urllib.request.urlopen(url, timeout=du.wait_s(5)) as r:
        st = json.loads(r.read().decode())
    return st["registered_buffers"], st["channels"]


def refusal(what, uuid, why):
    """The daemon's message for a client on a GPU it cannot serve (desc.c)."""
    return ("%s on GPU %s, not on this daemon's GPU %s, and peer access cannot serve it: %s"
            % (what, uuid.hex(), OWN.hex(), why))


NOT_VISIBLE = ("it is not one of the 3 GPUs this process sees (CUDA_VISIBLE_DEVICES %s)"
               % VISIBLE)
NO_ACCESS = "there is no peer access between GPU 0 (this daemon's) and GPU 2"


def test_forward_desc_from_a_peer_gpu_equals_inline(daemon, dims):
    """A buffer on the peer GPU registers with MPS off, counts as a peer
    mapping in /status, and FORWARD_DESC through it gives the inline
    FORWARD's y bit for bit."""
    cases = du.reference_cases(daemon, dims, n=3, max_t=4, seed=31)
    shm = Shm(layout(dims, 4)[4])
    try:
        with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
            bid = c.register_buf(shm.handle, 0, shm.size, PEER)
            rb, _ = status(daemon)
            assert (rb["mappings"], rb["peer_mappings"]) == (1, 1), rb
            for layer, x, ids, w, _ in cases:
                y = forward_by_desc(c, shm, dims, bid, layer, x, ids, w)
                assert np.array_equal(y, np.asarray(c.forward(layer, x, ids, w)).view(np.uint16))
            # the same allocation claimed as moed's own GPU's memory: refused
            with pytest.raises(mc.MoedError) as e:
                c.register_buf(shm.handle, 0, 64, OWN)
            assert (e.value.name, e.value.message) == (
                "inval", "the handle is mapped already as memory of peer GPU 1, not of the GPU "
                         "this registration names")
            c.unregister_buf(bid)
            rb, _ = status(daemon)
            assert (rb["mappings"], rb["peer_mappings"]) == (0, 0), rb
    finally:
        shm.close()


@pytest.mark.parametrize("uuid,why", [(NOPEER, NO_ACCESS), (UNKNOWN, NOT_VISIBLE)])
def test_register_from_a_gpu_moed_cannot_reach(daemon, shm, uuid, why):
    """A GPU without peer access, or one moed does not see: refused with
    the UUIDs and the reason; nothing mapped."""
    with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
        before = status(daemon)[0]["refused"]
        with pytest.raises(mc.MoedError) as e:
            c.register_buf(shm.handle, 0, 4096, uuid)
        assert (e.value.name, e.value.message) == ("inval",
                                                   refusal("the buffer lies", uuid, why))
        rb, _ = status(daemon)
        assert (rb["mappings"], rb["refused"]) == (0, before + 1), rb
        c.ping()


def test_chan_open_from_a_peer_gpu(daemon, shm):
    """CHAN_OPEN from the peer GPU opens with MPS off (an arena alone, and
    one naming a buffer registered from the peer); /status lists the
    client's GPU; from moed's own GPU without MPS the refusal is as before,
    and from a GPU moed cannot reach it names the reason."""
    with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
        arena = c.chan_open([], PEER, arena_bytes=256)
        bid = c.register_buf(shm.handle, 0, 4096, PEER)
        named = c.chan_open([bid], PEER)
        _, ch = status(daemon)
        got = {r["id"]: r["peer_gpu"] for r in ch["list"]}
        assert got == {arena.chan_id: 1, named.chan_id: 1}, ch
        with pytest.raises(mc.MoedError) as e:
            c.chan_open([], OWN, arena_bytes=256)
        assert (e.value.name, e.value.message) == (
            "unsupported", "the client's GPU is moed's GPU and MPS is off: the client's kernels "
                           "cannot run while moed's persistent kernel is resident; start MPS "
                           "(docs/ZERO_COPY.md)")
        for uuid, why in [(NOPEER, NO_ACCESS), (UNKNOWN, NOT_VISIBLE)]:
            with pytest.raises(mc.MoedError) as e:
                c.chan_open([], uuid, arena_bytes=256)
            assert (e.value.name, e.value.message) == (
                "inval", refusal("the client's kernels run", uuid, why))
        c.chan_close(arena.chan_id)
        c.chan_close(named.chan_id)


def test_same_gpu_without_mps_still_registers(daemon, shm):
    """moed's own GPU without MPS: REGISTER_BUF is accepted as before (a
    warning, not a refusal) and is not a peer mapping."""
    with mc.Client(daemon.sock_path, timeout=du.wait_s(30)) as c:
        bid = c.register_buf(shm.handle, 0, 4096, OWN)
        rb, _ = status(daemon)
        assert (rb["mappings"], rb["peer_mappings"]) == (1, 0), rb
        c.unregister_buf(bid)
    assert "which is not under MPS" in daemon.log()


def test_no_peer_access_in_the_backend(tmp_path_factory, shm):
    """A backend without peer_gpu (the CPU stand-in without
    MOED_TEST_CPU_PEERS): another GPU is refused for both requests, saying
    so."""
    env = {k: v for k, v in ENV.items() if k != "MOED_TEST_CPU_PEERS"}
    with start(tmp_path_factory, "peer-none", env) as d:
        with mc.Client(d.sock_path, timeout=du.wait_s(30)) as c:
            with pytest.raises(mc.MoedError) as e:
                c.register_buf(shm.handle, 0, 4096, PEER)
            assert e.value.message == refusal("the buffer lies", PEER,
                                              "the backend has no peer access")
            with pytest.raises(mc.MoedError) as e:
                c.chan_open([], PEER, arena_bytes=256)
            assert e.value.message == refusal("the client's kernels run", PEER,
                                              "the backend has no peer access")
        assert d.stop() == 0, d.log()[-4000:]
