/* backend_chan_cuda.c - the CUDA backend's doorbell channels (backend.h:
 * chan_open, chan_close, chan_quiet, chan_stats; the contract is in
 * kernels/moe_gpu_abi.h, the registry and every host-side check in
 * engine/desc.c).
 *
 * The kernel's channel table (engine.max_channels entries) lies in device
 * memory; the host writes an entry only while it is inactive, through a
 * stream of its own (cb->side: a copy there never waits for the resident
 * kernel), and then releases chanctl->gen. Each entry has an allocation of
 * its own (MOE_GPU_CHAN_ALLOC, so that its IPC handle exposes nothing else),
 * made on the entry's first use and kept. A channel with an arena (daemon
 * memory the client copies its inputs into and y out of, so that a killed
 * client frees nothing the kernel touches) has it in the same allocation at
 * MOE_GPU_CHAN_ARENA_OFF, the whole rounded up to MOE_GPU_CHAN_ALLOC; an
 * entry whose allocation is too small for the arena asked gets a larger one
 * and the old one is freed later (cuda_release_later: cudaFree waits for the
 * device to go idle, which it never is while the kernel is resident). The
 * whole allocation is zeroed at every open: a new owner never sees a
 * previous owner's ring or activations. A reused allocation gets a fresh
 * key, so a closed channel's client that still rings it is refused
 * (MOE_GPU_CHAN_E_KEY).
 *
 * Closing never waits: the entry is deactivated, gen released, and the
 * entry stays DRAINING until the dispatcher has acknowledged that gen
 * (between batches, so none of the channel's batches is in flight). While a
 * channel is open or draining the kernel stays resident (no idle exit; a
 * relaunch if it had idled out), since only a running kernel sees a bell.
 * Loop thread, except where noted; state under cb->mu.
 */
#include <cuda_runtime.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "backend_cuda_int.h"
#include "moed_check_cuda.h"
#include "moed_err.h"
#include "moed_log.h"
#include "moed_util.h"

enum { CHAN_FREE = 0, CHAN_OPEN, CHAN_DRAINING };

int cuda_chan_setup(struct cuda_backend *cb, uint32_t max_channels, char *err, size_t errlen)
{
    int rc = 0;
    if (max_channels > MOE_GPU_MAX_CHANS)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "cuda backend: %u doorbell channels asked, at most %d", max_channels,
                           MOE_GPU_MAX_CHANS);
    cb->n_chans = max_channels;
    if (!max_channels)
        return 0;
    cb->chan = calloc(max_channels, sizeof *cb->chan);
    if (!cb->chan)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "cuda backend: channel table");
    const size_t tab = (size_t)max_channels * sizeof(struct moe_gpu_chan_ent);
    MOED_CUDA_TRY(cudaMalloc((void **)&cb->chans_d, tab));
    MOED_CUDA_TRY(cudaMemset(cb->chans_d, 0, tab));
    MOED_CUDA_TRY(cudaMalloc((void **)&cb->slot_of_d, cb->n_slot_of * sizeof(int32_t)));
    MOED_CUDA_TRY(cudaMemcpy(cb->slot_of_d, cb->slot_of, cb->n_slot_of * sizeof(int32_t),
                             cudaMemcpyHostToDevice));
    MOED_CUDA_TRY(cudaHostAlloc((void **)&cb->chanctl, sizeof *cb->chanctl, cudaHostAllocMapped));
    memset(cb->chanctl, 0, sizeof *cb->chanctl);
    MOED_CUDA_TRY(cudaHostGetDevicePointer((void **)&cb->chanctl_d, cb->chanctl, 0));
    MOED_CUDA_TRY(cudaStreamCreateWithFlags(&cb->side, cudaStreamNonBlocking));
    MOED_CUDA_TRY(cudaHostAlloc(&cb->zeros, MOE_GPU_CHAN_ALLOC, cudaHostAllocDefault));
    memset(cb->zeros, 0, MOE_GPU_CHAN_ALLOC);
    cb->params.chans = cb->chans_d;
    cb->params.chanctl = cb->chanctl_d;
    cb->params.slot_of = cb->slot_of_d;
    cb->params.n_chans = max_channels;
    cb->params.n_slot_of = cb->n_slot_of;
