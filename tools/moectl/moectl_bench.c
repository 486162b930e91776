/* moectl_bench.c - `moectl bench`: closed-loop load on a running daemon
 * (connections x in-flight requests), latency percentiles, the daemon's
 * stage table and the latency it adds over a payload echo (see
 * moectl_client.c for the other commands, moectl_int.h for what they share).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "model.h"
#include "moe_ref.h"
#include "moectl.h"
#include "moectl_int.h"
#include "moed_client.h"
#include "moed_err.h"
#include "moed_log.h"
#include "moed_util.h"
#include "moed_proto.h"
#include "nvfp4.h"

/* --- bench ---------------------------------------------------------------- */

struct bench_shared {
    const struct opts *o;
    uint32_t layer;
    struct moed_hello_rep h;
    atomic_int stop;
    atomic_uint_fast64_t done, errors, failed_threads;
};

struct bench_thread {
    pthread_t tid;
    struct bench_shared *sh;
    uint32_t index;
    uint64_t *lat_ns; /* samples */
    size_t n_lat, cap_lat;
    char err[MOED_ERRLEN];
    int rc;
};

static void add_sample(struct bench_thread *t, uint64_t ns)
{
    if (t->n_lat == t->cap_lat) {
        size_t cap = t->cap_lat ? t->cap_lat * 2 : 4096;
        if (cap > MAX_SAMPLES / t->sh->o->connections + 1)
            return;
        uint64_t *p = realloc(t->lat_ns, cap * sizeof *p);
        if (!p)
            return;
        t->lat_ns = p;
        t->cap_lat = cap;
    }
    t->lat_ns[t->n_lat++] = ns;
}

/* One connection: keep K requests in flight; the request id carries the
 * slot (low 16 bits) so the send time is found however replies are ordered. */
static void *bench_worker(void *arg)
{
    struct bench_thread *t = arg;
    struct bench_shared *sh = t->sh;
    const struct opts *o = sh->o;
    struct moedc *c = NULL;
    struct batch b = {0};
    uint64_t sent_at[MAX_INFLIGHT];
    uint64_t seq = 0;
    t->rc = moedc_connect(o->socket, (int)o->timeout_ms, &c, t->err, sizeof t->err);
    if (t->rc)
        goto out;
    t->rc = moedc_hello(c, NULL, t->err, sizeof t->err);
    if (t->rc)
        goto out;
    t->rc = batch_make(&b, (uint32_t)o->tokens, &sh->h, o->seed + t->index);
    if (t->rc) {
        snprintf(t->err, sizeof t->err, "cannot build a batch");
        goto out;
    }
    for (uint32_t s = 0; s < o->inflight; s++) {
        sent_at[s] = moed_mono_ns();
        t->rc = moedc_send_forward(c, (++seq << 16) | s, sh->layer, b.T, b.k, b.x, b.ids, b.w,
                                   t->err, sizeof t->err);
        if (t->rc)
            goto out;
    }
    while (moedc_inflight(c) > 0) {
        struct moedc_reply r;
        int rc = moedc_recv(c, &r, t->err, sizeof t->err);
        uint64_t now = moed_mono_ns();
        if (rc && !r.from_daemon) {
            t->rc = rc;
            goto out;
        }
        uint32_t slot = (uint32_t)(r.request_id & 0xffff);
        if (rc) {
            atomic_fetch_add(&sh->errors, 1);
            if (r.request_id == 0) { /* a connection-level error: it will close */
                t->rc = rc;
                goto out;
            }
        } else {
            atomic_fetch_add(&sh->done, 1);
        }
        if (slot < o->inflight)
            add_sample(t, now - sent_at[slot]);
        if (atomic_load(&sh->stop) || slot >= o->inflight)
            continue;
        sent_at[slot] = moed_mono_ns();
        t->rc = moedc_send_forward(c, (++seq << 16) | slot, sh->layer, b.T, b.k, b.x, b.ids,
                                   b.w, t->err, sizeof t->err);
        if (t->rc)
            goto out;
    }
out:
    if (t->rc)
        atomic_fetch_add(&sh->failed_threads, 1);
    batch_free(&b);
    moedc_close(c);
    return NULL;
}

/* The daemon's stage timing (/status "stages_us"), fetched over a fresh
 * connection; NULL when it is unavailable (an older daemon, or an error). */
