"""Doorbell diagnostics on the GPU machine (under MPS): two DoorbellSessions
one after the other in one process, each with a short call timeout; after each
step the channel's bell/done/status words, the err word and /status channels,
and at the end the daemon's log tail. Usage: python3 scripts/doorbell_probe.py"""
import json
import os
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "ipc", "python"), os.path.join(ROOT, "tests", "py")]
import daemon_util as du  # noqa: E402
import moed_client as mc  # noqa: E402
import moed_client.cuda as mcc  # noqa: E402
import torch  # noqa: E402


def st(d):
    with urllib.request.urlopen("http://127.0.0.1:%d/status" % d.http_port(), timeout=10) as r:
        return json.loads(r.read().decode())["channels"]


def main():
    tmp = tempfile.mkdtemp()
    cfg = du.base_config(tmp, os.path.join(tmp, "m"), status__port=du.free_port(),
                         engine__backend="cuda", engine__sms_free=64, engine__max_channels=16)
    with du.Daemon(tmp, cfg) as d:
        for round_ in range(3):
            s = mcc.DoorbellSession(mc.Client(d.sock_path, timeout=30), max_tokens=8,
                                    timeout_s=2.0)
            ch = s.channel
            info = s.info
            print("round %d: chan %d, ring %s" % (round_, ch.chan_id, ch.ring()), flush=True)
            x = torch.randn(4, info.hidden, device="cuda").to(torch.bfloat16)
            ids = torch.zeros(4, info.top_k, dtype=torch.int32, device="cuda")
            w = torch.ones(4, info.top_k, device="cuda")
            for i in range(3):
                t0 = time.perf_counter()
                s.fused_experts(x, w, ids, info.moe_layers[0])
                torch.cuda.synchronize()
                print("  call %d: %.1f ms, err 0x%x, ring %s" % (
                    i, (time.perf_counter() - t0) * 1e3, ch.error_word(), ch.ring()), flush=True)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(10):
                    s.fused_experts(x, w, ids, info.moe_layers[0])
            for r in range(3):
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                print("  replay %d: %.1f ms, err 0x%x, ring %s" % (
                    r, (time.perf_counter() - t0) * 1e3, ch.error_word(), ch.ring()), flush=True)
            print("  status %s" % st(d), flush=True)
            del g
            s.close()
            time.sleep(0.2)
            print("  after close: %s" % {k: v for k, v in st(d).items() if k != "list"}, flush=True)
        print(d.log()[-3000:])


if __name__ == "__main__":
    main()
