"""Array conversion for the client (numpy and torch optional): hidden states
to and from bf16 wire bytes, routing arrays to i32/f32 wire bytes, row
slices and concatenation of a split batch."""
import struct


def _np():
    try:
        import numpy
        return numpy
    except ImportError:
        return None


def _bf16_dtype():
    try:
        import ml_dtypes
        return ml_dtypes.bfloat16
    except ImportError:
        return None


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _f32_to_bf16_bits(np, a):
    """Round-to-nearest-even fp32 -> bf16 bit patterns (uint16), NaN kept NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded = np.where(nan, (u >> 16).astype(np.uint16) | 0x0040, rounded)
    return rounded


def _bf16_bits_to_f32(np, bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


class _Kind:
    """How to turn the reply back into the caller's kind of array."""

    __slots__ = ("kind", "dtype", "device")

    def __init__(self, kind, dtype=None, device=None):
        self.kind, self.dtype, self.device = kind, dtype, device


def _hidden_to_wire(x):
    """(bytes of LE bf16, T, H, kind) from the hidden_states argument."""
    if _is_torch(x):
        import torch
        if x.dim() != 2:
            raise ValueError("hidden_states must be 2-D [T, H], got shape %s" % (tuple(x.shape),))
        t = x.detach()
        if t.dtype != torch.bfloat16:
            t = t.to(torch.bfloat16)
        t = t.to("cpu").contiguous()
        raw = t.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
        return raw, t.shape[0], t.shape[1], _Kind("torch", x.dtype, x.device)
    np = _np()
    if np is not None and isinstance(x, np.ndarray):
        if x.ndim != 2:
            raise ValueError("hidden_states must be 2-D [T, H], got shape %s" % (x.shape,))
        bf16 = _bf16_dtype()
        if bf16 is not None and x.dtype == bf16:
            bits = x.view(np.uint16)
        elif x.dtype == np.uint16:
            bits = x
        elif x.dtype.kind == "f":
            bits = _f32_to_bf16_bits(np, x.astype(np.float32))
        else:
            raise TypeError("hidden_states dtype %s: need bf16, uint16 bf16 bits or float"
                            % x.dtype)
        raw = np.ascontiguousarray(bits).astype("<u2", copy=False).tobytes()
        return raw, x.shape[0], x.shape[1], _Kind("numpy", x.dtype)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x), None, None, _Kind("bytes")
    raise TypeError("hidden_states must be a numpy array, a torch tensor or bytes, not %s"
                    % type(x).__name__)


def _routing_to_wire(a, fmt, what):
    """(bytes, rows, cols) of ids (int32) or weights (fp32)."""
    np = _np()
    if _is_torch(a):
        a = a.detach().to("cpu")
        if a.is_floating_point():
            a = a.float()  # numpy has no bf16: widen first
        a = a.numpy()
    if np is not None:
        arr = np.asarray(a, dtype="<i4" if fmt == "i" else "<f4")
        if arr.ndim != 2:
            raise ValueError("%s must be 2-D [T, k], got shape %s" % (what, arr.shape))
        return np.ascontiguousarray(arr).tobytes(), arr.shape[0], arr.shape[1]
    rows = [list(r) for r in a]
    cols = len(rows[0]) if rows else 0
    if any(len(r) != cols for r in rows):
        raise ValueError("%s rows have different lengths" % what)
    flat = [v for r in rows for v in r]
    return struct.pack("<%d%s" % (len(flat), fmt), *flat), len(rows), cols


def _wire_to_hidden(raw, t, h, kind):
    if kind.kind == "bytes":
        return bytes(raw)
    np = _np()
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint16).reshape(t, h)
    if kind.kind == "torch":
        import torch
        y = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
        if kind.dtype != torch.bfloat16:
            y = y.to(kind.dtype)
        return y.to(kind.device)
    if kind.dtype == np.uint16:
        return bits
    bf16 = _bf16_dtype()
    if bf16 is not None and kind.dtype == bf16:
        return bits.view(bf16)
    return _bf16_bits_to_f32(np, bits).astype(kind.dtype)


def _rows(a, t0, t1):
    """Rows t0..t1 of a [T, ...] array, tensor, bytes of bf16 rows or sequence."""
    if isinstance(a, (bytes, bytearray, memoryview)):
        raise TypeError("bytes hidden_states cannot be split: pass at most max_tokens rows")
    return a[t0:t1]


def _concat(parts, kind):
    if kind.kind == "torch":
        import torch
        return torch.cat(parts, dim=0)
    if kind.kind == "bytes":
        return b"".join(parts)
    return _np().concatenate(parts, axis=0)
