/* backend_place_cuda.c - the CUDA backend's memory: host memory for the
 * daemon's buffers (host_alloc / host_free: pinned, mapped at the same
 * address), and the weight placement: every expert of
 * every MoE layer repacked on the host (moe_gpu_repack_expert, in parallel
 * over experts) into the kernel's stream order and copied into one device
 * allocation; each matrix's weight_scale_2 into a per-layer float table;
 * and the backend's entry points that read the model (moed_backend_cuda_open)
 * or query devices.
 */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "backend_cuda_int.h"
#include "moe_gpu.h"
#include "moed_check_cuda.h"
#include "moed_err.h"
#include "moed_log.h"

struct pack_job {
    const struct moe_layer *layer;
    uint32_t e0, e1, H, I;
    uint8_t *out; /* experts e0..e1 packed, gu then dn per expert */
};

static void *pack_worker(void *arg)
{
    struct pack_job *j = arg;
    uint64_t gb = moe_gpu_gu_bytes(j->H, j->I), db = moe_gpu_dn_bytes(j->H, j->I);
    for (uint32_t e = j->e0; e < j->e1; e++) {
        uint8_t *o = j->out + (uint64_t)(e - j->e0) * (gb + db);
        moe_gpu_repack_expert(&j->layer->experts[e], j->H, j->I, o, o + gb);
    }
    return NULL;
}

/* Repack experts [e0, e1) of `layer` into host buffer `out` using up to
 * n_thr threads (falls back to this thread if thread creation fails). */
static void pack_range(const struct moe_layer *layer, uint32_t e0, uint32_t e1, uint32_t H,
                       uint32_t I, uint8_t *out, int n_thr)
{
    pthread_t th[64];
    struct pack_job jobs[64];
    int started[64] = {0};
    uint32_t n = e1 - e0;
    if (n_thr > 64)
        n_thr = 64;
    if (n_thr > (int)n)
        n_thr = (int)n;
    uint64_t per = moe_gpu_gu_bytes(H, I) + moe_gpu_dn_bytes(H, I);
    for (int t = 0; t < n_thr; t++) {
        uint32_t a = e0 + (uint32_t)((uint64_t)n * t / n_thr), b = e0 + (uint32_t)((uint64_t)n * (t + 1) / n_thr);
        jobs[t] = (struct pack_job){layer, a, b, H, I, out + (uint64_t)(a - e0) * per};
        started[t] = pthread_create(&th[t], NULL, pack_worker, &jobs[t]) == 0;
        if (!started[t])
            pack_worker(&jobs[t]);
    }
    for (int t = 0; t < n_thr; t++)
        if (started[t])
            pthread_join(th[t], NULL);
}

int cuda_place_weights(struct cuda_backend *cb, const struct moed_cuda_src *src, char *err,
                       size_t errlen)
{
    int rc = 0;
    const uint32_t H = cb->d.hidden, I = cb->d.inter, NE = cb->d.n_experts + cb->d.n_shared;
    const uint64_t per = moe_gpu_gu_bytes(H, I) + moe_gpu_dn_bytes(H, I);
    const uint64_t layer_bytes = per * NE;
    uint8_t *host = NULL;
    float *s2h = NULL;
    struct moe_gpu_layer *lh = NULL;
    uint32_t chunk = 0;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int n_thr = ncpu > 0 ? (int)ncpu : 1;

    lh = calloc(cb->n_layers, sizeof *lh);
    s2h = calloc((size_t)cb->n_layers * 3 * NE, sizeof *s2h);
    if (!lh || !s2h) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "cuda backend: out of host memory");
        goto cleanup;
    }
    MOED_CUDA_TRY(cudaMalloc((void **)&cb->wbuf, layer_bytes * cb->n_layers));
    MOED_CUDA_TRY(cudaMalloc((void **)&cb->s2, sizeof(float) * 3 * NE * cb->n_layers));
    MOED_CUDA_TRY(cudaMalloc((void **)&cb->layers_d, sizeof(struct moe_gpu_layer) * cb->n_layers));
    for (uint32_t l = 0; l < cb->n_layers; l++) {
        lh[l].gu = cb->wbuf + layer_bytes * l; /* gu and dn of expert e at gu + e*per */
        lh[l].dn = cb->wbuf + layer_bytes * l + moe_gpu_gu_bytes(H, I);
        lh[l].s2 = cb->s2 + (size_t)3 * NE * l;
    }
    if (src->random_weights) {
        for (uint32_t l = 0; l < cb->n_layers; l++)
            for (uint32_t e = 0; e < NE; e++) {
                uint64_t x = src->seed * 0x9E3779B97F4A7C15ull + l * 1000003ull + e * 7919ull + 1;
                for (int m = 0; m < 3; m++) {
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    /* like ModelOpt's amax/(6*448) for unit-scale weights, gate != up */
                    s2h[(size_t)3 * NE * l + (size_t)m * NE + e] =
                        (1.0f + (float)(x % 1000) / 1000.0f) / (6.0f * 448.0f);
                }
            }
        MOED_TRY(moe_gpu_fill_random(cb->wbuf, layer_bytes * cb->n_layers, src->seed, err, errlen));
        MOED_CUDA_TRY(cudaDeviceSynchronize());
    } else {
        /* the kernel reads gu at e*per and dn at e*per + gu bytes: interleave
         * experts as [gu dn][gu dn]..., which is what pack_range writes */
        chunk = NE < 64 ? NE : 64;
        host = malloc(per * chunk);
        if (!host) {
            rc = moed_seterr(err, errlen, MOED_E_NOMEM,
                             "cuda backend: cannot allocate %llu bytes of repack buffer",
                             (unsigned long long)(per * chunk));
            goto cleanup;
        }
        uint64_t done = 0, total = layer_bytes * cb->n_layers, next_log = 0;
        for (uint32_t l = 0; l < cb->n_layers; l++) {
            const struct moe_layer *ly = src->layers[l];
            for (uint32_t e = 0; e < NE; e++) {
                s2h[(size_t)3 * NE * l + e] = ly->experts[e].gate.scale_2;
                s2h[(size_t)3 * NE * l + NE + e] = ly->experts[e].up.scale_2;
                s2h[(size_t)3 * NE * l + 2 * NE + e] = ly->experts[e].down.scale_2;
            }
            for (uint32_t e0 = 0; e0 < NE; e0 += chunk) {
                uint32_t e1 = e0 + chunk < NE ? e0 + chunk : NE;
                pack_range(ly, e0, e1, H, I, host, n_thr);
                MOED_CUDA_TRY(cudaMemcpy(cb->wbuf + layer_bytes * l + per * e0, host, per * (e1 - e0),
                              cudaMemcpyHostToDevice));
                done += per * (e1 - e0);
                if (cb->progress)
                    cb->progress(cb->progress_ctx, done, total);
                if (done >= next_log || done == total) {
                    LOG_I("cuda: GPU %d: uploaded %.2f of %.2f GiB of expert weights (layer %u/%u)",
                          cb->dev, done / 1073741824.0, total / 1073741824.0, l + 1, cb->n_layers);
                    next_log = done + total / 10;
                }
            }
        }
    }
    /* per-layer tables; the kernel indexes gu/dn by e*per: fix the layer
     * pointers to that stride (gu at +0, dn at +gu bytes within each expert) */
    MOED_CUDA_TRY(cudaMemcpy(cb->s2, s2h, sizeof(float) * 3 * NE * cb->n_layers, cudaMemcpyHostToDevice));
    MOED_CUDA_TRY(cudaMemcpy(cb->layers_d, lh, sizeof *lh * cb->n_layers, cudaMemcpyHostToDevice));
