/* backend_cuda.c - the CUDA backend: weight placement, the submission ring,
 * the completion thread and failure handling around the persistent kernel
 * (kernels/moe_gpu.cu).
 *
 * Placement (backend_place_cuda.c). Every expert of every MoE layer is
 * repacked on the host (moe_gpu_repack_expert, in parallel over experts) into
 * the kernel's stream order and copied into one device allocation; each matrix's
 * weight_scale_2 goes to a per-layer float table. The whole placement is
 * counted first and refused with both numbers if it does not fit
 * (cudaMemGetInfo).
 *
 * Hot path (submit). No CUDA call: x in memory from host_alloc (pinned,
 * device-mapped, MOED_BUF_PINNED, 16-byte aligned) is handed to the kernel
 * where it lies, other host inputs are copied into the ring slot's pinned,
 * device-mapped staging area (ids and w always: they are small and the slot
 * holds them inline), the descriptor is written, and ctrl->head is stored
 * with release semantics (x86: a plain store after the descriptor stores; the
 * kernel reads head with ld.acquire.sys). Likewise the kernel writes y
 * straight into a MOED_BUF_PINNED output, else into staging. Batches that
 * find the ring full wait in a FIFO that the completion thread drains.
 *
 * Host memory (host_alloc). cudaHostAlloc(mapped | portable); with unified
 * addressing the device pointer is the host pointer, which is checked once
 * per allocation (a block where it is not is never handed out). Freeing it
 * (cudaFreeHost) waits until the device is idle, i.e. never returns while the
 * persistent kernel is resident: host_free only queues the block, and close
 * frees the queue once the kernel has stopped.
 *
 * Completion thread (one per GPU). Watches ctrl->done_seq (acquire), copies
 * a staged output into the engine's buffer, sets the batch's kernel_ns
 * (kernel_time_ns) and calls done().
 * It spins briefly after progress and then backs off; idle, it sleeps on a
 * condition variable that submit signals. It also enforces the batch
 * deadline, watches the heartbeat, polls the stream for a sticky CUDA error
 * and, after idle_exit_ms of idleness, stops the kernel (relaunched on the
 * next batch). Any failure marks the backend unhealthy and fails every queued
 * and in-flight batch with MOED_E_BACKEND; the daemon then exits with code 4
 * (docs/GPU.md) so the service manager restarts it.
 *
 * One backend drives one GPU. Expert parallelism over several (or one GPU
 * listed more than once) opens one backend per GPU under the wrapper of
 * engine/backend.h (moed_backend_ep_open); a backend with cfg->ep_place is
 * one of its devices (backend_shard_cuda.c).
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "backend_cuda.h"
#include "backend_cuda_hooks.h"
#include "backend_cuda_int.h"
#include "moe_gpu.h"
#include "moed_check_cuda.h"
#include "moed_err.h"
#include "moed_log.h"
#include "moed_util.h"

/* Every CUDA call goes through MOED_CUDA_TRY (common/moed_check_cuda.h): the
 * call text, file and line go to the log and to err, rc becomes
 * MOED_E_BACKEND, control goes to `cleanup`. */

#define HB_STALL_MS 5000u /* idle kernel heartbeat must advance within this */

static int g_test_guards; /* backends opened from now on get guard regions */

static uint64_t rt_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* cudaMalloc of a scratch buffer of `bytes` (between two guard regions of
 * cb->guard bytes). */
#define CUDA_MAX_TOKENS 16384u /* engine.max_tokens on this backend (cuda_open) */

static int scratch_alloc(struct cuda_backend *cb, int which, void **out, size_t bytes, char *err,
                         size_t errlen)
{
    int rc = 0;
    uint8_t *b = NULL;
    const size_t g = cb->guard;
    MOED_CUDA_TRY(cudaMalloc((void **)&b, bytes + 2 * g));
    cb->g[which].base = b;
    cb->g[which].bytes = bytes;
    if (g) {
        MOED_CUDA_TRY(cudaMemset(b, GUARD_FILL, g));
        MOED_CUDA_TRY(cudaMemset(b + g + bytes, GUARD_FILL, g));
    }
    *out = b + g;
cleanup:
    return rc;
}

/* h, the gate_up output, is read back by every down task of its expert (one
 * per column block of the hidden dimension); between its write and those
 * reads the expert weights stream through L2 and evict it, so at large T
 * each row came from DRAM twice or more (Qwen3-30B-A3B T = 256: 1.056x the
 * experts' bytes, bench/NOTES.md stop 41). The first bytes of h (pair rows
 * fill it from the start, so these are the rows every batch uses) go in an
 * access policy window of persisting lines on the kernel's stream, with L2
 * set aside for them: L2 / 8 at most (6.25 MiB of the H100's 50, 7.5 of the
 * H200's 60; what persisting lines do not use stays open to all accesses).
 * A device without persisting L2 (cudaDevAttrMaxPersistingL2CacheSize 0),
 * or one whose set-aside cannot be changed from here and is 0 (under MPS only
 * the server's CUDA_DEVICE_DEFAULT_PERSISTING_L2_CACHE_PERCENTAGE_LIMIT sets
 * it; under MIG there is none), runs without the window: logged, not an
 * error. */
