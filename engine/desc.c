/* desc.c - registered client buffers and FORWARD_DESC requests (desc.h). */
#include "desc.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_gpu_abi.h"
#include "moed_err.h"
#include "moed_log.h"

_Static_assert(MOED_PROTO_CHAN_BUFS == MOE_GPU_CHAN_BUFS, "a channel's buffers: wire = kernel");
_Static_assert(MOED_PROTO_CHAN_ARENA_OFF == MOE_GPU_CHAN_ARENA_OFF, "the arena: wire = kernel");
_Static_assert(MOE_GPU_MAX_CHANS == 16, "engine.max_channels' bound (config_keys.c) is the "
                                        "kernel's table size");

/* One mapped client allocation (backend ipc_open), shared by every
 * registration of the same handle. */
struct desc_map {
    struct desc_map *next;
    uint8_t handle[MOED_PROTO_IPC_HANDLE_BYTES];
    struct moed_buf mem; /* where it is mapped here (kind, device, base, bytes) */
    uint32_t refs;       /* registrations using it */
    int gpu;             /* the client's GPU: -1 this daemon's, else its peer ordinal */
};

/* One registration: [off, off + size) of a mapping. */
struct desc_buf {
    uint32_t id;
    uint32_t refs; /* 1 while registered, + 1 per request holding it */
    struct desc_map *map;
    uint64_t off, size;
};

/* A connection's registrations (moed_server_conn_user). */
struct desc_conn {
    uint32_t n, next_id;
    struct desc_buf *bufs[]; /* max_per_conn slots, n used */
};

/* A doorbell channel: its backend table entry and the registrations its
 * descriptors name (a reference on each). */
struct desc_chan {
    struct desc_chan *next;
    struct moed_conn *conn; /* its connection while open; NULL once draining */
    uint32_t id, index, n_bufs;
    int gpu;                /* the client's GPU: -1 this daemon's, else its peer ordinal */
    uint64_t arena_bytes;   /* its arena in the daemon (0: none); table range 0 then */
    struct desc_buf *bufs[MOED_PROTO_CHAN_BUFS];
};

struct moed_desc {
    struct moed_backend *be;
    uint32_t max_per_conn, max_chans, max_chans_per_conn, hidden, top_k, max_tokens;
    struct desc_map *maps;
    struct desc_chan *chans, *draining; /* open; closed, the backend not yet quiet */
    uint32_t next_chan_id;
    struct moed_desc_stats st; /* db_*: those of reaped channels (get_stats adds the live) */
    int warned_mps;
};

/* A FORWARD_DESC request's state (moed_reqio.src). */
struct desc_req {
    struct moed_desc *d;
    struct desc_buf *ref[4]; /* x, ids, w, y */
    struct moed_buf buf[4];
    int leak;                /* abandoned: the device may still touch them */
    int times;               /* MOED_FORWARD_DESC_TIMES: the reply carries its times */
};

static void map_put(struct moed_desc *d, struct desc_map *m)
{
    if (--m->refs)
        return;
    struct desc_map **pp = &d->maps;
    while (*pp != m)
        pp = &(*pp)->next;
    *pp = m->next;
    if (d->be) /* NULL: detached, the backend has closed */
        d->be->ops->ipc_close(d->be, &m->mem);
    d->st.mappings--;
    d->st.mapped_bytes -= m->mem.bytes;
    d->st.peer_mappings -= m->gpu >= 0;
    free(m);
}

static void buf_put(struct moed_desc *d, struct desc_buf *b)
{
    if (--b->refs)
        return;
    map_put(d, b->map);
    d->st.registered--;
    free(b);
}

int moed_desc_open(struct moed_backend *be, uint32_t max_per_conn, uint32_t max_chans,
                   uint32_t max_chans_per_conn, uint32_t hidden, uint32_t top_k,
                   uint32_t max_tokens, struct moed_desc **out)
{
    struct moed_desc *d = calloc(1, sizeof *d);
    if (!d)
        return MOED_E_NOMEM;
    d->be = be;
    d->max_per_conn = max_per_conn;
    d->max_chans = max_chans;
    d->max_chans_per_conn = max_chans_per_conn;
    d->next_chan_id = 1;
    d->hidden = hidden;
    d->top_k = top_k;
    d->max_tokens = max_tokens;
    *out = d;
    return 0;
}

