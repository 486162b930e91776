/* server.c - libuv Unix-socket server: accept, peer check, framing, limits.
 *
 * Per connection (struct moed_conn):
 *   - a read buffer buf[off..len) from the buffer pool (bufpool.h: pinned
 *     when the backend offers host memory it can use in place, else plain)
 *     that grows on demand, never beyond 32 + max_frame_bytes (the largest
 *     frame we accept), and is kept between frames up to
 *     read_buffer_keep_bytes: a client sending 256 KiB frames would
 *     otherwise pay a malloc, a realloc (copying what was read so far) and a
 *     free per frame, and fresh memory costs page faults. When the buffer
 *     holds exactly one FORWARD frame, the engine may keep the whole buffer
 *     and use the payload in place (no copy); the connection then reads on
 *     into another buffer from the pool, of the size it lent, and the engine
 *     puts the lent one back into the pool when done;
 *   - `skip`: bytes of a rejected frame (unknown type, valid header) still to
 *     discard, so the stream stays in sync;
 *   - `pending`: FORWARD requests handed to the engine and not yet answered,
 *     and `unwritten`: replies of every kind (HELLO, PING, STATUS, ERROR,
 *     FORWARD) queued for the wire and not yet written; at
 *     pending + unwritten == max_pending_per_client we stop parsing and
 *     reading until replies drain (TCP-style backpressure onto the client),
 *     so a client that pipelines PINGs and never reads holds at most that
 *     many replies;
 *   - `wq_cost`: the memory its queued replies hold, allocation overhead
 *     included (a 32-byte PING reply costs a write request and a malloc
 *     chunk too); over max_client_buffer_bytes we stop reading; if it does
 *     not drain within frame_timeout_ms the client is disconnected. The sum
 *     over all clients is capped at max_reply_bytes: past it the client
 *     holding the most is dropped;
 *   - fairness: one pass handles at most CONN_FRAMES_PER_PASS frames of a
 *     client; a client with more buffered stops reading and waits on the
 *     `runner` idle handle for a later loop pass, so other clients, the
 *     status port and the timers are served in between (a write of 65,536
 *     pipelined STATUS frames used to hold the loop for 43 s);
 *   - one timer: the frame deadline (runs only while we read and a frame is
 *     incomplete: started at the frame's first byte), the drain deadline,
 *     the idle deadline (idle_timeout_ms: nothing in progress), or a
 *     closing connection's grace / linger.
 *
 * Closing is Redis-style: conn_close() only marks the connection and queues
 * it; an idle handle closes it on a later loop pass, so no callback ever sees
 * its own connection freed under it. Memory is freed when both handles are
 * closed and the engine has answered every FORWARD it took (pending == 0).
 * A client that fully closed its socket (POLLHUP at EOF; a half-close keeps
 * reading its replies) is closed at once, so its slot is free while the
 * engine finishes or skips (engine.c) what it took from it. A connection
 * closed with an error (refusal, framing error) lingers: after the ERROR
 * frame and a write shutdown it reads and discards until the client's EOF or
 * LINGER_MS, so the client's next write does not fail with EPIPE before it
 * has read why.
 */
#include "server.h"

#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "bufpool.h"
#include "moed_check_uv.h"
#include "moed_err.h"
#include "moed_le.h"
#include "moed_log.h"

/* Reply heads (HELLO, ERROR, FORWARD) and the bf16/int32/fp32 tensors pass
 * between the wire and memory in host order, so the daemon runs on
 * little-endian hosts only (x86-64, AArch64); the header fields it reads are
 * decoded explicitly. The client library has no such limit. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "moed's daemon needs a little-endian host");

#define CONN_BUF_INITIAL (64u * 1024u) /* first read buffer; grows to 32 + max_frame_bytes */
#define CLOSE_GRACE_MS 2000u           /* max wait for queued replies when closing */
#define LINGER_MS 500u                 /* read-and-discard after an error close */
#define LISTEN_BACKLOG 128
/* Frames of one client handled in one loop pass: a STATUS reply costs a few
 * microseconds (the body is cached), a FORWARD its validation and maybe a
 * copy, so a pass stays well under a millisecond per client. */
#define CONN_FRAMES_PER_PASS 32u
#define DISCARD_BYTES 4096u            /* read buffer of lingering connections */

/* What a malloc'd block of n bytes costs (glibc: an 8-byte header, 16-byte
 * granules, 32 bytes at least), for the reply-memory accounting. */
static size_t alloc_cost(size_t n)
{
    size_t c = (n + 8 + 15) & ~(size_t)15;
    return c < 32 ? 32 : c;
}

enum timer_mode { TIMER_NONE = 0, TIMER_FRAME, TIMER_DRAIN, TIMER_IDLE, TIMER_CLOSE };

struct moed_conn {
    uv_pipe_t pipe;
    uv_timer_t timer;
    uv_shutdown_t shutdown_req;
    struct moed_server *srv;
    uint64_t id;
    struct moed_hbuf buf; /* read buffer; bytes [off, len) are unparsed */
    size_t off, len;
    size_t lent_cap;      /* size of the last buffer lent to the engine: the next one's */
    uint64_t skip;
    uint64_t rx_ns;       /* start of the read that brought the current frame's first byte */
    uint64_t read_start_ns; /* start of the latest read (taken in on_alloc) */
    uint32_t pending;
    uint32_t unwritten;   /* replies queued, their write not completed */
    uint64_t wq_cost;     /* memory those hold (alloc_cost of each allocation) */
    int fatal_code;       /* framing error to send once pending == 0 (fatal) */
    uint64_t fatal_rid;
    char *fatal_msg;      /* malloc'd; NULL: moed_strerror(fatal_code) */
    int handles_open;     /* pipe + timer still not closed */
    enum timer_mode tmode;
    unsigned reading : 1;
    unsigned closing : 1; /* marked: no more reads, replies dropped */
    unsigned graceful : 1;/* flush queued writes before closing */
    unsigned drain_on_close : 1; /* clean end: wait for replies while they drain */
    unsigned queued : 1;  /* on the srv close list */
    unsigned closed : 1;  /* uv_close called */
    unsigned eof : 1;
    unsigned wpaused : 1; /* write queue over the limit */
    unsigned counted : 1; /* counted in srv->n_clients */
    unsigned processing : 1; /* inside conn_process (guards re-entry) */
    unsigned deferred : 1; /* on srv->ready: frames left for a later pass */
    unsigned fatal : 1;   /* framing error: answer what was taken, then the error */
    unsigned linger : 1;  /* error close: read and discard after the shutdown */
    struct moed_conn *prev, *next;   /* srv->conns */
    struct moed_conn *close_next;    /* srv->close_list */
    struct moed_conn *ready_next;    /* srv->ready list */
};

