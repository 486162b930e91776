/* backend_ep.c - expert parallelism over n devices: a backend whose batches
 * are computed by n child backends, one per device (backend.h,
 * moed_backend_ep_open; docs/MULTI_GPU.md).
 *
 * Strategy. One driver thread takes the submitted batches in order, one at a
 * time:
 *
 *   1. moed_ep_assign over the layer's placement names the device of every
 *      entry t * (k + S) + j (a routed expert's pairs to its replicas in
 *      turn, shared slot of token t to device t % n);
 *   2. every child that has an entry gets a ROWS batch: the batch with its
 *      own copy of the ids (-1 for the entries that are not its own) and
 *      ep_n / ep_shard, writing its rows into the one rows buffer
 *      (cfg->rows); a child with no routed entry and no shared one (routed
 *      only, or T below its index) gets none;
 *   3. once every ROWS batch is done, a COMBINE batch on child 0 sums the
 *      rows into y in slot order, the one-device sum;
 *   4. done() of the original batch, from the driver thread.
 *
 * The result is the one-device result bit for bit: a row depends only on
 * its expert and its token, and the sum is the one moe_ref_forward does.
 *
 * Errors: a child that fails its ROWS or COMBINE batch (or refuses one at
 * submit) fails the batch with that child's code (the lowest device's,
 * when several fail); the ROWS batches already submitted are still waited
 * for (they write the rows buffer), the COMBINE is not run, and the next
 * batch runs as usual. A batch's kernel_ns is the slowest ROWS batch's
 * kernel time plus the COMBINE batch's, when every one of them reported
 * one, else 0 (not known).
 *
 * Memory: everything a batch needs (assignment, per-child ids, the child
 * batches) is sized at open from max_tokens and the model's dims; the queue
 * of waiting batches is a ring that doubles when full (no allocation per
 * batch once it has grown to the engine's depth). Children call done from
 * their own threads: the driver waits on `cv` for the count of outstanding
 * child batches, under `mu`, which also guards the queue.
 *
 * No host_alloc, no zero-copy (ipc) and no doorbell channel ops: the engine
 * falls back to ordinary memory and refuses those paths under EP for now.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "moed_err.h"
#include "moed_log.h"
#include "placement.h"

#define EP_QUEUE_INIT 64 /* ring slots at open; doubles when full */

struct ep_backend {
    struct moed_backend base; /* first: ops receive &base */
    struct moed_backend_ops ops;
    struct moed_model *model;
    uint32_t n_dev, n_layers, max_tokens, k, S, n_experts;
    const struct moed_placement *const *place;
    struct moed_buf rows;
    struct moed_backend *child[MOED_PLACE_MAX_DEVS];
    /* driver thread only (sized at open) */
    uint8_t *dev_of;                           /* [max_tokens * (k + S)] */
    uint32_t *seen;                            /* [n_experts] */
    int32_t *ids[MOED_PLACE_MAX_DEVS];         /* [max_tokens * k] each */
    struct moed_batch sub[MOED_PLACE_MAX_DEVS]; /* the ROWS batches; sub[0] also COMBINE */
    pthread_t driver;
    int driver_started;
    /* under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct moed_batch **q; /* ring of waiting batches */
    uint32_t q_cap, q_head, q_len;
    uint32_t pending;      /* child batches not yet done */
    int stopping;
};

static void ep_child_done(void *ctx, struct moed_batch *b)
{
    struct ep_backend *eb = ctx;
    (void)b; /* its status and kernel_ns are read by the driver once all are in */
    pthread_mutex_lock(&eb->mu);
    eb->pending--;
    pthread_cond_broadcast(&eb->cv);
    pthread_mutex_unlock(&eb->mu);
}

/* Submit n child batches (child[dev[i]] gets sub[dev[i]]) and wait for the
 * ones that were accepted. A child's refusal at submit becomes that child
 * batch's status. */
static void ep_run_children(struct ep_backend *eb, const uint32_t *dev, uint32_t n)
{
    pthread_mutex_lock(&eb->mu);
    eb->pending += n;
    pthread_mutex_unlock(&eb->mu);
    for (uint32_t i = 0; i < n; i++) {
        struct moed_batch *s = &eb->sub[dev[i]];
        int rc = moed_backend_submit(eb->child[dev[i]], s);
        if (rc) {
            s->status = rc;
            s->kernel_ns = 0;
            pthread_mutex_lock(&eb->mu);
            eb->pending--;
            pthread_mutex_unlock(&eb->mu);
        }
    }
    pthread_mutex_lock(&eb->mu);
    while (eb->pending)
        pthread_cond_wait(&eb->cv, &eb->mu);
    pthread_mutex_unlock(&eb->mu);
}