static int cuda_h_in_l2(struct cuda_backend *cb, size_t h_bytes, char *err, size_t errlen)
{
    int rc = 0, maxp = 0, maxw = 0, l2 = 0;
    size_t aside = 0;
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&maxp, cudaDevAttrMaxPersistingL2CacheSize, cb->dev));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&maxw, cudaDevAttrMaxAccessPolicyWindowSize, cb->dev));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, cb->dev));
    size_t win = h_bytes;
    if (win > (size_t)l2 / 8)
        win = (size_t)l2 / 8;
    if (win > (size_t)maxp)
        win = (size_t)maxp;
    if (win > (size_t)maxw)
        win = (size_t)maxw;
    if (win > 0) {
        /* the set-aside is the context's: never shrink what another part of
         * this process set; a refusal (MPS) leaves the limit as it is */
        MOED_CUDA_TRY(cudaDeviceGetLimit(&aside, cudaLimitPersistingL2CacheSize));
        if (aside < win && cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, win) != cudaSuccess)
            (void)cudaGetLastError();
        MOED_CUDA_TRY(cudaDeviceGetLimit(&aside, cudaLimitPersistingL2CacheSize));
        if (win > aside)
            win = aside;
    }
    if (win == 0) {
        LOG_I("cuda: GPU %d: h stays in normal L2 lines: no persisting L2 set aside (device max "
              "%d bytes, window max %d; under MPS the server's "
              "CUDA_DEVICE_DEFAULT_PERSISTING_L2_CACHE_PERCENTAGE_LIMIT sets it)",
              cb->dev, maxp, maxw);
        goto cleanup;
    }
    cudaStreamAttrValue v;
    memset(&v, 0, sizeof v);
    v.accessPolicyWindow.base_ptr = cb->h;
    v.accessPolicyWindow.num_bytes = win;
    v.accessPolicyWindow.hitRatio = 1.0f;
    v.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
    v.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
    MOED_CUDA_TRY(cudaStreamSetAttribute(cb->stream, cudaStreamAttributeAccessPolicyWindow, &v));
    cb->h_l2_bytes = win;
    LOG_I("cuda: GPU %d: the first %zu KiB of h (%zu KiB) in persisting L2 lines", cb->dev,
          win >> 10, h_bytes >> 10);
cleanup:
    return rc;
}

/* ---------------- queue ---------------- */

/* 1 if the kernel reads or writes the buffer where it lies: device memory,
 * or host memory from host_alloc (mapped at the same address) aligned for the
 * kernel's 16-byte vectors; 0 if it goes through the slot's staging area. */
static int buf_in_place(const struct moed_buf *b)
{
    return b->kind == MOED_BUF_DEVICE ||
           (b->kind == MOED_BUF_PINNED && (uintptr_t)b->ptr % MOED_BUF_ALIGN == 0);
}

/* Copy the batch's staged inputs into the slot and publish it. Caller holds
 * mu. */
static void publish_locked(struct cuda_backend *cb, struct moed_batch *b)
{
    uint64_t seq = ++cb->next_seq;
    unsigned slot = (unsigned)(seq % MOE_GPU_RING);
    uint8_t *st = cb->stage + slot * cb->slot_bytes;
    uint8_t *sd = cb->stage_d + slot * cb->slot_bytes;
    const uint32_t T = b->n_tokens, H = cb->d.hidden, k = cb->d.top_k;
    struct moe_gpu_slot *sl = moe_gpu_slot_for(cb->ctrl, seq);
    struct moe_gpu_desc *dsc = &sl->d;
    const uint32_t ep = b->flags & (MOED_BATCH_ROWS | MOED_BATCH_COMBINE);
    dsc->seq = seq;
    dsc->layer = (uint32_t)cb->slot_of[b->layer];
    dsc->n_tokens = T;
    if (ep == MOED_BATCH_COMBINE) { /* reads no x */
        dsc->x = 0;
    } else if (buf_in_place(&b->x)) {
        dsc->x = (uint64_t)(uintptr_t)b->x.ptr;
    } else {
        memcpy(st, b->x.ptr, (size_t)T * H * 2);
        dsc->x = (uint64_t)(uintptr_t)sd;
    }
    dsc->inl = moed_buf_on_host(&b->ids) && moed_buf_on_host(&b->w) &&
               (size_t)T * k * 8 <= MOE_GPU_INLINE_BYTES;
    if (dsc->inl) { /* one PCIe round trip fewer for the kernel (moe_gpu.h) */
        cuda_shard_ids(cb, b, (int32_t *)(void *)sl->inl);
        memcpy(sl->inl + (size_t)T * k * 4, b->w.ptr, (size_t)T * k * 4);
        dsc->ids = dsc->w = 0;
    } else if (moed_buf_on_host(&b->ids)) {
        cuda_shard_ids(cb, b, (int32_t *)(void *)(st + cb->off_ids));
        dsc->ids = (uint64_t)(uintptr_t)(sd + cb->off_ids);
    } else {
        dsc->ids = (uint64_t)(uintptr_t)b->ids.ptr;
    }
    if (dsc->inl) {
    } else if (moed_buf_on_host(&b->w)) {
        memcpy(st + cb->off_w, b->w.ptr, (size_t)T * k * 4);
        dsc->w = (uint64_t)(uintptr_t)(sd + cb->off_w);
    } else {
        dsc->w = (uint64_t)(uintptr_t)b->w.ptr;
    }
    dsc->y = ep == MOED_BATCH_ROWS ? 0 /* writes rows, not y */
             : buf_in_place(&b->y) ? (uint64_t)(uintptr_t)b->y.ptr
                                   : (uint64_t)(uintptr_t)(sd + cb->off_y);
    dsc->flags = ((b->flags & MOED_BATCH_ROUTED_ONLY) ? MOE_GPU_ROUTED_ONLY : 0) |
                 (ep == MOED_BATCH_ROWS ? MOE_GPU_ROWS : 0) |
                 (ep == MOED_BATCH_COMBINE ? MOE_GPU_COMBINE : 0);
    dsc->rows = ep ? (uint64_t)(uintptr_t)b->rows.ptr : 0;
    dsc->ep_n = ep == MOED_BATCH_ROWS ? b->ep_n : 1;
    dsc->ep_shard = ep == MOED_BATCH_ROWS ? b->ep_shard : 0;
    dsc->stall_ns = cb->stall_ns;
    cb->stall_ns = 0;
    cb->inflight[slot] = b;
    if (cb->next_seq == cb->delivered + 1)
        cb->head_start_ns = moed_mono_ns();
    /* stamped just before the release store: the dispatch-latency figure of
     * the benchmark then includes the store's own cost (tens of ns) */
    __atomic_store_n(&cb->pub_rt_ns, rt_ns(), __ATOMIC_RELAXED);
    moe_gpu_publish(cb->ctrl, seq);
}

