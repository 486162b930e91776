"""Shared fixtures and helpers for the moed Python tests.

What is here (import the helpers with ``from conftest import ...``; the
fixtures are found by pytest by name):

* Paths: ``ROOT``, ``BUILD`` (env ``MOED_BUILD``, default ``build``, relative
  to the repository root), ``MOECTL``, ``tool_path(name)`` for the helper
  programs built from tests/tools/*.c.
* bf16 helpers: ``bf16_bits(float array) -> uint16`` (round to nearest even,
  via ml_dtypes) and ``bf16_to_f64(uint16 array) -> float64``.
* Checkpoint reading: ``read_safetensors(path)`` and ``load_checkpoint(dir)``
  (all shards, names -> numpy arrays; F8_E4M3 tensors come back as
  ``ml_dtypes.float8_e4m3fn``). The file parsing is done here rather than by
  ``safetensors.numpy.load_file`` because that function needs a numpy dtype
  for F8_E4M3 which numpy does not have; test_genmodel checks that the
  safetensors package reads the same header.
* ``dequant(weight, weight_scale, weight_scale_2)``: NVFP4 -> float64 (low
  nibble = even column, value = e2m1 * e4m3 * scale_2); ``nvfp4_quantize(w)``
  the other way (ModelOpt's scales); ``write_safetensors(path, tensors)``.
* ``F64Reference(model_dir)``: an independent float64 MoE reference of the
  contract in kernels/moe_ref.h: g, u, d and the slot sum in float64, only
  h rounded to bf16 (ml_dtypes.bfloat16), output left in float64.
* ``gen_model(preset, layers, seed, out_dir, threads=0)``: runs
  ``moectl gen-model``.
* ``ref_forward(model_dir, layer, x_bits, ids, w, threads=0)``: runs the C
  reference through tests/tools/ref_forward and returns y as uint16 bf16 bits.
* ``rel_l2(y, ref)``.
* Module fixture ``models_dir``: the daemons' shared synthetic_dir
  (daemon_util.models_dir).
* Session fixtures ``tiny_model`` (tiny, 2 layers, seed 11) and
  ``qwen3_model`` (qwen3-30b-a3b, 1 layer, seed 12): checkpoint directories
  generated once per session.
"""

import json
import os
import struct
import subprocess
import tempfile

import ml_dtypes
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("MOED_BUILD", "build")
if not os.path.isabs(BUILD):
    BUILD = os.path.join(ROOT, BUILD)
MOECTL = os.path.join(BUILD, "moectl")


def tool_path(name):
    """Path of a helper program built from tests/tools/<name>.c."""
    return os.path.join(BUILD, "tools", name)


# --------------------------------------------------------------------- bf16

def bf16_bits(a):
    """Float array -> uint16 bf16 bit patterns, round to nearest even."""
    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_to_f64(bits):
    """uint16 bf16 bit patterns -> float64 (exact)."""
    return np.asarray(bits, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def rel_l2(y, ref):
    """Relative L2 error of y (uint16 bf16 bits or floats) against ref."""
    y = np.asarray(y)
    y = bf16_to_f64(y) if y.dtype == np.uint16 else y.astype(np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / (den if den > 0 else 1.0))


# -------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I16": np.dtype("<i2"), "U16": np.dtype("<u2"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I32": np.dtype("<i4"), "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8"), "F64": np.dtype("<f8"),
}


