/* moe_ref.c - the CPU reference of one MoE layer (contract in moe_ref.h).
 *
 * Strategy. Every NVFP4 row is dequantized exactly once per call and reused
 * for every token routed to its expert:
 *
 *   0. Group the (token, slot) pairs by expert with a counting sort. Pair p =
 *      t * (k + S) + slot; routed slots are 0..k-1, shared slots k..k+S-1.
 *   1. Gate/up phase, work item = (active expert, block of PH_ROWS rows of I):
 *      dequantize gate row i and up row i, then for each pair of the expert
 *      h[p][i] = bf16(silu(g) * u) with g, u fp32 dots against x_t.
 *   2. Down phase, work item = block of PD_ROWS output rows r of H: for each
 *      active expert dequantize its down rows r, dot them with h[p] of each of
 *      its pairs into d[p][r] (per-thread scratch), then for each token
 *      y[t][r] = bf16(sum_j w_j d_j + sum_s d_s) in slot order.
 *
 * Determinism: every dot product is one fixed-order function of its inputs,
 * every output element is written by exactly one work item, and the slot sum
 * runs in the contract's order, so the result does not depend on the thread
 * count or on which thread took which item (items are handed out with an
 * atomic counter purely for load balance).
 *
 * Memory per call: x as fp32 [T, H], h [T*(k+S), I], the pair index, plus
 * per-thread scratch of max(2H, PD_ROWS * (I + T*(k+S))) floats, for T at
 * most MOE_REF_CHUNK_TOKENS: a larger batch runs as consecutive chunks of
 * that many tokens (every token is computed alone, so the result is the
 * same), which bounds the memory at large T (16384 tokens of a DeepSeek-V3
 * layer would need 1.2 GB of h at once; a chunk needs 75 MB).
 *
 * Empty slots (id -1, moe_ref_forward_flags with MOE_REF_EMPTY_SLOTS) make no
 * pair and are left out of the sum; MOE_REF_ROUTED_ONLY leaves out the
 * shared slots (the layer is used as if S were 0).
 *
 * moe_ref_rows runs the same two phases over the pairs it selects, the down
 * phase writing each pair's row into the caller's rows buffer instead of the
 * per-thread d (the same dot products, so the same values), and combines
 * nothing; moe_ref_combine is step 2's sum alone, over the rows buffer
 * (combine(), the one function both use).
 */
#include "moe_ref.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moed_err.h"
#include "moed_log.h"

#define PH_ROWS 32     /* I rows per gate/up work item */
#define PD_ROWS 8      /* H rows per down work item: 8 dequantized rows stay in L1/L2 */
#define MAX_THREADS 256
#define MOE_REF_CHUNK_TOKENS 1024u

/* Fixed-order fp32 dot products. Each output is the sum of 8 interleaved
 * lanes (two 4-wide GCC vectors: SSE on any x86-64 and NEON on arm64, without
 * -ffast-math), combined in a fixed tree. dot4 computes four dots that share
 * the operand `a` (one load of a per step) and gives bit-identical results to
 * four dot1 calls, so blocking never changes a value. len % 8 == 0 (len is H
 * or I, both multiples of NVFP4_GROUP = 16). -std=c11 keeps fp-contract off: no FMA. */
typedef float v4f __attribute__((vector_size(16)));

