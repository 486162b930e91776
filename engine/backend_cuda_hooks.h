/* backend_cuda_hooks.h - test and benchmark hooks into a running CUDA
 * backend (tests/gpu, bench/ only: nothing that serves includes this).
 */
#ifndef MOED_BACKEND_CUDA_HOOKS_H
#define MOED_BACKEND_CUDA_HOOKS_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "moe_gpu.h"

/* Current heartbeat value, kernel launches so far, and the kernel's grid. */
uint64_t moed_backend_cuda_heartbeat(struct moed_backend *be);
uint64_t moed_backend_cuda_launches(struct moed_backend *be);
int moed_backend_cuda_grid(struct moed_backend *be);
/* The kernel's phase timestamps of the last batch (ns, see
 * moe_gpu_ctrl.phase_ns); copies 6 values. */
void moed_backend_cuda_phases(struct moed_backend *be, uint64_t out[6]);
/* CLOCK_REALTIME ns of the last batch's head store [0] and of the completion
 * thread first seeing done_seq advance [1]. */
void moed_backend_cuda_host_stamps(struct moed_backend *be, uint64_t out[2]);
/* 1 while the persistent kernel is resident (0 after an idle exit,
 * engine.idle_exit_ms), so other kernels can be timed on a free GPU. */
int moed_backend_cuda_running(struct moed_backend *be);
/* Device pointers of layer slot `slot` (0..n_layers-1) and the dims the
 * kernel serves; MOED_E_INVAL for a slot out of range. */
int moed_backend_cuda_layer_ptrs(struct moed_backend *be, uint32_t slot, struct moe_gpu_layer *out,
                                 struct moe_gpu_dims *dims);
/* The next batch published makes the kernel stall `us` first. */
void moed_backend_cuda_debug_stall(struct moed_backend *be, uint32_t us);
/* on = 1: backends opened from now on place every scratch buffer the kernel
 * writes (staged x, ids, w; h; d; routing tables) between two guard regions
 * of a known byte pattern (0, the default: plain allocations, as served). */
void moed_backend_cuda_test_guards(int on);
/* 0 if every guard region is intact, else MOED_E_BACKEND naming the buffer,
 * side and first changed byte (MOED_E_INVAL: opened without guards). Safe
 * while the kernel runs (a copy on another stream). */
int moed_backend_cuda_check_guards(struct moed_backend *be, char *err, size_t errlen);
/* The daemon-side device address of doorbell channel `index` (what a client
 * maps through the IPC handle; a test in the daemon's own process cannot
 * open its own handle), NULL if it has none. */
struct moe_gpu_chan *moed_backend_cuda_chan_ptr(struct moed_backend *be, uint32_t index);

#endif
