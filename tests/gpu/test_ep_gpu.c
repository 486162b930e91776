/* test_ep_gpu.c - expert parallelism on one GPU: the kernel's ROWS and
 * COMBINE batches and the CUDA backend as a device with a partial placement
 * (engine/backend.h MOED_BATCH_ROWS / _COMBINE, cfg.ep_place).
 *
 *   gpu_test_ep_gpu [--quick]
 *
 * Checks, each one PASS/FAIL line, then "gpu tests: N passed, N failed":
 *   - rows: for shapes with and without shared experts, T = 1, 5, 16, 64,
 *     256, routings uniform, empty slots, routed-only and both, the entries
 *     split over 2 and 3 devices by moed_ep_assign (a balanced placement
 *     with replicas): one ROWS batch per device (its entries' ids, -1
 *     elsewhere) into one rows buffer in device memory (NaN before), then one COMBINE
 *     batch: y equal bit for bit to the plain batch's, guard regions intact;
 *   - shard: two backends on this GPU (sm_share 2), each with a skewed
 *     partial placement (cfg.ep_place: only its experts placed), the same
 *     batches: equal bit for bit to a backend with every expert (itself
 *     checked against the CPU reference); a ROWS
 *     batch naming an expert not placed on its device, and a plain batch,
 *     refused with MOED_E_INVAL.
 * --quick: the tiny shape only (for compute-sanitizer).
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "backend_cuda.h"
#include "backend_cuda_hooks.h"
#include "gpu/moe_cases.h"
#include "moed_err.h"
#include "moed_log.h"
#include "placement.h"

#include "gpu/moe_io.h"

static const uint32_t g_T[] = {1, 5, 16, 64, 256};
static const enum moe_routing g_routing[] = {R_UNIFORM, R_EMPTY, R_ROUTED, R_EMPTY_ROUTED};
enum { MAX_T = 256 };

static struct moed_backend_cfg cfg_of(void)
{
    static const int gpu0[1] = {0};
    struct moed_backend_cfg c = {0};
    c.gpus = gpu0;
    c.n_gpus = 1;
    c.max_tokens = MAX_T;
    c.batch_deadline_ms = 20000;
    return c;
}

static struct moed_backend *open_on(struct synth *sy, const struct moe_shape *p,
                                    const struct moed_backend_cfg *c, struct waiter *wt,
                                    char *err, size_t errlen)
{
    const struct moe_layer *ls[1] = {&sy->layer};
    const uint32_t ids[1] = {3};
    struct moed_cuda_src src = {0};
    src.n_layers = 1;
    src.layers = ls;
    src.layer_ids = ids;
    src.dims = (struct moe_gpu_dims){p->H, p->I, p->E, p->S, p->k, c->max_tokens};
    struct moed_backend *be = NULL;
    if (moed_backend_cuda_open_src(&src, c, on_done, wt, &be, err, errlen))
        return NULL;
    return be;
}

/* rows [T * KS, H] all NaN (a missed entry shows), by a copy: a memset is a
 * kernel, which would wait for the resident persistent kernel forever */
static int rows_poison(float *rows, size_t n)
{
    static uint32_t nan[1 << 16];
    if (nan[0] == 0)
        for (size_t i = 0; i < sizeof nan / sizeof nan[0]; i++)
            nan[i] = 0xffffffffu;
    for (size_t o = 0; o < n; o += sizeof nan / sizeof nan[0]) {
        size_t c = n - o < sizeof nan / sizeof nan[0] ? n - o : sizeof nan / sizeof nan[0];
        if (cudaMemcpy(rows + o, nan, c * 4, cudaMemcpyHostToDevice) != cudaSuccess)
            return -1;
    }
    return 0;
}

/* One ROWS batch of device `dev` (its entries of dev_of; ids -1 elsewhere)
 * or (dev < 0) the COMBINE batch, on be; its status. */