static inline v4f ld4(const float *p)
{
    v4f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float lanes_sum(v4f lo, v4f hi)
{
    v4f s = lo + hi;
    return (s[0] + s[2]) + (s[1] + s[3]);
}

static float dot1(const float *a, const float *b, uint32_t len)
{
    v4f lo = {0}, hi = {0};
    for (size_t i = 0; i < len; i += 8) {
        lo += ld4(a + i) * ld4(b + i);
        hi += ld4(a + i + 4) * ld4(b + i + 4);
    }
    return lanes_sum(lo, hi);
}

static void dot4(const float *a, const float *const b[4], uint32_t len, float out[4])
{
    v4f lo[4] = {{0}}, hi[4] = {{0}};
    for (size_t i = 0; i < len; i += 8) {
        v4f al = ld4(a + i), ah = ld4(a + i + 4);
        for (int j = 0; j < 4; j++) {
            lo[j] += al * ld4(b[j] + i);
            hi[j] += ah * ld4(b[j] + i + 4);
        }
    }
    for (int j = 0; j < 4; j++)
        out[j] = lanes_sum(lo[j], hi[j]);
}

/* h = bf16(silu(g) * u), kept as the float it rounds to. */
static inline float act(float g, float u)
{
    return bf16_to_float(bf16_from_float(g / (1.0f + expf(-g)) * u));
}

struct ref_job {
    const struct moe_layer *L;
    uint32_t T, slots;         /* slots = k + S */
    const float *x;            /* [T, H] fp32 copy of the bf16 input */
    const float *w;            /* [T, k] routing weights */
    const int32_t *ids;        /* [T, k] expert ids; < 0: an empty slot (no pair) */
    uint16_t *y;               /* [T, H]; NULL: rows mode */
    float *rows;               /* rows mode: [T * slots, H], pair p's row at rows[p * H] */
    float *h;                  /* [T * slots, I] bf16-rounded activations */
    const uint32_t *pair_off;  /* [E + S + 1] offsets into pairs */
    const uint32_t *pairs;     /* pair ids grouped by expert */
    const uint32_t *active;    /* experts with >= 1 pair */
    uint32_t n_active;
    uint32_t ph_blocks;        /* I row blocks per expert */
    atomic_uint next1, next2;  /* work counters of the two phases */
};

struct ref_worker {
    struct ref_job *job;
    float *scratch; /* max(2H, PD_ROWS * (I + T*slots)) floats, reused by both phases */
};

static void phase_gate_up(struct ref_job *j, float *gate_row, float *up_row)
{
    const struct moe_layer *L = j->L;
    const uint32_t H = L->hidden, I = L->inter;
    const uint32_t n_items = j->n_active * j->ph_blocks;
    for (;;) {
        uint32_t item = atomic_fetch_add(&j->next1, 1);
        if (item >= n_items)
            break;
        uint32_t e = j->active[item / j->ph_blocks];
        uint32_t i0 = (item % j->ph_blocks) * PH_ROWS;
        uint32_t i1 = i0 + PH_ROWS < I ? i0 + PH_ROWS : I;
        const struct moe_expert *ex = &L->experts[e];
        for (uint32_t i = i0; i < i1; i++) {
            nvfp4_dequant_row(&ex->gate, i, gate_row, 1);
            nvfp4_dequant_row(&ex->up, i, up_row, 1);
            uint32_t q = j->pair_off[e], qend = j->pair_off[e + 1];
            for (; q + 4 <= qend; q += 4) {
                const float *xs[4];
                float g[4], u[4];
                for (int c = 0; c < 4; c++)
                    xs[c] = j->x + (size_t)(j->pairs[q + c] / j->slots) * H;
                dot4(gate_row, xs, H, g);
                dot4(up_row, xs, H, u);
                for (int c = 0; c < 4; c++)
                    j->h[(size_t)j->pairs[q + c] * I + i] = act(g[c], u[c]);
            }
            for (; q < qend; q++) {
                const float *xt = j->x + (size_t)(j->pairs[q] / j->slots) * H;
                j->h[(size_t)j->pairs[q] * I + i] = act(dot1(gate_row, xt, H), dot1(up_row, xt, H));
            }
        }
    }
}

/* The contract's sum, the one place it is computed (moe_ref_forward per
 * block of output rows, moe_ref_combine over the rows buffer): for token t <
 * T and row r < nr, y[t * y_ld + r] = bf16(sum over the slots s < n_sum in
 * order, routed slots s < k weighted by w (those whose id is < 0 skipped:
 * empty, nothing to add), shared slots with weight 1) of the row value
 * d[(t * d_slots + s) * d_ld + r]. */
static void combine(const float *d, size_t d_ld, uint32_t d_slots, uint32_t n_sum, uint32_t T,
                    uint32_t k, const int32_t *ids, const float *w, uint32_t nr, uint16_t *y,
                    size_t y_ld)
{
    for (uint32_t t = 0; t < T; t++) {
        for (uint32_t rr = 0; rr < nr; rr++) {
            float acc = 0.0f;
            for (uint32_t s = 0; s < n_sum; s++) {
                if (s < k && ids[(size_t)t * k + s] < 0)
                    continue; /* an empty slot: no pair, nothing to add */
                float dv = d[((size_t)t * d_slots + s) * d_ld + rr];
                acc += s < k ? w[(size_t)t * k + s] * dv : dv;
            }
            y[(size_t)t * y_ld + rr] = bf16_from_float(acc);
        }
    }
}

static void phase_down(struct ref_job *j, float *rows, float *d)
{
    const struct moe_layer *L = j->L;
    const uint32_t H = L->hidden, I = L->inter, k = L->top_k, slots = j->slots;
    const uint32_t n_items = (H + PD_ROWS - 1) / PD_ROWS;
    for (;;) {
        uint32_t item = atomic_fetch_add(&j->next2, 1);
        if (item >= n_items)
            break;
        uint32_t r0 = item * PD_ROWS;
        uint32_t nr = r0 + PD_ROWS <= H ? PD_ROWS : H - r0;
        /* d[p * PD_ROWS + rr] = down row (r0 + rr) of p's expert . h[p] */
        for (uint32_t a = 0; a < j->n_active; a++) {
            uint32_t e = j->active[a];
            const struct moe_expert *ex = &L->experts[e];
            for (uint32_t rr = 0; rr < nr; rr++)
                nvfp4_dequant_row(&ex->down, r0 + rr, rows + (size_t)rr * I, 1);
            for (uint32_t q = j->pair_off[e]; q < j->pair_off[e + 1]; q++) {
                uint32_t p = j->pairs[q];
                const float *hp = j->h + (size_t)p * I;
                float *dp = j->y ? d + (size_t)p * PD_ROWS : j->rows + (size_t)p * H + r0;
                uint32_t rr = 0;
                for (; rr + 4 <= nr; rr += 4) {
                    const float *rs[4] = {rows + (size_t)rr * I, rows + (size_t)(rr + 1) * I,
                                          rows + (size_t)(rr + 2) * I, rows + (size_t)(rr + 3) * I};
                    dot4(hp, rs, I, dp + rr);
                }
                for (; rr < nr; rr++)
                    dp[rr] = dot1(rows + (size_t)rr * I, hp, I);
            }
        }
        if (j->y)
            combine(d, PD_ROWS, slots, slots, j->T, k, j->ids, j->w, nr, j->y + r0, H);
    }
}

static void *worker_gate_up(void *arg)
{
    struct ref_worker *wk = arg;
    float *gate_row = wk->scratch, *up_row = gate_row + wk->job->L->hidden;
    phase_gate_up(wk->job, gate_row, up_row);
    return NULL;
}

static void *worker_down(void *arg)
{
    struct ref_worker *wk = arg;
    float *rows = wk->scratch, *d = rows + (size_t)PD_ROWS * wk->job->L->inter;
    phase_down(wk->job, rows, d);
    return NULL;
}

/* Run one phase on nt threads: this thread is worker 0. Work is handed out by
 * an atomic counter, so a failed pthread_create only means fewer helpers: the
 * threads that exist (at least this one) still finish every item. */
static void run_phase(void *(*fn)(void *), struct ref_worker *workers, pthread_t *tids, long nt)
{
    long started = 1;
    for (long i = 1; i < nt; i++) {
        if (pthread_create(&tids[i], NULL, fn, &workers[i]) != 0) {
            LOG_W("moe_ref: pthread_create failed; continuing with %ld threads", started);
            break;
        }
        started++;
    }
    fn(&workers[0]);
    for (long i = 1; i < started; i++)
        pthread_join(tids[i], NULL);
}

static int check_mat(const struct nvfp4_mat *m, uint32_t n, uint32_t k)
{
    return m->n == n && m->k == k && m->w != NULL && m->scale != NULL;
}

/* Shapes and the bounds of the scratch sizes. */
static int validate_layer(const struct moe_layer *L, uint32_t T)
{
    if (!L || !L->experts)
        return MOED_E_INVAL;
    if (L->hidden == 0 || L->hidden % NVFP4_GROUP || L->inter == 0 ||
        L->inter % NVFP4_GROUP)
        return MOED_E_INVAL;
    if (L->n_experts == 0 || L->top_k == 0 || L->top_k > L->n_experts)
        return MOED_E_INVAL;
    /* Bound the scratch sizes: (T * slots) * max(H, I) floats must fit. */
    uint64_t slots = (uint64_t)L->top_k + L->n_shared;
    uint64_t width = L->hidden > L->inter ? L->hidden : L->inter;
    if (slots > UINT32_MAX / 2 || (uint64_t)T * slots > UINT32_MAX / 2 ||
        (uint64_t)T * slots * width > (uint64_t)SIZE_MAX / 2 / sizeof(float))
        return MOED_E_INVAL;
    for (uint32_t e = 0; e < L->n_experts + L->n_shared; e++) {
        const struct moe_expert *ex = &L->experts[e];
        if (!check_mat(&ex->gate, L->inter, L->hidden) || !check_mat(&ex->up, L->inter, L->hidden) ||
            !check_mat(&ex->down, L->hidden, L->inter))
            return MOED_E_INVAL;
    }
    return 0;
}

/* Every id in [0, E), or -1 (an empty slot) when empty_ok. */
static int validate_ids(const struct moe_layer *L, uint32_t T, const int32_t *ids, int empty_ok)
{
    if (!ids)
        return MOED_E_INVAL;
    for (uint64_t i = 0; i < (uint64_t)T * L->top_k; i++) {
        if (ids[i] == -1 && empty_ok)
            continue;
        if (ids[i] < 0 || (uint32_t)ids[i] >= L->n_experts) {
            LOG_D("moe_ref: token %llu slot %u: expert id %d not in [0, %u)",
                  (unsigned long long)(i / L->top_k), (unsigned)(i % L->top_k), ids[i],
                  L->n_experts);
            return MOED_E_INVAL;
        }
    }
    return 0;
}

static int validate(const struct moe_layer *L, uint32_t T, const uint16_t *x, const int32_t *ids,
                    const float *w, const uint16_t *y, int empty_ok)
{
    if (!x || !w || !y)
        return MOED_E_INVAL;
    int rc = validate_layer(L, T);
    return rc ? rc : validate_ids(L, T, ids, empty_ok);
}

/* What a chunk computes: y (forward: every pair, combined), or rows (the
 * rows of the pairs it selects: routed slots with an id >= 0, shared slots
 * of the tokens t with (t0 + t) % ep_n == ep_shard when `shared`). */
struct chunk_out {
    uint16_t *y;   /* [T, H], or NULL: rows mode */
    float *rows;   /* [T * (k + S), H] */
    uint32_t t0, ep_n, ep_shard;
    int shared;
};

/* Is pair (t, s) of the chunk computed? */
static int pair_selected(const struct moe_layer *L, const struct chunk_out *o, const int32_t *ids,
                         uint32_t t, uint32_t s)
{
    const uint32_t k = L->top_k;
    if (s < k)
        return ids[(size_t)t * k + s] >= 0;
    return o->y || (o->shared && (o->t0 + t) % o->ep_n == o->ep_shard);
}

/* One chunk of at most MOE_REF_CHUNK_TOKENS tokens (validated). */
static int ref_chunk(const struct moe_layer *layer, uint32_t n_tokens, const uint16_t *x,
                     const int32_t *ids, const float *w, const struct chunk_out *o,
                     int n_threads)
{
    int rc = 0;

    const uint32_t H = layer->hidden, I = layer->inter, k = layer->top_k;
    const uint32_t S = layer->n_shared, NE = layer->n_experts + S;
    const uint32_t slots = k + S, P = n_tokens * slots;
    struct ref_job job = {0};
    struct ref_worker *workers = NULL;
    pthread_t *tids = NULL;
    uint32_t *pair_off = NULL, *pairs = NULL, *active = NULL, *fill = NULL;
    float *xf = NULL, *h = NULL, *scratch = NULL;

    pair_off = calloc((size_t)NE + 1, sizeof *pair_off);
    fill = calloc((size_t)NE, sizeof *fill);
    active = malloc((size_t)NE * sizeof *active);
    pairs = malloc((size_t)P * sizeof *pairs);
    xf = malloc((size_t)n_tokens * H * sizeof *xf);
    h = malloc((size_t)P * I * sizeof *h);
    if (!pair_off || !fill || !active || !pairs || !xf || !h) {
        rc = MOED_E_NOMEM;
        goto out_free;
    }

    /* Counting sort of pairs by expert; within an expert, pairs stay in
     * (token, slot) order. */
    for (uint32_t p = 0; p < P; p++) {
        uint32_t t = p / slots, s = p % slots;
        if (!pair_selected(layer, o, ids, t, s))
            continue;
        uint32_t e = s < k ? (uint32_t)ids[(size_t)t * k + s] : layer->n_experts + (s - k);
        pair_off[e + 1]++;
    }
    for (uint32_t e = 0; e < NE; e++)
        pair_off[e + 1] += pair_off[e];
    for (uint32_t p = 0; p < P; p++) {
        uint32_t t = p / slots, s = p % slots;
        if (!pair_selected(layer, o, ids, t, s))
            continue;
        uint32_t e = s < k ? (uint32_t)ids[(size_t)t * k + s] : layer->n_experts + (s - k);
        pairs[pair_off[e] + fill[e]++] = p;
    }
    uint32_t n_active = 0;
    for (uint32_t e = 0; e < NE; e++)
        if (pair_off[e + 1] > pair_off[e])
            active[n_active++] = e;
    for (size_t i = 0; i < (size_t)n_tokens * H; i++)
        xf[i] = bf16_to_float(x[i]);

    job.L = layer;
    job.T = n_tokens;
    job.slots = slots;
    job.x = xf;
    job.w = w;
    job.ids = ids;
    job.y = o->y;
    job.rows = o->rows;
    job.h = h;
    job.pair_off = pair_off;
    job.pairs = pairs;
    job.active = active;
    job.n_active = n_active;
    job.ph_blocks = (I + PH_ROWS - 1) / PH_ROWS;
    atomic_init(&job.next1, 0);
    atomic_init(&job.next2, 0);

    long nt = n_threads > 0 ? n_threads : sysconf(_SC_NPROCESSORS_ONLN);
    uint32_t max_items = n_active * job.ph_blocks;
    if (max_items < (H + PD_ROWS - 1) / PD_ROWS)
        max_items = (H + PD_ROWS - 1) / PD_ROWS;
    if (nt < 1)
        nt = 1;
    if (nt > MAX_THREADS)
        nt = MAX_THREADS;
    if ((uint32_t)nt > max_items)
        nt = max_items;

    /* the down phase's d [P * PD_ROWS] only when it combines */
    size_t per = (size_t)PD_ROWS * ((size_t)I + (o->y ? P : 0));
    if (per < 2 * (size_t)H)
        per = 2 * (size_t)H;
    workers = calloc((size_t)nt, sizeof *workers);
    tids = calloc((size_t)nt, sizeof *tids);
    scratch = malloc((size_t)nt * per * sizeof *scratch);
    if (!workers || !tids || !scratch) {
        rc = MOED_E_NOMEM;
        goto out_free;
    }
    for (long i = 0; i < nt; i++) {
        workers[i].job = &job;
        workers[i].scratch = scratch + (size_t)i * per;
    }
    /* Joining between the phases is the barrier: phase 2 reads h rows that
     * every thread wrote in phase 1. */
    run_phase(worker_gate_up, workers, tids, nt);
    run_phase(worker_down, workers, tids, nt);

out_free:
    free(scratch);
    free(tids);
    free(workers);
    free(h);
    free(xf);
    free(pairs);
    free(active);
    free(fill);
    free(pair_off);
    return rc;
}

int moe_ref_forward_flags(const struct moe_layer *layer, uint32_t n_tokens, const uint16_t *x,
                          const int32_t *ids, const float *w, uint16_t *y, int n_threads,
                          unsigned flags)
{
    struct moe_layer routed;
    if (layer && (flags & MOE_REF_ROUTED_ONLY)) {
        routed = *layer;
        routed.n_shared = 0;
        layer = &routed;
    }
    int rc = validate(layer, n_tokens, x, ids, w, y, (flags & MOE_REF_EMPTY_SLOTS) != 0);
    if (rc)
        return rc;
    const size_t H = layer->hidden, k = layer->top_k;
    for (uint32_t t0 = 0; t0 < n_tokens && rc == 0; t0 += MOE_REF_CHUNK_TOKENS) {
        uint32_t n = n_tokens - t0 < MOE_REF_CHUNK_TOKENS ? n_tokens - t0 : MOE_REF_CHUNK_TOKENS;
        struct chunk_out o = {.y = y + t0 * H};
        rc = ref_chunk(layer, n, x + t0 * H, ids + t0 * k, w + t0 * k, &o, n_threads);
    }
    return rc;
}

int moe_ref_rows(const struct moe_layer *layer, uint32_t n_tokens, const uint16_t *x,
                 const int32_t *ids, float *rows, uint32_t ep_n, uint32_t ep_shard,
                 int n_threads, unsigned flags)
{
    if (!x || !rows || ep_n == 0 || ep_shard >= ep_n)
        return MOED_E_INVAL;
    int rc = validate_layer(layer, n_tokens);
    if (!rc)
        rc = validate_ids(layer, n_tokens, ids, 1);
    if (rc)
        return rc;
    const size_t H = layer->hidden, k = layer->top_k, KS = k + layer->n_shared;
    for (uint32_t t0 = 0; t0 < n_tokens && rc == 0; t0 += MOE_REF_CHUNK_TOKENS) {
        uint32_t n = n_tokens - t0 < MOE_REF_CHUNK_TOKENS ? n_tokens - t0 : MOE_REF_CHUNK_TOKENS;
        struct chunk_out o = {.rows = rows + t0 * KS * H, .t0 = t0, .ep_n = ep_n,
                              .ep_shard = ep_shard, .shared = !(flags & MOE_REF_ROUTED_ONLY)};
        rc = ref_chunk(layer, n, x + t0 * H, ids + t0 * k, NULL, &o, n_threads);
    }
    return rc;
}

int moe_ref_combine(const struct moe_layer *layer, uint32_t n_tokens, const int32_t *ids,
                    const float *w, const float *rows, uint16_t *y, unsigned flags)
{
    if (!w || !rows || !y)
        return MOED_E_INVAL;
    int rc = validate_layer(layer, n_tokens);
    if (!rc)
        rc = validate_ids(layer, n_tokens, ids, (flags & MOE_REF_EMPTY_SLOTS) != 0);
    if (rc)
        return rc;
    const uint32_t k = layer->top_k, KS = k + layer->n_shared;
    combine(rows, layer->hidden, KS, flags & MOE_REF_ROUTED_ONLY ? k : KS, n_tokens, k, ids, w,
            layer->hidden, y, layer->hidden);
    return 0;
}

int moe_ref_forward(const struct moe_layer *layer, uint32_t n_tokens, const uint16_t *x,
                    const int32_t *ids, const float *w, uint16_t *y, int n_threads)
{
    return moe_ref_forward_flags(layer, n_tokens, x, ids, w, y, n_threads, 0);
}