struct moed_server {
    uv_loop_t *loop;
    struct moed_server_limits cfg;
    const struct moed_server_ops *ops;
    void *ctx;
    struct moed_server_counters counters;
    uv_pipe_t listener;
    uv_idle_t closer;
    uv_idle_t runner;     /* serves deferred clients on later loop passes */
    int listening;
    int closer_active;
    int runner_active;
    int sndbuf_logged; /* the effective SO_SNDBUF was reported once */
    struct moed_bufpool *pool; /* read buffers and reply frames (the engine's) */
    int n_handles; /* listener + closer still open */
    uint32_t n_clients;
    uint64_t next_id;
    struct moed_conn *conns;
    struct moed_conn *close_list;
    struct moed_conn *ready_head, *ready_tail; /* deferred clients, FIFO */
    uint64_t reply_cost;  /* wq_cost of every client not closing */
    uint8_t discard[DISCARD_BYTES]; /* lingering connections read into this */
    int closing;
    void (*done)(void *arg);
    void *done_arg;
};

struct write_req {
    uv_write_t req;
    struct moed_hbuf buf; /* a pool frame (FORWARD reply), back to the pool once
                             written; base NULL: the frame is in data[] */
    struct moed_conn *c;
    size_t cost;              /* charged to c->wq_cost while queued */
    int timed;                /* a FORWARD reply: record its stages when written */
    struct moed_req_times t;
    uint8_t data[];           /* small frames (HELLO, PING, STATUS, ERROR): one
                                 allocation with the request */
};

static void conn_process(struct moed_conn *c);
static void conn_update(struct moed_conn *c);
static void conn_close(struct moed_conn *c, int graceful);
static void on_close_grace(uv_timer_t *t);
static void on_conn_timer(uv_timer_t *t);
static uint64_t close_grace_ms(const struct moed_conn *c);
static void server_maybe_done(struct moed_server *srv);

/* ---- frames and writes ------------------------------------------------ */

static int conn_blocked(const struct moed_conn *c)
{
    return c->pending + c->unwritten >= c->srv->cfg.max_pending_per_client || c->wpaused;
}

static void wr_free(struct moed_server *srv, struct write_req *wr)
{
    moed_bufpool_put(srv->pool, &wr->buf);
    free(wr);
}

static void on_write(uv_write_t *req, int status)
{
    struct write_req *wr = (struct write_req *)req;
    struct moed_conn *c = wr->c;
    struct moed_server *srv = c->srv;
    if (status >= 0 && wr->timed && srv->ops->reply_written)
        srv->ops->reply_written(srv->ctx, &wr->t, uv_hrtime());
    int was_blocked = conn_blocked(c);
    c->unwritten--;
    c->wq_cost -= wr->cost;
    if (!c->closing)
        srv->reply_cost -= wr->cost;
    wr_free(srv, wr);
    if (status < 0 && status != UV_ECANCELED && !c->closing) {
        LOG_D("client %llu: write failed: %s", (unsigned long long)c->id, uv_strerror(status));
        conn_close(c, 0);
        return;
    }
    if (status >= 0 && c->drain_on_close && c->tmode == TIMER_CLOSE && !c->closed)
        MOED_UV_CHECK(uv_timer_start(&c->timer, on_close_grace, close_grace_ms(c), 0)); /* progress */
    if (c->closing)
        return;
    if (c->wpaused && c->wq_cost <= srv->cfg.max_client_buffer_bytes)
        c->wpaused = 0;
    if (status >= 0 && c->tmode == TIMER_DRAIN)
        MOED_UV_CHECK(uv_timer_start(&c->timer, on_conn_timer, srv->cfg.frame_timeout_ms, 0)); /* progress */
    /* Parse on only where this write lifted a limit (and not for a deferred
     * client: the runner has its turn), else every completed write of a pass
     * would handle another batch of frames. */
    if (was_blocked && !conn_blocked(c) && !c->deferred)
        conn_process(c);
    else
        conn_update(c);
}

/* The client holding the most reply memory, over the global cap: drop it
 * (Redis drops a client over its output-buffer limit the same way). */
static void server_shed(struct moed_server *srv)
{
    while (srv->reply_cost > srv->cfg.max_reply_bytes) {
        struct moed_conn *worst = NULL;
        for (struct moed_conn *c = srv->conns; c; c = c->next)
            if (!c->closing && (!worst || c->wq_cost > worst->wq_cost))
                worst = c;
        if (!worst || worst->wq_cost == 0)
            return;
        LOG_W("client %llu: dropped: its %llu bytes of unread replies put the daemon over "
              "server.max_reply_bytes (%llu)", (unsigned long long)worst->id,
              (unsigned long long)worst->wq_cost, (unsigned long long)srv->cfg.max_reply_bytes);
        conn_close(worst, 0);
    }
}

/* Queue wr (its frame: len bytes at p) and charge it; takes ownership. */
static void conn_queue(struct moed_conn *c, struct write_req *wr, const uint8_t *p, size_t len,
                       const struct moed_req_times *t)
{
    struct moed_server *srv = c->srv;
    wr->c = c;
    wr->timed = t != NULL;
    if (t) {
        wr->t = *t;
        wr->t.reply_ns = uv_hrtime();
    }
    uv_buf_t b = uv_buf_init((char *)(uintptr_t)p, (unsigned)len);
    int rc = uv_write(&wr->req, (uv_stream_t *)&c->pipe, &b, 1, on_write);
    if (rc < 0) {
        wr_free(srv, wr);
        if (!c->closing)
            conn_close(c, 0);
        return;
    }
    c->unwritten++;
    c->wq_cost += wr->cost;
    if (c->closing)
        return;
    srv->reply_cost += wr->cost;
    if (c->wq_cost > srv->cfg.max_client_buffer_bytes && !c->wpaused) {
        c->wpaused = 1;
        conn_update(c);
    }
    if (srv->reply_cost > srv->cfg.max_reply_bytes)
        server_shed(srv);
}

static int conn_writable(const struct moed_conn *c)
{
    return !c->closed && !(c->closing && !c->graceful);
}

/* Queue a whole frame of `len` bytes at buf->base + off; takes ownership of
 * the buffer (*buf is cleared). `t`: a timed FORWARD reply (NULL for
 * everything else). */
static void conn_write(struct moed_conn *c, struct moed_hbuf *buf, size_t off, size_t len,
                       const struct moed_req_times *t)
{
    struct moed_server *srv = c->srv;
    if (!conn_writable(c)) {
        moed_bufpool_put(srv->pool, buf);
        return;
    }
    struct write_req *wr = malloc(sizeof *wr);
    if (!wr) {
        moed_bufpool_put(srv->pool, buf);
        conn_close(c, 0);
        return;
    }
    wr->buf = *buf;
    buf->base = NULL;
    wr->cost = alloc_cost(sizeof *wr) + alloc_cost(wr->buf.cap);
    conn_queue(c, wr, wr->buf.base + off, len, t);
}

/* A write request with room for a small frame of n bytes in data[]. */
static struct write_req *wr_small(size_t n)
{
    struct write_req *wr = malloc(sizeof *wr + n);
    if (wr) {
        wr->buf = (struct moed_hbuf){0};
        wr->cost = alloc_cost(sizeof *wr + n);
    }
    return wr;
}

