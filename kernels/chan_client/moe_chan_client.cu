/* moe_chan_client.cu - the client side of a doorbell channel: the kernel a
 * serving engine enqueues on its own CUDA stream (captured in its CUDA graph
 * and replayed) to run one MoE layer through moed without a host round trip.
 *
 * Not part of the daemon's kernels: it is built into a fatbin of its own
 * (Makefile: sm_90a, sm_120a and compute_90 PTX), embedded in the daemon,
 * and sent to each client in the CHAN_OPEN reply (ipc/PROTOCOL.md section
 * 10), so that the client always runs the code of the daemon's channel ABI
 * (kernels/moe_gpu_abi.h). The client loads it with cuModuleLoadData and
 * launches moed_chan_call with grid 1, block 32 (one thread works).
 *
 * The sequence numbers live in device memory (the channel's bell), not in
 * the launch: a replayed graph rings seq = bell + 1 each time. Calls on one
 * channel must be serialized (one stream per channel).
 */
#include <stdint.h>

#include "moe_gpu_abi.h"

static __device__ __forceinline__ unsigned long long ld_acquire_sys(const uint64_t *p)
{
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void st_release_sys(uint64_t *p, unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ unsigned long long globaltimer_ns(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Submit descriptor d (its seq is set here) on channel ch and wait for the
 * answer. On anything but MOE_GPU_CHAN_OK for this seq - a refused
 * descriptor, no answer within timeout_ns (0: wait forever), or the daemon
 * closed the channel - the status word (seq << 8 | code;
 * MOE_GPU_CHAN_E_TIMEOUT, MOE_GPU_CHAN_E_CLOSED) goes into *err unless *err
 * already holds an earlier one. */
extern "C" __global__ void moed_chan_call(struct moe_gpu_chan *ch, struct moe_gpu_chan_desc d,
                                          unsigned long long *err, unsigned long long timeout_ns)
{
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    const unsigned long long seq = *(volatile uint64_t *)&ch->bell + 1;
    if (*(volatile uint64_t *)&ch->closed) { /* nothing will answer: do not ring */
        atomicCAS(err, 0ull, moe_gpu_chan_word(seq, MOE_GPU_CHAN_E_CLOSED));
        return;
    }
    d.seq = seq;
    struct moe_gpu_chan_desc *slot = &ch->slot[seq % MOE_GPU_CHAN_SLOTS];
    const uint4 *src = reinterpret_cast<const uint4 *>(&d);
    uint4 *dst = reinterpret_cast<uint4 *>(slot);
#pragma unroll
    for (unsigned i = 0; i < sizeof d / 16; i++)
        __stcg(dst + i, src[i]);
    uint64_t *stamp = ch->stamp[seq % MOE_GPU_CHAN_SLOTS];
    const unsigned long long t0 = globaltimer_ns();
    __stcg(&stamp[0], t0);
    st_release_sys(&ch->bell, seq); /* release: the slot before the bell, at system scope */

    unsigned ns = 32;
    unsigned long long word;
    for (;;) {
        if (ld_acquire_sys(&ch->done) >= seq) {
            __stcg(&stamp[3], globaltimer_ns());
            word = ld_acquire_sys(&ch->status[seq % MOE_GPU_CHAN_SLOTS]);
            if (word == moe_gpu_chan_word(seq, MOE_GPU_CHAN_OK))
                return;
            if (word >> 8 != seq) /* answered past seq and overwritten: not ours */
                word = moe_gpu_chan_word(seq, MOE_GPU_CHAN_E_SEQ);
            break;
        }
        if (*(volatile uint64_t *)&ch->closed) {
            word = moe_gpu_chan_word(seq, MOE_GPU_CHAN_E_CLOSED);
            break;
        }
        if (timeout_ns && globaltimer_ns() - t0 > timeout_ns) {
            word = moe_gpu_chan_word(seq, MOE_GPU_CHAN_E_TIMEOUT);
            break;
        }
        __nanosleep(ns);
        ns = ns < 256 ? ns * 2 : 256;
    }
    atomicCAS(err, 0ull, word);
}
