#!/usr/bin/env python3
"""A gate on a variant's kernel time against base, written before the call
that measures it (scripts/device-session.sh gate=V): the mean kernel_us of
each (model, T) over every run of V and of base in the CSVs that
scripts/device-variants.sh wrote (variant-base.csv, variant-V.csv under each
DIR), and the rules on their ratio V / base.

  variant_gate.py [--dir DIR]... V RULE...
  variant_gate.py --check V RULE...    (the name's and the rules' syntax only)

RULE: MODEL:T<=R (that point's ratio at most R; the point must have been
measured for both) or *<=R (every point measured for both). Exit 0 when every
rule holds, 1 when one does not (or a named point, or every point, is
missing), 2 on a bad rule or usage; the ratios are printed either way."""
import argparse
import csv
import glob
import math
import os
import re
import sys

RULE = re.compile(r"^(?:(\*)|([A-Za-z0-9._-]+):([0-9]+))<=([0-9]*\.?[0-9]+)$")


def parse_rules(rules):
    """[(model or None, T or None, max ratio)]; ValueError names a bad rule."""
    out = []
    for s in rules:
        m = RULE.match(s)
        if not m:
            raise ValueError(f"bad rule {s!r}: want MODEL:T<=R or *<=R")
        r = float(m.group(4))
        if not (r > 0 and math.isfinite(r)):
            raise ValueError(f"bad rule {s!r}: the ratio must be positive")
        out.append((None, None, r) if m.group(1) else (m.group(2), int(m.group(3)), r))
    return out


def mean_kernel_us(paths):
    """{(model, T): mean kernel_us} over the rows of the CSVs in paths."""
    runs = {}
    for p in paths:
        with open(p, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    k, us = (row["model"], int(row["T"])), float(row["kernel_us"])
                except (KeyError, TypeError, ValueError):
                    raise ValueError(f"{p}: a row without model, T and kernel_us: {row}")
                if us > 0:
                    runs.setdefault(k, []).append(us)
    return {k: sum(v) / len(v) for k, v in runs.items()}


def gate(base, var, rules):
    """(ok, lines): the ratios per point and each rule's verdict."""
    ratio = {k: var[k] / base[k] for k in sorted(base) if k in var}
    lines = [f"{m} {t}: base {base[(m, t)]:.1f} V {var[(m, t)]:.1f} us, V / base {q:.4f}"
             for (m, t), q in ratio.items()]
    ok = True
    for model, t, r in rules:
        if model is None:
            held = bool(ratio) and max(ratio.values()) <= r
            what = f"every point <= {r}" + ("" if ratio else " (no point measured for both)")
        else:
            q = ratio.get((model, t))
            held = q is not None and q <= r
            what = f"{model} {t} <= {r}" + (" (not measured for both)" if q is None else "")
        lines.append(f"rule {what}: {'holds' if held else 'fails'}")
        ok = ok and held
    return ok, lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", action="append", default=[],
                    help="a folder with variant-*.csv (default: /tmp/session/*-variants)")
    ap.add_argument("--check", action="store_true", help="check V's and the rules' syntax only")
    ap.add_argument("args", nargs="+", metavar="V RULE")
    a = ap.parse_args(argv)
    v = a.args[0]
    if not re.match(r"^[A-Za-z0-9_-]+$", v) or v == "base":
        print(f"variant_gate: bad variant name {v!r}", file=sys.stderr)
        return 2
    try:
        rules = parse_rules(a.args[1:])
    except ValueError as e:
        print(f"variant_gate: {e}", file=sys.stderr)
        return 2
    if not rules:
        print("variant_gate: no rule", file=sys.stderr)
        return 2
    if a.check:
        return 0
    dirs = a.dir or sorted(glob.glob("/tmp/session/*-variants"))

    def files(name):
        return [f for f in (os.path.join(d, f"variant-{name}.csv") for d in dirs)
                if os.path.isfile(f)]

    try:
        base, var = mean_kernel_us(files("base")), mean_kernel_us(files(v))
    except (OSError, ValueError) as e:
        print(f"variant_gate: {e}", file=sys.stderr)
        return 2
    ok, lines = gate(base, var, rules)
    print("\n".join(lines))
    print(f"gate {v}: {'pass' if ok else 'fail'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
