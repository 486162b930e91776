"""The CUDA path for torch tensors (protocol version 2: registered buffers).

A ``CudaSession`` allocates one device buffer on the caller's GPU, registers
it with the daemon once (its CUDA IPC handle, offset, size and the GPU's
UUID), and then runs each MoE layer by descriptor: the inputs are copied into
the registered buffer on the caller's stream (device to device), the daemon
reads them and writes y there in place, and only a 40-byte reply crosses the
socket. No host copy of the hidden states, no socket payload per layer.

    import torch, moed_client.cuda as mcc
    s = mcc.CudaSession()                      # $MOED_SOCKET, current device
    y = s.fused_experts(x, topk_weights, topk_ids, layer=3)

The daemon must run on the same GPU (the CUDA backend; under MPS when another
process's kernels share it: docs/ZERO_COPY.md). The socket round trip waits
on the host, so this call is not legal inside CUDA graph capture (it raises
there); the GPU doorbell is the path for graphs.
"""

import uuid as _uuid

from . import Client, MoedError, E_INVAL

E_UNSUPPORTED = -17
ALIGN = 16


def _torch():
    import torch
    return torch


def device_uuid(device):
    """The 16-byte UUID of a CUDA device (torch.cuda.get_device_properties)."""
    torch = _torch()
    u = torch.cuda.get_device_properties(device).uuid
    raw = getattr(u, "bytes", None)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        return bytes(raw)
    return _uuid.UUID(str(u).replace("GPU-", "")).bytes


def _cuda_malloc_handle(h):
    """The cudaIpcMemHandle_t in torch's storage handle: torch writes
    [version byte]['c'][64-byte handle] for a cudaMalloc block (c10
    CUDACachingAllocator::shareIpcHandle; 'e' is an expandable segment,
    which has no such handle); older torch the bare 64 bytes."""
    if len(h) == 64:
        return h
    if len(h) == 66 and h[1] == ord("c"):
        return h[2:]
    return None


def ipc_range(tensor):
    """(handle, offset, size) of a CUDA tensor's bytes inside the allocation
    its storage lies in: the 64-byte cudaIpcMemHandle of the caching
    allocator's block, the byte offset of the tensor's first element in it,
    and the tensor's bytes (contiguous tensors only)."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise MoedError(E_INVAL, "a contiguous CUDA tensor is needed")
    st = tensor.untyped_storage()
    info = st._share_cuda_()
    handle, storage_offset = _cuda_malloc_handle(bytes(info[1])), int(info[3])
    if handle is None:
        raise MoedError(E_UNSUPPORTED, "the storage has no CUDA IPC handle (expandable "
                        "segments or a memory pool allocation cannot be exported)")
    off = storage_offset + tensor.storage_offset() * tensor.element_size()
    return handle, off, tensor.numel() * tensor.element_size()


class CudaSession:
    """One registered buffer of max_tokens rows of x | ids | w | y on the
    caller's GPU, and the client connection that registered it."""

    def __init__(self, client=None, device=None, max_tokens=None):
        torch = _torch()
        self.client = client if client is not None else Client()
        info = self.client.hello()
        if info.version < 2:
            raise MoedError(E_UNSUPPORTED, "the daemon speaks protocol version %d; the CUDA "
                            "path needs 2" % info.version)
        self.info = info
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else torch.device(device).index or 0)
        self.max_tokens = min(max_tokens or info.max_tokens, info.max_tokens)
        H, k, T = info.hidden, info.top_k, self.max_tokens

        def a(n):
            return (n + ALIGN - 1) // ALIGN * ALIGN
        self.off_x = 0
        self.off_ids = a(2 * T * H)
        self.off_w = a(self.off_ids + 4 * T * k)
        self.off_y = a(self.off_w + 4 * T * k)
        total = a(self.off_y + 2 * T * H)
        self.mem = torch.zeros(total, dtype=torch.uint8, device=self.device)
        handle, off, size = ipc_range(self.mem)
        if off % ALIGN:
            raise MoedError(E_INVAL, "the buffer starts %d bytes into its allocation, not "
                            "16-aligned" % off)
        self.buf_id = self.client.register_buf(handle, off, size, device_uuid(self.device))

    def _view(self, off, n, dtype, shape):
        return self.mem[off:off + n * _torch().tensor([], dtype=dtype).element_size()] \
            .view(dtype).view(shape)

    def fused_experts(self, hidden_states, topk_weights, topk_ids, layer):
        """One MoE layer by descriptor; returns y [T, H] in hidden_states'
        dtype on its device (a new tensor)."""
        torch = _torch()
        if torch.cuda.is_current_stream_capturing():
            raise MoedError(E_UNSUPPORTED, "the socket descriptor path waits on the host and "
                            "cannot be captured in a CUDA graph; use the doorbell")
        T, H = hidden_states.shape
        k = self.info.top_k
        if T < 1 or T > self.max_tokens or H != self.info.hidden or \
                tuple(topk_ids.shape) != (T, k) or tuple(topk_weights.shape) != (T, k):
            raise ValueError("shapes: hidden_states [T<=%d, %d], topk [T, %d]"
                             % (self.max_tokens, self.info.hidden, k))
        x = self._view(self.off_x, T * H, torch.bfloat16, (T, H))
        ids = self._view(self.off_ids, T * k, torch.int32, (T, k))
        w = self._view(self.off_w, T * k, torch.float32, (T, k))
        y = self._view(self.off_y, T * H, torch.bfloat16, (T, H))
        x.copy_(hidden_states)
        ids.copy_(topk_ids)
        w.copy_(topk_weights)
        torch.cuda.current_stream(self.device).synchronize()  # the daemon reads them next
        b = self.buf_id
        self.client.forward_desc(layer, T, (b, self.off_x), (b, self.off_ids),
                                 (b, self.off_w), (b, self.off_y))
        return y.to(hidden_states.dtype, copy=True)

    def close(self):
        if self.client is not None:
            try:
                self.client.unregister_buf(self.buf_id)
            finally:
                self.client.close()
                self.client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
