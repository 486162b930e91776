"""GPU: registered buffers and FORWARD by descriptor with real CUDA IPC handles
(protocol version 2), a torch client on the daemon's GPU.

Run by scripts/run-gpu-tests.sh under MPS (it starts and stops the MPS
control daemon and exports its pipe directory); skips cleanly without torch,
a GPU or MPS. The daemon leaves SMs free (engine.sms_free) and idles out
fast, so the client's own kernels (the copies into the registered buffer)
always find room.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_util import du, torch, np, batch, status as full_status  # noqa: E402

import moed_client as mc  # noqa: E402
import moed_client.cuda as mcc  # noqa: E402


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zc")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port(),
                         engine__backend="cuda", engine__sms_free=int(
                             os.environ.get("MOED_TEST_SMS_FREE", "64")),
                         engine__idle_exit_ms=20)
    with du.Daemon(tmp, cfg) as d:
        yield d
        assert d.alive(), d.log()
        assert d.stop() == 0, d.log()[-4000:]



def test_mps_leaves_sms_free_by_default(tmp_path_factory):
    """Under MPS with engine.sms_free 0, the kernel leaves
    engine.mps_sms_free_percent (50) of the SMs free, and says so. First in
    the file: it starts a daemon of its own, and under MPS one moed serves a
    GPU (test_second_moed_on_the_gpu_refused)."""
    import json
    import re
    import urllib.request
    tmp = tmp_path_factory.mktemp("zc-mps")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port(),
                         engine__backend="cuda", engine__sms_free=0)
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    with du.Daemon(tmp, cfg) as d:
        url = "http://127.0.0.1:%d/status" % d.http_port()
        with urllib.request.urlopen(url, timeout=du.wait_s(5)) as r:
            desc = json.loads(r.read().decode())["backend"]["description"]
        print("backend: %s" % desc)
        assert "MPS on" in desc, desc
        used = int(re.search(r"(\d+) SMs used", desc).group(1))
        assert used == n_sms - n_sms * 50 // 100, (used, n_sms)
        assert "leaving %d of %d SMs free" % (n_sms * 50 // 100, n_sms) in d.log()
        # and its context is limited to them (MPS execution affinity), so
        # that its CTAs leave the other SMs whole
        assert "(context limited to its SMs)" in desc, desc
        assert "moed's context is limited to %d of %d SMs under MPS" % (used, n_sms) in d.log()
        assert d.stop() == 0, d.log()[-4000:]


def status(daemon):
    return full_status(daemon)["registered_buffers"]


def wait_status(daemon, **want):
    deadline = time.monotonic() + du.wait_s(30)
    while True:
        st = status(daemon)
        if all(st[k] == v for k, v in want.items()):
            return st
        assert time.monotonic() < deadline, (st, want)
        time.sleep(0.02)


def test_descriptor_path_equals_inline_bit_for_bit(daemon):
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c:
        info = c.hello()
        assert info.backend == "cuda" and info.version == 2
        with mcc.CudaSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60))) as s:
            for i, t in enumerate([1, 3, 7, 16, info.max_tokens]):
                layer = info.first_moe_layer + i % (info.n_layers - info.first_moe_layer)
                x, ids, w = batch(info, t, i)
                y_inline = torch.from_numpy(np.ascontiguousarray(
                    np.asarray(c.forward(layer, x.view(torch.int16).numpy().view(np.uint16),
                                         ids.numpy(), w.numpy())).view(np.uint16)
                ).view(np.int16))
                y = s.fused_experts(x.cuda(), w.cuda(), ids.cuda(), layer)
                assert y.is_cuda and y.dtype == torch.bfloat16 and tuple(y.shape) == (t, info.hidden)
                got = y.cpu().view(torch.int16)
                assert torch.equal(got, y_inline), (t, (got != y_inline).sum().item())
            st = status(daemon)
            assert st["registered"] == 1 and st["mappings"] == 1, st
            assert st["descriptor_requests"] >= 5
        wait_status(daemon, registered=0, mappings=0)


def test_bad_ranges_and_expert_ids(daemon):
    """Host checks with a real handle; an out-of-range expert id in GPU memory
    never reads out of bounds (the kernel clamps it) and the daemon stays
    healthy."""
    with mcc.CudaSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60))) as s:
        c, b = s.client, s.buf_id
        info = s.info
        t = 4
        with pytest.raises(mc.MoedError) as e:
            c.forward_desc(info.first_moe_layer, t, (b, s.mem.numel()), (b, s.off_ids),
                           (b, s.off_w), (b, s.off_y))
        assert e.value.name == "range"
        handle, off, size = mcc.ipc_range(s.mem)
        with pytest.raises(mc.MoedError) as e:
            c.register_buf(handle, off, size + (64 << 20), mcc.device_uuid(s.device))
        assert e.value.name == "range", e.value
        with pytest.raises(mc.MoedError) as e:
            c.register_buf(b"\0" * 64, 0, 4096, mcc.device_uuid(s.device))
        assert e.value.name == "io", e.value
        with pytest.raises(mc.MoedError) as e:
            c.register_buf(handle, off, size, b"\1" * 16)
        assert e.value.name == "inval", e.value
        x, ids, w = batch(info, t, 99)
        ids[0, 0] = info.n_experts + 1000
        y = s.fused_experts(x.cuda(), w.cuda(), ids.cuda(), info.first_moe_layer)
        assert y.shape[0] == t
        x, ids, w = batch(info, t, 100)
        s.fused_experts(x.cuda(), w.cuda(), ids.cuda(), info.first_moe_layer)
    assert daemon.alive()


CHILD = r"""
import sys, time
sys.path[:0] = sys.argv[2].split(":")
import torch, moed_client as mc, moed_client.cuda as mcc
s = mcc.CudaSession(mc.Client(sys.argv[1], timeout=60))
x = torch.randn(2, s.info.hidden, device="cuda").to(torch.bfloat16)
ids = torch.zeros(2, s.info.top_k, dtype=torch.int32, device="cuda")
w = torch.ones(2, s.info.top_k, device="cuda")
s.fused_experts(x, w, ids, s.info.first_moe_layer)
print("ready", flush=True)
time.sleep(600)
"""


def test_killed_clients_leave_no_mapping(daemon):
    n = int(os.environ.get("MOED_TEST_KILLS", "10"))
    path = os.pathsep.join(p for p in sys.path if p)
    free0 = None
    for i in range(n):
        p = subprocess.Popen([sys.executable, "-c", CHILD, daemon.sock_path, path],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready", i
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        wait_status(daemon, registered=0, mappings=0)
        free, total = torch.cuda.mem_get_info()
        if i == 1:
            free0 = free
    assert daemon.alive()
    # device memory: no growth after the first two rounds (allocator warm-up)
    if free0 is not None:
        free, _ = torch.cuda.mem_get_info()
        print("device free after %d kills: %d MiB (after 2: %d MiB)"
              % (n, free >> 20, free0 >> 20))
        assert free >= free0 - (64 << 20)
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c:
        assert c.ping() >= 0


def test_latency_inline_vs_descriptor(daemon):
    """Not a pass/fail check: p50 of one layer through the inline socket path
    and by descriptor (host-synchronous, socket reply), printed for the note."""
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c, \
            mcc.CudaSession(mc.Client(daemon.sock_path, timeout=du.wait_s(60))) as s:
        info = c.hello()
        layer = info.first_moe_layer
        for t in (1, 16, info.max_tokens):
            x, ids, w = batch(info, t, 7)
            xn, idn, wn = x.view(torch.int16).numpy().view(np.uint16), ids.numpy(), w.numpy()
            xc, idc, wc = x.cuda(), ids.cuda(), w.cuda()
            res = {}
            for name, fn in (("inline", lambda: c.forward(layer, xn, idn, wn)),
                             ("descriptor", lambda: s.fused_experts(xc, wc, idc, layer))):
                for _ in range(20):
                    fn()
                ts = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                res[name] = sorted(ts)[len(ts) // 2] * 1e6
            print("latency T=%d: inline p50 %.1f us, descriptor p50 %.1f us"
                  % (t, res["inline"], res["descriptor"]))


def test_second_moed_on_the_gpu_refused(daemon, tmp_path_factory):
    """A second moed on the module daemon's GPU under MPS is refused at start
    (exit 4, the backend), naming the first one's pid and the lock file,
    before it makes a context or launches a kernel; the first one keeps
    serving, the same answer bit for bit."""
    def call(c, info):
        x, ids, w = batch(info, 4, 11)
        return np.asarray(c.forward(info.first_moe_layer, x.view(torch.int16).numpy()
                                    .view(np.uint16), ids.numpy(), w.numpy())).view(np.uint16)

    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c:
        info = c.hello()
        before = call(c, info)
    tmp = tmp_path_factory.mktemp("zc-second")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory), status__port=du.free_port(),
                         engine__backend="cuda", engine__sms_free=64)
    with pytest.raises(RuntimeError) as ei:
        with du.Daemon(tmp, cfg):
            pass
    text = str(ei.value)
    assert "moed exited with 4 during start-up" in text, text[-4000:]
    assert re.search(r"GPU 0 \(uuid [0-9a-f]{32}\) under MPS is held by another process, "
                     r"pid %d \(lock file /dev/shm/moed-gpu-[0-9a-f]{32}\.lock\); one moed per "
                     r"GPU under MPS" % daemon.proc.pid, text), text[-4000:]
    assert "persistent kernel" not in text, text[-4000:]
    with mc.Client(daemon.sock_path, timeout=du.wait_s(60)) as c:
        assert np.array_equal(call(c, c.hello()), before)
