/* backend_cpu.c - the CPU backend: one worker thread and a FIFO of batches.
 *
 * Each batch runs through moe_ref_forward on the model's layer; that function
 * already spreads one batch over all cores, so one worker thread (not one per
 * batch) keeps the machine busy without oversubscribing it. done() is called
 * from the worker thread, exactly once per accepted batch. close() stops
 * accepting, lets the worker finish everything queued, then joins it.
 *
 * MOED_BUF_PINNED buffers are host memory like MOED_BUF_HOST. The CPU backend
 * has no memory of its own to offer (host_alloc NULL), except with
 * the test switch MOED_TEST_CPU_HOST_ALLOC (test_hooks.h): then host_alloc hands out
 * page-aligned malloc'd memory, so that the daemon's pinned-buffer path
 * (buffer pool, MOED_BUF_PINNED batches, /status buffers) runs without a GPU.
 *
 * A batch's kernel_ns is 0 (not known: there is no kernel to time), except
 * with MOED_TEST_CPU_KERNEL_TIME, another test switch: then it is the time
 * moe_ref_forward took, so that the kernel stages of /status run without a GPU.
 *
 * Expert parallelism (backend_ep.c): a ROWS batch computes the expert
 * output rows of its entries into b->rows (moe_ref_rows), a COMBINE batch y
 * from them (moe_ref_combine). Opened as an EP child (cfg->ep_place), the
 * backend holds the placement and refuses (MOED_E_INVAL, logged naming the
 * expert and the device) a ROWS batch naming a routed expert that has no
 * replica on its device, or another device's shard. It computes a refused
 * expert as well as any other (every expert is in host memory): the check
 * keeps the CPU child as strict as a device that holds only its experts.
 *
 * The CPU backend has no doorbell channels (chan ops NULL), except with
 * MOED_TEST_CPU_CHANNELS: then fake ones take entries of a table of
 * engine.max_channels, serve nothing, report a closed entry quiet after
 * CPU_CHAN_QUIET_POLLS polls and count those polls as "served", so that the
 * daemon's channel lifetime and counters run without a GPU.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "moe_gpu_abi.h"
#include "moe_ref.h"
#include "placement.h"
#include "moed_err.h"
#include "moed_log.h"
#include "moed_util.h"
#include "test_hooks.h"

struct cpu_node {
    struct cpu_node *next;
    struct moed_batch *b;
};

#define CPU_MAX_PEERS 7 /* MOED_TEST_CPU_PEERS entries (a host of 8 GPUs) */

struct cpu_backend {
    struct moed_backend base; /* first: ops receive &base */
    struct moed_backend_ops ops; /* cpu_ops, plus host_alloc with cpu_host_alloc */
    struct moed_model *model;
    int n_threads;
    /* an EP child: the placement of each MoE layer (absolute id, n_layers
     * entries) and this device's index; NULL: not one */
    const struct moed_placement *const *ep_place;
    uint32_t ep_shard, n_layers;
    int kernel_time; /* MOED_TEST_CPU_KERNEL_TIME */
    int no_mps;      /* MOED_TEST_CPU_NO_MPS */
    /* MOED_TEST_CPU_PEERS: the other "GPUs" this process sees, ordinals
     * 1..n_peers (0 is the backend's own), each with or without peer access */
    uint32_t n_peers;
    uint8_t peer_uuid[CPU_MAX_PEERS][16];
    uint8_t peer_ok[CPU_MAX_PEERS];
    /* MOED_TEST_CPU_CHANNELS: per entry 0 free, 1 open, else closed with
     * chan_polls[i] polls to go; loop thread only */
    uint32_t max_chans, chan_opens;
    uint8_t chan_state[MOE_GPU_MAX_CHANS];
    uint32_t chan_polls[MOE_GPU_MAX_CHANS];
    uint64_t chan_count[MOE_GPU_MAX_CHANS]; /* chan_quiet polls since the entry's open */
    pthread_t worker;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct cpu_node *head, *tail;
    int stopping;
    uint64_t done_batches;
};

/* An EP child's check of a ROWS batch: its shard is this device, and every
 * routed id it names has a replica here. */
