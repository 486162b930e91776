/* reqio.h - where one request's inputs lie and where its reply goes (prefix
 * moed_reqio_). The one owner of the buffer handoff between the socket
 * server, the buffer pool, the engine's batches and the backend.
 *
 * A request comes from a source; each source is one moed_reqio_ops:
 *   - socket (moed_reqio_from_frame, this module): x | ids | w arrived in a
 *     FORWARD frame. When the server lends its read buffer (the frame was all
 *     it held) the inputs stay where they were read, else they are copied out.
 *     A lone request's batch reads them in place and writes y straight into a
 *     reply frame from the pool (pinned and device-mapped when the backend
 *     offers such memory: the backend then skips its staging copies); a
 *     merged batch copies the inputs in and the reply's y out.
 *   - descriptor (FORWARD_DESC, engine/desc.h): x, ids, w and y lie in a
 *     client's registered GPU buffers; the batch uses them in place and the
 *     reply is a head without y.
 *
 * The engine sees only these calls: bind (a batch of this request alone),
 * host_inputs (merge), reply / fail / skip (exactly one answers the request
 * and releases everything it holds), abandon (its batch failed while the
 * device may still touch its buffers). Loop thread only.
 */
#ifndef MOED_REQIO_H
#define MOED_REQIO_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "bufpool.h"
#include "server.h"

/* The kind of memory a pool buffer is, for a moed_buf. */
static inline enum moed_buf_kind moed_reqio_hbuf_kind(const struct moed_hbuf *h)
{
    return h->pinned ? MOED_BUF_PINNED : MOED_BUF_HOST;
}

/* What every request of one engine shares. */
struct moed_reqio_env {
    struct moed_bufpool *pool;
    uint32_t hidden, top_k;
};

struct moed_reqio;

struct moed_reqio_ops {
    const char *name;
    /* Point b's x, ids, w, y at the request's own memory for a batch of it
     * alone; 0, or < 0 when the layout does not allow it (the engine then
     * merges it, which needs host_inputs). */
    int (*bind)(const struct moed_reqio_env *env, struct moed_reqio *io, struct moed_batch *b);
    /* x | ids | w readable by the host, or NULL (the request cannot merge). */
    const uint8_t *(*host_inputs)(const struct moed_reqio *io);
    /* The batch succeeded: answer. y is in place if bind ran for b, else at
     * row `row` of b->y (b NULL: a request of T = 0, answered with no
     * batch). t has every timestamp up to done_ns. Returns 1 when
     * the result went to the client, 0 when the client is gone (dropped), a
     * negative code when an error was sent instead. */
    int (*reply)(const struct moed_reqio_env *env, struct moed_reqio *io,
                  const struct moed_batch *b, int bound, uint32_t row,
                  const struct moed_req_times *t);
    /* Answer with an error (code < 0); code 0: the client is gone, only
     * release. */
    void (*fail)(const struct moed_reqio_env *env, struct moed_reqio *io, int code,
                 const char *msg);
    /* The device may still read or write the request's buffers. */
    void (*abandon)(const struct moed_reqio_env *env, struct moed_reqio *io);
};

/* One request's I/O; embedded in the engine's request. */
struct moed_reqio {
    const struct moed_reqio_ops *ops;
    struct moed_conn *conn;
    uint64_t request_id;
    uint32_t layer, n_tokens;
    /* socket source */
    uint8_t *data;           /* x bf16 [T,H] | ids int32 [T,k] | w fp32 [T,k] */
    struct moed_hbuf rx;     /* base != NULL: data lies in this lent read buffer */
    struct moed_hbuf frame;  /* bound: the reply frame, y in it */
    /* other sources */
    void *src;               /* the source's per-request state */
};

/* Take a parsed FORWARD into *io: keep the lent read buffer (rx not NULL:
 * the frame is all it holds; *rx is cleared) or copy the body. 0 or
 * MOED_E_NOMEM (with a message in err; rx untouched). */
int moed_reqio_from_frame(struct moed_reqio *io, struct moed_conn *c, uint64_t request_id,
                          const struct moed_server_fwd *fr, struct moed_hbuf *rx, char *err,
                          size_t errlen);

static inline int moed_reqio_bind(const struct moed_reqio_env *env, struct moed_reqio *io,
                                  struct moed_batch *b)
{
    return io->ops->bind(env, io, b);
}
static inline const uint8_t *moed_reqio_host_inputs(const struct moed_reqio *io)
{
    return io->ops->host_inputs(io);
}
static inline int moed_reqio_reply(const struct moed_reqio_env *env, struct moed_reqio *io,
                                   const struct moed_batch *b, int bound, uint32_t row,
                                   const struct moed_req_times *t)
{
    return io->ops->reply(env, io, b, bound, row, t);
}
static inline void moed_reqio_fail(const struct moed_reqio_env *env, struct moed_reqio *io,
                                   int code, const char *msg)
{
    io->ops->fail(env, io, code, msg);
}
static inline void moed_reqio_abandon(const struct moed_reqio_env *env, struct moed_reqio *io)
{
    io->ops->abandon(env, io);
}

#endif