static void fill_from_pending_locked(struct cuda_backend *cb)
{
    while (cb->ph && cb->running && !cb->failed && cb->next_seq - cb->delivered < MOE_GPU_RING) {
        struct pend *p = cb->ph;
        cb->ph = p->next;
        if (!cb->ph)
            cb->pt = NULL;
        publish_locked(cb, p->b);
        free(p);
    }
}

static int cuda_submit(struct moed_backend *be, struct moed_batch *b)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    const uint32_t T = b->n_tokens, H = cb->d.hidden, k = cb->d.top_k;
    /* expert parallelism: a ROWS batch writes no y, a COMBINE batch reads no x */
    const uint32_t ep = b->flags & (MOED_BATCH_ROWS | MOED_BATCH_COMBINE);
    int rc = 0;
    /* shapes (the engine validated the request; these are internal asserts) */
    if (T == 0 || T > cb->d.max_tokens || b->top_k != k || b->layer >= cb->n_slot_of ||
        cb->slot_of[b->layer] < 0 ||
        (ep != MOED_BATCH_COMBINE && b->x.bytes < (uint64_t)T * H * 2) ||
        (ep != MOED_BATCH_ROWS && b->y.bytes < (uint64_t)T * H * 2) ||
        b->ids.bytes < (uint64_t)T * k * 4 || b->w.bytes < (uint64_t)T * k * 4)
        return MOED_E_INVAL;
    const struct moed_buf *bufs[4] = {&b->x, &b->ids, &b->w, &b->y};
    for (int i = 0; i < 4; i++) {
        if ((i == 0 && ep == MOED_BATCH_COMBINE) || (i == 3 && ep == MOED_BATCH_ROWS))
            continue;
        if (!bufs[i]->ptr || (bufs[i]->kind == MOED_BUF_DEVICE && bufs[i]->device != cb->dev))
            return MOED_E_INVAL;
    }
    if (moed_buf_on_host(&b->ids)) {
        const int32_t *ids = b->ids.ptr;
        for (uint64_t i = 0; i < (uint64_t)T * k; i++)
            if (ids[i] < -1 || (ids[i] >= 0 && (uint32_t)ids[i] >= cb->ep_experts))
                return MOED_E_INVAL; /* -1: an empty slot (moed_batch.ids) */
    }
    if ((rc = cuda_shard_check(cb, b)))
        return rc;
    pthread_mutex_lock(&cb->mu);
    if (cb->failed) {
        rc = MOED_E_BACKEND;
    } else if (cb->closing) {
        rc = MOED_E_SHUTDOWN;
    } else if (cb->running && !cb->ph && cb->next_seq - cb->delivered < MOE_GPU_RING) {
        publish_locked(cb, b);
    } else {
        struct pend *p = malloc(sizeof *p);
        if (!p) {
            rc = MOED_E_NOMEM;
        } else {
            p->next = NULL;
            p->b = b;
            if (cb->pt)
                cb->pt->next = p;
            else
                cb->ph = p;
            cb->pt = p;
        }
    }
    cb->last_active_ns = moed_mono_ns();
    pthread_cond_signal(&cb->cv);
    pthread_mutex_unlock(&cb->mu);
    return rc;
}

/* Mark unhealthy and fail everything queued or in flight (done() outside mu). */
static void fail_all(struct cuda_backend *cb, const char *why)
{
    struct moed_batch *list[MOE_GPU_RING];
    int n = 0;
    struct pend *p;
    pthread_mutex_lock(&cb->mu);
    if (!cb->failed) {
        cb->failed = 1;
        snprintf(cb->fail_msg, sizeof cb->fail_msg, "%s", why);
        LOG_E("cuda: GPU %d: backend unhealthy: %s; failing %llu in-flight batches", cb->dev, why,
              (unsigned long long)(cb->next_seq - cb->delivered));
    }
    for (uint64_t s = cb->delivered + 1; s <= cb->next_seq; s++) {
        unsigned slot = (unsigned)(s % MOE_GPU_RING);
        if (cb->inflight[slot])
            list[n++] = cb->inflight[slot];
        cb->inflight[slot] = NULL;
    }
    cb->delivered = cb->next_seq;
    p = cb->ph;
    cb->ph = cb->pt = NULL;
    pthread_mutex_unlock(&cb->mu);
    cuda_chan_failed(cb);
    for (int i = 0; i < n; i++) {
        list[i]->status = MOED_E_BACKEND;
        cb->base.done(cb->base.done_ctx, list[i]);
    }
    while (p) {
        struct pend *nx = p->next;
        p->b->status = MOED_E_BACKEND;
        cb->base.done(cb->base.done_ctx, p->b);
        free(p);
        p = nx;
    }
}

/* Launch the kernel for the batches after `delivered`; 0 or MOED_E_BACKEND
 * (the failing call logged and in err). */
static int launch_locked(struct cuda_backend *cb, char *err, size_t errlen)
{
    moe_gpu_arm(cb->ctrl);
    cb->params.start_seq = cb->delivered + 1;
    int rc = moe_gpu_start(&cb->params, &cb->launch, cb->stream, err, errlen);
    if (rc)
        return rc;
    cb->launches++;
    cb->running = 1;
    cb->head_start_ns = moed_mono_ns();
    cb->last_active_ns = cb->head_start_ns; /* idle time counts from the launch */
    return 0;
}

