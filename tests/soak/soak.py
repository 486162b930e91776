#!/usr/bin/env python3
"""soak.py - long mixed-load run against a real moed on the CPU backend.

    make soak DURATION=1800          (seconds; also "30m", "2h")
    .venv/bin/python tests/soak/soak.py --duration 30m --build build

Starts the daemon (tests/py/daemon_util.Daemon, synthetic tiny model), then
runs, all at once:
  probe     one client, one FORWARD (T=4) every 50 ms: the latency measured
  pipeline  2 clients, each keeping 4 FORWARDs of T=16 in flight
  churn     connect, HELLO, 1-5 FORWARDs, close, again (client restarts)
  kill9     a child process pipelining FORWARDs (raw frames, never reading
            much), SIGKILLed after 0.2-2 s, one a second
  slow      pipelines 16 FORWARDs of T=64, then reads one reply every 100 ms
  scrape    STATUS over the socket and GET /metrics on the status port, 1/s

After a warm-up (10% of the run, at most 120 s) the load pauses until the
daemon reports no client connected, and the baseline RSS and open fds are
taken; at the end the same is done again. Latency is compared between the
first and the last fifth of the measured time (pooled windows), so one noisy
window on a shared machine does not decide it. Prints one row per window and
a drift table; exits 1 if a target fails (p99 drift >= 10%, RSS drift >= 50 MB,
fds not flat), 2 if the daemon died or a load thread broke.
"""

import argparse
import http.client
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "py"))

P99_DRIFT_MAX = 0.10
RSS_DRIFT_MAX_MB = 50.0


def parse_duration(s):
    s = str(s).strip()
    mult = {"s": 1, "m": 60, "h": 3600}
    if s and s[-1] in mult:
        return float(s[:-1]) * mult[s[-1]]
    return float(s)


def socket_kind(target):
    """' (unix ...)' / ' (tcp ...)' for a "socket:[inode]" fd target."""
    if not target.startswith("socket:["):
        return ""
    inode = target[8:-1]
    for proto in ("unix", "tcp", "tcp6"):
        try:
            with open("/proc/net/" + proto) as f:
                for line in f:
                    if inode in line.split():
                        return " (%s: %s)" % (proto, " ".join(line.split()))
        except OSError:
            pass
    return " (not in /proc/net)"


def pct(vals, q):
    if not vals:
        return float("nan")
    v = sorted(vals)
    return v[min(len(v) - 1, int(q * len(v)))]


class Gate:
    """Run / pause / stop shared by the load threads."""

    def __init__(self):
        self.cv = threading.Condition()
        self.paused = False
        self.stopping = False
        self.active = 0  # threads inside a unit of work

    def enter(self):
        """Block while paused; False once stopping."""
        with self.cv:
            while self.paused and not self.stopping:
                self.cv.wait(0.5)
            if self.stopping:
                return False
            self.active += 1
            return True

    def leave(self):
        with self.cv:
            self.active -= 1
            self.cv.notify_all()

    def pause(self, timeout):
        with self.cv:
            self.paused = True
            end = time.monotonic() + timeout
            while self.active and time.monotonic() < end:
                self.cv.wait(0.2)
            return self.active == 0

    def resume(self):
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def stop(self):
        with self.cv:
            self.stopping = True
            self.cv.notify_all()