static size_t error_frame_encode(uint8_t *f, uint64_t request_id, int code, const char *msg,
                                 size_t mlen)
{
    moed_frame_encode(f, MOED_MSG_ERROR | MOED_PROTO_REPLY, request_id,
                      sizeof(struct moed_error_rep) + mlen);
    struct moed_error_rep er = {.code = code, .msg_len = (uint32_t)mlen};
    memcpy(f + MOED_PROTO_HDR_SIZE, &er, sizeof er);
    if (mlen)
        memcpy(f + MOED_PROTO_HDR_SIZE + sizeof er, msg, mlen);
    return MOED_PROTO_HDR_SIZE + sizeof er + mlen;
}

static size_t error_msg_len(const char *msg)
{
    size_t mlen = msg ? strlen(msg) : 0;
    return mlen > MOED_PROTO_MAX_ERRMSG ? MOED_PROTO_MAX_ERRMSG : mlen;
}

uint8_t *moed_server_error_frame(uint64_t request_id, int code, const char *msg, size_t *len)
{
    size_t mlen = error_msg_len(msg);
    uint8_t *f = malloc(MOED_PROTO_HDR_SIZE + sizeof(struct moed_error_rep) + mlen);
    if (!f)
        return NULL;
    *len = error_frame_encode(f, request_id, code, msg, mlen);
    return f;
}

static void conn_send_error(struct moed_conn *c, uint64_t request_id, int code, const char *msg)
{
    struct moed_server *srv = c->srv;
    if (code < 0 && -code < MOED_E__COUNT)
        srv->counters.errors[-code]++;
    LOG_D("client %llu: error %s (request %llu): %s", (unsigned long long)c->id,
          moed_errname(code), (unsigned long long)request_id, msg);
    if (!conn_writable(c))
        return;
    size_t mlen = error_msg_len(msg);
    struct write_req *wr = wr_small(MOED_PROTO_HDR_SIZE + sizeof(struct moed_error_rep) + mlen);
    if (!wr)
        return;
    size_t n = error_frame_encode(wr->data, request_id, code, msg, mlen);
    conn_queue(c, wr, wr->data, n, NULL);
}

static void conn_send(struct moed_conn *c, uint16_t type, uint64_t request_id, const void *payload,
                      size_t plen)
{
    if (!conn_writable(c))
        return;
    struct write_req *wr = wr_small(MOED_PROTO_HDR_SIZE + plen);
    if (!wr) {
        conn_close(c, 0);
        return;
    }
    moed_frame_encode(wr->data, type | MOED_PROTO_REPLY, request_id, plen);
    if (plen)
        memcpy(wr->data + MOED_PROTO_HDR_SIZE, payload, plen);
    conn_queue(c, wr, wr->data, MOED_PROTO_HDR_SIZE + plen, NULL);
}

/* ---- closing ------------------------------------------------------------ */

static void conn_free_if_done(struct moed_conn *c)
{
    if (c->handles_open > 0 || c->pending > 0 || !c->closed || c->deferred)
        return;
    struct moed_server *srv = c->srv;
    if (c->prev)
        c->prev->next = c->next;
    else
        srv->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    moed_bufpool_put(srv->pool, &c->buf);
    free(c->fatal_msg);
    free(c);
    server_maybe_done(srv);
}

static void on_conn_handle_closed(uv_handle_t *h)
{
    struct moed_conn *c = h->data;
    c->handles_open--;
    conn_free_if_done(c);
}

static void conn_close_now(struct moed_conn *c)
{
    if (c->closed)
        return;
    c->closed = 1;
    uv_close((uv_handle_t *)&c->pipe, on_conn_handle_closed);
    uv_close((uv_handle_t *)&c->timer, on_conn_handle_closed);
}

static void on_linger_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *out)
{
    (void)suggested;
    struct moed_conn *c = h->data;
    *out = uv_buf_init((char *)c->srv->discard, sizeof c->srv->discard);
}

/* A lingering connection: whatever the client still sends is dropped; its
 * EOF (or an error) ends the linger. */
static void on_linger_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *b)
{
    (void)b;
    if (nread < 0)
        conn_close_now(s->data);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    struct moed_conn *c = req->data;
    if (c->closed)
        return;
    /* After an error close the client may still be writing (a refused
     * client sends its HELLO): read and drop it for a moment, so that its
     * write does not fail with EPIPE before it has read our ERROR. */
    if (status == 0 && c->linger &&
        uv_read_start((uv_stream_t *)&c->pipe, on_linger_alloc, on_linger_read) == 0) {
        MOED_UV_CHECK(uv_timer_start(&c->timer, on_close_grace, LINGER_MS, 0));
        return;
    }
    conn_close_now(c);
}

/* How long a closing connection may go without write progress: a client
 * that half-closed after its last request is owed its replies and gets as
 * long as an open one (frame_timeout_ms per stall); error and shutdown
 * closes get CLOSE_GRACE_MS in all. */
static uint64_t close_grace_ms(const struct moed_conn *c)
{
    uint64_t t = c->srv->cfg.frame_timeout_ms;
    return c->drain_on_close && t > CLOSE_GRACE_MS ? t : CLOSE_GRACE_MS;
}

static void on_close_grace(uv_timer_t *t)
{
    conn_close_now(t->data);
}

/* Runs on a later loop pass than the one that marked the connections. */
static void on_closer(uv_idle_t *h)
{
    struct moed_server *srv = h->data;
    struct moed_conn *list = srv->close_list;
    srv->close_list = NULL;
    uv_idle_stop(&srv->closer);
    srv->closer_active = 0;
    for (struct moed_conn *c = list, *nx; c; c = nx) {
        nx = c->close_next;
        c->queued = 0;
        if (c->closed)
            continue;
        if (c->graceful &&
            (c->linger || uv_stream_get_write_queue_size((uv_stream_t *)&c->pipe) > 0)) {
            /* Let the queued replies (often the ERROR frame explaining the
             * close) reach the client, but never wait more than the grace. */
            c->shutdown_req.data = c;
            if (uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->pipe, on_shutdown) == 0) {
                uv_timer_stop(&c->timer);
                c->tmode = TIMER_CLOSE;
                MOED_UV_CHECK(uv_timer_start(&c->timer, on_close_grace, close_grace_ms(c), 0));
                continue;
            }
        }
        conn_close_now(c);
    }
}

static void conn_close(struct moed_conn *c, int graceful)
{
    struct moed_server *srv = c->srv;
    if (c->closing) {
        if (!graceful)
            c->graceful = 0;
        return;
    }
    c->closing = 1;
    c->graceful = graceful ? 1 : 0;
    srv->reply_cost -= c->wq_cost; /* no longer counted against the cap */
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->pipe);
        c->reading = 0;
    }
    uv_timer_stop(&c->timer);
    c->tmode = TIMER_NONE;
    if (c->counted) {
        c->counted = 0;
        srv->n_clients--;
        srv->counters.clients = srv->n_clients;
    }
    if (!c->queued) {
        c->queued = 1;
        c->close_next = srv->close_list;
        srv->close_list = c;
    }
    if (!srv->closer_active) {
        srv->closer_active = 1;
        MOED_UV_CHECK(uv_idle_start(&srv->closer, on_closer));
    }
}

/* ---- timers and read state --------------------------------------------- */

