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
#include "moed_err.h"
#include "moed_proto.h"

struct moed_server;
struct moed_conn; /* one client connection; opaque */

#define MOED_SERVER_PATH_MAX 4096
#define MOED_SERVER_MAX_IDS 64

/* What the server reads of the daemon's config (the server.* keys; see
 * config/README.md for each one's meaning and bounds). */
struct moed_server_limits {
    char socket_path[MOED_SERVER_PATH_MAX];
    uint32_t socket_mode;             /* e.g. 0660 */
    char socket_group[64];            /* "" = leave as is */
    uint32_t allowed_uids[MOED_SERVER_MAX_IDS]; uint32_t n_allowed_uids; /* empty: own uid + root */
    uint32_t allowed_gids[MOED_SERVER_MAX_IDS]; uint32_t n_allowed_gids;
    uint32_t max_clients;
    uint32_t max_pending_per_client;
    uint64_t max_frame_bytes;
    uint64_t max_client_buffer_bytes; /* queued reply bytes before reading stops */
    uint32_t frame_timeout_ms;        /* header received -> body must complete */
    uint64_t read_buffer_keep_bytes;  /* read buffer a connection keeps between frames */
    uint64_t socket_buffer_bytes;     /* SO_SNDBUF of client sockets; 0 = kernel default */
    uint32_t idle_timeout_ms;         /* close a client idle this long; 0 = never */
    uint64_t max_reply_bytes;         /* reply memory queued for all clients together */
};

/* The server's own counters (read with moed_server_counters). */
struct moed_server_counters {
    uint32_t clients;               /* connected now */
    uint64_t clients_total;         /* accepted since start */
    uint64_t clients_refused;
    uint64_t errors[MOED_E__COUNT]; /* ERROR frames sent, by -code */
};

/* The timestamps of one request (ns, uv_hrtime clock); 0 = not reached. */
struct moed_req_times {
    uint64_t rx_ns;       /* first byte of the frame read */
    uint64_t complete_ns; /* frame complete */
    uint64_t submit_ns;   /* batch handed to the backend */
    uint64_t done_ns;     /* backend done callback (backend thread) */
    uint64_t reply_ns;    /* reply handed to the socket write */
    uint64_t kernel_ns;   /* not a timestamp: the batch's kernel time (ns,
                             moed_batch.kernel_ns); 0 = not known */
};

/* A FORWARD request as moed_server_forward_parse read it. */
struct moed_server_fwd {
    uint32_t layer;
    uint32_t n_tokens;    /* 0 is valid: the engine answers at once, with no y */
    int routed_only;      /* flag 0x1: no shared-expert term for this request */
    int empty_slots;      /* flag 0x2: ids of -1 are empty slots (validated) */
    const uint8_t *body;  /* x bf16 [T, H], ids int32 [T, top_k], w f32 [T, top_k] */
    size_t body_len;
};

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
    /* The model's MoE layer ids, ascending, into out[0..max) (HELLO version
     * 2); returns how many there are (at most max are written). */
    uint32_t (*moe_layers)(void *ctx, uint32_t *out, uint32_t max);
    /* Status JSON for a STATUS request: `*len` bytes the engine keeps (valid
     * until the next call; the server copies them into the reply), so that a
     * flood of STATUS requests is served from one rendering; NULL on
     * allocation failure. */
    const char *(*status_json)(void *ctx, size_t *len);
    /* Optional: a timed FORWARD reply's last byte was written at now_ns; `t`
     * has every timestamp (reply_ns included). */
    void (*reply_written)(void *ctx, const struct moed_req_times *t, uint64_t now_ns);
    /* Version 2, registered client buffers (PROTOCOL.md section 9); each
     * optional (NULL: the type is answered MOED_E_UNSUPPORTED). */
    /* REGISTER_BUF, decoded and checked (moed_register_decode): 0 with the
     * new id in *buf_id (the server replies), or a negative code with a
     * message in err (the server answers ERROR). */
    int (*register_buf)(void *ctx, struct moed_conn *c, const struct moed_register_req *rq,
                        uint32_t *buf_id, char *err, size_t errlen);
    /* UNREGISTER_BUF: 0 (the server replies) or a negative code. */
    int (*unregister_buf)(void *ctx, struct moed_conn *c, uint32_t buf_id, char *err,
                          size_t errlen);
    /* FORWARD_DESC: as forward (payload valid during the call only; no
     * buffer is lent); answered later with moed_server_reply_desc or
     * moed_server_reply_error. */
    int (*forward_desc)(void *ctx, struct moed_conn *c, uint64_t request_id,
                        const uint8_t *payload, uint64_t len, const struct moed_req_times *t,
                        char *err, size_t errlen);
    /* CHAN_OPEN, decoded and checked (moed_chan_open_decode): 0 with the
     * reply head in *rep and *kernel pointing at its rep->kernel_bytes bytes
     * of fatbin (valid during the call; the server copies them into the
     * reply), or a negative code with a message. */
    int (*chan_open)(void *ctx, struct moed_conn *c, const struct moed_chan_open_req *rq,
                     struct moed_chan_open_rep *rep, const void **kernel, char *err,
                     size_t errlen);
    /* CHAN_CLOSE (decoded): 0 (the server replies) or a negative code. */
    int (*chan_close)(void *ctx, struct moed_conn *c, uint32_t chan_id, char *err,
                      size_t errlen);
    /* The connection closed (called once, when it is marked closing; its
     * requests may still be out): everything it registered is to go. */
    void (*conn_closed)(void *ctx, struct moed_conn *c);
};