static int run_ep(struct moed_backend *be, struct waiter *wt, struct io *io, uint32_t S,
                  const uint8_t *dev_of, int dev, uint32_t n_dev, float *rows, int32_t *ids_dev)
{
    const uint32_t T = io->T, k = io->k, KS = k + S;
    struct moed_batch b;
    batch_of(&b, io, 3);
    b.rows = (struct moed_buf){MOED_BUF_DEVICE, 0, rows, (uint64_t)T * KS * io->H * 4};
    if (dev >= 0) {
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t j = 0; j < k; j++)
                ids_dev[t * k + j] = dev_of[t * KS + j] == dev ? io->ids[t * k + j] : -1;
        b.ids.ptr = ids_dev;
        b.flags |= MOED_BATCH_ROWS;
        b.ep_n = n_dev;
        b.ep_shard = (uint32_t)dev;
        b.y = (struct moed_buf){0}; /* not written */
    } else {
        b.flags |= MOED_BATCH_COMBINE;
        b.x = (struct moed_buf){0}; /* not read */
    }
    uint64_t target = wt->done + 1;
    int rc = moed_backend_submit(be, &b);
    if (rc)
        return rc;
    if (wait_done(wt, target, 30)) {
        printf("FAIL  EP batch (T=%u) not completed in 30 s; stopping\n", T);
        printf("gpu tests: %d passed, %d failed\n", n_pass, n_fail + 1);
        fflush(stdout);
        _exit(1);
    }
    return b.status;
}

/* The rows check on one shape: every T, routing and device count. */
static void test_rows(const struct moe_shape *p)
{
    struct synth sy;
    struct waiter wt = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, NULL};
    char err[MOED_ERRLEN] = "";
    const uint32_t KS = p->k + p->S;
    if (synth_make(&sy, p, 41)) {
        result(0, "rows %s: cannot build the layer", p->name);
        return;
    }
    /* device memory allocated and freed with no persistent kernel resident */
    float *rows = NULL;
    if (cudaMalloc((void **)&rows, (size_t)MAX_T * KS * p->H * 4) != cudaSuccess)
        rows = NULL;
    struct moed_backend_cfg c = cfg_of();
    struct moed_backend *be = rows ? open_on(&sy, p, &c, &wt, err, sizeof err) : NULL;
    uint16_t *yref = malloc((size_t)MAX_T * p->H * 2);
    int32_t *ids_dev = malloc((size_t)MAX_T * p->k * 4);
    uint8_t *dev_of = malloc((size_t)MAX_T * KS);
    uint32_t *seen = calloc(p->E, sizeof *seen), count[MOED_PLACE_MAX_DEVS];
    uint64_t *load = calloc(p->E, sizeof *load);
    if (!be || !yref || !ids_dev || !dev_of || !seen || !load) {
        result(0, "rows %s: setup: %s", p->name, err);
        goto out;
    }
    for (uint32_t e = 0; e < p->E; e++)
        load[e] = e < 2 ? 1000 : 10; /* two hot experts: replicated */
    for (uint32_t n_dev = 2; n_dev <= 3; n_dev++) {
        struct moed_placement pl;
        if (moed_placement_balanced(p->E, p->S, n_dev, load, n_dev, 0.5, &pl, err, sizeof err)) {
            result(0, "rows %s: placement: %s", p->name, err);
            continue;
        }
        for (size_t ti = 0; ti < sizeof g_T / sizeof g_T[0]; ti++)
            for (size_t ri = 0; ri < sizeof g_routing / sizeof g_routing[0]; ri++) {
                const uint32_t T = g_T[ti];
                const enum moe_routing rt = g_routing[ri];
                struct io io;
                if (io_alloc(&io, T, p->H, p->k)) {
                    result(0, "rows %s: buffers", p->name);
                    io_free(&io);
                    continue;
                }
                io_fill(&io, p->E, rt, 7000 + 10 * T + ri);
                int s0 = run_batch(be, &wt, &io, 3);
                memcpy(yref, io.y, (size_t)T * p->H * 2);
                int rc = moed_ep_assign(&pl, T, p->k, io.ids, dev_of, count, seen);
                int st = s0 || rc || rows_poison(rows, (size_t)T * KS * p->H);
                for (uint32_t d = 0; d < n_dev && !st; d++)
                    st = run_ep(be, &wt, &io, p->S, dev_of, (int)d, n_dev, rows, ids_dev);
                for (size_t i = 0; i < (size_t)T * p->H; i++)
                    io.y[i] = 0x7fc1;
                if (!st)
                    st = run_ep(be, &wt, &io, p->S, dev_of, -1, n_dev, rows, ids_dev);
                size_t diff = 0;
                for (size_t i = 0; i < (size_t)T * p->H; i++)
                    diff += io.y[i] != yref[i];
                char gerr[MOED_ERRLEN] = "";
                int grc = moed_backend_cuda_check_guards(be, gerr, sizeof gerr);
                result(st == 0 && diff == 0 && grc == 0 && io_guard_errors(&io) == 0,
                       "rows %s/T=%u/%s over %u devices: ROWS + COMBINE = plain batch, %zu of %zu "
                       "outputs differ, status %d %s", p->name, T, rname[rt], n_dev, diff,
                       (size_t)T * p->H, st, gerr);
                io_free(&io);
            }
        moed_placement_free(&pl);
    }