static int cpu_check_placed(const struct cpu_backend *cb, const struct moed_batch *b)
{
    const struct moed_placement *p = b->layer < cb->n_layers ? cb->ep_place[b->layer] : NULL;
    if (!p) {
        LOG_W("cpu backend (device %u): batch %llu: layer %u has no placement", cb->ep_shard,
              (unsigned long long)b->seq, b->layer);
        return MOED_E_INVAL;
    }
    if (b->ep_shard != cb->ep_shard || b->ep_n != p->n_dev) {
        LOG_W("cpu backend (device %u of %u): batch %llu is for device %u of %u", cb->ep_shard,
              p->n_dev, (unsigned long long)b->seq, b->ep_shard, b->ep_n);
        return MOED_E_INVAL;
    }
    const int32_t *ids = b->ids.ptr;
    for (size_t i = 0; i < (size_t)b->n_tokens * b->top_k; i++) {
        const int32_t e = ids[i];
        if (e < 0)
            continue;
        if ((uint32_t)e >= p->n_experts) {
            LOG_W("cpu backend (device %u): batch %llu: expert %d is not in the placement "
                  "(%u experts)", cb->ep_shard, (unsigned long long)b->seq, e, p->n_experts);
            return MOED_E_INVAL;
        }
        const uint8_t *dev = p->dev + (size_t)e * MOED_PLACE_MAX_REPLICAS;
        uint32_t r = 0;
        while (r < p->n_rep[e] && dev[r] != cb->ep_shard)
            r++;
        if (r == p->n_rep[e]) {
            LOG_W("cpu backend: batch %llu layer %u token %zu slot %zu: expert %d has no "
                  "replica on device %u", (unsigned long long)b->seq, b->layer,
                  i / b->top_k, i % b->top_k, e, cb->ep_shard);
            return MOED_E_INVAL;
        }
    }
    return 0;
}

/* One batch: forward, ROWS or COMBINE (backend.h). */
static int cpu_run(const struct cpu_backend *cb, const struct moed_batch *b)
{
    const struct moe_layer *layer = moed_model_layer(cb->model, b->layer);
    const unsigned ep = b->flags & (MOED_BATCH_ROWS | MOED_BATCH_COMBINE);
    if (!layer || ep == (MOED_BATCH_ROWS | MOED_BATCH_COMBINE) || !moed_buf_on_host(&b->ids))
        return MOED_E_INVAL;
    unsigned fl = MOE_REF_EMPTY_SLOTS; /* the engine validated every -1 */
    if (b->flags & MOED_BATCH_ROUTED_ONLY)
        fl |= MOE_REF_ROUTED_ONLY;
    if (ep) {
        const uint64_t need = (uint64_t)b->n_tokens * (layer->top_k + layer->n_shared) *
                              layer->hidden * sizeof(float);
        if (!moed_buf_on_host(&b->rows) || !b->rows.ptr || b->rows.bytes < need)
            return MOED_E_INVAL;
    }
    if (ep == MOED_BATCH_ROWS) {
        if (!moed_buf_on_host(&b->x))
            return MOED_E_INVAL;
        if (cb->ep_place) {
            int rc = cpu_check_placed(cb, b);
            if (rc)
                return rc;
        }
        return moe_ref_rows(layer, b->n_tokens, b->x.ptr, b->ids.ptr, b->rows.ptr, b->ep_n,
                            b->ep_shard, cb->n_threads, fl);
    }
    if (!moed_buf_on_host(&b->y) || !moed_buf_on_host(&b->w))
        return MOED_E_INVAL;
    if (ep == MOED_BATCH_COMBINE)
        return moe_ref_combine(layer, b->n_tokens, b->ids.ptr, b->w.ptr, b->rows.ptr, b->y.ptr,
                               fl);
    if (!moed_buf_on_host(&b->x))
        return MOED_E_INVAL;
    return moe_ref_forward_flags(layer, b->n_tokens, b->x.ptr, b->ids.ptr, b->w.ptr, b->y.ptr,
                                 cb->n_threads, fl);
}