void moed_desc_detach(struct moed_desc *d)
{
    if (!d || !d->be)
        return;
    if (d->chans || d->draining)
        LOG_W("channels: %" PRIu64 " open and %" PRIu64 " draining as the backend closes; "
              "their mappings are left to process exit",
              d->st.chans_open, d->st.chans_draining);
    if (d->maps)
        LOG_W("buffers: %" PRIu64 " client mappings still held as the backend closes "
              "(abandoned batches, channels); left to process exit", d->st.mappings);
    d->be = NULL;
}

void moed_desc_close(struct moed_desc *d)
{
    if (!d)
        return;
    moed_desc_detach(d);
    /* channels still open or draining (the backend has closed: nothing
     * touches them now): their references go, the mappings stay to exit */
    struct desc_chan *lists[2] = {d->chans, d->draining};
    for (int i = 0; i < 2; i++)
        for (struct desc_chan *ch = lists[i], *nx; ch; ch = nx) {
            nx = ch->next;
            for (uint32_t k = 0; k < ch->n_bufs; k++)
                buf_put(d, ch->bufs[k]);
            free(ch);
        }
    for (struct desc_map *m = d->maps, *nx; m; m = nx) {
        nx = m->next;
        free(m);
    }
    free(d);
}

static struct desc_conn *conn_table(struct moed_desc *d, struct moed_conn *c, int create)
{
    void **slot = moed_server_conn_user(c);
    if (!*slot && create) {
        struct desc_conn *t = calloc(1, sizeof *t + d->max_per_conn * sizeof t->bufs[0]);
        if (t)
            t->next_id = 1;
        *slot = t;
    }
    return *slot;
}

static void hex16(const uint8_t *u, char out[33])
{
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", u[i]);
}

/* Which GPU the client's memory or kernels are on (REGISTER_BUF's and
 * CHAN_OPEN's uuid): *gpu -1 for this daemon's own (then *mps says whether
 * it is shared through MPS), else the ordinal of a GPU the backend serves by
 * peer access (no MPS needed: the client's kernels run on their own GPU).
 * Anything else is refused naming both UUIDs and the reason; `what` says
 * what lies there ("the buffer lies", "the client's kernels run"). */
static int client_gpu(struct moed_desc *d, const uint8_t want[MOED_PROTO_UUID_BYTES],
                      const char *what, int *gpu, int *mps, char *err, size_t errlen)
{
    const struct moed_backend_ops *ops = d->be->ops;
    uint8_t uuid[MOED_PROTO_UUID_BYTES];
    *gpu = -1;
    *mps = 0;
    int rc = ops->device_uuid(d->be, uuid, mps);
    if (rc < 0)
        return moed_seterr(err, errlen, rc, "backend %s: the GPU's UUID is not known", ops->name);
    if (memcmp(uuid, want, sizeof uuid) == 0)
        return 0;
    char a[33], b[33], why[200] = "the backend has no peer access";
    hex16(want, a);
    hex16(uuid, b);
    rc = ops->peer_gpu ? ops->peer_gpu(d->be, want, why, sizeof why) : MOED_E_INVAL;
    if (rc >= 0) {
        *gpu = rc;
        return 0;
    }
    return moed_seterr(err, errlen, MOED_E_INVAL,
                       "%s on GPU %s, not on this daemon's GPU %s, and peer access cannot "
                       "serve it: %s",
                       what, a, b, why);
}

/* Validate (everything that does not need the handle), then open. */
static int find(const struct desc_conn *t, uint32_t id)
{
    for (uint32_t i = 0; t && i < t->n; i++)
        if (t->bufs[i]->id == id)
            return (int)i;
    return -1;
}