static void on_conn_timer(uv_timer_t *t)
{
    struct moed_conn *c = t->data;
    enum timer_mode m = c->tmode;
    c->tmode = TIMER_NONE;
    if (c->closing)
        return;
    char msg[160];
    if (m == TIMER_FRAME) {
        uint64_t rid = 0;
        if (c->len - c->off >= MOED_PROTO_HDR_SIZE) {
            rid = le_get64(c->buf.base + c->off + 16);
        }
        snprintf(msg, sizeof msg,
                 "frame not complete within %u ms (server.frame_timeout_ms); %zu bytes received",
                 c->srv->cfg.frame_timeout_ms, c->len - c->off);
        conn_send_error(c, rid, MOED_E_TIMEOUT, msg);
        conn_close(c, 1);
    } else if (m == TIMER_DRAIN) {
        LOG_W("client %llu: %zu reply bytes not read within %u ms; disconnecting",
              (unsigned long long)c->id, uv_stream_get_write_queue_size((uv_stream_t *)&c->pipe),
              c->srv->cfg.frame_timeout_ms);
        conn_close(c, 0);
    } else if (m == TIMER_IDLE) {
        snprintf(msg, sizeof msg, "idle for %u ms (server.idle_timeout_ms); closing",
                 c->srv->cfg.idle_timeout_ms);
        LOG_I("client %llu: %s", (unsigned long long)c->id, msg);
        conn_send_error(c, 0, MOED_E_TIMEOUT, msg);
        c->linger = 1;
        conn_close(c, 1);
    }
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *out)
{
    (void)suggested;
    struct moed_conn *c = h->data;
    size_t limit = MOED_PROTO_HDR_SIZE + (size_t)c->srv->cfg.max_frame_bytes;
    /* libuv reads right after this: the stage timing of a frame starts here,
     * so that its first read's copy counts too */
    c->read_start_ns = uv_hrtime();
    if (c->off > 0 && c->off == c->len) {
        c->off = c->len = 0;
    } else if (c->off > 0) {
        memmove(c->buf.base, c->buf.base + c->off, c->len - c->off);
        c->len -= c->off;
        c->off = 0;
    }
    if (!c->buf.base) {
        /* after a lend, a buffer like the one lent: a steady client's next
         * frame then fits without growing */
        size_t want = c->lent_cap > CONN_BUF_INITIAL ? c->lent_cap : CONN_BUF_INITIAL;
        if (want > limit)
            want = limit;
        (void)moed_bufpool_get(c->srv->pool, want, 1, &c->buf);
    } else if (c->len == c->buf.cap && c->buf.cap < limit) {
        /* Grow as bytes arrive, never to more than the frame being read
         * needs: a header alone (its length says up to max_frame_bytes)
         * costs no more than the buffer it came in. Doubling keeps the
         * copies of a large frame under one frame's size in all. */
        size_t ncap = c->buf.cap * 2;
        if (c->len - c->off >= MOED_PROTO_HDR_SIZE && c->skip == 0) {
            uint64_t plen = le_get64(c->buf.base + c->off + 24);
            size_t need = c->off + MOED_PROTO_HDR_SIZE + (size_t)plen;
            if (plen <= c->srv->cfg.max_frame_bytes && need > c->buf.cap && need < ncap)
                ncap = need;
        }
        if (ncap > limit)
            ncap = limit;
        (void)moed_bufpool_grow(c->srv->pool, &c->buf, ncap, c->len);
    }
    /* A full buffer (only possible on allocation failure) gives UV_ENOBUFS.
     * uv_buf_t lengths are unsigned int: a 4 GiB frame is read in pieces. */
    size_t room = c->buf.cap - c->len;
    if (room > UINT_MAX)
        room = UINT_MAX;
    *out = uv_buf_init((char *)c->buf.base + c->len, (unsigned)room);
}

/* At EOF: did the client close its socket (POLLHUP: both directions shut,
 * AF_UNIX sets it when the peer's socket is released) or only its write side
 * (shutdown(SHUT_WR): it still reads its replies)? */
static int peer_gone(const struct moed_conn *c)
{
    uv_os_fd_t fd;
    if (uv_fileno((const uv_handle_t *)&c->pipe, &fd) < 0)
        return 0;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR)) != 0;
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *b)
{
    (void)b;
    struct moed_conn *c = s->data;
    if (nread == 0)
        return;
    if (nread < 0) {
        if (c->closing)
            return;
        if (nread == UV_EOF) {
            /* The client may only have half-closed: answer what it sent
             * (conn_process decides when the connection is done). */
            c->eof = 1;
            if (c->reading) {
                uv_read_stop(s);
                c->reading = 0;
            }
            if (peer_gone(c)) {
                /* Closed both ways: nobody reads the replies. Free the slot
                 * now; the engine skips what it has not started. */
                LOG_D("client %llu: closed its socket with %u requests in flight",
                      (unsigned long long)c->id, c->pending);
                conn_close(c, 0);
                return;
            }
            conn_process(c);
            return;
        }
        if (nread == UV_ENOBUFS) {
            conn_send_error(c, 0, MOED_E_NOMEM, "out of memory for the read buffer");
            conn_close(c, 1);
            return;
        }
        LOG_D("client %llu: read: %s", (unsigned long long)c->id, uv_strerror((int)nread));
        conn_close(c, 0);
        return;
    }
    if (c->len == c->off)
        c->rx_ns = c->read_start_ns; /* these bytes start a frame */
    c->len += (size_t)nread;
    conn_process(c);
}

/* Start or stop reading and the timer to match the connection's state. */
static void conn_update(struct moed_conn *c)
{
    if (c->closing)
        return;
    struct moed_server *srv = c->srv;
    int want = !c->eof && !c->fatal && !c->deferred && !conn_blocked(c);
    if (want && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read) == 0)
            c->reading = 1;
    } else if (!want && c->reading) {
        uv_read_stop((uv_stream_t *)&c->pipe);
        c->reading = 0;
    }
    enum timer_mode m = TIMER_NONE;
    uint32_t ms = srv->cfg.frame_timeout_ms;
    /* Replies not leaving (over the memory limit, or at the request limit
     * with bytes stuck in the queue): the drain deadline, restarted by every
     * completed write (on_write), so only a client that reads nothing for
     * frame_timeout_ms is dropped. */
    if (c->wpaused ||
        (conn_blocked(c) && uv_stream_get_write_queue_size((uv_stream_t *)&c->pipe) > 0))
        m = TIMER_DRAIN;
    else if (c->reading && (c->len > c->off || c->skip > 0))
        m = TIMER_FRAME;
    else if (c->reading && c->pending == 0 && c->unwritten == 0 && srv->cfg.idle_timeout_ms) {
        m = TIMER_IDLE;
        ms = srv->cfg.idle_timeout_ms;
    }
    if (m == c->tmode)
        return;
    uv_timer_stop(&c->timer);
    c->tmode = m;
    if (m != TIMER_NONE)
        MOED_UV_CHECK(uv_timer_start(&c->timer, on_conn_timer, ms, 0));
}

/* ---- frame handling ------------------------------------------------------ */

