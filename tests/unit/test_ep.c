/* test_ep.c - the expert-parallel backend (engine/backend_ep.c) over CPU
 * children, against one CPU backend: the same output bit for bit over 2, 3
 * and 4 devices (balanced placement, a skewed map, hot experts replicated)
 * at T = 1..256 with shared experts, routed-only and empty slots; a child
 * that fails a batch (a stub around a CPU child) fails that batch with its
 * code and the next one is right; close with batches queued calls done
 * once for each; bad configurations are refused with their message; a CPU
 * child refuses an expert that has no replica on its device.
 *
 * The rows buffer is filled with a NaN pattern before every EP batch: a row
 * that no child wrote and the combine read would show as NaN in y. */
#include <check.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "placement.h"
#include "check_main.h"
#include "gen_fixture.h"

#define TMAX 256u
#define ROW_NAN 0x7fc0dead

/* ---- completions: done() counts per batch, waits on a condition ---------- */

struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t n_done;
    uint32_t per[64]; /* done calls per batch (b->user indexes it) */
};

static void waiter_init(struct waiter *w)
{
    memset(w, 0, sizeof *w);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
}

static void on_done(void *ctx, struct moed_batch *b)
{
    struct waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->n_done++;
    w->per[(uintptr_t)b->user % 64]++;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void wait_for(struct waiter *w, uint32_t n)
{
    pthread_mutex_lock(&w->mu);
    while (w->n_done < n)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

/* ---- the children: CPU backends, or a stub around one that fails -------- */

enum stub_mode { STUB_NONE, STUB_FAIL_ROWS, STUB_FAIL_COMBINE, STUB_REFUSE };

struct stub {
    struct moed_backend base;
    struct moed_backend *inner;
    enum stub_mode mode;
    int code;
    int times;          /* batches still to fail (then it passes them) */
    int *closes;        /* counts close() */
    int ktime;          /* reports kernel times: ROWS 1000 * (device + 1) ns, COMBINE 7 */
    int sick;           /* healthy() answers 0 */
    uint32_t dev;
};

struct children {
    struct moed_model *m;
    const struct moed_placement *const *place;
    uint32_t stub_dev;  /* the device that is a stub (mode != STUB_NONE) */
    enum stub_mode mode;
    int code, times;
    uint32_t fail_open; /* open_child of this device fails (UINT32_MAX: none) */
    int closes;         /* stub closes */
    int opened;
    int ktime;          /* every device a stub reporting kernel times ... */
    uint32_t ktime_unknown; /* ... except this one's (0: not known) */
    uint32_t sick_dev;  /* with ktime: this device is not healthy */
};

static void stub_done(void *ctx, struct moed_batch *b)
{
    struct stub *s = ctx;
    const unsigned want = s->mode == STUB_FAIL_ROWS ? MOED_BATCH_ROWS : MOED_BATCH_COMBINE;
    if (s->mode != STUB_REFUSE && (b->flags & want) && s->times > 0) {
        s->times--;
        b->status = s->code;
        b->kernel_ns = 0;
    }
    if (s->ktime && b->status == 0)
        b->kernel_ns = (b->flags & MOED_BATCH_ROWS) ? 1000u * (s->dev + 1) : 7;
    s->base.done(s->base.done_ctx, b);
}

static int stub_submit(struct moed_backend *be, struct moed_batch *b)
{
    struct stub *s = (struct stub *)be;
    if (s->mode == STUB_REFUSE && (b->flags & MOED_BATCH_ROWS) && s->times > 0) {
        s->times--;
        return s->code;
    }
    return moed_backend_submit(s->inner, b);
}

static int stub_healthy(struct moed_backend *be)
{
    return !((struct stub *)be)->sick;
}

static uint64_t stub_heartbeat(struct moed_backend *be)
{
    return 42 + ((struct stub *)be)->dev;
}

static void stub_close(struct moed_backend *be)
{
    struct stub *s = (struct stub *)be;
    moed_backend_close(s->inner);
    (*s->closes)++;
    free(s);
}

static const struct moed_backend_ops stub_ops = {
    .name = "stub", .submit = stub_submit, .healthy = stub_healthy, .close = stub_close};
/* with kernel times: a heartbeat as well (42 + its device) */
static const struct moed_backend_ops stub_hb_ops = {.name = "stub",
                                                    .submit = stub_submit,
                                                    .healthy = stub_healthy,
                                                    .heartbeat = stub_heartbeat,
                                                    .close = stub_close};

static int cpu_child(struct children *c, uint32_t i, moed_backend_done_fn done, void *ctx,
                     struct moed_backend **out, char *err, size_t errlen)
{
    struct moed_backend_cfg bc = {.n_threads = 1, .max_tokens = TMAX, .ep_place = c->place,
                                  .ep_shard = i};
    return moed_backend_cpu_open(c->m, &bc, done, ctx, out, err, errlen);
}

static int open_child(void *ctx, uint32_t i, moed_backend_done_fn done, void *done_ctx,
                      struct moed_backend **out, char *err, size_t errlen)
{
    struct children *c = ctx;
    if (i == c->fail_open)
        return moed_seterr(err, errlen, MOED_E_IO, "test: device %u is unplugged", i);
    c->opened++;
    if ((c->mode == STUB_NONE || i != c->stub_dev) && !c->ktime)
        return cpu_child(c, i, done, done_ctx, out, err, errlen);
    struct stub *s = calloc(1, sizeof *s);
    ck_assert_ptr_nonnull(s);
    *s = (struct stub){.base = {c->ktime ? &stub_hb_ops : &stub_ops, done, done_ctx},
                       .sick = c->ktime && i == c->sick_dev, .mode = c->mode, .code = c->code,
                       .times = i == c->stub_dev ? c->times : 0, .closes = &c->closes,
                       .ktime = c->ktime && i != c->ktime_unknown, .dev = i};
    int rc = cpu_child(c, i, stub_done, s, &s->inner, err, errlen);
    ck_assert_int_eq(rc, 0);
    *out = &s->base;
    return 0;
}

/* ---- the fixture: model, reference backend, batches, rows buffer -------- */

static struct gen_fx fx;
static struct waiter ref_w;
static struct moed_backend *ref;
static uint16_t *xb, *yref, *yep;
static int32_t *idb;
static float *wb;
static uint32_t *rows;
static size_t rows_bytes;
static uint32_t H, K, KS, E, S;

static void setup(void)
{
    char err[MOED_ERRLEN] = "";
    gen_fx_open(&fx, 21);
    const struct moe_layer *L = moed_model_layer(fx.m, 0);
    H = L->hidden;
    K = L->top_k;
    S = L->n_shared;
    KS = K + S;
    E = L->n_experts;
    waiter_init(&ref_w);
    struct moed_backend_cfg bc = {.n_threads = 1, .max_tokens = TMAX};
    ck_assert_msg(moed_backend_cpu_open(fx.m, &bc, on_done, &ref_w, &ref, err, sizeof err) == 0,
                  "%s", err);
    xb = malloc((size_t)TMAX * H * sizeof *xb);
    yref = malloc((size_t)TMAX * H * sizeof *yref);
    yep = malloc((size_t)TMAX * H * sizeof *yep);
    idb = malloc((size_t)TMAX * K * sizeof *idb);
    wb = malloc((size_t)TMAX * K * sizeof *wb);
    rows_bytes = (size_t)TMAX * KS * H * sizeof(float);
    rows = malloc(rows_bytes);
    ck_assert(xb && yref && yep && idb && wb && rows);
}

static void teardown(void)
{
    moed_backend_close(ref);
    free(xb);
    free(yref);
    free(yep);
    free(idb);
    free(wb);
    free(rows);
    gen_fx_close(&fx);
}

static struct moed_buf hbuf(void *p, size_t bytes)
{
    return (struct moed_buf){MOED_BUF_HOST, 0, p, bytes};
}

static struct moed_batch batch(uint32_t layer, uint32_t T, uint32_t flags, uint16_t *y,
                               uintptr_t user)
{
    return (struct moed_batch){.seq = user, .layer = layer, .n_tokens = T, .top_k = K,
                               .x = hbuf(xb, (size_t)T * H * 2), .ids = hbuf(idb, (size_t)T * K * 4),
                               .w = hbuf(wb, (size_t)T * K * 4), .y = hbuf(y, (size_t)T * H * 2),
                               .flags = flags, .user = (void *)user};
}

/* Submit b to be and wait for its done; its status. */
static int run_on(struct moed_backend *be, struct waiter *w, struct moed_batch *b)
{
    pthread_mutex_lock(&w->mu);
    uint32_t before = w->n_done;
    pthread_mutex_unlock(&w->mu);
    int rc = moed_backend_submit(be, b);
    if (rc)
        return rc;
    wait_for(w, before + 1);
    return b->status;
}

static void fill_rows_nan(void)
{
    for (size_t i = 0; i < rows_bytes / 4; i++)
        rows[i] = ROW_NAN;
}

static struct moed_ep_cfg ep_cfg(struct children *c, uint32_t n_dev,
                                 const struct moed_placement *const *place)
{
    return (struct moed_ep_cfg){.n_dev = n_dev, .open_child = open_child, .open_ctx = c,
                                .place = place, .n_layers = GEN_LAYERS,
                                .rows = hbuf(rows, rows_bytes), .max_tokens = TMAX};
}

/* ---- placements ---------------------------------------------------------- */

enum { PL_BALANCED, PL_MAP, PL_HOT, PL__COUNT };
static const char *const pl_names[PL__COUNT] = {"balanced", "skewed map", "hot replicated"};

/* Layer l of n_dev devices, kind pk. The map puts most experts on device
 * 0, expert E-1 on every device but 0, one expert alone on the last device;
 * layer 1 shifts it by one expert. Hot: expert 1 carries most of the load
 * and is replicated on every device. */
static void make_place(int pk, uint32_t n_dev, uint32_t l, struct moed_placement *out)
{
    char err[MOED_ERRLEN] = "";
    uint64_t load[64] = {0};
    ck_assert_uint_le(E, 64);
    int rc;
    if (pk == PL_MAP) {
        int64_t lists[64][MOED_PLACE_MAX_DEVS];
        const int64_t *lp[64];
        uint32_t lens[64];
        for (uint32_t e = 0; e < E; e++) {
            const uint32_t ee = (e + l) % E;
            lens[e] = 0;
            if (ee == E - 1) {
                for (uint32_t d = 1; d < n_dev; d++)
                    lists[e][lens[e]++] = d;
            } else if (ee == E - 2) {
                lists[e][lens[e]++] = n_dev - 1;
            } else {
                lists[e][lens[e]++] = 0;
                if (ee % 3 == 1 && n_dev > 2)
                    lists[e][lens[e]++] = 2;
            }
            lp[e] = lists[e];
        }
        rc = moed_placement_from_lists(E, S, n_dev, lp, lens, out, err, sizeof err);
    } else {
        if (pk == PL_HOT) {
            for (uint32_t e = 0; e < E; e++)
                load[e] = 10 + e;
            load[1 + l] = 1000;
        }
        rc = moed_placement_balanced(E, S, n_dev, load, pk == PL_HOT ? n_dev : 1, 1.0, out,
                                     err, sizeof err);
    }
    ck_assert_msg(rc == 0, "%s", err);
    if (pk == PL_HOT)
        ck_assert_uint_eq(out->n_rep[1 + l], n_dev); /* the hot expert is on every device */
}

/* Both MoE layers placed on n_dev devices, kind pk. */
struct places {
    struct moed_placement pl[GEN_LAYERS];
    const struct moed_placement *p[GEN_LAYERS];
};

static void places_make(struct places *P, int pk, uint32_t n_dev)
{
    for (uint32_t l = 0; l < GEN_LAYERS; l++) {
        make_place(pk, n_dev, l, &P->pl[l]);
        P->p[l] = &P->pl[l];
    }
}

static void places_free(struct places *P)
{
    for (uint32_t l = 0; l < GEN_LAYERS; l++)
        moed_placement_free(&P->pl[l]);
}

/* The EP backend over ch's children (n_dev devices, ch->place), up to
 * max_tokens, done() into ew. */
static struct moed_backend *ep_open_ok(struct children *ch, uint32_t n_dev, uint32_t max_tokens,
                                       struct waiter *ew)
{
    waiter_init(ew);
    struct moed_ep_cfg cfg = ep_cfg(ch, n_dev, ch->place);
    cfg.max_tokens = max_tokens;
    struct moed_backend *ep = NULL;
    char err[MOED_ERRLEN] = "";
    ck_assert_msg(moed_backend_ep_open(fx.m, &cfg, on_done, ew, &ep, err, sizeof err) == 0, "%s",
                  err);
    return ep;
}

/* ---- EP == one CPU backend, bit for bit ---------------------------------- */

static const uint32_t Ts[] = {1, 2, 5, 16, 64, 256};

START_TEST(test_ep_equals_one_device)
{
    const uint32_t n_dev = (uint32_t)_i;
    uint64_t seed = 1000 + n_dev;
    for (int pk = 0; pk < PL__COUNT; pk++) {
        struct places P;
        places_make(&P, pk, n_dev);
        struct children ch = {.m = fx.m, .place = P.p, .fail_open = UINT32_MAX};
        struct waiter ew;
        struct moed_backend *ep = ep_open_ok(&ch, n_dev, TMAX, &ew);
        /* the ops: healthy while the children are, no heartbeat (child 0 is a
         * CPU backend), no host memory, zero-copy or channels under EP */
        const struct moed_backend_ops *ops = ep->ops;
        ck_assert_int_eq(ops->healthy(ep), 1);
        ck_assert(!ops->heartbeat && !ops->host_alloc && !ops->host_free && !ops->ipc_open &&
                  !ops->device_uuid && !ops->chan_open);
        char desc[1024], want[64];
        ops->describe(ep, desc, sizeof desc);
        snprintf(want, sizeof want, "ep: %u devices", n_dev);
        ck_assert_msg(strstr(desc, want) != NULL, "'%s' lacks '%s'", desc, want);
        snprintf(want, sizeof want, "; device %u: cpu: reference kernel, 1 threads", n_dev - 1);
        ck_assert_msg(strstr(desc, want) != NULL, "'%s' lacks '%s'", desc, want);
        uint32_t n = 0;
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++)
            for (int v = 0; v < 3; v++) { /* shared + routed, routed only, empty slots */
                const uint32_t T = Ts[ti], l = (uint32_t)(ti + v) % GEN_LAYERS;
                const uint32_t fl = v == 1 ? MOED_BATCH_ROUTED_ONLY : 0;
                gen_batch(moed_model_layer(fx.m, l), T, &seed, v == 2 ? 3 : 0, xb, idb, wb);
                struct moed_batch rb = batch(l, T, fl, yref, n);
                ck_assert_int_eq(run_on(ref, &ref_w, &rb), 0);
                fill_rows_nan();
                memset(yep, 0xff, (size_t)T * H * 2);
                struct moed_batch eb = batch(l, T, fl, yep, n);
                ck_assert_msg(run_on(ep, &ew, &eb) == 0, "%u devices, %s, T %u, variant %d: "
                              "status %d", n_dev, pl_names[pk], T, v, eb.status);
                ck_assert_msg(memcmp(yep, yref, (size_t)T * H * 2) == 0,
                              "%u devices, %s, T %u, variant %d: EP output differs from one "
                              "CPU backend", n_dev, pl_names[pk], T, v);
                n++;
            }
        ck_assert_uint_eq(ew.n_done, n);
        moed_backend_close(ep);
        places_free(&P);
    }
}
END_TEST

/* ---- a child that fails ---------------------------------------------------- */

/* 3 devices, balanced; device `dev` is a stub in `mode` failing its first
 * batch with `code`: the first batch (T 16: every device has entries) gets
 * that code, the second (queued behind it) is right. */
static void child_fails(uint32_t dev, enum stub_mode mode, int code)
{
    struct places P;
    places_make(&P, PL_BALANCED, 3);
    struct children ch = {.m = fx.m, .place = P.p, .fail_open = UINT32_MAX, .stub_dev = dev,
                          .mode = mode, .code = code, .times = 1};
    struct waiter ew;
    struct moed_backend *ep = ep_open_ok(&ch, 3, TMAX, &ew);
    uint64_t seed = 77;
    const uint32_t T = 16;
    static uint16_t y1[TMAX * 256], y2[TMAX * 256];
    ck_assert_uint_le(H, 256);
    gen_batch(moed_model_layer(fx.m, 0), T, &seed, 0, xb, idb, wb);
    struct moed_batch b1 = batch(0, T, 0, y1, 1), b2 = batch(0, T, 0, y2, 2);
    ck_assert_int_eq(moed_backend_submit(ep, &b1), 0);
    ck_assert_int_eq(moed_backend_submit(ep, &b2), 0);
    wait_for(&ew, 2);
    ck_assert_msg(b1.status == code, "device %u, mode %d: status %d, want %d", dev, mode,
                  b1.status, code);
    ck_assert_int_eq(b2.status, 0);
    struct moed_batch rb = batch(0, T, 0, yref, 3);
    ck_assert_int_eq(run_on(ref, &ref_w, &rb), 0);
    ck_assert_msg(memcmp(y2, yref, (size_t)T * H * 2) == 0, "the batch after the failed one "
                  "differs from one CPU backend");
    ck_assert_uint_eq(ew.per[1], 1);
    ck_assert_uint_eq(ew.per[2], 1);
    moed_backend_close(ep);
    ck_assert_int_eq(ch.closes, 1);
    ck_assert_uint_eq(ew.n_done, 2);
    places_free(&P);
}

START_TEST(test_child_fails_rows)
{
    child_fails(1, STUB_FAIL_ROWS, MOED_E_TIMEOUT);
}
END_TEST

START_TEST(test_child_refuses_rows)
{
    child_fails(2, STUB_REFUSE, MOED_E_BUSY);
}
END_TEST

START_TEST(test_child_fails_combine)
{
    child_fails(0, STUB_FAIL_COMBINE, MOED_E_BACKEND);
}
END_TEST

/* ---- close with batches queued --------------------------------------------- */

START_TEST(test_close_with_queued)
{
    struct places P;
    places_make(&P, PL_BALANCED, 2);
    struct children ch = {.m = fx.m, .place = P.p, .fail_open = UINT32_MAX};
    struct waiter ew;
    struct moed_backend *ep = ep_open_ok(&ch, 2, TMAX, &ew);
    uint64_t seed = 5;
    const uint32_t T = 16;
    gen_batch(moed_model_layer(fx.m, 1), T, &seed, 5, xb, idb, wb);
    struct moed_batch rb = batch(1, T, 0, yref, 63);
    ck_assert_int_eq(run_on(ref, &ref_w, &rb), 0);
    enum { NB = 40 }; /* more than one is still queued at close */
    static struct moed_batch b[NB];
    static uint16_t y[NB][16 * 256];
    ck_assert_uint_le(H, 256);
    for (uint32_t i = 0; i < NB; i++) {
        b[i] = batch(1, T, 0, y[i], i);
        b[i].status = 1; /* not a code: done must set it */
        ck_assert_int_eq(moed_backend_submit(ep, &b[i]), 0);
    }
    moed_backend_close(ep);
    ck_assert_uint_eq(ew.n_done, NB);
    for (uint32_t i = 0; i < NB; i++) {
        ck_assert_msg(ew.per[i] == 1, "batch %u: done called %u times", i, ew.per[i]);
        /* close finishes what is queued (the children are still open) */
        ck_assert_msg(b[i].status == 0, "batch %u: status %d", i, b[i].status);
        ck_assert_msg(memcmp(y[i], yref, (size_t)T * H * 2) == 0, "batch %u differs", i);
    }
    places_free(&P);
}
END_TEST

/* ---- kernel time (the slowest ROWS batch's plus the COMBINE's), heartbeat,
 * healthy ---------------------------------------------------------------- */

START_TEST(test_kernel_time)
{
    struct places P;
    places_make(&P, PL_BALANCED, 3);
    uint64_t seed = 11;
    const uint32_t T = 16; /* shared slots put entries on every device */
    gen_batch(moed_model_layer(fx.m, 0), T, &seed, 0, xb, idb, wb);
    /* every device reports: 3000 (device 2's rows) + 7; device 1 does not: 0;
     * plain CPU children (no kernel time without the test switch): 0 */
    const uint32_t unknown[3] = {UINT32_MAX, 1, UINT32_MAX};
    const int ktime[3] = {1, 1, 0};
    const uint64_t want[3] = {3007, 0, 0};
    for (int c = 0; c < 3; c++) {
        struct children ch = {.m = fx.m, .place = P.p, .fail_open = UINT32_MAX,
                              .stub_dev = UINT32_MAX, .ktime = ktime[c],
                              .ktime_unknown = unknown[c], .sick_dev = c == 1 ? 2 : UINT32_MAX};
        struct waiter ew;
        struct moed_backend *ep = ep_open_ok(&ch, 3, TMAX, &ew);
        /* heartbeat: child 0's when it has one; healthy: every child is */
        if (ktime[c])
            ck_assert_uint_eq(ep->ops->heartbeat(ep), 42);
        else
            ck_assert_ptr_null(ep->ops->heartbeat);
        ck_assert_int_eq(ep->ops->healthy(ep), c != 1);
        struct moed_batch b = batch(0, T, 0, yep, 0);
        b.kernel_ns = 12345;
        ck_assert_int_eq(run_on(ep, &ew, &b), 0);
        ck_assert_msg(b.kernel_ns == want[c], "case %d: kernel_ns %llu, want %llu", c,
                      (unsigned long long)b.kernel_ns, (unsigned long long)want[c]);
        moed_backend_close(ep);
    }
    places_free(&P);
}
END_TEST

/* ---- batches the EP backend refuses at submit (done not called) ----------- */

START_TEST(test_submit_refused)
{
    struct places P;
    places_make(&P, PL_BALANCED, 2);
    struct children ch = {.m = fx.m, .place = P.p, .fail_open = UINT32_MAX};
    struct waiter ew;
    struct moed_backend *ep = ep_open_ok(&ch, 2, 8, &ew);
    uint64_t seed = 3;
    gen_batch(moed_model_layer(fx.m, 0), 9, &seed, 0, xb, idb, wb);
    struct moed_batch b = batch(0, 9, 0, yep, 0); /* over max_tokens */
    ck_assert_int_eq(moed_backend_submit(ep, &b), MOED_E_INVAL);
    b = batch(0, 0, 0, yep, 0);
    ck_assert_int_eq(moed_backend_submit(ep, &b), MOED_E_INVAL);
    b = batch(GEN_LAYERS, 8, 0, yep, 0); /* no such layer */
    ck_assert_int_eq(moed_backend_submit(ep, &b), MOED_E_INVAL);
    b = batch(0, 8, MOED_BATCH_ROWS, yep, 0); /* the halves are the children's */
    ck_assert_int_eq(moed_backend_submit(ep, &b), MOED_E_INVAL);
    b = batch(0, 8, 0, yep, 0);
    b.top_k = K + 1;
    ck_assert_int_eq(moed_backend_submit(ep, &b), MOED_E_INVAL);
    b = batch(0, 8, 0, yep, 0);
    ck_assert_int_eq(run_on(ep, &ew, &b), 0);
    moed_backend_close(ep);
    ck_assert_uint_eq(ew.n_done, 1);
    places_free(&P);
}
END_TEST

/* ---- bad configurations ------------------------------------------------------ */

static void expect_refused(struct moed_ep_cfg *cfg, const char *want)
{
    struct waiter ew;
    waiter_init(&ew);
    struct moed_backend *ep = (struct moed_backend *)0x1;
    char err[MOED_ERRLEN] = "";
    int rc = moed_backend_ep_open(fx.m, cfg, on_done, &ew, &ep, err, sizeof err);
    ck_assert_msg(rc < 0, "opened; wanted '%s'", want);
    ck_assert_ptr_null(ep);
    ck_assert_msg(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

START_TEST(test_bad_cfg)
{
    struct places P;
    struct moed_placement p3;
    places_make(&P, PL_BALANCED, 2);
    const struct moed_placement *const *place = P.p, *const *p2 = P.p;
    make_place(PL_BALANCED, 3, 0, &p3);
    struct children ch = {.m = fx.m, .place = P.p, .fail_open = UINT32_MAX,
                          .stub_dev = 0, .mode = STUB_FAIL_ROWS, .times = 0};
    struct moed_ep_cfg cfg = ep_cfg(&ch, 2, place);

    cfg.n_dev = 0;
    expect_refused(&cfg, "0 devices, not in 1..8");
    cfg.n_dev = MOED_PLACE_MAX_DEVS + 1;
    expect_refused(&cfg, "9 devices, not in 1..8");
    cfg.n_dev = 3; /* the placements are for 2 */
    expect_refused(&cfg, "layer 0 is placed on 2 devices, not 3");
    cfg.n_dev = 2;

    const struct moed_placement *missing[GEN_LAYERS] = {p2[0], NULL};
    cfg.place = missing;
    expect_refused(&cfg, "MoE layer 1 has no placement");
    cfg.n_layers = 1; /* a table too short: layer 1 unplaced as well */
    cfg.place = place;
    expect_refused(&cfg, "MoE layer 1 has no placement");
    cfg.n_layers = GEN_LAYERS;
    const struct moed_placement *mixed[GEN_LAYERS] = {p2[0], &p3};
    cfg.place = mixed;
    expect_refused(&cfg, "layer 1 is placed on 3 devices, not 2");
    cfg.place = place;

    struct moed_placement few;
    char err[MOED_ERRLEN];
    const uint64_t zero[64] = {0};
    ck_assert_int_eq(moed_placement_balanced(E - 1, S, 2, zero, 1, 1.0, &few, err, sizeof err), 0);
    const struct moed_placement *wrong[GEN_LAYERS] = {&few, p2[1]};
    cfg.place = wrong;
    char want[128];
    snprintf(want, sizeof want, "layer 0's placement has %u routed + %u shared experts, the "
             "model %u + %u", E - 1, S, E, S);
    expect_refused(&cfg, want);
    cfg.place = place;

    cfg.rows.bytes = rows_bytes - 1;
    snprintf(want, sizeof want, "the rows buffer has %zu bytes, max_tokens %u needs %zu",
             rows_bytes - 1, TMAX, rows_bytes);
    expect_refused(&cfg, want);
    cfg.rows.bytes = rows_bytes;
    cfg.max_tokens = TMAX + 1;
    expect_refused(&cfg, "the rows buffer has");
    cfg.max_tokens = 0;
    expect_refused(&cfg, "max_tokens is 0");
    cfg.max_tokens = TMAX;

    /* a device that will not open: the message names it, the opened ones
     * are closed again (the stub on device 0 counts its close) */
    ch.fail_open = 1;
    expect_refused(&cfg, "device 1 did not open: test: device 1 is unplugged");
    ck_assert_int_eq(ch.opened, 1);
    ck_assert_int_eq(ch.closes, 1);

    moed_placement_free(&few);
    moed_placement_free(&p3);
    places_free(&P);
}
END_TEST

/* ---- a CPU child holds its placement ---------------------------------------- */

START_TEST(test_cpu_child_refuses_unplaced)
{
    struct places P;
    places_make(&P, PL_MAP, 2);
    /* layer 0 of the map: expert E-2 only on device 1, expert 0 only on 0 */
    ck_assert_uint_eq(P.pl[0].n_rep[E - 2], 1);
    ck_assert_uint_eq(P.pl[0].dev[(E - 2) * MOED_PLACE_MAX_REPLICAS], 1);
    ck_assert_uint_eq(P.pl[0].n_rep[0], 1);
    ck_assert_uint_eq(P.pl[0].dev[0], 0);
    struct children ch = {.m = fx.m, .place = P.p, .fail_open = UINT32_MAX};
    struct waiter w;
    waiter_init(&w);
    struct moed_backend *c0 = NULL;
    char err[MOED_ERRLEN] = "";
    ck_assert_msg(cpu_child(&ch, 0, on_done, &w, &c0, err, sizeof err) == 0, "%s", err);

    uint64_t seed = 9;
    gen_batch(moed_model_layer(fx.m, 0), 4, &seed, 0, xb, idb, wb);
    for (uint32_t i = 0; i < 4 * K; i++)
        idb[i] = -1;
    idb[0] = 0; /* its own */
    struct moed_batch b = batch(0, 4, MOED_BATCH_ROWS, yep, 0);
    b.rows = hbuf(rows, rows_bytes);
    b.ep_n = 2;
    b.ep_shard = 0;
    ck_assert_int_eq(run_on(c0, &w, &b), 0);

    /* expert E-2 (device 1's) in token 2, slot 1: refused, the log names
     * the expert and the device */
    idb[2 * K + 1] = (int32_t)(E - 2);
    char path[] = "/tmp/moed-ep-log-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    int saved = dup(2);
    ck_assert_int_ge(saved, 0);
    ck_assert_int_ge(dup2(fd, 2), 0);
    moed_log_set_level(MOED_LOG_WARN);
    int rc = run_on(c0, &w, &b);
    moed_log_set_level(MOED_LOG_ERROR);
    dup2(saved, 2);
    close(saved);
    char logbuf[4096] = "";
    ck_assert_int_ge(pread(fd, logbuf, sizeof logbuf - 1, 0), 0);
    close(fd);
    unlink(path);
    ck_assert_int_eq(rc, MOED_E_INVAL);
    char want[128];
    snprintf(want, sizeof want, "token 2 slot 1: expert %u has no replica on device 0", E - 2);
    ck_assert_msg(strstr(logbuf, want) != NULL, "log '%s' lacks '%s'", logbuf, want);

    /* a batch for another device's shard is refused too */
    idb[2 * K + 1] = -1;
    b.ep_shard = 1;
    ck_assert_int_eq(run_on(c0, &w, &b), MOED_E_INVAL);
    b.ep_shard = 0;
    ck_assert_int_eq(run_on(c0, &w, &b), 0);
    /* a rows buffer too small */
    b.rows.bytes = (size_t)4 * KS * H * 4 - 1;
    ck_assert_int_eq(run_on(c0, &w, &b), MOED_E_INVAL);
    moed_backend_close(c0);
    places_free(&P);
}
END_TEST

static Suite *ep_suite(void)
{
    Suite *s = suite_create("ep");
    TCase *tc = tcase_create("ep");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_loop_test(tc, test_ep_equals_one_device, 2, 5);
    tcase_add_test(tc, test_child_fails_rows);
    tcase_add_test(tc, test_child_refuses_rows);
    tcase_add_test(tc, test_child_fails_combine);
    tcase_add_test(tc, test_close_with_queued);
    tcase_add_test(tc, test_kernel_time);
    tcase_add_test(tc, test_submit_refused);
    tcase_add_test(tc, test_bad_cfg);
    tcase_add_test(tc, test_cpu_child_refuses_unplaced);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return moed_check_run(ep_suite());
}
