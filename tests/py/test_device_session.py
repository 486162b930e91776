"""scripts/device-session.sh's check of its steps: a call whose pick=V,
picked:STEP, gate=V or gated:STEP lacks what it needs is refused with exit 2 and a message naming
the step, before any step runs or the last call's logs in /tmp/session are
touched (so it runs here, with no GPU)."""
import os
import subprocess

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "device-session.sh")
V = "nosuchvariant"  # no build-V exists in a checkout


@pytest.mark.parametrize("steps, message", [
    (["picked:test"], "device-session: picked:test needs pick=V before it in the same call"),
    (["h200:picked:test"], "device-session: picked:test needs pick=V before it in the same call"),
    ([f"check={V}", f"variants=base,{V}", "picked:bench", f"pick={V}"],
     "device-session: picked:bench needs pick=V before it in the same call"),
    ([f"variants=base,{V}", f"pick={V}"],
     f"device-session: pick={V} needs check={V} before it in the same call"),
    ([f"check={V}", f"variants={V}", f"pick={V}"],
     f"device-session: pick={V} needs variants=base,... before it in the same call"),
    ([f"check={V}", "variants=base", f"pick={V}"],
     f"device-session: pick={V} needs variants=...,{V} before it in the same call"),
    ([f"check={V}", f"h200:variants=base,{V}", f"pick={V}"],
     f"device-session: pick={V} needs build-{V} (a full CUDA=1 build of {V}'s tree, carried)"),
    (["gated:bench"], "device-session: gated:bench needs gate=V before it in the same call"),
    ([f"variants=base,{V}", "h200:gated:bench", f"gate={V}"],
     "device-session: gated:bench needs gate=V before it in the same call"),
    ([f"variants={V}", f"gate={V}"],
     f"device-session: gate={V} needs variants=base,... before it in the same call"),
    (["variants=base", f"gate={V}"],
     f"device-session: gate={V} needs variants=...,{V} before it in the same call"),
    ([f"variants=base,{V}", f"gate={V}"],
     f'device-session: gate={V} needs GATE (its rules, e.g. GATE="*<=1.0")'),
    (["variants=base", "gate=base", "GATE=*<=1.0"],
     "device-session: gate=base: bad variant name 'base'"),
    ([f"variants=base,{V}", f"gate={V}", "gated:bench", "GATE=deepseek-v3:256<0.98"],
     f"device-session: gate={V}: bad rule 'deepseek-v3:256<0.98': want MODEL:T<=R or *<=R"),
])
def test_refused_before_any_step(steps, message):
    # a stand-in for the last call's logs: a refused call must leave them
    sess = "/tmp/session"
    os.makedirs(sess, exist_ok=True)
    mark = os.path.join(sess, f"kept-{os.getpid()}")
    with open(mark, "w") as f:
        f.write("last call\n")
    try:
        env = dict(os.environ)
        env.pop("GATE", None)
        env.update(s.split("=", 1) for s in steps if s.startswith("GATE="))
        steps = [s for s in steps if not s.startswith("GATE=")]
        r = subprocess.run(["bash", SCRIPT, *steps], capture_output=True, text=True, timeout=60,
                           env=env)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert r.stderr.strip() == message
        assert r.stdout == ""
        assert os.path.exists(mark)
    finally:
        if os.path.exists(mark):
            os.unlink(mark)
