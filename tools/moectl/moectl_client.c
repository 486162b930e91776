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
#include "moectl_int.h"
#include "moed_client.h"
#include "moed_err.h"
#include "moed_log.h"
#include "moed_util.h"
#include "moed_proto.h"
#include "nvfp4.h"
#include "placement.h"

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
    {"--socket", OPT_STR, "status experts placement ping forward bench", 0, 0,
     offsetof(struct opts, socket),
     "daemon socket (default $MOED_SOCKET or " DEFAULT_SOCKET ")"},
    {"--timeout-ms", OPT_U64, "status experts placement ping forward bench", 1, 3600000,
     offsetof(struct opts, timeout_ms), "reply timeout in ms (default 30000)"},
    {"--json", OPT_FLAG, "status experts placement", 0, 0, offsetof(struct opts, json),
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
    {"--gpus", OPT_U64, "placement", 1, MOED_PLACE_MAX_DEVS, offsetof(struct opts, gpus),
     "GPUs to place the experts on (default 2)"},
    {"--max-replicas", OPT_U64, "placement", 1, MOED_PLACE_MAX_REPLICAS,
     offsetof(struct opts, max_replicas), "copies of one hot expert at most (default: --gpus)"},
    {"--hot-percent", OPT_U64, "placement", 1, 100000000, offsetof(struct opts, hot_percent),
     "an expert over this % of one GPU's share of the tokens is copied (default 100)"},
};
#define N_OPTS (sizeof opt_table / sizeof opt_table[0])

static const char *cmd_summary(const char *cmd)
{
    if (strcmp(cmd, "status") == 0)
        return "print a short summary of the daemon's status (--json: the whole document)";
    if (strcmp(cmd, "experts") == 0)
        return "per-layer, per-expert token counts since start (--json: experts.logical_count "
               "[layers][experts], the layout of SGLang's expert-distribution dump)";
    if (strcmp(cmd, "placement") == 0)
        return "a balanced placement of every MoE layer's experts on --gpus GPUs from the "
               "token counts since start (--json: the map, one device list per expert; "
               "docs/MULTI_GPU.md)";
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
                       .duration = 10, .inflight = 1, .timeout_ms = DEFAULT_TIMEOUT_MS,
                       .gpus = 2, .hot_percent = 100};
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

int connect_hello(const struct opts *o, struct moedc **c, struct moed_hello_rep *h)
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

cJSON *fetch_status(const struct opts *o, struct moedc *c, char **raw)
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
    printf("batches   %.0f, mean %.1f tokens; busy %.1f%%", jd(r, "batches.count"),
           jd(r, "batches.mean_tokens"), 100 * jd(r, "busy_fraction"));
    if (jd(r, "loop_spin.us") > 0) /* NaN (an older daemon) and 0 (off, CPU) say nothing */
        printf("; event loop spun %.1f s (engine.loop_spin_us %.0f)", jd(r, "loop_spin.seconds"),
               jd(r, "loop_spin.us"));
    printf("\n");
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


void batch_free(struct batch *b)
{
    free(b->x);
    free(b->ids);
    free(b->w);
}

/* x ~ N(0, 1) in bf16; k distinct ids per token (partial Fisher-Yates);
 * weights positive and summing to 1, like a softmax router's. */
int batch_make(struct batch *b, uint32_t T, const struct moed_hello_rep *h, uint64_t seed)
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
int pick_layer(const struct opts *o, const struct moed_hello_rep *h, uint32_t *layer)
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
    if (strcmp(cmd, "placement") == 0)
        return cmd_placement(&o);
    if (strcmp(cmd, "ping") == 0)
        return cmd_ping(&o);
    if (strcmp(cmd, "forward") == 0)
        return cmd_forward(&o);
    if (strcmp(cmd, "bench") == 0)
        return cmd_bench(&o);
    fprintf(stderr, "moectl: unknown client command '%s'\n", cmd);
    return 2;
}

