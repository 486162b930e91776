/* engine_open.c - the engine's life cycle (see engine.c): open the backend
 * and the buffer pool, the start-up self-check, the stats brought up to
 * date, drain and close. */
#include "engine_int.h"

#include "nccl_group.h"
#include "placement.h"

/* ---- expert parallelism over GPUs --------------------------------------------- */

/* engine.gpus with more than one entry and backend cuda: one CUDA backend
 * per entry under moed_backend_ep_open (backend.h), child i on gpus[i]
 * with device i of every layer's placement; the rows on gpus[0]. What the
 * wrapper borrows lives here, freed after it closes (eng_ep_free). */
struct eng_ep {
    struct moed_model *model;
    struct moed_backend_cfg bc; /* the children's, less their own fields */
    int gpus[MOED_PLACE_MAX_DEVS];
    uint32_t n;
    struct moed_placement *place;            /* [n_layers]: zeroed for non-MoE layers */
    const struct moed_placement **place_ptr; /* [n_layers]: NULL for non-MoE layers */
    uint32_t n_layers;
    struct moed_buf rows;
    struct moed_nccl_group *grp; /* engine.nccl_ranks > 1: the group (NULL: none) */
    uint32_t rank;               /* this daemon's rank in it */
};

static void eng_ep_free(struct eng_ep *ep)
{
    if (!ep)
        return;
    moed_nccl_close(ep->grp); /* after every backend on it closed */
    moed_backend_cuda_rows_free(&ep->rows);
    if (ep->place)
        for (uint32_t l = 0; l < ep->n_layers; l++)
            moed_placement_free(&ep->place[l]);
    free(ep->place);
    free(ep->place_ptr);
    free(ep);
}

static int ep_open_child(void *ctx, uint32_t i, moed_backend_done_fn done, void *done_ctx,
                         struct moed_backend **out, char *err, size_t errlen)
{
    const struct eng_ep *ep = ctx;
    struct moed_backend_cfg c = ep->bc;
    c.gpus = &ep->gpus[i];
    c.n_gpus = 1;
    c.ep_place = ep->place_ptr;
    c.ep_shard = i;
    c.sm_share = 0; /* the entries naming this GPU share its SMs (an NCCL rank opens one) */
    for (uint32_t j = 0; j < ep->n && !ep->grp; j++)
        c.sm_share += ep->gpus[j] == ep->gpus[i];
    c.max_channels = 0; /* doorbell channels: one device's kernel, not a child's */
    /* NCCL's kernels need whole SMs beside it; ranks sharing a GPU (under
     * MPS) take disjoint partitions: a persistent grid must be resident
     * whole */
    c.sm_partition = ep->grp ? 1 + (int)ep->rank : 0;
    return moed_backend_cuda_open(ep->model, &c, done, done_ctx, out, err, errlen);
}

/* Every MoE layer's placement: engine.placement's map, or balanced by
 * expert count. */
static int ep_place(struct eng_ep *ep, const struct moed_cfg *cfg, const struct moed_dims *d,
                    char *err, size_t errlen)
{
    int rc = 0;
    uint8_t *is_moe = calloc(d->n_layers ? d->n_layers : 1, 1);
    uint64_t *zero = calloc(d->n_experts ? d->n_experts : 1, sizeof *zero);
    if (!is_moe || !zero) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
        goto out;
    }
    for (uint32_t l = 0; l < d->n_layers; l++)
        is_moe[l] = moed_model_is_moe_layer(ep->model, l) != 0;
    if (cfg->placement[0]) {
        rc = moed_placement_load_json(cfg->placement, d->n_layers, is_moe, d->n_experts,
                                      d->n_shared, ep->n, ep->place, err, errlen);
    } else {
        for (uint32_t l = 0; l < d->n_layers && !rc; l++)
            if (is_moe[l])
                rc = moed_placement_balanced(d->n_experts, d->n_shared, ep->n, zero, 1, 1.0,
                                             &ep->place[l], err, errlen);
    }
    for (uint32_t l = 0; l < d->n_layers && !rc; l++)
        ep->place_ptr[l] = is_moe[l] ? &ep->place[l] : NULL;
out:
    free(is_moe);
    free(zero);
    return rc;
}

/* What expert parallelism over n devices holds (device i on gpus[i]), with
 * every MoE layer placed, into *out; 0 or the error. */