static void handle_hello(struct moed_conn *c, const struct moed_frame_hdr *h, const uint8_t *p)
{
    struct moed_server *srv = c->srv;
    if (h->payload_len != sizeof(struct moed_hello_req) && h->payload_len != 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "HELLO payload is %llu bytes; expected %zu",
                 (unsigned long long)h->payload_len, sizeof(struct moed_hello_req));
        conn_send_error(c, h->request_id, MOED_E_INVAL, msg);
        return;
    }
    if (h->payload_len == sizeof(struct moed_hello_req)) {
        struct moed_hello_req rq = {.min_version = le_get16(p), .max_version = le_get16(p + 2)};
        if (rq.min_version > MOED_PROTO_VERSION || rq.max_version < MOED_PROTO_VERSION) {
            char msg[128];
            snprintf(msg, sizeof msg, "client speaks versions %u..%u; this daemon speaks %u",
                     rq.min_version, rq.max_version, MOED_PROTO_VERSION);
            conn_send_error(c, h->request_id, MOED_E_VERSION, msg);
            return;
        }
    }
    struct moed_hello_rep rep;
    memset(&rep, 0, sizeof rep);
    srv->ops->hello(srv->ctx, &rep);
    rep.version = MOED_PROTO_VERSION;
    conn_send(c, MOED_MSG_HELLO, h->request_id, &rep, sizeof rep);
}

/* Returns 1 when the engine kept the read buffer (a FORWARD used in place):
 * the connection no longer owns c->buf. */
static int handle_frame(struct moed_conn *c, const struct moed_frame_hdr *h, const uint8_t *p)
{
    struct moed_server *srv = c->srv;
    char msg[MOED_ERRLEN];
    switch (h->type) {
    case MOED_MSG_HELLO:
        handle_hello(c, h, p);
        return 0;
    case MOED_MSG_PING:
        if (h->payload_len > MOED_PROTO_MAX_PING) {
            snprintf(msg, sizeof msg, "PING payload is %llu bytes; at most %d allowed",
                     (unsigned long long)h->payload_len, MOED_PROTO_MAX_PING);
            conn_send_error(c, h->request_id, MOED_E_INVAL, msg);
            return 0;
        }
        conn_send(c, MOED_MSG_PING, h->request_id, p, (size_t)h->payload_len);
        return 0;
    case MOED_MSG_STATUS: {
        size_t jlen = 0;
        const char *js = srv->ops->status_json(srv->ctx, &jlen);
        if (!js) {
            conn_send_error(c, h->request_id, MOED_E_NOMEM, "out of memory rendering the status");
            return 0;
        }
        conn_send(c, MOED_MSG_STATUS, h->request_id, js, jlen);
        return 0;
    }
    case MOED_MSG_FORWARD: {
        msg[0] = 0;
        c->pending++;
        struct moed_req_times t = {.rx_ns = c->rx_ns, .complete_ns = uv_hrtime()};
        /* Lend the buffer only when the frame is all it holds: nothing of a
         * next frame has to move out of it. */
        struct moed_hbuf rx = c->buf;
        int lend = c->off == 0 && c->len == MOED_PROTO_HDR_SIZE + (size_t)h->payload_len;
        int rc = srv->ops->forward(srv->ctx, c, h->request_id, p, h->payload_len, &t,
                                   lend ? &rx : NULL, msg, sizeof msg);
        if (rc < 0) {
            c->pending--;
            conn_send_error(c, h->request_id, rc, msg[0] ? msg : moed_strerror(rc));
            return 0;
        }
        return lend && rx.base == NULL;
    }
    case MOED_MSG_REGISTER_BUF:
    case MOED_MSG_UNREGISTER_BUF:
        snprintf(msg, sizeof msg,
                 "message type %u (buffer registration) is not supported by protocol version %d",
                 h->type, MOED_PROTO_VERSION);
        conn_send_error(c, h->request_id, MOED_E_UNSUPPORTED, msg);
        return 0;
    default:
        snprintf(msg, sizeof msg, "unknown message type %u (0x%04x)", h->type, h->type);
        conn_send_error(c, h->request_id, MOED_E_TYPE, msg);
        return 0;
    }
}

/* Describe a framing error from what the parser saw. */
static void framing_message(const struct moed_conn *c, int rc, const struct moed_frame_hdr *h,
                            size_t have, char *msg, size_t len)
{
    const uint8_t *p = c->buf.base + c->off;
    uint32_t magic = have >= 4 ? le_get32(p) : 0;
    if (rc == MOED_E_TOOBIG) {
        snprintf(msg, len, "payload_len %llu is over the limit %llu (server.max_frame_bytes)",
                 (unsigned long long)h->payload_len, (unsigned long long)c->srv->cfg.max_frame_bytes);
    } else if (rc == MOED_E_VERSION) {
        snprintf(msg, len, "protocol version %u not supported (this daemon speaks %d)", h->version,
                 MOED_PROTO_VERSION);
    } else if (rc == MOED_E_TYPE) {
        snprintf(msg, len, "unknown message type %u (0x%04x)", h->type, h->type);
    } else if (have >= 4 && magic != MOED_PROTO_MAGIC) {
        snprintf(msg, len, "bad magic 0x%08x (expected 0x%08x \"MOED\")", magic, MOED_PROTO_MAGIC);
    } else if (have >= MOED_PROTO_HDR_SIZE && (h->flags != 0 || h->reserved != 0)) {
        snprintf(msg, len, "flags 0x%x / reserved 0x%x must be 0 in version %d", h->flags,
                 h->reserved, MOED_PROTO_VERSION);
    } else {
        snprintf(msg, len, "malformed frame header (%s)", moed_strerror(rc));
    }
}

/* Runs on a later loop pass than the one that deferred the clients: each
 * gets another CONN_FRAMES_PER_PASS frames (and may defer itself again, to
 * the end of the list). */
static void on_runner(uv_idle_t *h)
{
    struct moed_server *srv = h->data;
    struct moed_conn *list = srv->ready_head;
    srv->ready_head = srv->ready_tail = NULL;
    for (struct moed_conn *c = list, *nx; c; c = nx) {
        nx = c->ready_next;
        c->ready_next = NULL;
        c->deferred = 0;
        if (c->closing)
            conn_free_if_done(c);
        else
            conn_process(c);
    }
    if (!srv->ready_head) {
        uv_idle_stop(&srv->runner);
        srv->runner_active = 0;
    }
}

/* Frames are left in the buffer for a later pass: stop reading until then
 * (conn_update), so a flood waits in the client's socket, not here. */
static void conn_defer(struct moed_conn *c)
{
    struct moed_server *srv = c->srv;
    if (c->deferred || srv->closing)
        return;
    c->deferred = 1;
    c->ready_next = NULL;
    if (srv->ready_tail)
        srv->ready_tail->ready_next = c;
    else
        srv->ready_head = c;
    srv->ready_tail = c;
    if (!srv->runner_active) {
        srv->runner_active = 1;
        MOED_UV_CHECK(uv_idle_start(&srv->runner, on_runner));
    }
}

/* A framing error: the stream is lost. Requests taken before it are still
 * answered (their replies first, on the wire), then the error, then the
 * close; nothing more is read. */
