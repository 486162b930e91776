/* moectl_client.c - `moectl status|ping|forward|bench`: the command-line
 * client of a running daemon, built on the C client library (moed_client.h).
 *
 * Exit codes: 0 success, 1 the daemon or the check failed, 2 usage error.
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
#include "moed_client.h"
#include "moed_err.h"
#include "moed_log.h"
#include "moed_util.h"
#include "moed_proto.h"
#include "nvfp4.h"

#define DEFAULT_SOCKET "/tmp/moed.sock"
#define DEFAULT_TIMEOUT_MS 30000
#define MAX_CONNECTIONS 1024
#define MAX_INFLIGHT 1024
#define MAX_DURATION_S 86400
#define MAX_PING_COUNT 1000000
/* Latency samples kept by bench (beyond this, requests are still counted). */
#define MAX_SAMPLES (64u << 20)
/* Failing rel-L2 of `forward --check`: bf16 output rounding is ~4e-3. */
#define CHECK_REL_L2 1e-2
/* bench's floor: round trips of the payload echoed through a socketpair (the
 * first ECHO_WARMUP not counted), with the send buffer the C client and the
 * daemon ask for (MOEDC's 1 MiB, server.socket_buffer_bytes' default) */
#define ECHO_ROUNDS 200
#define ECHO_WARMUP 20
#define ECHO_SNDBUF (1 << 20)
/* What the daemon may add over that echo (end to end, per request). */
#define ADDED_BUDGET_US 30.0

struct opts {
    const char *cmd;
    const char *socket;
    const char *model;
    int json, check;
    uint64_t count, layer, tokens, seed, connections, duration, inflight, timeout_ms;
    int have_layer;
};

/* One table of options: name, which commands take it, numeric bounds. */
enum opt_kind { OPT_FLAG, OPT_STR, OPT_U64 };
static const struct opt_def {
    const char *name;
    enum opt_kind kind;
    const char *cmds; /* space-separated commands that accept it */
    uint64_t min, max;
    size_t off;
    const char *help;
} opt_table[] = {
    {"--socket", OPT_STR, "status experts ping forward bench", 0, 0, offsetof(struct opts, socket),
     "daemon socket (default $MOED_SOCKET or " DEFAULT_SOCKET ")"},
    {"--timeout-ms", OPT_U64, "status experts ping forward bench", 1, 3600000,
     offsetof(struct opts, timeout_ms), "reply timeout in ms (default 30000)"},
    {"--json", OPT_FLAG, "status experts", 0, 0, offsetof(struct opts, json),
     "print the JSON document instead of the summary"},
    {"--count", OPT_U64, "ping", 1, MAX_PING_COUNT, offsetof(struct opts, count),
     "number of pings (default 4)"},
    {"--layer", OPT_U64, "forward bench", 0, MOED_MAX_LAYERS - 1, offsetof(struct opts, layer),
     "MoE layer id (default: the first MoE layer)"},
    {"--tokens", OPT_U64, "forward bench", 1, UINT32_MAX, offsetof(struct opts, tokens),
     "tokens per request (default 1)"},
    {"--seed", OPT_U64, "forward bench", 0, UINT64_MAX, offsetof(struct opts, seed),
     "random seed (default 1)"},
    {"--check", OPT_FLAG, "forward", 0, 0, offsetof(struct opts, check),
     "compare with the CPU reference of the daemon's checkpoint"},
    {"--model", OPT_STR, "forward", 0, 0, offsetof(struct opts, model),
     "checkpoint directory for --check (default: the one the daemon names)"},
    {"--connections", OPT_U64, "bench", 1, MAX_CONNECTIONS, offsetof(struct opts, connections),
     "concurrent connections, one thread each (default 1)"},
    {"--duration", OPT_U64, "bench", 1, MAX_DURATION_S, offsetof(struct opts, duration),
     "seconds to run (default 10)"},
    {"--inflight", OPT_U64, "bench", 1, MAX_INFLIGHT, offsetof(struct opts, inflight),
     "requests pipelined per connection (default 1)"},
};
#define N_OPTS (sizeof opt_table / sizeof opt_table[0])

