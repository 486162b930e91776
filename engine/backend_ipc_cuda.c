/* backend_ipc_cuda.c - the CUDA backend's side of registered client buffers
 * (backend.h: device_uuid, ipc_open, ipc_close; engine/desc.h owns the
 * registry and every check of the ranges).
 *
 * A client's cudaIpcMemHandle_t names a whole allocation; it is opened into
 * the backend's device (cudaIpcMemLazyEnablePeerAccess) and its real size is
 * asked of the driver (cuMemGetAddressRange, through the runtime's driver
 * entry point: no link against libcuda), so that a client that claims a
 * larger allocation than it has is refused before any batch can read past
 * its end. A handle that will not open is the client's error (MOED_E_IO),
 * never the backend's: the runtime error is cleared and the backend stays
 * healthy. A client on another GPU of the host (cuda_peer_gpu: one this
 * process sees, with peer access both ways) registers the same way: its
 * handle opens in this backend's device context, the flag enabling peer
 * access to the GPU it lies on, and the kernel reads x, ids and w (__ldcv,
 * kernel.cuh and stage_routing in task.cuh: no stale L1 or L2 line, the
 * loads go over NVLink to the client's memory every batch)
 * and writes y there (plain stores, which __threadfence_system in
 * batch_end, kernels/moe_gpu/kernel.cuh, orders before the answer at
 * system scope: peer memory is covered by the .sys scope as mapped host
 * memory is, so the client that sees the answer sees y). Closing such a
 * mapping goes through the release queue as any other (cudaIpcCloseMemHandle
 * waits for an idle device). Loop thread. Also what the backend knows of
 * sharing its GPU: the
 * device's UUID and whether it runs under MPS, the SMs the kernel then
 * leaves to the other processes (cuda_sms_free), the context that keeps
 * it off them (cuda_ctx_open: a smaller grid alone does not, since the
 * hardware may spread its CTAs over every SM; the driver calls through the
 * same entry points), and the GPU's lock file under MPS, one moed per GPU
 * (cuda_gpu_lock).
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_int.h"
#include "moed_err.h"
#include "moed_lock.h"
#include "moed_log.h"
#include "test_hooks.h"

typedef CUresult (*get_range_fn)(CUdeviceptr *base, size_t *size, CUdeviceptr p);

void cuda_sharing_probe(struct cuda_backend *cb, const struct cudaDeviceProp *prop)
{
    memcpy(cb->uuid, prop->uuid.bytes, sizeof cb->uuid);
    if (cudaDeviceGetAttribute(&cb->mps, cudaDevAttrMpsEnabled, cb->dev) != cudaSuccess) {
        (void)cudaGetLastError();
        cb->mps = 0;
    }
}

int cuda_gpu_lock(struct cuda_backend *cb, char *err, size_t errlen)
{
    cb->lock_path[0] = '\0';
    if (!cb->mps)
        return 0;
    if (moed_test_switch(MOED_TEST_MPS_NO_LOCK)) { /* test_hooks.h */
        LOG_W("cuda: GPU %d under MPS: MOED_TEST_MPS_NO_LOCK is set, so a second moed on this "
              "GPU is not refused (a test switch: leave it unset in production)", cb->dev);
        return 0;
    }
    char id[33], what[96], why[384];
    for (int i = 0; i < 16; i++)
        snprintf(id + 2 * i, 3, "%02x", cb->uuid[i]);
    snprintf(what, sizeof what, "GPU %d (uuid %s) under MPS", cb->dev, id);
    snprintf(cb->lock_path, sizeof cb->lock_path, "/dev/shm/moed-gpu-%s.lock", id);
    const int rc = moed_lock_take(cb->lock_path, what, why, sizeof why);
    if (rc == 0)
        return 0;
    cb->lock_path[0] = '\0';
    if (rc == MOED_E_BUSY)
        return moed_seterr(err, errlen, rc,
                           "cuda backend: %s; one moed per GPU under MPS: the first one's kernel "
                           "holds the SMs a second one's needs, and a process that exits with "
                           "its kernel unfinished faults every client of the GPU",
                           why);
    LOG_W("cuda: %s; going on without it (a second moed on this GPU would not be refused)", why);
    return 0;
}

