/* backend_nccl_cuda.c - the NCCL group of daemons (nccl_group.h): forming
 * it, rank 0's peers (children of the EP backend) and the worker backend of
 * rank r > 0.
 *
 * Threads and the communicator. NCCL calls on one communicator must not run
 * from two threads at once, and after ncclCommAbort nothing may touch it:
 * every call (the sends and receives of an exchange, ncclCommGetAsyncError)
 * is made under the group's mutex `mu`, and `failed` (set under it, once)
 * means the communicator is gone: no call touches it after. Waiting for an
 * exchange is not done under mu: the caller polls its event, takes mu only
 * to ask NCCL for an asynchronous error, and fails the group at its
 * deadline. A failure hands the abort to a thread of its own
 * (grp_abort_locked): ncclCommAbort frees NCCL's host buffers, which waits
 * for every kernel of the process, so with this process's persistent
 * kernel resident it returns only once the daemon's close has stopped that
 * kernel; the failing thread returns at once and its batch fails now.
 *
 * Rank 0 runs one thread per peer (the exchanges of peer r, its pings);
 * rank r > 0 one thread, the worker loop: receive a header, check it, run
 * the batch on the local device, answer.
 */
#include <cuda_runtime.h>
/* nccl.h declares ncclGroupStart() and friends without (void) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend_cuda.h"
#include "moe_gpu.h"
#include "moed_check_cuda.h"
#include "moed_err.h"
#include "moed_log.h"
#include "nccl_group.h"
#include "placement.h"

_Static_assert(NCCL_UNIQUE_ID_BYTES == MOED_NCCL_ID_BYTES, "ncclUniqueId size");

_Static_assert(sizeof(struct moed_nccl_hdr) == 64, "moed_nccl_hdr is 64 bytes");

struct moed_nccl_group {
    ncclComm_t comm;
    int gpu;
    uint32_t ranks, rank, timeout_ms, keepalive_ms, max_tokens;
    uint32_t H, k, S;
    const struct moed_model *model;
    pthread_mutex_t mu;
    atomic_int failed; /* written under mu */
    pthread_t aborter; /* grp_abort_locked's thread, joined by grp_abort_join */
    int aborter_started;
    ncclComm_t aborting; /* what it aborts (g->comm may be cleared meanwhile) */
    char id_path[4096]; /* the file rank 0 wrote ("" none) */
};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void nap(unsigned round)
{
    if (round < 64) {
        sched_yield();
        return;
    }
    const struct timespec ts = {0, round < 1024 ? 20 * 1000 : 200 * 1000};
    nanosleep(&ts, NULL);
}

static void *aborter_main(void *arg)
{
    struct moed_nccl_group *g = arg;
    (void)cudaSetDevice(g->gpu);
    (void)ncclCommAbort(g->aborting);
    return NULL;
}

/* Abort the communicator on a thread of its own (the header comment says
 * why), inline if none can be started. Under mu, with failed set. */
static void grp_abort_locked(struct moed_nccl_group *g)
{
    if (g->aborter_started)
        return;
    g->aborting = g->comm;
    if (pthread_create(&g->aborter, NULL, aborter_main, g) == 0)
        g->aborter_started = 1;
    else
        (void)ncclCommAbort(g->comm);
}

/* Wait for grp_abort_locked's thread (before g is freed). */
static void grp_abort_join(struct moed_nccl_group *g)
{
    if (g->aborter_started)
        pthread_join(g->aborter, NULL);
    g->aborter_started = 0;
}

/* The group fails for good: log why, abort the communicator. Under mu. */
static void grp_fail_locked(struct moed_nccl_group *g, const char *fmt, ...)
{
    if (atomic_load(&g->failed))
        return;
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    LOG_E("nccl: rank %u of %u: %s; aborting the communicator, the backend is unhealthy", g->rank,
          g->ranks, why);
    atomic_store(&g->failed, 1);
    grp_abort_locked(g);
}

/* Settle a non-blocking call's result: poll ncclCommGetAsyncError while it
 * is in progress, up to deadline. 0 or MOED_E_BACKEND / MOED_E_TIMEOUT
 * (the group failed). Under mu. */
static int grp_settle_locked(struct moed_nccl_group *g, ncclResult_t r, uint64_t deadline,
                             const char *what)
{
    for (unsigned i = 0; r == ncclInProgress; i++) {
        if (now_ms() > deadline) {
            grp_fail_locked(g, "%s: still in progress after engine.nccl_timeout_ms (%u ms)", what,
                            g->timeout_ms);
            return MOED_E_TIMEOUT;
        }
        nap(i);
        if (ncclCommGetAsyncError(g->comm, &r) != ncclSuccess)
            r = ncclInternalError;
    }
    if (r != ncclSuccess) {
        grp_fail_locked(g, "%s: NCCL %s (%s)", what, ncclGetErrorString(r),
                        ncclGetLastError(g->comm));
        return MOED_E_BACKEND;
    }
    return 0;
}

/* Wait for ev until deadline, asking NCCL for asynchronous errors meanwhile.
 * *stop (may be NULL) set: MOED_E_SHUTDOWN at once. */
