/* bench_baseline.h - the two baselines bench_moe.c prints beside moed
 * (bench/bench_baseline.cu; linked into the benchmark only, with cuBLAS).
 *
 * (a) "staged": the same NVFP4 weights (moed's repacked streams, read in
 *     place) and the same math as separate, non-persistent kernel launches per
 *     stage: route, gate_up, activation, down, combine; captured once in a CUDA
 *     graph per batch and replayed.
 * (b) "cublas": what a user of stock libraries does: the weights dequantized
 *     once to bf16 (weight_scale_2 folded in), then one cublasGemmEx (bf16 in,
 *     fp32 accumulate and out) per touched expert for gate_up and for down,
 *     with route, gather, activation and combine kernels; captured in a CUDA
 *     graph per batch (the per-expert GEMM sizes depend on the routing, so a
 *     graph is captured per routing; capture time is not counted) and replayed.
 *
 * Inputs (x, ids, w) of each baseline batch sit in device memory before the
 * replay (moed's figure includes staging them over PCIe). Times are host wall
 * clock of cudaGraphLaunch + cudaStreamSynchronize.
 */
#ifndef BENCH_BASELINE_H
#define BENCH_BASELINE_H

#include <stddef.h>
#include <stdint.h>

#include "moe_gpu.h"

#define BL_SLOTS 8 /* batches (routings) with their own graphs, replayed round robin */

struct bl_ctx;

/* nv[n_nv]: moed's layers (device pointers, as the backend placed them);
 * n_bf16 of them (the first) get dequantized bf16 copies for (b). */
int bl_open(const struct moe_gpu_dims *d, const struct moe_gpu_layer *nv, uint32_t n_nv,
            uint32_t n_bf16, struct bl_ctx **out, char *err, size_t errlen);
/* Batch `slot` (< BL_SLOTS): copies x [T,H] bf16, ids [T,k], w [T,k] to the
 * device and captures both graphs; slot s uses NVFP4 layer s % n_nv and bf16
 * layer s % n_bf16 (slot 0: layer 0 for both). */
int bl_set_batch(struct bl_ctx *c, uint32_t slot, uint32_t T, const uint16_t *x,
                 const int32_t *ids, const float *w, char *err, size_t errlen);
/* Replay baseline `which` (0 = staged, 1 = cublas) of `slot`, wait for it;
 * y (host, [T,H] bf16) receives the output when not NULL (not timed). */
int bl_run(struct bl_ctx *c, int which, uint32_t slot, uint16_t *y, double *us, char *err,
           size_t errlen);
void bl_close(struct bl_ctx *c);

/* Offset of the GPU's %globaltimer from host CLOCK_REALTIME (ns, gpu - host)
 * by ping-pong through mapped memory: the round with the shortest round trip
 * wins; *half_rtt_ns is its half round trip (the offset's uncertainty). */
int bl_clock_offset(int rounds, int64_t *off_ns, int64_t *half_rtt_ns, char *err, size_t errlen);

#endif
