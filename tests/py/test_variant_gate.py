"""scripts/variant_gate.py: a variant's kernel time against base's from the
CSVs that scripts/device-variants.sh writes, and the rules on the ratio."""
import csv
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "variant_gate.py")
# bench_moe's CSV header (bench/bench_moe.c), as device-variants.sh keeps it
HEADER = ("model,T,experts,MB,moed_p50_us,moed_p10_us,moed_p90_us,moed_TBps,frac,staged_p50_us,"
          "cublas_p50_us,staged_relL2,cublas_relL2,kernel_us,dispatch_us,complete_us,"
          "payload_copy_us,moed_dev_p50_us,frac_kernel").split(",")


def write_runs(d, name, rows):
    """rows: (model, T, kernel_us), one per run, into d/variant-name.csv."""
    with open(os.path.join(d, f"variant-{name}.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for model, t, us in rows:
            r = {k: "-1.0" for k in HEADER}
            r.update(model=model, T=str(t), kernel_us=f"{us:.1f}", moed_p50_us=f"{us + 5:.1f}")
            w.writerow([r[k] for k in HEADER])


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def two_calls(tmp_path):
    """two variants steps' folders: base and V twice each at two points"""
    a, b = tmp_path / "1-variants", tmp_path / "2-variants"
    a.mkdir()
    b.mkdir()
    write_runs(a, "base", [("deepseek-v3", 256, 2100.0), ("qwen3-30b-a3b", 256, 187.0)])
    write_runs(b, "base", [("deepseek-v3", 256, 2080.0), ("qwen3-30b-a3b", 256, 189.0)])
    write_runs(a, "wk", [("deepseek-v3", 256, 2000.0), ("qwen3-30b-a3b", 256, 190.0)])
    write_runs(b, "wk", [("deepseek-v3", 256, 2020.0), ("qwen3-30b-a3b", 256, 191.0)])
    return ["--dir", str(a), "--dir", str(b)]


def test_ratio_of_means_and_rules(two_calls):
    # deepseek-v3 256: 2010 / 2090 = 0.9617; qwen3 256: 190.5 / 188 = 1.0133
    r = run(*two_calls, "wk", "deepseek-v3:256<=0.97", "qwen3-30b-a3b:256<=1.014", "*<=1.014")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deepseek-v3 256: base 2090.0 V 2010.0 us, V / base 0.9617" in r.stdout
    assert "qwen3-30b-a3b 256: base 188.0 V 190.5 us, V / base 1.0133" in r.stdout
    assert r.stdout.strip().endswith("gate wk: pass")


@pytest.mark.parametrize("rules, failing", [
    (["deepseek-v3:256<=0.96"], "rule deepseek-v3 256 <= 0.96: fails"),
    (["deepseek-v3:256<=0.97", "*<=1.013"], "rule every point <= 1.013: fails"),
    (["deepseek-v3:128<=2"], "rule deepseek-v3 128 <= 2.0 (not measured for both): fails"),
])
def test_a_rule_that_fails(two_calls, rules, failing):
    r = run(*two_calls, "wk", *rules)
    assert r.returncode == 1, r.stdout + r.stderr
    assert failing in r.stdout.splitlines()
    assert r.stdout.strip().endswith("gate wk: fail")


def test_no_runs_of_the_variant(two_calls):
    r = run(*two_calls, "other", "*<=1.5")
    assert r.returncode == 1
    assert "rule every point <= 1.5 (no point measured for both): fails" in r.stdout


@pytest.mark.parametrize("rule, message", [
    ("deepseek-v3:256<0.98", "variant_gate: bad rule 'deepseek-v3:256<0.98': want MODEL:T<=R or *<=R"),
    ("deepseek-v3<=0.98", "variant_gate: bad rule 'deepseek-v3<=0.98': want MODEL:T<=R or *<=R"),
    ("*<=0", "variant_gate: bad rule '*<=0': the ratio must be positive"),
])
def test_bad_rule(rule, message):
    for args in (["--check", "wk", rule], ["wk", rule]):
        r = run(*args)
        assert r.returncode == 2
        assert r.stderr.strip() == message
    assert run("--check", "wk", "*<=1.0", "qwen3-30b-a3b:16<=.99").returncode == 0


@pytest.mark.parametrize("args, message", [
    (["wk"], "variant_gate: no rule"),
    (["base", "*<=1.0"], "variant_gate: bad variant name 'base'"),
    (["../x", "*<=1.0"], "variant_gate: bad variant name '../x'"),
])
def test_bad_name_or_no_rule(args, message):
    for a in (["--check", *args], args):
        r = run(*a)
        assert r.returncode == 2
        assert r.stderr.strip() == message


def test_bad_csv(tmp_path):
    with open(tmp_path / "variant-base.csv", "w") as f:
        f.write("model,T,kernel_us\ndeepseek-v3,two,5.0\n")
    r = run("--dir", str(tmp_path), "wk", "*<=1.0")
    assert r.returncode == 2
    assert r.stderr.startswith(f"variant_gate: {tmp_path}/variant-base.csv: a row without model, T")
