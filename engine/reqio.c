/* reqio.c - the socket source of requests (reqio.h): a FORWARD frame's
 * inputs in a lent read buffer or a copy, y into a reply frame in place.
 *
 * The handoff, in one place:
 *   from_frame  the server lends its read buffer when the frame was all it
 *               held (server.h, ops->forward): the inputs stay at
 *               MOED_SERVER_FWD_BODY_OFF (16-aligned) and the buffer is the
 *               request's until it answers; otherwise the body is copied.
 *   bind        a batch of this request alone reads x, ids, w where they lie
 *               and writes y into a reply frame taken from the pool now, at
 *               MOED_SERVER_FWD_PAD into its buffer, so that y lies at
 *               MOED_BUF_ALIGN. Buffers from the pinned allocator are marked
 *               MOED_BUF_PINNED: the backend uses them in place.
 *   reply       the inputs go back to the pool, the frame (bound: y already
 *               in it; merged: a fresh one, y copied from the batch's row)
 *               goes to the server, which frames and writes it.
 *   abandon     a failed batch may still be touched by the device: pinned
 *               buffers are never reused (bufpool's abandon).
 */
#include "reqio.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed_err.h"

_Static_assert(MOED_BUF_ALIGN == 16 &&
                   (MOED_SERVER_FWD_PAD + MOED_SERVER_FWD_Y_OFF) % MOED_BUF_ALIGN == 0,
               "y in a bound request's reply frame is aligned for in-place use");

static size_t x_bytes(const struct moed_reqio_env *env, uint32_t t)
{
    return (size_t)t * env->hidden * 2;
}

/* The inputs are read: give them back. */
static void sock_drop_inputs(const struct moed_reqio_env *env, struct moed_reqio *io)
{
    if (io->rx.base)
        moed_bufpool_put(env->pool, &io->rx);
    else
        free(io->data);
    io->data = NULL;
}

static void sock_release(const struct moed_reqio_env *env, struct moed_reqio *io)
{
    sock_drop_inputs(env, io);
    moed_bufpool_put(env->pool, &io->frame);
}

/* x, ids and w where the request holds them (its malloc'd copy, or 48 bytes
 * into a lent read buffer: 16-byte aligned either way; ids need 4-byte
 * alignment, which holds when T*H is even), y in a reply frame. */
static int sock_bind(const struct moed_reqio_env *env, struct moed_reqio *io, struct moed_batch *b)
{
    size_t xb = x_bytes(env, io->n_tokens), ib = (size_t)io->n_tokens * env->top_k * 4;
    if (xb % 4 != 0)
        return MOED_E_INVAL;
    if (moed_bufpool_get(env->pool, MOED_SERVER_FWD_PAD + MOED_SERVER_FWD_Y_OFF + xb, 1,
                         &io->frame))
        return MOED_E_NOMEM;
    enum moed_buf_kind xk = io->rx.base ? moed_reqio_hbuf_kind(&io->rx) : MOED_BUF_HOST;
    b->x = (struct moed_buf){xk, 0, io->data, xb};
    b->ids = (struct moed_buf){xk, 0, io->data + xb, ib};
    b->w = (struct moed_buf){xk, 0, io->data + xb + ib, ib};
    b->y = (struct moed_buf){moed_reqio_hbuf_kind(&io->frame), 0,
                             io->frame.base + MOED_SERVER_FWD_PAD + MOED_SERVER_FWD_Y_OFF, xb};
    return 0;
}

static const uint8_t *sock_host_inputs(const struct moed_reqio *io) { return io->data; }

static int sock_reply(const struct moed_reqio_env *env, struct moed_reqio *io,
                      const struct moed_batch *b, int bound, uint32_t row,
                      const struct moed_req_times *t)
{
    sock_drop_inputs(env, io); /* x was read; y is in the batch or the frame */
    if (moed_server_conn_gone(io->conn)) {
        /* the server frees the connection once its last request is released */
        moed_bufpool_put(env->pool, &io->frame);
        moed_server_reply(io->conn, NULL, 0, 0, NULL);
        return 0;
    }
    size_t ylen = x_bytes(env, io->n_tokens);
    struct moed_hbuf f = io->frame;
    size_t off = MOED_SERVER_FWD_PAD;
    io->frame = (struct moed_hbuf){0};
    if (!bound) {
        moed_bufpool_put(env->pool, &f);
        off = 0;
        if (moed_bufpool_get(env->pool, MOED_SERVER_FWD_Y_OFF + ylen, 0, &f) == 0 && ylen)
            memcpy(f.base + MOED_SERVER_FWD_Y_OFF, (const uint8_t *)b->y.ptr + (size_t)row * env->hidden * 2,
                   ylen);
    }
    if (!f.base) {
        moed_server_reply_error(io->conn, io->request_id, MOED_E_NOMEM,
                                "out of memory building the reply");
        return MOED_E_NOMEM;
    }
    moed_server_reply_forward(io->conn, &f, off, io->request_id, io->n_tokens, env->hidden, t);
    return 1;
}

static void sock_fail(const struct moed_reqio_env *env, struct moed_reqio *io, int code,
                      const char *msg)
{
    sock_release(env, io);
    if (code == 0)
        moed_server_reply(io->conn, NULL, 0, 0, NULL);
    else
        moed_server_reply_error(io->conn, io->request_id, code, msg);
}

static void sock_abandon(const struct moed_reqio_env *env, struct moed_reqio *io)
{
    if (io->rx.base && io->rx.pinned) { /* x read in place from the read buffer */
        moed_bufpool_abandon(env->pool, &io->rx);
        io->data = NULL;
    }
    moed_bufpool_abandon(env->pool, &io->frame);
}

static const struct moed_reqio_ops sock_ops = {
    .name = "socket",
    .bind = sock_bind,
    .host_inputs = sock_host_inputs,
    .reply = sock_reply,
    .fail = sock_fail,
    .abandon = sock_abandon,
};

int moed_reqio_from_frame(struct moed_reqio *io, struct moed_conn *c, uint64_t request_id,
                          const struct moed_server_fwd *fr, struct moed_hbuf *rx, char *err,
                          size_t errlen)
{
    memset(io, 0, sizeof *io);
    if (rx) {
        /* Keep the server's buffer: the inputs are used where they were read
         * (a 256 KiB copy less at T=64, H=2048). */
        io->rx = *rx;
        rx->base = NULL;
        io->data = (uint8_t *)(uintptr_t)fr->body;
    } else if (fr->body_len && !(io->data = malloc(fr->body_len))) {
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for a %zu-byte request",
                           fr->body_len);
    } else if (fr->body_len) {
        memcpy(io->data, fr->body, fr->body_len);
    }
    io->ops = &sock_ops;
    io->conn = c;
    io->request_id = request_id;
    io->layer = fr->layer;
    io->n_tokens = fr->n_tokens;
    return 0;
}
