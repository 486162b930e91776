"""scripts/tasklog.py (the kernel's task log, MOE_GPU_TASK_LOG) on synthetic logs
whose every stamp is known: the per-part split, the clock conversion, the CTAs of
an older batch left out, and files that are not task logs refused."""
import importlib.util
import os
import struct

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "tasklog", os.path.join(HERE, "..", "..", "scripts", "tasklog.py"))
tasklog = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tasklog)

CTAS, N, W = tasklog.CTAS, tasklog.N, tasklog.W
CPN = 2  # SM cycles per ns in these logs (2 GHz)


def write_log(path, ctas):
    """ctas: {cta: (go_ns, seq, staged_ns, routed_ns, [(kind, ntiles, cnt, [7 stamps in ns after
    go])], end_ns)}"""
    hdr = [0] * (CTAS * 8)
    ents = [0] * (CTAS * N * W)
    for c, (go, seq, staged, routed, tasks, end) in ctas.items():
        clk0 = 1_000_000 + 777 * c  # each SM's clock64 has its own origin
        hdr[c * 8:c * 8 + 8] = [go, clk0, clk0 + CPN * routed, clk0 + CPN * end, go + end,
                                len(tasks), clk0 + CPN * staged, seq]
        for i, (kind, nt, cnt, st) in enumerate(tasks):
            b = (c * N + i) * W
            ents[b:b + 7] = [clk0 + CPN * x for x in st]
            ents[b + 7] = kind | nt << 4 | cnt << 8 | (i << 32)
    with open(path, "wb") as f:
        f.write(struct.pack("<%dQ" % len(hdr), *hdr))
        f.write(struct.pack("<%dQ" % len(ents), *ents))


def test_parts_clock_and_older_batches(tmp_path):
    p = tmp_path / "qwen3-30b-a3b-T4.bin"
    write_log(p, {
        # CTA 0: go at 10000 ns; a gate_up task of 4 tiles, a down task, a combine task
        0: (10_000, 7, 120, 300, [
            (0, 4, 3, [400, 500, 600, 5600, 5700, 5800, 5900]),
            (1, 4, 3, [6000, 6100, 6300, 8300, 8400, 8500, 8600]),
            (2, 0, 0, [8700, 8700, 9700, 0, 0, 0, 10_200]),
        ], 10_500),
        # CTA 1: go 200 ns later, one gate_up task, ends first
        1: (10_200, 7, 90, 100, [(0, 4, 1, [200, 300, 350, 4350, 4400, 4450, 4500])], 4_600),
        # CTA 2 ran an older batch (seq 6): not this batch's
        2: (1_000, 6, 20, 50, [(0, 4, 1, [60, 70, 80, 90, 100, 110, 120])], 200),
    })
    s = tasklog.summarize(str(p))
    assert (s["model"], s["T"], s["grid"]) == ("qwen3-30b-a3b", 4, 2)
    assert s["mhz"] == pytest.approx(CPN * 1e3)
    assert s["span_ns"] == pytest.approx(10_500)  # CTA 0's loop end, from the first go
    cat = s["cat"]
    assert cat["pre-go"] == pytest.approx(200)  # CTA 1 went 200 ns after CTA 0
    assert cat["stage"] == pytest.approx(120 + 90)  # go -> its slice of x staged
    assert cat["route"] == pytest.approx(180 + 10)  # -> routed
    assert cat["to-first"] == pytest.approx(100 + 100)
    assert cat["decode"] == pytest.approx(100 + 100 + 100)
    # the combine task's ready wait counts as ready; its run as combine
    assert cat["ready"] == pytest.approx(100 + 200 + 1000 + 50)
    assert cat["stream"] == pytest.approx(5000 + 2000 + 4000)
    assert cat["reduce"] == pytest.approx(100 + 100 + 50)
    assert cat["epilogue"] == pytest.approx(100 + 100 + 50)
    assert cat["release"] == pytest.approx(100 + 100 + 50)
    assert cat["between"] == pytest.approx(100 + 100)
    assert cat["combine"] == pytest.approx(500)
    # CTA 0 ends its last task at 10200 of a 10500 span; CTA 1 at 200 + 4500
    assert cat["after-last"] == pytest.approx(300 + (10_500 - 4_700))
    assert sum(cat.values()) == pytest.approx(s["grid"] * s["span_ns"])
    # by kind, tiles per task and the pairs' n-tiles (3 and 1 pairs: one n-tile)
    assert sorted(s["kinds"]) == [(0, 4, 1), (1, 4, 1), (2, 0, 0)]
    gu = s["kinds"][(0, 4, 1)]
    assert gu[0:2] == [2, 4]  # tasks, tokens
    assert gu[2 + tasklog.PARTS.index("stream")] == pytest.approx(9000)
    assert s["kinds"][(2, 0, 0)][0] == 1
    # each task's stream part with the weight bytes of its tiles (Qwen3: K 2048 gate_up, 768 down)
    assert sorted(e[3] for e in s["ev"]) == [0, 4 * 12 * 1152, 4 * 32 * 1152, 4 * 32 * 1152]
    # each CTA's start, from the first go: x staged, routed, first task ready and streamed
    assert sorted(s["start"]) == [pytest.approx((120, 300, 600, 5600)),
                                  pytest.approx((290, 300, 550, 4550))]
    assert tasklog.quantiles([r[2] for r in s["start"]]) == pytest.approx((550, 550, 600, 600, 600))