static int grp_wait(struct moed_nccl_group *g, cudaEvent_t ev, uint64_t deadline,
                    const atomic_int *stop, const char *what)
{
    for (unsigned i = 0;; i++) {
        const cudaError_t q = cudaEventQuery(ev);
        if (q == cudaSuccess)
            return 0;
        pthread_mutex_lock(&g->mu);
        int rc = 0;
        if (atomic_load(&g->failed)) {
            rc = MOED_E_BACKEND;
        } else if (q != cudaErrorNotReady) {
            grp_fail_locked(g, "%s: CUDA %s", what, cudaGetErrorString(q));
            rc = MOED_E_BACKEND;
        } else {
            ncclResult_t st = ncclSuccess;
            if (ncclCommGetAsyncError(g->comm, &st) != ncclSuccess)
                st = ncclInternalError;
            if (st != ncclSuccess && st != ncclInProgress) {
                grp_fail_locked(g, "%s: NCCL %s (%s)", what, ncclGetErrorString(st),
                                ncclGetLastError(g->comm));
                rc = MOED_E_BACKEND;
            } else if (now_ms() > deadline) {
                grp_fail_locked(g, "%s: not done within engine.nccl_timeout_ms (%u ms): the peer "
                                "stopped answering", what, g->timeout_ms);
                rc = MOED_E_TIMEOUT;
            }
        }
        pthread_mutex_unlock(&g->mu);
        if (rc)
            return rc;
        if (stop && atomic_load(stop))
            return MOED_E_SHUTDOWN;
        nap(i);
    }
}

struct xfer {
    int send;
    void *buf;
    size_t bytes;
};

/* One exchange with rank `peer`: each send or receive on its own, in
 * order on `st`, each in an NCCL group of its own (the other side posts the
 * same messages with the same sizes in the same order: NCCL matches them one
 * by one; several to one peer in one group, the other side's grouped
 * otherwise, came apart over the socket transport: "Message truncated"), then
 * wait for all of them (timeout_ms from now). */