static const char *cmd_summary(const char *cmd)
{
    if (strcmp(cmd, "status") == 0)
        return "print a short summary of the daemon's status (--json: the whole document)";
    if (strcmp(cmd, "experts") == 0)
        return "per-layer, per-expert token counts since start (--json: experts.logical_count "
               "[layers][experts], the layout of SGLang's expert-distribution dump)";
    if (strcmp(cmd, "ping") == 0)
        return "round-trip PINGs and print their latency";
    if (strcmp(cmd, "forward") == 0)
        return "send one random batch and print its latency (--check: compare with the CPU "
               "reference)";
    return "N connections x K pipelined requests for a duration: requests/s, tokens/s, "
           "p50/p99/p999 latency, the daemon's stages, and the latency it adds against the "
           "same payload echoed through a bare socket";
}

static int cmd_takes(const struct opt_def *d, const char *cmd)
{
    size_t n = strlen(cmd);
    for (const char *p = d->cmds; (p = strstr(p, cmd)) != NULL; p += n)
        if ((p == d->cmds || p[-1] == ' ') && (p[n] == ' ' || p[n] == 0))
            return 1;
    return 0;
}

static void usage(FILE *f, const char *cmd)
{
    fprintf(f, "usage: moectl %s [options]\n  %s\n\noptions:\n", cmd, cmd_summary(cmd));
    for (size_t i = 0; i < N_OPTS; i++) {
        if (!cmd_takes(&opt_table[i], cmd))
            continue;
        const char *arg = opt_table[i].kind == OPT_FLAG ? "" :
                          opt_table[i].kind == OPT_STR ? " S" : " N";
        fprintf(f, "  %s%-*s %s\n", opt_table[i].name, (int)(16 - strlen(opt_table[i].name)),
                arg, opt_table[i].help);
    }
    fprintf(f, "  --help           this text\n");
}

/* Returns 0, 1 for --help (printed), or 2 for a usage error (printed).
 * getopt_long over the options of opt_table that `cmd` takes. */
static int parse_opts(const char *cmd, int argc, char **argv, struct opts *o)
{
    *o = (struct opts){.cmd = cmd, .count = 4, .tokens = 1, .seed = 1, .connections = 1,
                       .duration = 10, .inflight = 1, .timeout_ms = DEFAULT_TIMEOUT_MS};
    o->socket = getenv("MOED_SOCKET");
    if (!o->socket || !*o->socket)
        o->socket = DEFAULT_SOCKET;
    struct option lo[N_OPTS + 2];
    size_t n = 0;
    for (size_t k = 0; k < N_OPTS; k++)
        if (cmd_takes(&opt_table[k], cmd))
            lo[n++] = (struct option){opt_table[k].name + 2,
                                      opt_table[k].kind == OPT_FLAG ? no_argument
                                                                    : required_argument,
                                      NULL, 256 + (int)k};
    lo[n++] = (struct option){"help", no_argument, NULL, 'h'};
    lo[n] = (struct option){NULL, 0, NULL, 0};
    optind = 1;
    opterr = 0;
    for (int c; (c = getopt_long(argc, argv, ":h", lo, NULL)) != -1;) {
        if (c == 'h') {
            usage(stdout, cmd);
            return 1;
        }
        if (c == ':') {
            fprintf(stderr, "moectl %s: %s needs a value\n", cmd, argv[optind - 1]);
            return 2;
        }
        if (c < 256) {
            const char *a = argv[optind - 1];
            if (strncmp(a, "--", 2) == 0 && strchr(a, '='))
                fprintf(stderr, "moectl %s: %.*s takes no value\n", cmd,
                        (int)(strchr(a, '=') - a), a);
            else
                fprintf(stderr, "moectl %s: unknown option '%s'\n", cmd, a);
            usage(stderr, cmd);
            return 2;
        }
        const struct opt_def *d = &opt_table[c - 256];
        char *field = (char *)o + d->off;
        if (d->kind == OPT_FLAG) {
            *(int *)(void *)field = 1;
            continue;
        }
        const char *val = optarg;
        if (d->kind == OPT_STR) {
            if (!*val) {
                fprintf(stderr, "moectl %s: %s needs a non-empty value\n", cmd, d->name);
                return 2;
            }
            *(const char **)(void *)field = val;
            continue;
        }
        char *end;
        errno = 0;
        unsigned long long v = strtoull(val, &end, 10);
        if (errno || end == val || *end || val[0] == '-' || v < d->min || v > d->max) {
            fprintf(stderr, "moectl %s: %s '%s' is not an integer in [%" PRIu64 ", %" PRIu64
                    "]\n", cmd, d->name, val, d->min, d->max);
            return 2;
        }
        *(uint64_t *)(void *)field = v;
        if (strcmp(d->name, "--layer") == 0)
            o->have_layer = 1;
    }
    if (optind < argc) {
        fprintf(stderr, "moectl %s: unknown option '%s'\n", cmd, argv[optind]);
        usage(stderr, cmd);
        return 2;
    }
    return 0;
}