void cuda_gpu_unlock(struct cuda_backend *cb)
{
    if (cb->lock_path[0])
        moed_lock_drop(cb->lock_path);
    cb->lock_path[0] = '\0';
}

int cuda_sms_free(const struct cuda_backend *cb, int sms_free, int mps_percent)
{
    if (!cb->mps || sms_free != 0 || mps_percent <= 0)
        return sms_free;
    sms_free = cb->n_sms * mps_percent / 100;
    LOG_I("cuda: GPU %d is shared through MPS: leaving %d of %d SMs free "
          "(engine.mps_sms_free_percent %d; engine.sms_free sets it)",
          cb->dev, sms_free, cb->n_sms, mps_percent);
    return sms_free;
}

/* The driver calls of the SM-limited context, through the runtime's entry
 * points (no link against libcuda); NULL where the driver lacks one. */
typedef CUresult (*ctx_create_fn)(CUcontext *, CUctxCreateParams *, unsigned, CUdevice);
typedef CUresult (*ctx_affinity_fn)(CUexecAffinityParam *, CUexecAffinityType);
typedef CUresult (*ctx_ctx_fn)(CUcontext);
typedef CUresult (*affinity_support_fn)(int *, CUexecAffinityType, CUdevice);
static struct {
    pthread_once_t once;
    ctx_create_fn create;
    ctx_affinity_fn get_affinity;
    ctx_ctx_fn set_current, destroy;
    affinity_support_fn support;
    /* green contexts */
    CUresult (*get_resource)(CUdevice, CUdevResource *, CUdevResourceType);
    CUresult (*split)(CUdevResource *, unsigned *, const CUdevResource *, CUdevResource *,
                      unsigned, unsigned);
    CUresult (*gen_desc)(CUdevResourceDesc *, CUdevResource *, unsigned);
    CUresult (*green_create)(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned);
    CUresult (*green_stream)(CUstream *, CUgreenCtx, unsigned, int);
    CUresult (*green_destroy)(CUgreenCtx);
} g_drv = {.once = PTHREAD_ONCE_INIT};