/* One batch, steps 1-3 of the strategy; sets b->status and b->kernel_ns. */
static void ep_run(struct ep_backend *eb, struct moed_batch *b)
{
    const uint32_t T = b->n_tokens, k = eb->k, KS = k + eb->S;
    const struct moed_placement *p = eb->place[b->layer];
    uint32_t count[MOED_PLACE_MAX_DEVS], routed[MOED_PLACE_MAX_DEVS] = {0};
    uint32_t devs[MOED_PLACE_MAX_DEVS], n = 0;
    b->kernel_ns = 0;
    b->status = moed_ep_assign(p, T, k, b->ids.ptr, eb->dev_of, count, eb->seen);
    if (b->status)
        return;
    const int32_t *ids = b->ids.ptr;
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t j = 0; j < k; j++) {
            const uint8_t d = eb->dev_of[(size_t)t * KS + j];
            for (uint32_t c = 0; c < eb->n_dev; c++)
                eb->ids[c][(size_t)t * k + j] = c == d ? ids[(size_t)t * k + j] : -1;
            if (ids[(size_t)t * k + j] >= 0)
                routed[d]++;
        }
    const int shared = eb->S > 0 && !(b->flags & MOED_BATCH_ROUTED_ONLY);
    for (uint32_t c = 0; c < eb->n_dev; c++) {
        if (!routed[c] && !(shared && c < T))
            continue; /* no entry of this batch is on device c */
        struct moed_batch *s = &eb->sub[c];
        *s = *b;
        s->ids = (struct moed_buf){MOED_BUF_HOST, 0, eb->ids[c], (uint64_t)T * k * sizeof(int32_t)};
        s->rows = eb->rows;
        s->flags = (b->flags & MOED_BATCH_ROUTED_ONLY) | MOED_BATCH_ROWS;
        s->ep_n = eb->n_dev;
        s->ep_shard = c;
        s->status = 0;
        s->kernel_ns = 0;
        s->user = NULL;
        devs[n++] = c;
    }
    ep_run_children(eb, devs, n);
    uint64_t slowest = 0;
    int known = 1;
    for (uint32_t i = 0; i < n; i++) {
        const struct moed_batch *s = &eb->sub[devs[i]];
        if (s->status && !b->status) {
            b->status = s->status;
            LOG_W("ep: batch %llu layer %u: device %u failed its rows: %s",
                  (unsigned long long)b->seq, b->layer, devs[i], moed_strerror(s->status));
        }
        known &= s->kernel_ns != 0;
        if (s->kernel_ns > slowest)
            slowest = s->kernel_ns;
    }
    if (b->status)
        return;
    struct moed_batch *c = &eb->sub[0];
    *c = *b;
    c->rows = eb->rows;
    c->flags = (b->flags & MOED_BATCH_ROUTED_ONLY) | MOED_BATCH_COMBINE;
    c->ep_n = eb->n_dev;
    c->ep_shard = 0;
    c->status = 0;
    c->kernel_ns = 0;
    c->user = NULL;
    const uint32_t zero = 0;
    ep_run_children(eb, &zero, 1);
    if (c->status) {
        LOG_W("ep: batch %llu layer %u: device 0 failed the combine: %s",
              (unsigned long long)b->seq, b->layer, moed_strerror(c->status));
        b->status = c->status;
        return;
    }
    known &= c->kernel_ns != 0;
    b->kernel_ns = known ? slowest + c->kernel_ns : 0;
}

static void *ep_driver(void *arg)
{
    struct ep_backend *eb = arg;
    for (;;) {
        pthread_mutex_lock(&eb->mu);
        while (!eb->q_len && !eb->stopping)
            pthread_cond_wait(&eb->cv, &eb->mu);
        struct moed_batch *b = NULL;
        if (eb->q_len) {
            b = eb->q[eb->q_head];
            eb->q_head = (eb->q_head + 1) % eb->q_cap;
            eb->q_len--;
        }
        pthread_mutex_unlock(&eb->mu);
        if (!b)
            break; /* stopping and the queue is empty */
        ep_run(eb, b);
        eb->base.done(eb->base.done_ctx, b);
    }
    return NULL;
}

