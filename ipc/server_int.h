/* server_int.h - what the socket server's files share (private to ipc/):
 * server.c (writes, closing, timers, reads, replies to the engine),
 * server_frames.c (frame dispatch: HELLO / PING / STATUS inline, FORWARD to
 * the engine, fairness between clients) and server_accept.c (accept, peer
 * check, open and close of the listener). See server.c for the design.
 */
#ifndef MOED_SERVER_INT_H
#define MOED_SERVER_INT_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "bufpool.h"
#include "server.h"

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
static inline size_t alloc_cost(size_t n)
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
    void *user;           /* the engine's (moed_server_conn_user) */
    uint64_t rx_ns;       /* start of the read that brought the current frame's first byte */
    uint64_t read_start_ns; /* start of the latest read (taken in on_alloc) */
    uint32_t pending;
    uint32_t unwritten;   /* replies queued, their write not completed */
    uint32_t held;        /* engine resources in use without socket traffic
                             (open doorbell channels): not idle while > 0 */
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

/* Shared between the server's files (server.c unless noted). */
int conn_blocked(const struct moed_conn *c);
void conn_close(struct moed_conn *c, int graceful);
void conn_close_now(struct moed_conn *c);
void conn_free_if_done(struct moed_conn *c);
void conn_process(struct moed_conn *c);
void conn_send(struct moed_conn *c, uint16_t type, uint64_t request_id, const void *payload,
               size_t plen);
void conn_send_error(struct moed_conn *c, uint64_t request_id, int code, const char *msg);
void conn_update(struct moed_conn *c);
void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *out);
void on_closer(uv_idle_t *h);
void server_maybe_done(struct moed_server *srv);

#endif
