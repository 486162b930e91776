#!/usr/bin/env python3
"""Where a batch's SM time goes: each CTA's task timeline of the persistent
kernel's last batch (a kernel built with -DMOE_GPU_TASK_LOG=1, bench_moe with
BENCH_TASKLOG=dir; layout in kernels/moe_gpu.h, moe_gpu_task_log). Pure Python.

  scripts/tasklog.py [--rate] [--start] FILE.bin [...]    FILE: PRESET-TT.bin as bench_moe writes it

Per file:
- the batch's span (the first CTA's go to the last CTA's task loop end) and the
  SM clock (clock64 over %globaltimer, median over the CTAs);
- the CTAs' time split into: pre-go (waiting for the batch's release),
  stage (its slice of x), route (the routing: built, or, in a batch whose
  routing CTA 0 builds alone, waited for and its tables copied), to-first (-> its first task's
  claim seen), decode, ready (x staged / the expert's gate_up tiles / every down
  tile; thread 0 first releases the last task's tiles' counter), stream (->
  every warp's K loop done), reduce (split-K sums), epilogue, release (the
  barrier: -> the task's end), between
  (-> the next claim seen), combine (a combine task's run), after-last (its last
  task's end -> the span's end);
- per task kind, tiles per task and its chunk's pairs (1-8: one n-tile; 9-16: two;
  17-32: four, the task forms of run_task): count, those parts' means, and the
  stream part against the task's weight bytes at 1/grid of the streaming read
  (TASKLOG_STREAM_TBS, default 4.53);
- a timeline of how many CTAs stream gate_up / down and run combine tasks; with
  --rate, the weight bytes streamed per bin (TB/s, tasks' bytes spread evenly
  over their stream part);
- with --start, when the CTAs got going (us from the first go, min / p10 / p50 /
  p90 / max over the CTAs): their slice of x staged, routed, their first task
  ready (its wait for x or its gate_up tiles done), its stream part's end.
"""
import os
import re
import struct
import sys

CTAS, N, W = 1024, 256, 8  # MOE_GPU_TLOG_CTAS, MOE_GPU_TLOG_N, words per entry
SHAPES = {"deepseek-v3": (7168, 2048), "qwen3-30b-a3b": (2048, 768)}
UNIT_BYTES, UNIT_K = 1152, 64  # MOE_GPU_UNIT_BYTES, MOE_GPU_UNIT_K
try:
    STREAM = float(os.environ.get("TASKLOG_STREAM_TBS", "4.53")) * 1e12
    if not 0 < STREAM < 1e15:
        raise ValueError
except ValueError:
    sys.exit("TASKLOG_STREAM_TBS=%s: not a read bandwidth in TB/s (0, 1000)" %
             os.environ.get("TASKLOG_STREAM_TBS"))
PARTS = ["decode", "ready", "stream", "reduce", "epilogue", "release"]
# a chunk's pairs -> its n-tiles of 8 (1, 2 or 4: the task forms), and their label
PAIRS = {1: "1-8", 2: "9-16", 4: "17-32"}


def ntiles_of(cnt):
    return 1 if cnt <= 8 else 2 if cnt <= 16 else 4


def load(path):
    raw = open(path, "rb").read()
    nh = CTAS * 8
    if len(raw) != 8 * (nh + CTAS * N * W):
        sys.exit("%s: %d bytes, not a task log of %d CTAs x %d entries" % (path, len(raw), CTAS, N))
    return struct.unpack_from("<%dQ" % nh, raw, 0), struct.unpack_from("<%dQ" % (CTAS * N * W), raw, nh * 8)