static void *drv_fn(const char *name, int version)
{
    void *p = NULL;
    enum cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion(name, &p, (unsigned)version, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void drv_load(void)
{
    g_drv.create = (ctx_create_fn)drv_fn("cuCtxCreate", 12050); /* CUctxCreateParams */
    g_drv.get_affinity = (ctx_affinity_fn)drv_fn("cuCtxGetExecAffinity", 11040);
    g_drv.set_current = (ctx_ctx_fn)drv_fn("cuCtxSetCurrent", 4000);
    g_drv.destroy = (ctx_ctx_fn)drv_fn("cuCtxDestroy", 4000);
    g_drv.support = (affinity_support_fn)drv_fn("cuDeviceGetExecAffinitySupport", 11040);
    g_drv.get_resource = drv_fn("cuDeviceGetDevResource", 12040);
    g_drv.split = drv_fn("cuDevSmResourceSplitByCount", 12040);
    g_drv.gen_desc = drv_fn("cuDevResourceGenerateDesc", 12040);
    g_drv.green_create = drv_fn("cuGreenCtxCreate", 12040);
    g_drv.green_stream = drv_fn("cuGreenCtxStreamCreate", 12050);
    g_drv.green_destroy = drv_fn("cuGreenCtxDestroy", 12040);
}

void cuda_ctx_open(struct cuda_backend *cb, int sms)
{
    cb->ctx = NULL;
    cb->ctx_sms = cb->n_sms;
    if (!cb->mps || sms <= 0 || sms >= cb->n_sms)
        return;
    pthread_once(&g_drv.once, drv_load);
    int ok = 0;
    if (!g_drv.create || !g_drv.get_affinity || !g_drv.set_current || !g_drv.destroy ||
        !g_drv.support || g_drv.support(&ok, CU_EXEC_AFFINITY_TYPE_SM_COUNT, cb->dev) !=
                              CUDA_SUCCESS ||
        !ok) {
        LOG_W("cuda: GPU %d: the driver cannot make a context limited to %d SMs (execution "
              "affinity); the kernel's grid is smaller, but its CTAs may still land on every SM",
              cb->dev, sms);
        return;
    }
    CUexecAffinityParam aff = {.type = CU_EXEC_AFFINITY_TYPE_SM_COUNT};
    aff.param.smCount.val = (unsigned)sms;
    CUctxCreateParams cp = {.execAffinityParams = &aff, .numExecAffinityParams = 1};
    CUcontext ctx = NULL;
    CUresult r = g_drv.create(&ctx, &cp, CU_CTX_MAP_HOST, (CUdevice)cb->dev);
    CUexecAffinityParam got = {.type = CU_EXEC_AFFINITY_TYPE_SM_COUNT};
    if (r == CUDA_SUCCESS)
        r = g_drv.get_affinity(&got, CU_EXEC_AFFINITY_TYPE_SM_COUNT);
    if (r != CUDA_SUCCESS) {
        if (ctx)
            (void)g_drv.destroy(ctx);
        LOG_W("cuda: GPU %d: a context limited to %d SMs failed (CUresult %d); the kernel's "
              "grid is smaller, but its CTAs may still land on every SM", cb->dev, sms, (int)r);
        return;
    }
    cb->ctx = ctx;
    cb->ctx_sms = (int)got.param.smCount.val;
    LOG_I("cuda: GPU %d: moed's context is limited to %d of %d SMs under MPS (%d asked): the "
          "other %d are left whole", cb->dev, cb->ctx_sms, cb->n_sms, sms,
          cb->n_sms - cb->ctx_sms);
}

cudaError_t cuda_use(const struct cuda_backend *cb)
{
    if (!cb->ctx)
        return cudaSetDevice(cb->dev);
    return g_drv.set_current((CUcontext)cb->ctx) == CUDA_SUCCESS ? cudaSuccess
                                                                 : cudaErrorInvalidResourceHandle;
}

void cuda_ctx_close(struct cuda_backend *cb)
{
    if (!cb->ctx)
        return;
    (void)g_drv.set_current(NULL);
    (void)g_drv.destroy((CUcontext)cb->ctx);
    cb->ctx = NULL;
}

int cuda_green_stream(struct cuda_backend *cb, int sms, unsigned part, cudaStream_t *out)
{
    cb->green = NULL;
    cb->green_sms = 0;
    pthread_once(&g_drv.once, drv_load);
    if (!g_drv.get_resource || !g_drv.split || !g_drv.gen_desc || !g_drv.green_create ||
        !g_drv.green_stream || !g_drv.green_destroy) {
        LOG_W("cuda: GPU %d: the driver has no green contexts: the kernel's CTAs may land on "
              "every SM and leave none whole", cb->dev);
        return -1;
    }
    enum { MAX_PARTS = 32 };
    CUdevResource all, parts[MAX_PARTS], rest;
    memset(&all, 0, sizeof all);
    memset(parts, 0, sizeof parts);
    memset(&rest, 0, sizeof rest);
    CUresult r = g_drv.get_resource((CUdevice)cb->dev, &all, CU_DEV_RESOURCE_TYPE_SM);
    /* the partition: a multiple of the SM granularity, at most `sms` */
    unsigned gran = r == CUDA_SUCCESS && all.sm.smCoscheduledAlignment
                        ? all.sm.smCoscheduledAlignment : 8;
    unsigned want = (unsigned)sms / gran * gran;
    if (r == CUDA_SUCCESS && (want < all.sm.minSmPartitionSize || want >= all.sm.smCount)) {
        LOG_W("cuda: GPU %d: %d SMs cannot be a green context (minimum %u, granularity %u, of "
              "%u)", cb->dev, sms, all.sm.minSmPartitionSize, gran, all.sm.smCount);
        return -1;
    }
    unsigned groups = r == CUDA_SUCCESS ? all.sm.smCount / (want ? want : 1) : 1;
    if (groups > MAX_PARTS)
        groups = MAX_PARTS;
    if (r == CUDA_SUCCESS)
        r = g_drv.split(parts, &groups, &all, &rest, 0, want);
    const unsigned pick = groups ? part % groups : 0;
    CUdevResourceDesc desc = NULL;
    if (r == CUDA_SUCCESS)
        r = g_drv.gen_desc(&desc, &parts[pick], 1);
    CUgreenCtx g = NULL;
    if (r == CUDA_SUCCESS)
        r = g_drv.green_create(&g, desc, (CUdevice)cb->dev, CU_GREEN_CTX_DEFAULT_STREAM);
    CUstream st = NULL;
    if (r == CUDA_SUCCESS)
        r = g_drv.green_stream(&st, g, CU_STREAM_NON_BLOCKING, 0);
    if (r != CUDA_SUCCESS) {
        if (g)
            (void)g_drv.green_destroy(g);
        LOG_W("cuda: GPU %d: a green context of %u SMs failed (CUresult %d): the kernel's CTAs "
              "may land on every SM and leave none whole", cb->dev, want, (int)r);
        return -1;
    }
    if (part >= groups)
        LOG_W("cuda: GPU %d: partition %u asked, %u fit: a process on this GPU that took "
              "partition %u shares its SMs, and two persistent grids on one partition may "
              "not both be resident (raise engine.sms_free)", cb->dev, part, groups, pick);
    cb->green = g;
    cb->green_sms = (int)parts[pick].sm.smCount;
    *out = (cudaStream_t)st;
    LOG_I("cuda: GPU %d: the persistent kernel runs on a green context of %d of %d SMs "
          "(partition %u of %u): the other %d are left whole for this process's other kernels "
          "(NCCL's)", cb->dev, cb->green_sms, cb->n_sms, pick, groups,
          cb->n_sms - cb->green_sms);
    return 0;
}

void cuda_green_close(struct cuda_backend *cb)
{
    if (cb->green)
        (void)g_drv.green_destroy((CUgreenCtx)cb->green);
    cb->green = NULL;
}

int cuda_device_uuid(struct moed_backend *be, uint8_t uuid[16], int *mps)
{
    const struct cuda_backend *cb = (const struct cuda_backend *)be;
    memcpy(uuid, cb->uuid, 16);
    *mps = cb->mps;
    return 0;
}

int cuda_peer_gpu(struct moed_backend *be, const uint8_t uuid[16], char *err, size_t errlen)
{
    const struct cuda_backend *cb = (const struct cuda_backend *)be;
    int n = 0, peer = -1;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 0;
    }
    for (int i = 0; i < n && peer < 0; i++) {
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
            (void)cudaGetLastError();
            continue;
        }
        if (i != cb->dev && memcmp(prop.uuid.bytes, uuid, 16) == 0)
            peer = i;
    }
    if (peer < 0) {
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        return moed_seterr(err, errlen, MOED_E_INVAL, MOED_PEER_NOT_VISIBLE, n,
                           vis ? vis : "unset");
    }
    /* both ways: this kernel reads x / writes y in the peer's memory, the
     * client's kernel writes bells and slots and reads done in this GPU's */
    int to = 0, from = 0;
    if (cudaDeviceCanAccessPeer(&to, cb->dev, peer) != cudaSuccess ||
        cudaDeviceCanAccessPeer(&from, peer, cb->dev) != cudaSuccess) {
        (void)cudaGetLastError();
        to = from = 0;
    }
    if (!to || !from)
        return moed_seterr(err, errlen, MOED_E_INVAL, MOED_PEER_NO_ACCESS, cb->dev, peer);
    return peer;
}

