/* engine.c - FORWARD requests -> batches -> backend -> replies.
 *
 * Flow (loop thread unless noted):
 *   forward()   validate (moed_server_forward_parse) before anything reaches a
 *               backend; the request's I/O (where its inputs lie, where its
 *               reply goes) is its source's: reqio.h (socket frames: the
 *               lent read buffer and the reply frame written in place);
 *               append it to the waiting FIFO, dispatch();
 *   dispatch()  while fewer than MOED_ENGINE_MAX_OUTSTANDING batches are at
 *               the backend: take the oldest waiting request's layer and merge
 *               every waiting request of that layer that still fits into
 *               max_tokens (in arrival order), copy them into one batch and
 *               submit it. With the backend busy, requests pile up and merge;
 *               idle, a lone request goes out at once on its own buffers
 *               (a "bound" batch, moed_reqio_bind: no copies; at T=64,
 *               H=2048 that is two 256 KiB copies less per request). A
 *               request whose inputs the host cannot read always goes alone.
 *               Batch memory comes from the buffer pool (bufpool.h);
 *   on_done()   backend thread: push the batch on the completion list and
 *               uv_async_send (which coalesces);
 *   on_async()  drain the whole completion list: each request of each batch
 *               answers through its source (moed_reqio_reply: y in place or
 *               its rows of the merged batch; dropped if the client is
 *               gone), then dispatch() again.
 */
#include "engine_int.h"

static void dispatch(struct moed_engine *e);
static void on_health_timer(uv_timer_t *t);

/* ---- helpers ----------------------------------------------------------- */

static int is_moe_layer_cb(const void *ctx, uint32_t layer)
{
    return moed_model_is_moe_layer(ctx, layer);
}

static size_t x_bytes(const struct moed_engine *e, uint32_t t) { return (size_t)t * e->dims->hidden * 2; }
static size_t ids_bytes(const struct moed_engine *e, uint32_t t) { return (size_t)t * e->dims->top_k * 4; }

/* The loop spins (polls with a zero timeout) while a batch is at the backend
 * and for spin_ns after the last one: a thread asleep in epoll_wait through
 * a batch of a few hundred microseconds wakes up late (7-70 us on the H200
 * host, a VM, later the longer it slept), and every request of that batch
 * waits for it (bench/NOTES.md, 2026-12-02 night). */
static void on_spin(uv_idle_t *h)
{
    struct moed_engine *e = h->data;
    on_async(&e->async); /* completions handed over since the last round */
    const uint64_t now = now_ns();
    e->stats.loop_spin_ns += now - e->spin_round_ns;
    e->spin_round_ns = now;
    if (e->outstanding == 0 && now - e->spin_last_ns > e->spin_ns) {
        MOED_UV_CHECK(uv_idle_stop(h));
        e->spinning = 0;
    }
}

static void spin_kick(struct moed_engine *e)
{
    if (!e->spin_on)
        return;
    e->spin_last_ns = now_ns();
    if (!e->spinning && MOED_UV_CHECK(uv_idle_start(&e->spin, on_spin)) == 0) {
        e->spinning = 1;
        e->spin_round_ns = e->spin_last_ns;
    }
}

void busy_begin(struct moed_engine *e)
{
    if (e->outstanding++ == 0)
        e->busy_since_ns = now_ns();
    spin_kick(e);
}

void busy_end(struct moed_engine *e)
{
    if (--e->outstanding == 0)
        e->stats.busy_ns += now_ns() - e->busy_since_ns;
    spin_kick(e);
}

void maybe_drained(struct moed_engine *e)
{
    if (e->draining && e->stats.in_flight == 0 && e->outstanding == 0 && e->drain_cb) {
        void (*cb)(void *) = e->drain_cb;
        e->drain_cb = NULL;
        cb(e->drain_arg);
    }
}

/* Answer one request with an error (code 0: its client is gone, release
 * only); frees it. */
void req_fail(struct moed_engine *e, struct eng_req *r, int code, const char *msg)
{
    moed_reqio_fail(&e->io_env, &r->io, code, msg);
    e->stats.in_flight--;
    free(r);
}

/* ---- completions --------------------------------------------------------- */

void on_backend_done(void *ctx, struct moed_batch *b)
{
    /* Backend thread. */
    struct moed_engine *e = ctx;
    struct eng_batch *eb = (struct eng_batch *)b;
    eb->done_ns = now_ns(); /* uv_hrtime: CLOCK_MONOTONIC, fine off the loop thread */
    eb->next = NULL;
    pthread_mutex_lock(&e->done_mu);
    if (e->done_tail)
        e->done_tail->next = eb;
    else
        e->done_head = eb;
    e->done_tail = eb;
    pthread_mutex_unlock(&e->done_mu);
    MOED_UV_CHECK(uv_async_send(&e->async));
}