static int grp_xfer(struct moed_nccl_group *g, uint32_t peer, const struct xfer *x, int n,
                    cudaStream_t st, cudaEvent_t ev, const atomic_int *stop, const char *what)
{
    const uint64_t deadline = now_ms() + g->timeout_ms;
    pthread_mutex_lock(&g->mu);
    if (atomic_load(&g->failed)) {
        pthread_mutex_unlock(&g->mu);
        return MOED_E_BACKEND;
    }
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        /* a group of one: a bare ncclSend / ncclRecv on a non-blocking
         * communicator may report success before its kernel is enqueued
         * (NVIDIA/nccl#1495); the first connection is grp_connect's */
        ncclResult_t r = ncclGroupStart();
        if (r == ncclSuccess)
            r = x[i].send ? ncclSend(x[i].buf, x[i].bytes, ncclUint8, (int)peer, g->comm, st)
                          : ncclRecv(x[i].buf, x[i].bytes, ncclUint8, (int)peer, g->comm, st);
        const ncclResult_t e = ncclGroupEnd();
        rc = grp_settle_locked(g, r == ncclSuccess || r == ncclInProgress ? e : r, deadline, what);
    }
    if (!rc) {
        const cudaError_t c = cudaEventRecord(ev, st);
        if (c != cudaSuccess) {
            grp_fail_locked(g, "%s: cudaEventRecord: %s", what, cudaGetErrorString(c));
            rc = MOED_E_BACKEND;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return rc ? rc : grp_wait(g, ev, deadline, stop, what);
}

/* ---------------- forming the group ---------------- */

/* Connect every pair the group uses (rank 0 with each worker) both ways in
 * one NCCL group each side, before any exchange: a first lone send (or
 * receive) on a non-blocking communicator never finished connecting over
 * the socket transport (H200, NCCL 2.28, two ranks as two hosts), while a
 * group with both directions did. 64 bytes each way. */
static int grp_connect(struct moed_nccl_group *g, char *err, size_t errlen)
{
    int rc = 0;
    void *buf = NULL;
    cudaStream_t st = NULL;
    cudaEvent_t ev = NULL;
    MOED_CUDA_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    MOED_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    MOED_CUDA_TRY(cudaMalloc(&buf, 128));
    MOED_CUDA_TRY(cudaMemsetAsync(buf, 0, 128, st));
    for (uint32_t r = 0; r < g->ranks && !rc; r++) {
        if (r == g->rank || (g->rank != 0 && r != 0))
            continue;
        const uint64_t deadline = now_ms() + g->timeout_ms;
        pthread_mutex_lock(&g->mu);
        ncclResult_t x = ncclGroupStart();
        if (x == ncclSuccess)
            x = ncclSend(buf, 64, ncclUint8, (int)r, g->comm, st);
        if (x == ncclSuccess || x == ncclInProgress)
            x = ncclRecv((char *)buf + 64, 64, ncclUint8, (int)r, g->comm, st);
        const ncclResult_t e = ncclGroupEnd();
        rc = grp_settle_locked(g, x == ncclSuccess || x == ncclInProgress ? e : x, deadline,
                               "connecting to a peer");
        if (!rc && cudaEventRecord(ev, st) != cudaSuccess) {
            grp_fail_locked(g, "connecting to a peer: cudaEventRecord failed");
            rc = MOED_E_BACKEND;
        }
        pthread_mutex_unlock(&g->mu);
        if (!rc)
            rc = grp_wait(g, ev, deadline, NULL, "connecting to a peer");
        if (rc)
            rc = moed_seterr(err, errlen, rc, "nccl: rank %u could not connect to rank %u within "
                             "engine.nccl_timeout_ms (%u ms); NCCL's reason in the log", g->rank,
                             r, g->timeout_ms);
    }
cleanup:
    if (st)
        cudaStreamDestroy(st);
    if (ev)
        cudaEventDestroy(ev);
    cudaFree(buf);
    return rc;
}


int moed_nccl_open(const struct moed_model *m, const struct moed_nccl_cfg *cfg,
                   struct moed_nccl_group **out, char *err, size_t errlen)
{
    int rc = 0;
    *out = NULL;
    if (cfg->ranks < 2 || cfg->ranks > MOED_PLACE_MAX_DEVS || cfg->rank >= cfg->ranks ||
        cfg->keepalive_ms >= cfg->timeout_ms || cfg->max_tokens < 1)
        return moed_seterr(err, errlen, MOED_E_CONFIG, "nccl: rank %u of %u ranks: bad group",
                           cfg->rank, cfg->ranks);
    struct moed_nccl_group *g = calloc(1, sizeof *g);
    if (!g)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "nccl: out of memory");
    pthread_mutex_init(&g->mu, NULL);
    const struct moed_dims *d = moed_model_dims(m);
    g->model = m;
    g->gpu = cfg->gpu;
    g->ranks = cfg->ranks;
    g->rank = cfg->rank;
    g->timeout_ms = cfg->timeout_ms;
    g->keepalive_ms = cfg->keepalive_ms;
    g->max_tokens = cfg->max_tokens;
    g->H = d->hidden;
    g->k = d->top_k;
    g->S = d->n_shared;
    MOED_CUDA_TRY(cudaSetDevice(cfg->gpu));
    ncclUniqueId id;
    const int from_file = cfg->id_file && cfg->id_file[0];
    if (!from_file && !getenv("NCCL_COMM_ID")) {
        rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                         "engine.nccl_ranks %u: engine.nccl_id_file is empty and NCCL_COMM_ID is "
                         "not set; give every rank one of them (docs/MULTI_GPU.md)", cfg->ranks);
        goto cleanup;
    }
    if (!from_file || cfg->rank == 0)
        MOED_NCCL_TRY(ncclGetUniqueId(&id)); /* NCCL_COMM_ID: its address, on every rank */
    if (from_file && cfg->rank == 0) {
        MOED_TRY(moed_nccl_id_write(cfg->id_file, (const uint8_t *)id.internal, err, errlen));
        snprintf(g->id_path, sizeof g->id_path, "%s", cfg->id_file);
        LOG_I("nccl: rank 0 of %u: the group's id is in %s", cfg->ranks, cfg->id_file);
    } else if (from_file) {
        LOG_I("nccl: rank %u of %u: waiting up to %u ms for the group's id in %s", cfg->rank,
              cfg->ranks, cfg->timeout_ms, cfg->id_file);
        MOED_TRY(moed_nccl_id_read(cfg->id_file, cfg->timeout_ms, (uint8_t *)id.internal, err,
                                   errlen));
    }
    ncclConfig_t nc = NCCL_CONFIG_INITIALIZER;
    nc.blocking = 0;
    const uint64_t t0 = now_ms(), deadline = t0 + cfg->timeout_ms;
    ncclResult_t r = ncclCommInitRankConfig(&g->comm, (int)cfg->ranks, id, (int)cfg->rank, &nc);
    if (r != ncclSuccess && r != ncclInProgress) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "nccl: rank %u of %u: "
                         "ncclCommInitRankConfig: %s (%s)", cfg->rank, cfg->ranks,
                         ncclGetErrorString(r), g->comm ? ncclGetLastError(g->comm) : "");
        if (g->comm)
            (void)ncclCommAbort(g->comm);
        g->comm = NULL;
        goto cleanup;
    }
    pthread_mutex_lock(&g->mu);
    rc = grp_settle_locked(g, r, deadline, "forming the group");
    pthread_mutex_unlock(&g->mu);
    if (rc) {
        rc = moed_seterr(err, errlen, rc,
                         rc == MOED_E_TIMEOUT
                             ? "nccl: rank %u of %u: the group did not form within "
                               "engine.nccl_timeout_ms (%u ms): a rank not started, a stale "
                               "engine.nccl_id_file, or no network path NCCL can use between "
                               "them (NCCL_SOCKET_IFNAME)"
                             : "nccl: rank %u of %u: forming the group failed (NCCL's reason in "
                               "the log; %u ms)",
                         cfg->rank, cfg->ranks, cfg->timeout_ms);
        g->comm = NULL; /* aborted */
        goto cleanup;
    }
    if ((rc = grp_connect(g, err, errlen))) {
        if (!atomic_load(&g->failed))
            (void)ncclCommAbort(g->comm);
        g->comm = NULL;
        goto cleanup;
    }
    LOG_I("nccl: rank %u of %u on GPU %d: group formed in %llu ms (NCCL %d)", cfg->rank,
          cfg->ranks, cfg->gpu, (unsigned long long)(now_ms() - t0), NCCL_VERSION_CODE);
    *out = g;
    return 0;