static int eng_ep_new(struct moed_engine *e, const struct moed_cfg *cfg,
                      const struct moed_backend_cfg *bc, uint32_t n, const int *gpus,
                      struct eng_ep **out, char *err, size_t errlen)
{
    const struct moed_dims *d = e->dims;
    struct eng_ep *ep = calloc(1, sizeof *ep);
    *out = NULL;
    if (!ep)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
    ep->model = e->model;
    ep->bc = *bc;
    ep->n = n;
    memcpy(ep->gpus, gpus, sizeof(int) * n);
    ep->n_layers = d->n_layers;
    ep->place = calloc(d->n_layers ? d->n_layers : 1, sizeof *ep->place);
    ep->place_ptr = calloc(d->n_layers ? d->n_layers : 1, sizeof *ep->place_ptr);
    int rc = !ep->place || !ep->place_ptr
                 ? moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory")
                 : ep_place(ep, cfg, d, err, errlen);
    if (rc) {
        eng_ep_free(ep);
        return rc;
    }
    *out = ep;
    return 0;
}

/* The EP backend over ep's devices (open_child opens device i), the rows
 * (fp32 [max_tokens * (k + S), H], every device's, combined on device 0)
 * on rows_gpus[0], which rows_gpus[1..n_rows_gpus) write by peer access. */
static int eng_ep_open(struct moed_engine *e, struct eng_ep *ep, const struct moed_cfg *cfg,
                       int (*open_child)(void *, uint32_t, moed_backend_done_fn, void *,
                                         struct moed_backend **, char *, size_t),
                       int n_rows_gpus, char *err, size_t errlen)
{
    const struct moed_dims *d = e->dims;
    const uint64_t rows = (uint64_t)cfg->max_tokens * (d->top_k + d->n_shared) * d->hidden * 4;
    int rc = moed_backend_cuda_rows_alloc(ep->gpus, n_rows_gpus, rows, &ep->rows, err, errlen);
    if (rc)
        return rc;
    const struct moed_ep_cfg ec = {.n_dev = ep->n,
                                   .open_child = open_child,
                                   .open_ctx = ep,
                                   .place = ep->place_ptr,
                                   .n_layers = d->n_layers,
                                   .rows = ep->rows,
                                   .max_tokens = cfg->max_tokens};
    rc = moed_backend_ep_open(e->model, &ec, on_backend_done, e, &e->be, err, errlen);
    if (rc < 0)
        return rc;
    e->ep = ep;
    return 0;
}

static int open_ep_cuda(struct moed_engine *e, const struct moed_cfg *cfg,
                        const struct moed_backend_cfg *bc, char *err, size_t errlen)
{
    if (cfg->n_gpus > MOED_PLACE_MAX_DEVS)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "engine.gpus lists %u GPUs; expert parallelism spans at most %d",
                           cfg->n_gpus, MOED_PLACE_MAX_DEVS);
    struct eng_ep *ep;
    int rc = eng_ep_new(e, cfg, bc, cfg->n_gpus, cfg->gpus, &ep, err, errlen);
    if (rc)
        return rc;
    rc = eng_ep_open(e, ep, cfg, ep_open_child, (int)ep->n, err, errlen);
    if (rc) {
        eng_ep_free(ep);
        return rc;
    }
    LOG_I("engine: expert parallelism over %u devices (engine.gpus), placement %s", ep->n,
          cfg->placement[0] ? cfg->placement : "balanced by expert count");
    return 0;
}

/* engine.nccl_ranks > 1: the NCCL group of daemons (nccl_group.h). Rank 0:
 * the EP backend over the ranks, device 0 its own GPU, device r the peer
 * rank r; rank r > 0: the worker, its own GPU device r of the placement. */
static int nccl_open_child(void *ctx, uint32_t i, moed_backend_done_fn done, void *done_ctx,
                           struct moed_backend **out, char *err, size_t errlen)
{
    const struct eng_ep *ep = ctx;
    if (i == ep->rank)
        return ep_open_child(ctx, i, done, done_ctx, out, err, errlen);
    return moed_nccl_peer_open(ep->grp, i, done, done_ctx, out, err, errlen);
}