/* What a backend that stopped being healthy has logged before (its own
 * line names the cause): a device error, a stalled kernel, a lost NCCL peer
 * or the end of an NCCL group. */
#define BACKEND_UNHEALTHY "backend unhealthy (the lines above say why)"

static void engine_fail(struct moed_engine *e, int code, const char *why)
{
    if (e->failed)
        return;
    e->failed = 1;
    e->stats.healthy = 0;
    LOG_E("backend failed: %s; failing every waiting request", why);
    while (e->wait_head) {
        struct eng_req *r = e->wait_head;
        e->wait_head = r->next;
        req_fail(e, r, code, why);
    }
    e->wait_tail = NULL;
    e->n_waiting = 0;
    if (e->fail_cb)
        e->fail_cb(e->fail_arg);
}

/* A batch the backend failed may still be read and written by the device (a
 * kernel past its deadline goes on): the pinned buffers it uses in place are
 * never reused (left to process exit; the daemon is on its way out). */
static void batch_abandon_in_place(struct moed_engine *e, struct eng_batch *eb)
{
    if (eb->bound && eb->reqs)
        moed_reqio_abandon(&e->io_env, &eb->reqs->io);
    moed_bufpool_abandon(e->pool, &eb->mem);
}

static void batch_complete(struct moed_engine *e, struct eng_batch *eb)
{
    struct moed_batch *b = &eb->b;
    busy_end(e);
    if (b->status == MOED_E_BACKEND)
        batch_abandon_in_place(e, eb);
    if (eb->selfcheck) {
        e->selfcheck_done = 1;
        return; /* the self-check owns and frees it */
    }
    char msg[160];
    if (b->status != 0)
        snprintf(msg, sizeof msg, "backend %s failed the batch (seq %llu): %s", e->backend_name,
                 (unsigned long long)b->seq, moed_strerror(b->status));
    uint64_t now = now_ns();
    uint32_t row = 0;
    for (struct eng_req *r = eb->reqs, *nx; r; r = nx) {
        nx = r->next;
        if (b->status != 0) {
            req_fail(e, r, b->status, msg);
            continue;
        }
        r->t.submit_ns = eb->submit_ns;
        r->t.done_ns = eb->done_ns;
        r->t.kernel_ns = b->kernel_ns;
        if (moed_reqio_reply(&e->io_env, &r->io, b, eb->bound, row, &r->t) > 0) {
            e->stats.requests++;
            e->stats.tokens += r->io.n_tokens;
            moed_stats_record_latency(&e->stats, (double)(now - r->t.complete_ns) / 1000.0);
        }
        row += r->io.n_tokens;
        e->stats.in_flight--;
        free(r);
    }
    int status = b->status;
    batch_free(e, eb);
    if (status == MOED_E_BACKEND ||
        (e->be && e->be->ops->healthy && !e->be->ops->healthy(e->be)))
        engine_fail(e, MOED_E_BACKEND, BACKEND_UNHEALTHY);
}

int moed_engine_attach(struct moed_engine *e, char *err, size_t errlen)
{
    int rc = MOED_UV_CHECK(uv_async_init(e->loop, &e->async, on_async));
    if (rc < 0)
        return moed_seterr(err, errlen, MOED_E_IO, "uv_async_init: %s", uv_strerror(rc));
    e->async.data = e;
    e->attached = 1;
    if (e->be->ops->healthy && MOED_UV_CHECK(uv_timer_init(e->loop, &e->health_timer)) == 0) {
        e->health_timer.data = e;
        e->health_timer_on = 1;
        MOED_UV_CHECK(uv_timer_start(&e->health_timer, on_health_timer, HEALTH_POLL_MS,
                                     HEALTH_POLL_MS));
        uv_unref((uv_handle_t *)&e->health_timer); /* never keeps the loop alive alone */
    }
    if (e->be->ops->chan_quiet && MOED_UV_CHECK(uv_timer_init(e->loop, &e->chan_timer)) == 0) {
        e->chan_timer.data = e;
        e->chan_timer_on = 1;
        uv_unref((uv_handle_t *)&e->chan_timer);
    }
    if (e->spin_ns && e->be->ops->completes_in_us &&
        MOED_UV_CHECK(uv_idle_init(e->loop, &e->spin)) == 0) {
        e->spin.data = e;
        e->spin_on = 1;
        e->stats.loop_spin_us = (uint32_t)(e->spin_ns / 1000);
        uv_unref((uv_handle_t *)&e->spin);
    }
    return 0;
}

