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

The daemon runs on the same GPU (the CUDA backend; under MPS when another
process's kernels share it) or on another GPU of the host that it reaches by
peer access, the dedicated expert GPU (docs/ZERO_COPY.md): then the buffer
is still allocated here and named by this GPU's UUID, and moed's kernel
reads x and writes y in it over NVLink. The socket round trip waits
on the host, so this call is not legal inside CUDA graph capture (it raises
there); the GPU doorbell is the path for graphs:

    s = mcc.DoorbellSession(moed_client.Client(), max_tokens=64)
    y = s.fused_experts(x, topk_weights, topk_ids, layer=3)   # capturable
    s.check()                                 # after the graph ran: any refused call

A ``DoorbellSession`` opens a doorbell channel with an arena of the same
layout (CHAN_OPEN: a small ring and the arena in one allocation of moed's
device memory, mapped here through CUDA IPC), copies the inputs into the
arena and y out of it on the caller's stream, and runs each layer as a
one-thread kernel there that rings moed's persistent kernel and spins until
it has answered. The arena is moed's memory: a client killed mid-graph
frees nothing moed's kernel may still be reading or writing (a registered
tensor of the client's own is freed with its process, under moed's kernel:
docs/ZERO_COPY.md). With the daemon on another GPU (``device`` the client's,
moed's a peer) the channel maps in this GPU's context with lazy peer access,
the client kernel runs on the caller's stream here and rings moed over
NVLink, and the arena, moed's memory, is viewed as a tensor of this GPU over
the peer mapping: the input and output copies are device-to-device copies
over NVLink, capturable like any other (``Channel.peer_gpu`` says which GPU
the arena lies on). ``Channel`` is the layer under it, for callers that
manage their own registered tensors as well. The driver calls go through
ctypes on libcuda.so.1 (moed_client._cudrv); torch is imported only here.
"""

import ctypes
import uuid as _uuid

from . import Client, MoedError, E_INVAL, CHAN_BUFS
from . import _cudrv
from ._chan import (ChannelError, RangeTable, CHAN_HEAD, pack_desc, call_flags,  # noqa: F401
                    check_flags, status_name)

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


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def arena_layout(hidden, top_k, max_tokens):
    """(off_ids, off_w, off_y, bytes) of an arena of max_tokens rows of x
    bf16 [T, H] at 0 | ids int32 [T, k] | w fp32 [T, k] | y bf16 [T, H], each
    16-aligned: at most the daemon's limit for CHAN_OPEN arena_bytes,
    max_tokens * (4 H + 8 k) + 64."""
    H, k, T = hidden, top_k, max_tokens
    off_ids = _align(2 * T * H)
    off_w = _align(off_ids + 4 * T * k)
    off_y = _align(off_w + 4 * T * k)
    return off_ids, off_w, off_y, _align(off_y + 2 * T * H)


class _Arena:
    """Views of x | ids | w | y (arena_layout) over `mem`, a uint8 CUDA
    tensor of at least that many bytes (a buffer of the caller's, or a
    channel's arena), full-size; fill() copies inputs into the first T rows
    (views: no allocation)."""

    def __init__(self, info, max_tokens, mem):
        torch = _torch()
        H, k, T = info.hidden, info.top_k, max_tokens
        self.off_x = 0
        self.off_ids, self.off_w, self.off_y, nbytes = arena_layout(H, k, T)
        if mem.dtype != torch.uint8 or mem.numel() < nbytes:
            raise ValueError("an arena of %d rows needs %d bytes of uint8, got %d of %s"
                             % (T, nbytes, mem.numel(), mem.dtype))
        self.mem = mem

        def view(off, n, dtype, shape):
            return self.mem[off:off + n].view(dtype).view(shape)
        self.x = view(self.off_x, 2 * T * H, torch.bfloat16, (T, H))
        self.ids = view(self.off_ids, 4 * T * k, torch.int32, (T, k))
        self.w = view(self.off_w, 4 * T * k, torch.float32, (T, k))
        self.y = view(self.off_y, 2 * T * H, torch.bfloat16, (T, H))

    @classmethod
    def alloc(cls, info, max_tokens, device):
        """An arena over a new zeroed buffer of the caller's on `device`
        (to register: CudaSession, a Channel over registered tensors)."""
        torch = _torch()
        nbytes = arena_layout(info.hidden, info.top_k, max_tokens)[3]
        return cls(info, max_tokens, torch.zeros(nbytes, dtype=torch.uint8, device=device))

    def fill(self, hidden_states, topk_weights, topk_ids, info, max_tokens):
        """Copy the inputs into the first T rows (on the current stream);
        returns the (x, ids, w, y) views of those rows."""
        T, H = hidden_states.shape
        k = info.top_k
        if T < 1 or T > max_tokens or H != info.hidden or \
                tuple(topk_ids.shape) != (T, k) or tuple(topk_weights.shape) != (T, k):
            raise ValueError("shapes: hidden_states [1 <= T <= %d, %d], topk [T, %d]; got %s, "
                             "%s, %s" % (max_tokens, info.hidden, k, tuple(hidden_states.shape),
                                         tuple(topk_ids.shape), tuple(topk_weights.shape)))
        x, ids, w, y = self.x[:T], self.ids[:T], self.w[:T], self.y[:T]
        x.copy_(hidden_states)
        ids.copy_(topk_ids)
        w.copy_(topk_weights)
        return x, ids, w, y


def _v2_info(client):
    info = client.hello()
    if info.version < 2:
        raise MoedError(E_UNSUPPORTED, "the daemon speaks protocol version %d; the CUDA "
                        "path needs 2" % info.version)
    return info


def _device(device):
    torch = _torch()
    return torch.device("cuda", torch.cuda.current_device() if device is None
                        else torch.device(device).index or 0)


class CudaSession:
    """One registered buffer of max_tokens rows of x | ids | w | y on the
    caller's GPU, and the client connection that registered it."""

    def __init__(self, client=None, device=None, max_tokens=None):
        self.client = client if client is not None else Client()
        self.info = info = _v2_info(self.client)
        self.device = _device(device)
        self.max_tokens = min(max_tokens or info.max_tokens, info.max_tokens)
        self.arena = a = _Arena.alloc(info, self.max_tokens, self.device)
        self.mem, self.off_x, self.off_ids, self.off_w, self.off_y = \
            a.mem, a.off_x, a.off_ids, a.off_w, a.off_y
        handle, off, size = ipc_range(self.mem)
        if off % ALIGN:
            raise MoedError(E_INVAL, "the buffer starts %d bytes into its allocation, not "
                            "16-aligned" % off)
        self.buf_id = self.client.register_buf(handle, off, size, device_uuid(self.device))

    def fused_experts(self, hidden_states, topk_weights, topk_ids, layer):
        """One MoE layer by descriptor; returns y [T, H] in hidden_states'
        dtype on its device (a new tensor)."""
        torch = _torch()
        if torch.cuda.is_current_stream_capturing():
            raise MoedError(E_UNSUPPORTED, "the socket descriptor path waits on the host and "
                            "cannot be captured in a CUDA graph; use the doorbell")
        T = hidden_states.shape[0]
        y = self.arena.fill(hidden_states, topk_weights, topk_ids, self.info, self.max_tokens)[3]
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


# --- the GPU doorbell ---------------------------------------------------------

DEFAULT_CALL_TIMEOUT_S = 10.0  # a call with no answer in this long records E_TIMEOUT


class _DeviceRange:
    """Device memory mapped here, as __cuda_array_interface__ (version 2: no
    stream to synchronize with), for torch.as_tensor to view in place."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None, "version": 2}


DL_CPU, DL_CUDA = 1, 2  # DLDeviceType kDLCPU, kDLCUDA
_KEPT = []  # the DLPack structures of every _PeerRange (see there)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _PeerRange:
    """Memory at ptr as a uint8 tensor that torch places on the device
    given (DLPack, legacy "dltensor" capsule, no deleter: the memory is
    not torch's), not on the one torch would infer from the pointer. For a
    channel of a daemon on another GPU: the mapping lies on moed's GPU but
    is an address of this (the client's) GPU's context (cuIpcOpenMemHandle,
    lazy peer access), so a tensor of the client's device over it is one its
    kernels and copies on the client's stream use in place, over NVLink.
    torch reads the structure again when the tensor dies (its deleter
    field): they are kept for the process (_KEPT, ~100 bytes a channel),
    not freed under a view someone still holds."""

    def __init__(self, ptr, nbytes, device_type, device_id):
        self.shape = (ctypes.c_int64 * 1)(nbytes)
        self.strides = (ctypes.c_int64 * 1)(1)
        self.managed = _DLManagedTensor(
            _DLTensor(ptr, _DLDevice(device_type, device_id), 1, _DLDataType(1, 8, 1),
                      self.shape, self.strides, 0), None, None)
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                       ctypes.c_void_p]
        self.capsule = new(ctypes.addressof(self.managed), b"dltensor", None)
        _KEPT.append((self.managed, self.shape, self.strides))

    def tensor(self):
        from torch.utils.dlpack import from_dlpack
        return from_dlpack(self.capsule)


class Channel:
    """A doorbell channel with a daemon-owned arena, registered CUDA
    tensors, or both.

    Channel(client, tensors, arena_bytes=N) registers each tensor's bytes
    (ipc_range, REGISTER_BUF), opens the channel (CHAN_OPEN) with an arena of
    N bytes (0: none), maps its ring and arena (one cuIpcOpenMemHandle),
    loads the client kernel the daemon sent (cuModuleLoadData) and keeps an
    8-byte err word on the channel's GPU (`device`, or the tensors'). With
    an arena, `arena` is a uint8 tensor over it (moed's memory, mapped here,
    zeroed at open; valid until close()) and is the channel's buffer 0, the
    tensors 1..; without one the tensors are 0... The tensors are kept alive
    until close().

    Prefer the arena: moed's kernel reads x and writes y where the
    descriptor points, so a registered tensor must outlive every call in
    flight, and a client killed mid-graph frees its tensors while moed's
    kernel may still be touching them (undefined behaviour in CUDA IPC:
    docs/ZERO_COPY.md); its death frees nothing of an arena.

    call(x, ids, w, y, layer) enqueues one MoE layer on the current torch
    stream: x bf16 [T, H], ids int32 [T, k], w fp32 [T, k], y bf16 [T, H]
    (written by moed), each contiguous and inside the arena or one of the
    registered tensors. It launches one small kernel that rings moed and spins until
    moed has answered, so it can be captured in a CUDA graph and replayed; it
    neither synchronizes nor allocates. Calls on one channel must be
    serialized (one stream at a time). A call moed refuses (its descriptor
    failed moed's checks) or that got no answer within timeout_s leaves y
    unwritten and its status word in err; check() raises it.

    The client that opened the channel must stay connected: when its
    connection closes, moed closes the channel and its registrations.
    """

    def __init__(self, client, tensors=(), timeout_s=DEFAULT_CALL_TIMEOUT_S, arena_bytes=0,
                 device=None):
        torch = _torch()
        self.client, self.tensors = client, list(tensors)
        self.info = _v2_info(client)
        self.chan_id, self.buf_ids, self._chan, self._mod = 0, [], 0, None
        self.arena, self._arena_range, self.peer_gpu = None, None, None
        n_max = CHAN_BUFS - 1 if arena_bytes else CHAN_BUFS
        if not (arena_bytes or self.tensors) or len(self.tensors) > n_max or \
                any(not t.is_cuda for t in self.tensors) or \
                len({t.device for t in self.tensors} |
                    ({_device(device)} if device is not None else set())) > 1:
            raise MoedError(E_INVAL, "a channel needs an arena or 1..16 CUDA tensors (0..15 "
                            "besides an arena), on one GPU")
        self.device = _device(self.tensors[0].device if self.tensors else device)
        try:
            uuid = device_uuid(self.device)
            for t in self.tensors:
                self.buf_ids.append(client.register_buf(*ipc_range(t), uuid))
            ci = client.chan_open(self.buf_ids, uuid, arena_bytes)
            self.chan_id, self.key, self.slots = ci.chan_id, ci.key, ci.slots
            with torch.cuda.device(self.device):
                _cudrv.ensure_context(self.device.index)
                self._chan = _cudrv.ipc_open(ci.handle)
                on = _cudrv.pointer_device(self._chan)  # moed's GPU, as numbered here
                self.peer_gpu = None if on == self.device.index else on
                self._mod, fn = _cudrv.module_load(ci.kernel)
                self.err = torch.zeros(1, dtype=torch.int64, device=self.device)
                ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in self.tensors]
                if ci.arena_bytes:
                    self.arena = self._view_arena(self._chan + ci.arena_off, ci.arena_bytes)
                    ranges.insert(0, (self._chan + ci.arena_off, ci.arena_bytes))
            self.table = RangeTable(ranges)
            self._launch = _cudrv.ChanLaunch(fn, self._chan, self.err.data_ptr(),
                                             int(timeout_s * 1e9) if timeout_s else 0)
        except BaseException:
            self.close()
            raise

    def _view_arena(self, ptr, nbytes):
        """A uint8 tensor over the mapped arena, in place (the range object
        stays referenced; torch.as_tensor with no device asked never
        copies, and the view must be of this very memory on this GPU).
        With the daemon on another GPU (peer_gpu: the ordinal the arena
        lies on, None when it is this one) the view is a tensor of this
        GPU over the peer mapping (_PeerRange): the arena's copies then run
        on the caller's stream as device-to-device copies over NVLink."""
        if self.peer_gpu is None:
            self._arena_range = _DeviceRange(ptr, nbytes)
            t = _torch().as_tensor(self._arena_range)
            if t.device.type == "cuda" and t.device != self.device and t.data_ptr() == ptr:
                self.peer_gpu = t.device.index  # torch's pointer query knows better
        if self.peer_gpu is not None:
            self._arena_range = _PeerRange(ptr, nbytes, DL_CUDA, self.device.index)
            t = self._arena_range.tensor()
        if t.data_ptr() != ptr or t.numel() != nbytes or t.device != self.device:
            raise MoedError(E_INVAL, "torch sees the mapped arena as %d bytes at 0x%x on %s, "
                            "not %d at 0x%x on %s" % (t.numel(), t.data_ptr(), t.device, nbytes,
                                                      ptr, self.device))
        return t

    def ref(self, t, what="tensor"):
        """(table index, offset) of tensor t's bytes (host only)."""
        return self.table.find(t.data_ptr(), t.numel() * t.element_size(), what)

    def call(self, x, ids, w, y, layer, flags=0):
        """Enqueue one MoE layer on the current stream (see the class)."""
        torch = _torch()
        T, H = x.shape
        k = self.info.top_k
        if x.dtype != torch.bfloat16 or y.dtype != torch.bfloat16 or \
                ids.dtype != torch.int32 or w.dtype != torch.float32 or \
                tuple(y.shape) != (T, H) or tuple(ids.shape) != (T, k) or \
                tuple(w.shape) != (T, k) or not all(
                    t.is_contiguous() for t in (x, ids, w, y)):
            raise ValueError("call needs contiguous x, y bf16 [T, H] and ids int32, w fp32 "
                             "[T, %d]" % k)
        check_flags(flags)
        pack_desc(self._launch.desc, layer, T, self.key, flags,
                  (self.ref(x, "x"), self.ref(ids, "ids"), self.ref(w, "w"), self.ref(y, "y")))
        self._launch.launch(torch.cuda.current_stream(self.device).cuda_stream,
                            self.device.index)

    def call_desc(self, layer, n_tokens, refs, flags=0, key=None):
        """Enqueue a descriptor as given: refs = ((index, offset) of x, ids,
        w, y), no host checks (tests: a bad descriptor from the GPU)."""
        pack_desc(self._launch.desc, layer, n_tokens, self.key if key is None else key, flags,
                  refs)
        self._launch.launch(_torch().cuda.current_stream(self.device).cuda_stream,
                            self.device.index)

    def error_word(self):
        """The err word (0: every call so far answered OK); waits for the
        device first (the calls may run on any stream)."""
        _torch().cuda.synchronize(self.device)
        return int(self.err.item()) & 0xFFFFFFFFFFFFFFFF

    def check(self, reset=True):
        """Raise ChannelError (a MoedError naming the MOE_GPU_CHAN_E_* status
        and the seq of the first call not answered OK since the last reset)
        if there was one; reset: zero the err word first (on the current
        stream). Waits for the device (the calls enqueued so far)."""
        word = self.error_word()
        if word:
            if reset:
                self.err.zero_()
            raise ChannelError(word, self.chan_id)

    def ring(self):
        """(bell, done, status words) of the channel as moed's memory holds
        them now (a synchronous device read; for tests and tools)."""
        f = CHAN_HEAD.unpack(_cudrv.read_device(self._chan, CHAN_HEAD.size))
        return f[0], f[2], list(f[3:])  # bell, done (f[1]: closed), status words

    def stamps(self, last):
        """The %globaltimer stamps (ns) of the calls seq last-7..last, oldest
        first: (rang, taken, answered, seen) each, as moed's memory holds them
        now (a synchronous read; the calls must have completed). taken ->
        answered is moed's kernel time; the rest is the doorbell's own."""
        from ._chan import CHAN_SLOTS as n, STAMPS, STAMPS_OFF
        w = STAMPS.unpack(_cudrv.read_device(self._chan + STAMPS_OFF, STAMPS.size))
        return [tuple(w[4 * (s % n):4 * (s % n) + 4]) for s in range(last - n + 1, last + 1)]

    def close(self):
        """Wait for the device (no call of this channel may still run), close
        the channel and unregister its buffers, then unmap and unload. Safe to
        call twice and after a failed open."""
        torch = _torch()
        errs = []

        def attempt(fn, *a):
            try:
                fn(*a)
            except Exception as e:  # noqa: BLE001 (every step runs; the first error is raised)
                errs.append(e)
        if self._chan or self._mod:
            attempt(torch.cuda.synchronize, self.device)
        if self.chan_id and self.client._sock is not None:
            attempt(self.client.chan_close, self.chan_id)
        self.chan_id = 0
        self.arena, self._arena_range = None, None  # views of the mapping, about to go
        if self._chan:
            attempt(_cudrv.ipc_close, self._chan)
            self._chan = 0
        if self._mod:
            attempt(_cudrv.module_unload, self._mod)
            self._mod = None
        while self.buf_ids:
            b = self.buf_ids.pop()
            if self.client._sock is not None:
                attempt(self.client.unregister_buf, b)
        self.tensors = []
        if errs:
            raise errs[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DoorbellSession:
    """The doorbell behind a framework's fused-experts call: a Channel with
    an arena (moed's memory, mapped here) of max_tokens rows of x | ids | w |
    y, and nothing of the caller's registered.

    fused_experts(hidden_states, topk_weights, topk_ids, layer) copies the
    inputs into the arena, rings moed and returns a new tensor (a copy of y,
    in hidden_states' dtype) on the caller's device; all of it is enqueued
    on the current stream, so it can be captured in a CUDA graph. A refused
    call leaves its output as the arena's last y: check() after the step
    (or the graph's replay) raises it. The process may die at any point
    (SIGKILL mid-graph included): moed's kernel touches only moed's memory.
    close() closes the channel and the client."""

    def __init__(self, client=None, max_tokens=None, device=None,
                 timeout_s=DEFAULT_CALL_TIMEOUT_S):
        self.client = client if client is not None else Client()
        self.channel = None
        try:
            self.info = info = _v2_info(self.client)
            self.device = _device(device)
            self.max_tokens = min(max_tokens or info.max_tokens, info.max_tokens)
            nbytes = arena_layout(info.hidden, info.top_k, self.max_tokens)[3]
            self.channel = Channel(self.client, (), timeout_s, arena_bytes=nbytes,
                                   device=self.device)
            self.arena = _Arena(info, self.max_tokens, self.channel.arena)
        except BaseException:
            self.close()
            raise

    def fused_experts(self, hidden_states, topk_weights, topk_ids, layer, *,
                      routed_only=False, empty_slots=False):
        """One MoE layer through the doorbell; y [T, H] (a new tensor)."""
        x, ids, w, y = self.arena.fill(hidden_states, topk_weights, topk_ids, self.info,
                                       self.max_tokens)
        self.channel.call(x, ids, w, y, layer, call_flags(routed_only, empty_slots))
        return y.to(hidden_states.dtype, copy=True)

    def check(self, reset=True):
        """Channel.check(): raise the first refused or timed-out call."""
        self.channel.check(reset)

    def close(self):
        self.arena = None  # views of the channel's mapping
        try:
            if self.channel is not None:
                self.channel.close()
                self.channel = None
        finally:
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
