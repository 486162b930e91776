/* status.c - latency histogram and the /status (JSON) and /metrics
 * (Prometheus text 0.0.4) renderers of struct moed_stats.
 *
 * Everything here runs on the event-loop thread over a struct the engine
 * owns; the renderers only read it. Every field and metric is documented in
 * docs/STATUS.md: keep the two in step.
 */
#include "stats.h"

#include "moed_sbuf.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "status_int.h"

/* Buckets per octave; see the MOED_LAT_BUCKETS comment in stats.h. */
#define LAT_PER_OCTAVE 3

/* Prometheus gets every bucket bound (1 us .. 1.66 s, 26 % apart): fine
 * enough to read 5-500 us (a GPU decode step) and 1-50 ms (a CPU forward)
 * with histogram_quantile(). */

/* Upper bound of bucket i in microseconds, 2^(i/3); the overflow bucket has
 * none and reports its lower bound 2^(62/3). */
static double bucket_upper_us(int i)
{
    if (i < 0)
        i = 0;
    if (i > MOED_LAT_BUCKETS - 2)
        i = MOED_LAT_BUCKETS - 2;
    return exp2((double)i / LAT_PER_OCTAVE);
}

static int lat_bucket(double us)
{
    if (!(us > 1.0)) /* also catches NaN and negatives */
        return 0;
    int i = (int)ceil(LAT_PER_OCTAVE * log2(us));
    /* log2 may land a hair off an exact bound; settle on the bound itself so
     * that `us <= upper(i)` and `us > upper(i-1)` hold exactly. */
    if (i > MOED_LAT_BUCKETS - 1)
        i = MOED_LAT_BUCKETS - 1;
    while (i > 0 && us <= bucket_upper_us(i - 1))
        i--;
    while (i < MOED_LAT_BUCKETS - 1 && us > bucket_upper_us(i))
        i++;
    return i;
}

void moed_stats_record_latency(struct moed_stats *s, double us)
{
    if (!(us >= 0.0)) /* NaN or negative: a clock glitch, count it as 0 */
        us = 0.0;
    s->lat_hist[lat_bucket(us)]++;
    s->lat_count++;
    s->lat_sum_us += us;
}

double moed_stats_latency_pct(const struct moed_stats *s, double p)
{
    uint64_t total = 0;
    for (int i = 0; i < MOED_LAT_BUCKETS; i++)
        total += s->lat_hist[i];
    if (total == 0)
        return 0.0;
    if (!(p > 0.0))
        p = 0.0;
    if (p > 1.0)
        p = 1.0;
    uint64_t rank = (uint64_t)ceil(p * (double)total);
    if (rank < 1)
        rank = 1;
    if (rank > total)
        rank = total;
    uint64_t seen = 0;
    for (int i = 0; i < MOED_LAT_BUCKETS; i++) {
        seen += s->lat_hist[i];
        if (seen >= rank)
            return bucket_upper_us(i);
    }
    return bucket_upper_us(MOED_LAT_BUCKETS - 1);
}

/* ---------------------------------------------------------- stages */

static const char *const stage_names[MOED_STAGE__COUNT] = {
    [MOED_STAGE_RECV] = "recv",       [MOED_STAGE_SUBMIT] = "submit",
    [MOED_STAGE_BACKEND] = "backend", [MOED_STAGE_REPLY] = "reply",
    [MOED_STAGE_WRITE] = "write",     [MOED_STAGE_TOTAL] = "total",
    [MOED_STAGE_ADDED] = "added",     [MOED_STAGE_KERNEL] = "kernel",
    [MOED_STAGE_ADDED_KERNEL] = "added_kernel",
};

const char *moed_stage_name(enum moed_stage st)
{
    return (unsigned)st < MOED_STAGE__COUNT ? stage_names[st] : "?";
}

static uint64_t span(uint64_t from, uint64_t to) { return to > from ? to - from : 0; }

uint64_t moed_stats_stage_samples(const struct moed_stats *s, enum moed_stage st)
{
    return st >= MOED_STAGE_KERNEL ? s->stage_kernel_count : s->stage_count;
}