static int ep_submit(struct moed_backend *be, struct moed_batch *b)
{
    struct ep_backend *eb = (struct ep_backend *)be;
    if (b->n_tokens < 1 || b->n_tokens > eb->max_tokens || b->top_k != eb->k ||
        b->layer >= eb->n_layers || !eb->place[b->layer] || !moed_buf_on_host(&b->ids) ||
        !b->ids.ptr || (b->flags & (MOED_BATCH_ROWS | MOED_BATCH_COMBINE)))
        return MOED_E_INVAL;
    pthread_mutex_lock(&eb->mu);
    if (eb->stopping) {
        pthread_mutex_unlock(&eb->mu);
        return MOED_E_SHUTDOWN;
    }
    if (eb->q_len == eb->q_cap) {
        if (eb->q_cap > UINT32_MAX / 2) {
            pthread_mutex_unlock(&eb->mu);
            return MOED_E_BUSY;
        }
        struct moed_batch **nq = malloc((size_t)eb->q_cap * 2 * sizeof *nq);
        if (!nq) {
            pthread_mutex_unlock(&eb->mu);
            return MOED_E_NOMEM;
        }
        for (uint32_t i = 0; i < eb->q_len; i++)
            nq[i] = eb->q[(eb->q_head + i) % eb->q_cap];
        free(eb->q);
        eb->q = nq;
        eb->q_head = 0;
        eb->q_cap *= 2;
    }
    eb->q[(eb->q_head + eb->q_len) % eb->q_cap] = b;
    eb->q_len++;
    pthread_cond_broadcast(&eb->cv);
    pthread_mutex_unlock(&eb->mu);
    return 0;
}

static int ep_healthy(struct moed_backend *be)
{
    struct ep_backend *eb = (struct ep_backend *)be;
    for (uint32_t c = 0; c < eb->n_dev; c++)
        if (!eb->child[c]->ops->healthy(eb->child[c]))
            return 0;
    return 1;
}

static uint64_t ep_heartbeat(struct moed_backend *be)
{
    struct moed_backend *c0 = ((struct ep_backend *)be)->child[0];
    return c0->ops->heartbeat(c0);
}

static void ep_describe(struct moed_backend *be, char *buf, unsigned len)
{
    struct ep_backend *eb = (struct ep_backend *)be;
    int off = snprintf(buf, len, "ep: %u devices, combined on device 0", eb->n_dev);
    for (uint32_t c = 0; c < eb->n_dev && off >= 0 && (unsigned)off < len; c++) {
        char one[256] = "";
        const struct moed_backend *ch = eb->child[c];
        if (ch->ops->describe)
            ch->ops->describe(eb->child[c], one, sizeof one);
        else
            snprintf(one, sizeof one, "%s", ch->ops->name);
        off += snprintf(buf + off, len - (unsigned)off, "; device %u: %s", c, one);
    }
}

/* Frees what open acquired; the driver thread must not be running. */
static void ep_free(struct ep_backend *eb)
{
    for (uint32_t c = 0; c < MOED_PLACE_MAX_DEVS; c++) {
        moed_backend_close(eb->child[c]);
        free(eb->ids[c]);
    }
    free(eb->q);
    free(eb->seen);
    free(eb->dev_of);
    pthread_cond_destroy(&eb->cv);
    pthread_mutex_destroy(&eb->mu);
    free(eb);
}

static void ep_close(struct moed_backend *be)
{
    struct ep_backend *eb = (struct ep_backend *)be;
    pthread_mutex_lock(&eb->mu);
    eb->stopping = 1; /* the driver still runs every queued batch, then exits */
    pthread_cond_broadcast(&eb->cv);
    pthread_mutex_unlock(&eb->mu);
    pthread_join(eb->driver, NULL);
    ep_free(eb);
}

static const struct moed_backend_ops ep_ops = {
    .name = "ep",
    .completes_in_us = 1,
    .submit = ep_submit,
    .healthy = ep_healthy,
    .describe = ep_describe,
    .close = ep_close,
};

/* The cfg against the model: bounds, every MoE layer placed on n_dev
 * devices with the model's expert counts, the rows buffer big enough. */
