"""Helpers for the daemon tests: start the real moed binary on a temp socket,
wait until it serves, stop it, and craft raw frames on a raw socket.

Build dir from $MOED_BUILD (default "build"). Every daemon gets its own temp
directory (config, socket, log); models are generated once per test session
into a shared synthetic_dir (the daemon reuses a complete one).
"""

import json
import os
import signal
import socket
import struct
import subprocess
import time

import moed_client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("MOED_BUILD", "build")
if not os.path.isabs(BUILD):
    BUILD = os.path.join(ROOT, BUILD)
MOED = os.path.join(BUILD, "moed")
MOECTL = os.path.join(BUILD, "moectl")

# Wire constants and error codes: the Python client's (its one copy, checked
# against the C headers by test_constants.py).
MAGIC = moed_client.PROTO_MAGIC
VERSION = moed_client.PROTO_MIN_VERSION  # frames of the version-1 types travel as version 1
HDR = struct.Struct("<IHHIIQQ")
REPLY = moed_client.REPLY
MSG_HELLO, MSG_FORWARD, MSG_STATUS, MSG_PING, MSG_ERROR = (
    moed_client.MSG_HELLO, moed_client.MSG_FORWARD, moed_client.MSG_STATUS,
    moed_client.MSG_PING, moed_client.MSG_ERROR)
MSG_REGISTER_BUF = moed_client.MSG_REGISTER_BUF
MSG_UNREGISTER_BUF = moed_client.MSG_UNREGISTER_BUF
MSG_FORWARD_DESC = moed_client.MSG_FORWARD_DESC

E = {name: code for code, name in moed_client.ERROR_NAMES.items() if code}  # "inval": -12, ...

# The model every daemon test uses (generated on first use by the daemon).
SYNTH_PRESET = "tiny"
SYNTH_LAYERS = 2
SYNTH_SEED = 7
SYNTH_SPEC = "synthetic:%s:layers=%d:seed=%d" % (SYNTH_PRESET, SYNTH_LAYERS, SYNTH_SEED)


def synth_dir(synthetic_dir):
    """Where the daemon puts the checkpoint for SYNTH_SPEC."""
    return os.path.join(synthetic_dir, "%s-l%d-s%d" % (SYNTH_PRESET, SYNTH_LAYERS, SYNTH_SEED))


# The backend the daemon tests run on: "cpu" in CI; `make test-gpu` runs the
# same suite with MOED_TEST_BACKEND=cuda on a GPU machine.
TEST_BACKEND = os.environ.get("MOED_TEST_BACKEND", "cpu")

# Every wait in these tests is for an event (a reply, EOF, an exit, a log
# line); its limit only bounds a failure, so a generous one costs nothing when
# the test passes. Sanitizer builds on a loaded 2-core CI machine run many
# times slower than a plain build on an idle one: every limit goes through
# wait_s(), scaled by MOED_TEST_TIME_SCALE (default 3, or 10 under
# MOED_SANITIZE=1). A wait that must NOT see an event (a client timeout
# test) is not scaled.
TIME_SCALE = float(os.environ.get("MOED_TEST_TIME_SCALE") or
                   (10 if os.environ.get("MOED_SANITIZE") == "1" else 3))


def wait_s(seconds):
    """`seconds` scaled for the build and the machine (see TIME_SCALE)."""
    return seconds * TIME_SCALE


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (for status.port)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def models_dir(tmp_path_factory):
    """synthetic_dir shared by a session's daemons (each model generated once);
    the `models_dir` fixture (conftest.py) is this."""
    return str(tmp_path_factory.getbasetemp() / "models")


def module_daemon(tmp_path_factory, models_dir, name):
    """Body of a module-scoped `daemon` fixture (`yield from` it): a daemon on
    base_config with a free status port, which must exit cleanly at the end
    (and leak nothing under ASan)."""
    tmp = tmp_path_factory.mktemp(name)
    cfg = base_config(str(tmp), models_dir, status__port=free_port())
    with Daemon(tmp, cfg) as d:
        yield d
        assert d.stop() == 0, d.log()[-4000:]


def base_config(tmpdir, synthetic_dir, **over):
    """A small, strict config: MOED_TEST_BACKEND (default CPU), tight limits,
    short frame deadline; log.level MOED_TEST_LOG_LEVEL (default info)."""
    cfg = {
        "server": {
            "socket": os.path.join(tmpdir, "moed.sock"),
            "socket_mode": "0660",
            "max_clients": 40,
            "max_pending_per_client": 32,
            "max_frame_bytes": 1 << 20,
            "max_client_buffer_bytes": 4 << 20,
            # a reply not read for this long drops the client: scaled, so a
            # test process descheduled on a loaded machine is not dropped
            "frame_timeout_ms": int(wait_s(0.3) * 1000),
        },
        "status": {"address": "127.0.0.1", "port": 0},
        "model": {"path": SYNTH_SPEC, "synthetic_dir": synthetic_dir},
        "engine": {"backend": TEST_BACKEND, "max_tokens": 64, "cpu_threads": 0},
        "log": {"level": os.environ.get("MOED_TEST_LOG_LEVEL", "info")},
    }
    for key, val in over.items():
        sect, name = key.split("__", 1)
        cfg.setdefault(sect, {})[name] = val
    return cfg


