"""The HTTP status port under slowloris, through the real daemon: 80 slow
clients from one address (one header byte a second, reconnecting whenever
they are closed) must not keep /status probes and scrapes from another
address from getting 200 at once; every refusal is an answer (503 or 408)
followed by a clean close, never a reset; a slow client is closed at the
header deadline.
"""

import http.client
import select
import socket
import threading
import time

import pytest

import daemon_util as du

N_SLOW = 80          # slowloris connections (the status port serves 64 at once)
N_PROBES = 48
HEADER_TIMEOUT_MS = 2000  # the default of status.header_timeout_ms
PROBE_ADDR = "127.0.0.2"  # Linux routes all of 127/8 to loopback


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("statusport")
    cfg = du.base_config(str(tmp), du.models_dir(tmp_path_factory),
                         status__port=du.free_port())
    with du.Daemon(tmp, cfg) as d:
        yield d
        assert d.alive(), d.log()[-3000:]
        assert d.stop() == 0, d.log()[-4000:]


class Slowloris:
    """N connections from 127.0.0.1 sending "GET /status HTTP/1.1\\r\\n" and
    then one header byte a second, never finishing the head; a connection the
    server closes is read to its end (answer or reset recorded) and opened
    again 50 ms later. One thread, non-blocking sockets."""

    def __init__(self, port, n):
        self.port, self.n = port, n
        self.stop = False
        self.lock = threading.Lock()
        self.answers = {}     # status line code -> count
        self.resets = 0       # ECONNRESET seen on a closed connection
        self.connects = 0
        self.longest = 0.0    # longest life of a connection the server closed
        self.th = threading.Thread(target=self.run, daemon=True)

    def open(self):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        self.connects += 1
        return {"s": s, "t0": time.monotonic(), "next": time.monotonic(), "sent": 0,
                "got": b""}

    def finish(self, c, reset):
        with self.lock:
            if reset:
                self.resets += 1
            head = c["got"].split(b"\r\n", 1)[0]
            code = head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1 ") else "none"
            self.answers[code] = self.answers.get(code, 0) + 1
            self.longest = max(self.longest, time.monotonic() - c["t0"])
        c["s"].close()

    def run(self):
        conns = [self.open() for _ in range(self.n)]
        pending = []  # reopen times
        req = b"GET /status HTTP/1.1\r\nX-Slow: "  # a header value that never ends
        while not self.stop:
            now = time.monotonic()
            while pending and pending[0] <= now:
                pending.pop(0)
                conns.append(self.open())
            for c in conns:
                if c["next"] <= now:
                    data = req if c["sent"] == 0 else b"a"
                    try:
                        c["s"].send(data)
                        c["sent"] += 1
                        c["next"] = now + 1.0
                    except (BlockingIOError, InterruptedError):
                        c["next"] = now + 0.05
                    except OSError:
                        c["next"] = now + 1.0  # the read below sees why
            r, _, _ = select.select([c["s"] for c in conns], [], [], 0.05)
            rs = set(r)
            keep = []
            for c in conns:
                if c["s"] not in rs:
                    keep.append(c)
                    continue
                try:
                    chunk = c["s"].recv(65536)
                except ConnectionResetError:
                    self.finish(c, True)
                    pending.append(time.monotonic() + 0.05)
                    continue
                except (BlockingIOError, InterruptedError):
                    keep.append(c)
                    continue
                if chunk:
                    c["got"] += chunk
                    keep.append(c)
                    continue
                self.finish(c, False)
                pending.append(time.monotonic() + 0.05)
            conns = keep
        for c in conns:
            c["s"].close()


def probe(port, path):
    t0 = time.monotonic()
    h = http.client.HTTPConnection("127.0.0.1", port, timeout=du.wait_s(10),
                                   source_address=(PROBE_ADDR, 0))
    try:
        h.request("GET", path)
        r = h.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    except (OSError, http.client.HTTPException) as e:
        return repr(e), time.monotonic() - t0
    finally:
        h.close()


def test_probes_served_under_slowloris(daemon):
    port = daemon.http_port()
    slow = Slowloris(port, N_SLOW)
    slow.th.start()
    try:
        time.sleep(2.5)  # ramp-up: every slow connection has sent 2-3 bytes
        results = []
        for i in range(N_PROBES):
            results.append(probe(port, "/status" if i % 2 == 0 else "/metrics"))
            time.sleep(0.05)
    finally:
        slow.stop = True
        slow.th.join(du.wait_s(10))
    bound = 1.0 * du.TIME_SCALE / 3
    bad = [r for r in results if r[0] != 200]
    slowest = max(t for _, t in results)
    print("probes: %d of %d got 200, slowest %.3f s; slowloris: %d connects, answers %s, "
          "%d resets, longest life %.2f s"
          % (N_PROBES - len(bad), N_PROBES, slowest, slow.connects, slow.answers, slow.resets,
             slow.longest))
    assert not bad, "%d of %d probes failed: %s" % (len(bad), N_PROBES, bad[:8])
    assert slowest < bound, "slowest probe %.3f s, bound %.3f s" % (slowest, bound)
    # refusals are answers followed by a clean close, never a reset
    assert slow.resets == 0, (slow.resets, slow.answers)
    assert slow.answers.get("none", 0) == 0, slow.answers
    assert set(slow.answers) <= {"503", "408"}, slow.answers
    # the slow connections that held a slot were closed at the header deadline
    assert slow.answers.get("408", 0) > 0, slow.answers
    assert slow.longest < du.wait_s(HEADER_TIMEOUT_MS / 1000.0 + 1.0), slow.longest


def test_header_deadline_answers_408(daemon):
    """One slow client alone (no pressure): answered 408 and closed cleanly at
    status.header_timeout_ms, not kept for the whole connection deadline."""
    port = daemon.http_port()
    s = socket.create_connection(("127.0.0.1", port), timeout=du.wait_s(10))
    t0 = time.monotonic()
    s.sendall(b"GET /status HTTP/1.1\r\nX-Slow: ")
    got = b""
    while True:
        chunk = s.recv(65536)  # a reset would raise here
        if not chunk:
            break
        got += chunk
    dt = time.monotonic() - t0
    s.close()
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got[:200]
    assert b"Connection: close\r\n" in got
    assert HEADER_TIMEOUT_MS / 1000.0 * 0.9 < dt < du.wait_s(HEADER_TIMEOUT_MS / 1000.0 + 1.0), dt
    # and the port still serves
    assert probe(port, "/healthz")[0] == 200