/* Open the listening socket described by `lim`: checks the path length,
 * refuses a path that is not a socket, replaces a stale socket only if
 * nothing listens on it, binds, applies mode and group, and starts listening.
 * Read buffers come from `pool` and every frame written goes back to it;
 * `pool` (owned by the caller) outlives the server. `lim` is copied. */
int moed_server_open(uv_loop_t *loop, const struct moed_server_limits *lim,
                     const struct moed_server_ops *ops, void *ctx, struct moed_bufpool *pool,
                     struct moed_server **out, char *err, size_t errlen);

/* The server's counters (valid until moed_server_close's done). */
const struct moed_server_counters *moed_server_counters(const struct moed_server *srv);

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

/* FORWARD framing, owned here. A reply's y (bf16 [T, H]) lies
 * MOED_SERVER_FWD_Y_OFF bytes into its frame; a buffer whose frame starts
 * MOED_SERVER_FWD_PAD bytes in has y at MOED_BUF_ALIGN (16). In a lent read
 * buffer (ops->forward's rx) the request body starts MOED_SERVER_FWD_BODY_OFF
 * bytes in, also 16-aligned. */
#define MOED_SERVER_FWD_Y_OFF ((size_t)(MOED_PROTO_HDR_SIZE + sizeof(struct moed_forward_rep)))
#define MOED_SERVER_FWD_PAD ((16 - MOED_SERVER_FWD_Y_OFF % 16) % 16)
#define MOED_SERVER_FWD_BODY_OFF ((size_t)(MOED_PROTO_HDR_SIZE + sizeof(struct moed_forward_req)))
_Static_assert(MOED_SERVER_FWD_BODY_OFF % 16 == 0, "x in a lent read buffer is 16-aligned");

/* Validate a FORWARD payload against the model (moed_forward_validate) and
 * give its fields; MOED_E_INVAL with a message in err if it is not valid. */
int moed_server_forward_parse(const uint8_t *payload, uint64_t len, uint32_t hidden,
                              uint32_t n_experts, uint32_t top_k, uint32_t max_tokens,
                              int (*is_moe_layer)(const void *ctx, uint32_t layer),
                              const void *ctx, struct moed_server_fwd *out, char *err,
                              size_t errlen);

/* Answer a FORWARD with its result: y (n_tokens * hidden bf16) is already at
 * frame->base + off + MOED_SERVER_FWD_Y_OFF; the server writes the frame
 * header and the reply head in front of it and sends it as moed_server_reply
 * does. */
void moed_server_reply_forward(struct moed_conn *c, struct moed_hbuf *frame, size_t off,
                               uint64_t request_id, uint32_t n_tokens, uint32_t hidden,
                               const struct moed_req_times *t);

/* Answer a FORWARD_DESC with its head alone (y is in the client's buffer),
 * with times (MOED_FORWARD_DESC_TIMES) followed by the request's kernel time
 * (t->kernel_ns) and its time in the daemon (t->rx_ns -> now); 1 when the
 * reply was queued, 0 when the client is gone. */
int moed_server_reply_desc(struct moed_conn *c, uint64_t request_id, uint32_t n_tokens,
                           uint32_t hidden, int times, const struct moed_req_times *t);

/* A pointer the engine keeps per connection (NULL at accept). */
void **moed_server_conn_user(struct moed_conn *c);

/* Answer a FORWARD the engine took with an ERROR frame. */
void moed_server_reply_error(struct moed_conn *c, uint64_t request_id, int code, const char *msg);

/* The engine holds (+1) or lets go of (-1) something the client uses
 * without socket traffic (an open doorbell channel, served on the GPU):
 * while any is held the connection is not idle (server.idle_timeout_ms). */
void moed_server_conn_hold(struct moed_conn *c, int delta);

/* 1 if the connection is gone (closed or closing): the engine may drop work. */
int moed_server_conn_gone(const struct moed_conn *c);

/* Build an ERROR frame (malloc'd, *len set); NULL on allocation failure. */
uint8_t *moed_server_error_frame(uint64_t request_id, int code, const char *msg, size_t *len);

#endif
