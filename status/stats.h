/* stats.h - the numbers moed reports in /status, /metrics and STATUS.
 *
 * Written only by the event-loop thread (the engine and server), read by the
 * status renderers on the same thread: no locking. Backend figures that other
 * threads update (heartbeat, busy time) are copied in by the engine before a
 * status is rendered.
 */
#ifndef MOED_STATS_H
#define MOED_STATS_H

#include <stdint.h>

#include "moed_err.h"
#include "model.h"
#include "server.h"

/* Latency histogram: 3 buckets per octave (each ~26 % wide, so a percentile
 * read from it is within one bucket, +26 %, of the exact value), from 1 us to
 * about 1.7 s, which covers a GPU decode step (tens of us) up to a slow CPU
 * reference forward:
 *   bucket 0      : us <= 1
 *   bucket i      : 2^((i-1)/3) < us <= 2^(i/3)      (1 <= i <= 62)
 *   bucket 63     : us > 2^(62/3) (~1.66 s; overflow)
 * Upper bounds are inclusive so they map directly onto Prometheus `le`. */
#define MOED_LAT_BUCKETS 64
#define MOED_STATS_MAX_CHANS 64 /* channels /status lists (MOE_GPU_MAX_CHANS) */

/* Where a FORWARD request's time goes, stage by stage, so that the latency
 * the socket path adds on top of the backend can be read on any backend.
 * Each stage runs from one timestamp (CLOCK_MONOTONIC, ns) to the next:
 *   RECV     first byte of the frame read -> frame complete
 *   SUBMIT   frame complete -> its batch handed to the backend (validation,
 *            copies, waiting for a backend slot and for other requests)
 *   BACKEND  handed to the backend -> the backend's done callback
 *   REPLY    done callback -> reply frame handed to the socket write (loop
 *            wake-up, reply built)
 *   WRITE    handed to the write -> last byte written into the socket
 *   TOTAL    first byte read -> last byte written
 *   ADDED    TOTAL - BACKEND of the same request: what the daemon adds
 * and, only for requests whose batch's kernel time the backend reported
 * (moed_batch.kernel_ns: CUDA; never the CPU backend unless a test asks):
 *   KERNEL        the GPU kernel's time for the request's batch (inside BACKEND)
 *   ADDED_KERNEL  TOTAL - KERNEL of the same request: what the socket path
 *                 and the backend's dispatch and completion add over the kernel
 * Only requests answered OK whose reply was written completely are timed. The
 * kernel stages (from MOED_STAGE_KERNEL on) have fewer samples than the
 * others: they keep their own count (moed_stats_stage_samples). */
enum moed_stage {
    MOED_STAGE_RECV = 0,
    MOED_STAGE_SUBMIT,
    MOED_STAGE_BACKEND,
    MOED_STAGE_REPLY,
    MOED_STAGE_WRITE,
    MOED_STAGE_TOTAL,
    MOED_STAGE_ADDED,
    MOED_STAGE_KERNEL,       /* first stage sampled only with a known kernel time */
    MOED_STAGE_ADDED_KERNEL,
    MOED_STAGE__COUNT
};

/* Percentiles of the stages are exact order statistics over the last
 * MOED_STAGE_WINDOW timed requests (a histogram's 26 % buckets are too coarse
 * to see tens of microseconds move on a few-hundred-microsecond request). */
#define MOED_STAGE_WINDOW 1024

/* struct moed_req_times (one request's timestamps) is the server's (server.h). */