/* Ask an idle kernel to exit and wait for it (mu held by caller is dropped
 * while waiting; returns 0 or MOED_E_BACKEND). */
static int stop_kernel(struct cuda_backend *cb, uint32_t timeout_ms)
{
    moe_gpu_request_stop(cb->ctrl);
    uint64_t t0 = moed_mono_ns();
    while (!moe_gpu_exited(cb->ctrl)) {
        if (moed_mono_ns() - t0 > (uint64_t)timeout_ms * 1000000ull)
            return MOED_E_BACKEND;
        usleep(50);
    }
    cudaError_t e = cudaStreamSynchronize(cb->stream);
    if (e != cudaSuccess) {
        LOG_E("cuda: GPU %d: kernel ended with %s", cb->dev, cudaGetErrorString(e));
        return MOED_E_BACKEND;
    }
    return 0;
}

/* The kernel time of batch `seq`, which the completion thread has just seen
 * in ctrl->done_seq: phase_ns[5] - phase_ns[0] (%globaltimer, ns). The kernel
 * keeps only the last batch's stamps and may already have started the next
 * batch (its dispatcher waits for this batch's completion, not for the host),
 * overwriting [0]: then [0] is at or past [5] and the figure is dropped (0,
 * not known); so is it when done_seq has moved on meanwhile ([5] may be the
 * next batch's). [5] is read before [0] so that a [0] of a later batch can
 * only pair with an older [5], never a stale [0] with a newer [5] (both of
 * the next batch, ahead of its done_seq, would take a whole batch run between
 * two loads). Three loads of mapped host memory, once per completion seen;
 * acquire keeps their order (plain loads on x86). */
static uint64_t kernel_time_ns(const struct cuda_backend *cb, uint64_t seq)
{
    uint64_t t5 = moe_gpu_phase(cb->ctrl, 5);
    uint64_t t0 = moe_gpu_phase(cb->ctrl, 0);
    if (moe_gpu_poll_done(cb->ctrl) != seq || t0 == 0 || t5 <= t0)
        return 0;
    return t5 - t0;
}

/* now - then as a signed age (negative when `then` was stamped after `now`). */
static int64_t age_ns(uint64_t now, uint64_t then) { return (int64_t)(now - then); }

/* Client mappings given back (cuda_ipc_close) are unmapped here, and
 * outgrown channel allocations freed (cuda_release_later), with no
 * kernel resident: a running kernel is stopped between batches (the host
 * ring empty; a busy doorbell channel does not keep it from stopping, see
 * cuda_chan_wake_locked) and relaunched by the state machine after, as it
 * would be after an idle exit. NULL or why the backend fails. */
static const char *release_step(struct cuda_backend *cb)
{
    pthread_mutex_lock(&cb->mu);
    int go = cb->n_rel && !cb->failed && !cb->closing && cb->next_seq == cb->delivered;
    int stop = go && cb->running;
    if (stop) {
        cb->running = 0;  /* submits queue meanwhile */
        cb->stopping = 1; /* a channel opens after */
        moe_gpu_request_stop(cb->ctrl);
        cuda_chan_wake_locked(cb);
    }
    pthread_mutex_unlock(&cb->mu);
    if (!go)
        return NULL;
    const char *why = NULL;
    if (stop && stop_kernel(cb, 2000))
        why = "the kernel did not stop on request";
    else
        cuda_release_queued(cb);
    if (stop) {
        pthread_mutex_lock(&cb->mu);
        cb->stopping = 0;
        pthread_cond_broadcast(&cb->cv);
        pthread_mutex_unlock(&cb->mu);
    }
    return why;
}

