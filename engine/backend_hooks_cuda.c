/* backend_hooks_cuda.c - the CUDA backend's test and benchmark hooks
 * (backend_cuda_hooks.h): counters, phase stamps, layer pointers, the
 * deadline stall, and the check of the scratch guard regions.
 */
#include <cuda_runtime.h>
#include <pthread.h>

#include "backend_cuda_hooks.h"
#include "backend_cuda_int.h"
#include "moed_check_cuda.h"
#include "moed_err.h"

static const char *const guard_name[G_COUNT] = {"staged x", "staged ids", "staged w",
                                                "h", "d", "routing tables"};

uint64_t moed_backend_cuda_launches(struct moed_backend *be)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    pthread_mutex_lock(&cb->mu);
    uint64_t n = cb->launches;
    pthread_mutex_unlock(&cb->mu);
    return n;
}

void moed_backend_cuda_phases(struct moed_backend *be, uint64_t out[6])
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    for (int i = 0; i < 6; i++)
        out[i] = moe_gpu_phase(cb->ctrl, (unsigned)i);
}

void moed_backend_cuda_host_stamps(struct moed_backend *be, uint64_t out[2])
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    out[0] = __atomic_load_n(&cb->pub_rt_ns, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&cb->seen_rt_ns, __ATOMIC_RELAXED);
}

int moed_backend_cuda_running(struct moed_backend *be)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    pthread_mutex_lock(&cb->mu);
    int r = cb->running;
    pthread_mutex_unlock(&cb->mu);
    return r;
}

int moed_backend_cuda_layer_ptrs(struct moed_backend *be, uint32_t slot, struct moe_gpu_layer *out,
                                 struct moe_gpu_dims *dims)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    if (slot >= cb->n_layers)
        return MOED_E_INVAL;
    const uint32_t H = cb->d.hidden, I = cb->d.inter, NE = cb->d.n_experts + cb->d.n_shared;
    const uint64_t layer_bytes = (moe_gpu_gu_bytes(H, I) + moe_gpu_dn_bytes(H, I)) * NE;
    out->gu = cb->wbuf + layer_bytes * slot;
    out->dn = cb->wbuf + layer_bytes * slot + moe_gpu_gu_bytes(H, I);
    out->s2 = cb->s2 + (size_t)3 * NE * slot;
    *dims = cb->d;
    return 0;
}

void moed_backend_cuda_debug_stall(struct moed_backend *be, uint32_t us)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    pthread_mutex_lock(&cb->mu);
    cb->stall_ns = (uint64_t)us * 1000u;
    pthread_mutex_unlock(&cb->mu);
}

int moed_backend_cuda_grid(struct moed_backend *be)
{
    return ((struct cuda_backend *)be)->launch.grid;
}

int moed_backend_cuda_check_guards(struct moed_backend *be, char *err, size_t errlen)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    int rc = 0;
    uint8_t buf[2 * GUARD_BYTES];
    if (!cb->guard)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "cuda backend: opened without guard regions "
                           "(moed_backend_cuda_test_guards)");
    MOED_CUDA_TRY(cuda_use(cb));
    for (int i = 0; i < G_COUNT; i++) {
        const struct guarded *g = &cb->g[i];
        if (!g->base)
            continue;
        MOED_CUDA_TRY(cudaMemcpy(buf, g->base, GUARD_BYTES, cudaMemcpyDeviceToHost));
        MOED_CUDA_TRY(cudaMemcpy(buf + GUARD_BYTES, g->base + GUARD_BYTES + g->bytes, GUARD_BYTES,
                                 cudaMemcpyDeviceToHost));
        for (unsigned j = 0; j < 2 * GUARD_BYTES; j++)
            if (buf[j] != GUARD_FILL) {
                rc = moed_seterr(err, errlen, MOED_E_BACKEND,
                                 "cuda backend: guard %s %s (%zu bytes) changed: byte %u is "
                                 "0x%02x, not 0x%02x", j < GUARD_BYTES ? "before" : "after",
                                 guard_name[i], g->bytes,
                                 j < GUARD_BYTES ? j : j - GUARD_BYTES, buf[j], GUARD_FILL);
                goto cleanup;
            }
    }
cleanup:
    return rc;
}

struct moe_gpu_chan *moed_backend_cuda_chan_ptr(struct moed_backend *be, uint32_t index)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    if (index >= cb->n_chans)
        return NULL;
    return cb->chan[index].mem;
}