static int open_nccl(struct moed_engine *e, const struct moed_cfg *cfg,
                     const struct moed_backend_cfg *bc, char *err, size_t errlen)
{
    int gpus[MOED_PLACE_MAX_DEVS];
    const int gpu = cfg->n_gpus ? cfg->gpus[0] : 0;
    for (uint32_t i = 0; i < cfg->nccl_ranks; i++)
        gpus[i] = gpu; /* only entry `rank` is opened here */
    struct eng_ep *ep;
    int rc = eng_ep_new(e, cfg, bc, cfg->nccl_ranks, gpus, &ep, err, errlen);
    if (rc)
        return rc;
    ep->rank = cfg->nccl_rank;
    const struct moed_nccl_cfg nc = {.ranks = cfg->nccl_ranks,
                                     .rank = cfg->nccl_rank,
                                     .id_file = cfg->nccl_id_file,
                                     .timeout_ms = cfg->nccl_timeout_ms,
                                     .keepalive_ms = cfg->nccl_keepalive_ms,
                                     .gpu = gpu,
                                     .max_tokens = cfg->max_tokens};
    rc = moed_nccl_open(e->model, &nc, &ep->grp, err, errlen);
    if (!rc && ep->rank > 0) {
        rc = moed_nccl_worker_open(ep->grp, ep_open_child, ep, on_backend_done, e, &e->be, err,
                                   errlen);
        if (!rc)
            e->ep = ep;
    } else if (!rc) {
        rc = eng_ep_open(e, ep, cfg, nccl_open_child, 1, err, errlen);
        if (!rc)
            LOG_I("engine: expert parallelism over the %u ranks of an NCCL group, placement %s",
                  ep->n, cfg->placement[0] ? cfg->placement : "balanced by expert count");
    }
    if (rc)
        eng_ep_free(ep);
    return rc;
}

/* ---- open / self-check / close ------------------------------------------------- */

static int open_backend(struct moed_engine *e, const struct moed_cfg *cfg,
                        moed_progress_fn progress, void *progress_ctx, char *err, size_t errlen)
{
    struct moed_backend_cfg bc = {
        .progress = progress,
        .progress_ctx = progress_ctx,
        .n_threads = (int)cfg->cpu_threads,
        .gpus = cfg->n_gpus ? cfg->gpus : NULL,
        .n_gpus = (int)cfg->n_gpus,
        .sms_free = (int)cfg->sms_free,
        .mps_sms_free_percent = (int)cfg->mps_sms_free_percent,
        .max_tokens = cfg->max_tokens,
        .batch_deadline_ms = cfg->batch_deadline_ms,
        .idle_exit_ms = cfg->idle_exit_ms,
        .max_channels = cfg->max_channels,
    };
    enum moed_cfg_backend kind = cfg->backend;
    if (kind == MOED_CFG_BACKEND_AUTO)
        kind = moed_backend_cuda_available() ? MOED_CFG_BACKEND_CUDA : MOED_CFG_BACKEND_CPU;
    if (kind == MOED_CFG_BACKEND_CUDA) {
        if (!moed_backend_cuda_available())
            return moed_seterr(err, errlen, MOED_E_BACKEND,
                               "engine.backend is \"cuda\" but %s",
#ifdef MOED_HAVE_CUDA
                               "no CUDA device is visible"
#else
                               "this build has no CUDA (built with CUDA=0)"
#endif
            );
        if (cfg->nccl_ranks > 1)
            return open_nccl(e, cfg, &bc, err, errlen);
        if (cfg->n_gpus > 1)
            return open_ep_cuda(e, cfg, &bc, err, errlen);
        return moed_backend_cuda_open(e->model, &bc, on_backend_done, e, &e->be, err, errlen);
    }
    return moed_backend_cpu_open(e->model, &bc, on_backend_done, e, &e->be, err, errlen);
}

static void *pool_host_alloc(void *ctx, size_t bytes)
{
    struct moed_backend *be = ctx;
    return be->ops->host_alloc(be, bytes);
}

static void pool_host_free(void *ctx, void *p)
{
    struct moed_backend *be = ctx;
    be->ops->host_free(be, p);
}

/* The buffer pool, on the backend's host allocator when it has one. */
static int open_pool(struct moed_engine *e, const struct moed_cfg *cfg, char *err, size_t errlen)
{
    const struct moed_backend_ops *ops = e->be->ops;
    struct moed_bufpool_cfg pc = {.pinned_limit = cfg->pinned_pool_bytes,
                                  .keep_bytes = cfg->read_buffer_keep_bytes};
    if (ops->host_alloc && ops->host_free)
        pc.pinned = (struct moed_host_allocator){pool_host_alloc, pool_host_free, e->be};
    if (moed_bufpool_open(&pc, &e->pool) < 0)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
    e->io_env = (struct moed_reqio_env){e->pool, e->dims->hidden, e->dims->top_k};
    if (pc.pinned.alloc && pc.pinned_limit)
        LOG_I("buffers: up to %llu MiB of backend %s host memory, used in place "
              "(server.pinned_pool_bytes)", (unsigned long long)(pc.pinned_limit >> 20), ops->name);
    else if (pc.pinned.alloc)
        LOG_I("buffers: ordinary memory (server.pinned_pool_bytes is 0)");
    else
        LOG_I("buffers: ordinary memory (backend %s has no host memory of its own)", ops->name);
    return 0;
}

