#!/usr/bin/env python3
"""Plot bench.csv (written by bench/bench_moe with BENCH_CSV set): p50 latency
and effective bandwidth vs tokens per batch, moed against the two baselines,
one column per model; a third row, where the CSV has them, with moed's energy
per GB of distinct expert bytes and the SM clock under the power cap.

    python3 scripts/plot_bench.py bench.csv bench.png
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: plot_bench.py BENCH_CSV OUT_PNG\n")
        return 2
    rows = list(csv.DictReader(open(argv[1], newline="")))
    if not rows:
        sys.stderr.write("%s: no rows\n" % argv[1])
        return 1
    models = []
    for r in rows:
        if r["model"] not in models:
            models.append(r["model"])
    def has(key):
        return any(float(r.get(key) or -1) > 0 for r in rows)
    energy = has("energy_J_per_GB")
    nrow = 3 if energy else 2
    fig, axes = plt.subplots(nrow, len(models), figsize=(6 * len(models), 4 * nrow),
                             squeeze=False)
    series = [("moed_p50_us", "moed (persistent), x/y through host staging", "o-"),
              ("moed_dev_p50_us", "moed (persistent), x/y in device memory", "D-"),
              ("kernel_us", "moed kernel time (head seen -> batch complete)", "x-"),
              ("staged_p50_us", "(a) NVFP4, launch per stage, graph", "s--"),
              ("cublas_p50_us", "(b) bf16 + cuBLAS per expert, graph", "^:")]
    for c, m in enumerate(models):
        rs = [r for r in rows if r["model"] == m]
        T = [int(r["T"]) for r in rs]
        mb = [float(r["MB"]) for r in rs]
        lat_ax, bw_ax = axes[0][c], axes[1][c]
        # the roofline: distinct experts' bytes at the streaming read of the
        # same run (kernel_us * frac_kernel = MB / streaming read)
        floor = [float(r.get("kernel_us") or -1) * float(r.get("frac_kernel") or -1) for r in rs]
        if all(f > 0 for f in floor):
            lat_ax.plot(T, floor, "k--", lw=1, label="roofline: distinct bytes / streaming read")
        for key, label, style in series:
            v = [float(r.get(key) or -1) for r in rs]
            if all(x <= 0 for x in v):
                continue
            lat_ax.plot(T, v, style, label=label)
            # NVFP4 bytes moed streams (MB) / p50 (us) = TB/s, the same work for every series
            bw_ax.plot(T, [b / u if u > 0 else float("nan") for b, u in zip(mb, v)],
                       style, label=label)
        lat_ax.set_xscale("log", base=2)
        lat_ax.set_yscale("log")
        lat_ax.set_title("%s: p50 latency per MoE layer" % m)
        lat_ax.set_xlabel("tokens per batch (T)")
        lat_ax.set_ylabel("us")
        lat_ax.grid(True, which="both", alpha=0.3)
        lat_ax.legend(fontsize=8)
        bw_ax.set_xscale("log", base=2)
        bw_ax.set_title("%s: NVFP4 expert bytes / p50" % m)
        bw_ax.set_xlabel("tokens per batch (T)")
        bw_ax.set_ylabel("TB/s")
        bw_ax.grid(True, which="both", alpha=0.3)
        bw_ax.legend(fontsize=8)
        if energy:
            en_ax = axes[2][c]
            j = [float(r.get("energy_J_per_GB") or -1) for r in rs]
            mhz = [float(r.get("sm_MHz") or -1) for r in rs]
            en_ax.plot(T, [x if x > 0 else float("nan") for x in j], "o-", color="tab:green",
                       label="moed: J per GB of distinct expert bytes")
            en_ax.set_xscale("log", base=2)
            en_ax.set_ylim(bottom=0)
            en_ax.set_title("%s: energy per byte, SM clock (batches back to back)" % m)
            en_ax.set_xlabel("tokens per batch (T)")
            en_ax.set_ylabel("J/GB")
            en_ax.grid(True, which="both", alpha=0.3)
            ck_ax = en_ax.twinx()
            ck_ax.plot(T, [x if x > 0 else float("nan") for x in mhz], "s:", color="tab:gray",
                       label="SM clock p50 (MHz)")
            ck_ax.set_ylabel("MHz")
            lines = en_ax.get_legend_handles_labels()
            more = ck_ax.get_legend_handles_labels()
            en_ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
