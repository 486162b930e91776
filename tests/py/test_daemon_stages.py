"""Per-request stage timing through the real socket: after N FORWARD requests
the /status "stages_us" counters count exactly N, every duration is
non-negative, the stages add up to the total (which they only do when the
timestamps were taken in order) and "added" is total - backend; the same
numbers appear in /metrics. Also the data path behind them: a request whose
frame is all the read buffer holds is computed in place (the buffer is lent to
the engine and comes back as a spare), pipelined ones are copied and merged;
both must give the reference output, with the buffer-keeping and socket-buffer
settings on and off.
"""

import json
import time
import urllib.request

import numpy as np
import pytest

import daemon_util as du
from daemon_util import E, MSG_FORWARD

STAGES = ["recv", "submit", "backend", "reply", "write", "total", "added"]
PARTS = ["recv", "submit", "backend", "reply", "write"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "models")


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


def check_sane(st):
    assert st["window"] == min(st["count"], 1024)
    for name in STAGES:
        s = st[name]
        assert set(s) == {"p50", "p99", "mean"}, s
        assert 0 <= s["p50"] <= s["p99"], (name, s)
        assert s["mean"] >= 0, (name, s)
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
    metrics = http_get(daemon, "/metrics")
    lines = metrics.splitlines()

    def value(prefix):
        hits = [ln for ln in lines if ln.startswith(prefix + " ")]
        assert len(hits) == 1, (prefix, hits)
        return float(hits[0].rsplit(" ", 1)[1])

    assert value("moed_request_stage_samples_total") == st["count"]
    for name in STAGES:
        secs = value('moed_request_stage_seconds_total{stage="%s"}' % name)
        assert secs >= 0
        assert abs(secs / st["count"] * 1e6 - st[name]["mean"]) <= 1e-3 * st[name]["mean"] + 0.01
        p50 = value('moed_request_stage_p50_seconds{stage="%s"}' % name)
        p99 = value('moed_request_stage_p99_seconds{stage="%s"}' % name)
        assert abs(p50 * 1e6 - st[name]["p50"]) < 0.01 and abs(p99 * 1e6 - st[name]["p99"]) < 0.01
    for fam in ["moed_request_stage_samples_total", "moed_request_stage_seconds_total",
                "moed_request_stage_p50_seconds", "moed_request_stage_p99_seconds"]:
        assert "# HELP %s " % fam in metrics and "# TYPE %s " % fam in metrics


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


def test_moectl_bench_prints_stages(daemon, dims):
    """`moectl bench` ends with the daemon's stage breakdown, what the socket
    path adds over the backend, the same payload echoed through a bare socket
    and whether the added latency is within budget of it."""
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
    echo = [ln for ln in lines if ln.startswith("payload through the socket (echo, no processing) p50 ")]
    assert added and len(echo) == 1, r.stdout
    assert lines[added[0] + 1] == echo[0], r.stdout  # right after the added line
    assert float(echo[0].split()[-2]) > 0, echo
    budget = lines[added[0] + 2]
    assert budget.startswith("added <= echo + 30 us: met (") or \
        budget.startswith("added <= echo + 30 us: not met ("), r.stdout
