/* backend_shard_cuda.c - the CUDA backend as one device of expert
 * parallelism (a child of moed_backend_ep_open, engine/backend.h):
 *
 *   - its partial placement: with cfg->ep_place only the routed experts
 *     with a replica on cfg->ep_shard and the shared experts are placed;
 *     the kernel sees a smaller model (the layer's local experts, then the
 *     shared ones) and the host rewrites each ROWS batch's ids to local
 *     indices as it stages them (a row depends only on its expert's weights
 *     and its token: the numbering changes no bit of it);
 *   - the checks of ROWS and COMBINE batches (the rows buffer, the split,
 *     an expert not placed here: refused, naming it);
 *   - backends sharing one GPU (engine.gpus [0, 0]): freeing device memory
 *     waits for the GPU to be idle, which never comes while another
 *     backend's persistent kernel is resident, so a backend closed (or
 *     failing to open) while others still hold its GPU parks its memory and
 *     the last one to leave the GPU frees every parked backend's;
 *   - the rows buffer for the engine (moed_backend_cuda_rows_alloc).
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_int.h"
#include "moed_check_cuda.h"
#include "moed_err.h"
#include "moed_log.h"
#include "placement.h"

/* ---------------- partial placement ---------------- */

void cuda_shard_free(struct cuda_shard *sh)
{
    if (sh->views)
        for (uint32_t l = 0; l < sh->n_layers; l++)
            free((void *)sh->views[l].experts);
    free(sh->views);
    free(sh->view_ptrs);
    free(sh->local);
    memset(sh, 0, sizeof *sh);
}

int cuda_shard_open(const struct moed_cuda_src *src, const struct moed_backend_cfg *cfg,
                    struct cuda_shard *sh, struct moed_cuda_src *out, char *err, size_t errlen)
{
    const uint32_t E = src->dims.n_experts, S = src->dims.n_shared, n = src->n_layers;
    const uint32_t shard = cfg->ep_shard;
    uint32_t n_loc = src->dims.top_k; /* the kernel's experts: at least top_k */
    memset(sh, 0, sizeof *sh);
    if (src->random_weights || !src->layers)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "cuda backend: a partial placement (expert parallelism) needs the "
                           "model's layers, not random weights");
    for (uint32_t l = 0; l < n; l++) {
        const uint32_t id = src->layer_ids ? src->layer_ids[l] : l;
        const struct moed_placement *pl = cfg->ep_place[id];
        if (!pl || pl->n_experts != E || pl->n_shared != S || shard >= pl->n_dev)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "cuda backend: layer %u: %s (device %u of a model with %u routed "
                               "and %u shared experts)", id,
                               !pl ? "no placement" : "the placement does not fit", shard, E, S);
        uint32_t c = 0;
        for (uint32_t e = 0; e < E; e++)
            for (uint32_t r = 0; r < pl->n_rep[e]; r++)
                c += pl->dev[(size_t)e * MOED_PLACE_MAX_REPLICAS + r] == shard;
        if (c > n_loc)
            n_loc = c;
    }
    sh->n_layers = n;
    sh->n_experts = E;
    sh->n_local = n_loc;
    sh->local = malloc(sizeof(int32_t) * n * E);
    sh->views = calloc(n, sizeof *sh->views);
    sh->view_ptrs = calloc(n, sizeof *sh->view_ptrs);
    if (!sh->local || !sh->views || !sh->view_ptrs)
        goto nomem;
    for (uint32_t l = 0; l < n; l++) {
        const uint32_t id = src->layer_ids ? src->layer_ids[l] : l;
        const struct moed_placement *pl = cfg->ep_place[id];
        const struct moe_layer *ly = src->layers[l];
        struct moe_expert *ex = malloc(sizeof *ex * (n_loc + S));
        if (!ex)
            goto nomem;
        uint32_t c = 0;
        for (uint32_t e = 0; e < E; e++) {
            int here = 0;
            for (uint32_t r = 0; r < pl->n_rep[e]; r++)
                here |= pl->dev[(size_t)e * MOED_PLACE_MAX_REPLICAS + r] == shard;
            sh->local[(size_t)l * E + e] = here ? (int32_t)c : -1;
            if (here)
                ex[c++] = ly->experts[e];
        }
        for (; c < n_loc; c++) /* padding (no id maps to it): any valid expert */
            ex[c] = ly->experts[0];
        for (uint32_t s = 0; s < S; s++)
            ex[n_loc + s] = ly->experts[E + s];
        sh->views[l] = *ly;
        sh->views[l].n_experts = n_loc;
        sh->views[l].experts = ex;
        sh->view_ptrs[l] = &sh->views[l];
    }
    *out = *src;
    out->layers = sh->view_ptrs;
    out->dims.n_experts = n_loc;
    LOG_I("cuda: device %u of expert parallelism: %u routed experts per layer at most (of %u) "
          "and the %u shared ones placed", shard, n_loc, E, S);
    return 0;
