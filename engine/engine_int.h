/* engine_int.h - what the engine's files share (private to engine/):
 * engine.c (requests, batching, completions, the server callbacks) and
 * engine_open.c (open, self-check, stats, drain, close). */
#ifndef MOED_ENGINE_INT_H
#define MOED_ENGINE_INT_H

#include "engine.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bufpool.h"
#include "desc.h"
#include "reqio.h"
#include "moed_check_uv.h"
#include "moe_ref.h"
#include "moed_err.h"
#include "moed_log.h"

struct eng_req {
    struct eng_req *next;
    struct moed_reqio io;    /* its source: inputs, reply, client (reqio.h) */
    struct moed_req_times t; /* rx and complete from the server; the rest here */
    uint32_t flags;          /* MOED_BATCH_ROUTED_ONLY: merged only with its like */
};

struct eng_batch {
    struct moed_batch b;  /* first: the backend hands us this pointer back */
    struct eng_batch *next;
    struct eng_req *reqs; /* in row order */
    struct moed_hbuf mem; /* merged batch: x | y | ids | w; none for a bound one */
    int bound;            /* a lone request's own buffers (moed_reqio_bind) */
    int selfcheck;
    uint64_t submit_ns;   /* handed to the backend (loop thread) */
    uint64_t done_ns;     /* done callback (backend thread, before the push) */
};

struct eng_ep; /* engine_open.c: what expert parallelism over GPUs holds */

struct moed_engine {
    uv_loop_t *loop;
    struct moed_model *model;
    const struct moed_dims *dims;
    struct moed_backend *be;
    struct eng_ep *ep; /* NULL: one device */
    struct moed_bufpool *pool; /* read buffers, reply frames, batch memory */
    struct moed_reqio_env io_env; /* what every request's I/O shares */
    struct moed_desc *desc;       /* registered client buffers (protocol version 2) */
    const char *backend_name;
    uv_async_t async;
    uint32_t max_tokens;
    uint32_t first_moe_layer;
    uint64_t max_frame_bytes;
    struct moed_stats stats;
    /* waiting FIFO */
    struct eng_req *wait_head, *wait_tail;
    uint64_t n_waiting;
    /* FORWARDs of T = 0, answered by the next on_async */
    struct eng_req *empty_head, *empty_tail;
    /* batches at the backend */
    uint32_t outstanding;
    uint64_t busy_since_ns;
    uint64_t next_seq;
    /* completion list (backend threads -> loop) */
    pthread_mutex_t done_mu;
    struct eng_batch *done_head, *done_tail;
    /* state */
    int draining;
    int failed;
    int selfcheck_done;
    void (*drain_cb)(void *);
    void (*drain_progress)(void *);
    void *drain_arg;
    struct moed_status_cache status_cache; /* STATUS frames (moed_status_json_cached) */
    void (*fail_cb)(void *);
    void *fail_arg;
    /* health watch: a backend can fail while idle (stalled kernel, sticky
     * device error) with no batch to report it */
    uv_timer_t health_timer;
    int health_timer_on;
    /* doorbell channels closed and not yet quiet: polled every
     * CHAN_REAP_POLL_MS while any drains (moed_desc_chan_reap) */
    uv_timer_t chan_timer;
    int chan_timer_on, chan_timer_running;
    /* engine.loop_spin_us: while batches are at a backend whose batches come
     * back in microseconds, and for spin_ns after the last one, the loop
     * polls without sleeping (an idle handle) */
    uv_idle_t spin;
    uint64_t spin_ns, spin_last_ns, spin_round_ns; /* spin_ns 0: off */
    int spin_on, spinning;
    int attached;             /* moed_engine_attach ran: handles to close */
    int closes_pending;       /* handles still to close before freeing */
    uint64_t hb_last, hb_changed_ns;
    const struct moed_server *srv; /* its counters go into the stats (NULL: none) */
};

#define HEALTH_POLL_MS 250
#define CHAN_REAP_POLL_MS 1
#define STATUS_CACHE_MS 100 /* a STATUS frame body is at most this old (same counters) */

static inline uint64_t now_ns(void) { return uv_hrtime(); }

struct eng_batch *batch_alloc(struct moed_engine *e, uint32_t layer, uint32_t T);
void batch_free(struct moed_engine *e, struct eng_batch *eb);
void busy_begin(struct moed_engine *e);
void busy_end(struct moed_engine *e);
void maybe_drained(struct moed_engine *e);
void on_async(uv_async_t *h);
void on_backend_done(void *ctx, struct moed_batch *b);
void req_fail(struct moed_engine *e, struct eng_req *r, int code, const char *msg);

#endif