cleanup:
    return rc;
}

void cuda_chan_teardown(struct cuda_backend *cb, int device_ok)
{
    if (device_ok) {
        for (uint32_t i = 0; cb->chan && i < cb->n_chans; i++)
            if (cb->chan[i].mem)
                cudaFree(cb->chan[i].mem);
        if (cb->side)
            cudaStreamDestroy(cb->side);
        cudaFree(cb->chans_d);
        cudaFree(cb->slot_of_d);
        if (cb->chanctl)
            cudaFreeHost(cb->chanctl);
        if (cb->zeros)
            cudaFreeHost(cb->zeros);
    }
    free(cb->chan);
    cb->chan = NULL;
}

/* Write entry i's words [off, off + len) from src and wait for the copy
 * (the side stream: it does not wait for the resident kernel). */
static int put_entry(struct cuda_backend *cb, uint32_t i, size_t off, const void *src, size_t len)
{
    uint8_t *dst = (uint8_t *)&cb->chans_d[i] + off;
    cudaError_t ce = cuda_use(cb); /* chan_close: the loop thread */
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(dst, src, len, cudaMemcpyHostToDevice, cb->side);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(cb->side);
    if (ce != cudaSuccess) {
        LOG_E("cuda: GPU %d: channel table write: %s", cb->dev, cudaGetErrorString(ce));
        return MOED_E_BACKEND;
    }
    return 0;
}

/* Tell channel i's client that nothing will answer any more: its
 * `closed` word (the client kernel stops waiting, MOE_GPU_CHAN_E_CLOSED). */
static void mark_closed(struct cuda_backend *cb, uint32_t i)
{
    static const uint64_t one = 1;
    uint8_t *dst = (uint8_t *)cb->chan[i].mem + offsetof(struct moe_gpu_chan, closed);
    cudaError_t ce = cuda_use(cb);
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(dst, &one, sizeof one, cudaMemcpyHostToDevice, cb->side);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(cb->side);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        LOG_W("cuda: GPU %d: channel %u: cannot mark it closed: %s", cb->dev, i,
              cudaGetErrorString(ce));
    }
}

/* Release a table change; the generation it got (mu held). */
static uint64_t publish_gen_locked(struct cuda_backend *cb)
{
    moe_gpu_chan_publish(cb->chanctl, ++cb->chan_gen);
    return cb->chan_gen;
}

void cuda_chan_wake_locked(struct cuda_backend *cb)
{
    if (cb->n_chans)
        (void)publish_gen_locked(cb);
}

/* Give entry ch an allocation of at least `need` bytes and its IPC handle:
 * the one it has, or a new one (the old one, too small, freed later). */
static cudaError_t chan_mem(struct cuda_backend *cb, struct cuda_chan *ch, size_t need)
{
    if (ch->mem && ch->mem_bytes < need) {
        (void)cuda_release_later(cb, ch->mem, CUDA_REL_FREE); /* logged if not */
        ch->mem = NULL;
        ch->mem_bytes = 0;
    }
    if (ch->mem)
        return cudaSuccess;
    cudaError_t ce = cudaMalloc(&ch->mem, need);
    if (ce != cudaSuccess) {
        ch->mem = NULL;
        return ce;
    }
    cudaIpcMemHandle_t h;
    ce = cudaIpcGetMemHandle(&h, ch->mem);
    if (ce != cudaSuccess) {
        /* never exported: nothing but this process can touch it, and no
         * kernel does yet */
        (void)cuda_release_later(cb, ch->mem, CUDA_REL_FREE);
        ch->mem = NULL;
        return ce;
    }
    memcpy(ch->handle, &h, sizeof ch->handle);
    ch->mem_bytes = need;
    return cudaSuccess;
}