int moed_desc_register(struct moed_desc *d, struct moed_conn *c,
                       const struct moed_register_req *rq, uint32_t *buf_id, char *err,
                       size_t errlen)
{
    const struct moed_backend_ops *ops = d->be->ops;
    int rc = 0;
    struct desc_map *m = NULL;
    struct desc_conn *t = NULL;
    if (d->max_per_conn == 0) {
        rc = moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                         "buffer registration is off (server.max_registered_buffers is 0)");
        goto out;
    }
    t = conn_table(d, c, 1);
    if (!t) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for the buffer table");
        goto out;
    }
    if (t->n >= d->max_per_conn) {
        rc = moed_seterr(err, errlen, MOED_E_BUSY,
                         "this connection has %u buffers registered, the limit "
                         "(server.max_registered_buffers %u); unregister one first",
                         t->n, d->max_per_conn);
        goto out;
    }
    if (!ops->ipc_open || !ops->device_uuid) {
        rc = moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                         "backend %s cannot open CUDA IPC handles: registered buffers need the "
                         "cuda backend",
                         ops->name);
        goto out;
    }
    int gpu = -1, mps = 0;
    rc = client_gpu(d, rq->uuid, "the buffer lies", &gpu, &mps, err, errlen);
    if (rc < 0)
        goto out;
    if (gpu < 0 && !mps && !d->warned_mps) {
        /* a client on this GPU without MPS: its own kernels (the copies into
         * the buffer it lends) run only while moed's kernel is not resident */
        LOG_W("buffers: a client registers memory of this daemon's GPU, which is not under MPS: "
              "its kernels wait until moed's persistent kernel idles out (engine.idle_exit_ms); "
              "start MPS (docs/ZERO_COPY.md)");
        d->warned_mps = 1;
    }
    for (m = d->maps; m && memcmp(m->handle, rq->handle, sizeof m->handle) != 0; m = m->next)
        ;
    if (m && m->gpu != gpu) {
        /* one allocation claimed as another GPU's memory than before */
        char was[32] = "this daemon's GPU";
        if (m->gpu >= 0)
            snprintf(was, sizeof was, "peer GPU %d", m->gpu);
        rc = moed_seterr(err, errlen, MOED_E_INVAL,
                         "the handle is mapped already as memory of %s, not of the GPU this "
                         "registration names",
                         was);
        m = NULL;
        goto out;
    }
    if (m) {
        m->refs++;
    } else {
        m = calloc(1, sizeof *m);
        if (!m) {
            rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for a mapping");
            goto out;
        }
        memcpy(m->handle, rq->handle, sizeof m->handle);
        rc = ops->ipc_open(d->be, rq->handle, &m->mem, err, errlen);
        if (rc < 0) {
            free(m);
            m = NULL;
            goto out;
        }
        m->refs = 1;
        m->gpu = gpu;
        m->next = d->maps;
        d->maps = m;
        d->st.mappings++;
        d->st.mapped_bytes += m->mem.bytes;
        d->st.peer_mappings += gpu >= 0;
    }
    if (rq->offset > m->mem.bytes || rq->size > m->mem.bytes - rq->offset) {
        rc = moed_seterr(err, errlen, MOED_E_RANGE,
                         "range [%" PRIu64 ", %" PRIu64 ") is past the end of the %" PRIu64
                         "-byte allocation",
                         rq->offset, rq->offset + rq->size, m->mem.bytes);
        goto out;
    }
    struct desc_buf *b = calloc(1, sizeof *b);
    if (!b) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for a registration");
        goto out;
    }
    /* ids are never 0 and never one still registered (after 2^32 of them) */
    while (t->next_id == 0 || find(t, t->next_id) >= 0)
        t->next_id++;
    *b = (struct desc_buf){.id = t->next_id++, .refs = 1, .map = m, .off = rq->offset,
                           .size = rq->size};
    t->bufs[t->n++] = b;
    m = NULL; /* b holds it */
    d->st.registered++;
    d->st.registers++;
    *buf_id = b->id;
out:
    if (m)
        map_put(d, m);
    if (rc < 0)
        d->st.refused++;
    return rc;
}