/* Reap the draining channels the backend reports quiet; stop once none is
 * left. */
static void on_chan_timer(uv_timer_t *t)
{
    struct moed_engine *e = t->data;
    if (moed_desc_chan_reap(e->desc) == 0 && e->chan_timer_running) {
        MOED_UV_CHECK(uv_timer_stop(&e->chan_timer));
        e->chan_timer_running = 0;
    }
}

/* A channel may have started draining: reap what is quiet now, poll the
 * rest from the timer. */
static void chan_reap_kick(struct moed_engine *e)
{
    if (moed_desc_chan_reap(e->desc) == 0 || !e->chan_timer_on || e->chan_timer_running)
        return;
    if (MOED_UV_CHECK(uv_timer_start(&e->chan_timer, on_chan_timer, CHAN_REAP_POLL_MS,
                                     CHAN_REAP_POLL_MS)) == 0)
        e->chan_timer_running = 1;
}

/* Poll the backend's health while idle: a stalled kernel or a sticky device
 * error fails everything waiting and triggers the daemon's exit (code 4). */
static void on_health_timer(uv_timer_t *t)
{
    struct moed_engine *e = t->data;
    if (!e->failed && e->be && !e->be->ops->healthy(e->be))
        engine_fail(e, MOED_E_BACKEND, BACKEND_UNHEALTHY);
}

/* Answer the T = 0 requests: the reply head alone, n_tokens 0 and no y
 * (moed_reqio_reply with no batch). */
static void reply_empty(struct moed_engine *e)
{
    struct eng_req *list = e->empty_head;
    e->empty_head = e->empty_tail = NULL;
    for (struct eng_req *r = list, *nx; r; r = nx) {
        nx = r->next;
        r->t.submit_ns = r->t.done_ns = now_ns();
        if (moed_reqio_reply(&e->io_env, &r->io, NULL, 0, 0, &r->t) > 0)
            e->stats.requests++;
        e->stats.in_flight--;
        free(r);
    }
}

void on_async(uv_async_t *h)
{
    struct moed_engine *e = h->data;
    reply_empty(e);
    pthread_mutex_lock(&e->done_mu);
    struct eng_batch *list = e->done_head;
    e->done_head = e->done_tail = NULL;
    int completed = 0;
    pthread_mutex_unlock(&e->done_mu);
    for (struct eng_batch *eb = list, *nx; eb; eb = nx) {
        nx = eb->next;
        batch_complete(e, eb);
        completed = 1;
    }
    dispatch(e);
    if (completed && e->draining && e->drain_progress && e->drain_cb)
        e->drain_progress(e->drain_arg);
    maybe_drained(e);
}

/* ---- batching ----------------------------------------------------------------- */

/* Release a waiting request whose client is gone, without computing it. */
static void req_skip(struct moed_engine *e, struct eng_req *r) { req_fail(e, r, 0, NULL); }

/* Take the oldest waiting request's layer and flags; merge every waiting
 * request of that layer and flags that still fits. Returns the batch's requests in FIFO order.
 * Requests of clients that have gone (closed their socket) are taken off the
 * list on the way into *gone, not computed. NULL if only those were left. */
static struct eng_req *take_batch(struct moed_engine *e, uint32_t *layer, uint32_t *n_tokens,
                                  struct eng_req **gone)
{
    struct eng_req *head = NULL, *tail = NULL, **pp = &e->wait_head, *prev = NULL;
    uint32_t L = 0, T = 0, F = 0;
    while (*pp) {
        struct eng_req *r = *pp;
        if (moed_server_conn_gone(r->io.conn)) {
            *pp = r->next;
            if (e->wait_tail == r)
                e->wait_tail = prev;
            r->next = *gone;
            *gone = r;
            e->n_waiting--;
            continue;
        }
        if (!head) {
            L = r->io.layer;
            F = r->flags;
        }
        /* a request that cannot merge goes alone */
        int alone = !moed_reqio_host_inputs(&r->io);
        if (r->io.layer == L && r->flags == F && T + r->io.n_tokens <= e->max_tokens &&
            !(head && alone)) {
            *pp = r->next;
            if (e->wait_tail == r)
                e->wait_tail = prev;
            r->next = NULL;
            if (tail)
                tail->next = r;
            else
                head = r;
            tail = r;
            T += r->io.n_tokens;
            e->n_waiting--;
            if (T == e->max_tokens || alone)
                break;
        } else {
            prev = r;
            pp = &r->next;
        }
    }
    *layer = L;
    *n_tokens = T;
    return head;
}