static void conn_fail(struct moed_conn *c, uint64_t request_id, int code, const char *msg)
{
    c->len = c->off; /* drop what is left of the stream */
    c->skip = 0;
    if (c->pending == 0) {
        conn_send_error(c, request_id, code, msg);
        c->linger = 1;
        conn_close(c, 1);
        return;
    }
    c->fatal = 1;
    c->fatal_code = code;
    c->fatal_rid = request_id;
    c->fatal_msg = strdup(msg);
    LOG_D("client %llu: framing error with %u requests in flight; answering them first",
          (unsigned long long)c->id, c->pending);
}

/* Parse and handle complete frames in the buffer, as far as the limits and
 * the per-pass bound allow; then compact the buffer and update the read
 * state. */
static void conn_process(struct moed_conn *c)
{
    struct moed_server *srv = c->srv;
    /* An engine reply can come back synchronously from inside handle_frame
     * (a batch refused at submit); the outer loop picks up where it is, so a
     * nested call must not move the buffer under it. */
    if (c->processing)
        return;
    c->processing = 1;
    uint32_t handled = 0;
    while (!c->closing && !c->fatal) {
        size_t have = c->len - c->off;
        if (c->skip > 0) {
            size_t n = have < c->skip ? have : (size_t)c->skip;
            c->off += n;
            c->skip -= n;
            if (c->skip > 0)
                break;
            uv_timer_stop(&c->timer); /* the skipped frame is complete */
            c->tmode = TIMER_NONE;
            continue;
        }
        if (have == 0 || conn_blocked(c))
            break;
        if (handled == CONN_FRAMES_PER_PASS) {
            conn_defer(c); /* the rest on a later loop pass */
            break;
        }
        struct moed_frame_hdr h;
        memset(&h, 0, sizeof h);
        int rc = moed_frame_parse(c->buf.base + c->off, have, srv->cfg.max_frame_bytes, &h);
        if (rc == MOED_PARSE_NEED_MORE)
            break;
        if (rc < 0) {
            char msg[256];
            int full = have >= MOED_PROTO_HDR_SIZE;
            if (rc == MOED_E_TYPE && full && h.magic == MOED_PROTO_MAGIC &&
                h.payload_len <= srv->cfg.max_frame_bytes) {
                /* Request-level: the header is sound, so skip its payload and
                 * keep the connection. */
                framing_message(c, rc, &h, have, msg, sizeof msg);
                conn_send_error(c, h.request_id, MOED_E_TYPE, msg);
                c->skip = MOED_PROTO_HDR_SIZE + h.payload_len;
                handled++;
                continue;
            }
            /* The stream cannot be resynchronised: answer every request
             * taken before it, then the error, then close. */
            if (rc == MOED_E_TYPE)
                rc = MOED_E_PROTO;
            framing_message(c, rc, &h, have, msg, sizeof msg);
            conn_fail(c, full ? h.request_id : 0, rc, msg);
            break;
        }
        /* Complete frame. */
        handled++;
        uv_timer_stop(&c->timer);
        c->tmode = TIMER_NONE;
        size_t flen = MOED_PROTO_HDR_SIZE + (size_t)h.payload_len;
        if (handle_frame(c, &h, c->buf.base + c->off + MOED_PROTO_HDR_SIZE)) {
            /* The engine keeps the buffer (it held just this frame); the
             * next read takes another from the pool. */
            c->lent_cap = c->buf.cap;
            c->buf = (struct moed_hbuf){0};
            c->off = c->len = 0;
            continue;
        }
        c->off += flen;
        /* Bytes left over start the next frame; they came with the latest
         * read at the latest. */
        c->rx_ns = c->read_start_ns;
    }
    c->processing = 0;
    if (c->off == c->len) {
        c->off = c->len = 0;
        /* Idle after a frame bigger than what we keep: give the memory back
         * (Redis shrinks query buffers the same way), so N idle clients never
         * hold N max frames. Up to the keep size the buffer stays, at its
         * high-water mark, for the next frame. */
        if (c->buf.cap > CONN_BUF_INITIAL && c->buf.cap > srv->cfg.read_buffer_keep_bytes &&
            c->skip == 0) {
            moed_bufpool_put(srv->pool, &c->buf);
            c->lent_cap = 0;
        }
    }
    /* Bytes left after off (a partial frame, or frames of a deferred or
     * blocked client) move to the front only before the next read
     * (on_alloc): a client served one frame per write completion would
     * otherwise have the rest of its buffer moved once per frame. */
    if (c->closing)
        return;
    if (c->eof && !c->fatal) {
        /* No more bytes will come. Bytes left that the loop could not parse
         * (it was not blocked by a limit) are a truncated frame. */
        size_t rest = c->len - c->off;
        int blocked = conn_blocked(c) || c->deferred;
        if ((rest > 0 || c->skip > 0) && !blocked) {
            char msg[160];
            snprintf(msg, sizeof msg, "connection closed mid-frame (%zu bytes of a frame received)",
                     rest);
            conn_send_error(c, 0, MOED_E_PROTO, msg);
            /* drop the partial frame; requests before it still get their
             * replies (nothing in flight is lost), then the close below */
            c->len = c->off;
            c->skip = 0;
            rest = 0;
        }
        if (rest == 0 && c->skip == 0 && c->pending == 0) {
            /* A clean end after every request was answered: the client
             * still reads (half-close), so wait for the replies to drain. */
            conn_close(c, 1);
            c->drain_on_close = 1;
            return;
        }
    }
    conn_update(c);
}

/* ---- engine-facing replies ----------------------------------------------- */

static void conn_request_done(struct moed_conn *c)
{
    int was_blocked = conn_blocked(c);
    c->pending--;
    if (c->closing) {
        conn_free_if_done(c);
        return;
    }
    if (c->fatal) {
        if (c->pending == 0) {
            c->fatal = 0;
            conn_send_error(c, c->fatal_rid, c->fatal_code,
                            c->fatal_msg ? c->fatal_msg : moed_strerror(c->fatal_code));
            c->linger = 1;
            conn_close(c, 1);
        }
        return;
    }
    /* Below the pending limit again (frames already buffered come first),
     * or a half-closed client that may now be done. */
    if (!c->deferred && (c->eof || (was_blocked && !conn_blocked(c))))
        conn_process(c);
    else
        conn_update(c); /* its reply may be stuck in the queue: the drain deadline */
}

void moed_server_reply(struct moed_conn *c, struct moed_hbuf *frame, size_t off, size_t len,
                       const struct moed_req_times *t)
{
    if (frame && c->closing)
        moed_bufpool_put(c->srv->pool, frame); /* client gone: the reply is dropped */
    else if (frame)
        conn_write(c, frame, off, len, t);
    conn_request_done(c);
}

void moed_server_reply_error(struct moed_conn *c, uint64_t request_id, int code, const char *msg)
{
    if (!c->closing)
        conn_send_error(c, request_id, code, msg);
    else if (code < 0 && -code < MOED_E__COUNT)
        c->srv->counters.errors[-code]++;
    conn_request_done(c);
}