class Soak:
    def __init__(self, args, daemon, mc, np):
        self.args = args
        self.d = daemon
        self.mc = mc
        self.np = np
        self.gate = Gate()
        self.lock = threading.Lock()
        self.lat = []          # (t, seconds) of the probe
        self.counts = {}       # event -> count
        self.errors = []       # unexpected exceptions (thread, text)
        self.rng = random.Random(args.seed)
        with mc.Client(daemon.sock_path, timeout=30) as c:
            self.info = c.hello()
        self.layers = list(range(self.info.first_moe_layer, self.info.n_layers))

    def count(self, what, n=1):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def inputs(self, rng, t):
        np = self.np
        x = rng.standard_normal((t, self.info.hidden)).astype(np.float32)
        ids = np.stack([rng.choice(self.info.n_experts, self.info.top_k, replace=False)
                        for _ in range(t)]).astype(np.int32)
        w = rng.random((t, self.info.top_k)).astype(np.float32)
        return self.layers[int(rng.integers(len(self.layers)))], x, ids, w

    def client(self):
        c = self.mc.Client(self.d.sock_path, timeout=60)
        c.hello()
        return c

    # ---- load threads: each loops over short units of work between
    # gate.enter() and gate.leave(), closing its connections at the end of
    # a unit when the gate pauses.

    def run_thread(self, name, unit):
        rng = self.np.random.default_rng(abs(hash(name)) % (1 << 32))
        state = {}
        while self.gate.enter():
            try:
                unit(rng, state)
            except Exception as e:  # noqa: BLE001 - reported, ends the run
                if self.gate.stopping:
                    break
                with self.lock:
                    self.errors.append((name, "%s: %s" % (type(e).__name__, e)))
                break
            finally:
                if self.gate.paused or self.gate.stopping:
                    for c in state.pop("clients", []):
                        c.close()
                self.gate.leave()

    def probe(self, rng, state):
        if not state.get("clients"):
            state["clients"] = [self.client()]
        c = state["clients"][0]
        args = self.inputs(rng, 4)
        for _ in range(20):
            t0 = time.perf_counter()
            c.forward(*args)
            dt = time.perf_counter() - t0
            with self.lock:
                self.lat.append((time.monotonic(), dt))
            time.sleep(max(0.0, 0.05 - dt))

    def pipeline(self, rng, state):
        if not state.get("clients"):
            state["clients"] = [self.client()]
        c = state["clients"][0]
        rid = state.get("rid", 0)
        for _ in range(4 - c.inflight):
            rid += 1
            c.send_forward(rid, *self.inputs(rng, 16))
        state["rid"] = rid
        for _ in range(8):
            c.recv()
            time.sleep(0.01)
            rid += 1
            c.send_forward(rid, *self.inputs(rng, 16))
            state["rid"] = rid
        while c.inflight and (self.gate.paused or self.gate.stopping):
            c.recv()
        self.count("pipeline_requests", 8)

    def churn(self, rng, state):
        with self.client() as c:
            for _ in range(int(rng.integers(1, 6))):
                c.forward(*self.inputs(rng, int(rng.integers(1, 17))))
        self.count("churn_sessions")
        time.sleep(0.1)

    def kill9(self, rng, state):
        # the child speaks raw frames (no numpy import: a cheap start-up on
        # a small machine) and pipelines FORWARDs until it is killed
        code = ("import socket, struct, sys, random\n"
                "r = random.Random(int(sys.argv[2])); H, K, E, L = map(int, sys.argv[3:7])\n"
                "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
                "def fr(t, i, p): return struct.pack('<IHHIIQQ', 0x44454F4D, 1, t, 0, 0, i,"
                " len(p)) + p\n"
                "s.sendall(fr(1, 1, struct.pack('<HHI', 1, 1, 0))); rid = 1\n"
                "while True:\n"
                "    for _ in range(8):\n"
                "        rid += 1; t = r.randint(1, 32)\n"
                "        ids = b''.join(struct.pack('<i', e) for _ in range(t)"
                " for e in r.sample(range(E), K))\n"
                "        p = struct.pack('<IIII', L, t, K, 0) + b'\\x80\\x3f' * (t * H)"
                " + ids + struct.pack('<f', 0.5) * (t * K)\n"
                "        s.sendall(fr(2, rid, p))\n"
                "    s.recv(1 << 16)\n")
        i = self.info
        p = subprocess.Popen([sys.executable, "-c", code, self.d.sock_path,
                              str(int(rng.integers(1 << 30))), str(i.hidden), str(i.top_k),
                              str(i.n_experts), str(i.first_moe_layer)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.2 + 1.8 * float(rng.random()))
        alive = p.poll() is None
        p.kill()
        _, err = p.communicate()
        if not alive:
            raise RuntimeError("kill9 child exited by itself (%d): %s"
                               % (p.returncode, err.decode()[-400:]))
        self.count("kill9")
        time.sleep(1.0)

    def slow(self, rng, state):
        with self.client() as c:
            for rid in range(1, 17):
                c.send_forward(rid, *self.inputs(rng, 64))
            while c.inflight:
                time.sleep(0.1)
                c.recv()
        self.count("slow_sessions")

    def scrape(self, rng, state):
        with self.mc.Client(self.d.sock_path, timeout=30) as c:
            c.status()
        port = self.d.http_port()
        if port:
            h = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            h.request("GET", "/metrics")
            r = h.getresponse()
            r.read()
            h.close()
            if r.status != 200:
                raise RuntimeError("/metrics answered %d" % r.status)
        self.count("scrapes")
        time.sleep(1.0)

    # ---- daemon state

    def cpu_s(self):
        """The daemon's user + system CPU seconds so far."""
        with open("/proc/%d/stat" % self.d.pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def served(self):
        with self.mc.Client(self.d.sock_path, timeout=30) as c:
            return int(c.status()["requests"]["served"])

    def rss_mb(self):
        return self.d.rss_kb() / 1024.0

    def fd_targets(self):
        out = {}
        base = "/proc/%d/fd" % self.d.pid
        for f in os.listdir(base):
            try:
                out[int(f)] = os.readlink(os.path.join(base, f))
            except OSError:
                pass
        return out

    def fds(self):
        return len(os.listdir("/proc/%d/fd" % self.d.pid))

    def connected(self):
        with self.mc.Client(self.d.sock_path, timeout=30) as c:
            return int(c.status()["clients"]["connected"]) - 1  # minus this one

    def quiesce(self, what):
        """Pause the load, wait until no client is connected and the fd count
        is stable; returns (rss_mb, fds)."""
        self.gate.pause(120)
        end = time.monotonic() + 120
        seen = []
        while time.monotonic() < end:
            # fds first: the STATUS connection connected() opens is closed by
            # the daemon a moment after it returns, so counted after it, it
            # is there or not by chance (a soak once saw 12 fds at the start
            # and 11 at the end for that reason alone)
            f, n = self.fds(), self.connected()
            seen = seen[-3:] + [f] if n == 0 else []
            if len(seen) == 4 and len(set(seen)) == 1:  # stable for 1.5 s
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("%s: clients still connected after 120 s" % what)
        # the count is the one taken before connected() opened its own
        # connection (see above); the fd map too, once the daemon has closed
        # that connection's end (counted right after it, the final sample of
        # a 30-minute run once read 12 against 11, the extra fd that very
        # STATUS connection on the daemon's socket)
        for _ in range(50):
            self.idle_fds = self.fd_targets()
            if len(self.idle_fds) == seen[-1]:
                break
            time.sleep(0.1)
        return self.rss_mb(), seen[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", default="30m", help="seconds, or 30m / 2h")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per table row")
    ap.add_argument("--build", default=os.environ.get("MOED_BUILD", "build"))
    ap.add_argument("--threads", type=int, default=0, help="engine.cpu_threads (0: per core)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (config, log)")
    args = ap.parse_args()
    duration = parse_duration(args.duration)
    os.environ["MOED_BUILD"] = os.path.abspath(args.build)

    import numpy as np
    import moed_client as mc
    import daemon_util as du

    tmp = tempfile.mkdtemp(prefix="moed-soak-")
    cfg = du.base_config(tmp, os.path.join(tmp, "models"), server__max_clients=64,
                         server__max_pending_per_client=64,
                         server__max_client_buffer_bytes=16 << 20,
                         server__frame_timeout_ms=30000, engine__cpu_threads=args.threads,
                         engine__max_tokens=64)
    d = du.Daemon(tmp, cfg, start_timeout=300)
    d.start()
    rc = 0
    try:
        rc = run(args, duration, d, mc, np)
    finally:
        code = d.stop(60)
        print("daemon exit code %d (log %s)" % (code, d.log_path))
        if code != 0:
            print(d.log()[-3000:])
            rc = rc or 2
        if not args.keep and rc == 0:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return rc


def run(args, duration, d, mc, np):
    s = Soak(args, d, mc, np)
    units = [("probe", s.probe), ("pipeline0", s.pipeline), ("pipeline1", s.pipeline),
             ("churn", s.churn), ("kill9", s.kill9), ("slow", s.slow), ("scrape", s.scrape)]
    threads = [threading.Thread(target=s.run_thread, args=u, daemon=True, name=u[0])
               for u in units]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    warm = min(120.0, 0.1 * duration)
    time.sleep(warm)
    rss0, fd0 = s.quiesce("start")
    fdmap0 = s.idle_fds
    s.gate.resume()
    t0 = time.monotonic()
    print("baseline after %.0f s warm-up: RSS %.1f MB, %d fds (no client connected)"
          % (t0 - t_start, rss0, fd0), flush=True)
    print("%8s %8s %8s %8s %9s %5s %8s %6s  %s"
          % ("t_s", "probes", "p50_ms", "p99_ms", "rss_mb", "fds", "cpu_us/r", "load",
             "events (cumulative)"), flush=True)
    windows = []
    cpu_prev, req_prev = s.cpu_s(), s.served()
    t_end = t_start + duration
    next_row = t0 + args.window
    while True:
        now = time.monotonic()
        if s.errors or not d.alive():
            break
        if now >= next_row or now >= t_end:
            with s.lock:
                lat = [dt for (t, dt) in s.lat if next_row - args.window <= t < next_row]
                ev = dict(s.counts)
            cpu, req = s.cpu_s(), s.served()
            with open("/proc/loadavg") as f:
                load = float(f.read().split()[0])
            w = dict(t=now - t0, lat=lat, rss=s.rss_mb(), fds=s.fds(), load=load,
                     cpu=cpu - cpu_prev, req=req - req_prev)
            cpu_prev, req_prev = cpu, req
            windows.append(w)
            print("%8.0f %8d %8.2f %8.2f %9.1f %5d %8.0f %6.2f  %s"
                  % (w["t"], len(lat), 1e3 * pct(lat, 0.5), 1e3 * pct(lat, 0.99), w["rss"],
                     w["fds"], 1e6 * w["cpu"] / max(1, w["req"]), load,
                     " ".join("%s=%d" % kv for kv in sorted(ev.items()))),
                  flush=True)
            next_row += args.window
            if now >= t_end:
                break
        time.sleep(min(1.0, max(0.05, min(next_row, t_end) - time.monotonic())))
    broken = bool(s.errors) or not d.alive()
    if not broken:
        rss1, fd1 = s.quiesce("end")
    s.gate.stop()
    for t in threads:
        t.join(60)
    if not broken and fd1 != fd0:
        a, b = fdmap0, s.idle_fds
        for fd in sorted(set(a) | set(b)):
            if a.get(fd) != b.get(fd):
                print("fd %d: start %s, end %s%s" % (fd, a.get(fd, "-"), b.get(fd, "-"),
                                                     socket_kind(b.get(fd, ""))))
    for name, text in s.errors:
        print("load thread %s failed: %s" % (name, text))
    if broken:
        print("daemon %s" % ("alive" if d.alive() else "DIED"))
        return 2

    k = max(1, len(windows) // 5)
    first = [x for w in windows[:k] for x in w["lat"]]
    last = [x for w in windows[-k:] for x in w["lat"]]
    p99a, p99b = pct(first, 0.99), pct(last, 0.99)
    p99_drift = (p99b - p99a) / p99a
    rss_drift = rss1 - rss0
    print()
    print("soak: %.0f s measured after %.0f s warm-up, %d windows of %.0f s; "
          "p99 over the first and last %d windows (%d and %d probes)"
          % (windows[-1]["t"], t0 - t_start, len(windows),
             args.window, k, len(first), len(last)))
    print("events: %s" % " ".join("%s=%d" % kv for kv in sorted(s.counts.items())))
    rows = [("probe p99 (ms)", "%.2f" % (1e3 * p99a), "%.2f" % (1e3 * p99b),
             "%+.1f%%" % (100 * p99_drift), "< +%d%%" % (100 * P99_DRIFT_MAX),
             p99_drift < P99_DRIFT_MAX),
            ("probe p50 (ms)", "%.2f" % (1e3 * pct(first, 0.5)), "%.2f" % (1e3 * pct(last, 0.5)),
             "%+.1f%%" % (100 * (pct(last, 0.5) / pct(first, 0.5) - 1)), "-", None),
            ("RSS, idle (MB)", "%.1f" % rss0, "%.1f" % rss1, "%+.1f MB" % rss_drift,
             "< %d MB" % RSS_DRIFT_MAX_MB, rss_drift < RSS_DRIFT_MAX_MB),
            ("open fds, idle", "%d" % fd0, "%d" % fd1, "%+d" % (fd1 - fd0), "0", fd1 == fd0)]
    # Not targets: what the daemon spends per request (does not depend on how
    # busy the machine is) and the machine's load, to tell a daemon that
    # slows down from a machine that got busier.
    cpu_a = sum(w["cpu"] for w in windows[:k]) / max(1, sum(w["req"] for w in windows[:k]))
    cpu_b = sum(w["cpu"] for w in windows[-k:]) / max(1, sum(w["req"] for w in windows[-k:]))
    load_a = sum(w["load"] for w in windows[:k]) / k
    load_b = sum(w["load"] for w in windows[-k:]) / k
    rows += [("CPU/request (us)", "%.0f" % (1e6 * cpu_a), "%.0f" % (1e6 * cpu_b),
              "%+.1f%%" % (100 * (cpu_b / cpu_a - 1) if cpu_a else 0), "-", None),
             ("load average", "%.2f" % load_a, "%.2f" % load_b, "%+.2f" % (load_b - load_a), "-",
              None)]
    print("| %-16s | %10s | %10s | %10s | %8s | %4s |" % ("metric", "start", "end", "drift",
                                                          "target", "ok"))
    print("|%s|%s|%s|%s|%s|%s|" % ("-" * 18, "-" * 12, "-" * 12, "-" * 12, "-" * 10, "-" * 6))
    for name, a, b, dr, tgt, ok in rows:
        print("| %-16s | %10s | %10s | %10s | %8s | %4s |"
              % (name, a, b, dr, tgt, "-" if ok is None else ("yes" if ok else "NO")))
    return 0 if all(r[5] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
