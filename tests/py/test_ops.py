"""Operator experience, checked as a new user and an operator would do it:

* `make install DESTDIR=... PREFIX=/opt/x` stages a tree whose pkg-config file
  names /opt/x and include/moed, the client library exports the moedc_* API
  only (nm -D), and README's C example, built with pkg-config against the
  staged tree, runs against a daemon; README's Python example runs too.
* The installed unit passes `systemd-analyze verify` and scores 2.5 or less
  in `systemd-analyze security --offline=yes` (skipped without systemd-analyze).
* The command line: -V names the build's features, no config file is an
  error that names /etc/moed/moed.json, MOED_SOCKET / MOED_STATUS_PORT override
  the file, engine.gpus without a GPU fails --check-config, a status port in
  use gets a clear message, log lines carry journal priorities.
* /metrics parses with prometheus_client's text parser (and promtool where it
  is installed): histograms with 26 % buckets, per-stage histograms, process_*
  metrics, counters typed counter, per-layer per-expert hits equal to what the
  test sent; /status experts.logical_count and `moectl experts` agree.
* moectl: -V, `status` is a short summary and `--json` the document,
  `forward --check` finds the model from the daemon.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import daemon_util as du

ROOT = du.ROOT
MAKE_ARGS = shlex.split(os.environ.get("MOED_MAKE_ARGS") or "BUILD=%s" % du.BUILD)
SANITIZED = os.environ.get("MOED_SANITIZE") == "1"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models_dir):
    yield from du.module_daemon(tmp_path_factory, models_dir, "ops")


def run(cmd, **kw):
    kw.setdefault("timeout", du.wait_s(60))
    if cmd[0] == "make":  # not a job of the `make test` that runs pytest
        kw["env"] = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS",
                                                                      "MAKELEVEL")}
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def readme_block(heading, lang):
    """The first ```lang block after `heading` in README.md."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    at = text.index(heading)
    m = re.compile(r"```%s\n(.*?)```" % lang, re.S).search(text, at)
    assert m, (heading, lang)
    return m.group(1)


def http_get(daemon, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (daemon.http_port(), path),
                                timeout=du.wait_s(5)) as r:
        return r.read().decode()


# ---- install --------------------------------------------------------------------

@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """`make install DESTDIR=<tmp> PREFIX=/opt/x`; afterwards the build's
    PREFIX-dependent files are made again for the default PREFIX."""
    dest = str(tmp_path_factory.mktemp("stage"))
    build = du.BUILD
    try:
        r = run(["make", "-s", "-C", ROOT, *MAKE_ARGS, "install", "DESTDIR=" + dest,
                 "PREFIX=/opt/x"], timeout=du.wait_s(300))
        assert r.returncode == 0, r.stdout + r.stderr
        yield dest
    finally:
        run(["make", "-s", "-C", ROOT, *MAKE_ARGS, os.path.join(build, "moed-client.pc"),
             os.path.join(build, "moed.service")])
        shutil.rmtree(dest, ignore_errors=True)


def test_install_tree(staged):
    x = os.path.join(staged, "opt/x")
    for f in ["bin/moed", "bin/moectl", "lib/libmoedclient.so.1", "lib/libmoedclient.so",
              "include/moed/moed_client.h", "include/moed/moed_proto.h",
              "include/moed/moed_err.h", "lib/pkgconfig/moed-client.pc",
              "lib/systemd/system/moed.service", "lib/sysusers.d/moed.conf",
              "etc/moed/moed.json", "share/doc/moed/README.md"]:
        assert os.path.exists(os.path.join(x, f)), f
    with open(os.path.join(x, "lib/pkgconfig/moed-client.pc")) as f:
        pc = f.read()
    assert "prefix=/opt/x\n" in pc and "-I${includedir}/moed" in pc, pc
    with open(os.path.join(x, "lib/systemd/system/moed.service")) as f:
        unit = f.read()
    assert "ExecStart=/opt/x/bin/moed --config /opt/x/etc/moed/moed.json" in unit
    # the example config is one moed accepts
    r = run([du.MOED, "--check-config", os.path.join(x, "etc/moed/moed.json")])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["server"]["socket"] == "/run/moed/moed.sock"


def test_client_library_exports_moedc_only(staged):
    lib = os.path.join(staged, "opt/x/lib/libmoedclient.so.1")
    r = run(["nm", "-D", "--defined-only", lib])
    assert r.returncode == 0, r.stderr
    names = [ln.split()[-1] for ln in r.stdout.splitlines() if ln.split()
             and ln.split()[-2] in ("T", "D", "B", "R", "W", "V", "i")]
    names = [n.split("@")[0] for n in names]
    ours = [n for n in names if not n.startswith(("_", "MOEDC_"))]
    assert ours and all(n.startswith("moedc_") for n in ours), ours
    assert "moedc_forward" in ours and "moed_frame_parse" not in names


def test_readme_c_example_builds_with_pkg_config_and_runs(staged, daemon, tmp_path):
    src = tmp_path / "app.c"
    src.write_text(readme_block("## Calling moed from C", "c"))
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(staged, "opt/x/lib/pkgconfig"),
               PKG_CONFIG_SYSROOT_DIR=staged)
    flags = run(["pkg-config", "--cflags", "--libs", "moed-client"], env=env)
    assert flags.returncode == 0, flags.stderr
    san = ["-fsanitize=address,undefined"] if SANITIZED else []
    app = str(tmp_path / "app")
    r = run(["cc", "-std=c11", "-Wall", "-Werror", str(src), *shlex.split(flags.stdout), "-o",
             app, *san], env=env)
    assert r.returncode == 0, r.stderr
    r = run([app, daemon.sock_path],
            env=dict(os.environ, LD_LIBRARY_PATH=os.path.join(staged, "opt/x/lib")))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^layer \d+: y\[0\] = 0x[0-9a-f]{4} \(bf16\), backend %s$"
                     % du.TEST_BACKEND, r.stdout, re.M), r.stdout


def test_readme_python_example_runs(daemon, tmp_path):
    src = tmp_path / "example.py"
    src.write_text(readme_block("## Calling moed from Python", "python"))
    r = run([sys.executable, str(src)], env=dict(os.environ, MOED_SOCKET=daemon.sock_path,
                                                  PYTHONPATH=os.path.join(ROOT, "ipc/python")))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^layer \d+ -> \(4, \d+\) float32$", r.stdout, re.M), r.stdout


def test_python_package_metadata():
    sys.path.insert(0, os.path.join(ROOT, "ipc", "python"))
    import moed_client
    with open(os.path.join(ROOT, "ipc/python/pyproject.toml")) as f:
        pyproject = f.read()
    assert re.search(r'^version = "%s"$' % re.escape(moed_client.__version__), pyproject, re.M)
    pkg = os.path.join(ROOT, "ipc/python/moed_client")
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    with open(os.path.join(pkg, "__init__.pyi")) as f:
        stub = f.read()
    for name in moed_client.__all__:  # every public name is typed
        assert re.search(r"^(class |def )?%s\b" % re.escape(name), stub, re.M), name
    assert 'numpy = ["numpy' in pyproject and 'readme = "README.md"' in pyproject


# ---- systemd ----------------------------------------------------------------------

def test_unit_verify_and_security(staged, tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed (scripts/deps.sh installs systemd)")
    with open(os.path.join(staged, "opt/x/lib/systemd/system/moed.service")) as f:
        unit = f.read()
    # point the commands at the staged binaries, so that verify finds them
    path = tmp_path / "moed.service"
    path.write_text(unit.replace("/opt/x/", os.path.join(staged, "opt/x/")))
    r = run(["systemd-analyze", "verify", str(path)])
    assert r.returncode == 0 and not r.stderr.strip(), r.stdout + r.stderr
    r = run(["systemd-analyze", "security", "--offline=yes", str(path)])
    m = re.search(r"Overall exposure level for moed\.service: ([0-9.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 2.5, r.stdout
    for want in ["User=moed", "DevicePolicy=closed", "DeviceAllow=/dev/nvidiactl rw",
                 "RuntimeDirectory=moed", "RestartPreventExitStatus=2 3"]:
        assert want in unit, want
    with open(os.path.join(staged, "opt/x/etc/moed/moed.json")) as f:
        cfg = json.load(f)
    assert cfg["server"]["socket"].startswith("/run/moed/")  # not under PrivateTmp


# ---- command line ---------------------------------------------------------------------

def test_version_names_features():
    for exe in (du.MOED, du.MOECTL):
        r = run([exe, "-V"])
        assert r.returncode == 0 and r.stdout.startswith(os.path.basename(exe) + " "), r.stdout
    r = run([du.MOED, "--version"])
    assert re.search(r"^cuda: (yes \(archs [0-9a-z ]+;|no)", r.stdout, re.M), r.stdout
    assert re.search(r"^nccl: ", r.stdout, re.M) and "backends: cpu" in r.stdout
    r = run([du.MOED, "-h"])
    assert r.returncode == 0 and "MOED_STATUS_PORT" in r.stdout and "-V, --version" in r.stdout


def test_no_config_file_is_a_clear_error(tmp_path):
    env = dict(os.environ)
    env.pop("MOED_CONFIG", None)
    if os.path.exists("/etc/moed/moed.json"):
        pytest.skip("/etc/moed/moed.json exists here")
    r = run([du.MOED], env=env)
    assert r.returncode == 2, r.stderr
    assert "/etc/moed/moed.json does not exist" in r.stderr and "--builtin" in r.stderr
    # MOED_CONFIG names the file instead
    p = tmp_path / "c.json"
    p.write_text('{"server": {"socket": "/tmp/x.sock"}}')
    r = run([du.MOED, "--bogus-flag"], env=dict(env, MOED_CONFIG=str(p)))
    assert r.returncode == 2 and "unknown argument '--bogus-flag'" in r.stderr


def test_env_overrides_socket_and_port(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"server": {"socket": "/tmp/x.sock"}, "status": {"port": 9464}}')
    env = dict(os.environ, MOED_SOCKET="/run/moed/other.sock", MOED_STATUS_PORT="9999")
    r = run([du.MOED, "--check-config", str(p)], env=env)
    assert r.returncode == 0, r.stderr
    eff = json.loads(r.stdout)
    assert eff["server"]["socket"] == "/run/moed/other.sock" and eff["status"]["port"] == 9999
    r = run([du.MOED, "--check-config", str(p)], env=dict(env, MOED_STATUS_PORT="70000"))
    assert r.returncode == 2 and "MOED_STATUS_PORT" in r.stderr
    r = run([du.MOED, "--check-config", str(p)], env=dict(env, MOED_SOCKET="/" + "s" * 120))
    assert r.returncode == 2 and "MOED_SOCKET" in r.stderr


def gpu_count():
    r = run([du.MOED, "-V"])
    m = re.search(r"; (\d+) devices? visible", r.stdout)
    return int(m.group(1)) if m else 0


def test_gpus_without_a_gpu_fail_check_config(tmp_path, models_dir):
    if gpu_count() > 1:
        pytest.skip("this machine has GPUs")
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"engine": {"gpus": [0, 1]}}))
    r = run([du.MOED, "--check-config", str(p)])
    assert r.returncode == 2, r.stdout + r.stderr
    # no GPU: the list is refused as such; one GPU: its second entry is
    assert re.search(r"engine\.gpus (names GPUs|lists 2 GPUs)|"
                     r"engine\.gpus\[1\] = 1 but 1 CUDA device is visible", r.stderr), r.stderr
    # the daemon refuses it the same way, before it opens the model
    cfg = du.base_config(str(tmp_path), models_dir, engine__backend="auto")
    cfg["engine"]["gpus"] = [0, 1]
    cfg["model"]["path"] = str(tmp_path / "no-such-model")
    p.write_text(json.dumps(cfg))
    r = run([du.MOED, "--config", str(p)])
    assert r.returncode == 2 and "engine.gpus" in r.stderr, r.stderr


def test_status_port_in_use_message(daemon, tmp_path, models_dir):
    port = daemon.http_port()
    cfg = du.base_config(str(tmp_path), models_dir, status__port=port)
    cfg["server"]["socket"] = os.path.join(str(tmp_path), "second.sock")
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    r = run([du.MOED, "--config", str(p)], timeout=du.wait_s(120))
    assert r.returncode == 1, r.stderr
    want = ("status port %d on 127.0.0.1 is already in use (another moed?); set status.port "
            "or MOED_STATUS_PORT" % port)
    assert want in r.stderr, r.stderr


def test_log_lines_carry_journal_priorities(tmp_path, models_dir):
    """With stderr the journal ($JOURNAL_STREAM naming its device:inode),
    every line starts with its sd-daemon priority."""
    tmp = str(tmp_path)
    cfg = du.base_config(tmp, models_dir, status__port=0)
    d = du.Daemon(tmp, cfg)
    # the log file the daemon's stderr goes to is created by start(): make it
    # first, name it in JOURNAL_STREAM
    open(d.log_path, "wb").close()
    st = os.stat(d.log_path)
    d.env = {"JOURNAL_STREAM": "%d:%d" % (st.st_dev, st.st_ino)}
    with d:
        assert d.stop() == 0
    lines = [ln for ln in d.log().splitlines() if ln]
    assert lines and all(re.match(r"<[3467]>(ERROR|WARN |INFO |DEBUG) ", ln) for ln in lines), \
        lines[:5]
    assert any(ln.startswith("<6>INFO  ready: socket") for ln in lines)


# ---- metrics ------------------------------------------------------------------------------

def send_batches(daemon, dims, n=6, seed=3):
    """FORWARD n random batches over the first two MoE layers; returns the
    per-(layer, expert) token counts they route."""
    import moed_client
    rng = np.random.default_rng(seed)
    layers = list(range(dims["first_moe_layer"], dims["n_layers"]))[:2]
    want = np.zeros((dims["n_layers"], dims["n_experts"] + dims["n_shared"]), np.int64)
    with moed_client.Client(daemon.sock_path) as c:
        for i in range(n):
            t = int(rng.integers(1, 9))
            x = du.bf16_bits(rng.standard_normal((t, dims["hidden"])))
            ids = np.stack([rng.choice(dims["n_experts"], dims["top_k"], replace=False)
                            for _ in range(t)]).astype(np.int32)
            w = rng.random((t, dims["top_k"])).astype(np.float32)
            layer = layers[i % len(layers)]
            c.forward(layer, x, ids, w)
            np.add.at(want[layer], ids.ravel(), 1)
            want[layer, dims["n_experts"]:] += t
    return want


def status_counts(daemon, dims):
    """/status's per-layer counts as one [layers, E + S] matrix."""
    x = json.loads(http_get(daemon, "/status"))["experts"]
    sc = np.array(x["shared_count"], np.int64).reshape(dims["n_layers"], dims["n_shared"])
    return np.concatenate([np.array(x["logical_count"], np.int64), sc], axis=1)


@pytest.fixture(scope="module")
def expert_counts(daemon, dims):
    """Counts the daemon must show after this module's batches: what it had
    (other tests of this module sent requests) plus what they route."""
    before = status_counts(daemon, dims)
    return before + send_batches(daemon, dims)


def test_metrics_parse_and_agree(daemon, dims, expert_counts):
    from prometheus_client.parser import text_string_to_metric_families
    # the stages of the last request are recorded once its reply is written
    deadline = du.wait_s(5)
    t0 = time.monotonic()
    while True:
        text = http_get(daemon, "/metrics")
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        st = fams["moed_request_stage_seconds"]
        cnt = [s.value for s in st.samples if s.name.endswith("_count")
               and s.labels["stage"] == "total"]
        if cnt and cnt[0] >= 6 or time.monotonic() - t0 > deadline:
            break
        time.sleep(0.02)
    # types: counters are counters (prometheus_client strips _total)
    for name in ["moed_requests", "moed_tokens", "moed_errors", "moed_batches",
                 "moed_expert_hits", "process_cpu_seconds"]:
        assert fams[name].type == "counter", (name, fams[name].type)
    for name in ["process_resident_memory_bytes", "process_open_fds",
                 "process_start_time_seconds", "process_virtual_memory_bytes"]:
        assert fams[name].type == "gauge" and fams[name].samples[0].value > 0, name
    assert "moed_request_stage_p50_seconds" not in fams
    # latency histogram: bounds at most 26 % apart from 1 us up, so 5-500 us
    # and 1-50 ms have at least 10 buckets each
    lat = fams["moed_request_latency_seconds"]
    assert lat.type == "histogram"
    les = sorted(float(s.labels["le"]) for s in lat.samples if s.name.endswith("_bucket"))
    fin = [x for x in les if x != float("inf")]
    assert all(b / a <= 1.26 for a, b in zip(fin, fin[1:]))
    assert sum(5e-6 <= x <= 5e-4 for x in fin) >= 10 and sum(1e-3 <= x <= 5e-2 for x in fin) >= 10
    # per-stage histograms, one series set per stage
    stages = {s.labels["stage"] for s in st.samples}
    assert {"recv", "submit", "backend", "reply", "write", "total", "added"} <= stages
    # per-layer, per-expert hits equal what was sent
    got = np.zeros_like(expert_counts)
    for s in fams["moed_expert_hits"].samples:
        got[int(s.labels["layer"]), int(s.labels["expert"])] = s.value
    assert (got == expert_counts).all(), (got, expert_counts)
    # promtool's own lint, where it is installed
    promtool = shutil.which("promtool")
    if promtool:
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_metrics(daemon):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (Debian package prometheus); the "
                    "prometheus_client parser checked /metrics")
    r = subprocess.run([promtool, "check", "metrics"], input=http_get(daemon, "/metrics"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_expert_load_in_status_and_moectl(daemon, dims, expert_counts):
    x = json.loads(http_get(daemon, "/status"))["experts"]
    E = dims["n_experts"]
    assert x["num_layers"] == dims["n_layers"] and x["num_logical_experts"] == E
    assert np.array_equal(np.array(x["logical_count"]), expert_counts[:, :E])
    assert np.array_equal(np.array(x["shared_count"]).reshape(dims["n_layers"], -1),
                          expert_counts[:, E:])
    assert x["hits"] == expert_counts.sum(axis=0).tolist()
    r = run([du.MOECTL, "experts", "--json", "--socket", daemon.sock_path])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["logical_count"] == x["logical_count"]
    r = run([du.MOECTL, "experts", "--socket", daemon.sock_path])
    assert r.returncode == 0, r.stderr
    for layer in np.nonzero(expert_counts.sum(axis=1))[0]:
        row = expert_counts[layer, :E]
        assert re.search(r"^\s+%d\s+%d\s+%d\s+%d\s" % (layer, row.sum(), row.argmax(), row.max()),
                         r.stdout, re.M), r.stdout


def test_moectl_placement_from_the_load(daemon, dims, expert_counts):
    """moectl placement (engine/placement.h) from /status's counts: every MoE
    layer, every expert on 1..max_replicas distinct GPUs, copies exactly for
    the experts over --hot-percent of one GPU's share (recomputed here), the
    per-GPU tokens it reports equal to the map applied to the counts, the
    busiest GPU within one replica's load of the mean, replicas per GPU
    within 2; bad options refused."""
    import math
    E, layers = dims["n_experts"], list(range(dims["first_moe_layer"], dims["n_layers"]))
    for gpus, hot in ((2, 100), (3, 50), (4, 25)):
        r = run([du.MOECTL, "placement", "--json", "--gpus", str(gpus), "--hot-percent", str(hot),
                 "--socket", daemon.sock_path])
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        counts = np.array(json.loads(http_get(daemon, "/status"))["experts"]["logical_count"])
        assert out["gpus"] == gpus and out["max_replicas"] == gpus and out["n_experts"] == E
        assert [l["layer"] for l in out["layers"]] == layers
        for l in out["layers"]:
            load = counts[l["layer"]]
            fair = load.sum() / gpus
            dev_tokens, dev_experts, heaviest = np.zeros(gpus), np.zeros(gpus, int), 0.0
            for e, devs in enumerate(l["experts"]):
                assert devs and len(set(devs)) == len(devs) and all(0 <= d < gpus for d in devs)
                want = 1
                if fair > 0 and load[e] > hot / 100 * fair:
                    want = min(gpus, math.ceil(load[e] / (hot / 100 * fair)))
                assert len(devs) == want, (l["layer"], e, devs, load[e], fair)
                for d in devs:
                    dev_tokens[d] += load[e] / len(devs)
                    dev_experts[d] += 1
                heaviest = max(heaviest, load[e] / len(devs))
            assert np.allclose(l["device_tokens"], dev_tokens), (l, dev_tokens)
            assert l["device_experts"] == dev_experts.tolist()
            assert dev_tokens.max() <= load.sum() / gpus + heaviest + 1e-9
            assert dev_experts.max() - dev_experts.min() <= 2
    r = run([du.MOECTL, "placement", "--socket", daemon.sock_path])
    assert r.returncode == 0 and re.search(r"^\s+%d\s+\d+\s+[\d.]+\s+\d+/\d+$" % layers[0],
                                           r.stdout, re.M), r.stdout
    r = run([du.MOECTL, "placement", "--gpus", "2", "--max-replicas", "3",
             "--socket", daemon.sock_path])
    assert r.returncode == 2 and "--max-replicas 3 is over --gpus 2" in r.stderr, r.stderr
    r = run([du.MOECTL, "placement", "--gpus", "9", "--socket", daemon.sock_path])
    assert r.returncode == 2 and "--gpus" in r.stderr, r.stderr


# ---- moectl ---------------------------------------------------------------------------------

def test_moectl_status_summary_and_json(daemon):
    r = run([du.MOECTL, "status", "--socket", daemon.sock_path])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) <= 15, r.stdout
    assert lines[0].startswith("moed ") and "serving (healthy)" in lines[0], lines[0]
    assert any(ln.startswith("requests ") for ln in lines) and \
        any(ln.startswith("latency ") for ln in lines), r.stdout
    r = run([du.MOECTL, "status", "--json"], env=dict(os.environ, MOED_SOCKET=daemon.sock_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["load"]["loaded"] is True and "stages_us" in doc
    r = run([du.MOECTL, "status", "--bogus"])
    assert r.returncode == 2 and "unknown option '--bogus'" in r.stderr
    r = run([du.MOECTL, "status", "--socket"])
    assert r.returncode == 2 and "needs a value" in r.stderr


def test_moectl_forward_check_finds_the_model(daemon):
    r = run([du.MOECTL, "forward", "--check", "--tokens", "3", "--socket", daemon.sock_path],
            timeout=du.wait_s(120))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: model %s" % du.synth_dir(daemon.cfg["model"]["synthetic_dir"]) in r.stdout
    assert "check: ok" in r.stdout, r.stdout


def test_grafana_dashboard_names_real_metrics(daemon, expert_counts):
    """Every metric the dashboard in docs/ queries is one /metrics serves
    (the kernel ones only with a GPU backend)."""
    with open(os.path.join(ROOT, "docs/grafana-moed.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = set(re.findall(r"\b((?:moed|process)_[a-z0-9_]+)", " ".join(exprs)))
    text = http_get(daemon, "/metrics")
    served = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    for n in sorted(names):
        fam = re.sub(r"_(bucket|sum|count)$", "", n)
        if fam.startswith("moed_kernel_") and du.TEST_BACKEND == "cpu":
            continue
        assert fam in served, (n, sorted(served))


def test_make_deb(tmp_path):
    """`make deb` packages the PREFIX=/usr install: binaries, library,
    headers, .pc, unit, sysusers entry, the config as a conffile."""
    if not shutil.which("dpkg-deb"):
        pytest.skip("dpkg-deb not installed")
    try:
        r = run(["make", "-s", "-C", ROOT, *MAKE_ARGS, "deb"], timeout=du.wait_s(300))
        assert r.returncode == 0, r.stdout + r.stderr
        debs = [f for f in os.listdir(du.BUILD) if f.startswith("moed_") and f.endswith(".deb")]
        assert len(debs) == 1, debs
        deb = os.path.join(du.BUILD, debs[0])
        files = run(["dpkg-deb", "-c", deb]).stdout
        for f in ["./usr/bin/moed", "./usr/lib/libmoedclient.so.1", "./usr/include/moed/moed_client.h",
                  "./usr/lib/pkgconfig/moed-client.pc", "./lib/systemd/system/moed.service",
                  "./usr/lib/sysusers.d/moed.conf", "./etc/moed/moed.json"]:
            assert f in files, (f, files)
        info = run(["dpkg-deb", "-I", deb]).stdout
        assert "Package: moed" in info and "libuv1" in info, info
        assert run(["dpkg-deb", "-e", deb, str(tmp_path / "ctl")]).returncode == 0
        assert (tmp_path / "ctl" / "conffiles").read_text() == "/etc/moed/moed.json\n"
        assert run(["dpkg-deb", "-x", deb, str(tmp_path / "fs")]).returncode == 0
        unit = (tmp_path / "fs/lib/systemd/system/moed.service").read_text()
        assert "ExecStart=/usr/bin/moed --config /etc/moed/moed.json" in unit
        pc = (tmp_path / "fs/usr/lib/pkgconfig/moed-client.pc").read_text()
        assert pc.startswith("prefix=/usr\n"), pc
    finally:
        run(["make", "-s", "-C", ROOT, *MAKE_ARGS, os.path.join(du.BUILD, "moed-client.pc"),
             os.path.join(du.BUILD, "moed.service")])
        shutil.rmtree(os.path.join(du.BUILD, "deb"), ignore_errors=True)