int moed_desc_unregister(struct moed_desc *d, struct moed_conn *c, uint32_t buf_id, char *err,
                         size_t errlen)
{
    struct desc_conn *t = conn_table(d, c, 0);
    int i = find(t, buf_id);
    if (i < 0)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "buffer id %u is not registered on this connection", buf_id);
    struct desc_buf *b = t->bufs[i];
    for (const struct desc_chan *ch = d->chans; ch; ch = ch->next)
        for (uint32_t k = 0; k < ch->n_bufs; k++)
            if (ch->bufs[k] == b)
                return moed_seterr(err, errlen, MOED_E_BUSY,
                                   "buffer id %u is named by open channel %u (its buffer %u); "
                                   "close the channel first (CHAN_CLOSE)",
                                   buf_id, ch->id, k);
    t->bufs[i] = t->bufs[--t->n];
    buf_put(d, b);
    return 0;
}

static void chan_drain(struct moed_desc *d, struct desc_chan *ch);

void moed_desc_conn_closed(struct moed_desc *d, struct moed_conn *c)
{
    /* its channels first: they keep their registrations until reaped */
    for (struct desc_chan *ch = d->chans, *nx; ch; ch = nx) {
        nx = ch->next;
        if (ch->conn == c)
            chan_drain(d, ch);
    }
    void **slot = moed_server_conn_user(c);
    struct desc_conn *t = *slot;
    if (!t)
        return;
    for (uint32_t i = 0; i < t->n; i++)
        buf_put(d, t->bufs[i]);
    free(t);
    *slot = NULL;
}

/* ---- doorbell channels ---- */

static void chan_stats(const struct moed_desc *d, const struct desc_chan *ch,
                       struct moed_chan_stats *out)
{
    *out = (struct moed_chan_stats){0};
    if (d->be && d->be->ops->chan_stats)
        d->be->ops->chan_stats(d->be, ch->index, out);
}

void moed_desc_get_stats(const struct moed_desc *d, struct moed_desc_stats *out)
{
    *out = d ? d->st : (struct moed_desc_stats){0};
    const struct desc_chan *lists[2] = {d ? d->chans : NULL, d ? d->draining : NULL};
    for (int i = 0; i < 2; i++)
        for (const struct desc_chan *ch = lists[i]; ch; ch = ch->next) {
            struct moed_chan_stats cs;
            chan_stats(d, ch, &cs);
            out->db_served += cs.served;
            out->db_refused += cs.refused;
            out->db_kernel_ns += cs.kernel_ns;
        }
}

/* Close ch at the backend (not waiting) and move it from the open list to
 * the draining list. */
static void chan_drain(struct moed_desc *d, struct desc_chan *ch)
{
    struct desc_chan **pp = &d->chans;
    while (*pp != ch)
        pp = &(*pp)->next;
    *pp = ch->next;
    if (d->be) /* NULL: detached, the backend has closed */
        d->be->ops->chan_close(d->be, ch->index);
    moed_server_conn_hold(ch->conn, -1);
    ch->conn = NULL;
    ch->next = d->draining;
    d->draining = ch;
    d->st.chans_open--;
    d->st.chans_draining++;
}

uint64_t moed_desc_arena_limit(uint32_t max_tokens, uint32_t hidden, uint32_t top_k)
{
    return (uint64_t)max_tokens * (4ull * hidden + 8ull * top_k) + 64;
}

uint32_t moed_desc_chan_reap(struct moed_desc *d)
{
    uint32_t left = 0;
    if (!d || !d->be)
        return 0; /* detached: left to process exit */
    for (struct desc_chan **pp = &d->draining; *pp;) {
        struct desc_chan *ch = *pp;
        if (!d->be->ops->chan_quiet(d->be, ch->index)) {
            left++;
            pp = &ch->next;
            continue;
        }
        /* its final counts (the entry is not reused before the next chan_open) */
        struct moed_chan_stats cs;
        chan_stats(d, ch, &cs);
        d->st.db_served += cs.served;
        d->st.db_refused += cs.refused;
        d->st.db_kernel_ns += cs.kernel_ns;
        *pp = ch->next;
        for (uint32_t i = 0; i < ch->n_bufs; i++)
            buf_put(d, ch->bufs[i]);
        d->st.chans_draining--;
        d->st.arena_bytes -= ch->arena_bytes;
        LOG_D("channels: channel %u (entry %u) reaped: %" PRIu64 " served, %" PRIu64 " refused",
              ch->id, ch->index, cs.served, cs.refused);
        free(ch);
    }
    return left;
}

