"""The few CUDA driver API calls a doorbell channel needs, through ctypes on
libcuda.so.1 (no CUDA Python package): map the channel's allocation
(cuIpcOpenMemHandle with the 64-byte handle by value), load the client
kernel's fatbin (cuModuleLoadData, cuModuleGetFunction), launch it on a
stream (cuLaunchKernel: grid 1, block 32, the argument list of
kernels/moe_chan_client.cu) and undo it all. Every call first makes sure a
context is current on the calling thread (the device's primary context, the
one torch uses, when none is)."""

import ctypes

from . import MoedError

E_BACKEND = -16
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CUDA_ERROR_INVALID_CONTEXT = 201
CHAN_KERNEL = b"moed_chan_call"

_lib = None


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def ipc_handle(handle):
    """A CUipcMemHandle (passed by value) holding the 64 bytes of handle."""
    handle = bytes(handle)
    if len(handle) != 64:
        raise MoedError(-12, "an IPC handle is 64 bytes, got %d" % len(handle))
    return CUipcMemHandle.from_buffer_copy(handle)


def lib():
    """libcuda.so.1, initialized (MoedError 'backend' if it cannot be)."""
    global _lib
    if _lib is None:
        try:
            d = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise MoedError(E_BACKEND, "the CUDA driver (libcuda.so.1) cannot be loaded: %s"
                            % e) from None
        u, vp, p = ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER
        sigs = {
            "cuInit": [u],
            "cuGetErrorName": [ctypes.c_int, p(ctypes.c_char_p)],
            "cuDeviceGet": [p(ctypes.c_int), ctypes.c_int],
            "cuCtxGetCurrent": [p(vp)],
            "cuCtxSetCurrent": [vp],
            "cuDevicePrimaryCtxRetain": [p(vp), ctypes.c_int],
            "cuIpcOpenMemHandle_v2": [p(ctypes.c_uint64), CUipcMemHandle, u],
            "cuIpcCloseMemHandle": [ctypes.c_uint64],
            "cuModuleLoadData": [p(vp), ctypes.c_char_p],
            "cuModuleGetFunction": [p(vp), vp, ctypes.c_char_p],
            "cuModuleUnload": [vp],
            "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, p(vp), p(vp)],
            "cuMemcpyDtoH_v2": [vp, ctypes.c_uint64, ctypes.c_size_t],
            "cuPointerGetAttribute": [vp, ctypes.c_int, ctypes.c_uint64],
        }
        for name, args in sigs.items():
            f = getattr(d, name)
            f.argtypes, f.restype = args, ctypes.c_int
        _check(d, d.cuInit(0), "cuInit")
        _lib = d
    return _lib


def _check(d, rc, what):
    if rc != 0:
        name = ctypes.c_char_p()
        d.cuGetErrorName(rc, ctypes.byref(name))
        raise MoedError(E_BACKEND, "%s: %s (%d)" % (
            what, (name.value or b"CUDA_ERROR_UNKNOWN").decode("ascii", "replace"), rc))


def check(rc, what):
    """Raise MoedError 'backend' naming the CUresult unless rc is CUDA_SUCCESS."""
    if rc != 0:
        _check(lib(), rc, what)


def ensure_context(device_index):
    """Make a context current on this thread: the current one if there is one,
    else the primary context of device_index (retained for the process)."""
    d = lib()
    ctx = ctypes.c_void_p()
    check(d.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    check(d.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    check(d.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def ipc_open(handle):
    """Map another process's allocation by its 64-byte IPC handle: its device
    address in this process."""
    h = ipc_handle(handle)
    p = ctypes.c_uint64()
    check(lib().cuIpcOpenMemHandle_v2(ctypes.byref(p), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
          "cuIpcOpenMemHandle")
    return p.value


CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


def pointer_device(ptr):
    """The ordinal of the GPU the memory at device address ptr lies on (for
    a mapping of another process's allocation: the GPU it was allocated on,
    which is not the context's own when it is a peer's)."""
    dev = ctypes.c_int(-1)
    check(lib().cuPointerGetAttribute(ctypes.byref(dev), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                      ptr), "cuPointerGetAttribute(DEVICE_ORDINAL)")
    return dev.value


def ipc_close(ptr):
    check(lib().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def module_load(image):
    """(module, function moed_chan_call) of a fatbin image (bytes)."""
    d = lib()
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check(d.cuModuleLoadData(ctypes.byref(mod), bytes(image)), "cuModuleLoadData")
    rc = d.cuModuleGetFunction(ctypes.byref(fn), mod, CHAN_KERNEL)
    if rc != 0:
        d.cuModuleUnload(mod)
        check(rc, "cuModuleGetFunction(moed_chan_call)")
    return mod.value, fn.value


def module_unload(mod):
    check(lib().cuModuleUnload(mod), "cuModuleUnload")


def read_device(ptr, n):
    """n bytes at device address ptr (synchronous)."""
    buf = ctypes.create_string_buffer(n)
    check(lib().cuMemcpyDtoH_v2(buf, ptr, n), "cuMemcpyDtoH")
    return buf.raw


class ChanLaunch:
    """The argument block of moed_chan_call(chan, desc by value (96 bytes),
    err, timeout_ns), allocated once: call() rewrites the descriptor in place
    and launches, so a call allocates nothing (cuLaunchKernel copies the
    arguments, also into a graph being captured)."""

    def __init__(self, fn, chan_ptr, err_ptr, timeout_ns, launch=None):
        self.fn = ctypes.c_void_p(fn)
        self.chan = ctypes.c_uint64(chan_ptr)
        self.desc = (ctypes.c_char * 96)()
        self.err = ctypes.c_uint64(err_ptr)
        self.timeout = ctypes.c_uint64(timeout_ns)
        self.params = (ctypes.c_void_p * 4)(*[ctypes.addressof(a) for a in (
            self.chan, self.desc, self.err, self.timeout)])
        self._launch = launch or lib().cuLaunchKernel  # launch: a stand-in (CPU tests)

    def launch(self, stream, device_index):
        """cuLaunchKernel(grid 1x1x1, block 32x1x1, smem 0, stream) with the
        descriptor as packed into self.desc."""
        rc = self._launch(self.fn, 1, 1, 1, 32, 1, 1, 0, stream, self.params, None)
        if rc == CUDA_ERROR_INVALID_CONTEXT:  # a thread that never touched the GPU
            ensure_context(device_index)
            rc = self._launch(self.fn, 1, 1, 1, 32, 1, 1, 0, stream, self.params, None)
        check(rc, "cuLaunchKernel(moed_chan_call)")
