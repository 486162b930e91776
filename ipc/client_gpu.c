/* client_gpu.c - the GPU side of a doorbell channel in the client library
 * (moed_client.h; PROTOCOL.md sections 10.4, 10.5): map the channel, load
 * the client kernel, launch it on the caller's stream. The CUDA driver API
 * comes from libcuda.so.1 through dlopen, so the library itself links no
 * CUDA: without a driver (or a GPU, or a current context) these calls answer
 * MOED_E_UNSUPPORTED saying which. */
#include "client_int.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_gpu_abi.h"

/* The driver API types and entry points used here (cuda.h, CUDA 12/13). */
typedef int cu_result;
typedef unsigned long long cu_deviceptr;
typedef struct {
    char reserved[64];
} cu_ipc_handle;
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1

static struct {
    void *lib;
    char why[256]; /* why the driver is not usable ("" once it is) */
    cu_result (*init)(unsigned);
    cu_result (*ctx_get_current)(void **);
    cu_result (*ipc_open)(cu_deviceptr *, cu_ipc_handle, unsigned);
    cu_result (*ipc_close)(cu_deviceptr);
    cu_result (*module_load_data)(void **, const void *);
    cu_result (*module_get_function)(void **, void *, const char *);
    cu_result (*module_unload)(void *);
    cu_result (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void *, void **, void **);
    cu_result (*error_string)(cu_result, const char **);
} cu;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

#define CU_SYM(field, name)                                                          \
    do {                                                                             \
        *(void **)&cu.field = dlsym(cu.lib, name);                                   \
        if (!cu.field) {                                                             \
            snprintf(cu.why, sizeof cu.why, "libcuda.so.1 has no %s", name);         \
            return;                                                                  \
        }                                                                            \
    } while (0)

static void cu_load(void)
{
    cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cu.lib) {
        const char *e = dlerror();
        snprintf(cu.why, sizeof cu.why, "the CUDA driver (libcuda.so.1) will not load: %s",
                 e ? e : "?");
        return;
    }
    CU_SYM(init, "cuInit");
    CU_SYM(ctx_get_current, "cuCtxGetCurrent");
    CU_SYM(ipc_open, "cuIpcOpenMemHandle_v2");
    CU_SYM(ipc_close, "cuIpcCloseMemHandle");
    CU_SYM(module_load_data, "cuModuleLoadData");
    CU_SYM(module_get_function, "cuModuleGetFunction");
    CU_SYM(module_unload, "cuModuleUnload");
    CU_SYM(launch, "cuLaunchKernel");
    CU_SYM(error_string, "cuGetErrorString");
    cu_result r = cu.init(0);
    if (r != 0)
        snprintf(cu.why, sizeof cu.why, "cuInit failed (CUDA error %d): no usable GPU", r);
}

static const char *cu_err(cu_result r)
{
    const char *s = NULL;
    if (cu.error_string && cu.error_string(r, &s) == 0 && s)
        return s;
    return "unknown CUDA error";
}

/* The driver loaded and a context current on this thread. */
static int cu_ready(const char *what, char *err, size_t errlen)
{
    pthread_once(&cu_once, cu_load);
    if (cu.why[0])
        return moed_seterr(err, errlen, MOED_E_UNSUPPORTED, "%s: %s", what, cu.why);
    void *ctx = NULL;
    cu_result r = cu.ctx_get_current(&ctx);
    if (r != 0 || !ctx)
        return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                           "%s: no current CUDA context on this thread (make the client GPU's "
                           "context current first, e.g. cudaSetDevice / torch.cuda.set_device)",
                           what);
    return 0;
}

struct moedc_chan {
    cu_deviceptr chan; /* the channel, mapped here */
    void *module, *fn;
    uint64_t key;
    uint32_t slots;
    uint64_t arena_off, arena_bytes; /* the arena in that mapping (0, 0: none) */
};