/* A batch of one request alone, on its own buffers (moed_reqio_bind: a
 * socket request's x, ids, w where they lie and y in its reply frame). NULL
 * when its source cannot, or on allocation failure: the caller falls back to
 * a merged batch. */
static struct eng_batch *batch_alloc_bound(struct moed_engine *e, struct eng_req *r)
{
    struct eng_batch *eb = calloc(1, sizeof *eb);
    if (!eb)
        return NULL;
    struct moed_batch *b = &eb->b;
    if (moed_reqio_bind(&e->io_env, &r->io, b) < 0) {
        free(eb);
        return NULL;
    }
    eb->bound = 1;
    b->seq = ++e->next_seq;
    b->layer = r->io.layer;
    b->n_tokens = r->io.n_tokens;
    b->top_k = e->dims->top_k;
    b->user = eb;
    return eb;
}

void batch_free(struct moed_engine *e, struct eng_batch *eb)
{
    moed_bufpool_put(e->pool, &eb->mem);
    free(eb);
}

struct eng_batch *batch_alloc(struct moed_engine *e, uint32_t layer, uint32_t T)
{
    struct eng_batch *eb = calloc(1, sizeof *eb);
    if (!eb)
        return NULL;
    size_t xb = x_bytes(e, T), ib = ids_bytes(e, T);
    /* x | y | ids | w: every part 4-byte aligned (x, y are even multiples);
     * y is as aligned as x when H is a multiple of 8 (every CUDA model). */
    if (moed_bufpool_get(e->pool, 2 * xb + 2 * ib, 1, &eb->mem)) {
        free(eb);
        return NULL;
    }
    enum moed_buf_kind k = moed_reqio_hbuf_kind(&eb->mem);
    uint8_t *m = eb->mem.base;
    struct moed_batch *b = &eb->b;
    b->seq = ++e->next_seq;
    b->layer = layer;
    b->n_tokens = T;
    b->top_k = e->dims->top_k;
    b->x = (struct moed_buf){k, 0, m, xb};
    b->y = (struct moed_buf){k, 0, m + xb, xb};
    b->ids = (struct moed_buf){k, 0, m + 2 * xb, ib};
    b->w = (struct moed_buf){k, 0, m + 2 * xb + ib, ib};
    b->user = eb;
    return eb;
}

static void dispatch(struct moed_engine *e)
{
    while (!e->failed && e->wait_head && e->outstanding < MOED_ENGINE_MAX_OUTSTANDING) {
        uint32_t layer, T;
        struct eng_req *gone = NULL;
        struct eng_req *reqs = take_batch(e, &layer, &T, &gone);
        while (gone) {
            struct eng_req *r = gone;
            gone = r->next;
            req_skip(e, r);
        }
        if (!reqs)
            continue;
        struct eng_batch *eb = reqs->next ? NULL : batch_alloc_bound(e, reqs);
        if (!eb && moed_reqio_host_inputs(&reqs->io))
            eb = batch_alloc(e, layer, T);
        if (eb)
            eb->b.flags = reqs->flags;
        if (!eb) {
            for (struct eng_req *r = reqs, *nx; r; r = nx) {
                nx = r->next;
                req_fail(e, r, MOED_E_NOMEM, "out of memory building a batch");
            }
            continue;
        }
        eb->reqs = reqs;
        uint8_t *x = eb->b.x.ptr, *ids = eb->b.ids.ptr, *w = eb->b.w.ptr;
        for (struct eng_req *r = eb->bound ? NULL : reqs; r; r = r->next) {
            size_t xb = x_bytes(e, r->io.n_tokens), ib = ids_bytes(e, r->io.n_tokens);
            const uint8_t *in = moed_reqio_host_inputs(&r->io);
            memcpy(x, in, xb);
            memcpy(ids, in + xb, ib);
            memcpy(w, in + xb + ib, ib);
            x += xb;
            ids += ib;
            w += ib;
        }
        busy_begin(e);
        e->stats.batches++;
        e->stats.batch_tokens += T;
        eb->submit_ns = now_ns(); /* before submit: the backend may finish at once */
        int rc = moed_backend_submit(e->be, &eb->b);
        if (rc < 0) {
            busy_end(e);
            char msg[128];
            snprintf(msg, sizeof msg, "backend refused the batch: %s", moed_strerror(rc));
            for (struct eng_req *r = reqs, *nx; r; r = nx) {
                nx = r->next;
                req_fail(e, r, rc, msg);
            }
            batch_free(e, eb);
            if (rc == MOED_E_BACKEND)
                engine_fail(e, rc, msg);
        }
    }
}