class Daemon:
    """One moed process. Use as a context manager (always cleans up)."""

    def __init__(self, tmpdir, cfg, start_timeout=120.0, env=None):
        self.env = env
        self.tmpdir = str(tmpdir)
        self.cfg = cfg
        self.sock_path = cfg["server"]["socket"]
        self.cfg_path = os.path.join(self.tmpdir, "moed.json")
        self.log_path = os.path.join(self.tmpdir, "moed.log")
        self.start_timeout = start_timeout
        self.proc = None
        self.returncode = None

    def start(self):
        with open(self.cfg_path, "w") as f:
            json.dump(self.cfg, f)
        self._log = open(self.log_path, "wb")
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        env.update(self.env or {})
        self.proc = subprocess.Popen([MOED, "--config", self.cfg_path], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + wait_s(self.start_timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("moed exited with %d during start-up:\n%s"
                                   % (self.proc.returncode, self.log()))
            if "ready: socket" in self.log():
                return self
            time.sleep(0.02)
        raise RuntimeError("moed not ready after %.0fs:\n%s" % (self.start_timeout, self.log()))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        # SIGTERM first: under MPS, a process killed while its kernel is
        # resident leaves the MPS server to tear that kernel down, and the
        # next process on the GPU gets a fatal error (seen on the H200,
        # scripts/probe_mps_kill.py); SIGKILL only if it does not stop
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(wait_s(10))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    @property
    def pid(self):
        return self.proc.pid

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def signal(self, sig=signal.SIGTERM):
        self.proc.send_signal(sig)

    def wait(self, timeout=30.0):
        self.returncode = self.proc.wait(wait_s(timeout))
        return self.returncode

    def stop(self, timeout=30.0):
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None

    def alive(self):
        return self.proc.poll() is None

    def sanitized(self):
        """True if the binary runs under AddressSanitizer (its quarantine keeps
        freed memory resident, so RSS says nothing there; LeakSanitizer at a
        clean exit checks leaks instead)."""
        with open("/proc/%d/maps" % self.proc.pid) as f:
            return "libasan" in f.read()

    def rss_kb(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def http_port(self):
        """The status port the daemon logged (config port 0 picks a free one)."""
        for line in self.log().splitlines():
            if "status on http://" in line:
                return int(line.rsplit(":", 1)[1].split("/", 1)[0])
        return None

    def connect(self, timeout=10.0):
        return raw_connect(self.sock_path, timeout)


# ---- raw frames ----------------------------------------------------------------

def raw_connect(path, timeout=10.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(wait_s(timeout))
    s.connect(path)
    return s


def header(mtype, rid=0, plen=0, magic=MAGIC, version=VERSION, flags=0, reserved=0):
    return HDR.pack(magic, version, mtype, flags, reserved, rid, plen)


def frame(mtype, rid=0, payload=b"", **kw):
    return header(mtype, rid, len(payload), **kw) + payload


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError("EOF after %d of %d bytes" % (len(buf), n))
        buf += chunk
    return bytes(buf)


def read_frame(s):
    """-> (type, request_id, payload)."""
    magic, ver, mtype, flags, res, rid, plen = HDR.unpack(recv_exact(s, 32))
    assert magic == MAGIC and ver == moed_client.frame_version(mtype), (hex(magic), ver, mtype)
    return mtype, rid, recv_exact(s, plen)


def parse_error(payload):
    code, mlen = struct.unpack_from("<iI", payload)
    msg = payload[8:8 + mlen].decode("utf-8")
    assert len(payload) == 8 + mlen
    return code, msg


def expect_error(s, code, substr, rid=None):
    """Read one frame; it must be ERROR with `code` and `substr` in its message."""
    mtype, r, payload = read_frame(s)
    assert mtype == MSG_ERROR | REPLY, "expected ERROR, got type 0x%04x" % mtype
    c, msg = parse_error(payload)
    assert c == code, "error code %d (%s), expected %d" % (c, msg, code)
    assert substr in msg, "%r not in %r" % (substr, msg)
    if rid is not None:
        assert r == rid, "request id %d, expected %d" % (r, rid)
    return msg


def expect_closed(s, timeout=10.0):
    """The daemon closed the connection (EOF or reset), nothing more to read."""
    s.settimeout(wait_s(timeout))
    try:
        data = s.recv(65536)
    except ConnectionResetError:
        return
    assert data == b"", "expected EOF, got %d more bytes" % len(data)


def hello_payload():
    return struct.pack("<HHI", 1, 1, 0)


def hello(s, rid=1):
    s.sendall(frame(MSG_HELLO, rid, hello_payload()))
    mtype, r, p = read_frame(s)
    assert mtype == MSG_HELLO | REPLY and r == rid, (mtype, r)
    f = struct.unpack("<HHIIIIIIIIIQ16s", p)
    return dict(version=f[0], hidden=f[2], inter=f[3], n_experts=f[4], top_k=f[5],
                n_shared=f[6], n_layers=f[7], first_moe_layer=f[8], max_tokens=f[9],
                max_frame_bytes=f[11], backend=f[12].rstrip(b"\0").decode())


def forward_payload(layer, x_bits, ids, w, n_tokens=None, top_k=None, flags=0):
    """x_bits: bytes (bf16 little-endian [T,H]); ids int32 [T,k]; w fp32 [T,k]
    (numpy arrays or bytes). n_tokens/top_k override the head fields."""
    xb = bytes(x_bits)
    ib = ids.astype("<i4").tobytes() if hasattr(ids, "astype") else bytes(ids)
    wb = w.astype("<f4").tobytes() if hasattr(w, "astype") else bytes(w)
    if n_tokens is None:
        n_tokens = ids.shape[0]
    if top_k is None:
        top_k = ids.shape[1]
    return struct.pack("<IIII", layer, n_tokens, top_k, flags) + xb + ib + wb


def forward_reply(payload):
    t, h = struct.unpack_from("<II", payload)
    assert len(payload) == 8 + 2 * t * h
    return t, h, payload[8:]


def check_forward_reply(conn, want):
    """Read one frame: a FORWARD reply whose request id is a key of `want`
    (id -> reference output); check it against that reference and drop the
    id from `want`."""
    import numpy as np
    mtype, rid, p = read_frame(conn)
    assert mtype == MSG_FORWARD | REPLY, parse_error(p)
    assert rid in want, (rid, sorted(want))
    ref = want.pop(rid)
    y = np.frombuffer(forward_reply(p)[2], np.uint16).reshape(ref.shape)
    assert rel_l2(y, ref) < 1e-2


def forward_lone_and_burst(conns, cases, rid, burst=None):
    """Every case as a lone request (one in flight: the daemon computes it in
    place in its read buffer and writes y into the reply frame) on each of
    `conns`, then all cases as one pipelined write (later frames share the
    read buffer, so they are copied and merged) on each of `burst` (default:
    `conns`); every reply is checked against its reference. Request ids
    continue from `rid`; returns the last one used."""
    for conn in conns:
        for layer, x, ids, w, ref in cases:
            rid += 1
            conn.sendall(frame(MSG_FORWARD, rid, forward_payload(layer, x.tobytes(), ids, w)))
            check_forward_reply(conn, {rid: ref})
    wants = []
    for conn in conns if burst is None else burst:
        want, frames = {}, []
        for layer, x, ids, w, ref in cases:
            rid += 1
            want[rid] = ref
            frames.append(frame(MSG_FORWARD, rid, forward_payload(layer, x.tobytes(), ids, w)))
        conn.sendall(b"".join(frames))
        wants.append((conn, want))
    for conn, want in wants:
        while want:
            check_forward_reply(conn, want)
    return rid


# ---- reference outputs ----------------------------------------------------------
# The float64 numpy reference and bf16 helpers are conftest's (shared with the
# codec and reference tests): F64Reference reads the checkpoint's safetensors
# directly, independent of the C code.

from conftest import F64Reference, bf16_bits, bf16_to_f64, rel_l2  # noqa: E402,F401


def reference_cases(daemon, dims, n=4, max_t=8, seed=0):
    """n random FORWARD inputs on the daemon's model with their reference
    outputs: [(layer, x_bits, ids, w, ref)]."""
    import numpy as np
    ref = F64Reference(synth_dir(daemon.cfg["model"]["synthetic_dir"]))
    rng = np.random.default_rng(seed)
    layers = [l for l in range(dims["first_moe_layer"], dims["n_layers"])]
    out = []
    for i in range(n):
        t = int(rng.integers(1, max_t + 1))
        x = bf16_bits(rng.standard_normal((t, dims["hidden"])).astype(np.float32))
        ids = np.stack([rng.choice(dims["n_experts"], dims["top_k"], replace=False)
                        for _ in range(t)]).astype(np.int32)
        w = rng.random((t, dims["top_k"])).astype(np.float32)
        layer = layers[i % len(layers)]
        out.append((layer, x, ids, w, ref.forward(layer, x, ids, w)))
    return out