static int ep_validate(const struct moed_model *m, const struct moed_ep_cfg *cfg, char *err,
                       size_t errlen)
{
    if (!m || !cfg || !cfg->open_child || !cfg->place)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "ep backend: missing the model, open_child or the placements");
    if (cfg->n_dev < 1 || cfg->n_dev > MOED_PLACE_MAX_DEVS)
        return moed_seterr(err, errlen, MOED_E_INVAL, "ep backend: %u devices, not in 1..%u",
                           cfg->n_dev, MOED_PLACE_MAX_DEVS);
    if (cfg->max_tokens < 1)
        return moed_seterr(err, errlen, MOED_E_INVAL, "ep backend: max_tokens is 0");
    const struct moed_dims *d = moed_model_dims(m);
    for (uint32_t l = 0; l < d->n_layers; l++) {
        if (!moed_model_is_moe_layer(m, l))
            continue;
        const struct moed_placement *p = l < cfg->n_layers ? cfg->place[l] : NULL;
        if (!p)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "ep backend: MoE layer %u has no placement", l);
        if (p->n_dev != cfg->n_dev)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "ep backend: layer %u is placed on %u devices, not %u", l,
                               p->n_dev, cfg->n_dev);
        if (p->n_experts != d->n_experts || p->n_shared != d->n_shared)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "ep backend: layer %u's placement has %u routed + %u shared "
                               "experts, the model %u + %u",
                               l, p->n_experts, p->n_shared, d->n_experts, d->n_shared);
    }
    const uint64_t need = (uint64_t)cfg->max_tokens * (d->top_k + d->n_shared) * d->hidden *
                          sizeof(float);
    if (!cfg->rows.ptr || cfg->rows.bytes < need)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "ep backend: the rows buffer has %llu bytes, max_tokens %u needs "
                           "%llu (%u x %u entries x %u floats)",
                           (unsigned long long)(cfg->rows.ptr ? cfg->rows.bytes : 0),
                           cfg->max_tokens, (unsigned long long)need, cfg->max_tokens,
                           d->top_k + d->n_shared, d->hidden);
    return 0;
}

int moed_backend_ep_open(struct moed_model *m, const struct moed_ep_cfg *cfg,
                         moed_backend_done_fn done, void *done_ctx, struct moed_backend **out,
                         char *err, size_t errlen)
{
    *out = NULL;
    int rc = ep_validate(m, cfg, err, errlen);
    if (rc)
        return rc;
    const struct moed_dims *d = moed_model_dims(m);
    struct ep_backend *eb = calloc(1, sizeof *eb);
    if (!eb)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "ep backend: out of memory");
    pthread_mutex_init(&eb->mu, NULL);
    pthread_cond_init(&eb->cv, NULL);
    eb->ops = ep_ops;
    eb->base.ops = &eb->ops;
    eb->base.done = done;
    eb->base.done_ctx = done_ctx;
    eb->model = m;
    eb->n_dev = cfg->n_dev;
    eb->n_layers = cfg->n_layers < d->n_layers ? cfg->n_layers : d->n_layers;
    eb->max_tokens = cfg->max_tokens;
    eb->k = d->top_k;
    eb->S = d->n_shared;
    eb->n_experts = d->n_experts;
    eb->place = cfg->place;
    eb->rows = cfg->rows;
    eb->q_cap = EP_QUEUE_INIT;
    eb->q = malloc(EP_QUEUE_INIT * sizeof *eb->q);
    eb->dev_of = malloc((size_t)cfg->max_tokens * (eb->k + eb->S));
    eb->seen = malloc((size_t)eb->n_experts * sizeof *eb->seen);
    int nomem = !eb->q || !eb->dev_of || !eb->seen;
    for (uint32_t c = 0; c < eb->n_dev && !nomem; c++) {
        eb->ids[c] = malloc((size_t)cfg->max_tokens * eb->k * sizeof *eb->ids[c]);
        nomem = !eb->ids[c];
    }
    if (nomem) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "ep backend: out of memory for %u tokens",
                         cfg->max_tokens);
        goto fail;
    }
    for (uint32_t c = 0; c < eb->n_dev; c++) {
        char cerr[MOED_ERRLEN] = "";
        rc = cfg->open_child(cfg->open_ctx, c, ep_child_done, eb, &eb->child[c], cerr,
                             sizeof cerr);
        if (rc || !eb->child[c]) {
            eb->child[c] = NULL;
            rc = moed_seterr(err, errlen, rc ? rc : MOED_E_BACKEND,
                             "ep backend: device %u did not open: %s", c,
                             cerr[0] ? cerr : "no backend");
            goto fail;
        }
    }
    if (eb->child[0]->ops->heartbeat)
        eb->ops.heartbeat = ep_heartbeat;
    rc = pthread_create(&eb->driver, NULL, ep_driver, eb);
    if (rc) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "ep backend: pthread_create: error %d", rc);
        goto fail;
    }
    LOG_I("ep backend: %u devices, up to %u tokens, rows buffer %llu bytes", eb->n_dev,
          eb->max_tokens, (unsigned long long)eb->rows.bytes);
    *out = &eb->base;
    return 0;

fail:
    ep_free(eb);
    return rc;
}