static void *cpu_worker(void *arg)
{
    struct cpu_backend *cb = arg;
    for (;;) {
        pthread_mutex_lock(&cb->mu);
        while (!cb->head && !cb->stopping)
            pthread_cond_wait(&cb->cv, &cb->mu);
        struct cpu_node *n = cb->head;
        if (n) {
            cb->head = n->next;
            if (!cb->head)
                cb->tail = NULL;
        }
        pthread_mutex_unlock(&cb->mu);
        if (!n)
            break; /* stopping and the queue is empty */
        struct moed_batch *b = n->b;
        free(n);
        uint64_t t0 = cb->kernel_time ? moed_mono_ns() : 0;
        b->kernel_ns = 0;
        b->status = cpu_run(cb, b);
        if (cb->kernel_time && b->status == 0)
            b->kernel_ns = moed_mono_ns() - t0;
        __atomic_add_fetch(&cb->done_batches, 1, __ATOMIC_RELAXED);
        cb->base.done(cb->base.done_ctx, b);
    }
    return NULL;
}

static int cpu_submit(struct moed_backend *be, struct moed_batch *b)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    struct cpu_node *n = malloc(sizeof *n);
    if (!n)
        return MOED_E_NOMEM;
    n->next = NULL;
    n->b = b;
    pthread_mutex_lock(&cb->mu);
    if (cb->stopping) {
        pthread_mutex_unlock(&cb->mu);
        free(n);
        return MOED_E_SHUTDOWN;
    }
    if (cb->tail)
        cb->tail->next = n;
    else
        cb->head = n;
    cb->tail = n;
    pthread_cond_signal(&cb->cv);
    pthread_mutex_unlock(&cb->mu);
    return 0;
}

static int cpu_healthy(struct moed_backend *be)
{
    (void)be;
    return 1;
}

static void cpu_describe(struct moed_backend *be, char *buf, unsigned len)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(buf, len, "cpu: reference kernel, %d threads (%ld cores online)",
             cb->n_threads > 0 ? cb->n_threads : (int)cores, cores);
}

static void cpu_close(struct moed_backend *be)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    pthread_mutex_lock(&cb->mu);
    cb->stopping = 1;
    pthread_cond_signal(&cb->cv);
    pthread_mutex_unlock(&cb->mu);
    pthread_join(cb->worker, NULL);
    pthread_cond_destroy(&cb->cv);
    pthread_mutex_destroy(&cb->mu);
    free(cb);
}

static void *cpu_host_alloc(struct moed_backend *be, size_t bytes)
{
    (void)be;
    void *p = NULL;
    int rc = posix_memalign(&p, 4096, bytes ? bytes : 1);
    if (rc != 0) {
        LOG_W("cpu backend: host_alloc of %zu bytes failed: %s", bytes, strerror(rc));
        return NULL;
    }
    return p;
}

static void cpu_host_free(struct moed_backend *be, void *p)
{
    (void)be;
    free(p);
}

/* MOED_TEST_CPU_SHM_IPC (test_hooks.h): a "GPU" with a fixed UUID whose
 * "IPC handles" name POSIX shared memory objects, mapped whole, so that the
 * registered-buffer path runs end to end without a GPU. */
static int cpu_test_uuid(struct moed_backend *be, uint8_t uuid[16], int *mps)
{
    memcpy(uuid, MOED_TEST_CPU_UUID, 16);
    *mps = !((struct cpu_backend *)be)->no_mps;
    return 0;
}

static int cpu_test_ipc_open(struct moed_backend *be, const uint8_t handle[64],
                             struct moed_buf *out, char *err, size_t errlen)
{
    (void)be;
    char name[65];
    memcpy(name, handle, 64);
    name[64] = 0;
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0)
        return moed_seterr(err, errlen, MOED_E_IO, "the handle will not open: shm_open %.64s: %s",
                           name, strerror(errno));
    struct stat stt;
    void *p = MAP_FAILED;
    if (fstat(fd, &stt) == 0 && stt.st_size > 0)
        p = mmap(NULL, (size_t)stt.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return moed_seterr(err, errlen, MOED_E_IO, "the handle will not open: mmap %.64s failed",
                           name);
    *out = (struct moed_buf){MOED_BUF_HOST, 0, p, (uint64_t)stt.st_size};
    return 0;
}

static void cpu_test_ipc_close(struct moed_backend *be, const struct moed_buf *m)
{
    (void)be;
    munmap(m->ptr, (size_t)m->bytes);
}

