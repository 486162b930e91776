"""moed's E2M1 / E4M3 / bf16 codecs (kernels/nvfp4.c, via tests/tools/codec_dump)
against ml_dtypes' float4_e2m1fn, float8_e4m3fn and bfloat16.

Known, intended difference: nvfp4_e4m3_encode saturates (satfinite, like
ModelOpt's clamp and CUDA's __NV_SATFINITE) to +-448 for |x| >= 448, inf
included, while ml_dtypes' astype gives NaN once |x| rounds past 448 (from 464
up) and for inf. Those inputs are checked against the satfinite rule instead.
E2M1 has no NaN or inf: moed encodes NaN as +0 and +-inf as +-6; NaN is left
out of the ml_dtypes comparison.
"""

import os
import subprocess

import ml_dtypes
import numpy as np
import pytest

from conftest import tool_path

CODEC_DUMP = tool_path("codec_dump")


def run_dump(*args, stdin=None):
    if not os.path.exists(CODEC_DUMP):
        pytest.fail("%s not built (make tools)" % CODEC_DUMP)
    r = subprocess.run([CODEC_DUMP, *args], input=stdin, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def tables():
    e2m1, e4m3 = {}, {}
    for line in run_dump("tables").splitlines():
        kind, code, val = line.split()
        (e2m1 if kind == "e2m1" else e4m3)[int(code)] = float(val)
    assert sorted(e2m1) == list(range(16)) and sorted(e4m3) == list(range(256))
    return e2m1, e4m3


def encode(xs):
    """C encodings of float32 values: (e2m1 codes, e4m3 codes, bf16 bits)."""
    xs = np.asarray(xs, dtype=np.float32)
    # Hex floats round-trip exactly through strtof.
    text = "".join(float(v).hex() + "\n" for v in xs)
    rows = [list(map(int, l.split())) for l in run_dump("encode", stdin=text).splitlines()]
    a = np.array(rows, dtype=np.int64).reshape(-1, 3)
    assert len(a) == len(xs)
    return a[:, 0].astype(np.uint8), a[:, 1].astype(np.uint8), a[:, 2].astype(np.uint16)


def test_e2m1_table_matches_ml_dtypes(tables):
    e2m1, _ = tables
    ref = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    for c in range(16):
        assert e2m1[c] == ref[c] and np.signbit(e2m1[c]) == np.signbit(ref[c]), c
    assert [e2m1[c] for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_e4m3_table_matches_ml_dtypes(tables):
    _, e4m3 = tables
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    nan_codes = [c for c in range(256) if np.isnan(e4m3[c])]
    assert nan_codes == [0x7F, 0xFF]
    assert [c for c in range(256) if np.isnan(ref[c])] == nan_codes
    for c in range(256):
        if c in nan_codes:
            continue
        assert e4m3[c] == ref[c] and np.signbit(e4m3[c]) == np.signbit(ref[c]), hex(c)
    assert e4m3[0x7E] == 448.0 and e4m3[0x01] == 2.0 ** -9


def test_ml_dtypes_e2m1_rounding_is_rne():
    """ml_dtypes' own E2M1 rounding follows the ModelOpt thresholds, ties to
    the even code; otherwise the comparison below would prove nothing."""
    xs = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0], dtype=np.float32)
    got = xs.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0]


def edge_values():
    e4 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e4 = np.sort(e4[np.isfinite(e4) & (e4 >= 0)])
    mids = (e4[:-1] + e4[1:]) / 2
    thr = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=np.float32)
    near = np.concatenate([np.nextafter(v, np.float32(0)) for v in (mids, thr)] +
                          [np.nextafter(v, np.float32(1e9)) for v in (mids, thr)])
    e2 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    bf = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, 3.3895314e38,
                   1e-40, 2 ** -126, 2 ** -133], dtype=np.float32)
    pos = np.concatenate([e4, mids, near, thr, e2, bf, [0.0]]).astype(np.float32)
    return np.concatenate([pos, -pos])


def random_values(rng):
    mag = np.exp(rng.uniform(np.log(1e-6), np.log(460.0), 20000)).astype(np.float32)
    sgn = np.where(rng.random(20000) < 0.5, -1, 1).astype(np.float32)
    return np.concatenate([mag * sgn, rng.standard_normal(5000).astype(np.float32) * 3])


@pytest.mark.parametrize("source", ["edges", "random"])
def test_encode_matches_ml_dtypes(source):
    seed = int.from_bytes(os.urandom(4), "little")
    xs = edge_values() if source == "edges" else random_values(np.random.default_rng(seed))
    xs = xs[np.abs(xs) < 448]  # satfinite vs NaN differs above: next test
    c2, c4, cb = encode(xs)
    r2 = xs.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    r4 = xs.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    rb = xs.astype(ml_dtypes.bfloat16).view(np.uint16)
    for name, got, ref in (("e2m1", c2, r2), ("e4m3", c4, r4), ("bf16", cb, rb)):
        bad = np.nonzero(got != ref)[0]
        assert len(bad) == 0, "%s (seed %d): x=%s got %s want %s" % (
            name, seed, xs[bad[:5]].tolist(), got[bad[:5]].tolist(), ref[bad[:5]].tolist())


def test_saturation_and_specials():
    xs = np.array([448, 449, 463.9, 464, 465, 1e6, np.inf, -448, -1000, -np.inf, np.nan,
                   7.0, -7.0, 1e30], dtype=np.float32)
    c2, c4, cb = encode(xs)
    assert c4.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0xFE, 0x7F,
                           0x4E, 0xCE, 0x7E]
    assert c2.tolist() == [7, 7, 7, 7, 7, 7, 7, 15, 15, 15, 0, 7, 15, 7]
    # bf16 of the specials and large values equals ml_dtypes (NaN: both NaN).
    rb = xs.astype(ml_dtypes.bfloat16)
    got = cb.view(ml_dtypes.bfloat16)
    assert np.isnan(got[10]) and np.isnan(rb[10])
    keep = ~np.isnan(xs)
    assert (cb[keep] == rb.view(np.uint16)[keep]).all()
    # Where ml_dtypes does not produce NaN (below 464) it agrees with satfinite.
    small = np.abs(xs) < 464
    r4 = xs[small].astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert (c4[small] == r4).all()


def test_usage_error():
    r = subprocess.run([CODEC_DUMP, "bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage: codec_dump" in r.stderr