int moed_engine_open(uv_loop_t *loop, struct moed_model *model, const struct moed_cfg *cfg,
                     moed_progress_fn progress, void *progress_ctx, struct moed_engine **out,
                     char *err, size_t errlen)
{
    int rc;
    *out = NULL;
    struct moed_engine *e = calloc(1, sizeof *e);
    if (!e) {
        moed_model_close(model);
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
    }
    e->loop = loop;
    e->model = model;
    e->dims = moed_model_dims(model);
    e->max_tokens = cfg->max_tokens;
    e->spin_ns = (uint64_t)cfg->loop_spin_us * 1000;
    e->max_frame_bytes = cfg->max_frame_bytes;
    e->first_moe_layer = e->dims->n_layers;
    for (uint32_t l = 0; l < e->dims->n_layers; l++)
        if (moed_model_is_moe_layer(model, l)) {
            e->first_moe_layer = l;
            break;
        }
    uint64_t need = moed_forward_payload_len(cfg->max_tokens, e->dims->hidden, e->dims->top_k);
    if (need == 0 || need > cfg->max_frame_bytes) {
        rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                         "server.max_frame_bytes %llu is below the %llu bytes a FORWARD of "
                         "engine.max_tokens %u tokens needs for this model (H=%u, k=%u)",
                         (unsigned long long)cfg->max_frame_bytes, (unsigned long long)need,
                         cfg->max_tokens, e->dims->hidden, e->dims->top_k);
        goto fail_model;
    }
    e->stats.version = MOED_VERSION;
    e->stats.start_ns = now_ns();
    e->stats.dims = e->dims;
    e->stats.model_path = moed_model_dir(model);
    e->stats.backend = "";
    e->stats.n_expert_hits = e->dims->n_experts + e->dims->n_shared;
    e->stats.n_hit_layers = e->dims->n_layers; /* rows by absolute layer (validated < this) */
    e->stats.expert_hits =
        calloc((size_t)e->stats.n_hit_layers * e->stats.n_expert_hits, sizeof(uint64_t));
    if (!e->stats.expert_hits) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
        goto fail_model;
    }
    pthread_mutex_init(&e->done_mu, NULL);
    e->async.data = e; /* on_async drains completions also before attach */
    rc = open_backend(e, cfg, progress, progress_ctx, err, errlen);
    if (rc < 0)
        goto fail_mutex;
    rc = open_pool(e, cfg, err, errlen);
    if (rc < 0)
        goto fail_backend;
    if (moed_desc_open(e->be, cfg->max_registered_buffers, cfg->max_channels,
                       cfg->max_channels_per_client, e->dims->hidden,
                       e->dims->top_k, cfg->max_tokens, &e->desc) < 0) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
        moed_bufpool_close(e->pool);
        goto fail_backend;
    }
    e->stats.backend = e->be->ops->name;
    e->backend_name = e->be->ops->name;
    e->stats.healthy = 1;
    if (e->be->ops->describe)
        e->be->ops->describe(e->be, e->stats.backend_desc, sizeof e->stats.backend_desc);
    *out = e;
    return 0;

fail_backend:
    moed_backend_close(e->be);
    eng_ep_free(e->ep);
    e->ep = NULL;
fail_mutex:
    pthread_mutex_destroy(&e->done_mu);
    free(e->stats.expert_hits);
fail_model:
    moed_model_close(model);
    free(e);
    return rc;
}