def read_safetensors_header(path):
    """(header dict without __metadata__, data-section offset)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head, 8 + n


def read_safetensors(path):
    """name -> numpy array (read-only views of one file read)."""
    head, off = read_safetensors_header(path)
    with open(path, "rb") as f:
        blob = f.read()
    out = {}
    for name, meta in head.items():
        b, e = meta["data_offsets"]
        dt = _ST_DTYPES[meta["dtype"]]
        out[name] = np.frombuffer(blob, dtype=dt, count=(e - b) // dt.itemsize,
                                  offset=off + b).reshape(meta["shape"])
    return out


def checkpoint_files(model_dir):
    """The safetensors files of a checkpoint (index order when sharded)."""
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, p) for p in files]
    return [os.path.join(model_dir, "model.safetensors")]


def load_checkpoint(model_dir):
    """All tensors of a checkpoint directory: name -> numpy array."""
    out = {}
    for p in checkpoint_files(model_dir):
        out.update(read_safetensors(p))
    return out


def load_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------- NVFP4

E2M1_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def e2m1_codes(weight):
    """Packed uint8 [N, K/2] -> codes [N, K]: even column from the low nibble."""
    w = np.asarray(weight, dtype=np.uint8)
    codes = np.empty((w.shape[0], 2 * w.shape[1]), dtype=np.uint8)
    codes[:, 0::2] = w & 0xF
    codes[:, 1::2] = w >> 4
    return codes


def nvfp4_quantize(w):
    """float [N, K] -> (weight uint8 [N, K/2], weight_scale uint8 [N, K/16]
    (E4M3 bytes), weight_scale_2 float32) in the ModelOpt NVFP4 layout:
    scale_2 = amax / (6 * 448), each 16-weight block's scale amax_b / 6 /
    scale_2 rounded to E4M3, the weights rounded to E2M1 (nearest even) in
    units of block scale * scale_2. dequant() of the result is what a
    checkpoint of these tensors means."""
    w = np.asarray(w, dtype=np.float64)
    n, k = w.shape
    s2 = np.float32(max(np.abs(w).max(), 1e-30) / (6.0 * 448.0))
    blocks = w.reshape(n, k // 16, 16)
    sb = (np.abs(blocks).max(axis=2) / 6.0 / float(s2)).astype(ml_dtypes.float8_e4m3fn)
    sbf = sb.astype(np.float64)
    unit = np.where(sbf > 0, sbf, 1.0)[:, :, None] * float(s2)
    q = np.clip(blocks / unit, -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn)
    codes = q.reshape(n, k).view(np.uint8) & 0xF
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, sb.view(np.uint8), s2


def write_safetensors(path, tensors):
    """tensors: name -> (dtype name, numpy array of that dtype)."""
    head, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dt, a = tensors[name]
        b = np.ascontiguousarray(a).tobytes()
        head[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def dequant(weight, weight_scale, weight_scale_2):
    """NVFP4 matrix -> float64 [N, K]: e2m1 * e4m3(block scale) * scale_2."""
    vals = E2M1_VALUES[e2m1_codes(weight)]
    sc = np.asarray(weight_scale).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    n, k = vals.shape
    vals = vals.reshape(n, k // 16, 16) * sc[:, :, None]
    return vals.reshape(n, k) * float(np.asarray(weight_scale_2, dtype=np.float32))


class F64Reference:
    """Float64 MoE reference read straight from a checkpoint directory.

    forward(layer, x_bits[T,H] uint16, ids[T,k] int, w[T,k] float32) ->
    float64 [T,H]. Follows kernels/moe_ref.h: per slot g = Wg x, u = Wu x,
    h = bf16(silu(g) * u), d = Wd h; y = sum_j w_j d_j + sum_s d_s. Only h is
    rounded; everything else stays float64. Experts are dequantized on use
    (not cached: a qwen3 layer would be 5 GB of float64).
    """

    def __init__(self, model_dir):
        self.dir = model_dir
        self.config = load_config(model_dir)
        c = self.config
        self.hidden = c["hidden_size"]
        self.inter = c["moe_intermediate_size"]
        self.n_experts = c.get("n_routed_experts", c.get("num_experts"))
        self.n_shared = c.get("n_shared_experts") or 0
        self.top_k = c["num_experts_per_tok"]
        self.tensors = load_checkpoint(model_dir)

    def _prefix(self, layer, e):
        base = "model.layers.%d.mlp." % layer
        if e < self.n_experts:
            return base + "experts.%d." % e
        if self.n_shared == 1:
            return base + "shared_experts."
        return base + "shared_experts.%d." % (e - self.n_experts)

    def matrix(self, layer, e, proj):
        """Dequantized float64 matrix of expert e (shared: e >= E), proj in
        gate_proj/up_proj/down_proj."""
        p = self._prefix(layer, e) + proj + "."
        t = self.tensors
        return dequant(t[p + "weight"], t[p + "weight_scale"], t[p + "weight_scale_2"])

    def forward(self, layer, x_bits, ids, w, routed_only=False):
        """y for routing (ids, w); an id of -1 is an empty slot (adds nothing,
        FORWARD flag 0x2); routed_only leaves out the shared experts (0x1)."""
        x = bf16_to_f64(x_bits)
        ids = np.asarray(ids, dtype=np.int64)
        w = np.asarray(w, dtype=np.float32).astype(np.float64)
        T, k = ids.shape
        assert x.shape == (T, self.hidden) and k == self.top_k
        S = 0 if routed_only else self.n_shared
        w = np.where(ids < 0, 0.0, w)
        # d[t, slot] for routed slots 0..k-1 and shared slots k..k+S-1.
        d = np.zeros((T, k + S, self.hidden))
        slot_expert = np.concatenate([ids, np.tile(self.n_experts + np.arange(S), (T, 1))],
                                     axis=1)
        for e in np.unique(slot_expert[slot_expert >= 0]):
            tt, ss = np.nonzero(slot_expert == e)
            xe = x[tt]
            g = xe @ self.matrix(layer, e, "gate_proj").T
            u = xe @ self.matrix(layer, e, "up_proj").T
            h = (g / (1.0 + np.exp(-g)) * u).astype(ml_dtypes.bfloat16).astype(np.float64)
            d[tt, ss] = h @ self.matrix(layer, e, "down_proj").T
        weights = np.concatenate([w, np.ones((T, S))], axis=1)
        y = np.zeros((T, self.hidden))
        for s in range(k + S):  # the contract's slot order
            y += weights[:, s:s + 1] * d[:, s]
        return y


# ------------------------------------------------------------ C programs

def gen_model(preset, layers, seed, out_dir, threads=0, check=True):
    """Run `moectl gen-model`; returns the CompletedProcess."""
    cmd = [MOECTL, "gen-model", "--preset", preset, "--layers", str(layers), "--seed",
           str(seed), "--out", str(out_dir), "--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if check and r.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), r.returncode, r.stderr))
    return r


def ref_forward(model_dir, layer, x_bits, ids, w, threads=0):
    """The C reference (moe_ref_forward) via tests/tools/ref_forward: y bits
    uint16 [T, H]. Raises RuntimeError with the tool's stderr on failure."""
    x_bits = np.ascontiguousarray(x_bits, dtype="<u2")
    ids = np.ascontiguousarray(ids, dtype="<i4")
    w = np.ascontiguousarray(w, dtype="<f4")
    T, k = ids.shape
    with tempfile.TemporaryDirectory() as td:
        fin, fout = os.path.join(td, "in.bin"), os.path.join(td, "out.bin")
        with open(fin, "wb") as f:
            f.write(struct.pack("<II", T, k) + x_bits.tobytes() + ids.tobytes() + w.tobytes())
        r = subprocess.run([tool_path("ref_forward"), "--model", str(model_dir), "--layer",
                            str(layer), "--in", fin, "--out", fout, "--threads", str(threads)],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError("ref_forward exit %d: %s" % (r.returncode, r.stderr.strip()))
        y = np.fromfile(fout, dtype="<u2")
    return y.reshape(T, -1)


# --------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def build_dir():
    return BUILD


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny preset (H=256 I=128 E=8 k=2 S=1), 2 layers, seed 11."""
    d = tmp_path_factory.mktemp("models") / "tiny-l2-s11"
    gen_model("tiny", 2, 11, d)
    return str(d)


@pytest.fixture(scope="session")
def qwen3_model(tmp_path_factory):
    """qwen3-30b-a3b preset (H=2048 I=768 E=128 k=8 S=0), 1 layer, seed 12."""
    d = tmp_path_factory.mktemp("models") / "qwen3-l1-s12"
    gen_model("qwen3-30b-a3b", 1, 12, d)
    return str(d)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """synthetic_dir of the daemon tests: one per session, so each synthetic
    model is generated once and every module's daemons reuse it."""
    import daemon_util
    return daemon_util.models_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def dims(daemon):
    """HELLO reply (as a dict) of the module's `daemon` fixture (daemon tests
    define `daemon` per module; this fixture resolves it there)."""
    import daemon_util as du
    s = daemon.connect()
    info = du.hello(s)
    s.close()
    return info