static void *completion_thread(void *arg)
{
    struct cuda_backend *cb = arg;
    uint64_t last_progress = moed_mono_ns(), last_query = 0, hb_val = 0, hb_at = moed_mono_ns();
    unsigned backoff_us = 0;
    if (cuda_use(cb) != cudaSuccess) {
        fail_all(cb, "cannot make the device's context current in the completion thread");
        return NULL;
    }
    for (;;) {
        uint64_t now = moed_mono_ns();
        /* ---- deliver completions ---- */
        uint64_t done = moe_gpu_poll_done(cb->ctrl);
        int progressed = 0;
        uint64_t done_kernel_ns = 0; /* kernel time of batch `done`, read right away */
        if (done > cb->delivered) { /* delivered: written by this thread only */
            __atomic_store_n(&cb->seen_rt_ns, rt_ns(), __ATOMIC_RELAXED);
            done_kernel_ns = kernel_time_ns(cb, done);
        }
        for (;;) {
            struct moed_batch *b = NULL;
            uint64_t seq = 0;
            pthread_mutex_lock(&cb->mu);
            if (cb->delivered < done && cb->delivered < cb->next_seq && !cb->failed) {
                unsigned slot = (unsigned)((cb->delivered + 1) % MOE_GPU_RING);
                b = cb->inflight[slot];
                cb->inflight[slot] = NULL;
                if (b && !(b->flags & MOED_BATCH_ROWS) && !buf_in_place(&b->y))
                    memcpy(b->y.ptr, cb->stage + slot * cb->slot_bytes + cb->off_y,
                           (size_t)b->n_tokens * cb->d.hidden * 2);
                seq = ++cb->delivered;
                cb->head_start_ns = now;
                cb->last_active_ns = now;
                fill_from_pending_locked(cb);
            }
            pthread_mutex_unlock(&cb->mu);
            if (!b)
                break;
            b->status = 0;
            /* only the last batch completed has its phases in ctrl */
            b->kernel_ns = seq == done ? done_kernel_ns : 0;
            cb->base.done(cb->base.done_ctx, b);
            progressed = 1;
        }
        if (progressed) {
            last_progress = now;
            backoff_us = 0;
        }

        const char *why = release_step(cb);

        /* ---- state machine under mu ---- */
        pthread_mutex_lock(&cb->mu);
        int failed = cb->failed;
        uint64_t inflight = cb->next_seq - cb->delivered;
        int pending = cb->ph != NULL;
        if (!failed && !why) {
            /* a channel's bell is seen only by a running kernel */
            if (!cb->running && (pending || cb->chans_live) && !cb->closing) {
                char lerr[MOED_ERRLEN];
                if (launch_locked(cb, lerr, sizeof lerr))
                    why = "kernel relaunch failed";
                else
                    fill_from_pending_locked(cb);
            }
            /* `now` was read before mu was taken, so a submit or launch may
             * have stamped a later time since: compare signed ages, never
             * unsigned differences that wrap to "very old". */
            if (inflight && cb->deadline_ms &&
                age_ns(now, cb->head_start_ns) > (int64_t)cb->deadline_ms * 1000000)
                why = "a batch missed engine.batch_deadline_ms";
        }
        if (cb->closing && (failed || (!inflight && !pending))) {
            pthread_mutex_unlock(&cb->mu);
            break;
        }
        int want_idle_stop = !failed && !why && cb->running && !inflight && !pending &&
                             !cb->chans_live &&
                             !cb->closing && cb->idle_exit_ms &&
                             age_ns(now, cb->last_active_ns) > (int64_t)cb->idle_exit_ms * 1000000;
        if (want_idle_stop) {
            cb->running = 0;  /* submits now queue; we stop the kernel below */
            cb->stopping = 1; /* and a channel opens only after (cuda_chan_open) */
        }
        pthread_mutex_unlock(&cb->mu);

        if (want_idle_stop) {
            if (stop_kernel(cb, 2000))
                why = "the kernel did not stop on request";
            else
                LOG_D("cuda: GPU %d: kernel exited after %u ms idle", cb->dev, cb->idle_exit_ms);
            pthread_mutex_lock(&cb->mu);
            cb->stopping = 0;
            pthread_cond_broadcast(&cb->cv);
            pthread_mutex_unlock(&cb->mu);
        }
        /* ---- health: sticky CUDA error, heartbeat ---- */
        if (!why && !failed && now - last_query > 10000000ull) {
            last_query = now;
            cudaError_t e = cudaStreamQuery(cb->stream);
            if (e != cudaSuccess && e != cudaErrorNotReady)
                why = cudaGetErrorString(e);
            uint64_t hb = moe_gpu_heartbeat(cb->ctrl);
            if (hb != hb_val || !cb->running || inflight) {
                hb_val = hb;
                hb_at = now;
            } else if (now - hb_at > (uint64_t)HB_STALL_MS * 1000000ull) {
                why = "kernel heartbeat stopped";
            }
        }
        if (why && !failed) {
            fail_all(cb, why);
            continue;
        }
        /* ---- wait: spin briefly after progress, then back off ---- */
        if (inflight) {
            /* a decode layer takes 5 us to 2 ms: spin through that, then back
             * off (a sleeping thread adds its wake-up time to every batch) */
            if (now - last_progress > 5000000ull) {
                backoff_us = backoff_us ? (backoff_us * 2 > 50 ? 50 : backoff_us * 2) : 2;
                usleep(backoff_us);
            }
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 10 * 1000000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_mutex_lock(&cb->mu);
            if (!cb->ph && cb->next_seq == cb->delivered && !cb->closing &&
                (cb->running || !cb->chans_live || cb->failed) && (!cb->n_rel || cb->failed))
                pthread_cond_timedwait(&cb->cv, &cb->mu, &ts);
            pthread_mutex_unlock(&cb->mu);
            last_progress = moed_mono_ns();
        }
    }
    return NULL;
}

/* ---------------- ops ---------------- */

static int cuda_healthy(struct moed_backend *be)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    pthread_mutex_lock(&cb->mu);
    int ok = !cb->failed;
    pthread_mutex_unlock(&cb->mu);
    return ok;
}

static void cuda_describe(struct moed_backend *be, char *buf, unsigned len)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    snprintf(buf, len,
             "cuda: GPU %d %s, %d SMs used, grid %d CTAs (%d/SM x %d threads, %d B smem), "
             "weights %.2f GiB, scratch %.2f GiB (%zu KiB in L2), "
             "device memory used %.2f of %.2f GiB, MPS %s%s%s%s",
             cb->dev, cb->dev_name, cb->launch.sms, cb->launch.grid, cb->launch.ctas_per_sm,
             cb->launch.block, cb->launch.smem_bytes, cb->weight_bytes / 1073741824.0,
             cb->scratch_bytes / 1073741824.0, cb->h_l2_bytes >> 10, cb->dev_used / 1073741824.0,
             cb->dev_total / 1073741824.0, cb->mps ? "on" : "off",
             cb->ctx ? " (context limited to its SMs)" : "", cb->failed ? "; UNHEALTHY: " : "",
             cb->failed ? cb->fail_msg : "");
}

void cuda_free_all(struct cuda_backend *cb, int device_ok)
{
    if (device_ok)
        (void)cuda_use(cb);
    if (device_ok) {
        while (cb->host_freed) {
            struct host_blk *hb = cb->host_freed;
            cb->host_freed = hb->next;
            cudaFreeHost(hb);
        }
        if (cb->stream)
            cudaStreamDestroy(cb->stream);
        cuda_green_close(cb);
        cudaFree(cb->wbuf);
        cudaFree(cb->s2);
        cudaFree(cb->layers_d);
        cudaFree(cb->state);
        for (int i = 0; i < G_COUNT; i++)
            cudaFree(cb->g[i].base);
        if (cb->ctrl)
            cudaFreeHost(cb->ctrl);
        if (cb->stage)
            cudaFreeHost(cb->stage);
    }
    cuda_chan_teardown(cb, device_ok);
    free(cb->rel); /* left mapped or allocated when the device is not ok */
    free(cb->slot_of);
    free(cb->ep_loc);
    if (device_ok) { /* a hung kernel's context (and the GPU's lock) are left to process exit */
        cuda_ctx_close(cb);
        cuda_gpu_unlock(cb);
    }
    pthread_mutex_destroy(&cb->mu);
    pthread_cond_destroy(&cb->cv);
    free(cb);
}