out:
    if (be)
        moed_backend_close(be);
    cudaFree(rows);
    free(yref);
    free(ids_dev);
    free(dev_of);
    free(seen);
    free(load);
    synth_free(&sy);
}

/* Two devices with partial placements on this GPU against the full one. */
static void test_shard(const struct moe_shape *p)
{
    enum { N = 2 };
    struct synth sy;
    struct waiter wt = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, NULL};
    char err[MOED_ERRLEN] = "";
    const uint32_t KS = p->k + p->S, NT = sizeof g_T / sizeof g_T[0];
    struct moed_backend *full = NULL, *dev[N] = {NULL, NULL};
    struct moed_placement pl = {0};
    const struct moed_placement *places[4] = {NULL, NULL, NULL, &pl}; /* layer 3 */
    uint16_t *yref[sizeof g_T / sizeof g_T[0]] = {NULL};
    struct io io[sizeof g_T / sizeof g_T[0]];
    float *rows = NULL;
    int32_t *ids_dev = malloc((size_t)MAX_T * p->k * 4);
    uint8_t *dev_of = malloc((size_t)MAX_T * KS);
    uint32_t *seen = calloc(p->E, sizeof *seen), count[N];
    int64_t **lists = calloc(p->E, sizeof *lists);
    uint32_t *lens = calloc(p->E, sizeof *lens);
    memset(io, 0, sizeof io);
    if (synth_make(&sy, p, 43) || !ids_dev || !dev_of || !seen || !lists || !lens ||
        cudaMalloc((void **)&rows, (size_t)MAX_T * KS * p->H * 4) != cudaSuccess) {
        result(0, "shard %s: setup", p->name);
        goto out;
    }
    /* skewed: device 1 holds experts 0..2 only, expert 0 on both */
    for (uint32_t e = 0; e < p->E; e++) {
        lists[e] = calloc(2, sizeof **lists);
        if (!lists[e])
            goto out;
        lens[e] = 1;
        lists[e][0] = e < 3 ? 1 : 0;
        if (e == 0)
            lists[e][lens[e]++] = 0;
    }
    if (moed_placement_from_lists(p->E, p->S, N, (const int64_t *const *)lists, lens, &pl, err,
                                  sizeof err)) {
        result(0, "shard %s: placement: %s", p->name, err);
        goto out;
    }
    struct moed_backend_cfg c = cfg_of();
    full = open_on(&sy, p, &c, &wt, err, sizeof err);
    if (!full) {
        result(0, "shard %s: open the full backend: %s", p->name, err);
        goto out;
    }
    for (uint32_t ti = 0; ti < NT; ti++) {
        yref[ti] = malloc((size_t)g_T[ti] * p->H * 2);
        if (!yref[ti] || io_alloc(&io[ti], g_T[ti], p->H, p->k))
            goto out;
        io_fill(&io[ti], p->E, ti % 2 ? R_EMPTY : R_UNIFORM, 9100 + ti);
        int nan = 0, st = run_batch(full, &wt, &io[ti], 3);
        double rel = st ? 1e9 : check_ref(&sy.layer, &io[ti], 64, &nan, MOE_TOL);
        if (st || nan || !(rel < MOE_TOL)) {
            result(0, "shard %s: the full backend T=%u: status %d, rel L2 %.2e, NaN %d", p->name,
                   g_T[ti], st, rel, nan);
            goto out;
        }
        memcpy(yref[ti], io[ti].y, (size_t)g_T[ti] * p->H * 2);
    }
    moed_backend_close(full);
    full = NULL;
    c.ep_place = places;
    c.sm_share = N;
    for (uint32_t d = 0; d < N; d++) {
        c.ep_shard = d;
        dev[d] = open_on(&sy, p, &c, &wt, err, sizeof err);
        if (!dev[d]) {
            result(0, "shard %s: open device %u: %s", p->name, d, err);
            goto out;
        }
    }
    for (uint32_t ti = 0; ti < NT; ti++) {
        const uint32_t T = g_T[ti];
        int st = moed_ep_assign(&pl, T, p->k, io[ti].ids, dev_of, count, seen);
        if (!st)
            st = rows_poison(rows, (size_t)T * KS * p->H);
        for (uint32_t d = 0; d < N && !st; d++)
            st = run_ep(dev[d], &wt, &io[ti], p->S, dev_of, (int)d, N, rows, ids_dev);
        for (size_t i = 0; i < (size_t)T * p->H; i++)
            io[ti].y[i] = 0x7fc1;
        if (!st)
            st = run_ep(dev[0], &wt, &io[ti], p->S, dev_of, -1, N, rows, ids_dev);
        size_t diff = 0;
        for (size_t i = 0; i < (size_t)T * p->H; i++)
            diff += io[ti].y[i] != yref[ti][i];
        result(st == 0 && diff == 0,
               "shard %s/T=%u: 2 devices with partial placements = every expert on one, %zu of "
               "%zu outputs differ, status %d", p->name, T, diff, (size_t)T * p->H, st);
    }
    /* refusals: expert 5 lives on device 0 only; a plain batch on a device */
    {
        struct io *q = &io[1];
        for (uint32_t i = 0; i < q->T * p->k; i++)
            ids_dev[i] = -1;
        ids_dev[0] = 5;
        struct moed_batch b;
        batch_of(&b, q, 3);
        b.ids.ptr = ids_dev;
        b.flags |= MOED_BATCH_ROWS;
        b.ep_n = N;
        b.ep_shard = 1;
        b.rows = (struct moed_buf){MOED_BUF_DEVICE, 0, rows, (uint64_t)q->T * KS * p->H * 4};
        int r1 = moed_backend_submit(dev[1], &b);
        batch_of(&b, q, 3);
        int r2 = moed_backend_submit(dev[1], &b);
        result(r1 == MOED_E_INVAL && r2 == MOED_E_INVAL,
               "shard %s: ROWS naming an expert not placed here refused (%d), a plain batch "
               "refused (%d)", p->name, r1, r2);
    }