cleanup:
    free(host);
    free(s2h);
    free(lh);
    return rc;
}

/* ---- host memory (the backend ops host_alloc, host_free) ---- */

/* host_free: queue the block for close (cudaFreeHost now would wait for the
 * resident kernel to exit). */
void cuda_host_free(struct moed_backend *be, void *p)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    struct host_blk *hb = p;
    pthread_mutex_lock(&cb->mu);
    hb->next = cb->host_freed;
    cb->host_freed = hb;
    pthread_mutex_unlock(&cb->mu);
}

/* host_alloc: pinned memory mapped into the device at the same address. */
void *cuda_host_alloc(struct moed_backend *be, size_t bytes)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    void *p = NULL, *dp = NULL;
    cudaError_t e = cuda_use(cb); /* the caller's thread may have another */
    if (e == cudaSuccess)
        e = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
        LOG_W("cuda: GPU %d: cudaHostAlloc of %zu bytes (mapped, portable) failed: %s (%s); "
              "that buffer uses ordinary memory and the staging copies",
              cb->dev, bytes, cudaGetErrorName(e), cudaGetErrorString(e));
        (void)cudaGetLastError(); /* not sticky: clear it off this thread */
        return NULL;
    }
    e = cudaHostGetDevicePointer(&dp, p, 0);
    if (e != cudaSuccess || dp != p) {
        LOG_W("cuda: GPU %d: pinned block %p is mapped at device address %p (%s); it cannot be "
              "used in place: ordinary memory and the staging copies instead", cb->dev, p, dp,
              cudaGetErrorString(e));
        (void)cudaGetLastError();
        cuda_host_free(be, p); /* cudaFreeHost would wait for the kernel */
        return NULL;
    }
    return p;
}

/* ---- the model's MoE layers as the placement's source; device queries ---- */

int moed_backend_cuda_open(struct moed_model *m, const struct moed_backend_cfg *cfg,
                           moed_backend_done_fn done, void *done_ctx,
                           struct moed_backend **out, char *err, size_t errlen)
{
    const struct moed_dims *dm = moed_model_dims(m);
    struct moed_cuda_src src = {0};
    const struct moe_layer **layers = NULL;
    uint32_t *ids = NULL;
    int rc;
    layers = calloc(dm->n_layers ? dm->n_layers : 1, sizeof *layers);
    ids = calloc(dm->n_layers ? dm->n_layers : 1, sizeof *ids);
    if (!layers || !ids) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "cuda backend: out of memory");
        goto cleanup;
    }
    for (uint32_t l = 0; l < dm->n_layers; l++) {
        if (!moed_model_is_moe_layer(m, l))
            continue;
        layers[src.n_layers] = moed_model_layer(m, l);
        ids[src.n_layers++] = l;
    }
    src.layers = layers;
    src.layer_ids = ids;
    src.dims = (struct moe_gpu_dims){.hidden = dm->hidden, .inter = dm->inter,
                                     .n_experts = dm->n_experts, .n_shared = dm->n_shared,
                                     .top_k = dm->top_k, .max_tokens = cfg->max_tokens};
    rc = moed_backend_cuda_open_src(&src, cfg, done, done_ctx, out, err, errlen);
cleanup:
    free(layers);
    free(ids);
    return rc;
}

int moed_backend_cuda_available(void)
{
    return moed_backend_cuda_device_count() > 0;
}

int moed_backend_cuda_device_count(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? n : 0;
}

int moed_backend_cuda_mem(int dev, uint64_t *free_bytes, uint64_t *total_bytes)
{
    size_t f = 0, t = 0;
    *free_bytes = *total_bytes = 0;
    if (cudaSetDevice(dev) != cudaSuccess || cudaMemGetInfo(&f, &t) != cudaSuccess)
        return MOED_E_BACKEND;
    *free_bytes = f;
    *total_bytes = t;
    return 0;
}
