/* server_frames.c - the socket server's frame dispatch (see server.c and
 * server_int.h): parse what a client sent, answer HELLO / PING / STATUS
 * inline, hand FORWARD to the engine, and share the loop fairly between
 * clients. */
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

/* ---- frame handling ------------------------------------------------------ */

/* HELLO: the highest version both sides speak. A version-2 reply is the
 * 64-byte version-1 reply, then n_moe_layers (u32) and the MoE layer ids. */
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
    uint16_t chosen = MOED_PROTO_MIN_VERSION; /* an empty HELLO: a version-1 client */
    if (h->payload_len == sizeof(struct moed_hello_req)) {
        struct moed_hello_req rq = {.min_version = le_get16(p), .max_version = le_get16(p + 2)};
        if (rq.min_version > MOED_PROTO_VERSION || rq.max_version < MOED_PROTO_MIN_VERSION ||
            rq.min_version > rq.max_version) {
            char msg[128];
            snprintf(msg, sizeof msg, "client speaks versions %u..%u; this daemon speaks %u..%u",
                     rq.min_version, rq.max_version, MOED_PROTO_MIN_VERSION, MOED_PROTO_VERSION);
            conn_send_error(c, h->request_id, MOED_E_VERSION, msg);
            return;
        }
        chosen = rq.max_version < MOED_PROTO_VERSION ? rq.max_version : MOED_PROTO_VERSION;
    }
    uint8_t buf[MOED_HELLO_V1_BYTES + 4 + 4 * MOED_PROTO_MAX_LAYERS];
    uint32_t layers[MOED_PROTO_MAX_LAYERS];
    struct moed_hello_rep rep;
    _Static_assert(sizeof rep == MOED_HELLO_V1_BYTES, "HELLO version-1 reply");
    memset(&rep, 0, sizeof rep);
    srv->ops->hello(srv->ctx, &rep);
    rep.version = chosen;
    memcpy(buf, &rep, sizeof rep);
    size_t len = sizeof rep;
    if (chosen >= 2) {
        uint32_t n = srv->ops->moe_layers ? srv->ops->moe_layers(srv->ctx, layers,
                                                                 MOED_PROTO_MAX_LAYERS)
                                          : 0;
        if (n > MOED_PROTO_MAX_LAYERS)
            n = MOED_PROTO_MAX_LAYERS;
        le_put32(buf + len, n);
        len += 4;
        for (uint32_t i = 0; i < n; i++, len += 4)
            le_put32(buf + len, layers[i]);
    }
    conn_send(c, MOED_MSG_HELLO, h->request_id, buf, len);
}

/* CHAN_OPEN's reply: the head, then the client kernel's fatbin. */
static int chan_open(struct moed_conn *c, const struct moed_frame_hdr *h, const uint8_t *p,
                     char *msg, size_t msglen)
{
    struct moed_server *srv = c->srv;
    struct moed_chan_open_req rq;
    struct moed_chan_open_rep rep;
    const void *kernel = NULL;
    int rc = moed_chan_open_decode(p, h->payload_len, &rq, msg, msglen);
    if (rc == 0)
        rc = srv->ops->chan_open(srv->ctx, c, &rq, &rep, &kernel, msg, msglen);
    if (rc < 0)
        return rc;
    size_t n = sizeof rep + rep.kernel_bytes;
    uint8_t *buf = malloc(n);
    if (!buf) {
        /* the channel is open: it goes with the connection */
        conn_close(c, 0);
        return 0;
    }
    moed_chan_open_rep_encode(buf, &rep);
    memcpy(buf + sizeof rep, kernel, rep.kernel_bytes);
    conn_send(c, MOED_MSG_CHAN_OPEN, h->request_id, buf, n);
    free(buf);
    return 0;
}

/* REGISTER_BUF, UNREGISTER_BUF, FORWARD_DESC, CHAN_OPEN, CHAN_CLOSE:
 * version-2 frames only; a
 * version-1 frame of these types is answered MOED_E_UNSUPPORTED as version 1
 * always did (the connection stays). */