cleanup:
    grp_abort_join(g);
    if (g->id_path[0])
        unlink(g->id_path);
    pthread_mutex_destroy(&g->mu);
    free(g);
    return rc;
}

void moed_nccl_close(struct moed_nccl_group *g)
{
    if (!g)
        return;
    pthread_mutex_lock(&g->mu);
    if (!atomic_load(&g->failed))
        (void)ncclCommAbort(g->comm); /* local: a dead peer cannot hold it up */
    atomic_store(&g->failed, 1);
    pthread_mutex_unlock(&g->mu);
    grp_abort_join(g); /* a failure's abort: the kernels it waited for are gone now */
    if (g->id_path[0])
        unlink(g->id_path);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

/* ---------------- device buffers of one side ---------------- */

struct link {
    cudaStream_t st;
    cudaEvent_t ev;
    struct moed_nccl_hdr *hdr_d, *hdr_h; /* [2] each: what goes out, what comes in */
    void *ids_d, *x_d, *slab_d;
    uint32_t *ent_d, *ent_h;        /* rank 0: the entries rank r computes */
};

/* aborted: the communicator failed or was aborted at close. Its operations
 * still queued on the stream may not have started (a kernel that finds no
 * SM free waits), and freeing memory waits for the device: the buffers are
 * then left to the process's exit instead. */
static void link_free(struct link *l, int aborted)
{
    if (!aborted) {
        cudaFree(l->hdr_d);
        cudaFree(l->ids_d);
        cudaFree(l->x_d);
        cudaFree(l->slab_d);
        cudaFree(l->ent_d);
        cudaFreeHost(l->hdr_h);
        cudaFreeHost(l->ent_h);
    }
    if (l->ev)
        cudaEventDestroy(l->ev);
    if (l->st)
        cudaStreamDestroy(l->st);
    memset(l, 0, sizeof *l);
}

static int link_alloc(const struct moed_nccl_group *g, struct link *l, int entries, char *err,
                      size_t errlen)
{
    int rc = 0;
    const size_t T = g->max_tokens, KS = g->k + g->S;
    MOED_CUDA_TRY(cudaSetDevice(g->gpu));
    MOED_CUDA_TRY(cudaStreamCreateWithFlags(&l->st, cudaStreamNonBlocking));
    MOED_CUDA_TRY(cudaEventCreateWithFlags(&l->ev, cudaEventDisableTiming));
    MOED_CUDA_TRY(cudaMalloc((void **)&l->hdr_d, 2 * sizeof(struct moed_nccl_hdr)));
    MOED_CUDA_TRY(cudaMallocHost((void **)&l->hdr_h, 2 * sizeof(struct moed_nccl_hdr)));
    MOED_CUDA_TRY(cudaMalloc(&l->ids_d, T * g->k * sizeof(int32_t)));
    MOED_CUDA_TRY(cudaMalloc(&l->x_d, T * g->H * 2));
    if (entries) {
        MOED_CUDA_TRY(cudaMalloc(&l->slab_d, T * KS * g->H * sizeof(float)));
        MOED_CUDA_TRY(cudaMalloc((void **)&l->ent_d, T * KS * sizeof(uint32_t)));
        MOED_CUDA_TRY(cudaMallocHost((void **)&l->ent_h, T * KS * sizeof(uint32_t)));
    }
cleanup:
    if (rc)
        link_free(l, 0);
    return rc;
}

/* A small copy on the link's stream, waited for: never the legacy default
 * stream, which would wait for every blocking stream of the context. */
static cudaError_t link_copy(struct link *l, void *dst, const void *src, size_t n,
                             enum cudaMemcpyKind kind)
{
    cudaError_t c = cudaMemcpyAsync(dst, src, n, kind, l->st);
    return c == cudaSuccess ? cudaStreamSynchronize(l->st) : c;
}

/* ---------------- rank 0: a peer ---------------- */

struct nccl_peer {
    struct moed_backend base; /* first */
    struct moed_nccl_group *g;
    uint32_t r;
    struct link l;
    pthread_t th;
    int th_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct moed_batch *job; /* under mu */
    int stopping;           /* under mu */
};

static int peer_batch(struct nccl_peer *p, struct moed_batch *b)
{
    struct moed_nccl_group *g = p->g;
    struct link *l = &p->l;
    const uint32_t T = b->n_tokens, KS = g->k + g->S;
    int rc = 0;
    char err[256];
    const size_t errlen = sizeof err;
    *l->hdr_h = (struct moed_nccl_hdr){.magic = MOED_NCCL_MAGIC, .kind = MOED_NCCL_BATCH,
                                       .seq = b->seq, .layer = b->layer, .n_tokens = T,
                                       .flags = b->flags, .ep_n = b->ep_n,
                                       .ep_shard = b->ep_shard};
    const uint32_t n = moed_nccl_rows_entries(b, g->k, g->S, l->ent_h);
    MOED_CUDA_TRY(cudaSetDevice(g->gpu));
    MOED_CUDA_TRY(cudaMemcpyAsync(l->hdr_d, l->hdr_h, sizeof *l->hdr_h, cudaMemcpyHostToDevice,
                                  l->st));
    MOED_CUDA_TRY(cudaMemcpyAsync(l->ids_d, b->ids.ptr, (size_t)T * g->k * 4, cudaMemcpyDefault,
                                  l->st));
    MOED_CUDA_TRY(cudaMemcpyAsync(l->x_d, b->x.ptr, (size_t)T * g->H * 2, cudaMemcpyDefault,
                                  l->st));
    MOED_CUDA_TRY(cudaMemcpyAsync(l->ent_d, l->ent_h, (size_t)n * 4, cudaMemcpyHostToDevice,
                                  l->st));
    const struct xfer x[] = {
        {1, l->hdr_d, sizeof(struct moed_nccl_hdr)},
        {1, l->ids_d, (size_t)T * g->k * 4},
        {1, l->x_d, (size_t)T * g->H * 2},
        {0, l->hdr_d + 1, sizeof(struct moed_nccl_hdr)},
        {0, l->slab_d, (size_t)T * KS * g->H * 4},
    };
    rc = grp_xfer(g, p->r, x, 5, l->st, l->ev, NULL, "a batch's exchange with its peer");
    if (rc)
        return rc;
    MOED_CUDA_TRY(link_copy(l, l->hdr_h + 1, l->hdr_d + 1, sizeof *l->hdr_h,
                            cudaMemcpyDeviceToHost));
    const struct moed_nccl_hdr *a = l->hdr_h + 1;
    if (a->magic != MOED_NCCL_MAGIC || a->kind != MOED_NCCL_REPLY || a->seq != b->seq) {
        pthread_mutex_lock(&g->mu);
        grp_fail_locked(g, "rank %u answered batch %llu with a bad header (magic %08x, kind %u, "
                        "seq %llu)", p->r, (unsigned long long)b->seq, a->magic, a->kind,
                        (unsigned long long)a->seq);
        pthread_mutex_unlock(&g->mu);
        return MOED_E_BACKEND;
    }
    if (a->status) {
        LOG_W("nccl: rank %u failed its part of batch %llu: %s", p->r,
              (unsigned long long)b->seq, moed_strerror(a->status));
        return a->status < 0 && a->status > -MOED_E__COUNT ? a->status : MOED_E_BACKEND;
    }
    MOED_TRY(moe_gpu_rows_merge(b->rows.ptr, l->slab_d, l->ent_d, n, g->H, l->st, err, errlen));
    MOED_CUDA_TRY(cudaStreamSynchronize(l->st));
    b->kernel_ns = a->kernel_ns;
cleanup:
    return rc;
}

/* A ping: header out, header back. */
static int peer_ping(struct nccl_peer *p, uint32_t kind)
{
    struct link *l = &p->l;
    *l->hdr_h = (struct moed_nccl_hdr){.magic = MOED_NCCL_MAGIC, .kind = kind};
    if (cudaMemcpyAsync(l->hdr_d, l->hdr_h, sizeof *l->hdr_h, cudaMemcpyHostToDevice, l->st) !=
        cudaSuccess)
        return MOED_E_BACKEND;
    const struct xfer x[] = {{1, l->hdr_d, sizeof(struct moed_nccl_hdr)},
                             {0, l->hdr_d + 1, sizeof(struct moed_nccl_hdr)}};
    return grp_xfer(p->g, p->r, x, kind == MOED_NCCL_STOP ? 1 : 2, l->st, l->ev, NULL,
                    kind == MOED_NCCL_STOP ? "telling a worker the group ends"
                                           : "a keepalive ping");
}

static void *peer_thread(void *arg)
{
    struct nccl_peer *p = arg;
    (void)cudaSetDevice(p->g->gpu);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (!p->job && !p->stopping) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            const uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)p->g->keepalive_ms * 1000000u;
            ts.tv_sec += (time_t)(ns / 1000000000u);
            ts.tv_nsec = (long)(ns % 1000000000u);
            if (pthread_cond_timedwait(&p->cv, &p->mu, &ts) != 0 && !p->job && !p->stopping &&
                !atomic_load(&p->g->failed)) {
                pthread_mutex_unlock(&p->mu);
                (void)peer_ping(p, MOED_NCCL_PING); /* a failure fails the group (logged) */
                pthread_mutex_lock(&p->mu);
            }
            continue;
        }
        if (p->job) {
            struct moed_batch *b = p->job;
            pthread_mutex_unlock(&p->mu);
            b->status = peer_batch(p, b);
            pthread_mutex_lock(&p->mu);
            p->job = NULL;
            pthread_mutex_unlock(&p->mu);
            p->base.done(p->base.done_ctx, b);
            pthread_mutex_lock(&p->mu);
            continue;
        }
        break; /* stopping, nothing queued */
    }
    pthread_mutex_unlock(&p->mu);
    if (!atomic_load(&p->g->failed))
        (void)peer_ping(p, MOED_NCCL_STOP);
    return NULL;
}