def test_pairs_classes(tmp_path, capsys):
    """tasks of 8, 9, 16, 17 and 32 pairs fall in the 1-8 / 9-16 / 17-32 rows (the
    one-, two- and four-n-tile task forms), each row with its own stream part"""
    p = tmp_path / "deepseek-v3-T256.bin"
    tasks, t = [], 0
    for cnt, stream in ((8, 1000), (9, 2000), (16, 4000), (17, 8000), (32, 16000)):
        tasks.append((0, 4, cnt, [t + 10, t + 20, t + 30, t + 30 + stream, t + 40 + stream,
                                  t + 50 + stream, t + 60 + stream]))
        t += 100 + stream
    write_log(p, {0: (1000, 1, 5, 10, tasks, t)})
    s = tasklog.summarize(str(p))
    st = 2 + tasklog.PARTS.index("stream")
    k = s["kinds"]
    assert sorted(k) == [(0, 4, 1), (0, 4, 2), (0, 4, 4)]
    assert (k[(0, 4, 1)][0:2], k[(0, 4, 1)][st]) == ([1, 8], pytest.approx(1000))
    assert (k[(0, 4, 2)][0:2], k[(0, 4, 2)][st]) == ([2, 25], pytest.approx(6000))
    assert (k[(0, 4, 4)][0:2], k[(0, 4, 4)][st]) == ([2, 49], pytest.approx(24000))
    tasklog.main(str(p), False)
    out = capsys.readouterr().out
    for label, n in (("1-8", 1), ("9-16", 2), ("17-32", 2)):
        assert "gate_up 4 tiles, %5s pairs: %5d tasks" % (label, n) in out


def test_not_a_task_log(tmp_path):
    p = tmp_path / "deepseek-v3-T1.bin"
    p.write_bytes(b"\0" * 64)
    with pytest.raises(SystemExit, match="not a task log"):
        tasklog.summarize(str(p))
    q = tmp_path / "log.bin"
    q.write_bytes(b"")
    with pytest.raises(SystemExit, match="not PRESET-TT.bin"):
        tasklog.summarize(str(q))


def test_no_cta_logged(tmp_path):
    p = tmp_path / "deepseek-v3-T16.bin"
    write_log(p, {})
    assert tasklog.summarize(str(p)) is None


def test_bad_stream_bandwidth_refused(tmp_path):
    import subprocess
    import sys
    p = tmp_path / "qwen3-30b-a3b-T4.bin"
    write_log(p, {})
    for bad in ("x", "0", "-1"):
        r = subprocess.run([sys.executable, _spec.origin, str(p)], capture_output=True, text=True,
                           env={**os.environ, "TASKLOG_STREAM_TBS": bad})
        assert r.returncode == 1
        assert "TASKLOG_STREAM_TBS=%s: not a read bandwidth" % bad in r.stderr
