"""Probe the daemon with one large batch per MoE layer, on this machine's
backend (MOED_TEST_BACKEND, MOED_BUILD as for the tests), optionally under
compute-sanitizer memcheck: the tool that found the h-buffer overread of
2026-12-01 (bench/NOTES.md). On the GPU machine, after
`BUILD=build-cuda scripts/device-gpu.sh prepare` here:

    LD_LIBRARY_PATH=$PWD/.device/lib PYTHONPATH=$PWD/ipc/python MOED_BUILD=build-cuda \
        MOED_TEST_BACKEND=cuda python3 scripts/daemon_probe.py T [san] [nopin|l1]

T: tokens per request (engine.max_tokens = T); san: run moed under
compute-sanitizer (its report in $OUT/san-T.txt; with the pinned pool on it
also reports its known false positive on buffers pinned after the launch,
so add nopin); nopin: server.pinned_pool_bytes 0; l1: a one-layer model.
Prints each layer's result and the daemon's WARN/ERROR lines."""
import os, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "py"))
import numpy as np
import daemon_util as du
import moed_client as mc
T = int(sys.argv[1]); san = len(sys.argv) > 2 and sys.argv[2] == "san"
variant = sys.argv[-1] if sys.argv[-1] in ("nopin", "l1") else ""
tmp = tempfile.mkdtemp()
models = os.path.join(tmp, "models")
if san:
    os.environ["REAL_MOED"] = du.MOED
    os.environ["SAN_LOG"] = os.path.join(os.environ.get("OUT", tmp), "san-%d.txt" % T)
    wrap = os.path.join(tmp, "wrap.sh")
    with open(wrap, "w") as f:
        f.write('#!/bin/sh\nexec compute-sanitizer --tool memcheck --print-limit 5 '
                '--log-file "$SAN_LOG" "$REAL_MOED" "$@"\n')
    os.chmod(wrap, 0o755)
    du.MOED = wrap
cfg = du.base_config(tmp, models, engine__max_tokens=max(T, 64), server__max_frame_bytes=64 << 20,
                     server__max_client_buffer_bytes=64 << 20, server__frame_timeout_ms=60000,
                     engine__batch_deadline_ms=60000)
if variant == "nopin":
    cfg["server"]["pinned_pool_bytes"] = 0
if variant == "l1":
    cfg["model"]["path"] = "synthetic:tiny:layers=1:seed=7"
print("variant", variant or "base")
d = du.Daemon(tmp, cfg, start_timeout=200)
d.start()
try:
    with mc.Client(d.sock_path, timeout=120) as c:
        info = c.hello()
        rng = np.random.default_rng(5)
        x = (rng.standard_normal((T, info.hidden)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        ids = np.stack([rng.choice(info.n_experts, info.top_k, replace=False) for _ in range(T)]).astype(np.int32)
        w = rng.random((T, info.top_k)).astype(np.float32)
        for layer in info.moe_layers:
            try:
                y = c.forward(layer, x, ids, w)
                print("T", T, "layer", layer, "ok", y.shape)
            except mc.MoedError as e:
                print("T", T, "layer", layer, "ERR", e)
                break
finally:
    if san:
        try:
            d.proc.wait(timeout=90)
        except Exception:
            pass
    d.kill()
    print("".join(l for l in d.log().splitlines(True) if "ERROR" in l or "WARN" in l)[-2000:])
