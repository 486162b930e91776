#!/usr/bin/env python3
"""Probe (GPU machine, under MPS): which doorbell calls does moed answer?
tests/gpu/test_doorbell_model.py's first call (T = 2, no flags) is answered
and its model's calls after it are not; this makes those calls one at a time
on one DoorbellSession, each with a 3 s call timeout, and prints each call's
err word, ring words and time, on the synthetic tiny model and on the e2e
test's Qwen3-MoE checkpoint (H = 64, max_tokens 16). Calls: T = 2, then
T = 2 with empty_slots (the plugins' flag), T = 16, T = 16 from fp32 x and
int64 ids (as the model's router gives them), T = 7, T = 2 again.
This process makes no CUDA context (the child does). Usage, from the tree
root with MPS started (scripts/mps.sh) and MOED_BUILD set:
  python3 scripts/probe_doorbell_calls.py [tiny] [qwen3]
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
sys.path[:0] = sys.argv[2].split(":")
faulthandler.dump_traceback_later(60, exit=True)
import torch
import moed_client as mc, moed_client.cuda as mcc
s = mcc.DoorbellSession(mc.Client(sys.argv[1], timeout=30), timeout_s=3)
info = s.info
print("session: H %d k %d E %d max_tokens %d layers %s" % (info.hidden, info.top_k,
      info.n_experts, s.max_tokens, info.moe_layers), flush=True)
def call(name, T, empty=False, f32=False, i64=False):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, info.hidden, generator=g)
    x = (x if f32 else x.to(torch.bfloat16)).cuda()
    ids = torch.stack([torch.randperm(info.n_experts, generator=g)[:info.top_k]
                       for _ in range(T)]).to(torch.int64 if i64 else torch.int32).cuda()
    w = torch.rand(T, info.top_k, generator=g).cuda()
    t0 = time.monotonic()
    y = s.fused_experts(x, w, ids, info.moe_layers[0], empty_slots=empty)
    torch.cuda.synchronize()
    dt = time.monotonic() - t0
    print("%-28s %.3f s err %#x ring %s finite %s" % (name, dt, s.channel.error_word(),
          s.channel.ring(), bool(torch.isfinite(y.float()).all())), flush=True)
    s.check()  # resets the err word
for args in (("T=2", 2), ("T=2 empty_slots", 2, True), ("T=16", 16),
             ("T=16 fp32 x, int64 ids", 16, False, True, True), ("T=7", 7), ("T=2 again", 2)):
    if args[1] > s.max_tokens:
        continue
    try:
        call(*args)
    except Exception as e:
        print("%-28s raised %s" % (args[0], e), flush=True)
s.close()
print("closed", flush=True)
"""


def qwen3_ckpt(tmp):
    import torch
    import test_e2e_transformers as e2e
    import transformers
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(e2e.CONFIGS["qwen3_moe"]()).eval()
    d = os.path.join(tmp, "ckpt")
    e2e.write_checkpoint(model, d)
    return d, e2e.MAX_TOKENS


def run(name, models):
    tmp = tempfile.mkdtemp(prefix="dbcalls-%s-" % name)
    over = dict(status__port=du.free_port(), engine__backend="cuda", engine__sms_free=64,
                engine__max_channels=4)
    if name == "qwen3":
        over["model__path"], over["engine__max_tokens"] = qwen3_ckpt(tmp)
    else:
        over["engine__max_tokens"] = 16
    d = du.Daemon(tmp, du.base_config(tmp, models, **over))
    d.start()
    try:
        path = os.pathsep.join(p for p in sys.path if p)
        t0 = time.monotonic()
        try:
            out = subprocess.run([sys.executable, "-c", CHILD, d.sock_path, path], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 timeout=90).stdout
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or "") + "\n(killed after 90 s)"
        print("== %s (%.1f s):\n  %s" % (name, time.monotonic() - t0,
              "\n  ".join(out.strip().splitlines()[-30:])), flush=True)
        print("  daemon log tail:\n    " + "\n    ".join(d.log().splitlines()[-8:]), flush=True)
    finally:
        print("  daemon stopped with SIGTERM: exit %s" % d.stop(), flush=True)
        d.kill()
    time.sleep(2)


def main():
    models = tempfile.mkdtemp(prefix="dbcalls-models-")
    for name in sys.argv[1:] or ["tiny", "qwen3"]:
        run(name, models)


if __name__ == "__main__":
    main()