/* ---- server callbacks ---------------------------------------------------------- */

/* 0 if the engine takes new work, else why not. */
static int taking(const struct moed_engine *e, char *err, size_t errlen)
{
    if (e->draining)
        return moed_seterr(err, errlen, MOED_E_SHUTDOWN, "moed is shutting down; request not taken");
    if (e->failed)
        return moed_seterr(err, errlen, MOED_E_BACKEND, "backend failed; moed is not serving");
    return 0;
}

static void req_queue(struct moed_engine *e, struct eng_req *r)
{
    if (e->wait_tail)
        e->wait_tail->next = r;
    else
        e->wait_head = r;
    e->wait_tail = r;
    e->n_waiting++;
    e->stats.in_flight++;
    dispatch(e);
}

static int eng_forward(void *ctx, struct moed_conn *c, uint64_t request_id, const uint8_t *payload,
                       uint64_t len, const struct moed_req_times *t, struct moed_hbuf *rx,
                       char *err, size_t errlen)
{
    struct moed_engine *e = ctx;
    int rc = taking(e, err, errlen);
    if (rc < 0)
        return rc;
    const struct moed_dims *d = e->dims;
    struct moed_server_fwd fr;
    rc = moed_server_forward_parse(payload, len, d->hidden, d->n_experts, d->top_k,
                                   e->max_tokens, is_moe_layer_cb, e->model, &fr, err, errlen);
    if (rc < 0)
        return rc;
    struct eng_req *r = calloc(1, sizeof *r);
    if (!r)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for a request");
    rc = moed_reqio_from_frame(&r->io, c, request_id, &fr, rx, err, errlen);
    if (rc < 0) {
        free(r);
        return rc;
    }
    r->t = *t;
    if (fr.n_tokens == 0) {
        /* An idle data-parallel rank: nothing to compute. Answered from the
         * loop's next pass (on_async), never from inside the server's frame
         * handling. */
        if (e->empty_tail)
            e->empty_tail->next = r;
        else
            e->empty_head = r;
        e->empty_tail = r;
        e->stats.in_flight++;
        MOED_UV_CHECK(uv_async_send(&e->async));
        return 0;
    }
    r->flags = fr.routed_only && d->n_shared ? MOED_BATCH_ROUTED_ONLY : 0;
    /* Per-layer, per-expert hits (row fr.layer, an MoE layer < n_layers):
     * routed ids (validated in range; an empty slot, -1, counts nothing and
     * its weight is made 0 here, so that no backend reads a weight it should
     * ignore: the socket source's inputs are the request's own memory), then
     * every shared expert once per token unless routed-only. */
    uint8_t *ids = (uint8_t *)(uintptr_t)moed_reqio_host_inputs(&r->io) + x_bytes(e, fr.n_tokens);
    uint8_t *w = ids + ids_bytes(e, fr.n_tokens);
    for (size_t i = 0; i < (size_t)fr.n_tokens * d->top_k; i++) {
        int32_t id;
        memcpy(&id, ids + 4 * i, 4);
        if (id < 0) {
            memset(w + 4 * i, 0, 4);
            continue;
        }
        e->stats.expert_hits[(size_t)fr.layer * e->stats.n_expert_hits + (uint32_t)id]++;
    }
    for (uint32_t s = 0; s < d->n_shared && !r->flags; s++)
        e->stats.expert_hits[(size_t)fr.layer * e->stats.n_expert_hits + d->n_experts + s] +=
            fr.n_tokens;
    req_queue(e, r);
    return 0;
}

/* FORWARD_DESC: every range checked against the client's registrations
 * before the request is queued (desc.h). */
