/* moe_io.h - the GPU op tests' harness (one translation unit includes it:
 * tests/gpu/test_moe_gpu.c): PASS/FAIL lines and their counts, random NVFP4
 * layers built in memory, batch buffers with guard regions, one batch run to
 * completion, and the check against the CPU reference (moe_ref_forward).
 */
#ifndef MOED_TESTS_GPU_MOE_IO_H
#define MOED_TESTS_GPU_MOE_IO_H

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "backend_cuda.h"
#include "backend_cuda_hooks.h"
#include "gpu/moe_cases.h"
#include "moe_ref.h"
#include "moed_err.h"
#include "moed_log.h"
#include "nvfp4.h"
static int n_pass, n_fail;

static void result(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void result(int ok, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("%s  ", ok ? "PASS" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    if (ok)
        n_pass++;
    else
        n_fail++;
}

/* A GPU test's start: warnings only in the log, guard regions around the
 * kernel's scratch (guards); 0 if no CUDA device is visible (the summary
 * line printed, one failure). */
static int gpu_test_start(int guards)
{
    moed_log_set_level(MOED_LOG_WARN);
    moed_backend_cuda_test_guards(guards);
    if (!moed_backend_cuda_available()) {
        printf("no CUDA device visible\ngpu tests: 0 passed, 1 failed\n");
        return 0;
    }
    return 1;
}

/* ---------------- random data ---------------- */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = (*s += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
static double rng_unif(uint64_t *s)
{
    return (rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}
static float rng_gauss(uint64_t *s)
{
    double u = rng_unif(s) + 1e-12, v = rng_unif(s);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

struct synth {
    struct moe_layer layer;
    struct moe_expert *ex;
    uint8_t *mem;
};

/* One matrix of random NVFP4: all codes uniform; scales mostly normal E4M3
 * near 1 (exponent field 5..8), 1/32 subnormal; scale_2 ~ 1/(3 sqrt(K)). */
static void rand_mat(struct nvfp4_mat *m, uint32_t n, uint32_t k, uint8_t **cursor, uint64_t *s)
{
    uint8_t *w = *cursor, *sc = w + (size_t)n * k / 2;
    *cursor = sc + (size_t)n * k / 16;
    for (size_t i = 0; i < (size_t)n * k / 2; i += 8) {
        uint64_t r = rng_next(s);
        memcpy(w + i, &r, 8);
    }
    for (size_t i = 0; i < (size_t)n * k / 16; i++) {
        uint64_t r = rng_next(s);
        uint8_t e = (r & 31) == 0 ? 0 : (uint8_t)(5 + (r >> 8) % 4);
        sc[i] = (uint8_t)((e << 3) | ((r >> 16) & 7));
        if (sc[i] == 0)
            sc[i] = 1; /* keep the block alive (smallest subnormal) */
    }
    m->n = n;
    m->k = k;
    m->w = w;
    m->scale = sc;
    m->scale_2 = (float)((0.5 + rng_unif(s)) / (3.0 * sqrt((double)k)));
    m->input_scale = 1.0f;
}

struct gen_job {
    struct synth *sy;
    const struct moe_shape *p;
    uint32_t e0, e1;
    uint64_t seed;
};

static void *gen_worker(void *arg)
{
    struct gen_job *j = arg;
    const uint64_t H = j->p->H, I = j->p->I;
    const uint64_t per = 2 * (I * H / 2 + I * H / 16) + (H * I / 2 + H * I / 16);
    for (uint32_t e = j->e0; e < j->e1; e++) {
        uint64_t s = j->seed * 1000003ull + e;
        uint8_t *cur = j->sy->mem + per * e;
        rand_mat(&j->sy->ex[e].gate, (uint32_t)I, (uint32_t)H, &cur, &s);
        rand_mat(&j->sy->ex[e].up, (uint32_t)I, (uint32_t)H, &cur, &s);
        rand_mat(&j->sy->ex[e].down, (uint32_t)H, (uint32_t)I, &cur, &s);
    }
    return NULL;
}

static int synth_make(struct synth *sy, const struct moe_shape *p, uint64_t seed)
{
    const uint32_t NE = p->E + p->S;
    const uint64_t per = 2 * ((uint64_t)p->I * p->H / 2 + (uint64_t)p->I * p->H / 16) +
                         ((uint64_t)p->H * p->I / 2 + (uint64_t)p->H * p->I / 16);
    memset(sy, 0, sizeof *sy);
    sy->ex = calloc(NE, sizeof *sy->ex);
    sy->mem = malloc(per * NE);
    if (!sy->ex || !sy->mem)
        return -1;
    pthread_t th[32];
    struct gen_job jobs[32];
    int nt = 16;
    for (int t = 0; t < nt; t++) {
        jobs[t] = (struct gen_job){sy, p, NE * t / nt, NE * (t + 1) / nt, seed};
        if (pthread_create(&th[t], NULL, gen_worker, &jobs[t]))
            return -1;
    }
    for (int t = 0; t < nt; t++)
        pthread_join(th[t], NULL);
    sy->layer = (struct moe_layer){p->H, p->I, p->E, p->S, p->k, sy->ex};
    return 0;
}

static void synth_free(struct synth *sy)
{
    free(sy->ex);
    free(sy->mem);
}

/* ---------------- batches ---------------- */

struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t done;
    uint64_t *count_by_user; /* optional: done count per batch index (user) */
};

static void on_done(void *ctx, struct moed_batch *b)
{
    struct waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->done++;
    if (w->count_by_user)
        w->count_by_user[(uintptr_t)b->user]++;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static int wait_done(struct waiter *w, uint64_t target, int timeout_s)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_s;
    pthread_mutex_lock(&w->mu);
    int rc = 0;
    while (w->done < target && rc == 0)
        rc = pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    int ok = w->done >= target;
    pthread_mutex_unlock(&w->mu);
    return ok ? 0 : -1;
}

/* One batch's buffers. y (and x, y in the backend's pinned memory with
 * B_PINNED) lies between two guard regions of IO_GUARD elements. */
#define IO_GUARD 128 /* elements (256 bytes: y stays 16-byte aligned) */
#define IO_GUARD_VAL 0x5a5au
struct io {
    uint32_t T, H, k;
    uint16_t *x, *y;
    int32_t *ids;
    float *w;
    int kind;                /* MOED_BUF_HOST or MOED_BUF_PINNED */
    unsigned ref_flags;      /* MOE_REF_EMPTY_SLOTS / MOE_REF_ROUTED_ONLY of the routing */
    struct moed_backend *be; /* the pinned memory's owner */
    uint16_t *xa, *ya;       /* the allocations: guard, buffer, guard */
};

static uint16_t *buf_get(struct io *io, size_t elems)
{
    size_t bytes = (elems + 2 * IO_GUARD) * 2;
    uint16_t *p = io->kind == MOED_BUF_PINNED ? io->be->ops->host_alloc(io->be, bytes) : malloc(bytes);
    if (p)
        for (size_t i = 0; i < elems + 2 * IO_GUARD; i++)
            p[i] = IO_GUARD_VAL;
    return p;
}
static void buf_put(struct io *io, uint16_t *p)
{
    if (p && io->kind == MOED_BUF_PINNED)
        io->be->ops->host_free(io->be, p);
    else
        free(p);
}

/* be != NULL and pinned: x and y in be's host_alloc memory (falls back to
 * ordinary memory when the backend offers none). */
static int io_alloc_on(struct io *io, uint32_t T, uint32_t H, uint32_t k, struct moed_backend *be,
                       int pinned)
{
    memset(io, 0, sizeof *io);
    io->T = T;
    io->H = H;
    io->k = k;
    io->be = be;
    io->kind = pinned && be && be->ops->host_alloc ? MOED_BUF_PINNED : MOED_BUF_HOST;
    io->xa = buf_get(io, (size_t)T * H);
    io->ya = buf_get(io, (size_t)T * H);
    if (io->kind == MOED_BUF_PINNED && (!io->xa || !io->ya)) {
        buf_put(io, io->xa);
        buf_put(io, io->ya);
        io->kind = MOED_BUF_HOST;
        io->xa = buf_get(io, (size_t)T * H);
        io->ya = buf_get(io, (size_t)T * H);
    }
    io->x = io->xa ? io->xa + IO_GUARD : NULL;
    io->y = io->ya ? io->ya + IO_GUARD : NULL;
    io->ids = malloc((size_t)T * k * 4);
    io->w = malloc((size_t)T * k * 4);
    return io->x && io->y && io->ids && io->w ? 0 : -1;
}
static int io_alloc(struct io *io, uint32_t T, uint32_t H, uint32_t k)
{
    return io_alloc_on(io, T, H, k, NULL, 0);
}
static void io_free(struct io *io)
{
    buf_put(io, io->xa);
    buf_put(io, io->ya);
    free(io->ids);
    free(io->w);
}
/* Guard elements around y that changed (0: intact). */
static uint32_t io_guard_errors(const struct io *io)
{
    uint32_t bad = 0;
    for (uint32_t i = 0; i < IO_GUARD; i++) {
        bad += io->ya[i] != IO_GUARD_VAL;
        bad += io->ya[IO_GUARD + (size_t)io->T * io->H + i] != IO_GUARD_VAL;
    }
    return bad;
}

#define rname moe_routing_name
static void io_fill(struct io *io, uint32_t E, enum moe_routing r, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t i = 0; i < (size_t)io->T * io->H; i++)
        io->x[i] = bf16_from_float(rng_gauss(&s));
    for (uint32_t t = 0; t < io->T; t++) {
        float sum = 0;
        for (uint32_t j = 0; j < io->k; j++) {
            int32_t e;
            if (r == R_SKEW) {
                e = (int32_t)j; /* every token on experts 0..k-1 */
            } else if (r == R_ALL) {
                e = (int32_t)((t * io->k + j) % E);
            } else {
                for (;;) { /* distinct experts per token */
                    e = (int32_t)(rng_next(&s) % E);
                    uint32_t q = 0;
                    while (q < j && io->ids[t * io->k + q] != e)
                        q++;
                    if (q == j)
                        break;
                }
            }
            io->ids[t * io->k + j] = e;
            io->w[t * io->k + j] = (float)(0.1 + rng_unif(&s));
            sum += io->w[t * io->k + j];
        }
        for (uint32_t j = 0; j < io->k; j++)
            io->w[t * io->k + j] /= sum;
    }
    io->ref_flags = (moe_routing_empty(r) ? MOE_REF_EMPTY_SLOTS : 0) |
                    (moe_routing_routed_only(r) ? MOE_REF_ROUTED_ONLY : 0);
    if (moe_routing_empty(r)) /* weights stay: an empty slot's weight is ignored */
        for (uint32_t t = 0; t < io->T; t++)
            for (uint32_t j = 0; j < io->k; j++)
                if (t % 5 == 4 || (t + j) % 3 == 1)
                    io->ids[t * io->k + j] = -1;
}

static void batch_of(struct moed_batch *b, struct io *io, uint32_t layer)
{
    memset(b, 0, sizeof *b);
    b->layer = layer;
    b->n_tokens = io->T;
    b->top_k = io->k;
    b->x = (struct moed_buf){io->kind, 0, io->x, (uint64_t)io->T * io->H * 2};
    b->ids = (struct moed_buf){MOED_BUF_HOST, 0, io->ids, (uint64_t)io->T * io->k * 4};
    b->w = (struct moed_buf){MOED_BUF_HOST, 0, io->w, (uint64_t)io->T * io->k * 4};
    b->y = (struct moed_buf){io->kind, 0, io->y, (uint64_t)io->T * io->H * 2};
    b->flags = (io->ref_flags & MOE_REF_ROUTED_ONLY) ? MOED_BATCH_ROUTED_ONLY : 0;
}

/* Submit one batch, wait for it. Returns its status, or a negative code if
 * submit failed or it timed out. */
static int run_batch(struct moed_backend *be, struct waiter *wt, struct io *io, uint32_t layer)
{
    struct moed_batch b;
    batch_of(&b, io, layer);
    for (size_t i = 0; i < (size_t)io->T * io->H; i++)
        io->y[i] = 0x7fc1; /* poison: NaN */
    uint64_t target = wt->done + 1;
    int rc = moed_backend_submit(be, &b);
    if (rc)
        return rc;
    if (wait_done(wt, target, 30)) {
        /* a hung kernel would make every later check time out as well */
        printf("FAIL  batch (T=%u) not completed in 30 s; stopping\n", io->T);
        printf("gpu tests: %d passed, %d failed\n", n_pass, n_fail + 1);
        fflush(stdout);
        _exit(1);
    }
    return b.status;
}

/* Reference on a sample of tokens: rel L2 over the sample; *nan counts NaN
 * outputs over all tokens. When the result misses `tol` (or a NaN is seen),
 * the first mismatching outputs are printed (NaN, or off by more than 4 tol
 * times the reference's RMS). */
static double check_ref(const struct moe_layer *L, struct io *io, uint32_t max_sample, int *nan,
                        double tol)
{
    const uint32_t H = io->H, k = io->k;
    uint32_t ns = io->T < max_sample ? io->T : max_sample;
    uint32_t *pick = malloc(ns * sizeof *pick);
    uint16_t *xs = malloc((size_t)ns * H * 2), *yr = malloc((size_t)ns * H * 2);
    int32_t *is = malloc((size_t)ns * k * 4);
    float *ws = malloc((size_t)ns * k * 4);
    double num = 0, den = 0;
    int ref_ok = 0;
    *nan = 0;
    for (size_t i = 0; i < (size_t)io->T * H; i++)
        if (isnan(bf16_to_float(io->y[i])))
            (*nan)++;
    for (uint32_t i = 0; i < ns; i++) {
        pick[i] = ns == io->T ? i : (uint32_t)(((uint64_t)i * io->T) / ns + (i * 7) % (io->T / ns));
        memcpy(xs + (size_t)i * H, io->x + (size_t)pick[i] * H, (size_t)H * 2);
        memcpy(is + (size_t)i * k, io->ids + (size_t)pick[i] * k, (size_t)k * 4);
        memcpy(ws + (size_t)i * k, io->w + (size_t)pick[i] * k, (size_t)k * 4);
    }
    if (moe_ref_forward_flags(L, ns, xs, is, ws, yr, 0, io->ref_flags) != 0) {
        num = 1e9;
        den = 1;
    } else {
        ref_ok = 1;
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t c = 0; c < H; c++) {
                double r = bf16_to_float(yr[(size_t)i * H + c]);
                double g = bf16_to_float(io->y[(size_t)pick[i] * H + c]);
                num += (g - r) * (g - r);
                den += r * r;
            }
    }
    double rel = den > 0 ? sqrt(num / den) : (num > 0 ? 1e9 : 0);
    if (ref_ok && (!(rel < tol) || *nan)) {
        const double lim = 4 * tol * sqrt(den / ((double)ns * H));
        int shown = 0;
        for (uint32_t i = 0; i < ns && shown < 5; i++)
            for (uint32_t c = 0; c < H && shown < 5; c++) {
                double r = bf16_to_float(yr[(size_t)i * H + c]);
                double g = bf16_to_float(io->y[(size_t)pick[i] * H + c]);
                if (isnan(g) || fabs(g - r) > lim) {
                    printf("      mismatch: token %u column %u: got %.6g, reference %.6g\n",
                           pick[i], c, g, r);
                    shown++;
                }
            }
    }
    free(pick);
    free(xs);
    free(yr);
    free(is);
    free(ws);
    return rel;
}

#endif