int moed_engine_self_check(struct moed_engine *e, char *err, size_t errlen)
{
    const struct moed_dims *d = e->dims;
    const uint32_t T = e->max_tokens < 4 ? e->max_tokens : 4, H = d->hidden, k = d->top_k;
    const uint32_t L = e->first_moe_layer;
    int rc = 0;
    if (e->ep && e->ep->rank > 0) {
        LOG_I("self-check: skipped on rank %u of the NCCL group (it computes rank 0's batches "
              "only; rank 0's self-check runs through it)", e->ep->rank);
        return 0;
    }
    uint16_t *ref = NULL;
    struct eng_batch *eb = batch_alloc(e, L, T);
    const struct moe_layer *layer = moed_model_layer(e->model, L);
    if (!eb || !layer || !(ref = malloc((size_t)T * H * 2))) {
        rc = moed_seterr(err, errlen, layer ? MOED_E_NOMEM : MOED_E_MODEL,
                         layer ? "out of memory" : "self-check: model has no MoE layer %u", L);
        goto out;
    }
    eb->selfcheck = 1;
    /* Deterministic input: a small LCG, distinct experts per token. */
    uint16_t *x = eb->b.x.ptr;
    int32_t *ids = eb->b.ids.ptr;
    float *w = eb->b.w.ptr;
    uint32_t s = 12345u;
    for (size_t i = 0; i < (size_t)T * H; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = bf16_from_float(((float)(s >> 8) / 16777216.0f - 0.5f) * 2.0f);
    }
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t j = 0; j < k; j++) {
            ids[t * k + j] = (int32_t)((t * 7 + j * 3 + j * j) % d->n_experts);
            w[t * k + j] = 1.0f / (float)(j + 1);
        }
    busy_begin(e);
    rc = moed_backend_submit(e->be, &eb->b);
    if (rc < 0) {
        busy_end(e);
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "self-check: backend %s refused a batch: %s",
                         e->be->ops->name, moed_strerror(rc));
        goto out;
    }
    while (!e->selfcheck_done)
        uv_run(e->loop, UV_RUN_ONCE);
    if (eb->b.status != 0) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "self-check: backend %s failed the batch: %s",
                         e->be->ops->name, moed_strerror(eb->b.status));
        goto out;
    }
    rc = moe_ref_forward(layer, T, x, ids, w, ref, 0);
    if (rc < 0) {
        rc = moed_seterr(err, errlen, rc, "self-check: moe_ref_forward: %s", moed_strerror(rc));
        goto out;
    }
    double rel = bf16_rel_l2(eb->b.y.ptr, ref, (size_t)T * H);
    if (!(rel <= 1e-2)) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND,
                         "self-check: backend %s differs from the CPU reference on layer %u, %u "
                         "tokens: relative L2 error %.3g (allowed 1e-2)",
                         e->be->ops->name, L, T, rel);
        goto out;
    }
    LOG_I("self-check passed: backend %s, layer %u, %u tokens, relative L2 error %.2e",
          e->be->ops->name, L, T, rel);
    e->stats.loaded = 1;
out:
    free(ref);
    if (eb)
        batch_free(e, eb);
    return rc;
}

struct moed_stats *moed_engine_stats(struct moed_engine *e)
{
    /* busy_ns is kept in closed intervals; include the open one here by
     * closing and reopening it. */
    if (e->outstanding > 0) {
        uint64_t t = now_ns();
        e->stats.busy_ns += t - e->busy_since_ns;
        e->busy_since_ns = t;
    }
    if (e->srv) {
        const struct moed_server_counters *sc = moed_server_counters(e->srv);
        e->stats.clients = sc->clients;
        e->stats.clients_total = sc->clients_total;
        e->stats.clients_refused = sc->clients_refused;
        memcpy(e->stats.errors, sc->errors, sizeof e->stats.errors);
    }
    if (e->be && e->be->ops->healthy && !e->failed)
        e->stats.healthy = e->be->ops->healthy(e->be) ? 1 : 0;
    if (e->pool) {
        struct moed_bufpool_stats ps;
        moed_bufpool_get_stats(e->pool, &ps);
        e->stats.pinned_bytes = ps.pinned_bytes;
        e->stats.pinned_free_bytes = ps.pinned_free_bytes;
        e->stats.pinned_limit = ps.pinned_limit;
        e->stats.pinned_allocs = ps.pinned_allocs;
        e->stats.spare_bytes = ps.spare_bytes;
    }
    if (e->desc) {
        struct moed_desc_stats ds;
        moed_desc_get_stats(e->desc, &ds);
        e->stats.zc_registered = ds.registered;
        e->stats.zc_mappings = ds.mappings;
        e->stats.zc_mapped_bytes = ds.mapped_bytes;
        e->stats.zc_peer_mappings = ds.peer_mappings;
        e->stats.zc_registers = ds.registers;
        e->stats.zc_refused = ds.refused;
        e->stats.zc_requests = ds.requests;
        e->stats.ch_open = ds.chans_open;
        e->stats.ch_draining = ds.chans_draining;
        e->stats.ch_arena_bytes = ds.arena_bytes;
        e->stats.ch_opens = ds.chan_opens;
        e->stats.ch_refused = ds.chan_refused;
        e->stats.db_served = ds.db_served;
        e->stats.db_refused = ds.db_refused;
        e->stats.db_kernel_ns = ds.db_kernel_ns;
        struct moed_desc_chan_row rows[MOED_STATS_MAX_CHANS];
        uint32_t n = moed_desc_chan_rows(e->desc, rows, MOED_STATS_MAX_CHANS);
        for (uint32_t i = 0; i < n; i++)
            e->stats.chans[i] = (struct moed_stats_chan){
                rows[i].id, rows[i].index, rows[i].n_bufs, (uint32_t)rows[i].draining,
                rows[i].gpu, rows[i].arena_bytes, rows[i].st.served, rows[i].st.refused,
                rows[i].st.kernel_ns, rows[i].st.last};
        e->stats.n_chans = n;
    }
    if (e->be && e->be->ops->heartbeat) {
        uint64_t hb = e->be->ops->heartbeat(e->be), t = now_ns();
        if (hb != e->hb_last || e->hb_changed_ns == 0) {
            e->hb_last = hb;
            e->hb_changed_ns = t;
        }
        e->stats.heartbeat = hb;
        e->stats.heartbeat_age_ms = (t - e->hb_changed_ns) / 1000000u;
    }
    return &e->stats;
}