void moed_server_reply_forward(struct moed_conn *c, struct moed_hbuf *frame, size_t off,
                               uint64_t request_id, uint32_t n_tokens, uint32_t hidden,
                               const struct moed_req_times *t)
{
    uint64_t plen = sizeof(struct moed_forward_rep) + (uint64_t)n_tokens * hidden * 2;
    uint8_t *fr = frame->base + off;
    moed_frame_encode(fr, MOED_MSG_FORWARD | MOED_PROTO_REPLY, request_id, plen);
    struct moed_forward_rep rep = {.n_tokens = n_tokens, .hidden = hidden};
    memcpy(fr + MOED_PROTO_HDR_SIZE, &rep, sizeof rep);
    moed_server_reply(c, frame, off, MOED_PROTO_HDR_SIZE + (size_t)plen, t);
}

int moed_server_forward_parse(const uint8_t *payload, uint64_t len, uint32_t hidden,
                              uint32_t n_experts, uint32_t top_k, uint32_t max_tokens,
                              int (*is_moe_layer)(const void *ctx, uint32_t layer),
                              const void *ctx, struct moed_server_fwd *out, char *err,
                              size_t errlen)
{
    struct moed_forward_req fr;
    int rc = moed_forward_validate(payload, len, hidden, n_experts, top_k, max_tokens,
                                   is_moe_layer, ctx, &fr, err, errlen);
    if (rc < 0)
        return rc;
    out->layer = fr.layer;
    out->n_tokens = fr.n_tokens;
    out->body = payload + sizeof fr;
    out->body_len = (size_t)len - sizeof fr;
    return 0;
}

int moed_server_conn_gone(const struct moed_conn *c) { return c->closing; }

const struct moed_server_counters *moed_server_counters(const struct moed_server *srv)
{
    return &srv->counters;
}

/* ---- accept ---------------------------------------------------------------- */

static int peer_allowed(const struct moed_server *srv, uid_t uid, gid_t gid)
{
    /* The daemon's own uid and root are always allowed (the operator must be
     * able to run moectl); the lists add more. */
    if (uid == 0 || uid == geteuid())
        return 1;
    for (uint32_t i = 0; i < srv->cfg.n_allowed_uids; i++)
        if (srv->cfg.allowed_uids[i] == uid)
            return 1;
    for (uint32_t i = 0; i < srv->cfg.n_allowed_gids; i++)
        if (srv->cfg.allowed_gids[i] == gid)
            return 1;
    return 0;
}

/* Ask for a kernel send buffer that holds a whole reply. An AF_UNIX stream
 * socket charges queued bytes to the sender's SO_SNDBUF (the receiver's
 * SO_RCVBUF plays no part), and the default (net.core.wmem_default, ~208 KiB)
 * is smaller than one T=64, H=2048 FORWARD reply (256 KiB): the write then
 * stops half-way until the client has read the first part, which costs a
 * wake-up of each side and a second pass through the loop per reply. The
 * kernel caps the value at net.core.wmem_max; we say so once. */
static void conn_set_sndbuf(struct moed_conn *c, uv_os_fd_t fd)
{
    struct moed_server *srv = c->srv;
    uint64_t want64 = srv->cfg.socket_buffer_bytes;
    if (want64 == 0)
        return;
    int want = want64 > INT_MAX / 2 ? INT_MAX / 2 : (int)want64;
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want) < 0) {
        LOG_D("client %llu: SO_SNDBUF %d: %s", (unsigned long long)c->id, want, strerror(errno));
        return;
    }
    if (srv->sndbuf_logged)
        return;
    srv->sndbuf_logged = 1;
    int got = 0;
    socklen_t gl = sizeof got;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &gl) < 0)
        return;
    /* Linux reports twice the value it accepted (the other half is its
     * bookkeeping overhead). */
    if (got / 2 < want)
        LOG_I("server.socket_buffer_bytes %d capped by the kernel to %d (net.core.wmem_max); "
              "replies larger than that are written in several steps",
              want, got / 2);
    else
        LOG_D("client sockets: SO_SNDBUF %d (kernel reports %d)", want, got);
}

static void on_connection(uv_stream_t *ls, int status)
{
    struct moed_server *srv = ls->data;
    if (status < 0) {
        LOG_W("accept: %s", uv_strerror(status));
        return;
    }
    struct moed_conn *c = calloc(1, sizeof *c);
    if (!c) {
        LOG_E("accept: out of memory");
        return;
    }
    c->srv = srv;
    c->id = ++srv->next_id;
    /* On Unix neither init can fail (libuv 1.x returns 0): checked for the log. */
    MOED_UV_CHECK(uv_pipe_init(srv->loop, &c->pipe, 0));
    MOED_UV_CHECK(uv_timer_init(srv->loop, &c->timer));
    c->pipe.data = c;
    c->timer.data = c;
    c->handles_open = 2;
    c->next = srv->conns;
    if (srv->conns)
        srv->conns->prev = c;
    srv->conns = c;
    if (uv_accept(ls, (uv_stream_t *)&c->pipe) < 0) {
        c->closing = 1;
        conn_close_now(c);
        return;
    }
    uv_os_fd_t fd;
    struct ucred cred = {0};
    socklen_t clen = sizeof cred;
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) < 0 ||
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) < 0) {
        LOG_W("client %llu: SO_PEERCRED failed: %s", (unsigned long long)c->id, strerror(errno));
        c->closing = 1;
        conn_close_now(c);
        return;
    }
    char msg[160];
    if (!peer_allowed(srv, cred.uid, cred.gid)) {
        srv->counters.clients_refused++;
        snprintf(msg, sizeof msg, "peer uid %u gid %u is not allowed (server.allowed_uids/allowed_gids)",
                 (unsigned)cred.uid, (unsigned)cred.gid);
        LOG_W("client %llu (pid %d): %s", (unsigned long long)c->id, (int)cred.pid, msg);
        conn_send_error(c, 0, MOED_E_PERM, msg);
        c->linger = 1;
        conn_close(c, 1);
        return;
    }
    if (srv->n_clients >= srv->cfg.max_clients) {
        srv->counters.clients_refused++;
        snprintf(msg, sizeof msg, "too many clients (limit %u)", srv->cfg.max_clients);
        LOG_W("client %llu (pid %d): %s", (unsigned long long)c->id, (int)cred.pid, msg);
        conn_send_error(c, 0, MOED_E_BUSY, msg);
        c->linger = 1;
        conn_close(c, 1);
        return;
    }
    conn_set_sndbuf(c, fd);
    c->counted = 1;
    srv->n_clients++;
    srv->counters.clients = srv->n_clients;
    srv->counters.clients_total++;
    LOG_D("client %llu connected (pid %d uid %u)", (unsigned long long)c->id, (int)cred.pid,
          (unsigned)cred.uid);
    conn_update(c);
}

/* ---- open / close ------------------------------------------------------------ */

/* Refuse a non-socket at the path; replace a stale socket only if nothing
 * listens on it. */