static const struct moed_backend_ops cuda_ops;

void moed_backend_cuda_quiesce(struct moed_backend *be)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    if (!cb || be->ops != &cuda_ops || cb->quiesced)
        return;
    cb->quiesced = 1;
    (void)cuda_use(cb); /* the closing thread may have made another current */
    cuda_chan_deactivate_all(cb);
    pthread_mutex_lock(&cb->mu);
    cb->closing = 1;
    pthread_cond_signal(&cb->cv);
    pthread_mutex_unlock(&cb->mu);
    if (cb->thr_started)
        pthread_join(cb->thr, NULL);
    cb->thr_started = 0;
    /* Stop the kernel; after a failure it may still be finishing batches
     * that were failed already, or be gone with a sticky error. Free device
     * memory (cuda_close) only when the kernel is known to be gone, never
     * under a live (hung) kernel. */
    cb->device_ok = 1;
    if (cb->running) {
        if (stop_kernel(cb, 5000)) {
            cudaError_t q = cudaStreamQuery(cb->stream);
            cb->device_ok = q != cudaErrorNotReady;
            if (!cb->device_ok)
                LOG_E("cuda: GPU %d: kernel did not stop; device memory is left to process exit",
                      cb->dev);
        }
        cb->running = 0;
    }
}

static void cuda_close(struct moed_backend *be)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    if (!cb)
        return;
    moed_backend_cuda_quiesce(be);
    (void)cuda_use(cb);
    if (cb->device_ok)
        cuda_release_queued(cb);
    cuda_dev_release(cb, cb->device_ok);
}

static const struct moed_backend_ops cuda_ops = {
    .name = "cuda",
    .completes_in_us = 1,
    .submit = cuda_submit,
    .healthy = cuda_healthy,
    .heartbeat = moed_backend_cuda_heartbeat,
    .describe = cuda_describe,
    .close = cuda_close,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .device_uuid = cuda_device_uuid,
    .peer_gpu = cuda_peer_gpu,
    .ipc_open = cuda_ipc_open,
    .ipc_close = cuda_ipc_close,
    .chan_open = cuda_chan_open,
    .chan_close = cuda_chan_close,
    .chan_quiet = cuda_chan_quiet,
    .chan_stats = cuda_chan_stats,
};

/* ---------------- open ---------------- */

