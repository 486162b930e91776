"""bench_moe's environment settings (bench/bench_moe.c): a value that is not one
refuses the run with exit 2 and a message naming the variable and the value,
before anything touches the GPU (so this runs wherever the CUDA build linked
bench_moe, as CI's does)."""
import os
import subprocess

import pytest

from conftest import BUILD

BENCH = os.path.join(BUILD, "bench", "bench_moe")

pytestmark = pytest.mark.skipif(not os.access(BENCH, os.X_OK),
                                reason="bench_moe not built (a CUDA=1 build makes it)")


@pytest.mark.parametrize("env, message", [
    ({"BENCH_PROFILE_RANGE": "2"}, "BENCH_PROFILE_RANGE=2: not 0, 1 or busy"),
    ({"BENCH_PROFILE_RANGE": "Busy"}, "BENCH_PROFILE_RANGE=Busy: not 0, 1 or busy"),
    ({"BENCH_PROFILE_MS": "0"}, "BENCH_PROFILE_MS=0: not a number of ms in [1, 60000]"),
    ({"BENCH_PROFILE_MS": "500ms"}, "BENCH_PROFILE_MS=500ms: not a number of ms in [1, 60000]"),
    ({"BENCH_ENERGY_MS": "-1"}, "BENCH_ENERGY_MS=-1: not a number of ms in [0, 60000]"),
    ({"BENCH_ENERGY_MS": "60001"}, "BENCH_ENERGY_MS=60001: not a number of ms in [0, 60000]"),
])
def test_bad_setting_refused(env, message):
    e = dict(os.environ)
    for k in ("BENCH_PROFILE_RANGE", "BENCH_PROFILE_MS", "BENCH_ENERGY_MS"):
        e.pop(k, None)
    e.update(env)
    r = subprocess.run([BENCH, "--preset", "tiny", "--tokens", "1"], env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == message