static cJSON *fetch_stages(const struct opts *o)
{
    struct moedc *c;
    char err[MOED_ERRLEN], *js = NULL;
    if (moedc_connect(o->socket, (int)o->timeout_ms, &c, err, sizeof err))
        return NULL;
    int rc = moedc_status(c, &js, err, sizeof err);
    moedc_close(c);
    if (rc)
        return NULL;
    cJSON *root = cJSON_Parse(js);
    free(js);
    cJSON *st = cJSON_DetachItemFromObjectCaseSensitive(root, "stages_us");
    cJSON_Delete(root);
    if (st && !cJSON_IsObject(st)) {
        cJSON_Delete(st);
        st = NULL;
    }
    return st;
}

static double stage_num(const cJSON *st, const char *stage, const char *key)
{
    const cJSON *o = stage ? cJSON_GetObjectItemCaseSensitive(st, stage) : st;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

/* Samples of a stage since the daemon started: the stage's own count (the
 * kernel stages, sampled only where the kernel time is known), else the
 * count of timed requests; 0 without `st`. */
static double stage_count(const cJSON *st, const char *stage)
{
    if (!st)
        return 0.0;
    double n = stage_num(st, stage, "count");
    return isnan(n) ? stage_num(st, NULL, "count") : n;
}

/* Mean of a stage over its samples taken between `before` and `after` (the
 * daemon's means are since its start: mean * count is the sum). */
static double stage_run_mean(const cJSON *before, const cJSON *after, const char *stage)
{
    double na = stage_count(after, stage), sa = stage_num(after, stage, "mean") * na;
    double nb = stage_count(before, stage), sb = nb ? stage_num(before, stage, "mean") * nb : 0;
    return na > nb ? (sa - sb) / (na - nb) : NAN;
}

/* The stages in the order printed; from "kernel" on, only requests whose
 * batch's kernel time the daemon knows are sampled (CUDA). */
static const char *const stage_names[] = {"recv",  "submit", "backend", "reply",       "write",
                                          "total", "added",  "kernel",  "added_kernel"};
#define N_PLAIN_STAGES 7 /* those before "kernel" */

/* Where the time went on the daemon's side, stage by stage: the median over
 * the daemon's window and the mean over this run's requests, then what the
 * socket path adds over the backend and, where the daemon knows the kernel's
 * time, over the kernel. The end-to-end figures subtract the daemon's mean
 * backend (kernel) time from the client's mean latency over the same
 * requests: exact when nothing else used the daemon meanwhile, and, unlike a
 * difference of medians, not swamped by a backend whose time varies. Returns
 * the figure over the kernel when this run has kernel samples, else the one
 * over the backend (NAN without stages), and which one through *what. */
static double print_stages(const cJSON *before, const cJSON *after, double client_mean_us,
                           const char **what)
{
    *what = "backend";
    if (!after)
        return NAN;
    double n = stage_num(after, NULL, "count"), win = stage_num(after, NULL, "window");
    double mine = n - stage_count(before, NULL);
    /* NAN from a daemon without kernel stages */
    double mine_k = stage_num(after, "kernel", "count") - stage_count(before, "kernel");
    int kernel = mine_k > 0;
    printf("daemon stages: p50 over its last %.0f timed requests (%.0f from this run) / mean over "
           "this run, us:\n  ", win, mine);
    for (size_t i = 0; i < (kernel ? sizeof stage_names / sizeof stage_names[0] : N_PLAIN_STAGES);
         i++)
        printf("%s%s %.1f / %.1f", i ? ", " : "", stage_names[i],
               stage_num(after, stage_names[i], "p50"),
               stage_run_mean(before, after, stage_names[i]));
    if (kernel)
        printf("\n  (kernel stages: p50 over the daemon's last %.0f requests with a known kernel "
               "time, %.0f of this run's %.0f)", stage_num(after, "kernel", "window"), mine_k,
               mine);
    double e2e = client_mean_us - stage_run_mean(before, after, "backend");
    printf("\nadded over backend: in the daemon p50 %.1f us, mean %.1f us; end to end (client "
           "mean - daemon backend mean) %.1f us\n", stage_num(after, "added", "p50"),
           stage_run_mean(before, after, "added"), e2e);
    if (!kernel)
        return e2e;
    *what = "kernel";
    e2e = client_mean_us - stage_run_mean(before, after, "kernel");
    printf("added over kernel: in the daemon p50 %.1f us, mean %.1f us; end to end (client mean - "
           "daemon kernel mean) %.1f us\n", stage_num(after, "added_kernel", "p50"),
           stage_run_mean(before, after, "added_kernel"), e2e);
    return e2e;
}

/* --- payload echo ------------------------------------------------------------ */

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static double pct(const uint64_t *v, size_t n, double p)
{
    if (n == 0)
        return 0;
    size_t i = (size_t)ceil(p * (double)n) - 1;
    return v[i < n ? i : n - 1] / 1e3;
}

struct echo {
    int fd;
    size_t req, rep; /* bytes in, bytes back */
    uint8_t *buf;    /* max(req, rep) */
};

/* Move exactly n bytes through a blocking socket; 0 or -1. */
static int xfer_all(int fd, uint8_t *buf, size_t n, int writing)
{
    while (n > 0) {
        ssize_t k = writing ? send(fd, buf, n, MSG_NOSIGNAL) : recv(fd, buf, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        buf += k;
        n -= (size_t)k;
    }
    return 0;
}

/* The daemon's side with no processing: read a request, write a reply. */
static void *echo_thread(void *arg)
{
    struct echo *e = arg;
    for (int i = 0; i < ECHO_ROUNDS; i++)
        if (xfer_all(e->fd, e->buf, e->req, 0) || xfer_all(e->fd, e->buf, e->rep, 1))
            break;
    return NULL;
}

/* p50 (us) of a `req`-byte frame out and a `rep`-byte frame back over an
 * AF_UNIX socketpair with the client's and the daemon's send buffers, echoed
 * by a thread that does nothing else: what the payload costs on the socket
 * alone. NAN on failure (why in err). */
static double echo_p50_us(size_t req, size_t rep, char *err, size_t errlen)
{
    int sv[2] = {-1, -1}, sndbuf = ECHO_SNDBUF;
    uint64_t lat[ECHO_ROUNDS];
    size_t n = 0;
    pthread_t th;
    struct echo e = {.req = req, .rep = rep};
    uint8_t *mine = calloc(1, req > rep ? req : rep);
    e.buf = calloc(1, req > rep ? req : rep);
    if (!mine || !e.buf) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
        snprintf(err, errlen, "socketpair: %s", strerror(errno));
        goto out;
    }
    for (int i = 0; i < 2; i++)
        (void)setsockopt(sv[i], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    e.fd = sv[1];
    if (pthread_create(&th, NULL, echo_thread, &e)) {
        snprintf(err, errlen, "cannot start the echo thread");
        goto out;
    }
    for (int i = 0; i < ECHO_ROUNDS; i++) {
        uint64_t t0 = moed_mono_ns();
        if (xfer_all(sv[0], mine, req, 1) || xfer_all(sv[0], mine, rep, 0)) {
            snprintf(err, errlen, "echo: %s", strerror(errno));
            break;
        }
        if (i >= ECHO_WARMUP)
            lat[n++] = moed_mono_ns() - t0;
    }
    shutdown(sv[0], SHUT_RDWR); /* a thread still reading sees EOF */
    pthread_join(th, NULL);
out:
    for (int i = 0; i < 2; i++)
        if (sv[i] >= 0)
            close(sv[i]);
    free(mine);
    free(e.buf);
    if (n < ECHO_ROUNDS - ECHO_WARMUP)
        return NAN;
    qsort(lat, n, sizeof *lat, cmp_u64);
    return pct(lat, n, 0.50);
}

/* The floor under bench's added latency: the same frames through a socket
 * with nothing behind it, and whether the daemon stays within budget of it. */
static void print_echo_budget(const struct opts *o, const struct moed_hello_rep *h,
                              double added_us, const char *over)
{
    char err[128] = "";
    uint64_t plen = moed_forward_payload_len((uint32_t)o->tokens, h->hidden, h->top_k);
    double echo = plen ? echo_p50_us(MOED_PROTO_HDR_SIZE + plen,
                                     MOED_PROTO_HDR_SIZE + sizeof(struct moed_forward_rep) +
                                         (size_t)o->tokens * h->hidden * 2,
                                     err, sizeof err)
                       : NAN;
    if (isnan(echo)) {
        printf("payload through the socket (echo, no processing): not measured (%s)\n",
               err[0] ? err : "frame size out of range");
        return;
    }
    printf("payload through the socket (echo, no processing) p50 %.1f us\n", echo);
    if (isnan(added_us))
        printf("added <= echo + %.0f us: unknown (no daemon stages)\n", ADDED_BUDGET_US);
    else
        printf("added <= echo + %.0f us: %s (end to end over %s %.1f us, echo + %.0f = %.1f us)\n",
               ADDED_BUDGET_US, added_us <= echo + ADDED_BUDGET_US ? "met" : "not met", over,
               added_us, ADDED_BUDGET_US, echo + ADDED_BUDGET_US);
}

int cmd_bench(const struct opts *o)
{
    struct bench_shared sh = {.o = o};
    struct bench_thread *th = NULL;
    struct moedc *c;
    uint64_t *all = NULL;
    int ret = 1;
    uint32_t started = 0;
    if (connect_hello(o, &c, &sh.h))
        return 1;
    moedc_close(c);
    ret = pick_layer(o, &sh.h, &sh.layer);
    if (ret)
        return ret;
    ret = 1;
    cJSON *st_before = fetch_stages(o);
    th = calloc(o->connections, sizeof *th);
    if (!th) {
        fprintf(stderr, "moectl bench: out of memory\n");
        cJSON_Delete(st_before);
        return 1;
    }
    fprintf(stderr, "bench: %" PRIu64 " connections x %" PRIu64 " in flight, %" PRIu64
            " tokens/request, layer %" PRIu32 ", %" PRIu64 " s, backend %s\n",
            o->connections, o->inflight, o->tokens, sh.layer, o->duration, sh.h.backend);
    uint64_t t0 = moed_mono_ns();
    for (; started < o->connections; started++) {
        th[started].sh = &sh;
        th[started].index = started;
        if (pthread_create(&th[started].tid, NULL, bench_worker, &th[started])) {
            fprintf(stderr, "moectl bench: cannot start thread %" PRIu32 "\n", started);
            atomic_store(&sh.stop, 1);
            goto join;
        }
    }
    uint64_t last_done = 0;
    for (uint64_t s = 1; s <= o->duration; s++) {
        /* Sleep to the next whole second since start, so lines stay on time. */
        uint64_t target = t0 + s * 1000000000ull, now = moed_mono_ns();
        if (target > now) {
            struct timespec ts = {(time_t)((target - now) / 1000000000ull),
                                  (long)((target - now) % 1000000000ull)};
            while (nanosleep(&ts, &ts) && errno == EINTR) {
            }
        }
        uint64_t done = atomic_load(&sh.done);
        fprintf(stderr, "[%3" PRIu64 "s] %8" PRIu64 " req/s  %10" PRIu64 " tokens/s  errors %"
                PRIu64 "  failed connections %" PRIu64 "\n", s, done - last_done,
                (done - last_done) * o->tokens, (uint64_t)atomic_load(&sh.errors),
                (uint64_t)atomic_load(&sh.failed_threads));
        last_done = done;
        if (atomic_load(&sh.failed_threads) == o->connections)
            break;
    }
    atomic_store(&sh.stop, 1);
join:
    for (uint32_t i = 0; i < started; i++)
        pthread_join(th[i].tid, NULL);
    double secs = (moed_mono_ns() - t0) / 1e9;
    size_t n = 0;
    for (uint32_t i = 0; i < started; i++)
        n += th[i].n_lat;
    all = malloc((n ? n : 1) * sizeof *all);
    if (!all) {
        fprintf(stderr, "moectl bench: out of memory\n");
        goto free_th;
    }
    n = 0;
    for (uint32_t i = 0; i < started; i++) {
        if (th[i].rc)
            fprintf(stderr, "moectl bench: connection %" PRIu32 ": %s (%s)\n", i, th[i].err,
                    moedc_strerror(th[i].rc));
        memcpy(all + n, th[i].lat_ns, th[i].n_lat * sizeof *all);
        n += th[i].n_lat;
    }
    qsort(all, n, sizeof *all, cmp_u64);
    uint64_t done = atomic_load(&sh.done), errors = atomic_load(&sh.errors);
    printf("requests: %" PRIu64 " ok, %" PRIu64 " errors in %.2f s\n", done, errors, secs);
    printf("throughput: %.1f requests/s, %.1f tokens/s\n", done / secs, done * o->tokens / secs);
    printf("latency: p50 %.1f us, p99 %.1f us, p999 %.1f us, max %.1f us (%zu samples)\n",
           pct(all, n, 0.50), pct(all, n, 0.99), pct(all, n, 0.999), n ? all[n - 1] / 1e3 : 0.0,
           n);
    double mean_us = 0;
    for (size_t i = 0; i < n; i++)
        mean_us += (double)all[i] / 1e3;
    mean_us = n ? mean_us / (double)n : 0.0;
    cJSON *st_after = fetch_stages(o);
    const char *over;
    double added_us = print_stages(st_before, st_after, mean_us, &over);
    print_echo_budget(o, &sh.h, added_us, over);
    cJSON_Delete(st_after);
    ret = (done > 0 && errors == 0 && atomic_load(&sh.failed_threads) == 0) ? 0 : 1;
free_th:
    for (uint32_t i = 0; i < started; i++)
        free(th[i].lat_ns);
    free(th);
    free(all);
    cJSON_Delete(st_before);
    return ret;
}