static struct desc_chan *chan_find(const struct moed_desc *d, uint32_t id)
{
    struct desc_chan *ch = d->chans;
    while (ch && ch->id != id)
        ch = ch->next;
    return ch;
}

/* Everything CHAN_OPEN checks before the backend takes an entry. */
static int chan_check(struct moed_desc *d, struct moed_conn *c,
                      const struct moed_chan_open_req *rq, struct desc_chan *ch, char *err,
                      size_t errlen)
{
    const struct moed_backend_ops *ops = d->be->ops;
    if (d->max_per_conn == 0 && rq->n_bufs > 0) /* an arena alone needs none */
        return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                           "doorbell channels name registered buffers, and registration is off "
                           "(server.max_registered_buffers is 0)");
    if (d->max_chans == 0)
        return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                           "doorbell channels are off: engine.max_channels is 0");
    if (!ops->chan_open || !ops->chan_close || !ops->chan_quiet || !ops->device_uuid)
        return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                           "doorbell channels need the cuda backend (backend %s has none)",
                           ops->name);
    const uint64_t limit = moed_desc_arena_limit(d->max_tokens, d->hidden, d->top_k);
    if (rq->arena_bytes > limit)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "CHAN_OPEN arena_bytes %" PRIu64 " is over the limit %" PRIu64
                           " (max_tokens rows of x, ids, w and y for this model)",
                           rq->arena_bytes, limit);
    uint32_t mine = 0;
    for (const struct desc_chan *o = d->chans; o; o = o->next)
        mine += o->conn == c;
    if (mine >= d->max_chans_per_conn)
        return moed_seterr(err, errlen, MOED_E_BUSY,
                           "this connection has %u doorbell channels open "
                           "(server.max_channels_per_client %u); close one first",
                           mine, d->max_chans_per_conn);
    const struct desc_conn *t = conn_table(d, c, 0);
    for (uint32_t i = 0; i < rq->n_bufs; i++) {
        int k = find(t, rq->buf_ids[i]);
        if (k < 0)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "buf_ids[%u]: buffer id %u is not registered on this connection",
                               i, rq->buf_ids[i]);
        ch->bufs[i] = t->bufs[k];
    }
    int mps = 0;
    int rc = client_gpu(d, rq->uuid, "the client's kernels run", &ch->gpu, &mps, err, errlen);
    if (rc < 0)
        return rc;
    if (ch->gpu < 0 && !mps)
        return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                           "the client's GPU is moed's GPU and MPS is off: the client's kernels "
                           "cannot run while moed's persistent kernel is resident; start MPS "
                           "(docs/ZERO_COPY.md)");
    return 0;
}