nomem:
    cuda_shard_free(sh);
    return moed_seterr(err, errlen, MOED_E_NOMEM, "cuda backend: out of memory");
}

void cuda_shard_ids(const struct cuda_backend *cb, const struct moed_batch *b, int32_t *dst)
{
    const uint64_t n = (uint64_t)b->n_tokens * cb->d.top_k;
    const int32_t *ids = b->ids.ptr;
    if (!cb->ep_loc || !(b->flags & MOED_BATCH_ROWS)) {
        memcpy(dst, ids, n * 4);
        return;
    }
    const int32_t *loc = cb->ep_loc + (size_t)cb->slot_of[b->layer] * cb->ep_experts;
    for (uint64_t i = 0; i < n; i++)
        dst[i] = ids[i] < 0 ? -1 : loc[ids[i]]; /* cuda_shard_check: every one placed */
}

int cuda_shard_check(const struct cuda_backend *cb, const struct moed_batch *b)
{
    const uint32_t ep = b->flags & (MOED_BATCH_ROWS | MOED_BATCH_COMBINE);
    const uint64_t T = b->n_tokens, KS = cb->d.top_k + cb->d.n_shared;
    if (!ep) {
        if (cb->ep_loc) {
            LOG_E("cuda: GPU %d: a plain batch (layer %u) on a device of expert parallelism, "
                  "which computes ROWS and COMBINE batches only", cb->dev, b->layer);
            return MOED_E_INVAL;
        }
        return 0;
    }
    if (ep == (MOED_BATCH_ROWS | MOED_BATCH_COMBINE))
        return MOED_E_INVAL;
    /* rows: where the kernel reads or writes it (device memory, this GPU's
     * or a peer's the caller enabled, or mapped pinned memory), 16-aligned */
    if (!b->rows.ptr || (uintptr_t)b->rows.ptr % 16 != 0 ||
        b->rows.bytes < T * KS * cb->d.hidden * 4 ||
        (b->rows.kind != MOED_BUF_DEVICE && b->rows.kind != MOED_BUF_PINNED))
        return MOED_E_INVAL;
    if (ep == MOED_BATCH_COMBINE)
        return 0;
    if (b->ep_n < 1 || b->ep_shard >= b->ep_n)
        return MOED_E_INVAL;
    if (!cb->ep_loc)
        return 0;
    if (!moed_buf_on_host(&b->ids)) {
        LOG_E("cuda: GPU %d: a ROWS batch (layer %u) with its expert ids in device memory on a "
              "device holding only some experts: the host cannot check them", cb->dev, b->layer);
        return MOED_E_INVAL;
    }
    const int32_t *ids = b->ids.ptr;
    const int32_t *loc = cb->ep_loc + (size_t)cb->slot_of[b->layer] * cb->ep_experts;
    for (uint64_t i = 0; i < T * cb->d.top_k; i++)
        if (ids[i] >= 0 && loc[ids[i]] < 0) {
            LOG_E("cuda: GPU %d: a ROWS batch names expert %d of layer %u (token %llu, slot "
                  "%llu), which is not placed on this device (expert parallelism device %u)",
                  cb->dev, ids[i], b->layer, (unsigned long long)(i / cb->d.top_k),
                  (unsigned long long)(i % cb->d.top_k), b->ep_shard);
            return MOED_E_INVAL;
        }
    return 0;
}

/* ---------------- backends sharing one GPU ---------------- */

#define CUDA_MAX_DEVS 64

static pthread_mutex_t g_dev_mu = PTHREAD_MUTEX_INITIALIZER;
static uint32_t g_dev_open[CUDA_MAX_DEVS]; /* backends holding each GPU */
static int g_dev_hung[CUDA_MAX_DEVS];      /* a kernel there never stopped */
static struct cuda_backend *g_parked;      /* closed, device memory not yet freed */

