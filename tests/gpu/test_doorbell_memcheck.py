"""GPU: the doorbell's malformed descriptors (test_doorbell.py) against a
daemon run under compute-sanitizer memcheck: moed's kernel refuses each one
with no access out of bounds.

A file of its own, run last by scripts/run-gpu-tests.sh under MPS: its
daemon is the only moed on the GPU (one per GPU under MPS), and a kernel the
tool stops faults the MPS server for every later client.

Memcheck checks a kernel's accesses against the allocations it knew at the
kernel's launch, and moed's kernel stays resident, so memory moed allocates
later reads as out of bounds though it is not (H200, 2026-12-01/02: the
pinned pool's blocks, 147 reports on the self-check's x; a second channel's
allocation, opened while the first kept the kernel resident). So the daemon
runs with no pinned pool (ordinary memory goes through the staging slots,
allocated before the launch), idles out (engine.idle_exit_ms), and the test
opens its one channel only once the kernel has exited: the channel's
allocation is made before the launch that serves it.
"""

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_util import du  # noqa: E402
from test_doorbell import doorbell_config, run_bad_descriptors  # noqa: E402

import moed_client as mc  # noqa: E402


def wait_log(d, text, timeout_s):
    deadline = time.monotonic() + du.wait_s(timeout_s)
    while text not in d.log():
        assert d.alive(), d.log()[-4000:]
        assert time.monotonic() < deadline, d.log()[-4000:]
        time.sleep(0.05)


def stop_under_tool(d, timeout_s):
    """SIGTERM to moed itself, the tool's child (the tool dies of a SIGTERM of
    its own before it writes its summary), then the tool's exit status."""
    def children(pid):
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(c) for c in f.read().split()]
    todo, moed = [d.proc.pid], None
    while todo and moed is None:
        pid = todo.pop()
        with open("/proc/%d/comm" % pid) as f:
            if f.read().strip() == "moed":
                moed = pid
        todo += children(pid)
    assert moed is not None, "no moed process under the tool (pid %d)" % d.proc.pid
    os.kill(moed, signal.SIGTERM)
    return d.wait(timeout_s)


def test_malformed_descriptors_under_memcheck(tmp_path_factory):
    """The bad descriptors on one channel, each followed by a good call on it,
    against a daemon under memcheck, on a one-layer tiny model: 0 errors
    reported."""
    cs = os.environ.get("COMPUTE_SANITIZER") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.access(p, os.X_OK)), None)
    if cs is None:
        pytest.skip("compute-sanitizer not found")
    tmp = tmp_path_factory.mktemp("db-san")
    log = os.path.join(os.environ.get("LOGDIR", str(tmp)), "doorbell-memcheck.txt")
    wrap = os.path.join(str(tmp), "wrap.sh")
    with open(wrap, "w") as f:
        f.write('#!/bin/sh\nexec "%s" --tool memcheck --print-limit 20 --log-file "%s" "%s" "$@"\n'
                % (cs, log, du.MOED))
    os.chmod(wrap, 0o755)
    cfg = doorbell_config(tmp, str(tmp / "models"), engine__batch_deadline_ms=60000,
                          engine__idle_exit_ms=20)
    cfg["model"]["path"] = "synthetic:tiny:layers=1:seed=7"
    cfg["server"]["frame_timeout_ms"] = 60000
    cfg["server"]["pinned_pool_bytes"] = 0
    cfg["log"]["level"] = "debug"
    real, du.MOED = du.MOED, wrap
    try:
        with du.Daemon(tmp, cfg, start_timeout=300) as d:
            wait_log(d, "kernel exited after 20 ms idle", 120)  # the self-check's launch
            with mc.Client(d.sock_path, timeout=du.wait_s(120)) as c:
                n = run_bad_descriptors(d, c, timeout_s=du.wait_s(100), two=False)
            assert stop_under_tool(d, 120) == 0, d.log()[-4000:]
    finally:
        du.MOED = real
    with open(log) as f:
        text = f.read()
    print("memcheck (%d bad descriptors): %s" % (n, text.strip().splitlines()[-1:]))
    assert "ERROR SUMMARY: 0 errors" in text, text[-4000:]