/* MOED_TEST_CPU_PEERS (test_hooks.h): "UUID[!],UUID[!]..." into cb; an
 * entry that is not 16 characters (and an optional '!') ends the list. */
static void cpu_test_peers_parse(struct cpu_backend *cb, const char *v)
{
    while (v && cb->n_peers < CPU_MAX_PEERS && strlen(v) >= 16) {
        memcpy(cb->peer_uuid[cb->n_peers], v, 16);
        v += 16;
        cb->peer_ok[cb->n_peers] = *v != '!';
        v += *v == '!';
        if (*v != ',' && *v != 0)
            break;
        cb->n_peers++;
        v += *v == ',';
    }
}

/* The stand-in of the CUDA backend's peer_gpu (backend_ipc_cuda.c), with
 * the same reasons. */
static int cpu_test_peer_gpu(struct moed_backend *be, const uint8_t uuid[16], char *err,
                             size_t errlen)
{
    const struct cpu_backend *cb = (const struct cpu_backend *)be;
    for (uint32_t i = 0; i < cb->n_peers; i++)
        if (memcmp(cb->peer_uuid[i], uuid, 16) == 0)
            return cb->peer_ok[i] ? (int)i + 1
                                  : moed_seterr(err, errlen, MOED_E_INVAL, MOED_PEER_NO_ACCESS,
                                                0, (int)i + 1);
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    return moed_seterr(err, errlen, MOED_E_INVAL, MOED_PEER_NOT_VISIBLE, (int)cb->n_peers + 1,
                       vis ? vis : "unset");
}

/* MOED_TEST_CPU_CHANNELS (test_hooks.h): channel entries that serve
 * nothing; the "handle" names the entry, the "fatbin" is a fixed string, an
 * arena is only reported (at MOE_GPU_CHAN_ARENA_OFF), not allocated. */
#define CPU_CHAN_QUIET_POLLS 3
static const char cpu_chan_kernel[] = "moed-cpu-test-kernel";

static int cpu_chan_open(struct moed_backend *be, const struct moed_chan_buf *bufs,
                         uint32_t n_bufs, uint64_t arena_bytes, struct moed_chan_info *out,
                         char *err, size_t errlen)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    uint32_t i = 0;
    while (i < cb->max_chans && cb->chan_state[i] != 0)
        i++;
    if (i == cb->max_chans)
        return moed_seterr(err, errlen, MOED_E_BUSY,
                           "all %u channel entries are taken (engine.max_channels; a closed "
                           "channel holds its entry until the kernel lets go of it)",
                           cb->max_chans);
    for (uint32_t k = 0; k < n_bufs; k++)
        if (!bufs[k].ptr || !bufs[k].size)
            return moed_seterr(err, errlen, MOED_E_INVAL, "channel buffer %u is empty", k);
    cb->chan_state[i] = 1;
    cb->chan_count[i] = 0;
    *out = (struct moed_chan_info){.index = i, .key = ((uint64_t)++cb->chan_opens << 8) | i,
                                   .size = sizeof(struct moe_gpu_chan),
                                   .kernel = cpu_chan_kernel,
                                   .kernel_bytes = sizeof cpu_chan_kernel - 1,
                                   /* an arena is reported, not allocated: nothing is served */
                                   .arena_off = arena_bytes ? MOE_GPU_CHAN_ARENA_OFF : 0,
                                   .arena_bytes = arena_bytes};
    snprintf((char *)out->handle, sizeof out->handle, "moed-cpu-test-chan-%u", i);
    return 0;
}

static void cpu_chan_close(struct moed_backend *be, uint32_t index)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    cb->chan_state[index] = 2;
    cb->chan_polls[index] = CPU_CHAN_QUIET_POLLS;
}

static int cpu_chan_quiet(struct moed_backend *be, uint32_t index)
{
    struct cpu_backend *cb = (struct cpu_backend *)be;
    cb->chan_count[index]++;
    if (cb->chan_state[index] == 2 && --cb->chan_polls[index] == 0)
        cb->chan_state[index] = 0;
    return cb->chan_state[index] == 0;
}