static int connect_hello(const struct opts *o, struct moedc **c, struct moed_hello_rep *h)
{
    char err[MOED_ERRLEN];
    int rc = moedc_connect(o->socket, (int)o->timeout_ms, c, err, sizeof err);
    if (rc) {
        fprintf(stderr, "moectl %s: %s\n", o->cmd, err);
        return rc;
    }
    if (!h)
        return 0;
    rc = moedc_hello(*c, h, err, sizeof err);
    if (rc) {
        fprintf(stderr, "moectl %s: HELLO: %s (%s)\n", o->cmd, err, moedc_strerror(rc));
        moedc_close(*c);
        *c = NULL;
    }
    return rc;
}

/* --- status ------------------------------------------------------------- */

/* The daemon's STATUS document, parsed; NULL (message printed) on failure. */
static cJSON *fetch_status(const struct opts *o, struct moedc *c, char **raw)
{
    char err[MOED_ERRLEN];
    char *js = NULL;
    int rc = moedc_status(c, &js, err, sizeof err);
    if (rc) {
        fprintf(stderr, "moectl %s: STATUS: %s (%s)\n", o->cmd, err, moedc_strerror(rc));
        return NULL;
    }
    cJSON *root = cJSON_Parse(js);
    if (!root || !cJSON_IsObject(root)) {
        fprintf(stderr, "moectl %s: the daemon's status is not a JSON object: %.200s\n", o->cmd,
                js);
        cJSON_Delete(root);
        root = NULL;
    }
    if (raw && root)
        *raw = js;
    else
        free(js);
    return root;
}

/* Field lookups by a dotted path; NAN / "" / -1 when absent. */
static const cJSON *jget(const cJSON *root, const char *path)
{
    char key[64];
    const cJSON *it = root;
    while (it && *path) {
        size_t n = strcspn(path, ".");
        if (n >= sizeof key)
            return NULL;
        memcpy(key, path, n);
        key[n] = 0;
        it = cJSON_GetObjectItemCaseSensitive(it, key);
        path += n + (path[n] == '.');
    }
    return it;
}

