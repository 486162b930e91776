#!/usr/bin/env python3
"""Probe (GPU machine, under MPS): does a client process's end take moed
down (SIGKILL, or its own exit), and does it matter what the client was doing
on the GPU?

For each mode, a fresh daemon (backend cuda, engine.sms_free 64), N child
processes started and then killed with SIGKILL at once (or left to exit),
then: is the daemon alive, does /status answer, does an inline FORWARD still
return? Modes:
  idle    a DoorbellSession opened, one call made, synchronized, then sleep
          (no kernel of the child's running when it dies)
  torch   no moed at all: a CUDA graph of matmuls replayed in a loop (the
          child's kernels running when it dies, none of them moed's)
  graph   a DoorbellSession's graph of 50 calls replayed in a loop (as
          tests/gpu/test_doorbell.py's killed-client test)
  exit    torch's graph of matmuls replayed 20 times, synchronized, and the
          process exits by itself (a serving engine's clean shutdown)
  exitbusy  the same graph replayed 20 times and the process exits at once,
          its work still queued (os._exit, no synchronize)
This process makes no CUDA context of its own (the MPS server recovers from a
fatal error only once every client has gone). Usage, from the tree root with
MPS started (scripts/mps.sh) and MOED_BUILD set:
  python3 scripts/probe_mps_kill.py [modes...] [--kills N]  (N clients per mode)
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "py"), os.path.join(ROOT, "ipc", "python")]

import daemon_util as du  # noqa: E402
import moed_client as mc  # noqa: E402
import numpy as np  # noqa: E402

HEAD = r"""
import sys, time
sys.path[:0] = sys.argv[2].split(":")
import torch
"""
SESSION = r"""
import moed_client as mc, moed_client.cuda as mcc
s = mcc.DoorbellSession(mc.Client(sys.argv[1], timeout=60), max_tokens=4)
x = torch.randn(2, s.info.hidden, device="cuda").to(torch.bfloat16)
ids = torch.zeros(2, s.info.top_k, dtype=torch.int32, device="cuda")
w = torch.ones(2, s.info.top_k, device="cuda")
s.fused_experts(x, w, ids, s.info.moe_layers[0])
torch.cuda.synchronize()
"""
CHILD = {
    "idle": HEAD + SESSION + r"""
print("ready", flush=True)
while True:
    time.sleep(1)
""",
    "torch": HEAD + r"""
a = torch.randn(1024, 1024, device="cuda")
torch.tanh(a @ a)  # cuBLAS set up before the capture
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    b = a
    for _ in range(50):
        b = torch.tanh(b @ a)
g.replay()
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    g.replay()
""",
    "graph": HEAD + SESSION + r"""
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(50):
        s.fused_experts(x, w, ids, s.info.moe_layers[0])
g.replay()
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    g.replay()
""",
}
CHILD["exit"] = CHILD["torch"].replace("while True:\n    g.replay()\n",
                                       "for _ in range(20):\n    g.replay()\n"
                                       "torch.cuda.synchronize()\n")
CHILD["exitbusy"] = CHILD["torch"].replace("while True:\n    g.replay()\n",
                                           "for _ in range(20):\n    g.replay()\n"
                                           "import os\nos._exit(0)\n")


def inline_ok(sock):
    with mc.Client(sock, timeout=du.wait_s(20)) as c:
        info = c.hello()
        rng = np.random.default_rng(1)
        x = rng.standard_normal((2, info.hidden), dtype=np.float32)
        ids = np.array([[0, 1], [1, 0]][:2], dtype=np.int32)[:, :info.top_k]
        w = np.ones((2, info.top_k), dtype=np.float32)
        y = np.asarray(c.forward(info.moe_layers[0], x, ids, w))
        return bool(np.isfinite(y.astype(np.float32)).all())


def run(mode, kills, models):
    tmp = tempfile.mkdtemp(prefix="mpskill-%s-" % mode)
    cfg = du.base_config(tmp, models, status__port=du.free_port(), engine__backend="cuda",
                         engine__sms_free=64, engine__max_channels=16, server__max_clients=64)
    path = os.pathsep.join(p for p in sys.path if p)
    with du.Daemon(tmp, cfg) as d:
        procs = [subprocess.Popen([sys.executable, "-c", CHILD[mode], d.sock_path, path],
                                  stdout=subprocess.PIPE, text=True) for _ in range(kills)]
        lines = [p.stdout.readline().strip() for p in procs]
        t0 = time.monotonic()
        for p in procs:
            if not mode.startswith("exit"):
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
        time.sleep(3)
        alive = d.alive()
        try:
            ok = alive and inline_ok(d.sock_path)
        except Exception as e:  # noqa: BLE001 (a probe reports whatever happened)
            ok = "error: %s" % e
        tail = [ln for ln in d.log().splitlines() if "ERROR" in ln or "illegal" in ln][:3]
        print("mode %-8s clients %d (ready %d): daemon alive %s, inline forward after: %s%s"
              % (mode, kills, lines.count("ready"), alive, ok,
                 "".join("\n    " + ln for ln in tail)), flush=True)
        print("    %.1f s after the clients' end; daemon stopped with SIGTERM: exit %s"
              % (time.monotonic() - t0, d.stop() if d.alive() else d.proc.returncode), flush=True)
    time.sleep(3)  # the MPS server recreates its context once every client has gone


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("modes", nargs="*", default=["torch", "idle", "graph", "exit", "exitbusy"])
    ap.add_argument("--kills", type=int, default=10)
    a = ap.parse_args()
    models = tempfile.mkdtemp(prefix="mpskill-models-")
    for m in a.modes:
        run(m, a.kills, models)


if __name__ == "__main__":
    main()