static get_range_fn range_fn(void)
{
    static get_range_fn fn;
    if (!fn) {
        void *p = NULL;
        enum cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (get_range_fn)p;
        else
            (void)cudaGetLastError();
    }
    return fn;
}

int cuda_ipc_open(struct moed_backend *be, const uint8_t handle[64], struct moed_buf *out,
                  char *err, size_t errlen)
{
    struct cuda_backend *cb = (struct cuda_backend *)be;
    cudaIpcMemHandle_t h;
    _Static_assert(sizeof h == 64, "cudaIpcMemHandle_t is 64 bytes");
    memcpy(&h, handle, sizeof h);
    void *p = NULL;
    cudaError_t ce = cuda_use(cb);
    if (ce == cudaSuccess)
        ce = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        return moed_seterr(err, errlen, MOED_E_IO,
                           "the handle will not open: cudaIpcOpenMemHandle: %s",
                           cudaGetErrorString(ce));
    }
    get_range_fn fn = range_fn();
    CUdeviceptr base = 0;
    size_t size = 0;
    if (!fn || fn(&base, &size, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS ||
        base != (CUdeviceptr)(uintptr_t)p || size == 0) {
        (void)cudaIpcCloseMemHandle(p);
        (void)cudaGetLastError();
        return moed_seterr(err, errlen, MOED_E_IO,
                           "the handle opened but the driver does not report its allocation's "
                           "range (cuMemGetAddressRange%s)",
                           fn ? "" : " not found");
    }
    *out = (struct moed_buf){MOED_BUF_DEVICE, cb->dev, p, (uint64_t)size};
    LOG_D("cuda: GPU %d: client allocation of %zu bytes mapped at %p", cb->dev, size, p);
    return 0;
}