/* Nothing is served through a CPU channel: its "counters" are the
 * chan_quiet polls since it opened (served, 1 us of kernel time each;
 * refused 0), so that a test sees a closed channel's final counts kept:
 * CPU_CHAN_QUIET_POLLS per channel once reaped. */
static void cpu_chan_stats(struct moed_backend *be, uint32_t index, struct moed_chan_stats *out)
{
    const uint64_t n = ((struct cpu_backend *)be)->chan_count[index];
    *out = (struct moed_chan_stats){.served = n, .kernel_ns = 1000 * n, .last = n << 8};
}

static const struct moed_backend_ops cpu_ops = {
    .name = "cpu",
    .submit = cpu_submit,
    .healthy = cpu_healthy,
    .describe = cpu_describe,
    .close = cpu_close,
};

int moed_backend_cpu_open(struct moed_model *m, const struct moed_backend_cfg *cfg,
                          moed_backend_done_fn done, void *done_ctx,
                          struct moed_backend **out, char *err, size_t errlen)
{
    *out = NULL;
    struct cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "cpu backend: out of memory");
    cb->ops = cpu_ops;
    int host_alloc = moed_test_switch(MOED_TEST_CPU_HOST_ALLOC);
    if (host_alloc) {
        cb->ops.host_alloc = cpu_host_alloc;
        cb->ops.host_free = cpu_host_free;
    }
    int shm_ipc = moed_test_switch(MOED_TEST_CPU_SHM_IPC);
    if (shm_ipc) {
        cb->ops.device_uuid = cpu_test_uuid;
        cb->ops.ipc_open = cpu_test_ipc_open;
        cb->ops.ipc_close = cpu_test_ipc_close;
        cpu_test_peers_parse(cb, getenv(MOED_TEST_CPU_PEERS));
        if (cb->n_peers)
            cb->ops.peer_gpu = cpu_test_peer_gpu;
    }
    cb->no_mps = moed_test_switch(MOED_TEST_CPU_NO_MPS);
    cb->ops.completes_in_us = moed_test_switch(MOED_TEST_CPU_SPIN);
    int chans = moed_test_switch(MOED_TEST_CPU_CHANNELS);
    if (chans) {
        cb->max_chans = cfg->max_channels < MOE_GPU_MAX_CHANS ? cfg->max_channels
                                                               : MOE_GPU_MAX_CHANS;
        cb->ops.chan_open = cpu_chan_open;
        cb->ops.chan_close = cpu_chan_close;
        cb->ops.chan_quiet = cpu_chan_quiet;
        cb->ops.chan_stats = cpu_chan_stats;
    }
    cb->base.ops = &cb->ops;
    cb->base.done = done;
    cb->base.done_ctx = done_ctx;
    cb->model = m;
    cb->n_threads = cfg->n_threads;
    cb->ep_place = cfg->ep_place;
    cb->ep_shard = cfg->ep_shard;
    cb->n_layers = cfg->ep_place ? moed_model_dims(m)->n_layers : 0;
    cb->kernel_time = moed_test_switch(MOED_TEST_CPU_KERNEL_TIME);
    pthread_mutex_init(&cb->mu, NULL);
    pthread_cond_init(&cb->cv, NULL);
    int rc = pthread_create(&cb->worker, NULL, cpu_worker, cb);
    if (rc != 0) {
        pthread_cond_destroy(&cb->cv);
        pthread_mutex_destroy(&cb->mu);
        free(cb);
        return moed_seterr(err, errlen, MOED_E_BACKEND, "cpu backend: pthread_create: error %d", rc);
    }
    LOG_I("cpu backend: worker started (%d compute threads, 0 = all cores)%s%s%s%s",
          cfg->n_threads, host_alloc ? "; host_alloc on (" MOED_TEST_CPU_HOST_ALLOC ")" : "",
          shm_ipc ? "; shared-memory \"IPC handles\" (" MOED_TEST_CPU_SHM_IPC ")" : "",
          chans ? "; fake doorbell channels (" MOED_TEST_CPU_CHANNELS ")" : "",
          cb->kernel_time ? "; compute time reported as kernel time (" MOED_TEST_CPU_KERNEL_TIME ")"
                          : "");
    *out = &cb->base;
    return 0;
}