static void handle_v2(struct moed_conn *c, const struct moed_frame_hdr *h, const uint8_t *p)
{
    struct moed_server *srv = c->srv;
    const struct moed_server_ops *ops = srv->ops;
    char msg[MOED_ERRLEN];
    msg[0] = 0;
    int rc = 0;
    if (h->version < moed_type_min_version(h->type)) {
        snprintf(msg, sizeof msg,
                 "message type %u (registered buffers, channels) needs protocol version 2 "
                 "frames; this one is version %u",
                 h->type, h->version);
        rc = MOED_E_UNSUPPORTED;
    } else if ((h->type == MOED_MSG_REGISTER_BUF && !ops->register_buf) ||
               (h->type == MOED_MSG_UNREGISTER_BUF && !ops->unregister_buf) ||
               (h->type == MOED_MSG_FORWARD_DESC && !ops->forward_desc) ||
               (h->type == MOED_MSG_CHAN_OPEN && !ops->chan_open) ||
               (h->type == MOED_MSG_CHAN_CLOSE && !ops->chan_close)) {
        snprintf(msg, sizeof msg, "message type %u is not served by this daemon", h->type);
        rc = MOED_E_UNSUPPORTED;
    } else if (h->type == MOED_MSG_REGISTER_BUF) {
        struct moed_register_req rq;
        uint32_t id = 0;
        rc = moed_register_decode(p, h->payload_len, &rq, msg, sizeof msg);
        if (rc == 0)
            rc = ops->register_buf(srv->ctx, c, &rq, &id, msg, sizeof msg);
        if (rc == 0) {
            uint8_t rep[sizeof(struct moed_register_rep)];
            le_put32(rep, id);
            le_put32(rep + 4, 0);
            conn_send(c, MOED_MSG_REGISTER_BUF, h->request_id, rep, sizeof rep);
        }
    } else if (h->type == MOED_MSG_UNREGISTER_BUF) {
        if (h->payload_len != sizeof(struct moed_register_rep) || le_get32(p + 4) != 0) {
            snprintf(msg, sizeof msg,
                     "UNREGISTER_BUF payload is %llu bytes (expected 8: buffer id, reserved 0)",
                     (unsigned long long)h->payload_len);
            rc = MOED_E_INVAL;
        } else {
            rc = ops->unregister_buf(srv->ctx, c, le_get32(p), msg, sizeof msg);
        }
        if (rc == 0)
            conn_send(c, MOED_MSG_UNREGISTER_BUF, h->request_id, NULL, 0);
    } else if (h->type == MOED_MSG_CHAN_OPEN) {
        rc = chan_open(c, h, p, msg, sizeof msg);
    } else if (h->type == MOED_MSG_CHAN_CLOSE) {
        struct moed_chan_close_req rq;
        rc = moed_chan_close_decode(p, h->payload_len, &rq, msg, sizeof msg);
        if (rc == 0)
            rc = ops->chan_close(srv->ctx, c, rq.chan_id, msg, sizeof msg);
        if (rc == 0)
            conn_send(c, MOED_MSG_CHAN_CLOSE, h->request_id, NULL, 0);
    } else {
        c->pending++;
        struct moed_req_times t = {.rx_ns = c->rx_ns, .complete_ns = uv_hrtime()};
        rc = ops->forward_desc(srv->ctx, c, h->request_id, p, h->payload_len, &t, msg, sizeof msg);
        if (rc < 0)
            c->pending--;
    }
    if (rc < 0)
        conn_send_error(c, h->request_id, rc, msg[0] ? msg : moed_strerror(rc));
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
    case MOED_MSG_FORWARD_DESC:
    case MOED_MSG_CHAN_OPEN:
    case MOED_MSG_CHAN_CLOSE:
        handle_v2(c, h, p);
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
        snprintf(msg, len, "protocol version %u not supported (this daemon speaks %d..%d)",
                 h->version, MOED_PROTO_MIN_VERSION, MOED_PROTO_VERSION);
    } else if (rc == MOED_E_TYPE) {
        snprintf(msg, len, "unknown message type %u (0x%04x)", h->type, h->type);
    } else if (have >= 4 && magic != MOED_PROTO_MAGIC) {
        snprintf(msg, len, "bad magic 0x%08x (expected 0x%08x \"MOED\")", magic, MOED_PROTO_MAGIC);
    } else if (have >= MOED_PROTO_HDR_SIZE && (h->flags != 0 || h->reserved != 0)) {
        snprintf(msg, len, "flags 0x%x / reserved 0x%x must be 0 in version %u", h->flags,
                 h->reserved, h->version);
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
void conn_process(struct moed_conn *c)
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

