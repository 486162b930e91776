/* server.h - moed's libuv Unix-socket server (prefix moed_server_).
 *
 * The server owns the listening socket and every client connection: it
 * checks peers (SO_PEERCRED), reassembles frames with a bounded per-client
 * buffer, answers HELLO / PING / STATUS inline and hands each FORWARD to the
 * engine through `ops->forward`. The engine answers every FORWARD it took
 * exactly once, later, with moed_server_reply() or moed_server_reply_error().
 *
 * Lifetime of a connection: a client that disconnects (or is disconnected)
 * is closed at once on the wire, but its memory lives until both its libuv
 * handles are closed AND the engine has answered (and so released) every
 * FORWARD it took from it. Replies to a closed connection are dropped. A
 * client that closed its socket outright (not just its write side) is closed
 * at EOF: its slot is free at once, and the engine may skip its requests
 * that have not started (moed_server_conn_gone).
 *
 * Everything here runs on the loop thread.
 */
#ifndef MOED_SERVER_H
#define MOED_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "bufpool.h"
#include "config.h"
#include "moed_proto.h"
#include "stats.h"

struct moed_server;
struct moed_conn; /* one client connection; opaque */

struct moed_server_ops {
    /* A FORWARD frame with a valid header. `payload` is valid only during the
     * call, unless the engine keeps the buffer it lies in: when `rx` is not
     * NULL the frame is all that buffer holds (at rx->base, so the payload
     * is at rx->base + 32), and an engine that returns 0 may take it (copy
     * *rx, set rx->base = NULL), use the payload in place instead of copying
     * it, and later put it back into the pool (before it answers the
     * request). `t` carries the frame's rx_ns and complete_ns (the rest is
     * 0).
     * Return 0 if the engine took the request (it then calls
     * moed_server_reply or moed_server_reply_error exactly once for it), or a
     * negative MOED_E_* code with a message in err (and rx untouched): the
     * server answers ERROR and the connection stays open. */
    int (*forward)(void *ctx, struct moed_conn *c, uint64_t request_id, const uint8_t *payload,
                   uint64_t len, const struct moed_req_times *t, struct moed_hbuf *rx,
                   char *err, size_t errlen);
    /* Fill the HELLO reply (everything but `version`). */
    void (*hello)(void *ctx, struct moed_hello_rep *rep);
    /* Status JSON for a STATUS request: `*len` bytes the engine keeps (valid
     * until the next call; the server copies them into the reply), so that a
     * flood of STATUS requests is served from one rendering; NULL on
     * allocation failure. */
    const char *(*status_json)(void *ctx, size_t *len);
};

/* Open the listening socket described by cfg (server.* keys): checks the path
 * length, refuses a path that is not a socket, replaces a stale socket only if
 * nothing listens on it, binds, applies mode and group, and starts listening.
 * Read buffers come from `pool` and every frame written goes back to it;
 * `pool` and `stats` (owned by the caller) outlive the server. `stats` gets
 * the client counters and the error counts of every ERROR frame sent. `cfg`
 * is copied. */
int moed_server_open(uv_loop_t *loop, const struct moed_cfg *cfg, const struct moed_server_ops *ops,
                     void *ctx, struct moed_bufpool *pool, struct moed_stats *stats,
                     struct moed_server **out, char *err, size_t errlen);

/* Stop accepting and remove the socket file (idempotent). Connected clients
 * keep working. */
void moed_server_stop_listening(struct moed_server *srv);

/* Stop listening, then close every client after its queued replies are
 * written (bounded wait), close the server's handles, and call done(arg) once
 * everything is released. The engine must have answered every FORWARD first
 * (see moed_engine_drain). The server memory is freed right before done. */
void moed_server_close(struct moed_server *srv, void (*done)(void *arg), void *arg);

/* Answer a FORWARD the engine took. The whole frame (header included) is
 * `len` bytes at frame->base + off, in a buffer from the server's pool; the
 * server owns the buffer from here (*frame is cleared) and puts it back into
 * the pool after the write, or at once if the client is gone. frame == NULL
 * only releases the request (used when moed_server_conn_gone said the client
 * left). `t` (may be NULL: not timed) has every timestamp up to done_ns; the
 * server adds reply_ns and, once the last byte is written, records the
 * request's stages in the stats. */
void moed_server_reply(struct moed_conn *c, struct moed_hbuf *frame, size_t off, size_t len,
                       const struct moed_req_times *t);

/* Answer a FORWARD the engine took with an ERROR frame. */
void moed_server_reply_error(struct moed_conn *c, uint64_t request_id, int code, const char *msg);

/* 1 if the connection is gone (closed or closing): the engine may drop work. */
int moed_server_conn_gone(const struct moed_conn *c);

/* Build an ERROR frame (malloc'd, *len set); NULL on allocation failure. */
uint8_t *moed_server_error_frame(uint64_t request_id, int code, const char *msg, size_t *len);

#endif