int moed_desc_chan_open(struct moed_desc *d, struct moed_conn *c,
                        const struct moed_chan_open_req *rq, struct moed_chan_open_rep *rep,
                        const void **kernel, char *err, size_t errlen)
{
    struct desc_chan *ch = calloc(1, sizeof *ch);
    int rc = ch ? 0 : moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for a channel");
    if (rc == 0)
        rc = chan_check(d, c, rq, ch, err, errlen);
    struct moed_chan_buf bufs[MOED_PROTO_CHAN_BUFS];
    struct moed_chan_info info = {0};
    for (uint32_t i = 0; rc == 0 && i < rq->n_bufs; i++) {
        const struct desc_buf *b = ch->bufs[i];
        bufs[i] = (struct moed_chan_buf){(uint8_t *)b->map->mem.ptr + b->off, b->size};
    }
    if (rc == 0)
        rc = d->be->ops->chan_open(d->be, bufs, rq->n_bufs, rq->arena_bytes, &info, err, errlen);
    if (rc < 0) {
        free(ch);
        d->st.chan_refused++;
        return rc;
    }
    while (d->next_chan_id == 0 || chan_find(d, d->next_chan_id))
        d->next_chan_id++;
    ch->id = d->next_chan_id++;
    ch->index = info.index;
    ch->n_bufs = rq->n_bufs;
    ch->arena_bytes = info.arena_bytes;
    ch->conn = c;
    moed_server_conn_hold(c, 1); /* used on the GPU: the connection is not idle */
    for (uint32_t i = 0; i < ch->n_bufs; i++)
        ch->bufs[i]->refs++;
    ch->next = d->chans;
    d->chans = ch;
    d->st.chans_open++;
    d->st.arena_bytes += ch->arena_bytes;
    if (info.kernel_bytes == 0 || info.kernel_bytes > MOED_PROTO_MAX_CHAN_KERNEL) {
        /* a build without the client kernel: nothing a client could call */
        chan_drain(d, ch);
        d->st.chan_refused++;
        return moed_seterr(err, errlen, MOED_E_BACKEND,
                           "backend %s: the client kernel's fatbin is %" PRIu64
                           " bytes (1..%u expected)",
                           d->be->ops->name, info.kernel_bytes, MOED_PROTO_MAX_CHAN_KERNEL);
    }
    d->st.chan_opens++;
    *rep = (struct moed_chan_open_rep){.chan_id = ch->id, .slots = MOE_GPU_CHAN_SLOTS,
                                       .key = info.key, .size = info.size,
                                       .abi_version = MOE_GPU_ABI_VERSION,
                                       .kernel_bytes = (uint32_t)info.kernel_bytes,
                                       .arena_off = info.arena_off,
                                       .arena_bytes = info.arena_bytes};
    memcpy(rep->handle, info.handle, sizeof rep->handle);
    *kernel = info.kernel;
    LOG_D("channels: channel %u open (entry %u, %u buffers, a %" PRIu64 "-byte arena, client "
          "GPU %d: -1 this daemon's)",
          ch->id, ch->index, ch->n_bufs, ch->arena_bytes, ch->gpu);
    return 0;
}

int moed_desc_chan_close(struct moed_desc *d, struct moed_conn *c, uint32_t chan_id, char *err,
                         size_t errlen)
{
    struct desc_chan *ch = chan_find(d, chan_id);
    if (!ch || ch->conn != c)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "unknown channel %u (not open on this connection)", chan_id);
    chan_drain(d, ch);
    return 0;
}

uint32_t moed_desc_chan_rows(const struct moed_desc *d, struct moed_desc_chan_row *out,
                             uint32_t max)
{
    uint32_t n = 0;
    const struct desc_chan *lists[2] = {d ? d->chans : NULL, d ? d->draining : NULL};
    for (int i = 0; i < 2; i++)
        for (const struct desc_chan *ch = lists[i]; ch && n < max; ch = ch->next, n++) {
            out[n] = (struct moed_desc_chan_row){ch->id, ch->index, ch->n_bufs, i == 1,
                                                 ch->gpu, ch->arena_bytes, {0}};
            chan_stats(d, ch, &out[n].st);
        }
    return n;
}

/* ---- the descriptor request source (reqio.h) ---- */

static void req_release(struct moed_reqio *io)
{
    struct desc_req *q = io->src;
    if (!q)
        return;
    for (int i = 0; i < 4 && !q->leak; i++)
        if (q->ref[i])
            buf_put(q->d, q->ref[i]);
    free(q);
    io->src = NULL;
}

static int desc_bind(const struct moed_reqio_env *env, struct moed_reqio *io, struct moed_batch *b)
{
    (void)env;
    const struct desc_req *q = io->src;
    b->x = q->buf[0];
    b->ids = q->buf[1];
    b->w = q->buf[2];
    b->y = q->buf[3];
    return 0;
}

static const uint8_t *desc_host_inputs(const struct moed_reqio *io)
{
    (void)io;
    return NULL; /* x, ids, w lie in separate client buffers: never merged */
}

static int desc_reply(const struct moed_reqio_env *env, struct moed_reqio *io,
                      const struct moed_batch *b, int bound, uint32_t row,
                      const struct moed_req_times *t)
{
    (void)b;
    (void)bound;
    (void)row;
    const int times = ((const struct desc_req *)io->src)->times;
    req_release(io);
    return moed_server_reply_desc(io->conn, io->request_id, io->n_tokens, env->hidden, times, t);
}