out:
    for (uint32_t d = 0; d < N; d++)
        if (dev[d])
            moed_backend_close(dev[d]);
    if (full)
        moed_backend_close(full);
    for (uint32_t ti = 0; ti < NT; ti++) {
        free(yref[ti]);
        if (io[ti].ids)
            io_free(&io[ti]);
    }
    if (lists)
        for (uint32_t e = 0; e < p->E; e++)
            free(lists[e]);
    free(lists);
    free(lens);
    moed_placement_free(&pl);
    cudaFree(rows);
    free(ids_dev);
    free(dev_of);
    free(seen);
    synth_free(&sy);
}

int main(int argc, char **argv)
{
    int quick = argc > 1 && !strcmp(argv[1], "--quick");
    if (moe_shapes_resolve())
        return 2;
    if (!gpu_test_start(1))
        return 1;
    /* tiny: one shared expert; e60-h320-i192: two; e60-h1024-i320: none */
    const char *shapes[] = {"tiny", "e60-h320-i192", "e60-h1024-i320"};
    for (size_t i = 0; i < (quick ? 1u : sizeof shapes / sizeof shapes[0]); i++) {
        const struct moe_shape *p = moe_shape_find(shapes[i]);
        test_rows(p);
        test_shard(p);
    }
    printf("gpu tests: %d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
