"""GPU: expert parallelism across daemons (an NCCL group, engine.nccl_ranks;
docs/MULTI_GPU.md "Across hosts"), two processes on one host standing in for
two hosts.

Two modes. MOED_TEST_MPS=1 (scripts/run-gpu-tests.sh step 8): both ranks on
GPU 0 under MPS, as below. MOED_TEST_NCCL_GPUS=2 (step 4d, two GPUs, no MPS):
rank r on GPU r, NCCL choosing its own transport between them (no
NCCL_HOSTID), and the same tests plus SIGKILL of either rank (a killed
process with a resident kernel would fault the other MPS clients of its GPU,
so the one-GPU mode stops the peer with SIGSTOP only): the survivor is no
longer ready and exits with 4 within its timeout.

Both ranks run on the one GPU of the test machine: under MPS (started by
scripts/run-gpu-tests.sh), each leaving SMs free for the other's kernel and
for NCCL's (engine.sms_free), with MOED_TEST_MPS_NO_LOCK (a second moed on an
MPS GPU is otherwise refused) and a distinct NCCL_HOSTID each, so that NCCL
takes them for two hosts (else it refuses two ranks on one GPU) and moves the
data through its socket transport over loopback, as between hosts.

- rank 0 answers every MoE layer at T = 1, 4, 16, 64 and 256 bit for bit as
  one daemon on the GPU does, with a skewed map (rank 1 holds two experts,
  one of them also on rank 0), the bootstrap through engine.nccl_id_file;
  rank 1 refuses client batches; rank 0's clean stop ends rank 1 (exit 4);
- the same through NCCL's environment bootstrap (NCCL_COMM_ID);
- a peer that stops answering (SIGSTOP): rank 0's batch fails, it is no
  longer ready and exits with 4 within engine.nccl_timeout_ms; once resumed
  the peer finds rank 0 gone and exits with 4 too; with rank 0's kernel
  idling out and with it resident;
- a group that never forms: rank 0 alone exits with 4 after the timeout, a
  worker with no id file says rank 0 never wrote it.

On one GPU each rank's persistent kernel runs on its own green-context
partition of 48 SMs (engine.sms_free 80; rank n takes partition n), so both
are resident whole and 36 SMs stay free for NCCL's kernels.

numpy only (no torch). MOED_TEST_MPS=1 or MOED_TEST_NCCL_GPUS=2 is required
(skips otherwise; SIGKILL only with the second); MOED_TEST_NCCL_DEBUG sets
the ranks' NCCL_DEBUG (default WARN).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "py"))

import daemon_util as du  # noqa: E402

np = pytest.importorskip("numpy")
import moed_client as mc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ep_cases import TOKENS, batches, differ, skewed_map  # noqa: E402

TWO_GPUS = os.environ.get("MOED_TEST_NCCL_GPUS") == "2"
if not os.path.exists(du.MOED) or not (TWO_GPUS or os.environ.get("MOED_TEST_MPS") == "1"):
    pytest.skip("needs a CUDA build of moed and MPS on the GPU (MOED_TEST_MPS=1) or two GPUs "
                "(MOED_TEST_NCCL_GPUS=2)", allow_module_level=True)

SMS_FREE = 80  # each rank's kernel on a 48-SM partition of its own, 36 SMs for NCCL's
EXIT_BACKEND = 4


def cfg_for(tmp, models, gpu=0, **over):
    kw = dict(status__port=du.free_port(), engine__backend="cuda", engine__sms_free=SMS_FREE,
              engine__max_tokens=max(TOKENS), server__max_frame_bytes=4 << 20,
              server__max_client_buffer_bytes=16 << 20)
    if TWO_GPUS:
        kw["engine__gpus"] = [gpu]
    kw.update(over)
    return du.base_config(str(tmp), models, **kw)


def rank_env(rank, extra=None):
    env = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": os.environ.get("MOED_TEST_NCCL_DEBUG", "WARN")}
    if not TWO_GPUS:  # two ranks on one GPU: NCCL must take them for two hosts
        env.update({"MOED_TEST_MPS_NO_LOCK": "1", "NCCL_HOSTID": "moed-test-host-%d" % rank})
    env.update(extra or {})
    return env


def start_group(daemons):
    """Start every rank at once (each blocks until the group forms)."""
    errs = []

    def go(d):
        try:
            d.start()
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=go, args=(d,)) for d in daemons]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        for d in daemons:
            d.kill()
        raise errs[0]


def run_cases(sock, cases):
    with mc.Client(sock, timeout=du.wait_s(120)) as c:
        return [np.asarray(c.forward(layer, x, ids, w, routed_only=ro, empty_slots=em))
                .view(np.uint16).copy() for layer, t, ro, em, x, ids, w in cases]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(models dir, hello info, cases, one daemon's outputs) on the GPU alone."""
    models = du.models_dir(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("one")
    with du.Daemon(tmp, cfg_for(tmp, models), env=rank_env(0)) as d:
        with mc.Client(d.sock_path, timeout=du.wait_s(60)) as c:
            info = c.hello()
        cases = batches(info, 2026)
        want = run_cases(d.sock_path, cases)
        assert d.stop() == 0, d.log()[-4000:]
    return models, info, cases, want


def group(tmp, models, n=2, env=None, **over):
    ds = []
    for r in range(n):
        d = tmp / ("rank%d" % r)
        d.mkdir()
        cfg = cfg_for(d, models, gpu=r if TWO_GPUS else 0, engine__nccl_ranks=n,
                      engine__nccl_rank=r, **over)
        ds.append(du.Daemon(d, cfg, env=rank_env(r, env)))
    return ds


def test_two_ranks_equal_one_daemon_bit_for_bit(tmp_path, reference):
    models, info, cases, want = reference
    pmap = tmp_path / "placement.json"
    skewed_map(info, pmap)
    idf = tmp_path / "nccl.id"
    r0, r1 = group(tmp_path, models, engine__nccl_id_file=str(idf),
                   engine__placement=str(pmap))
    start_group([r1, r0])
    try:
        assert idf.exists(), r0.log()[-3000:]
        assert "expert parallelism over the 2 ranks of an NCCL group" in r0.log()
        assert "serving rank 0" in r1.log()
        got = run_cases(r0.sock_path, cases)
        bad = differ(cases, got, want)
        assert not bad, bad
        # rank 1 computes for rank 0 only
        layer, t, ro, em, x, ids, w = cases[0]
        with mc.Client(r1.sock_path, timeout=du.wait_s(30)) as c:
            with pytest.raises(mc.MoedError) as ei:
                c.forward(layer, x, ids, w)
        assert ei.value.code == -17 and "refused" in ei.value.message, \
            str(ei.value)
        assert r0.stop() == 0, r0.log()[-4000:]
        assert not idf.exists(), "rank 0 left its id file behind"
        # rank 0's clean stop ends the group: the worker stops, code 4
        assert r1.wait(60) == EXIT_BACKEND, r1.log()[-4000:]
        assert "rank 0 ended the group" in r1.log(), r1.log()[-3000:]
    finally:
        r0.kill()
        r1.kill()


def test_environment_bootstrap(tmp_path, reference):
    models, info, cases, want = reference
    sub = [c for c in cases if c[1] in (1, 64)]
    sub_want = [w for c, w in zip(cases, want) if c[1] in (1, 64)]
    env = {"NCCL_COMM_ID": "127.0.0.1:%d" % du.free_port()}
    r0, r1 = group(tmp_path, models, env=env)
    start_group([r0, r1])
    try:
        got = run_cases(r0.sock_path, sub)
        assert not differ(sub, got, sub_want)
        assert r0.stop() == 0, r0.log()[-4000:]
        assert r1.wait(60) == EXIT_BACKEND, r1.log()[-4000:]
    finally:
        r0.kill()
        r1.kill()


@pytest.mark.parametrize("r0_kernel", ["idles-out", "resident"])
def test_peer_that_stops_answering_fails_rank_0(tmp_path, reference, r0_kernel):
    """resident: rank 0's persistent kernel never idles out (engine.idle_exit_ms
    0), so it is resident when rank 0 aborts the communicator (NCCL's abort
    frees host buffers, which waits for the process's kernels: a worker hung
    there at its close until it stopped its kernel first)."""
    models, info, cases, _ = reference
    timeout_ms = 3000
    r0, r1 = group(tmp_path, models, engine__nccl_id_file=str(tmp_path / "nccl.id"),
                   engine__nccl_timeout_ms=timeout_ms, engine__nccl_keepalive_ms=300,
                   engine__idle_exit_ms=50)
    if r0_kernel == "resident":
        r0.cfg["engine"]["idle_exit_ms"] = 0
    start_group([r1, r0])
    try:
        # T >= 2 with the shared experts: token 1's shared slot is rank 1's
        layer, t, ro, em, x, ids, w = next(c for c in cases if c[1] >= 2 and not c[2])
        run_cases(r0.sock_path, cases[:6])  # the group works
        time.sleep(0.5)  # rank 1's kernel idles out (no resident kernel when stopped)
        os.kill(r1.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with mc.Client(r0.sock_path, timeout=du.wait_s(60)) as c:
            try:
                c.forward(layer, x, ids, w)
                answered = "answered"
            except (mc.MoedError, OSError) as e:
                answered = str(e)
        code = r0.wait(du.wait_s(timeout_ms / 1000 * 3 + 30))
        took = time.monotonic() - t0
        log0 = r0.log()
        assert answered != "answered", log0[-3000:]
        assert code == EXIT_BACKEND, log0[-4000:]
        assert "the peer stopped answering" in log0 or "not done within" in log0, log0[-3000:]
        print("rank 0 exited %d, %.1f s after rank 1 stopped (timeout %d ms)"
              % (code, took, timeout_ms))
        os.kill(r1.pid, signal.SIGCONT)
        assert r1.wait(du.wait_s(timeout_ms / 1000 * 3 + 30)) == EXIT_BACKEND, r1.log()[-4000:]
    finally:
        try:
            os.kill(r1.pid, signal.SIGCONT)
        except OSError:
            pass
        r0.kill()
        r1.kill()


def test_group_that_never_forms(tmp_path, reference):
    models, *_ = reference
    r0, r1 = group(tmp_path, models, engine__nccl_id_file=str(tmp_path / "nccl.id"),
                   engine__nccl_timeout_ms=2000, engine__nccl_keepalive_ms=200)
    for d, want in ((r0, "the group did not form within engine.nccl_timeout_ms (2000 ms)"),
                    (r1, "rank 0 did not write it within engine.nccl_timeout_ms (2000 ms)")):
        with open(d.cfg_path, "w") as f:
            json.dump(d.cfg, f)
        env = dict(os.environ)
        env.update(d.env)
        p = subprocess.run([du.MOED, "--config", d.cfg_path], capture_output=True, text=True,
                           env=env, timeout=du.wait_s(180))
        assert p.returncode == EXIT_BACKEND, p.stdout[-2000:] + p.stderr[-2000:]
        assert want in p.stdout + p.stderr, p.stdout[-2000:] + p.stderr[-2000:]


@pytest.mark.skipif(not TWO_GPUS, reason="SIGKILL of a rank: two GPUs only (MOED_TEST_NCCL_GPUS=2)")
@pytest.mark.parametrize("killed", [1, 0])
def test_killed_rank_ends_the_other(tmp_path, reference, killed):
    """SIGKILL of rank `killed` (its kernel resident: no idle exit): the other
    rank stops being ready and exits with 4 within its timeout (rank 0 at its
    next batch, the worker when rank 0's keepalive pings stop)."""
    models, info, cases, _ = reference
    timeout_ms = 3000
    r0, r1 = group(tmp_path, models, engine__nccl_id_file=str(tmp_path / "nccl.id"),
                   engine__nccl_timeout_ms=timeout_ms, engine__nccl_keepalive_ms=300)
    start_group([r1, r0])
    try:
        run_cases(r0.sock_path, cases[:6])  # the group works
        dead, other = (r1, r0) if killed == 1 else (r0, r1)
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(du.wait_s(30))
        t0 = time.monotonic()
        if killed == 1:
            layer, t, ro, em, x, ids, w = next(c for c in cases if c[1] >= 2 and not c[2])
            with mc.Client(r0.sock_path, timeout=du.wait_s(60)) as c:
                with pytest.raises((mc.MoedError, OSError)):
                    c.forward(layer, x, ids, w)
        code = other.wait(du.wait_s(timeout_ms / 1000 * 3 + 30))
        took = time.monotonic() - t0
        assert code == EXIT_BACKEND, other.log()[-4000:]
        print("rank %d exited %d, %.1f s after rank %d was killed (timeout %d ms)"
              % (1 - killed, code, took, killed, timeout_ms))
    finally:
        r0.kill()
        r1.kill()
