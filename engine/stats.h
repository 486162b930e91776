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

/* Latency histogram: 3 buckets per octave (each ~26 % wide, so a percentile
 * read from it is within one bucket, +26 %, of the exact value), from 1 us to
 * about 1.7 s, which covers a GPU decode step (tens of us) up to a slow CPU
 * reference forward:
 *   bucket 0      : us <= 1
 *   bucket i      : 2^((i-1)/3) < us <= 2^(i/3)      (1 <= i <= 62)
 *   bucket 63     : us > 2^(62/3) (~1.66 s; overflow)
 * Upper bounds are inclusive so they map directly onto Prometheus `le`. */
#define MOED_LAT_BUCKETS 64

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
    /* backend busy accounting: ns with at least one batch queued or running */
    uint64_t busy_ns;
    /* per-expert hits (routed + shared), n_experts + n_shared entries */
    uint64_t *expert_hits;
    uint32_t n_expert_hits;
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

/* Renderers (malloc'd strings, caller frees; NULL on allocation failure). */
char *moed_status_json(const struct moed_stats *s, uint64_t now_ns);
char *moed_status_prometheus(const struct moed_stats *s, uint64_t now_ns);

#endif
