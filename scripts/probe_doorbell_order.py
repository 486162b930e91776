#!/usr/bin/env python3
"""Probe (GPU machine, under MPS): is a doorbell call answered when the
client's CUDA context was made before moed started (as in
tests/gpu/test_doorbell_model.py, whose model runs on the GPU before its
daemon starts), against a context made after moed is resident (as in
tests/gpu/test_doorbell.py)?

  before  the child makes its context and runs a matmul, then the daemon
          starts, then the child opens a DoorbellSession and makes one call
  after   the daemon starts, then the child does the same
Each call has a 5 s timeout (the client kernel's own); a child that hangs
past 40 s dumps its Python stacks (faulthandler) and is killed. This process
makes no CUDA context. Usage, from the tree root with MPS started
(scripts/mps.sh) and MOED_BUILD set: python3 scripts/probe_doorbell_order.py
"""
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "py"), os.path.join(ROOT, "ipc", "python")]

import daemon_util as du  # noqa: E402

CHILD = r"""
import faulthandler, sys, time
sys.path[:0] = sys.argv[1].split(":")
faulthandler.dump_traceback_later(40, exit=True)
import torch
a = torch.randn(256, 256, device="cuda")
(a @ a).sum().item()
print("ctx", flush=True)
sock = sys.stdin.readline().strip()
import moed_client as mc, moed_client.cuda as mcc
t0 = time.monotonic()
s = mcc.DoorbellSession(mc.Client(sock, timeout=30), max_tokens=4, timeout_s=5)
x = torch.randn(2, s.info.hidden, device="cuda").to(torch.bfloat16)
ids = torch.zeros(2, s.info.top_k, dtype=torch.int32, device="cuda")
w = torch.ones(2, s.info.top_k, device="cuda")
print("session open %.2f s" % (time.monotonic() - t0), flush=True)
y = s.fused_experts(x, w, ids, s.info.moe_layers[0])
torch.cuda.synchronize()
print("call returned %.2f s: err %#x ring %s" % (time.monotonic() - t0, s.channel.error_word(),
      s.channel.ring()), flush=True)
s.close()
print("done", flush=True)
"""


def run(order, models):
    tmp = tempfile.mkdtemp(prefix="dborder-%s-" % order)
    cfg = du.base_config(tmp, models, status__port=du.free_port(), engine__backend="cuda",
                         engine__sms_free=64, engine__max_channels=4)
    path = os.pathsep.join(p for p in sys.path if p)
    d = du.Daemon(tmp, cfg)
    child = None
    try:
        if order == "after":
            d.start()
        child = subprocess.Popen([sys.executable, "-c", CHILD, path], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert child.stdout.readline().strip() == "ctx"
        if order == "before":
            d.start()
        child.stdin.write(d.sock_path + "\n")
        child.stdin.flush()
        t0 = time.monotonic()
        try:
            out, _ = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
        print("order %-6s (%.1f s, exit %s):\n  %s" % (order, time.monotonic() - t0,
              child.returncode, "\n  ".join(out.strip().splitlines()[-25:])), flush=True)
        print("  daemon log tail:\n    " + "\n    ".join(d.log().splitlines()[-6:]), flush=True)
    finally:
        if child and child.poll() is None:
            child.kill()
        # SIGTERM: a moed SIGKILLed with its kernel resident gives the next
        # MPS client a fatal error (bench/NOTES.md, 2026-12-01 late)
        if d.proc is not None and d.alive():
            d.stop()
        d.kill()
    time.sleep(2)


def main():
    models = tempfile.mkdtemp(prefix="dborder-models-")
    for order in sys.argv[1:] or ["after", "before"]:
        run(order, models)


if __name__ == "__main__":
    main()