struct moed_stats {
    /* identity */
    const char *version;
    uint64_t start_ns;          /* CLOCK_MONOTONIC at start */
    const struct moed_dims *dims; /* NULL until the model is loaded */
    const char *model_path;
    const char *backend;        /* "cpu" / "cuda" / "" while loading */
    char backend_desc[512];     /* devices, memory (backend describe()) */
    /* load */
    int loaded;                 /* 1 once the model is loaded and self-check passed */
    int healthy;                /* backend healthy (0 -> /healthz 503) */
    uint64_t load_done, load_total; /* bytes of the current phase */
    const char *load_phase;     /* "checkpoint", "placing weights", NULL when loaded */
    /* clients and traffic */
    uint32_t clients;           /* connected now */
    uint64_t clients_total;     /* accepted since start */
    uint64_t clients_refused;
    uint64_t requests;          /* FORWARD requests answered OK */
    uint64_t tokens;            /* tokens in those */
    uint64_t in_flight;         /* FORWARD requests accepted, not yet answered */
    uint64_t batches;
    uint64_t batch_tokens;      /* sum of batch sizes (mean = batch_tokens / batches) */
    uint64_t errors[MOED_E__COUNT]; /* error replies by -code */
    /* latency of FORWARD (frame complete -> reply queued), microseconds */
    uint64_t lat_hist[MOED_LAT_BUCKETS];
    uint64_t lat_count;
    double lat_sum_us;
    /* stage timing (see enum moed_stage): requests timed, per-stage sums
     * since start, and the last MOED_STAGE_WINDOW samples of each stage in ns
     * (saturated at UINT32_MAX, 4.29 s) as a ring written at stage_count %
     * MOED_STAGE_WINDOW (the kernel stages: stage_kernel_count %) */
    uint64_t stage_count;
    uint64_t stage_kernel_count; /* of those, with a known kernel time: the
                                    samples (and ring index) of the kernel stages */
    uint64_t stage_sum_ns[MOED_STAGE__COUNT];
    uint32_t stage_win[MOED_STAGE__COUNT][MOED_STAGE_WINDOW];
    /* every sample of each stage since start, in the latency buckets (us) */
    uint64_t stage_hist[MOED_STAGE__COUNT][MOED_LAT_BUCKETS];
    /* backend busy accounting: ns with at least one batch queued or running */
    uint64_t busy_ns;
    /* the event loop's spin around GPU batches (engine.loop_spin_us): the
     * setting, 0 when off or the backend's batches take milliseconds (CPU),
     * and the ns spent polling without sleeping since start */
    uint32_t loop_spin_us;
    uint64_t loop_spin_ns;
    /* per-layer, per-expert hits: n_hit_layers rows (row = the checkpoint's
     * absolute layer index; dense layers stay 0) of n_expert_hits entries
     * (routed experts, then shared); n_hit_layers 0 reads as one row */
    uint64_t *expert_hits;
    uint32_t n_expert_hits;
    uint32_t n_hit_layers;
    /* host buffers (ipc/bufpool.h): backend host memory (CUDA: pinned) held,
     * of it on the free lists, its cap, allocator calls, plain spares kept */
    uint64_t pinned_bytes, pinned_free_bytes, pinned_limit, pinned_allocs, spare_bytes;
    /* registered client buffers (protocol version 2; engine/desc.h) */
    uint64_t zc_registered, zc_mappings, zc_mapped_bytes, zc_registers, zc_refused,
        zc_requests;
    uint64_t zc_peer_mappings; /* of zc_mappings, memory of a peer GPU */
    /* doorbell channels (engine/desc.h): open / draining now, CHAN_OPEN
     * accepted / refused since start, descriptors served / refused and their
     * kernel ns since start; the live channels, open then draining */
    uint64_t ch_open, ch_draining, ch_opens, ch_refused, db_served, db_refused, db_kernel_ns;
    uint64_t ch_arena_bytes; /* the arenas of the open and draining channels */
    struct moed_stats_chan {
        uint32_t id, index, n_bufs, draining;
        int32_t gpu; /* the client's GPU: -1 the daemon's, else its peer ordinal */
        uint64_t arena_bytes;
        uint64_t served, refused, kernel_ns, last;
    } chans[MOED_STATS_MAX_CHANS];
    uint32_t n_chans;
    /* GPU persistent-kernel heartbeat (0 without a GPU) */
    uint64_t heartbeat;
    uint64_t heartbeat_age_ms;
};

/* Record one latency sample (microseconds; negative or NaN counts as 0). */
void moed_stats_record_latency(struct moed_stats *s, double us);
/* Percentile p (0..1) from the histogram, microseconds: the upper bound of the
 * bucket holding the sample of rank ceil(p * count) (the overflow bucket
 * reports its lower bound). 0 when there are no samples. */
double moed_stats_latency_pct(const struct moed_stats *s, double p);

/* Record the stages of one request whose reply's last byte was written at
 * written_ns. Timestamps out of order (never with a monotonic clock) count as
 * 0-length stages. The kernel stages are recorded only when t->kernel_ns > 0
 * (ADDED_KERNEL is 0 when the kernel time exceeds TOTAL). */
void moed_stats_record_stages(struct moed_stats *s, const struct moed_req_times *t,
                              uint64_t written_ns);
/* Samples of a stage since start: stage_count, or stage_kernel_count for the
 * kernel stages (MOED_STAGE_KERNEL on). */
uint64_t moed_stats_stage_samples(const struct moed_stats *s, enum moed_stage st);
/* Percentile p (0..1) of a stage over the window, microseconds: the sample of
 * rank ceil(p * n) among the stage's last n = min(samples, MOED_STAGE_WINDOW);
 * 0 with no samples. */
double moed_stats_stage_pct(const struct moed_stats *s, enum moed_stage st, double p);
/* The stage's name in /status and /metrics ("recv", "submit", ...). */
const char *moed_stage_name(enum moed_stage st);

/* Renderers (malloc'd strings, caller frees; NULL on allocation failure). */
char *moed_status_json(const struct moed_stats *s, uint64_t now_ns);
char *moed_status_prometheus(const struct moed_stats *s, uint64_t now_ns);

/* The STATUS frame's body, rendered at most once per max_age_ns while the
 * visible counters (requests, clients, errors, ...) stay the same, so that a
 * client flooding STATUS costs a copy per request, not a rendering (~0.5 ms).
 * The cache owns the body: valid until the next call or
 * moed_status_cache_free. NULL on allocation failure. */
struct moed_status_cache {
    char *body;
    size_t len;
    uint64_t at_ns, key;
};
const char *moed_status_json_cached(struct moed_status_cache *sc, const struct moed_stats *s,
                                    uint64_t now_ns, uint64_t max_age_ns, size_t *len);
void moed_status_cache_free(struct moed_status_cache *sc);

#endif
