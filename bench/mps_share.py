"""moed and a serving engine on one GPU under MPS: moed's kernel time and the
engine's own step time against moed's share of the SMs (`make bench`, run by
scripts/run-bench.sh under MPS; docs/ZERO_COPY.md mode 1).

For each engine.sms_free in BENCH_MPS_SMS_FREE (SMs moed's persistent kernel
leaves to the engine), moed serves one synthetic layer of BENCH_MPS_MODEL
(qwen3-30b-a3b); this process plays the engine: a CUDA graph of
BENCH_MPS_LAYERS layers, each a dense part (bf16 [T, H] x [H, H] GEMMs,
BENCH_MPS_GEMMS of them, the attention and projections of a decode layer in
miniature) followed by the layer's MoE call through the doorbell
(DoorbellSession.fused_experts). Measured per layer (CUDA events around
graph replays, p50 of BENCH_MPS_REPS replays): the dense part alone (a graph
without the MoE calls, moed's kernel resident and idle), the whole layer,
and moed's kernel time of the same calls (/status channels: kernel seconds /
requests). over = layer - dense - kernel: what sharing and the doorbell add.
BENCH_MPS_SMS_FREE defaults to 44,66,99 (16 SMs free failed once and hung
twice on the H200, 2026-12-02: name it to try again); each share's figures
are printed as it ends, and a share that takes over BENCH_MPS_CASE_S (150)
seconds prints every thread's stack (the caller's timeout ends it:
scripts/run-bench.sh BENCH_MPS_TIMEOUT). Prints a markdown table.
"""

import faulthandler
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_copy import chan_kernel, du, mc, mcc, p50, status  # noqa: E402 (the three-path bench's helpers)


def replay_us(torch, g, reps):
    for _ in range(3):
        g.replay()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(reps)]
    for e0, e1 in evs:
        e0.record()
        g.replay()
        e1.record()
    torch.cuda.synchronize()
    return p50([e0.elapsed_time(e1) * 1e3 for e0, e1 in evs])


def one_share(torch, sms_free, model, tmp, T, layers, gemms, reps):
    dd = os.path.join(tmp, "d%d" % sms_free)
    os.makedirs(dd, exist_ok=True)
    cfg = du.base_config(dd, os.path.join(tmp, "models"), status__port=du.free_port(),
                         engine__backend="cuda", engine__max_tokens=max(T, 16),
                         engine__sms_free=sms_free, engine__batch_deadline_ms=60000)
    cfg["model"]["path"] = "synthetic:%s:layers=1:seed=3" % model
    with du.Daemon(dd, cfg, start_timeout=600 / du.TIME_SCALE) as d:
        try:
            return measure(torch, d, T, layers, gemms, reps)
        except (mc.MoedError, KeyError) as e:  # with what the daemon said
            raise RuntimeError("%s\n# its log's tail:\n%s" % (e, d.log()[-1200:])) from e
        finally:
            d.stop(60)


def measure(torch, d, T, layers, gemms, reps):
    sess = mcc.DoorbellSession(mc.Client(d.sock_path, timeout=120), max_tokens=max(T, 16))
    try:
        info = sess.info
        layer = info.moe_layers[0]
        H = info.hidden
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        wd = [(torch.randn(H, H, device="cuda", generator=g) / H ** 0.5).to(torch.bfloat16)
              for _ in range(gemms)]
        ids = torch.stack([torch.randperm(info.n_experts, device="cuda", generator=g)
                           [:info.top_k] for _ in range(T)]).to(torch.int32)
        w = torch.rand(T, info.top_k, device="cuda", generator=g)

        def step(with_moe):
            h = x
            for _ in range(layers):
                for m in wd:
                    h = h @ m
                if with_moe:
                    h = h + sess.fused_experts(h, w, ids, layer)
            return h

        graphs = {}
        for with_moe in (False, True):
            step(with_moe)
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                step(with_moe)
            graphs[with_moe] = gr
        dense = replay_us(torch, graphs[False], reps) / layers
        n0, k0 = chan_kernel(status(d), sess.channel.chan_id)
        total = replay_us(torch, graphs[True], reps) / layers
        sess.check()
        n1, k1 = chan_kernel(status(d), sess.channel.chan_id)
        kern = (k1 - k0) * 1e6 / (n1 - n0) if n1 > n0 else float("nan")
        return dense, total, kern
    finally:
        sess.close()


def main():
    import torch
    if not torch.cuda.is_available():
        print("mps_share bench: no CUDA device")
        return 1
    shares = [int(s) for s in os.environ.get("BENCH_MPS_SMS_FREE", "44,66,99").split(",")]
    model = os.environ.get("BENCH_MPS_MODEL", "qwen3-30b-a3b")
    T = int(os.environ.get("BENCH_MPS_TOKENS", "16"))
    layers = int(os.environ.get("BENCH_MPS_LAYERS", "8"))
    gemms = int(os.environ.get("BENCH_MPS_GEMMS", "4"))
    reps = int(os.environ.get("BENCH_MPS_REPS", "50"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        for s in shares:
            # a share that hangs (a GPU wait that never ends) shows where:
            # every thread's Python stack after BENCH_MPS_CASE_S
            print("# engine.sms_free %d ..." % s, flush=True)
            faulthandler.dump_traceback_later(int(os.environ.get("BENCH_MPS_CASE_S", "150")))
            try:
                rows.append((s,) + one_share(torch, s, model, tmp, T, layers, gemms, reps))
                print("# engine.sms_free %d: dense %.1f, layer %.1f, moed kernel %.1f us"
                      % ((s,) + rows[-1][1:]), flush=True)
            except (RuntimeError, mc.MoedError, KeyError) as e:
                print("# engine.sms_free %d failed: %s" % (s, str(e)[-1500:]), flush=True)
                failed = True
            finally:
                faulthandler.cancel_dump_traceback_later()
    print()
    print("moed and an engine on one GPU under MPS: %s, T = %d, per layer: %d bf16 GEMMs "
          "[%d, H] x [H, H] then the MoE call through the doorbell, a graph of %d layers, "
          "p50 of %d replays (us)" % (model, T, gemms, T, layers, reps))
    print()
    print("| engine.sms_free | moed's SMs | dense part alone | layer (dense + MoE) | "
          "moed kernel | over |")
    print("|---:|---:|---:|---:|---:|---:|")
    for s, dense, total, kern in rows:
        print("| %d | %d of %d | %.1f | %.1f | %.1f | %.1f |"
              % (s, sms - s, sms, dense, total, kern, total - dense - kern))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
