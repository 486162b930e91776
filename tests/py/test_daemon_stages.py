"""Per-request stage timing through the real socket: after N FORWARD requests
the /status "stages_us" counters count exactly N, every duration is
non-negative, the stages add up to the total (which they only do when the
timestamps were taken in order) and "added" is total - backend; the same
numbers appear in /metrics. The kernel stages ("kernel", "added_kernel") hold
only requests whose batch's kernel time the backend knew: none on the CPU
backend, every one with its test switch MOED_TEST_CPU_KERNEL_TIME=1 (the batch's
compute time, inside the backend stage). Also the data path behind them: a request whose
frame is all the read buffer holds is computed in place (the buffer is lent to
the engine and comes back as a spare), pipelined ones are copied and merged;
both must give the reference output, with the buffer-keeping and socket-buffer
settings on and off.
"""

import json
import subprocess
import time
import urllib.request

import numpy as np
import pytest

import daemon_util as du
from daemon_util import E, MSG_FORWARD

STAGES = ["recv", "submit", "backend", "reply", "write", "total", "added"]
PARTS = ["recv", "submit", "backend", "reply", "write"]
KERNEL_STAGES = ["kernel", "added_kernel"]  # sampled only with a known kernel time


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models_dir):
    yield from du.module_daemon(tmp_path_factory, models_dir, "stages")


@pytest.fixture(scope="module")
def cases(daemon, dims):
    return du.reference_cases(daemon, dims, n=6, max_t=dims["max_tokens"], seed=5)


def http_get(daemon, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (daemon.http_port(), path),
                                timeout=5) as r:
        return r.read().decode()


def stages(daemon):
    return json.loads(http_get(daemon, "/status"))["stages_us"]


def wait_count(daemon, n, timeout=5.0):
    """The stages of a request are recorded when the last byte of its reply is
    written, which the daemon learns on a loop pass after the client may
    already hold the reply: poll briefly for the count to arrive."""
    deadline = time.monotonic() + timeout
    st = stages(daemon)
    while st["count"] < n and time.monotonic() < deadline:
        time.sleep(0.01)
        st = stages(daemon)
    return st


def forward_reference_cases(d, seed):
    """4 random batches on d's model, 3 times each through the Python client
    (12 requests), each output checked against the float64 reference."""
    import moed_client
    s = d.connect()
    info = du.hello(s)
    s.close()
    cs = du.reference_cases(d, info, n=4, max_t=info["max_tokens"], seed=seed)
    with moed_client.Client(d.sock_path) as c:
        for layer, x, ids, w, ref in cs * 3:
            assert du.rel_l2(c.forward(layer, x, ids, w), ref) < 1e-2


def check_sane(st):
    assert set(st) == {"count", "window"} | set(STAGES) | set(KERNEL_STAGES), st
    assert st["window"] == min(st["count"], 1024)
    for name in STAGES:
        s = st[name]
        assert set(s) == {"p50", "p99", "mean"}, s
        assert 0 <= s["p50"] <= s["p99"], (name, s)
        assert s["mean"] >= 0, (name, s)
    for name in KERNEL_STAGES:
        s = st[name]
        assert set(s) == {"count", "window", "p50", "p99", "mean"}, s
        assert s["count"] == st["kernel"]["count"] <= st["count"], (name, s)
        assert s["window"] == min(s["count"], 1024), (name, s)
        assert 0 <= s["p50"] <= s["p99"] and s["mean"] >= 0, (name, s)
        if s["count"] == 0:
            assert s["p50"] == s["p99"] == s["mean"] == 0, (name, s)
    # The total is at least each of its parts, in every statistic.
    for name in PARTS:
        assert st[name]["p50"] <= st["total"]["p50"] + 1e-6, (name, st)
        assert st[name]["p99"] <= st["total"]["p99"] + 1e-6, (name, st)
        assert st[name]["mean"] <= st["total"]["mean"] + 1e-6, (name, st)


def test_stage_counters_count_requests(daemon, dims, cases):
    import moed_client
    before = wait_count(daemon, 0)
    n = 0
    with moed_client.Client(daemon.sock_path) as c:
        for layer, x, ids, w, ref in cases * 3:
            y = c.forward(layer, x, ids, w)
            assert du.rel_l2(y, ref) < 1e-2
            n += 1
    after = wait_count(daemon, before["count"] + n)
    assert after["count"] == before["count"] + n
    check_sane(after)
    # Over the same requests the parts add up to the total (clamping of an
    # out-of-order stamp would break this) and added = total - backend.
    cnt = after["count"]
    total = after["total"]["mean"] * cnt
    parts = sum(after[p]["mean"] * cnt for p in PARTS)
    assert abs(total - parts) <= 1e-6 * max(total, 1.0) + 0.01, (total, parts)
    added = after["added"]["mean"] * cnt
    backend = after["backend"]["mean"] * cnt
    assert abs(added - (total - backend)) <= 1e-6 * max(total, 1.0) + 0.01, after
    assert after["backend"]["mean"] > 0
    assert after["total"]["p50"] > 0