int cuda_dev_hold(struct cuda_backend *cb, char *err, size_t errlen)
{
    if (cb->dev < 0 || cb->dev >= CUDA_MAX_DEVS)
        return moed_seterr(err, errlen, MOED_E_CONFIG, "cuda backend: GPU %d: no such device",
                           cb->dev);
    pthread_mutex_lock(&g_dev_mu);
    g_dev_open[cb->dev]++;
    pthread_mutex_unlock(&g_dev_mu);
    cb->dev_held = 1;
    return 0;
}

void cuda_dev_release(struct cuda_backend *cb, int device_ok)
{
    if (!cb->dev_held) {
        cuda_free_all(cb, device_ok);
        return;
    }
    const int dev = cb->dev;
    struct cuda_backend *mine = NULL, **pp;
    pthread_mutex_lock(&g_dev_mu);
    if (!device_ok)
        g_dev_hung[dev] = 1;
    const int others = --g_dev_open[dev] > 0, hung = g_dev_hung[dev];
    if (others && !hung) {
        cb->park_next = g_parked;
        g_parked = cb;
        pthread_mutex_unlock(&g_dev_mu);
        LOG_D("cuda: GPU %d: backend closed; its device memory is freed when the last backend "
              "on the GPU closes", dev);
        return;
    }
    if (!others) /* the last one: every parked backend of the GPU goes with it */
        for (pp = &g_parked; *pp;) {
            struct cuda_backend *p = *pp;
            if (p->dev == dev) {
                *pp = p->park_next;
                p->park_next = mine;
                mine = p;
            } else {
                pp = &p->park_next;
            }
        }
    pthread_mutex_unlock(&g_dev_mu);
    (void)cudaSetDevice(dev);
    while (mine) {
        struct cuda_backend *p = mine;
        mine = p->park_next;
        cuda_free_all(p, !hung);
    }
    cuda_free_all(cb, device_ok && !hung);
}

/* ---------------- the rows buffer (engine_open.c) ---------------- */

int moed_backend_cuda_rows_alloc(const int *gpus, int n, uint64_t bytes, struct moed_buf *out,
                                 char *err, size_t errlen)
{
    int rc = 0;
    void *p = NULL;
    *out = (struct moed_buf){0};
    if (n < 1 || bytes == 0)
        return moed_seterr(err, errlen, MOED_E_INVAL, "cuda: rows buffer: no GPU or no bytes");
    const int home = gpus[0];
    for (int i = 1; i < n; i++) {
        const int g = gpus[i];
        int can = 0;
        if (g == home)
            continue;
        MOED_CUDA_TRY(cudaDeviceCanAccessPeer(&can, g, home));
        if (!can) {
            rc = moed_seterr(err, errlen, MOED_E_BACKEND,
                             "engine.gpus: GPU %d cannot access GPU %d's memory "
                             "(cudaDeviceCanAccessPeer: no peer access, e.g. no NVLink or "
                             "PCIe P2P between them): expert parallelism writes each GPU's rows "
                             "into GPU %d", g, home, home);
            goto cleanup;
        }
        MOED_CUDA_TRY(cudaSetDevice(g));
        cudaError_t e = cudaDeviceEnablePeerAccess(home, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
            (void)cudaGetLastError();
        } else if (e != cudaSuccess) {
            (void)cudaGetLastError();
            rc = moed_seterr(err, errlen, MOED_E_BACKEND,
                             "engine.gpus: cudaDeviceEnablePeerAccess from GPU %d to GPU %d "
                             "failed: %s", g, home, cudaGetErrorString(e));
            goto cleanup;
        }
    }
    MOED_CUDA_TRY(cudaSetDevice(home));
    MOED_CUDA_TRY(cudaMalloc(&p, bytes));
    *out = (struct moed_buf){.kind = MOED_BUF_DEVICE, .device = home, .ptr = p, .bytes = bytes};
    LOG_I("cuda: expert parallelism over %d devices: %.1f MiB of rows on GPU %d", n,
          bytes / 1048576.0, home);
cleanup:
    return rc;
}

void moed_backend_cuda_rows_free(struct moed_buf *b)
{
    if (b->ptr) {
        (void)cudaSetDevice(b->device);
        cudaFree(b->ptr);
    }
    *b = (struct moed_buf){0};
}
