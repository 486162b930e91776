/* moe_ref.h - CPU reference of one MoE layer forward (the contract the GPU
 * kernel must meet).
 *
 * For each token t with x_t (bf16, length H) and top-k pairs (e_j, w_j):
 *
 *   g   = W_gate[e] x_t,  u = W_up[e] x_t          fp32 accumulation
 *   h   = bf16( silu(g) * u )                       length I, rounded to bf16
 *   d_j = W_down[e] h                               fp32, length H
 *   y_t = bf16( sum_j w_j * d_j  +  sum_s d_s )     shared experts s, weight 1
 *
 * Weights are dequantized exactly (e2m1 * e4m3 * scale_2). Routed experts are
 * experts[0 .. n_experts), shared experts experts[n_experts .. n_experts +
 * n_shared). Slots are summed in order j = 0..k-1 then shared s = 0..S-1.
 */
#ifndef MOE_REF_H
#define MOE_REF_H

#include <stdint.h>

#include "nvfp4.h"

/* One expert's three matrices: gate/up [I, H], down [H, I]. */
struct moe_expert {
    struct nvfp4_mat gate, up, down;
};

/* One MoE layer: borrowed pointers, caller keeps them alive. */
struct moe_layer {
    uint32_t hidden;     /* H */
    uint32_t inter;      /* I */
    uint32_t n_experts;  /* E routed */
    uint32_t n_shared;   /* S shared */
    uint32_t top_k;      /* k */
    const struct moe_expert *experts; /* [E + S] */
};

/* y[T][H] (bf16) = layer(x[T][H] bf16, ids[T][k], w[T][k]).
 * Validates ids in [0, E) and shapes; returns 0 or MOED_E_INVAL/MOED_E_NOMEM.
 * n_threads <= 0 means "all online cores". Allocates per call: x as float
 * [T, H], h as float [T*(k+S), I], the token-by-expert index, and per thread
 * max(2H, 8*(I + T*(k+S))) floats, T at most 1024 at a time (larger batches
 * run in chunks of 1024 tokens); starts its worker threads per call. */
int moe_ref_forward(const struct moe_layer *layer, uint32_t n_tokens, const uint16_t *x,
                    const int32_t *ids, const float *w, uint16_t *y, int n_threads);

/* moe_ref_forward with flags: MOE_REF_ROUTED_ONLY leaves out the shared
 * experts; MOE_REF_EMPTY_SLOTS lets an id be -1, an empty slot that adds
 * nothing (its weight is not read into the sum). */
#define MOE_REF_ROUTED_ONLY 0x1u
#define MOE_REF_EMPTY_SLOTS 0x2u
int moe_ref_forward_flags(const struct moe_layer *layer, uint32_t n_tokens, const uint16_t *x,
                          const int32_t *ids, const float *w, uint16_t *y, int n_threads,
                          unsigned flags);

/* Expert parallelism (engine/backend.h, MOED_BATCH_ROWS / _COMBINE): the
 * layer in two halves, whose composition is moe_ref_forward_flags bit for
 * bit. The rows buffer is fp32 [T * (k + S), H] (S the layer's shared
 * experts, also with MOE_REF_ROUTED_ONLY): entry t * (k + S) + j holds d_j
 * of token t's slot j (routed slots j < k, then shared), unweighted.
 *
 * moe_ref_rows computes and writes exactly these entries, no others: routed
 * slot j of token t when ids[t * k + j] >= 0 (an id may be -1: a slot that
 * is empty or another device's), and the shared slots of token t when
 * t % ep_n == ep_shard (none with MOE_REF_ROUTED_ONLY). A row does not
 * depend on the other tokens or on the thread count. 0 or MOED_E_INVAL
 * (shapes, an id not in [-1, E), ep_shard >= ep_n) / MOED_E_NOMEM;
 * allocates per call as moe_ref_forward does. */
int moe_ref_rows(const struct moe_layer *layer, uint32_t n_tokens, const uint16_t *x,
                 const int32_t *ids, float *rows, uint32_t ep_n, uint32_t ep_shard,
                 int n_threads, unsigned flags);

/* y [T, H] bf16 from the rows: the sum above in slot order, the very float
 * operations moe_ref_forward does (one function computes both). Reads the
 * routed entries whose id is >= 0 and the shared entries unless
 * MOE_REF_ROUTED_ONLY; ids as for moe_ref_forward_flags (-1 only with
 * MOE_REF_EMPTY_SLOTS; its weight is not read). One thread, no allocation;
 * 0 or MOED_E_INVAL. */
int moe_ref_combine(const struct moe_layer *layer, uint32_t n_tokens, const int32_t *ids,
                    const float *w, const float *rows, uint16_t *y, unsigned flags);

#endif