def test_errors_are_not_timed(daemon, dims):
    """A refused FORWARD is answered with an ERROR and never timed."""
    before = wait_count(daemon, 0)
    s = daemon.connect()
    k, h = dims["top_k"], dims["hidden"]
    x = np.zeros((1, h), np.uint16)
    ids = np.full((1, k), dims["n_experts"], np.int32)  # out of range
    w = np.ones((1, k), np.float32)
    s.sendall(du.frame(MSG_FORWARD, 9, du.forward_payload(dims["first_moe_layer"], x.tobytes(),
                                                          ids, w)))
    du.expect_error(s, E["inval"], "is out of range", rid=9)
    s.close()
    time.sleep(0.05)
    assert stages(daemon)["count"] == before["count"]


def test_status_frame_matches_http_and_metrics(daemon, dims, cases):
    import moed_client
    with moed_client.Client(daemon.sock_path) as c:
        layer, x, ids, w, ref = cases[0]
        c.forward(layer, x, ids, w)
    st = wait_count(daemon, 1)
    with moed_client.Client(daemon.sock_path) as c:
        frame_st = c.status()["stages_us"]
    assert frame_st["count"] == st["count"]
    check_metrics(http_get(daemon, "/metrics"), st)


def check_metrics(metrics, st):
    """/metrics carries the same stage figures as /status (taken when no
    request ran in between): per stage a histogram whose _count is the
    stage's samples, whose _sum / _count is its mean, and whose bucket holding
    the median holds /status's exact p50 (the window is every sample here)."""
    lines = metrics.splitlines()

    def value(prefix):
        hits = [ln for ln in lines if ln.startswith(prefix + " ")]
        assert len(hits) == 1, (prefix, hits)
        return float(hits[0].rsplit(" ", 1)[1])

    fam = "moed_request_stage_seconds"
    assert "# HELP %s " % fam in metrics and "# TYPE %s histogram" % fam in metrics
    for name in STAGES + KERNEL_STAGES:
        n = st[name].get("count", st["count"])
        assert value('%s_count{stage="%s"}' % (fam, name)) == n
        secs = value('%s_sum{stage="%s"}' % (fam, name))
        assert secs >= 0
        mean = secs / n * 1e6 if n else 0.0
        assert abs(mean - st[name]["mean"]) <= 1e-3 * st[name]["mean"] + 0.01, (name, secs, st)
        pre = '%s_bucket{stage="%s",le="' % (fam, name)
        buckets = [(float(ln[len(pre):].split('"', 1)[0]), float(ln.rsplit(" ", 1)[1]))
                   for ln in lines if ln.startswith(pre)]
        assert buckets[-1] == (float("inf"), n)
        if n == 0 or n > st.get("window", n):
            continue
        rank = -(-n // 2)  # ceil(n / 2): the p50 sample
        lo = 0.0
        for le, cum in buckets:
            if cum >= rank:
                break
            lo = le
        p50 = st[name]["p50"] / 1e6
        assert lo - 1e-9 <= p50 <= le + 1e-9, (name, lo, p50, le)

def test_in_place_and_copied_requests_agree(daemon, dims, cases):
    """Alternate lone requests (read buffer lent to the engine, output written
    straight into the reply frame) with pipelined bursts (later frames share
    the read buffer, so they are copied; they merge into batches) across two
    connections, with different sizes so lent buffers come back as spares of
    other sizes: every reply must be the reference's."""
    a, b = daemon.connect(), daemon.connect()
    rid = 0
    for rnd in range(3):
        rid = du.forward_lone_and_burst((a, b), cases, rid, burst=(a,))
    a.close()
    b.close()
    assert daemon.alive()


@pytest.mark.parametrize("keep,sockbuf", [(0, 0), (65536, 65536)])
def test_buffer_settings_serve_correctly(tmp_path_factory, models_dir, keep, sockbuf):
    """server.read_buffer_keep_bytes and server.socket_buffer_bytes only change
    speed: with the buffer never kept (0), or kept only when small, and with the
    kernel's default or a small send buffer, replies are still the reference's
    and the stages are still counted."""
    import moed_client
    tmp = tmp_path_factory.mktemp("stages-cfg")
    cfg = du.base_config(str(tmp), models_dir, status__port=du.free_port(),
                         server__read_buffer_keep_bytes=keep,
                         server__socket_buffer_bytes=sockbuf)
    with du.Daemon(tmp, cfg) as d:
        s = d.connect()
        info = du.hello(s)
        s.close()
        cs = du.reference_cases(d, info, n=3, max_t=info["max_tokens"], seed=9)
        with moed_client.Client(d.sock_path) as c:
            for layer, x, ids, w, ref in cs * 2:
                assert du.rel_l2(c.forward(layer, x, ids, w), ref) < 1e-2
        st = wait_count(d, 6)
        assert st["count"] == 6
        check_sane(st)
        assert d.stop() == 0, d.log()[-4000:]


def moectl_bench(daemon):
    """Run `moectl bench` (one request at a time) and check the lines every
    run prints: the daemon's stage breakdown, what the socket path adds over
    the backend, then, if the daemon knew kernel times, over the kernel, the
    same payload echoed through a bare socket and whether the added latency
    (end to end over the kernel when known, else over the backend) is within
    budget of it. Returns (stdout lines, "kernel" or "backend")."""
    import subprocess
    r = subprocess.run([du.MOECTL, "bench", "--socket", daemon.sock_path, "--tokens", "4",
                        "--connections", "1", "--inflight", "1", "--duration", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "daemon stages: p50 over its last" in r.stdout, r.stdout
    for name in STAGES:
        assert " %s " % name in r.stdout, (name, r.stdout)
    assert "added over backend: in the daemon p50" in r.stdout, r.stdout
    assert "end to end (client mean - daemon backend mean)" in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    added = [i for i, ln in enumerate(lines) if ln.startswith("added over backend:")]
    over_k = [i for i, ln in enumerate(lines) if ln.startswith("added over kernel:")]
    echo = [ln for ln in lines if ln.startswith("payload through the socket (echo, no processing) p50 ")]
    assert len(added) == 1 and len(over_k) <= 1 and len(echo) == 1, r.stdout
    over = "kernel" if over_k else "backend"
    if over_k:
        assert over_k[0] == added[0] + 1, r.stdout
        assert lines[over_k[0]].startswith("added over kernel: in the daemon p50 "), r.stdout
        assert "; end to end (client mean - daemon kernel mean) " in lines[over_k[0]], r.stdout
        for name in KERNEL_STAGES:
            assert " %s " % name in r.stdout, (name, r.stdout)
    last = over_k[0] if over_k else added[0]
    assert lines[last + 1] == echo[0], r.stdout  # right after the added lines
    assert float(echo[0].split()[-2]) > 0, echo
    budget = lines[last + 2]
    assert budget.startswith("added <= echo + 30 us: met (end to end over %s " % over) or \
        budget.startswith("added <= echo + 30 us: not met (end to end over %s " % over), r.stdout
    return lines, over


def test_moectl_bench_prints_stages(daemon, dims):
    lines, over = moectl_bench(daemon)
    if du.TEST_BACKEND == "cpu":  # no kernel time: the output is as before
        assert over == "backend", lines
        assert not any(" kernel " in ln or "added_kernel" in ln for ln in lines), lines


@pytest.mark.skipif(du.TEST_BACKEND != "cpu", reason="the CPU backend's behaviour")
def test_cpu_backend_has_no_kernel_samples(daemon, dims, cases):
    """The CPU backend knows no kernel time: the kernel stages stay empty
    (count 0, zeros) however many requests are timed, and the other stages
    are counted as ever."""
    import moed_client
    before = wait_count(daemon, 0)
    with moed_client.Client(daemon.sock_path) as c:
        for layer, x, ids, w, ref in cases:
            c.forward(layer, x, ids, w)
    st = wait_count(daemon, before["count"] + len(cases))
    assert st["count"] == before["count"] + len(cases)
    check_sane(st)
    for name in KERNEL_STAGES:
        assert st[name] == {"count": 0, "window": 0, "p50": 0, "p99": 0, "mean": 0}, st
    assert st["backend"]["mean"] > 0 and st["added"]["p50"] > 0
    check_metrics(http_get(daemon, "/metrics"), st)


@pytest.mark.skipif(du.TEST_BACKEND != "cpu", reason="MOED_TEST_CPU_KERNEL_TIME is the CPU backend's")
def test_kernel_stages_with_kernel_time(tmp_path_factory, models_dir):
    """With MOED_TEST_CPU_KERNEL_TIME=1 every batch has a kernel time (its compute
    time, inside the backend stage): every timed request is a kernel sample,
    kernel <= backend in every statistic (per request, so also per order
    statistic over the same window), added_kernel = total - kernel summed over
    the requests (and >= added), /metrics agrees, and moectl bench prints the
    latency added over the kernel and budgets that figure."""
    tmp = tmp_path_factory.mktemp("stages-kernel")
    cfg = du.base_config(str(tmp), models_dir, status__port=du.free_port())
    with du.Daemon(tmp, cfg, env={"MOED_TEST_CPU_KERNEL_TIME": "1"}) as d:
        forward_reference_cases(d, seed=13)
        st = wait_count(d, 12)
        assert st["count"] == 12
        check_sane(st)
        k, ak = st["kernel"], st["added_kernel"]
        assert k["count"] == ak["count"] == 12 and k["window"] == 12, st
        assert 0 < k["p50"] and k["mean"] > 0, st
        for q in ("p50", "p99", "mean"):
            assert k[q] <= st["backend"][q] + 1e-6, (q, st)
            assert ak[q] + 1e-6 >= st["added"][q], (q, st)
        n = st["count"]
        assert abs(ak["mean"] * n - (st["total"]["mean"] - k["mean"]) * n) <= \
            1e-6 * st["total"]["mean"] * n + 0.01, st
        check_metrics(http_get(d, "/metrics"), st)
        lines, over = moectl_bench(d)
        assert over == "kernel", lines
        st2 = wait_count(d, 0)
        assert st2["kernel"]["count"] == st2["count"], st2
        assert d.stop() == 0, d.log()[-4000:]


def loop_spin(daemon):
    return json.loads(http_get(daemon, "/status"))["loop_spin"]


def moectl_status(daemon):
    return subprocess.run([du.MOECTL, "status", "--socket", daemon.sock_path],
                          capture_output=True, text=True, timeout=du.wait_s(30))


def spin_metric(daemon):
    lines = [l for l in http_get(daemon, "/metrics").splitlines()
             if l.startswith("moed_loop_spin_seconds_total ")]
    assert len(lines) == 1, lines
    return float(lines[0].split()[1])


def test_loop_spin_default_by_backend(daemon, cases):
    """engine.loop_spin_us defaults to 1000: the CUDA backend's loop spins
    around its batches; the CPU backend's batches take milliseconds and its
    threads need the cores, so its loop sleeps."""
    import moed_client
    with moed_client.Client(daemon.sock_path) as c:
        for layer, x, ids, w, ref in cases:
            assert du.rel_l2(c.forward(layer, x, ids, w), ref) < 1e-2
    ls = loop_spin(daemon)
    if du.TEST_BACKEND == "cpu":
        assert ls == {"us": 0, "seconds": 0}
        assert spin_metric(daemon) == 0
    else:
        assert ls["us"] == 1000 and ls["seconds"] > 0, ls
        assert spin_metric(daemon) > 0


@pytest.mark.skipif(du.TEST_BACKEND != "cpu", reason="MOED_TEST_CPU_SPIN is the CPU backend's")
@pytest.mark.parametrize("spin_us", [0, 20000])
def test_loop_spins_around_batches_and_stops(tmp_path_factory, models_dir, spin_us):
    """With MOED_TEST_CPU_SPIN=1 the CPU backend's batches count as coming back
    in microseconds (as the CUDA backend's do): the loop polls without
    sleeping while one is out and for engine.loop_spin_us after it, the
    answers are still the reference's, /status and /metrics count the time,
    and once the requests stop the spin stops (the count stands still).
    loop_spin_us 0 turns it off."""
    tmp = tmp_path_factory.mktemp("spin")
    cfg = du.base_config(str(tmp), models_dir, status__port=du.free_port(),
                         engine__loop_spin_us=spin_us)
    with du.Daemon(tmp, cfg, env={"MOED_TEST_CPU_SPIN": "1"}) as d:
        forward_reference_cases(d, seed=17)
        ls = loop_spin(d)
        assert ls["us"] == spin_us, ls
        if spin_us == 0:
            assert ls["seconds"] == 0, ls
            r = moectl_status(d)
            assert r.returncode == 0 and "event loop spun" not in r.stdout, r.stdout
        else:
            assert ls["seconds"] > 0, ls
            # idle now: within loop_spin_us of the last batch the spin ends;
            # wait until two reads a poll apart agree
            deadline = time.monotonic() + du.wait_s(20)
            prev = loop_spin(d)["seconds"]
            while True:
                time.sleep(du.wait_s(0.2))
                cur = loop_spin(d)["seconds"]
                if cur == prev:
                    break
                assert time.monotonic() < deadline, "the loop still spins: %r -> %r" % (prev, cur)
                prev = cur
            assert abs(spin_metric(d) - cur) <= 1e-6 * max(1.0, cur), cur
            r = moectl_status(d)
            assert r.returncode == 0, r.stderr
            assert "; event loop spun %.1f s (engine.loop_spin_us %d)" % (cur, spin_us) \
                in r.stdout, r.stdout
        assert d.stop() == 0, d.log()[-4000:]
