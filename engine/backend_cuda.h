/* backend_cuda.h - CUDA backend entry points beyond engine/backend.h, for the
 * GPU tests and the benchmark (CUDA builds only).
 *
 * moed_backend_cuda_open() (backend.h) serves a loaded checkpoint; the
 * function here serves layers the caller built in memory (tests) or random
 * NVFP4 weights generated on the device (benchmark), through the same
 * placement, queue and kernel.
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

/* Test/bench hooks: current heartbeat value, kernel launches so far, and the
 * kernel's grid. */
uint64_t moed_backend_cuda_heartbeat(struct moed_backend *be);
uint64_t moed_backend_cuda_launches(struct moed_backend *be);
int moed_backend_cuda_grid(struct moed_backend *be);
/* Bench hook: the kernel's phase timestamps of the last batch (ns, see
 * moe_gpu_ctrl.phase_ns); copies 6 values. */
void moed_backend_cuda_phases(struct moed_backend *be, uint64_t out[6]);
/* Bench hook: CLOCK_REALTIME ns of the last batch's head store [0] and of
 * the completion thread first seeing done_seq advance [1]. */
void moed_backend_cuda_host_stamps(struct moed_backend *be, uint64_t out[2]);
/* Bench hook: 1 while the persistent kernel is resident (0 after an idle
 * exit, engine.idle_exit_ms), so other kernels can be timed on a free GPU. */
int moed_backend_cuda_running(struct moed_backend *be);
/* Bench hook: device pointers of layer slot `slot` (0..n_layers-1) and the
 * dims the kernel serves; MOED_E_INVAL for a slot out of range. */
int moed_backend_cuda_layer_ptrs(struct moed_backend *be, uint32_t slot, struct moe_gpu_layer *out,
                                 struct moe_gpu_dims *dims);
/* Test hook: the next batch published makes the kernel stall `us` first. */
void moed_backend_cuda_debug_stall(struct moed_backend *be, uint32_t us);

#endif