/* Samples in a stage's window: its last min(samples, MOED_STAGE_WINDOW). */
static size_t stage_window(const struct moed_stats *s, enum moed_stage st)
{
    uint64_t n = moed_stats_stage_samples(s, st);
    return n < MOED_STAGE_WINDOW ? (size_t)n : MOED_STAGE_WINDOW;
}

void moed_stats_record_stages(struct moed_stats *s, const struct moed_req_times *t,
                              uint64_t written_ns)
{
    uint64_t d[MOED_STAGE__COUNT];
    d[MOED_STAGE_RECV] = span(t->rx_ns, t->complete_ns);
    d[MOED_STAGE_SUBMIT] = span(t->complete_ns, t->submit_ns);
    d[MOED_STAGE_BACKEND] = span(t->submit_ns, t->done_ns);
    d[MOED_STAGE_REPLY] = span(t->done_ns, t->reply_ns);
    d[MOED_STAGE_WRITE] = span(t->reply_ns, written_ns);
    d[MOED_STAGE_TOTAL] = span(t->rx_ns, written_ns);
    d[MOED_STAGE_ADDED] = span(d[MOED_STAGE_BACKEND], d[MOED_STAGE_TOTAL]);
    d[MOED_STAGE_KERNEL] = t->kernel_ns;
    d[MOED_STAGE_ADDED_KERNEL] = span(t->kernel_ns, d[MOED_STAGE_TOTAL]);
    /* without a kernel time the kernel stages get no sample (not a 0) */
    int n = t->kernel_ns ? MOED_STAGE__COUNT : MOED_STAGE_KERNEL;
    for (int i = 0; i < n; i++) {
        uint64_t slot = moed_stats_stage_samples(s, (enum moed_stage)i) % MOED_STAGE_WINDOW;
        s->stage_sum_ns[i] += d[i];
        s->stage_win[i][slot] = d[i] > UINT32_MAX ? UINT32_MAX : (uint32_t)d[i];
        s->stage_hist[i][lat_bucket((double)d[i] / 1000.0)]++;
    }
    s->stage_count++;
    s->stage_kernel_count += t->kernel_ns != 0;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* The window of one stage, sorted; returns how many samples it holds. */
static size_t stage_sorted(const struct moed_stats *s, enum moed_stage st,
                           uint32_t out[MOED_STAGE_WINDOW])
{
    size_t n = stage_window(s, st);
    memcpy(out, s->stage_win[st], n * sizeof *out);
    qsort(out, n, sizeof *out, cmp_u32);
    return n;
}

/* Order statistic of rank ceil(p * n) of sorted samples, in microseconds. */
static double sorted_pct_us(const uint32_t *v, size_t n, double p)
{
    if (n == 0)
        return 0.0;
    if (!(p > 0.0))
        p = 0.0;
    if (p > 1.0)
        p = 1.0;
    size_t rank = (size_t)ceil(p * (double)n);
    if (rank < 1)
        rank = 1;
    return (double)v[rank - 1] / 1000.0;
}

double moed_stats_stage_pct(const struct moed_stats *s, enum moed_stage st, double p)
{
    if ((unsigned)st >= MOED_STAGE__COUNT)
        return 0.0;
    uint32_t v[MOED_STAGE_WINDOW];
    size_t n = stage_sorted(s, st, v);
    return sorted_pct_us(v, n, p);
}

static double uptime_s(const struct moed_stats *s, uint64_t now_ns)
{
    return now_ns > s->start_ns ? (double)(now_ns - s->start_ns) / 1e9 : 0.0;
}

/* busy_ns over uptime, clamped to [0, 1] (busy time is sampled by the engine
 * and may run a little ahead of the clock read here). */
static double busy_fraction(const struct moed_stats *s, uint64_t now_ns)
{
    if (now_ns <= s->start_ns)
        return 0.0;
    double f = (double)s->busy_ns / (double)(now_ns - s->start_ns);
    return f > 1.0 ? 1.0 : f;
}

static int have_kernel(const struct moed_stats *s)
{
    return s->heartbeat != 0 || (s->backend && strcmp(s->backend, "cuda") == 0);
}

/* ---------------------------------------------------------------- JSON */

/* cJSON numbers are doubles: exact for counts up to 2^53, which no counter
 * here reaches in practice. */
int moed_status_jnum(cJSON *obj, const char *key, double v)
{
    return cJSON_AddNumberToObject(obj, key, v) ? 0 : -1;
}

static int jstr(cJSON *obj, const char *key, const char *v)
{
    if (!v)
        return cJSON_AddNullToObject(obj, key) ? 0 : -1;
    return cJSON_AddStringToObject(obj, key, v) ? 0 : -1;
}

static int json_model(cJSON *root, const struct moed_stats *s)
{
    cJSON *m = cJSON_AddObjectToObject(root, "model");
    if (!m || jstr(m, "path", s->model_path))
        return -1;
    const struct moed_dims *d = s->dims;
    if (!d) { /* still loading: the shape is not known yet */
        static const char *const keys[] = {"family", "hidden", "inter", "n_experts", "top_k",
                                           "n_shared", "n_layers", "n_moe_layers"};
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
            if (!cJSON_AddNullToObject(m, keys[i]))
                return -1;
        return 0;
    }
    char family[sizeof d->family + 1];
    memcpy(family, d->family, sizeof d->family);
    family[sizeof d->family] = '\0'; /* never trust a fixed array to be terminated */
    if (jstr(m, "family", family) || jnum(m, "hidden", d->hidden) || jnum(m, "inter", d->inter) ||
        jnum(m, "n_experts", d->n_experts) || jnum(m, "top_k", d->top_k) ||
        jnum(m, "n_shared", d->n_shared) || jnum(m, "n_layers", d->n_layers) ||
        jnum(m, "n_moe_layers", d->n_moe_layers))
        return -1;
    return 0;
}

/* Bucket bounds are irrational (2^(i/3)); round up to 0.01 us so the JSON
 * stays readable and the value is still an upper bound. */
static double pct_json(const struct moed_stats *s, double p)
{
    return ceil(moed_stats_latency_pct(s, p) * 100.0) / 100.0;
}

/* stages_us: {count, window, <stage>: {p50, p99, mean}}; the kernel stages,
 * sampled only for some requests, carry their own {count, window} too. */
static int json_stages(cJSON *root, const struct moed_stats *s)
{
    cJSON *o = cJSON_AddObjectToObject(root, "stages_us");
    if (!o || jnum(o, "count", (double)s->stage_count) ||
        jnum(o, "window", (double)stage_window(s, MOED_STAGE_RECV)))
        return -1;
    for (int i = 0; i < MOED_STAGE__COUNT; i++) {
        uint32_t v[MOED_STAGE_WINDOW];
        size_t n = stage_sorted(s, (enum moed_stage)i, v);
        uint64_t cnt = moed_stats_stage_samples(s, (enum moed_stage)i);
        double mean = cnt ? (double)s->stage_sum_ns[i] / 1000.0 / (double)cnt : 0.0;
        cJSON *st = cJSON_AddObjectToObject(o, stage_names[i]);
        if (!st || (i >= MOED_STAGE_KERNEL &&
                    (jnum(st, "count", (double)cnt) || jnum(st, "window", (double)n))))
            return -1;
        if (jnum(st, "p50", sorted_pct_us(v, n, 0.50)) ||
            jnum(st, "p99", sorted_pct_us(v, n, 0.99)) || jnum(st, "mean", mean))
            return -1;
    }
    return 0;
}

static uint32_t hit_layers(const struct moed_stats *s)
{
    return s->expert_hits ? (s->n_hit_layers ? s->n_hit_layers : 1) : 0;
}

/* One row of counts as a JSON array of entries [from, to). */
static cJSON *json_row(const uint64_t *v, uint32_t from, uint32_t to)
{
    cJSON *a = cJSON_CreateArray();
    for (uint32_t i = from; a && i < to; i++) {
        cJSON *n = cJSON_CreateNumber((double)v[i]);
        if (!n) {
            cJSON_Delete(a);
            return NULL;
        }
        cJSON_AddItemToArray(a, n);
    }
    return a;
}

/* experts: hits (per expert, summed over layers: routed then shared) and the
 * per-layer counts in the layout of SGLang's expert-distribution dump:
 * logical_count [num_layers][num_logical_experts] by absolute layer, routed
 * experts only; shared_count [num_layers][n_shared] beside it. */
static int json_experts(cJSON *root, const struct moed_stats *s)
{
    cJSON *x = cJSON_AddObjectToObject(root, "experts");
    cJSON *hits = x ? cJSON_AddArrayToObject(x, "hits") : NULL;
    if (!hits)
        return -1;
    uint32_t nl = hit_layers(s), ne = s->n_expert_hits;
    for (uint32_t i = 0; i < ne && nl; i++) {
        uint64_t sum = 0;
        for (uint32_t l = 0; l < nl; l++)
            sum += s->expert_hits[(size_t)l * ne + i];
        cJSON *n = cJSON_CreateNumber((double)sum);
        if (!n)
            return -1;
        cJSON_AddItemToArray(hits, n);
    }
    uint32_t routed = s->dims ? s->dims->n_experts : ne;
    if (routed > ne)
        routed = ne;
    if (jnum(x, "num_layers", nl) || jnum(x, "num_logical_experts", routed))
        return -1;
    cJSON *lc = cJSON_AddArrayToObject(x, "logical_count");
    cJSON *sc = cJSON_AddArrayToObject(x, "shared_count");
    if (!lc || !sc)
        return -1;
    for (uint32_t l = 0; l < nl; l++) {
        const uint64_t *row = s->expert_hits + (size_t)l * ne;
        cJSON *a = json_row(row, 0, routed), *b = json_row(row, routed, ne);
        if (!a || !b) {
            cJSON_Delete(a);
            cJSON_Delete(b);
            return -1;
        }
        cJSON_AddItemToArray(lc, a);
        cJSON_AddItemToArray(sc, b);
    }
    return 0;
}

static int json_body(cJSON *root, const struct moed_stats *s, uint64_t now_ns)
{
    double up = uptime_s(s, now_ns);
    if (jstr(root, "version", s->version) || jnum(root, "uptime_s", up) || json_model(root, s))
        return -1;

    cJSON *b = cJSON_AddObjectToObject(root, "backend");
    char desc[sizeof s->backend_desc + 1];
    memcpy(desc, s->backend_desc, sizeof s->backend_desc);
    desc[sizeof s->backend_desc] = '\0';
    if (!b || jstr(b, "name", s->backend ? s->backend : "") || jstr(b, "description", desc) ||
        !cJSON_AddBoolToObject(b, "healthy", s->healthy != 0))
        return -1;

    cJSON *l = cJSON_AddObjectToObject(root, "load");
    double frac = s->load_total ? (double)s->load_done / (double)s->load_total : 0.0;
    if (s->loaded)
        frac = 1.0;
    if (frac > 1.0)
        frac = 1.0;
    if (!l || !cJSON_AddBoolToObject(l, "loaded", s->loaded != 0) ||
        jnum(l, "done_bytes", (double)s->load_done) ||
        jnum(l, "total_bytes", (double)s->load_total) || jnum(l, "fraction", frac) ||
        (s->load_phase && !s->loaded ? jstr(l, "phase", s->load_phase) != 0
                                     : !cJSON_AddNullToObject(l, "phase")))
        return -1;

    cJSON *c = cJSON_AddObjectToObject(root, "clients");
    if (!c || jnum(c, "connected", s->clients) || jnum(c, "total", (double)s->clients_total) ||
        jnum(c, "refused", (double)s->clients_refused))
        return -1;

    cJSON *r = cJSON_AddObjectToObject(root, "requests");
    if (!r || jnum(r, "served", (double)s->requests) || jnum(r, "tokens", (double)s->tokens) ||
        jnum(r, "in_flight", (double)s->in_flight))
        return -1;
    cJSON *e = cJSON_AddObjectToObject(r, "errors");
    if (!e)
        return -1;
    for (int i = 1; i < MOED_E__COUNT; i++) /* errors[0] would be MOED_OK */
        if (s->errors[i] && jnum(e, moed_errname(-i), (double)s->errors[i]))
            return -1;

    cJSON *lat = cJSON_AddObjectToObject(root, "latency_us");
    double mean = s->lat_count ? s->lat_sum_us / (double)s->lat_count : 0.0;
    if (!lat || jnum(lat, "p50", pct_json(s, 0.50)) || jnum(lat, "p99", pct_json(s, 0.99)) ||
        jnum(lat, "p999", pct_json(s, 0.999)) || jnum(lat, "mean", mean) ||
        jnum(lat, "count", (double)s->lat_count))
        return -1;

    if (json_stages(root, s))
        return -1;

    cJSON *bt = cJSON_AddObjectToObject(root, "batches");
    double mean_tok = s->batches ? (double)s->batch_tokens / (double)s->batches : 0.0;
    if (!bt || jnum(bt, "count", (double)s->batches) || jnum(bt, "mean_tokens", mean_tok))
        return -1;

    if (jnum(root, "busy_fraction", busy_fraction(s, now_ns)))
        return -1;

    cJSON *ls = cJSON_AddObjectToObject(root, "loop_spin");
    if (!ls || jnum(ls, "us", (double)s->loop_spin_us) ||
        jnum(ls, "seconds", (double)s->loop_spin_ns / 1e9))
        return -1;

    cJSON *hb = cJSON_AddObjectToObject(root, "buffers");
    if (!hb || jnum(hb, "pinned_bytes", (double)s->pinned_bytes) ||
        jnum(hb, "pinned_free_bytes", (double)s->pinned_free_bytes) ||
        jnum(hb, "pinned_limit_bytes", (double)s->pinned_limit) ||
        jnum(hb, "pinned_allocations", (double)s->pinned_allocs) ||
        jnum(hb, "spare_bytes", (double)s->spare_bytes))
        return -1;

    if (moed_status_json_zero_copy(root, s))
        return -1;

    if (json_experts(root, s))
        return -1;

    if (!have_kernel(s))
        return cJSON_AddNullToObject(root, "kernel") ? 0 : -1;
    cJSON *k = cJSON_AddObjectToObject(root, "kernel");
    if (!k || jnum(k, "heartbeat", (double)s->heartbeat) ||
        jnum(k, "heartbeat_age_ms", (double)s->heartbeat_age_ms))
        return -1;
    return 0;
}

char *moed_status_json(const struct moed_stats *s, uint64_t now_ns)
{
    char *out = NULL;
    cJSON *root = cJSON_CreateObject();
    if (!root)
        goto out;
    if (json_body(root, s, now_ns))
        goto free_root;
    out = cJSON_PrintUnformatted(root);
free_root:
    cJSON_Delete(root);
out:
    return out;
}

/* ------------------------------------------------ STATUS frame, cached */

/* The counters a client can see move (a request served, a client come or
 * gone, an error): a cached body whose key differs is rendered again, so a
 * client reads its own effect at once; only a flood that changes nothing is
 * served from the cache, for up to max_age_ns. */
static uint64_t status_key(const struct moed_stats *s)
{
    uint64_t k = s->requests * 31 + s->in_flight;
    k = k * 31 + s->batches;
    k = k * 31 + s->stage_count;
    k = k * 31 + s->clients;
    k = k * 31 + s->clients_total;
    k = k * 31 + s->clients_refused;
    k = k * 31 + (uint64_t)s->loaded * 2 + (uint64_t)s->healthy;
    for (int i = 0; i < MOED_E__COUNT; i++)
        k = k * 31 + s->errors[i];
    return k;
}

const char *moed_status_json_cached(struct moed_status_cache *sc, const struct moed_stats *s,
                                    uint64_t now_ns, uint64_t max_age_ns, size_t *len)
{
    uint64_t key = status_key(s);
    if (!sc->body || key != sc->key || now_ns - sc->at_ns > max_age_ns) {
        char *js = moed_status_json(s, now_ns);
        if (!js)
            return NULL;
        free(sc->body);
        sc->body = js;
        sc->len = strlen(js);
        sc->at_ns = now_ns;
        sc->key = key;
    }
    *len = sc->len;
    return sc->body;
}

void moed_status_cache_free(struct moed_status_cache *sc)
{
    free(sc->body);
    sc->body = NULL;
}

/* ---------------------------------------------------------- Prometheus */

/* Text is built in a struct moed_sbuf (common/moed_sbuf.h). */

/* Label values escape backslash, double quote and newline (format 0.0.4). */
static void sb_label(struct moed_sbuf *b, const char *v)
{
    for (; v && *v; v++) {
        if (*v == '\\')
            moed_sb_printf(b, "\\\\");
        else if (*v == '"')
            moed_sb_printf(b, "\\\"");
        else if (*v == '\n')
            moed_sb_printf(b, "\\n");
        else
            moed_sb_printf(b, "%c", *v);
    }
}

void moed_status_sb_head(struct moed_sbuf *b, const char *name, const char *type, const char *help)
{
    moed_sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sb_double(struct moed_sbuf *b, double v)
{
    if (isnan(v))
        moed_sb_printf(b, "NaN");
    else if (isinf(v))
        moed_sb_printf(b, v > 0 ? "+Inf" : "-Inf");
    else
        moed_sb_printf(b, "%.9g", v);
}

void moed_status_prom_u64(struct moed_sbuf *b, const char *name, const char *type,
                          const char *help, uint64_t v)
{
    sb_head(b, name, type, help);
    moed_sb_printf(b, "%s %" PRIu64 "\n", name, v);
}

void moed_status_prom_dbl(struct moed_sbuf *b, const char *name, const char *type,
                          const char *help, double v)
{
    sb_head(b, name, type, help);
    moed_sb_printf(b, "%s ", name);
    sb_double(b, v);
    moed_sb_printf(b, "\n");
}

/* The samples of one histogram (latency buckets, us) with `labels` (e.g.
 * `stage="recv",`; "" for none); _count is the +Inf bucket by construction. */
static void prom_hist_series(struct moed_sbuf *b, const char *n, const char *labels,
                             const uint64_t hist[MOED_LAT_BUCKETS], double sum_s)
{
    uint64_t cum = 0;
    for (int i = 0; i < MOED_LAT_BUCKETS - 1; i++) {
        cum += hist[i];
        moed_sb_printf(b, "%s_bucket{%sle=\"", n, labels);
        sb_double(b, bucket_upper_us(i) / 1e6);
        moed_sb_printf(b, "\"} %" PRIu64 "\n", cum);
    }
    cum += hist[MOED_LAT_BUCKETS - 1];
    moed_sb_printf(b, "%s_bucket{%sle=\"+Inf\"} %" PRIu64 "\n", n, labels, cum);
    size_t ll = strlen(labels);
    /* _sum/_count take the labels without the trailing comma */
    moed_sb_printf(b, "%s_sum%s%.*s%s ", n, ll ? "{" : "", ll ? (int)ll - 1 : 0, labels,
              ll ? "}" : "");
    sb_double(b, sum_s);
    moed_sb_printf(b, "\n%s_count%s%.*s%s %" PRIu64 "\n", n, ll ? "{" : "", ll ? (int)ll - 1 : 0,
              labels, ll ? "}" : "", cum);
}

static void prom_latency(struct moed_sbuf *b, const struct moed_stats *s)
{
    const char *n = "moed_request_latency_seconds";
    sb_head(b, n, "histogram", "FORWARD latency, frame complete to reply queued.");
    prom_hist_series(b, n, "", s->lat_hist, s->lat_sum_us / 1e6);
}

/* One histogram per stage (label stage): aggregatable across instances, for
 * histogram_quantile(); /status keeps the exact window percentiles. */
static void prom_stages(struct moed_sbuf *b, const struct moed_stats *s)
{
    const char *n = "moed_request_stage_seconds";
    sb_head(b, n, "histogram",
            "Time of each stage of a FORWARD request (answered OK, reply fully written); the "
            "kernel stages only for batches whose kernel time is known.");
    for (int i = 0; i < MOED_STAGE__COUNT; i++) {
        char labels[48];
        snprintf(labels, sizeof labels, "stage=\"%s\",", stage_names[i]);
        prom_hist_series(b, n, labels, s->stage_hist[i], (double)s->stage_sum_ns[i] / 1e9);
    }
}

/* process_* metrics of the Prometheus client conventions, from /proc/self. */
static void prom_process(struct moed_sbuf *b)
{
    long tck = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    /* fields after the command (which may hold spaces): from the last ')' */
    const char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0, start = 0, vsize = 0, rss = 0;
    int ok = p && tck > 0 &&
             sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d "
                           "%*d %*d %*d %llu %llu %llu", &ut, &st, &start, &vsize, &rss) == 5;
    if (ok) {
        prom_dbl(b, "process_cpu_seconds_total", "counter",
                 "Total user and system CPU time spent in seconds.",
                 (double)(ut + st) / (double)tck);
        prom_u64(b, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
                 vsize);
        prom_u64(b, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
                 rss * (unsigned long long)(page > 0 ? page : 4096));
        unsigned long long btime = 0;
        FILE *fs = fopen("/proc/stat", "r");
        char line[256];
        while (fs && fgets(line, sizeof line, fs))
            if (sscanf(line, "btime %llu", &btime) == 1)
                break;
        if (fs)
            fclose(fs);
        if (btime)
            prom_dbl(b, "process_start_time_seconds", "gauge",
                     "Start time of the process since unix epoch in seconds.",
                     (double)btime + (double)start / (double)tck);
    }
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        uint64_t fds = 0;
        for (struct dirent *e; (e = readdir(d));)
            fds += e->d_name[0] != '.';
        closedir(d);
        prom_u64(b, "process_open_fds", "gauge", "Number of open file descriptors.",
                 fds ? fds - 1 : 0); /* less the one opendir holds */
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        prom_u64(b, "process_max_fds", "gauge", "Maximum number of open file descriptors.",
                 (uint64_t)rl.rlim_cur);
}

/* moed_expert_hits_total{layer,expert}: tokens routed to each expert of each
 * layer (routed experts, then shared), for the layers that have had any (a
 * series appears with a layer's first request). */
static void prom_experts(struct moed_sbuf *b, const struct moed_stats *s)
{
    uint32_t nl = hit_layers(s), ne = s->n_expert_hits;
    if (!nl || !ne)
        return;
    sb_head(b, "moed_expert_hits_total", "counter",
            "Tokens routed to each expert (routed experts, then shared) of each MoE layer "
            "(the checkpoint's layer index) that has had requests.");
    for (uint32_t l = 0; l < nl; l++) {
        const uint64_t *row = s->expert_hits + (size_t)l * ne;
        uint64_t any = 0;
        for (uint32_t i = 0; i < ne; i++)
            any |= row[i];
        for (uint32_t i = 0; any && i < ne; i++)
            moed_sb_printf(b, "moed_expert_hits_total{layer=\"%" PRIu32 "\",expert=\"%" PRIu32
                         "\"} %" PRIu64 "\n", l, i, row[i]);
    }
}

char *moed_status_prometheus(const struct moed_stats *s, uint64_t now_ns)
{
    struct moed_sbuf b = {0};

    sb_head(&b, "moed_build_info", "gauge", "Always 1; labels carry the version and backend.");
    moed_sb_printf(&b, "moed_build_info{version=\"");
    sb_label(&b, s->version);
    moed_sb_printf(&b, "\",backend=\"");
    sb_label(&b, s->backend);
    moed_sb_printf(&b, "\"} 1\n");
    if (s->dims) {
        char family[sizeof s->dims->family + 1];
        memcpy(family, s->dims->family, sizeof s->dims->family);
        family[sizeof s->dims->family] = '\0';
        sb_head(&b, "moed_model_info", "gauge", "Always 1; labels name the loaded model.");
        moed_sb_printf(&b, "moed_model_info{family=\"");
        sb_label(&b, family);
        moed_sb_printf(&b, "\",path=\"");
        sb_label(&b, s->model_path);
        moed_sb_printf(&b, "\",n_experts=\"%" PRIu32 "\",top_k=\"%" PRIu32 "\",n_moe_layers=\"%" PRIu32
                      "\"} 1\n",
                  s->dims->n_experts, s->dims->top_k, s->dims->n_moe_layers);
    }
    prom_dbl(&b, "moed_uptime_seconds", "gauge", "Seconds since the daemon started.",
             uptime_s(s, now_ns));
    prom_u64(&b, "moed_loaded", "gauge", "1 once the model is loaded and self-checked.",
             s->loaded ? 1 : 0);
    prom_u64(&b, "moed_healthy", "gauge", "1 while the backend reports healthy.",
             s->healthy ? 1 : 0);
    prom_u64(&b, "moed_load_done_bytes", "gauge", "Checkpoint bytes loaded so far.",
             s->load_done);
    prom_u64(&b, "moed_load_total_bytes", "gauge", "Checkpoint bytes to load.", s->load_total);
    prom_u64(&b, "moed_clients", "gauge", "Clients connected now.", s->clients);
    prom_u64(&b, "moed_clients_accepted_total", "counter", "Clients accepted since start.",
             s->clients_total);
    prom_u64(&b, "moed_clients_refused_total", "counter",
             "Clients refused (limit, permission) since start.", s->clients_refused);
    prom_u64(&b, "moed_requests_total", "counter", "FORWARD requests answered OK.", s->requests);
    prom_u64(&b, "moed_tokens_total", "counter", "Tokens in the FORWARD requests answered OK.",
             s->tokens);
    prom_u64(&b, "moed_requests_in_flight", "gauge",
             "FORWARD requests accepted and not yet answered.", s->in_flight);

    sb_head(&b, "moed_errors_total", "counter", "Error replies sent, by error code name.");
    for (int i = 1; i < MOED_E__COUNT; i++)
        moed_sb_printf(&b, "moed_errors_total{code=\"%s\"} %" PRIu64 "\n", moed_errname(-i),
                  s->errors[i]);

    prom_latency(&b, s);

    prom_stages(&b, s);

    prom_u64(&b, "moed_batches_total", "counter", "Batches run by the backend.", s->batches);
    prom_u64(&b, "moed_batch_tokens_total", "counter", "Tokens summed over all batches.",
             s->batch_tokens);
    prom_dbl(&b, "moed_busy_seconds_total", "counter",
             "Seconds with at least one batch queued or running.",
             (double)s->busy_ns / 1e9);
    prom_dbl(&b, "moed_busy_fraction", "gauge",
             "busy_seconds / uptime_seconds since start (0..1).",
             busy_fraction(s, now_ns));
    prom_dbl(&b, "moed_loop_spin_seconds_total", "counter",
             "Seconds the event loop polled without sleeping around GPU batches "
             "(engine.loop_spin_us).",
             (double)s->loop_spin_ns / 1e9);

    prom_u64(&b, "moed_buffer_pinned_bytes", "gauge",
             "Backend host memory (CUDA: pinned) held for buffers used in place.",
             s->pinned_bytes);
    prom_u64(&b, "moed_buffer_pinned_free_bytes", "gauge",
             "Of that, bytes kept free for reuse.", s->pinned_free_bytes);
    prom_u64(&b, "moed_buffer_pinned_limit_bytes", "gauge",
             "Cap on pinned buffer bytes (server.pinned_pool_bytes).", s->pinned_limit);
    prom_u64(&b, "moed_buffer_pinned_allocations_total", "counter",
             "Pinned buffers allocated from the backend since start.", s->pinned_allocs);
    prom_u64(&b, "moed_buffer_spare_bytes", "gauge",
             "Ordinary memory kept as spare buffers for reuse.", s->spare_bytes);
    moed_status_prom_zero_copy(&b, s);

    prom_experts(&b, s);

    if (have_kernel(s)) {
        prom_u64(&b, "moed_kernel_heartbeats_total", "counter",
                 "Persistent-kernel heartbeats (advances while the kernel runs).",
                 s->heartbeat);
        prom_dbl(&b, "moed_kernel_heartbeat_age_seconds", "gauge",
                 "Seconds since the heartbeat last advanced.",
                 (double)s->heartbeat_age_ms / 1e3);
    }

    prom_process(&b);

    if (b.oom) {
        free(b.s);
        return NULL;
    }
    if (!b.s) /* nothing written cannot happen, but never return NULL for success */
        return calloc(1, 1);
    return b.s;
}