int moedc_chan_attach(const struct moedc_chan_info *info, struct moedc_chan **out, char *err,
                      size_t errlen)
{
    if (out)
        *out = NULL;
    if (!info || !out)
        return moed_seterr(err, errlen, MOED_E_INVAL, "moedc_chan_attach: info and out are "
                                                      "required");
    if (info->abi_version != MOE_GPU_ABI_VERSION)
        return moed_seterr(err, errlen, MOED_E_VERSION,
                           "the daemon's channel ABI is version %" PRIu32 "; this library "
                           "speaks %u",
                           info->abi_version, MOE_GPU_ABI_VERSION);
    if (!info->kernel || info->kernel_bytes == 0 || info->size < sizeof(struct moe_gpu_chan) ||
        info->slots != MOE_GPU_CHAN_SLOTS)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "moedc_chan_attach: not an open channel's info (kernel %zu bytes, "
                           "size %" PRIu64 ", slots %" PRIu32 ")",
                           info->kernel_bytes, info->size, info->slots);
    if (info->arena_bytes && info->arena_off < info->size)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "moedc_chan_attach: an arena at offset %" PRIu64
                           " overlaps the %" PRIu64 "-byte channel",
                           info->arena_off, info->size);
    int rc = cu_ready("moedc_chan_attach", err, errlen);
    if (rc)
        return rc;
    struct moedc_chan *ch = calloc(1, sizeof *ch);
    if (!ch)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for a channel");
    ch->key = info->key;
    ch->slots = info->slots;
    ch->arena_off = info->arena_off;
    ch->arena_bytes = info->arena_bytes;
    cu_ipc_handle h;
    memcpy(h.reserved, info->handle, sizeof h.reserved);
    cu_result r = cu.ipc_open(&ch->chan, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (r != 0) {
        free(ch);
        return moed_seterr(err, errlen, MOED_E_IO,
                           "the channel's handle will not open: cuIpcOpenMemHandle: %s",
                           cu_err(r));
    }
    r = cu.module_load_data(&ch->module, info->kernel);
    if (r == 0)
        r = cu.module_get_function(&ch->fn, ch->module, "moed_chan_call");
    if (r != 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO,
                         "the client kernel will not load (cuModuleLoadData / "
                         "cuModuleGetFunction moed_chan_call): %s",
                         cu_err(r));
        moedc_chan_detach(ch);
        return rc;
    }
    *out = ch;
    return 0;
}

uint64_t moedc_chan_arena(const struct moedc_chan *ch, uint64_t *bytes)
{
    const int has = ch && ch->arena_bytes;
    if (bytes)
        *bytes = has ? ch->arena_bytes : 0;
    return has ? (uint64_t)ch->chan + ch->arena_off : 0;
}

void moedc_chan_detach(struct moedc_chan *ch)
{
    if (!ch)
        return;
    if (ch->module)
        cu.module_unload(ch->module);
    if (ch->chan)
        cu.ipc_close(ch->chan);
    free(ch);
}

static struct moe_gpu_chan_ref chan_ref(const struct moedc_chanref *r)
{
    return (struct moe_gpu_chan_ref){.buf = r->buf, .pad = 0, .off = r->offset};
}

int moedc_chan_call(struct moedc_chan *ch, void *stream, uint32_t layer, uint32_t n_tokens,
                    uint32_t flags, const struct moedc_chanref *x, const struct moedc_chanref *ids,
                    const struct moedc_chanref *w, const struct moedc_chanref *y, void *err_dev,
                    uint64_t timeout_ns, char *err, size_t errlen)
{
    if (!ch || !x || !ids || !w || !y || !err_dev)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "moedc_chan_call: the channel, the four refs and err_dev are "
                           "required");
    /* the kernel checks everything else; what the host knows is refused here */
    if (flags & ~(MOE_GPU_CHAN_ROUTED_ONLY | MOE_GPU_CHAN_EMPTY_SLOTS))
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "moedc_chan_call: flags 0x%" PRIx32 " (known: 0x1 routed-only, 0x2 "
                           "empty slots)",
                           flags);
    struct moe_gpu_chan_desc d = {.layer = layer, .n_tokens = n_tokens, .seq = 0, .key = ch->key,
                                  .flags = flags, .x = chan_ref(x), .ids = chan_ref(ids),
                                  .w = chan_ref(w), .y = chan_ref(y)};
    cu_deviceptr chan = ch->chan, e = (cu_deviceptr)(uintptr_t)err_dev;
    unsigned long long t = timeout_ns;
    void *args[] = {&chan, &d, &e, &t};
    cu_result r = cu.launch(ch->fn, 1, 1, 1, 32, 1, 1, 0, stream, args, NULL);
    if (r != 0)
        return moed_seterr(err, errlen, MOED_E_BACKEND, "cuLaunchKernel moed_chan_call: %s",
                           cu_err(r));
    return 0;
}