void moed_engine_on_failure(struct moed_engine *e, void (*cb)(void *arg), void *arg)
{
    e->fail_cb = cb;
    e->fail_arg = arg;
}

void moed_engine_drain(struct moed_engine *e, void (*done)(void *arg), void (*progress)(void *arg),
                       void *arg)
{
    e->draining = 1;
    e->drain_cb = done;
    e->drain_progress = progress;
    e->drain_arg = arg;
    LOG_I("draining: %llu requests in flight (%llu waiting, %u batches at the backend)",
          (unsigned long long)e->stats.in_flight, (unsigned long long)e->n_waiting, e->outstanding);
    maybe_drained(e);
}

int moed_engine_failed(const struct moed_engine *e) { return e->failed; }

static void on_async_closed(uv_handle_t *h)
{
    struct moed_engine *e = h->data;
    if (--e->closes_pending > 0)
        return;
    free(e->stats.expert_hits);
    moed_status_cache_free(&e->status_cache);
    pthread_mutex_destroy(&e->done_mu);
    free(e);
}

void moed_engine_close(struct moed_engine *e)
{
    if (!e)
        return;
    /* Pinned buffers go back to the backend while it is open (it frees them
     * once its kernel has stopped). The backend finishes (or fails) what is
     * queued and calls done for each batch; run their completions here so
     * every request is answered. */
    moed_bufpool_release_pinned(e->pool);
    moed_desc_chan_reap(e->desc); /* what is quiet already goes while the backend can say so */
    moed_desc_detach(e->desc);
    moed_backend_close(e->be);
    e->be = NULL;
    eng_ep_free(e->ep); /* what the expert-parallel backend borrowed, after it closed */
    e->ep = NULL;
    e->failed = 1; /* nothing more is submitted */
    on_async(&e->async);
    while (e->wait_head) {
        struct eng_req *r = e->wait_head;
        e->wait_head = r->next;
        req_fail(e, r, MOED_E_SHUTDOWN, "moed is shutting down");
    }
    e->wait_tail = NULL;
    moed_desc_close(e->desc);
    e->desc = NULL;
    moed_bufpool_close(e->pool);
    e->pool = NULL;
    moed_model_close(e->model);
    e->model = NULL;
    if (!e->attached) { /* no handles on the loop: free now */
        free(e->stats.expert_hits);
        moed_status_cache_free(&e->status_cache);
        pthread_mutex_destroy(&e->done_mu);
        free(e);
        return;
    }
    e->closes_pending = 1;
    if (e->health_timer_on) {
        e->closes_pending++;
        uv_close((uv_handle_t *)&e->health_timer, on_async_closed);
    }
    if (e->chan_timer_on) {
        e->closes_pending++;
        uv_close((uv_handle_t *)&e->chan_timer, on_async_closed);
    }
    if (e->spin_on) {
        e->closes_pending++;
        uv_close((uv_handle_t *)&e->spin, on_async_closed);
    }
    uv_close((uv_handle_t *)&e->async, on_async_closed);
}