def task_bytes(model, kind, nt):
    H, I = SHAPES.get(model, (0, 0))
    return nt * ((H if kind == 0 else I) // UNIT_K) * UNIT_BYTES


def summarize(path):
    """The file's batch as a dict: model, T, grid, mhz, span_ns, cat (ns per part,
    summed over the CTAs), kinds ({(kind, ntiles, n-tiles of its chunk's pairs, 0 for a
    combine task): [tasks, tokens, ns per PARTS entry...]}) and ev ((start, end, kind,
    bytes) of each task's stream part)."""
    m = re.match(r"(.*)-T(\d+)\.bin$", os.path.basename(path))
    if not m:
        sys.exit("%s: not PRESET-TT.bin" % path)
    model, T = m.group(1), int(m.group(2))
    hdr, ents = load(path)
    # the CTAs of the last batch (seq): a CTA that took no part in it keeps an older one's
    seqs = {hdr[c * 8 + 7] for c in range(CTAS) if hdr[c * 8]}
    ctas = [c for c in range(CTAS) if hdr[c * 8] and hdr[c * 8 + 4] > hdr[c * 8]
            and hdr[c * 8 + 7] == max(seqs)] if seqs else []
    if not ctas:
        return None
    fs = sorted((hdr[c * 8 + 3] - hdr[c * 8 + 1]) / (hdr[c * 8 + 4] - hdr[c * 8]) for c in ctas)
    f = fs[len(fs) // 2]  # SM cycles per ns
    t0 = min(hdr[c * 8] for c in ctas)

    def ns(c, clk):
        return hdr[c * 8] - t0 + (clk - hdr[c * 8 + 1]) / f

    cat = dict.fromkeys(["pre-go", "stage", "route", "to-first"] + PARTS +
                        ["between", "combine", "after-last"], 0.0)
    kinds = {}
    ev = []
    start = []
    span = max(ns(c, hdr[c * 8 + 3]) for c in ctas)
    for c in ctas:
        go, routed = ns(c, hdr[c * 8 + 1]), ns(c, hdr[c * 8 + 2])
        cat["pre-go"] += go
        staged = ns(c, hdr[c * 8 + 6]) if hdr[c * 8 + 6] else go  # (older logs: all in route)
        if hdr[c * 8 + 5]:
            b = c * N * W
            start.append((staged, routed, ns(c, ents[b + 2]), ns(c, ents[b + 3])))
        cat["stage"] += staged - go
        cat["route"] += routed - staged
        prev = routed
        for i in range(min(hdr[c * 8 + 5], N)):
            b = (c * N + i) * W
            st = [ns(c, x) for x in ents[b:b + 7]]
            info = ents[b + 7]
            kind, nt, cnt = info & 15, (info >> 4) & 15, (info >> 8) & 255
            cat["to-first" if i == 0 else "between"] += st[0] - prev
            prev = st[6]
            k = kinds.setdefault((kind, nt, 0 if kind == 2 else ntiles_of(cnt)),
                                 [0, 0] + [0.0] * len(PARTS))
            k[0] += 1
            k[1] += cnt
            if kind == 2:
                cat["ready"] += st[2] - st[0]
                cat["combine"] += st[6] - st[2]
                k[2 + PARTS.index("ready")] += st[2] - st[0]
                k[2 + PARTS.index("stream")] += st[6] - st[2]
                ev.append((st[2], st[6], 2, 0))
                continue
            for j, part in enumerate(PARTS):
                d = st[j + 1] - st[j]
                cat[part] += d
                k[2 + j] += d
            ev.append((st[2], st[3], kind, task_bytes(model, kind, nt)))
        cat["after-last"] += span - prev
    return {"model": model, "T": T, "grid": len(ctas), "mhz": f * 1e3, "span_ns": span,
            "cat": cat, "kinds": kinds, "ev": ev, "start": start}


def quantiles(v):
    """min, p10, p50, p90, max of a non-empty list"""
    v = sorted(v)
    n = len(v)
    return v[0], v[n // 10], v[n // 2], v[9 * n // 10], v[-1]


def main(path, rate, start=False):
    s = summarize(path)
    if s is None:
        print("%s: no CTA logged" % path)
        return
    model, T, grid, span, cat, kinds = s["model"], s["T"], s["grid"], s["span_ns"], s["cat"], s["kinds"]
    tot = grid * span
    print("== %s T=%d: %d CTAs, SM clock %.0f MHz, span %.1f us (first go -> last loop end)" %
          (model, T, grid, s["mhz"], span / 1e3))
    print("   CTA time: " + ", ".join("%s %.1f%%" % (k, 100 * v / tot) for k, v in cat.items()))
    for (kind, nt, pn), k in sorted(kinds.items()):
        n = k[0]
        name = ("gate_up", "down", "combine")[kind]
        if kind == 2:
            print("   %-7s: %5d tasks, ready wait %.2f us, run %.2f us" %
                  (name, n, k[2 + PARTS.index("ready")] / n / 1e3,
                   k[2 + PARTS.index("stream")] / n / 1e3))
            continue
        parts = ", ".join("%s %.2f" % (p, k[2 + j] / n / 1e3) for j, p in enumerate(PARTS))
        line = "   %-7s %d tiles, %5s pairs: %5d tasks, %.1f tokens; us: %s" % (
            name, nt, PAIRS[pn], n, k[1] / n, parts)
        byt = task_bytes(model, kind, nt)
        if byt:
            fair = byt / (STREAM / grid) * 1e9
            line += "; %.0f KB streams at %.2f of 1/%d of the stream" % (
                byt / 1e3, fair / (k[2 + PARTS.index("stream")] / n), grid)
        print(line)
    nb = 24
    w = span / nb
    bins = [[0.0] * 4 for _ in range(nb)]
    for st, e, kind, byt in s["ev"]:
        for b in range(int(st // w), min(int(e // w), nb - 1) + 1):
            lo, hi = max(st, b * w), min(e, (b + 1) * w)
            if hi > lo:
                bins[b][kind] += (hi - lo) / w
                bins[b][3] += byt * (hi - lo) / (e - st) if e > st else 0
    print("   timeline (%.1f us bins), CTAs streaming gate_up / down / running combine:" % (w / 1e3))
    print("   " + " ".join("%d/%d/%d" % tuple(round(x) for x in bb[:3]) for bb in bins))
    if rate:
        print("   weight TB/s per bin: " + " ".join("%.2f" % (bb[3] / w / 1e3) for bb in bins))
    if start and s["start"]:
        print("   start (us from the first go: min / p10 / p50 / p90 / max over %d CTAs):" %
              len(s["start"]))
        for i, name in enumerate(["x staged", "routed", "first ready", "first streamed"]):
            print("   %-14s " % name + " / ".join("%.1f" % (x / 1e3) for x in
                                                  quantiles([r[i] for r in s["start"]])))


if __name__ == "__main__":
    args = sys.argv[1:]
    rate, start = "--rate" in args, "--start" in args
    args = [a for a in args if a not in ("--rate", "--start")]
    if not args:
        sys.exit(__doc__)
    for p in args:
        main(p, rate, start)