static int peer_submit(struct moed_backend *be, struct moed_batch *b)
{
    struct nccl_peer *p = (struct nccl_peer *)be;
    const struct moed_nccl_group *g = p->g;
    if (!(b->flags & MOED_BATCH_ROWS) || (b->flags & MOED_BATCH_COMBINE) || b->n_tokens < 1 ||
        b->n_tokens > g->max_tokens || b->top_k != g->k || !moed_buf_on_host(&b->ids) ||
        !b->ids.ptr || !b->x.ptr || b->ep_n != g->ranks || b->ep_shard != p->r ||
        b->rows.kind != MOED_BUF_DEVICE || b->rows.device != g->gpu ||
        b->rows.bytes < (uint64_t)b->n_tokens * (g->k + g->S) * g->H * 4)
        return MOED_E_INVAL;
    if (atomic_load(&g->failed))
        return MOED_E_BACKEND;
    pthread_mutex_lock(&p->mu);
    int rc = p->stopping ? MOED_E_SHUTDOWN : p->job ? MOED_E_BUSY : 0;
    if (!rc) {
        b->kernel_ns = 0;
        p->job = b;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

static int peer_healthy(struct moed_backend *be)
{
    return !atomic_load(&((struct nccl_peer *)be)->g->failed);
}

static void peer_describe(struct moed_backend *be, char *buf, unsigned len)
{
    const struct nccl_peer *p = (const struct nccl_peer *)be;
    snprintf(buf, len, "rank %u of the NCCL group of %u (another daemon)", p->r, p->g->ranks);
}

static void peer_free(struct nccl_peer *p)
{
    link_free(&p->l, atomic_load(&p->g->failed));
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static void peer_close(struct moed_backend *be)
{
    struct nccl_peer *p = (struct nccl_peer *)be;
    pthread_mutex_lock(&p->mu);
    p->stopping = 1; /* a queued batch still runs */
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->th_started)
        pthread_join(p->th, NULL);
    peer_free(p);
}

static const struct moed_backend_ops peer_ops = {
    .name = "nccl-peer",
    .completes_in_us = 1,
    .submit = peer_submit,
    .healthy = peer_healthy,
    .describe = peer_describe,
    .close = peer_close,
};

int moed_nccl_peer_open(struct moed_nccl_group *g, uint32_t r, moed_backend_done_fn done,
                        void *done_ctx, struct moed_backend **out, char *err, size_t errlen)
{
    *out = NULL;
    if (g->rank != 0 || r < 1 || r >= g->ranks)
        return moed_seterr(err, errlen, MOED_E_INVAL, "nccl: peer %u of rank %u: not a peer",
                           r, g->rank);
    struct nccl_peer *p = calloc(1, sizeof *p);
    if (!p)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "nccl: out of memory");
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->base.ops = &peer_ops;
    p->base.done = done;
    p->base.done_ctx = done_ctx;
    p->g = g;
    p->r = r;
    int rc = link_alloc(g, &p->l, 1, err, errlen);
    if (!rc && pthread_create(&p->th, NULL, peer_thread, p) != 0)
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "nccl: peer %u: pthread_create failed", r);
    if (rc) {
        peer_free(p);
        return rc;
    }
    p->th_started = 1;
    *out = &p->base;
    return 0;
}