static int prepare_path(const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (lstat(path, &st) < 0) {
        if (errno == ENOENT)
            return 0;
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: stat: %s", path,
                           strerror(errno));
    }
    if (!S_ISSOCK(st.st_mode))
        return moed_seterr(err, errlen, MOED_E_IO,
                           "server.socket %s exists and is not a socket; refusing to replace it",
                           path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return moed_seterr(err, errlen, MOED_E_IO, "socket(): %s", strerror(errno));
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, strlen(path));
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    close(fd);
    if (rc == 0)
        return moed_seterr(err, errlen, MOED_E_IO, "another moed is listening on %s", path);
    if (e != ECONNREFUSED)
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: probing the old socket: %s",
                           path, strerror(e));
    LOG_I("removing stale socket %s (nothing listens on it)", path);
    if (unlink(path) < 0 && errno != ENOENT)
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: unlink stale socket: %s", path,
                           strerror(errno));
    return 0;
}

static int apply_group(const char *path, const char *group, char *err, size_t errlen)
{
    if (!group[0])
        return 0;
    struct group gr, *res = NULL;
    char buf[4096];
    gid_t gid;
    int rc = getgrnam_r(group, &gr, buf, sizeof buf, &res);
    if (rc == 0 && res) {
        gid = res->gr_gid;
    } else {
        char *end;
        unsigned long v = strtoul(group, &end, 10);
        if (*end || end == group)
            return moed_seterr(err, errlen, MOED_E_CONFIG, "server.socket_group: no group named '%s'",
                               group);
        gid = (gid_t)v;
    }
    if (chown(path, (uid_t)-1, gid) < 0)
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket_group: chgrp %s to %s: %s", path,
                           group, strerror(errno));
    return 0;
}

static void on_server_handle_closed(uv_handle_t *h)
{
    struct moed_server *srv = h->data;
    srv->n_handles--;
    server_maybe_done(srv);
}

int moed_server_open(uv_loop_t *loop, const struct moed_server_limits *cfg,
                     const struct moed_server_ops *ops, void *ctx, struct moed_bufpool *pool,
                     struct moed_server **out, char *err, size_t errlen)
{
    int rc;
    *out = NULL;
    size_t plen = strnlen(cfg->socket_path, sizeof cfg->socket_path);
    if (plen == 0 || plen > MOED_SOCKET_PATH_MAX)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "server.socket: path is %zu bytes; must be 1..%d (sun_path)", plen,
                           MOED_SOCKET_PATH_MAX);
    if (cfg->max_clients == 0 || cfg->max_pending_per_client == 0 || cfg->frame_timeout_ms == 0)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "server: max_clients, max_pending_per_client and frame_timeout_ms must be > 0");
    rc = prepare_path(cfg->socket_path, err, errlen);
    if (rc < 0)
        return rc;
    struct moed_server *srv = calloc(1, sizeof *srv);
    if (!srv)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
    srv->loop = loop;
    srv->cfg = *cfg;
    if (srv->cfg.max_client_buffer_bytes > srv->cfg.max_reply_bytes)
        srv->cfg.max_client_buffer_bytes = srv->cfg.max_reply_bytes; /* one client under the cap */
    srv->ops = ops;
    srv->ctx = ctx;
    srv->pool = pool;
    /* On Unix these inits cannot fail (libuv 1.x returns 0): checked for the log. */
    MOED_UV_CHECK(uv_pipe_init(loop, &srv->listener, 0));
    srv->listener.data = srv;
    MOED_UV_CHECK(uv_idle_init(loop, &srv->closer));
    srv->closer.data = srv;
    MOED_UV_CHECK(uv_idle_init(loop, &srv->runner));
    srv->runner.data = srv;
    srv->n_handles = 3;
    /* The socket is created with the configured mode (umask), then chmod'ed
     * in case the umask was not enough (e.g. 0666 under a 022 umask). */
    mode_t old = umask((mode_t)(~cfg->socket_mode & 0777));
    rc = uv_pipe_bind(&srv->listener, cfg->socket_path);
    umask(old);
    if (rc < 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: bind: %s", cfg->socket_path,
                         uv_strerror(rc));
        goto fail_handles;
    }
    if (chmod(cfg->socket_path, (mode_t)cfg->socket_mode) < 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: chmod %o: %s", cfg->socket_path,
                         cfg->socket_mode, strerror(errno));
        goto fail_unlink;
    }
    rc = apply_group(cfg->socket_path, cfg->socket_group, err, errlen);
    if (rc < 0)
        goto fail_unlink;
    rc = uv_listen((uv_stream_t *)&srv->listener, LISTEN_BACKLOG, on_connection);
    if (rc < 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: listen: %s", cfg->socket_path,
                         uv_strerror(rc));
        goto fail_unlink;
    }
    srv->listening = 1;
    LOG_I("listening on %s (mode %04o%s%s)", cfg->socket_path, cfg->socket_mode,
          cfg->socket_group[0] ? ", group " : "", cfg->socket_group);
    *out = srv;
    return 0;

fail_unlink:
    unlink(cfg->socket_path);
fail_handles:
    /* The handles were initialised on the loop: close them, free after. */
    srv->closing = 1;
    srv->done = NULL;
    srv->n_handles = 3;
    uv_close((uv_handle_t *)&srv->listener, on_server_handle_closed);
    uv_close((uv_handle_t *)&srv->closer, on_server_handle_closed);
    uv_close((uv_handle_t *)&srv->runner, on_server_handle_closed);
    return rc;
}

void moed_server_stop_listening(struct moed_server *srv)
{
    if (!srv->listening)
        return;
    srv->listening = 0;
    uv_close((uv_handle_t *)&srv->listener, on_server_handle_closed);
    if (unlink(srv->cfg.socket_path) < 0 && errno != ENOENT)
        LOG_W("unlink %s: %s", srv->cfg.socket_path, strerror(errno));
}

static void server_maybe_done(struct moed_server *srv)
{
    if (!srv->closing || srv->n_handles > 0 || srv->conns)
        return;
    void (*done)(void *) = srv->done;
    void *arg = srv->done_arg;
    free(srv);
    if (done)
        done(arg);
}

void moed_server_close(struct moed_server *srv, void (*done)(void *arg), void *arg)
{
    moed_server_stop_listening(srv);
    srv->done = done;
    srv->done_arg = arg;
    /* Every request was answered (the engine drained first): the replies
     * still queued are owed, so each client gets as long as an open one to
     * read them (frame_timeout_ms per stall), not CLOSE_GRACE_MS in all. */
    for (struct moed_conn *c = srv->conns; c; c = c->next) {
        conn_close(c, 1);
        c->drain_on_close = 1;
    }
    /* The closer handle is closed only after it ran for the marked clients;
     * deferred clients are all closing now: the runner has nothing to do. */
    srv->closing = 1;
    for (struct moed_conn *c = srv->ready_head, *nx; c; c = nx) {
        nx = c->ready_next;
        c->ready_next = NULL;
        c->deferred = 0;
    }
    srv->ready_head = srv->ready_tail = NULL;
    if (srv->close_list)
        on_closer(&srv->closer);
    uv_close((uv_handle_t *)&srv->closer, on_server_handle_closed);
    uv_close((uv_handle_t *)&srv->runner, on_server_handle_closed);
}
