/* backend_nocuda.c - the CUDA backend entry points of a CPU-only build.
 *
 * Built only when CUDA=0 (see Makefile: *_nocuda.c). The daemon and tests call
 * the same functions in every build; here they say plainly that this binary
 * has no GPU path, so a config asking for backend "cuda" fails at start-up
 * with a message instead of a link error.
 */
#include <stddef.h>

#include "backend.h"
#include "moed_err.h"
#include "nccl_group.h"

int moed_backend_cuda_open(struct moed_model *m, const struct moed_backend_cfg *cfg,
                           moed_backend_done_fn done, void *done_ctx,
                           struct moed_backend **out, char *err, size_t errlen)
{
    (void)m;
    (void)cfg;
    (void)done;
    (void)done_ctx;
    if (out)
        *out = NULL;
    return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                       "backend \"cuda\": this moed was built without CUDA "
                       "(rebuild with CUDA=1 and nvcc installed, or use backend \"cpu\")");
}

int moed_backend_cuda_available(void)
{
    return 0;
}

int moed_backend_cuda_device_count(void)
{
    return 0;
}

int moed_backend_cuda_mem(int dev, uint64_t *free_bytes, uint64_t *total_bytes)
{
    (void)dev;
    *free_bytes = *total_bytes = 0;
    return MOED_E_UNSUPPORTED;
}

int moed_backend_cuda_rows_alloc(const int *gpus, int n, uint64_t bytes, struct moed_buf *out,
                                 char *err, size_t errlen)
{
    (void)gpus;
    (void)n;
    (void)bytes;
    *out = (struct moed_buf){0};
    return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                       "expert parallelism on GPUs: this moed was built without CUDA");
}

void moed_backend_cuda_rows_free(struct moed_buf *b)
{
    (void)b;
}

int moed_nccl_open(const struct moed_model *m, const struct moed_nccl_cfg *cfg,
                   struct moed_nccl_group **out, char *err, size_t errlen)
{
    (void)m;
    (void)cfg;
    *out = NULL;
    return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                       "engine.nccl_ranks: this moed was built without CUDA (and NCCL)");
}

void moed_nccl_close(struct moed_nccl_group *g)
{
    (void)g;
}

int moed_nccl_peer_open(struct moed_nccl_group *g, uint32_t r, moed_backend_done_fn done,
                        void *done_ctx, struct moed_backend **out, char *err, size_t errlen)
{
    (void)g;
    (void)r;
    (void)done;
    (void)done_ctx;
    *out = NULL;
    return moed_seterr(err, errlen, MOED_E_UNSUPPORTED, "nccl: built without CUDA");
}

int moed_nccl_worker_open(struct moed_nccl_group *g,
                          int (*open_local)(void *ctx, uint32_t i, moed_backend_done_fn done,
                                            void *done_ctx, struct moed_backend **out,
                                            char *err, size_t errlen),
                          void *open_ctx, moed_backend_done_fn done, void *done_ctx,
                          struct moed_backend **out, char *err, size_t errlen)
{
    (void)g;
    (void)open_local;
    (void)open_ctx;
    (void)done;
    (void)done_ctx;
    *out = NULL;
    return moed_seterr(err, errlen, MOED_E_UNSUPPORTED, "nccl: built without CUDA");
}