int moed_backend_cuda_open_src(const struct moed_cuda_src *src, const struct moed_backend_cfg *cfg,
                               moed_backend_done_fn done, void *done_ctx,
                               struct moed_backend **out, char *err, size_t errlen)
{
    int rc = 0;
    struct cuda_backend *cb = NULL;
    struct cudaDeviceProp prop;
    size_t free_b = 0, total_b = 0;
    struct cuda_shard sh = {0};
    struct moed_cuda_src shard_src;
    const uint32_t n_routed = src->dims.n_experts; /* what batch ids are checked against */
    *out = NULL;
    /* more GPUs: engine_open opens one backend per GPU (expert parallelism) */
    if (cfg->n_gpus > 1)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "cuda backend: one GPU per backend (%d given)", cfg->n_gpus);
    if (src->n_layers == 0)
        return moed_seterr(err, errlen, MOED_E_MODEL, "cuda backend: the model has no MoE layers");
    if (cfg->ep_place) { /* a device of expert parallelism: its experts only */
        if ((rc = cuda_shard_open(src, cfg, &sh, &shard_src, err, errlen)))
            return rc;
        src = &shard_src;
    }
    cb = calloc(1, sizeof *cb);
    if (!cb) {
        cuda_shard_free(&sh);
        return moed_seterr(err, errlen, MOED_E_NOMEM, "cuda backend: out of memory");
    }
    pthread_mutex_init(&cb->mu, NULL);
    pthread_cond_init(&cb->cv, NULL);
    cb->base.ops = &cuda_ops;
    cb->base.done = done;
    cb->base.done_ctx = done_ctx;
    cb->d = src->dims;
    cb->d.max_tokens = cfg->max_tokens;
    cb->dev = cfg->n_gpus == 1 && cfg->gpus ? cfg->gpus[0] : 0;
    cb->deadline_ms = cfg->batch_deadline_ms;
    cb->progress = cfg->progress;
    cb->progress_ctx = cfg->progress_ctx;
    cb->idle_exit_ms = cfg->idle_exit_ms;
    cb->n_layers = src->n_layers;
    cb->ep_experts = n_routed;
    cb->ep_loc = sh.local; /* NULL: every expert placed */
    sh.local = NULL;
    cb->guard = __atomic_load_n(&g_test_guards, __ATOMIC_RELAXED) ? GUARD_BYTES : 0;
    if ((rc = cuda_dev_hold(cb, err, errlen)))
        goto cleanup;
    if ((rc = moe_gpu_check_dims(&cb->d, err, errlen)))
        goto cleanup;
    /* engine.max_tokens up to 16384 as on the CPU backend (the op cases run
     * 4096 and 16384 tokens, tiny-t16k; the daemon test test_max_tokens_16384
     * serves 16384); moe_gpu_check_dims bounds max_tokens * (k + S) by the
     * 16-bit routing tables. The clients split larger requests. */
    if (cfg->max_tokens > CUDA_MAX_TOKENS) {
        rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                         "cuda backend: engine.max_tokens %u is over the %u tokens per batch "
                         "this backend serves (the clients split larger requests)",
                         cfg->max_tokens, CUDA_MAX_TOKENS);
        goto cleanup;
    }

    /* layer id -> slot */
    uint32_t max_id = 0;
    for (uint32_t l = 0; l < src->n_layers; l++) {
        uint32_t id = src->layer_ids ? src->layer_ids[l] : l;
        if (id > max_id)
            max_id = id;
    }
    cb->n_slot_of = max_id + 1;
    cb->slot_of = malloc(sizeof(int32_t) * cb->n_slot_of);
    if (!cb->slot_of) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "cuda backend: out of memory");
        goto cleanup;
    }
    for (uint32_t i = 0; i < cb->n_slot_of; i++)
        cb->slot_of[i] = -1;
    for (uint32_t l = 0; l < src->n_layers; l++)
        cb->slot_of[src->layer_ids ? src->layer_ids[l] : l] = (int32_t)l;

    MOED_CUDA_TRY(cudaGetDeviceProperties(&prop, cb->dev));
    snprintf(cb->dev_name, sizeof cb->dev_name, "%s", prop.name);
    cb->n_sms = prop.multiProcessorCount;
    cuda_sharing_probe(cb, &prop);
    MOED_TRY(cuda_gpu_lock(cb, err, errlen));
    /* the SMs the kernel takes, and (under MPS, one backend on the GPU) a
     * context limited to them, made before anything of cb is allocated: an
     * allocation belongs to the context it was made in */
    int sms_free = cuda_sms_free(cb, cfg->sms_free, cfg->mps_sms_free_percent);
    if (cfg->sm_share > 1) { /* one of sm_share backends on this GPU: its share of the SMs */
        const int use = (cb->n_sms - sms_free) / (int)cfg->sm_share;
        sms_free = cb->n_sms - (use > 0 ? use : 1);
        LOG_I("cuda: GPU %d: one of %u backends on this GPU: its kernel takes %d SMs", cb->dev,
              cfg->sm_share, cb->n_sms - sms_free);
    } else if (!cfg->ep_place) {
        cuda_ctx_open(cb, cb->n_sms - sms_free);
    }
    MOED_CUDA_TRY(cuda_use(cb));
    if (cb->ctx) { /* the grid fills the context's SMs, as many as the driver granted */
        int seen = 0;
        MOED_CUDA_TRY(cudaDeviceGetAttribute(&seen, cudaDevAttrMultiProcessorCount, cb->dev));
        sms_free = seen > cb->ctx_sms ? seen - cb->ctx_sms : 0;
    }

    /* the kernel module and this build must agree on the host-device layout
     * (kernels/moe_gpu_abi.h) before anything is placed or launched */
    if ((rc = moe_gpu_abi_check(moe_gpu_kernel_abi(), err, errlen))) {
        LOG_E("%s", err);
        goto cleanup;
    }

    /* routing tables grow with max_tokens and live in shared memory */
    {
        int optin = 0;
        MOED_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, cb->dev));
        uint32_t need = moe_gpu_smem_bytes(&cb->d);
        if ((int)need > optin) {
            rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                             "cuda backend: engine.max_tokens %u needs %u bytes of shared memory "
                             "per CTA (routing tables + pipeline) but GPU %d allows %d; lower "
                             "engine.max_tokens", cb->d.max_tokens, need, cb->dev, optin);
            goto cleanup;
        }
    }

    /* fit: weights + scratch against free device memory */
    const uint32_t H = cb->d.hidden, I = cb->d.inter, NE = cb->d.n_experts + cb->d.n_shared;
    const uint64_t MT = cb->d.max_tokens, KS = cb->d.top_k + cb->d.n_shared, k = cb->d.top_k;
    const uint64_t h_bytes = MT * KS * I * 2; /* h: one bf16 row of I per (token, slot) */
    cb->weight_bytes = (moe_gpu_gu_bytes(H, I) + moe_gpu_dn_bytes(H, I)) * NE * cb->n_layers;
    cb->scratch_bytes = MT * H * 2 + MT * k * 8 + h_bytes + (MT * KS + 1) * H * 4 +
                        moe_gpu_state_bytes(&cb->d) + (uint64_t)sizeof(float) * 3 * NE * cb->n_layers +
                        /* routing tables: one region per CTA; 1024 bounds the grid
                         * (<= 16 warps per SM, >= 4 warps per CTA, <= 256 SMs) */
                        (uint64_t)moe_gpu_route_gmem_bytes(&cb->d) * 1024 +
                        2 * cb->guard * G_COUNT;
    MOED_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    const uint64_t margin = 256ull << 20;
    if (cb->weight_bytes + cb->scratch_bytes + margin > free_b) {
        rc = moed_seterr(err, errlen, MOED_E_NOFIT,
                         "cuda backend: GPU %d (%s) needs %.2f GiB (weights %.2f + scratch %.2f "
                         "+ 0.25 reserve) but has %.2f GiB free of %.2f",
                         cb->dev, cb->dev_name,
                         (cb->weight_bytes + cb->scratch_bytes + margin) / 1073741824.0,
                         cb->weight_bytes / 1073741824.0, cb->scratch_bytes / 1073741824.0,
                         free_b / 1073741824.0, total_b / 1073741824.0);
        goto cleanup;
    }
    LOG_I("cuda: GPU %d %s: placing %u layers, %.2f GiB of weights (%.2f GiB free)", cb->dev,
          cb->dev_name, cb->n_layers, cb->weight_bytes / 1073741824.0, free_b / 1073741824.0);

    if ((rc = cuda_place_weights(cb, src, err, errlen)))
        goto cleanup;
    MOED_CUDA_TRY(cudaMalloc(&cb->state, moe_gpu_state_bytes(&cb->d)));
    MOED_CUDA_TRY(cudaMemset(cb->state, 0, moe_gpu_state_bytes(&cb->d)));
    /* activation rows: the kernel's loads may pass the last row's end by up
     * to MOE_GPU_ROW_TAIL_BYTES (moe_gpu_abi.h) */
    MOED_TRY(scratch_alloc(cb, G_XS, (void **)&cb->xs, MT * H * 2 + MOE_GPU_ROW_TAIL_BYTES, err,
                           errlen));
    MOED_TRY(scratch_alloc(cb, G_IDS, (void **)&cb->ids_s, MT * k * 4, err, errlen));
    MOED_TRY(scratch_alloc(cb, G_W, (void **)&cb->w_s, MT * k * 4, err, errlen));
    MOED_TRY(scratch_alloc(cb, G_H, (void **)&cb->h, h_bytes + MOE_GPU_ROW_TAIL_BYTES, err, errlen));
    /* one more row than pairs: zeros, what an empty slot adds (route.cuh) */
    MOED_TRY(scratch_alloc(cb, G_DOUT, (void **)&cb->dout, (MT * KS + 1) * H * 4, err, errlen));
    MOED_CUDA_TRY(cudaMemset(cb->dout + MT * KS * H, 0, (size_t)H * 4));

    /* mapped host memory: control block + per-slot staging */
    MOED_CUDA_TRY(cudaHostAlloc((void **)&cb->ctrl, sizeof *cb->ctrl, cudaHostAllocMapped));
    memset(cb->ctrl, 0, sizeof *cb->ctrl);
    MOED_CUDA_TRY(cudaHostGetDevicePointer((void **)&cb->ctrl_d, cb->ctrl, 0));
    cb->off_ids = (MT * H * 2 + 255) & ~(size_t)255;
    cb->off_w = cb->off_ids + ((MT * k * 4 + 255) & ~(size_t)255);
    cb->off_y = cb->off_w + ((MT * k * 4 + 255) & ~(size_t)255);
    cb->slot_bytes = cb->off_y + ((MT * H * 2 + 255) & ~(size_t)255);
    MOED_CUDA_TRY(cudaHostAlloc((void **)&cb->stage, cb->slot_bytes * MOE_GPU_RING, cudaHostAllocMapped));
    MOED_CUDA_TRY(cudaHostGetDevicePointer((void **)&cb->stage_d, cb->stage, 0));
    if (cfg->sm_partition > 0 && !cb->ctx &&
        cuda_green_stream(cb, cb->n_sms - sms_free, (unsigned)cfg->sm_partition - 1,
                          &cb->stream) == 0)
        sms_free = cb->n_sms - cb->green_sms; /* the grid fills the partition */
    else
        MOED_CUDA_TRY(cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking));
    MOED_TRY(cuda_h_in_l2(cb, h_bytes, err, errlen));

    MOED_TRY(moe_gpu_plan(cb->dev, &cb->d, sms_free, &cb->launch, err, errlen));
    if (cb->ctx && cb->launch.sms != cb->ctx_sms)
        LOG_W("cuda: GPU %d: the kernel's grid spans %d SMs, its context %d", cb->dev,
              cb->launch.sms, cb->ctx_sms);
    MOED_TRY(scratch_alloc(cb, G_ROUTE, (void **)&cb->route_g,
                           (size_t)cb->launch.grid * moe_gpu_route_gmem_bytes(&cb->d), err, errlen));
    cb->params = (struct moe_gpu_params){
        .d = cb->d, .layers = cb->layers_d, .ctrl = cb->ctrl_d, .state = cb->state,
        .xs = cb->xs, .ids_s = cb->ids_s, .w_s = cb->w_s, .h = cb->h, .dout = cb->dout,
        .start_seq = 1, .smem_route = moe_gpu_smem_route_bytes(&cb->d),
        .route_g = cb->route_g};
    MOED_TRY(cuda_chan_setup(cb, cfg->max_channels, err, errlen));
    LOG_I("cuda: GPU %d: persistent kernel grid %d CTAs = %d/SM x %d SMs (%d left free), %d "
          "threads, %d B dynamic smem", cb->dev, cb->launch.grid, cb->launch.ctas_per_sm,
          cb->launch.sms, sms_free, cb->launch.block, cb->launch.smem_bytes);
    pthread_mutex_lock(&cb->mu);
    rc = launch_locked(cb, err, errlen);
    pthread_mutex_unlock(&cb->mu);
    if (rc)
        goto cleanup;
    MOED_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    cb->dev_used = total_b - free_b;
    cb->dev_total = total_b;
    if (pthread_create(&cb->thr, NULL, completion_thread, cb) != 0) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "cuda backend: cannot start completion thread");
        goto cleanup;
    }
    cb->thr_started = 1;
    LOG_I("cuda: GPU %d: ready; device memory used %.2f of %.2f GiB", cb->dev,
          cb->dev_used / 1073741824.0, cb->dev_total / 1073741824.0);
    cuda_shard_free(&sh);
    *out = &cb->base;
    return 0;
cleanup:
    if (cb) {
        if (cb->running && stop_kernel(cb, 2000) == 0)
            cb->running = 0;
        cuda_dev_release(cb, !cb->running);
    }
    cuda_shard_free(&sh);
    return rc;
}

uint64_t moed_backend_cuda_heartbeat(struct moed_backend *be)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    return moe_gpu_heartbeat(cb->ctrl);
}

void moed_backend_cuda_test_guards(int on)
{
    __atomic_store_n(&g_test_guards, on, __ATOMIC_RELAXED);
}
