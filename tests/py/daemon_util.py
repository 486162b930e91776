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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("MOED_BUILD", "build")
if not os.path.isabs(BUILD):
    BUILD = os.path.join(ROOT, BUILD)
MOED = os.path.join(BUILD, "moed")
MOECTL = os.path.join(BUILD, "moectl")

MAGIC = 0x44454F4D
VERSION = 1
HDR = struct.Struct("<IHHIIQQ")
REPLY = 0x8000
MSG_HELLO, MSG_FORWARD, MSG_STATUS, MSG_PING, MSG_ERROR = 1, 2, 3, 4, 5
MSG_REGISTER_BUF = 16

E = {  # common/moed_err.h
    "nomem": -1, "io": -2, "proto": -8, "version": -9, "type": -10, "toobig": -11,
    "inval": -12, "busy": -13, "timeout": -14, "shutdown": -15, "backend": -16,
    "unsupported": -17, "perm": -18,
}

# The model every daemon test uses (generated on first use by the daemon).
SYNTH_PRESET = "tiny"
SYNTH_LAYERS = 2
SYNTH_SEED = 7
SYNTH_SPEC = "synthetic:%s:layers=%d:seed=%d" % (SYNTH_PRESET, SYNTH_LAYERS, SYNTH_SEED)


def synth_dir(synthetic_dir):
    """Where the daemon puts the checkpoint for SYNTH_SPEC."""
    return os.path.join(synthetic_dir, "%s-l%d-s%d" % (SYNTH_PRESET, SYNTH_LAYERS, SYNTH_SEED))


def base_config(tmpdir, synthetic_dir, **over):
    """A small, strict config: CPU backend, tight limits, short frame deadline."""
    cfg = {
        "server": {
            "socket": os.path.join(tmpdir, "moed.sock"),
            "socket_mode": "0660",
            "max_clients": 40,
            "max_pending_per_client": 32,
            "max_frame_bytes": 1 << 20,
            "max_client_buffer_bytes": 4 << 20,
            "frame_timeout_ms": 300,
        },
        "status": {"address": "127.0.0.1", "port": 0},
        "model": {"path": SYNTH_SPEC, "synthetic_dir": synthetic_dir},
        "engine": {"backend": "cpu", "max_tokens": 64, "cpu_threads": 0},
        "log": {"level": "info"},
    }
    for key, val in over.items():
        sect, name = key.split("__", 1)
        cfg.setdefault(sect, {})[name] = val
    return cfg


class Daemon:
    """One moed process. Use as a context manager (always cleans up)."""

    def __init__(self, tmpdir, cfg, start_timeout=120.0):
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
        self.proc = subprocess.Popen([MOED, "--config", self.cfg_path], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
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
        self.returncode = self.proc.wait(timeout)
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
    s.settimeout(timeout)
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
    assert magic == MAGIC and ver == VERSION, (hex(magic), ver)
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


def expect_closed(s, timeout=5.0):
    """The daemon closed the connection (EOF or reset), nothing more to read."""
    s.settimeout(timeout)
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


# ---- reference outputs ----------------------------------------------------------
# A float64 numpy reference of one MoE layer, read straight from the
# checkpoint's safetensors (independent of the C code): weights dequantized as
# e2m1 * e4m3(block scale) * scale_2, h rounded to bf16 as the contract says.

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def bf16_bits(a):
    """float32 array -> uint16 bf16 bit patterns (round to nearest even)."""
    import numpy as np
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def bf16_to_f64(bits):
    import numpy as np
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _e4m3_table():
    import numpy as np
    t = np.zeros(256, dtype=np.float64)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 7
        if e == 0xF and m == 7:
            t[b] = np.nan
        elif e == 0:
            t[b] = s * (m / 8.0) * 2.0 ** -6
        else:
            t[b] = s * (1 + m / 8.0) * 2.0 ** (e - 7)
    return t


def _read_safetensors(path):
    import numpy as np
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in head.items():
        if name == "__metadata__":
            continue
        b, e = meta["data_offsets"]
        dt = {"U8": np.uint8, "F8_E4M3": np.uint8, "F32": np.float32, "BF16": np.uint16}[meta["dtype"]]
        out[name] = np.frombuffer(data[b:e], dtype=dt).reshape(meta["shape"])
    return out


class Reference:
    """reference.forward(layer, x_bits[T,H] uint16, ids[T,k], w[T,k]) -> float64 [T,H]."""

    def __init__(self, model_dir):
        import glob
        self.tensors = {}
        for p in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
            self.tensors.update(_read_safetensors(p))
        with open(os.path.join(model_dir, "config.json")) as f:
            self.config = json.load(f)
        self._e4m3 = _e4m3_table()
        self._cache = {}

    def _mat(self, prefix):
        import numpy as np
        if prefix in self._cache:
            return self._cache[prefix]
        w = self.tensors[prefix + ".weight"]
        sc = self._e4m3[self.tensors[prefix + ".weight_scale"]]
        s2 = float(self.tensors[prefix + ".weight_scale_2"].reshape(()))
        lut = np.array(_E2M1 + [-v for v in _E2M1], dtype=np.float64)
        n, kh = w.shape
        q = np.empty((n, 2 * kh), dtype=np.float64)
        q[:, 0::2] = lut[w & 0xF]
        q[:, 1::2] = lut[w >> 4]
        m = q * np.repeat(sc, 16, axis=1) * s2
        self._cache[prefix] = m
        return m

    def _expert(self, layer, e, n_experts):
        base = "model.layers.%d.mlp." % layer
        if e < n_experts:
            pre = base + "experts.%d." % e
        elif "%sshared_experts.gate_proj.weight" % base in self.tensors:
            pre = base + "shared_experts."
        else:
            pre = base + "shared_experts.%d." % (e - n_experts)
        return (self._mat(pre + "gate_proj"), self._mat(pre + "up_proj"),
                self._mat(pre + "down_proj"))

    def forward(self, layer, x_bits, ids, w):
        import numpy as np
        n_experts = self.config.get("n_routed_experts") or self.config.get("num_experts")
        n_shared = self.config.get("n_shared_experts") or 0
        x = bf16_to_f64(x_bits)
        y = np.zeros_like(x)
        ids = np.asarray(ids)
        w = np.asarray(w, dtype=np.float32).astype(np.float64)

        def run(e, xt):
            g, u, d = self._expert(layer, int(e), n_experts)
            a = g @ xt
            hh = a / (1 + np.exp(-a)) * (u @ xt)
            hh = bf16_to_f64(bf16_bits(hh.astype(np.float32)))
            return d @ hh

        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                y[t] += w[t, j] * run(ids[t, j], x[t])
            for s in range(n_shared):
                y[t] += run(n_experts + s, x[t])
        return y


def rel_l2(y, ref):
    """Relative L2 error of y (float array or uint16 bf16 bits) against ref."""
    import numpy as np
    y = np.asarray(y)
    y = bf16_to_f64(y) if y.dtype == np.uint16 else y.astype(np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / (den if den > 0 else 1.0))


def reference_cases(daemon, dims, n=4, max_t=8, seed=0):
    """n random FORWARD inputs on the daemon's model with their reference
    outputs: [(layer, x_bits, ids, w, ref)]."""
    import numpy as np
    ref = Reference(synth_dir(daemon.cfg["model"]["synthetic_dir"]))
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