int cuda_chan_open(struct moed_backend *be, const struct moed_chan_buf *bufs, uint32_t n_bufs,
                   uint64_t arena_bytes, struct moed_chan_info *out, char *err, size_t errlen)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    if (!cb->n_chans)
        return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                           "doorbell channels are off (engine.max_channels is 0)");
    const uint32_t first = arena_bytes != 0; /* the arena is range 0 */
    if ((!first && n_bufs == 0) || n_bufs > MOE_GPU_CHAN_BUFS - first)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "a channel names %u to %d buffers%s, not %u", 1 - first,
                           MOE_GPU_CHAN_BUFS - first, first ? " besides its arena" : "", n_bufs);
    if (arena_bytes > (1ull << 40)) /* desc.c bounds it far lower (the model's rows) */
        return moed_seterr(err, errlen, MOED_E_INVAL, "a %" PRIu64 "-byte arena", arena_bytes);
    const size_t need = first ? (size_t)(MOE_GPU_CHAN_ARENA_OFF + arena_bytes +
                                         MOE_GPU_CHAN_ALLOC - 1) /
                                    MOE_GPU_CHAN_ALLOC * MOE_GPU_CHAN_ALLOC
                              : MOE_GPU_CHAN_ALLOC;
    pthread_mutex_lock(&cb->mu);
    int failed = cb->failed;
    uint32_t i = 0;
    while (i < cb->n_chans && cb->chan[i].state != CHAN_FREE)
        i++;
    pthread_mutex_unlock(&cb->mu);
    if (failed)
        return moed_seterr(err, errlen, MOED_E_BACKEND, "the cuda backend has failed: %s",
                           cb->fail_msg);
    if (i == cb->n_chans)
        return moed_seterr(err, errlen, MOED_E_BUSY,
                           "every doorbell channel is in use or closing (engine.max_channels %u)",
                           cb->n_chans);
    struct cuda_chan *ch = &cb->chan[i];
    cudaError_t ce = cuda_use(cb);
    if (ce == cudaSuccess)
        ce = chan_mem(cb, ch, need);
    /* a clean channel: bell, done, status and slots zero, and nothing of a
     * previous owner's arena (the client maps the whole allocation) */
    for (size_t off = 0; ce == cudaSuccess && off < ch->mem_bytes; off += MOE_GPU_CHAN_ALLOC)
        ce = cudaMemcpyAsync((uint8_t *)ch->mem + off, cb->zeros,
                             ch->mem_bytes - off < MOE_GPU_CHAN_ALLOC ? ch->mem_bytes - off
                                                                      : MOE_GPU_CHAN_ALLOC,
                             cudaMemcpyHostToDevice, cb->side);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(cb->side);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        return moed_seterr(err, errlen, MOED_E_NOMEM, "cuda backend: channel memory: %s",
                           cudaGetErrorString(ce));
    }
    struct moe_gpu_chan_ent e;
    memset(&e, 0, sizeof e);
    e.chan = (uint64_t)(uintptr_t)ch->mem;
    if (getrandom(&e.key, sizeof e.key, 0) != (ssize_t)sizeof e.key)
        e.key = (uint64_t)moed_mono_ns() * 0x9E3779B97F4A7C15ull;
    e.key |= 1; /* never 0: a zeroed descriptor is refused */
    if (first)
        e.reg[0] = (struct moe_gpu_reg){(uint64_t)(uintptr_t)ch->mem + MOE_GPU_CHAN_ARENA_OFF,
                                        arena_bytes};
    for (uint32_t b = 0; b < n_bufs; b++)
        e.reg[first + b] = (struct moe_gpu_reg){(uint64_t)(uintptr_t)bufs[b].ptr, bufs[b].size};
    e.active = 0; /* written inactive, activated by the last word */
    if (put_entry(cb, i, 0, &e, sizeof e))
        return moed_seterr(err, errlen, MOED_E_BACKEND, "cuda backend: channel table write failed");
    memset(&cb->chanctl->stat[i], 0, sizeof cb->chanctl->stat[i]);
    const uint32_t on = 1;
    if (put_entry(cb, i, offsetof(struct moe_gpu_chan_ent, active), &on, sizeof on))
        return moed_seterr(err, errlen, MOED_E_BACKEND, "cuda backend: channel table write failed");
    pthread_mutex_lock(&cb->mu);
    /* An idle stop decided before this channel counted must end first: the
     * kernel looks at its stop request only when idle, and a client ringing
     * the new channel could keep it busy past the stop's limit. Stopping an
     * idle kernel takes microseconds; the wait is bounded all the same. */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5;
    while (cb->stopping && pthread_cond_timedwait(&cb->cv, &cb->mu, &until) == 0) {
    }
    ch->state = CHAN_OPEN;
    cb->chans_live++;
    publish_gen_locked(cb);
    pthread_cond_signal(&cb->cv); /* an idled-out kernel is launched again */
    pthread_mutex_unlock(&cb->mu);
    out->index = i;
    out->key = e.key;
    memcpy(out->handle, ch->handle, sizeof out->handle);
    out->size = sizeof(struct moe_gpu_chan);
    out->arena_off = first ? MOE_GPU_CHAN_ARENA_OFF : 0;
    out->arena_bytes = arena_bytes;
    out->kernel = moe_chan_client_fatbin;
    out->kernel_bytes = (uint64_t)(moe_chan_client_fatbin_end - moe_chan_client_fatbin);
    LOG_D("cuda: GPU %d: channel %u open over %u buffers and a %" PRIu64 "-byte arena "
          "(allocation %zu bytes)", cb->dev, i, n_bufs, arena_bytes, ch->mem_bytes);
    return 0;
}

