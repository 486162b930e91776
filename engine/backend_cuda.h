/* backend_cuda.h - CUDA backend entry points beyond engine/backend.h, for the
 * GPU tests and the benchmark (CUDA builds only).
 *
 * moed_backend_cuda_open() (backend.h) serves a loaded checkpoint; the
 * function here serves layers the caller built in memory (tests) or random
 * NVFP4 weights generated on the device (benchmark), through the same
 * placement, queue and kernel; moed_backend_cuda_quiesce stops a backend's
 * kernel ahead of its close (an NCCL worker, nccl_group.h). The tests' and
 * the benchmark's hooks into a
 * running backend are in backend_cuda_hooks.h (test-only).
 */
#ifndef MOED_BACKEND_CUDA_H
#define MOED_BACKEND_CUDA_H

#include <stdint.h>

#include "backend.h"
#include "moe_gpu.h"

struct moed_cuda_src {
    uint32_t n_layers;                     /* layers to place, >= 1 */
    const struct moe_layer *const *layers; /* [n_layers]; NULL with random_weights */
    const uint32_t *layer_ids;             /* [n_layers] absolute ids (NULL: 0..n-1) */
    struct moe_gpu_dims dims;              /* max_tokens from cfg overrides */
    int random_weights;                    /* fill weights on the device instead */
    uint64_t seed;
};

/* Same contract as moed_backend_cuda_open; the caller keeps src->layers alive
 * only for the duration of this call (weights are copied to the device). */
int moed_backend_cuda_open_src(const struct moed_cuda_src *src, const struct moed_backend_cfg *cfg,
                               moed_backend_done_fn done, void *done_ctx,
                               struct moed_backend **out, char *err, size_t errlen);

/* Stop `be`'s (a CUDA backend's) completion thread and persistent kernel and
 * wait for them, freeing nothing; its close then frees. For a caller that
 * must have the kernel gone before something else that waits for every
 * kernel of the process (aborting an NCCL communicator frees NCCL's host
 * buffers). Idempotent; the backend takes no batch after it. */
void moed_backend_cuda_quiesce(struct moed_backend *be);

#endif