static double jd(const cJSON *root, const char *path)
{
    const cJSON *v = jget(root, path);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static const char *js_(const cJSON *root, const char *path)
{
    const cJSON *v = jget(root, path);
    return cJSON_IsString(v) ? v->valuestring : "";
}

static int jb(const cJSON *root, const char *path)
{
    const cJSON *v = jget(root, path);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : -1;
}

/* "123 us" / "1.23 ms" / "1.23 s" */
static const char *fmt_us(char *buf, size_t n, double us)
{
    if (!(us == us))
        snprintf(buf, n, "-");
    else if (us < 1000)
        snprintf(buf, n, "%.0f us", us);
    else if (us < 1e6)
        snprintf(buf, n, "%.2f ms", us / 1e3);
    else
        snprintf(buf, n, "%.2f s", us / 1e6);
    return buf;
}

/* A few lines an operator reads at a glance; `--json` gives everything. */
static void print_summary(const struct opts *o, const cJSON *r)
{
    char a[32], b[32], c3[32];
    double up = jd(r, "uptime_s");
    int loaded = jb(r, "load.loaded"), healthy = jb(r, "backend.healthy");
    printf("moed %s at %s: %s, up %.0fh%02.0fm%02.0fs\n", js_(r, "version"), o->socket,
           loaded != 1 ? "loading" : healthy == 1 ? "serving (healthy)" : "UNHEALTHY",
           floor(up / 3600), floor(fmod(up, 3600) / 60), fmod(up, 60));
    if (loaded != 1)
        printf("load      %s: %.0f%% (%.0f of %.0f MiB)\n", js_(r, "load.phase"),
               100 * jd(r, "load.fraction"), jd(r, "load.done_bytes") / 1048576,
               jd(r, "load.total_bytes") / 1048576);
    printf("model     %s", js_(r, "model.path"));
    if (jd(r, "model.hidden") == jd(r, "model.hidden"))
        printf(" (%s: H=%.0f I=%.0f E=%.0f k=%.0f shared=%.0f, %.0f MoE layers of %.0f)",
               js_(r, "model.family"), jd(r, "model.hidden"), jd(r, "model.inter"),
               jd(r, "model.n_experts"), jd(r, "model.top_k"), jd(r, "model.n_shared"),
               jd(r, "model.n_moe_layers"), jd(r, "model.n_layers"));
    printf("\nbackend   %s\n", *js_(r, "backend.description") ? js_(r, "backend.description")
                                                            : js_(r, "backend.name"));
    printf("clients   %.0f connected (%.0f accepted, %.0f refused)\n", jd(r, "clients.connected"),
           jd(r, "clients.total"), jd(r, "clients.refused"));
    printf("requests  %.0f served, %.0f tokens, %.0f in flight; errors:",
           jd(r, "requests.served"), jd(r, "requests.tokens"), jd(r, "requests.in_flight"));
    const cJSON *errs = jget(r, "requests.errors");
    int any = 0;
    for (const cJSON *e = errs ? errs->child : NULL; e; e = e->next, any = 1)
        printf("%s %s %.0f", any ? "," : "", e->string, e->valuedouble);
    printf("%s\n", any ? "" : " none");
    printf("latency   p50 %s, p99 %s, p999 %s over %.0f requests\n",
           fmt_us(a, sizeof a, jd(r, "latency_us.p50")), fmt_us(b, sizeof b, jd(r, "latency_us.p99")),
           fmt_us(c3, sizeof c3, jd(r, "latency_us.p999")), jd(r, "latency_us.count"));
    if (jd(r, "stages_us.count") > 0) {
        printf("stages    p50:");
        static const char *const st[] = {"recv", "submit", "backend", "reply", "write", "kernel"};
        for (size_t i = 0; i < sizeof st / sizeof st[0]; i++) {
            char path[64];
            snprintf(path, sizeof path, "stages_us.%s.p50", st[i]);
            if (jd(r, path) == jd(r, path) && (i < 5 || jd(r, "stages_us.kernel.count") > 0))
                printf(" %s %s", st[i], fmt_us(a, sizeof a, jd(r, path)));
        }
        printf("; added p50 %s p99 %s\n", fmt_us(a, sizeof a, jd(r, "stages_us.added.p50")),
               fmt_us(b, sizeof b, jd(r, "stages_us.added.p99")));
    }
    printf("batches   %.0f, mean %.1f tokens; busy %.1f%%\n", jd(r, "batches.count"),
           jd(r, "batches.mean_tokens"), 100 * jd(r, "busy_fraction"));
    if (jget(r, "kernel") && cJSON_IsObject(jget(r, "kernel")))
        printf("kernel    heartbeat %.0f, last advanced %.0f ms ago\n", jd(r, "kernel.heartbeat"),
               jd(r, "kernel.heartbeat_age_ms"));
    printf("(moectl status --json: the whole document; moectl experts: per-layer expert load)\n");
}

static int cmd_status(const struct opts *o)
{
    struct moedc *c;
    char *js = NULL;
    if (connect_hello(o, &c, NULL))
        return 1;
    cJSON *root = fetch_status(o, c, &js);
    moedc_close(c);
    if (!root)
        return 1;
    if (o->json)
        printf("%s\n", js);
    else
        print_summary(o, root);
    free(js);
    cJSON_Delete(root);
    return 0;
}

/* `moectl experts`: tokens routed to each expert of each MoE layer since the
 * daemon started, from STATUS experts.logical_count ([layers][experts], the
 * layout of SGLang's expert-distribution dump, for EPLB tools). --json
 * prints that object; otherwise a table: per layer the total, the hottest
 * expert and the max/mean imbalance. */
static int cmd_experts(const struct opts *o)
{
    struct moedc *c;
    if (connect_hello(o, &c, NULL))
        return 1;
    cJSON *root = fetch_status(o, c, NULL);
    moedc_close(c);
    if (!root)
        return 1;
    int ret = 1;
    const cJSON *x = jget(root, "experts");
    const cJSON *lc = jget(root, "experts.logical_count");
    if (!cJSON_IsArray(lc)) {
        fprintf(stderr, "moectl experts: the daemon's status has no experts.logical_count "
                "(an older moed)\n");
        goto out;
    }
    if (o->json) {
        char *s = cJSON_PrintUnformatted(x);
        if (!s)
            goto out;
        printf("%s\n", s);
        free(s);
        ret = 0;
        goto out;
    }
    printf("%6s %12s %8s %12s %9s   (routed experts; layers without tokens not shown)\n",
           "layer", "tokens", "hottest", "its tokens", "max/mean");
    int layer = 0;
    for (const cJSON *row = lc->child; row; row = row->next, layer++) {
        double sum = 0, mx = -1;
        int n = 0, arg = -1;
        for (const cJSON *v = row->child; v; v = v->next, n++) {
            sum += v->valuedouble;
            if (v->valuedouble > mx) {
                mx = v->valuedouble;
                arg = n;
            }
        }
        if (sum > 0)
            printf("%6d %12.0f %8d %12.0f %9.2f\n", layer, sum, arg, mx, mx / (sum / n));
    }
    ret = 0;
out:
    cJSON_Delete(root);
    return ret;
}

/* --- ping --------------------------------------------------------------- */

static int cmd_ping(const struct opts *o)
{
    struct moedc *c;
    char err[MOED_ERRLEN];
    if (connect_hello(o, &c, NULL))
        return 1;
    double mn = INFINITY, mx = 0, sum = 0;
    uint64_t i;
    for (i = 0; i < o->count; i++) {
        uint64_t ns;
        int rc = moedc_ping(c, &ns, err, sizeof err);
        if (rc) {
            fprintf(stderr, "moectl ping: %s (%s)\n", err, moedc_strerror(rc));
            moedc_close(c);
            return 1;
        }
        double us = ns / 1e3;
        mn = us < mn ? us : mn;
        mx = us > mx ? us : mx;
        sum += us;
        printf("ping %" PRIu64 ": %.1f us\n", i + 1, us);
        if (i + 1 < o->count && o->count <= 100)
            usleep(100000); /* a short pause for an interactive run */
    }
    printf("%" PRIu64 " pings: min %.1f us, avg %.1f us, max %.1f us\n", i, mn, sum / i, mx);
    moedc_close(c);
    return 0;
}

/* --- random batches ------------------------------------------------------- */

static double rnd01(uint64_t *s)
{
    return (moed_splitmix64(s) >> 11) * 0x1.0p-53;
}

struct batch {
    uint32_t T, H, k;
    uint16_t *x;
    int32_t *ids;
    float *w;
};

static void batch_free(struct batch *b)
{
    free(b->x);
    free(b->ids);
    free(b->w);
}

/* x ~ N(0, 1) in bf16; k distinct ids per token (partial Fisher-Yates);
 * weights positive and summing to 1, like a softmax router's. */
static int batch_make(struct batch *b, uint32_t T, const struct moed_hello_rep *h, uint64_t seed)
{
    *b = (struct batch){.T = T, .H = h->hidden, .k = h->top_k};
    uint64_t s = seed;
    int32_t *perm = NULL;
    if (h->top_k == 0 || h->top_k > h->n_experts || h->n_experts > MOED_MAX_EXPERTS)
        return MOED_E_INVAL;
    b->x = malloc((size_t)T * h->hidden * sizeof *b->x);
    b->ids = malloc((size_t)T * h->top_k * sizeof *b->ids);
    b->w = malloc((size_t)T * h->top_k * sizeof *b->w);
    perm = malloc(h->n_experts * sizeof *perm);
    if (!b->x || !b->ids || !b->w || !perm) {
        free(perm);
        batch_free(b);
        return MOED_E_NOMEM;
    }
    for (size_t i = 0; i < (size_t)T * h->hidden; i++) {
        double u1 = rnd01(&s), u2 = rnd01(&s);
        double g = sqrt(-2.0 * log(u1 > 0 ? u1 : 1e-300)) * cos(2 * M_PI * u2);
        b->x[i] = bf16_from_float((float)g);
    }
    for (uint32_t t = 0; t < T; t++) {
        for (uint32_t e = 0; e < h->n_experts; e++)
            perm[e] = (int32_t)e;
        double sum = 0;
        for (uint32_t j = 0; j < h->top_k; j++) {
            uint32_t r = j + (uint32_t)(moed_splitmix64(&s) % (h->n_experts - j));
            int32_t tmp = perm[j];
            perm[j] = perm[r];
            perm[r] = tmp;
            b->ids[t * h->top_k + j] = perm[j];
            b->w[t * h->top_k + j] = (float)(0.05 + rnd01(&s));
            sum += b->w[t * h->top_k + j];
        }
        for (uint32_t j = 0; j < h->top_k; j++)
            b->w[t * h->top_k + j] = (float)(b->w[t * h->top_k + j] / sum);
    }
    free(perm);
    return 0;
}

/* Pick the layer: --layer, else the daemon's first MoE layer; range-check
 * against HELLO so a typo gets a local message. */
static int pick_layer(const struct opts *o, const struct moed_hello_rep *h, uint32_t *layer)
{
    *layer = o->have_layer ? (uint32_t)o->layer : h->first_moe_layer;
    if (*layer >= h->n_layers) {
        fprintf(stderr, "moectl %s: --layer %" PRIu32 " is out of range [0, %" PRIu32 ")\n",
                o->cmd, *layer, h->n_layers);
        return 2;
    }
    if (o->tokens > h->max_tokens) {
        fprintf(stderr, "moectl %s: --tokens %" PRIu64 " is over the daemon's max_tokens %"
                PRIu32 "\n", o->cmd, o->tokens, h->max_tokens);
        return 2;
    }
    return 0;
}

/* --- forward -------------------------------------------------------------- */

static int check_against_ref(const struct opts *o, const struct moed_hello_rep *h,
                             uint32_t layer, const struct batch *b, const uint16_t *y)
{
    char err[MOED_ERRLEN];
    struct moed_model *m = NULL;
    uint16_t *yref = NULL;
    int ret = 1;
    /* The loader's progress lines would drown the result; keep warnings. */
    if (moed_log_threshold > MOED_LOG_WARN)
        moed_log_set_level(MOED_LOG_WARN);
    int rc = moed_model_open(o->model, 0, NULL, NULL, &m, err, sizeof err);
    if (rc) {
        fprintf(stderr, "moectl forward: --model %s: %s\n", o->model, err);
        return 1;
    }
    const struct moed_dims *d = moed_model_dims(m);
    if (d->hidden != h->hidden || d->top_k != h->top_k || d->n_experts != h->n_experts ||
        d->n_shared != h->n_shared) {
        fprintf(stderr, "moectl forward: --model %s has H=%" PRIu32 " k=%" PRIu32 " E=%" PRIu32
                " S=%" PRIu32 " but the daemon serves H=%" PRIu32 " k=%" PRIu32 " E=%" PRIu32
                " S=%" PRIu32 "\n", o->model, d->hidden, d->top_k, d->n_experts, d->n_shared,
                h->hidden, h->top_k, h->n_experts, h->n_shared);
        goto close_m;
    }
    const struct moe_layer *ml = moed_model_layer(m, layer);
    if (!ml) {
        fprintf(stderr, "moectl forward: layer %" PRIu32 " is not an MoE layer of %s\n", layer,
                o->model);
        goto close_m;
    }
    yref = malloc((size_t)b->T * b->H * sizeof *yref);
    if (!yref) {
        fprintf(stderr, "moectl forward: out of memory\n");
        goto close_m;
    }
    uint64_t t0 = moed_mono_ns();
    rc = moe_ref_forward(ml, b->T, b->x, b->ids, b->w, yref, 0);
    uint64_t t1 = moed_mono_ns();
    if (rc) {
        fprintf(stderr, "moectl forward: CPU reference failed: %s\n", moed_strerror(rc));
        goto free_ref;
    }
    double num = 0, den = 0, maxabs = 0;
    size_t n = (size_t)b->T * b->H, same = 0, nonfinite = 0, worst = 0;
    for (size_t i = 0; i < n; i++) {
        double a = bf16_to_float(y[i]), r = bf16_to_float(yref[i]);
        same += y[i] == yref[i];
        if (!isfinite(a) || !isfinite(r)) {
            nonfinite++;
            continue;
        }
        double dd = fabs(a - r);
        if (dd > maxabs) {
            maxabs = dd;
            worst = i;
        }
        num += dd * dd;
        den += r * r;
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    printf("check: CPU reference %.2f ms; %zu/%zu outputs bit-identical; max abs diff %.6g "
           "(token %zu, col %zu); rel L2 %.3e%s\n",
           (t1 - t0) / 1e6, same, n, maxabs, worst / b->H, worst % b->H, rel,
           nonfinite ? " (non-finite outputs!)" : "");
    if (nonfinite || !(rel <= CHECK_REL_L2)) {
        printf("check: FAILED (rel L2 over %.0e or non-finite values)\n", CHECK_REL_L2);
        goto free_ref;
    }
    printf("check: ok\n");
    ret = 0;
free_ref:
    free(yref);
close_m:
    moed_model_close(m);
    return ret;
}

static int cmd_forward(const struct opts *o)
{
    struct moedc *c;
    struct moed_hello_rep h;
    struct batch b;
    char err[MOED_ERRLEN];
    uint16_t *y = NULL;
    uint32_t layer;
    int ret = 1;
    if (connect_hello(o, &c, &h))
        return 1;
    ret = pick_layer(o, &h, &layer);
    if (ret)
        goto close_c;
    ret = 1;
    if (batch_make(&b, (uint32_t)o->tokens, &h, o->seed)) {
        fprintf(stderr, "moectl forward: cannot build a batch (k=%" PRIu32 ", E=%" PRIu32 ")\n",
                h.top_k, h.n_experts);
        goto close_c;
    }
    y = malloc((size_t)b.T * b.H * sizeof *y);
    if (!y)
        goto free_b;
    uint64_t t0 = moed_mono_ns();
    int rc = moedc_forward(c, layer, b.T, b.k, b.x, b.ids, b.w, y, err, sizeof err);
    uint64_t t1 = moed_mono_ns();
    if (rc) {
        fprintf(stderr, "moectl forward: %s (%s)\n", err, moedc_strerror(rc));
        goto free_y;
    }
    printf("forward: layer %" PRIu32 ", %" PRIu32 " tokens, H=%" PRIu32 ", k=%" PRIu32
           ", backend %s: %.1f us\n", layer, b.T, b.H, b.k, h.backend, (t1 - t0) / 1e3);
    if (o->check && !o->model) {
        /* the checkpoint the daemon serves (same file system assumed) */
        cJSON *st = fetch_status(o, c, NULL);
        const char *mp = st ? js_(st, "model.path") : "";
        if (!*mp) {
            fprintf(stderr, "moectl forward: the daemon did not name its model; give --model DIR\n");
            cJSON_Delete(st);
            goto free_y;
        }
        struct opts o2 = *o;
        o2.model = mp;
        printf("check: model %s (from the daemon's status)\n", mp);
        ret = check_against_ref(&o2, &h, layer, &b, y);
        cJSON_Delete(st);
        goto free_y;
    }
    ret = o->check ? check_against_ref(o, &h, layer, &b, y) : 0;
free_y:
    free(y);
free_b:
    batch_free(&b);
close_c:
    moedc_close(c);
    return ret;
}

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

static int cmd_bench(const struct opts *o)
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

int moectl_client_main(const char *cmd, int argc, char **argv)
{
    struct opts o;
    int rc = parse_opts(cmd, argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : 2;
    if (strcmp(cmd, "status") == 0)
        return cmd_status(&o);
    if (strcmp(cmd, "experts") == 0)
        return cmd_experts(&o);
    if (strcmp(cmd, "ping") == 0)
        return cmd_ping(&o);
    if (strcmp(cmd, "forward") == 0)
        return cmd_forward(&o);
    if (strcmp(cmd, "bench") == 0)
        return cmd_bench(&o);
    fprintf(stderr, "moectl: unknown client command '%s'\n", cmd);
    return 2;
}
