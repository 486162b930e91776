/* test_hooks.h - test-only switches of the backends (never in the user's
 * config). Read from the environment when the backend opens; "1" turns one
 * on, anything else (or unset) leaves it off:
 *   MOED_TEST_CPU_HOST_ALLOC   the CPU backend offers a host allocator
 *       (page-aligned ordinary memory, reported as pinned) the way the CUDA
 *       backend offers pinned memory, so that the pinned-buffer path
 *       (server.pinned_pool_bytes, /status buffers) runs without a GPU;
 *   MOED_TEST_CPU_KERNEL_TIME  the CPU backend reports each batch's compute
 *       time as its kernel time (otherwise only CUDA knows one), so that the
 *       kernel and added_kernel stages (/status stages_us, moectl bench's
 *       latency added over the kernel) run without a GPU;
 *   MOED_TEST_CPU_SHM_IPC  the CPU backend plays a GPU for registered buffers
 *       (protocol version 2, engine/desc.h): its device UUID is
 *       MOED_TEST_CPU_UUID and an "IPC handle" is the NUL-padded name of a
 *       POSIX shared memory object, mapped whole, so that REGISTER_BUF and
 *       FORWARD_DESC run end to end (mapping, ranges, refcounts, closing on
 *       disconnect) without a GPU. Without it the CPU backend refuses
 *       REGISTER_BUF (it cannot open CUDA IPC handles);
 *   MOED_TEST_CPU_SPIN  the CPU backend says its batches come back in
 *       microseconds (backend.h completes_in_us) as the CUDA backend does,
 *       so that the event loop's spin around batches (engine.loop_spin_us,
 *       /status loop_spin_seconds) runs without a GPU;
 *   MOED_TEST_CPU_NO_MPS  with MOED_TEST_CPU_SHM_IPC, that "GPU" is not under
 *       MPS (a client on it cannot get a doorbell channel);
 *   MOED_TEST_CPU_PEERS  (not a switch: a list) with MOED_TEST_CPU_SHM_IPC,
 *       the other "GPUs" of the host that this process sees, so that the
 *       peer-access path (backend.h peer_gpu: REGISTER_BUF and CHAN_OPEN
 *       from another GPU, the dedicated expert GPU of docs/ZERO_COPY.md)
 *       runs without one: "UUID[!],UUID[!]...", each UUID 16 characters,
 *       entry i the GPU of ordinal i + 1 (0 is the backend's own), a '!'
 *       after it when there is no peer access between it and GPU 0; any
 *       other UUID is not visible. Up to 7 entries; unset, the backend has
 *       no peer_gpu (every other GPU refused);
 *   MOED_TEST_CPU_CHANNELS  the CPU backend has fake doorbell channel ops
 *       (backend.h chan_*): entries of a table of engine.max_channels that
 *       serve nothing, report quiet 3 polls after chan_close and count each
 *       chan_quiet poll as a descriptor served (1 us of kernel time), so that
 *       the daemon's channel lifetime (CHAN_OPEN's checks, the references on
 *       registrations, UNREGISTER_BUF refused while a channel names the
 *       buffer, draining and reaping on CHAN_CLOSE and disconnect, /status)
 *       runs without a GPU. Without it CHAN_OPEN is MOED_E_UNSUPPORTED on
 *       the CPU backend.
 *   MOED_TEST_MPS_NO_LOCK  the CUDA backend on a GPU under MPS takes no lock
 *       file (backend_cuda_int.h cuda_gpu_lock), so that a second moed on the
 *       GPU is not refused: the two ranks of tests/gpu/test_nccl_daemon.py
 *       share the one GPU of the test machine.
 * The CUDA backend's test and bench hooks are backend_cuda_hooks.h.
 */
#ifndef MOED_TEST_HOOKS_H
#define MOED_TEST_HOOKS_H

#include <stdlib.h>
#include <string.h>

#define MOED_TEST_CPU_HOST_ALLOC "MOED_TEST_CPU_HOST_ALLOC"
#define MOED_TEST_CPU_KERNEL_TIME "MOED_TEST_CPU_KERNEL_TIME"
#define MOED_TEST_CPU_SHM_IPC "MOED_TEST_CPU_SHM_IPC"
#define MOED_TEST_CPU_NO_MPS "MOED_TEST_CPU_NO_MPS"
#define MOED_TEST_CPU_SPIN "MOED_TEST_CPU_SPIN"
#define MOED_TEST_CPU_CHANNELS "MOED_TEST_CPU_CHANNELS"
#define MOED_TEST_CPU_PEERS "MOED_TEST_CPU_PEERS"
#define MOED_TEST_MPS_NO_LOCK "MOED_TEST_MPS_NO_LOCK"
#define MOED_TEST_CPU_UUID "moed-cpu-test-id" /* 16 bytes, no NUL */

static inline int moed_test_switch(const char *name)
{
    const char *v = getenv(name);
    return v && strcmp(v, "1") == 0;
}

#endif