static void desc_fail(const struct moed_reqio_env *env, struct moed_reqio *io, int code,
                      const char *msg)
{
    (void)env;
    req_release(io);
    if (code == 0)
        moed_server_reply(io->conn, NULL, 0, 0, NULL);
    else
        moed_server_reply_error(io->conn, io->request_id, code, msg);
}

static void desc_abandon(const struct moed_reqio_env *env, struct moed_reqio *io)
{
    (void)env;
    struct desc_req *q = io->src;
    if (q)
        q->leak = 1;
}

static const struct moed_reqio_ops desc_ops = {
    .name = "descriptor",
    .bind = desc_bind,
    .host_inputs = desc_host_inputs,
    .reply = desc_reply,
    .fail = desc_fail,
    .abandon = desc_abandon,
};

/* Ranges i and j of the request share bytes: by address, so that two
 * registrations of one allocation (one cached mapping) are caught too. */
static int overlap(const struct desc_req *q, int i, int j)
{
    uintptr_t a = (uintptr_t)q->buf[i].ptr, b = (uintptr_t)q->buf[j].ptr;
    return a < b + q->buf[j].bytes && b < a + q->buf[i].bytes;
}

int moed_desc_request(struct moed_desc *d, struct moed_conn *c, uint64_t request_id,
                      const struct moed_forward_desc_req *rq, struct moed_reqio *io, char *err,
                      size_t errlen)
{
    static const char *const names[4] = {"x", "ids", "w", "y"};
    const struct moed_bufref *refs[4] = {&rq->x, &rq->ids, &rq->w, &rq->y};
    const uint64_t T = rq->head.n_tokens;
    const uint64_t len[4] = {T * d->hidden * 2, T * d->top_k * 4, T * d->top_k * 4,
                             T * d->hidden * 2};
    struct desc_conn *t = conn_table(d, c, 0);
    struct desc_req *q = calloc(1, sizeof *q);
    int rc = 0;
    if (!q)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for a request");
    q->d = d;
    q->times = (rq->head.flags & MOED_FORWARD_DESC_TIMES) != 0;
    for (int i = 0; i < 4; i++) {
        int k = find(t, refs[i]->buf_id);
        if (k < 0) {
            rc = moed_seterr(err, errlen, MOED_E_INVAL,
                             "%s: buffer id %u is not registered on this connection", names[i],
                             refs[i]->buf_id);
            goto fail;
        }
        struct desc_buf *b = t->bufs[k];
        if (refs[i]->offset > b->size || len[i] > b->size - refs[i]->offset) {
            rc = moed_seterr(err, errlen, MOED_E_RANGE,
                             "%s: [%" PRIu64 ", +%" PRIu64 ") is past the end of buffer %u (%" PRIu64
                             " bytes)",
                             names[i], refs[i]->offset, len[i], b->id, b->size);
            goto fail;
        }
        uint8_t *p = (uint8_t *)b->map->mem.ptr + b->off + refs[i]->offset;
        if ((uintptr_t)p % (i == 0 || i == 3 ? MOED_BUF_ALIGN : 4) != 0) {
            rc = moed_seterr(err, errlen, MOED_E_INVAL, "%s: address is not aligned", names[i]);
            goto fail;
        }
        q->ref[i] = b;
        q->buf[i] = (struct moed_buf){b->map->mem.kind, b->map->mem.device, p, len[i]};
    }
    for (int i = 0; i < 3; i++)
        if (overlap(q, 3, i)) {
            rc = moed_seterr(err, errlen, MOED_E_INVAL, "y overlaps %s in buffer %u", names[i],
                             refs[i]->buf_id);
            goto fail;
        }
    for (int i = 0; i < 4; i++)
        q->ref[i]->refs++;
    memset(io, 0, sizeof *io);
    io->ops = &desc_ops;
    io->conn = c;
    io->request_id = request_id;
    io->layer = rq->head.layer;
    io->n_tokens = rq->head.n_tokens;
    io->src = q;
    d->st.requests++;
    return 0;
fail:
    free(q);
    d->st.refused++;
    return rc;
}