/* Queued, not unmapped here: cudaIpcCloseMemHandle waits until the device
 * is idle, which it never is while the persistent kernel is resident (a
 * doorbell channel keeps it so), and this runs on the loop thread. The
 * completion thread releases the queue with no kernel resident
 * (cuda_release_queued), stopping and relaunching it for that; the same
 * queue frees outgrown channel allocations (cudaFree waits alike). After a
 * failure the kernel may still run: the memory is left to process exit. */
void cuda_ipc_close(struct moed_backend *be, const struct moed_buf *m)
{
    (void)cuda_release_later((struct cuda_backend *)be, m->ptr, CUDA_REL_UNMAP);
}

int cuda_release_later(struct cuda_backend *cb, void *ptr, int kind)
{
    pthread_mutex_lock(&cb->mu);
    if (!cb->failed && cb->n_rel == cb->cap_rel) {
        uint32_t cap = cb->cap_rel ? 2 * cb->cap_rel : 16;
        struct cuda_release *nr = realloc(cb->rel, cap * sizeof *nr);
        if (nr) {
            cb->rel = nr;
            cb->cap_rel = cap;
        }
    }
    int queued = !cb->failed && cb->n_rel < cb->cap_rel;
    if (queued) {
        cb->rel[cb->n_rel++] = (struct cuda_release){ptr, kind};
        pthread_cond_signal(&cb->cv);
    }
    int failed = cb->failed;
    pthread_mutex_unlock(&cb->mu);
    if (!queued)
        LOG_W("cuda: GPU %d: %s %p left to process exit (%s)", cb->dev,
              kind == CUDA_REL_FREE ? "channel allocation" : "client mapping", ptr,
              failed ? "the backend has failed" : "out of memory");
    return queued;
}

void cuda_release_queued(struct cuda_backend *cb)
{
    pthread_mutex_lock(&cb->mu);
    struct cuda_release *list = cb->rel;
    uint32_t n = cb->n_rel, freed = 0;
    cb->rel = NULL;
    cb->n_rel = cb->cap_rel = 0;
    pthread_mutex_unlock(&cb->mu);
    cudaError_t ce = cuda_use(cb);
    for (uint32_t i = 0; i < n; i++) {
        const int fr = list[i].kind == CUDA_REL_FREE;
        if (ce == cudaSuccess)
            ce = fr ? cudaFree(list[i].ptr) : cudaIpcCloseMemHandle(list[i].ptr);
        freed += fr && ce == cudaSuccess;
        if (ce != cudaSuccess) {
            (void)cudaGetLastError();
            LOG_W("cuda: GPU %d: %s(%p): %s", cb->dev, fr ? "cudaFree" : "cudaIpcCloseMemHandle",
                  list[i].ptr, cudaGetErrorString(ce));
            ce = cudaSuccess;
        }
    }
    if (n)
        LOG_D("cuda: GPU %d: %u client mappings unmapped, %u channel allocations freed", cb->dev,
              n - freed, freed);
    free(list);
}