/* ---------------- rank r > 0: the worker ---------------- */

struct nccl_worker {
    struct moed_backend base; /* first */
    struct moed_backend_ops ops;
    struct moed_nccl_group *g;
    struct moed_backend *local;
    struct link l;
    int32_t *ids_h;   /* [max_tokens * k] */
    float *w_h;       /* [max_tokens * k] zeros: a ROWS batch reads no w */
    void *rows_d;     /* [max_tokens * (k + S) * H] fp32 */
    pthread_t th;
    int th_started;
    atomic_int stop;
    atomic_int ended; /* the loop is over: the group failed or ended */
    atomic_int rank0_stop; /* it ended on rank 0's STOP: nothing left posted */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int local_done;   /* under mu */
    struct moed_batch b;
};

static void worker_local_done(void *ctx, struct moed_batch *b)
{
    struct nccl_worker *w = ctx;
    (void)b;
    pthread_mutex_lock(&w->mu);
    w->local_done = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* One batch rank 0 sent (its header checked): ids and x in, the local ROWS
 * batch, the answer and the rows out. */
static int worker_batch(struct nccl_worker *w, const struct moed_nccl_hdr *h)
{
    struct moed_nccl_group *g = w->g;
    struct link *l = &w->l;
    const uint32_t T = h->n_tokens, KS = g->k + g->S;
    int rc;
    const struct xfer in[] = {{0, l->ids_d, (size_t)T * g->k * 4},
                              {0, l->x_d, (size_t)T * g->H * 2}};
    if ((rc = grp_xfer(g, 0, in, 2, l->st, l->ev, &w->stop, "receiving a batch")))
        return rc;
    int32_t status = 0;
    if (link_copy(l, w->ids_h, l->ids_d, (size_t)T * g->k * 4, cudaMemcpyDeviceToHost) !=
        cudaSuccess)
        status = MOED_E_BACKEND;
    struct moed_batch *b = &w->b;
    *b = (struct moed_batch){
        .seq = h->seq, .layer = h->layer, .n_tokens = T, .top_k = g->k,
        .x = {MOED_BUF_DEVICE, g->gpu, l->x_d, (uint64_t)T * g->H * 2},
        .ids = {MOED_BUF_HOST, 0, w->ids_h, (uint64_t)T * g->k * 4},
        .w = {MOED_BUF_HOST, 0, w->w_h, (uint64_t)T * g->k * 4},
        .rows = {MOED_BUF_DEVICE, g->gpu, w->rows_d, (uint64_t)T * KS * g->H * 4},
        .flags = h->flags, .ep_n = h->ep_n, .ep_shard = h->ep_shard};
    if (!status) {
        pthread_mutex_lock(&w->mu);
        w->local_done = 0;
        pthread_mutex_unlock(&w->mu);
        status = moed_backend_submit(w->local, b);
        if (!status) {
            pthread_mutex_lock(&w->mu);
            while (!w->local_done)
                pthread_cond_wait(&w->cv, &w->mu);
            pthread_mutex_unlock(&w->mu);
            status = b->status;
        }
    }
    if (status)
        LOG_W("nccl: rank %u: batch %llu (layer %u, %u tokens) failed here: %s", g->rank,
              (unsigned long long)h->seq, h->layer, T, moed_strerror(status));
    l->hdr_h[0] = (struct moed_nccl_hdr){.magic = MOED_NCCL_MAGIC, .kind = MOED_NCCL_REPLY,
                                         .seq = h->seq, .status = status,
                                         .kernel_ns = status ? 0 : b->kernel_ns};
    if (link_copy(l, l->hdr_d, l->hdr_h, sizeof *l->hdr_h, cudaMemcpyHostToDevice) != cudaSuccess)
        return MOED_E_BACKEND;
    const struct xfer out[] = {{1, l->hdr_d, sizeof(struct moed_nccl_hdr)},
                               {1, w->rows_d, (size_t)T * KS * g->H * 4}};
    return grp_xfer(g, 0, out, 2, l->st, l->ev, &w->stop, "sending a batch's rows");
}

static void *worker_thread(void *arg)
{
    struct nccl_worker *w = arg;
    struct moed_nccl_group *g = w->g;
    struct link *l = &w->l;
    (void)cudaSetDevice(g->gpu);
    uint64_t batches = 0;
    for (;;) {
        const struct xfer in[] = {{0, l->hdr_d + 1, sizeof(struct moed_nccl_hdr)}};
        int rc = grp_xfer(g, 0, in, 1, l->st, l->ev, &w->stop, "waiting for rank 0");
        if (rc)
            break;
        struct moed_nccl_hdr *h = l->hdr_h + 1;
        if (link_copy(l, h, l->hdr_d + 1, sizeof *h, cudaMemcpyDeviceToHost) != cudaSuccess)
            break;
        const char *bad = moed_nccl_hdr_check(h, g->model, g->ranks, g->rank, g->max_tokens);
        if (bad) {
            pthread_mutex_lock(&g->mu);
            grp_fail_locked(g, "rank 0 sent a header this worker refuses (%s: magic %08x, kind "
                            "%u, layer %u, %u tokens, flags %#x, ep %u/%u)", bad, h->magic,
                            h->kind, h->layer, h->n_tokens, h->flags, h->ep_shard, h->ep_n);
            pthread_mutex_unlock(&g->mu);
            break;
        }
        if (h->kind == MOED_NCCL_STOP) {
            LOG_W("nccl: rank %u: rank 0 ended the group after %llu batches; this worker stops "
                  "(restart it to join the next group)", g->rank, (unsigned long long)batches);
            atomic_store(&w->rank0_stop, 1);
            break;
        }
        if (h->kind == MOED_NCCL_PING) {
            l->hdr_h[0] =
                (struct moed_nccl_hdr){.magic = MOED_NCCL_MAGIC, .kind = MOED_NCCL_REPLY};
            if (link_copy(l, l->hdr_d, l->hdr_h, sizeof *l->hdr_h, cudaMemcpyHostToDevice) !=
                cudaSuccess)
                break;
            const struct xfer out[] = {{1, l->hdr_d, sizeof(struct moed_nccl_hdr)}};
            if (grp_xfer(g, 0, out, 1, l->st, l->ev, &w->stop, "answering a ping"))
                break;
            continue;
        }
        const struct moed_nccl_hdr hb = *h;
        if (worker_batch(w, &hb))
            break;
        batches++;
    }
    atomic_store(&w->ended, 1);
    return NULL;
}

static int worker_submit(struct moed_backend *be, struct moed_batch *b)
{
    (void)be;
    (void)b;
    return MOED_E_UNSUPPORTED;
}

static int worker_healthy(struct moed_backend *be)
{
    const struct nccl_worker *w = (const struct nccl_worker *)be;
    return !atomic_load(&w->ended) && !atomic_load(&w->g->failed) &&
           w->local->ops->healthy(w->local);
}

static uint64_t worker_heartbeat(struct moed_backend *be)
{
    struct moed_backend *l = ((struct nccl_worker *)be)->local;
    return l->ops->heartbeat(l);
}

static void worker_describe(struct moed_backend *be, char *buf, unsigned len)
{
    const struct nccl_worker *w = (const struct nccl_worker *)be;
    char one[256] = "";
    if (w->local->ops->describe)
        w->local->ops->describe(w->local, one, sizeof one);
    snprintf(buf, len, "nccl worker: rank %u of %u, computing device %u of the placement for "
             "rank 0; %s", w->g->rank, w->g->ranks, w->g->rank, one);
}

static void worker_free(struct nccl_worker *w)
{
    moed_backend_close(w->local);
    const int aborted = atomic_load(&w->g->failed);
    link_free(&w->l, aborted);
    if (!aborted)
        cudaFree(w->rows_d);
    free(w->ids_h);
    free(w->w_h);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

static void worker_close(struct moed_backend *be)
{
    struct nccl_worker *w = (struct nccl_worker *)be;
    atomic_store(&w->stop, 1);
    /* The persistent kernel goes first: aborting the communicator frees
     * NCCL's host buffers (cudaFreeHost in its proxy thread), which waits
     * for every kernel of the process; with this one resident it never
     * returned (H200, 2026-12-03: rank 1 stopped in ncclCommAbort for good,
     * bench/NOTES.md). A failure's abort, on a thread of its own, waits for
     * it too. */
    moed_backend_cuda_quiesce(w->local);
    if (w->th_started) {
        /* a receive posted for rank 0's next header (the loop leaves it
         * posted when it sees stop) ends only with the communicator: abort
         * it. After rank 0's STOP nothing is posted: the buffers are freed
         * as usual and moed_nccl_close ends the communicator. */
        pthread_mutex_lock(&w->g->mu);
        if (!atomic_load(&w->rank0_stop) && !atomic_load(&w->g->failed)) {
            atomic_store(&w->g->failed, 1);
            (void)ncclCommAbort(w->g->comm);
        }
        pthread_mutex_unlock(&w->g->mu);
        pthread_join(w->th, NULL);
    }
    worker_free(w);
}

int moed_nccl_worker_open(struct moed_nccl_group *g,
                          int (*open_local)(void *ctx, uint32_t i, moed_backend_done_fn done,
                                            void *done_ctx, struct moed_backend **out,
                                            char *err, size_t errlen),
                          void *open_ctx, moed_backend_done_fn done, void *done_ctx,
                          struct moed_backend **out, char *err, size_t errlen)
{
    int rc = 0;
    *out = NULL;
    if (g->rank == 0)
        return moed_seterr(err, errlen, MOED_E_INVAL, "nccl: rank 0 runs no worker");
    struct nccl_worker *w = calloc(1, sizeof *w);
    if (!w)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "nccl: out of memory");
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->g = g;
    const size_t T = g->max_tokens, KS = g->k + g->S;
    w->ids_h = malloc(T * g->k * sizeof *w->ids_h);
    w->w_h = calloc(T * g->k, sizeof *w->w_h);
    if (!w->ids_h || !w->w_h) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "nccl: out of memory");
        goto cleanup;
    }
    MOED_TRY(open_local(open_ctx, g->rank, worker_local_done, w, &w->local, err, errlen));
    MOED_TRY(link_alloc(g, &w->l, 0, err, errlen));
    MOED_CUDA_TRY(cudaMalloc(&w->rows_d, T * KS * g->H * sizeof(float)));
    w->ops = (struct moed_backend_ops){.name = "nccl-worker",
                                       .completes_in_us = 1,
                                       .submit = worker_submit,
                                       .healthy = worker_healthy,
                                       .describe = worker_describe,
                                       .close = worker_close};
    if (w->local->ops->heartbeat)
        w->ops.heartbeat = worker_heartbeat;
    w->base.ops = &w->ops;
    w->base.done = done;
    w->base.done_ctx = done_ctx;
    if (pthread_create(&w->th, NULL, worker_thread, w) != 0) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "nccl: worker: pthread_create failed");
        goto cleanup;
    }
    w->th_started = 1;
    LOG_I("nccl: rank %u of %u: serving rank 0 (client batches are refused here)", g->rank,
          g->ranks);
    *out = &w->base;
    return 0;
cleanup:
    worker_free(w);
    return rc;
}
