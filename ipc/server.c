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
#include "server_int.h"

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

static void on_close_grace(uv_timer_t *t);
static void on_conn_timer(uv_timer_t *t);
static uint64_t close_grace_ms(const struct moed_conn *c);

/* ---- frames and writes ------------------------------------------------ */

int conn_blocked(const struct moed_conn *c)
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

void conn_send_error(struct moed_conn *c, uint64_t request_id, int code, const char *msg)
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

/* conn_send with the request's timestamps (NULL: none); 1 when the frame
 * was queued, 0 when the client is gone or the copy could not be made (the
 * connection is then closed). */
static int conn_send_timed(struct moed_conn *c, uint16_t type, uint64_t request_id,
                           const void *payload, size_t plen, const struct moed_req_times *t)
{
    if (!conn_writable(c))
        return 0;
    struct write_req *wr = wr_small(MOED_PROTO_HDR_SIZE + plen);
    if (!wr) {
        conn_close(c, 0);
        return 0;
    }
    moed_frame_encode(wr->data, type | MOED_PROTO_REPLY, request_id, plen);
    if (plen)
        memcpy(wr->data + MOED_PROTO_HDR_SIZE, payload, plen);
    conn_queue(c, wr, wr->data, MOED_PROTO_HDR_SIZE + plen, t);
    return 1;
}

void conn_send(struct moed_conn *c, uint16_t type, uint64_t request_id, const void *payload,
                      size_t plen)
{
    (void)conn_send_timed(c, type, request_id, payload, plen, NULL);
}

/* ---- closing ------------------------------------------------------------ */

void conn_free_if_done(struct moed_conn *c)
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

void conn_close_now(struct moed_conn *c)
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
void on_closer(uv_idle_t *h)
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

void conn_close(struct moed_conn *c, int graceful)
{
    struct moed_server *srv = c->srv;
    if (c->closing) {
        if (!graceful)
            c->graceful = 0;
        return;
    }
    c->closing = 1;
    c->graceful = graceful ? 1 : 0;
    if (srv->ops->conn_closed)
        srv->ops->conn_closed(srv->ctx, c);
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

void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *out)
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
void conn_update(struct moed_conn *c)
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
    else if (c->reading && c->pending == 0 && c->unwritten == 0 && c->held == 0 &&
             srv->cfg.idle_timeout_ms) {
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
    out->routed_only = (fr.flags & MOED_FORWARD_ROUTED_ONLY) != 0;
    out->empty_slots = (fr.flags & MOED_FORWARD_EMPTY_SLOTS) != 0;
    out->body = payload + sizeof fr;
    out->body_len = (size_t)len - sizeof fr;
    return 0;
}

int moed_server_reply_desc(struct moed_conn *c, uint64_t request_id, uint32_t n_tokens,
                           uint32_t hidden, int times, const struct moed_req_times *t)
{
    uint8_t rep[sizeof(struct moed_forward_desc_times_rep)];
    le_put32(rep, n_tokens);
    le_put32(rep + 4, hidden);
    if (times) {
        const uint64_t now = uv_hrtime(); /* CLOCK_MONOTONIC, as the client's */
        const uint64_t rx = t && t->rx_ns && now > t->rx_ns ? t->rx_ns : now;
        le_put64(rep + 8, t ? t->kernel_ns : 0);
        le_put64(rep + 16, now - rx);
        le_put64(rep + 24, rx);
        le_put64(rep + 32, now);
    }
    const size_t n = times ? sizeof(struct moed_forward_desc_times_rep)
                           : sizeof(struct moed_forward_rep);
    int queued = !c->closing &&
                 conn_send_timed(c, MOED_MSG_FORWARD_DESC, request_id, rep, n, t);
    conn_request_done(c);
    return queued;
}

void **moed_server_conn_user(struct moed_conn *c) { return &c->user; }

/* Loop thread; the caller is inside a frame's handling or the close path,
 * and conn_process / the next write completion re-arm the timer. */
void moed_server_conn_hold(struct moed_conn *c, int delta)
{
    c->held = (uint32_t)((int64_t)c->held + delta);
}

int moed_server_conn_gone(const struct moed_conn *c) { return c->closing; }

const struct moed_server_counters *moed_server_counters(const struct moed_server *srv)
{
    return &srv->counters;
}