static int eng_forward_desc(void *ctx, struct moed_conn *c, uint64_t request_id,
                            const uint8_t *payload, uint64_t len, const struct moed_req_times *t,
                            char *err, size_t errlen)
{
    struct moed_engine *e = ctx;
    int rc = taking(e, err, errlen);
    if (rc < 0)
        return rc;
    struct moed_forward_desc_req rq;
    rc = moed_forward_desc_decode(payload, len, e->dims->top_k, e->max_tokens, is_moe_layer_cb,
                                  e->model, &rq, err, errlen);
    if (rc < 0)
        return rc;
    struct eng_req *r = calloc(1, sizeof *r);
    if (!r)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for a request");
    rc = moed_desc_request(e->desc, c, request_id, &rq, &r->io, err, errlen);
    if (rc < 0) {
        free(r);
        return rc;
    }
    r->t = *t;
    req_queue(e, r);
    return 0;
}

static int eng_register_buf(void *ctx, struct moed_conn *c, const struct moed_register_req *rq,
                            uint32_t *buf_id, char *err, size_t errlen)
{
    struct moed_engine *e = ctx;
    int rc = taking(e, err, errlen);
    return rc < 0 ? rc : moed_desc_register(e->desc, c, rq, buf_id, err, errlen);
}

static int eng_unregister_buf(void *ctx, struct moed_conn *c, uint32_t buf_id, char *err,
                              size_t errlen)
{
    struct moed_engine *e = ctx;
    return moed_desc_unregister(e->desc, c, buf_id, err, errlen);
}

static void eng_conn_closed(void *ctx, struct moed_conn *c)
{
    struct moed_engine *e = ctx;
    moed_desc_conn_closed(e->desc, c);
    chan_reap_kick(e);
}

static int eng_chan_open(void *ctx, struct moed_conn *c, const struct moed_chan_open_req *rq,
                         struct moed_chan_open_rep *rep, const void **kernel, char *err,
                         size_t errlen)
{
    struct moed_engine *e = ctx;
    int rc = taking(e, err, errlen);
    if (rc == 0)
        rc = moed_desc_chan_open(e->desc, c, rq, rep, kernel, err, errlen);
    chan_reap_kick(e); /* one that failed after the backend took it drains */
    return rc;
}

static int eng_chan_close(void *ctx, struct moed_conn *c, uint32_t chan_id, char *err,
                          size_t errlen)
{
    struct moed_engine *e = ctx;
    int rc = moed_desc_chan_close(e->desc, c, chan_id, err, errlen);
    chan_reap_kick(e);
    return rc;
}

static void eng_hello(void *ctx, struct moed_hello_rep *rep)
{
    struct moed_engine *e = ctx;
    const struct moed_dims *d = e->dims;
    rep->hidden = d->hidden;
    rep->inter = d->inter;
    rep->n_experts = d->n_experts;
    rep->top_k = d->top_k;
    rep->n_shared = d->n_shared;
    rep->n_layers = d->n_layers;
    rep->first_moe_layer = e->first_moe_layer;
    rep->max_tokens = e->max_tokens;
    rep->max_frame_bytes = e->max_frame_bytes;
    snprintf(rep->backend, sizeof rep->backend, "%s", e->be->ops->name);
}

static uint32_t eng_moe_layers(void *ctx, uint32_t *out, uint32_t max)
{
    struct moed_engine *e = ctx;
    uint32_t n = 0;
    for (uint32_t l = 0; l < e->dims->n_layers; l++)
        if (moed_model_is_moe_layer(e->model, l)) {
            if (n < max)
                out[n] = l;
            n++;
        }
    return n;
}

static const char *eng_status_json(void *ctx, size_t *len)
{
    struct moed_engine *e = ctx;
    return moed_status_json_cached(&e->status_cache, moed_engine_stats(e), now_ns(),
                                   STATUS_CACHE_MS * 1000000ull, len);
}

static void eng_reply_written(void *ctx, const struct moed_req_times *t, uint64_t now)
{
    struct moed_engine *e = ctx;
    moed_stats_record_stages(&e->stats, t, now);
}

static const struct moed_server_ops engine_ops = {
    .forward = eng_forward,
    .hello = eng_hello,
    .moe_layers = eng_moe_layers,
    .status_json = eng_status_json,
    .reply_written = eng_reply_written,
    .register_buf = eng_register_buf,
    .unregister_buf = eng_unregister_buf,
    .forward_desc = eng_forward_desc,
    .chan_open = eng_chan_open,
    .chan_close = eng_chan_close,
    .conn_closed = eng_conn_closed,
};

void moed_engine_set_server(struct moed_engine *e, const struct moed_server *srv) { e->srv = srv; }

const struct moed_server_ops *moed_engine_server_ops(void) { return &engine_ops; }

struct moed_bufpool *moed_engine_bufpool(struct moed_engine *e) { return e->pool; }