void cuda_chan_close(struct moed_backend *be, uint32_t index)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    if (index >= cb->n_chans || cb->chan[index].state != CHAN_OPEN)
        return;
    mark_closed(cb, index);
    const uint32_t off = 0;
    int rc = put_entry(cb, index, offsetof(struct moe_gpu_chan_ent, active), &off, sizeof off);
    pthread_mutex_lock(&cb->mu);
    cb->chan[index].state = CHAN_DRAINING;
    /* a failed table write leaves the entry active: it never drains (its
     * buffers stay mapped until process exit, as after a failed batch) */
    cb->chan[index].close_gen = rc ? UINT64_MAX : publish_gen_locked(cb);
    pthread_mutex_unlock(&cb->mu);
}

int cuda_chan_quiet(struct moed_backend *be, uint32_t index)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    if (index >= cb->n_chans)
        return 1;
    pthread_mutex_lock(&cb->mu);
    struct cuda_chan *ch = &cb->chan[index];
    int quiet = ch->state == CHAN_FREE;
    /* after a failure the kernel may still be inside one of its batches */
    if (ch->state == CHAN_DRAINING && !cb->failed &&
        moe_gpu_chan_acked(cb->chanctl) >= ch->close_gen) {
        ch->state = CHAN_FREE;
        cb->chans_live--;
        quiet = 1;
    }
    pthread_mutex_unlock(&cb->mu);
    return quiet;
}

void cuda_chan_stats(struct moed_backend *be, uint32_t index, struct moed_chan_stats *out)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    memset(out, 0, sizeof *out);
    if (index >= cb->n_chans)
        return;
    out->served = moe_gpu_chan_counter(cb->chanctl, index, 0);
    out->refused = moe_gpu_chan_counter(cb->chanctl, index, 1);
    out->kernel_ns = moe_gpu_chan_counter(cb->chanctl, index, 2);
    out->last = moe_gpu_chan_counter(cb->chanctl, index, 3);
}

void cuda_chan_deactivate_all(struct cuda_backend *cb)
{
    for (uint32_t i = 0; i < cb->n_chans; i++)
        if (cb->chan[i].state == CHAN_OPEN)
            cuda_chan_close(&cb->base, i);
}

void cuda_chan_failed(struct cuda_backend *cb)
{
    /* which entries are in use, under mu (the loop thread changes them); the
     * copies then outside it */
    uint8_t used[MOE_GPU_MAX_CHANS] = {0};
    pthread_mutex_lock(&cb->mu);
    for (uint32_t i = 0; i < cb->n_chans; i++)
        used[i] = cb->chan[i].state != CHAN_FREE;
    pthread_mutex_unlock(&cb->mu);
    for (uint32_t i = 0; i < cb->n_chans; i++)
        if (used[i])
            mark_closed(cb, i);
}
