/* test_status.c - latency histogram, /status JSON and /metrics text.
 *
 * References are independent of status.c: percentiles are checked against
 * the exact order statistic of the samples (sorted here), bucket bounds are
 * recomputed from the documented scheme (3 per octave, upper bound 2^(i/3)
 * us, inclusive), and the Prometheus text is checked line by line against
 * the 0.0.4 exposition grammar with POSIX regexes.
 */
#include <check.h>
#include <math.h>
#include <regex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "stats.h"
#include "check_main.h"

#define NS 1000000000ull

static struct moed_dims g_dims;
static uint64_t g_hits[5] = {5, 0, 9, 1, 40}; /* 4 routed + 1 shared */

/* A loaded CPU daemon 10 s after start with known counters. */
static void fill(struct moed_stats *s)
{
    memset(s, 0, sizeof *s);
    memset(&g_dims, 0, sizeof g_dims);
    g_dims.hidden = 7168;
    g_dims.inter = 2048;
    g_dims.n_experts = 4;
    g_dims.top_k = 2;
    g_dims.n_shared = 1;
    g_dims.n_layers = 61;
    g_dims.n_moe_layers = 58;
    snprintf(g_dims.family, sizeof g_dims.family, "deepseek_v3");
    s->version = "0.1.0";
    s->start_ns = 1 * NS;
    s->dims = &g_dims;
    s->model_path = "/models/ds";
    s->backend = "cpu";
    snprintf(s->backend_desc, sizeof s->backend_desc, "cpu: 16 threads");
    s->loaded = 1;
    s->healthy = 1;
    s->load_done = 1000;
    s->load_total = 1000;
    s->clients = 3;
    s->clients_total = 10;
    s->clients_refused = 2;
    s->requests = 500;
    s->tokens = 4000;
    s->in_flight = 4;
    s->batches = 100;
    s->batch_tokens = 3000;
    s->errors[-MOED_E_INVAL] = 7;
    s->errors[-MOED_E_BUSY] = 2;
    s->busy_ns = 2500000000ull; /* 2.5 s of 10 s */
    s->loop_spin_us = 1000;
    s->loop_spin_ns = 1500000000ull; /* 1.5 s */
    s->expert_hits = g_hits;
    s->n_expert_hits = 5;
    moed_stats_record_latency(s, 10.0);
    moed_stats_record_latency(s, 100.0);
    moed_stats_record_latency(s, 1000.0);
    moed_stats_record_latency(s, 1000.0);
}

static double jget(const cJSON *o, const char *path)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    const cJSON *cur = o;
    for (char *save = NULL, *k = strtok_r(buf, ".", &save); k; k = strtok_r(NULL, ".", &save)) {
        cur = cJSON_GetObjectItemCaseSensitive(cur, k);
        ck_assert_msg(cur != NULL, "JSON has no %s (at %s)", path, k);
    }
    ck_assert_msg(cJSON_IsNumber(cur), "JSON %s is not a number", path);
    return cur->valuedouble;
}

static const cJSON *jitem(const cJSON *o, const char *a, const char *b)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, a);
    ck_assert_msg(x != NULL, "JSON has no %s", a);
    if (!b)
        return x;
    x = cJSON_GetObjectItemCaseSensitive(x, b);
    ck_assert_msg(x != NULL, "JSON has no %s.%s", a, b);
    return x;
}

START_TEST(json_loaded)
{
    struct moed_stats s;
    fill(&s);
    char *txt = moed_status_json(&s, 11 * NS);
    ck_assert_ptr_nonnull(txt);
    cJSON *j = cJSON_Parse(txt);
    ck_assert_msg(j != NULL, "not JSON: %s", txt);

    ck_assert_str_eq(cJSON_GetStringValue(jitem(j, "version", NULL)), "0.1.0");
    ck_assert_double_eq_tol(jget(j, "uptime_s"), 10.0, 1e-9);
    ck_assert_str_eq(cJSON_GetStringValue(jitem(j, "model", "path")), "/models/ds");
    ck_assert_str_eq(cJSON_GetStringValue(jitem(j, "model", "family")), "deepseek_v3");
    ck_assert_double_eq(jget(j, "model.hidden"), 7168);
    ck_assert_double_eq(jget(j, "model.inter"), 2048);
    ck_assert_double_eq(jget(j, "model.n_experts"), 4);
    ck_assert_double_eq(jget(j, "model.top_k"), 2);
    ck_assert_double_eq(jget(j, "model.n_shared"), 1);
    ck_assert_double_eq(jget(j, "model.n_layers"), 61);
    ck_assert_double_eq(jget(j, "model.n_moe_layers"), 58);
    ck_assert_str_eq(cJSON_GetStringValue(jitem(j, "backend", "name")), "cpu");
    ck_assert_str_eq(cJSON_GetStringValue(jitem(j, "backend", "description")), "cpu: 16 threads");
    ck_assert(cJSON_IsTrue(jitem(j, "backend", "healthy")));
    ck_assert(cJSON_IsTrue(jitem(j, "load", "loaded")));
    ck_assert_double_eq(jget(j, "load.done_bytes"), 1000);
    ck_assert_double_eq(jget(j, "load.total_bytes"), 1000);
    ck_assert_double_eq(jget(j, "load.fraction"), 1.0);
    ck_assert_double_eq(jget(j, "clients.connected"), 3);
    ck_assert_double_eq(jget(j, "clients.total"), 10);
    ck_assert_double_eq(jget(j, "clients.refused"), 2);
    ck_assert_double_eq(jget(j, "requests.served"), 500);
    ck_assert_double_eq(jget(j, "requests.tokens"), 4000);
    ck_assert_double_eq(jget(j, "requests.in_flight"), 4);
    /* errors: exactly the non-zero codes, by moed_errname */
    const cJSON *e = jitem(j, "requests", "errors");
    ck_assert_int_eq(cJSON_GetArraySize(e), 2);
    ck_assert_double_eq(jget(j, "requests.errors.inval"), 7);
    ck_assert_double_eq(jget(j, "requests.errors.busy"), 2);
    /* latency: samples 10, 100, 1000, 1000 us */
    ck_assert_double_eq(jget(j, "latency_us.count"), 4);
    ck_assert_double_eq_tol(jget(j, "latency_us.mean"), 527.5, 1e-9);
    double p50 = jget(j, "latency_us.p50"); /* rank 2 -> 100 us */
    ck_assert_msg(p50 >= 100 && p50 <= 100 * cbrt(2.0) + 1e-9, "p50 %g", p50);
    double p99 = jget(j, "latency_us.p99"); /* rank 4 -> 1000 us */
    ck_assert_msg(p99 >= 1000 && p99 <= 1000 * cbrt(2.0) + 1e-9, "p99 %g", p99);
    ck_assert_double_eq(jget(j, "latency_us.p999"), p99);
    ck_assert_double_eq(jget(j, "batches.count"), 100);
    ck_assert_double_eq_tol(jget(j, "batches.mean_tokens"), 30.0, 1e-12);
    ck_assert_double_eq_tol(jget(j, "busy_fraction"), 0.25, 1e-12);
    ck_assert_double_eq(jget(j, "loop_spin.us"), 1000);
    ck_assert_double_eq_tol(jget(j, "loop_spin.seconds"), 1.5, 1e-12);
    const cJSON *hits = jitem(j, "experts", "hits");
    ck_assert(cJSON_IsArray(hits));
    ck_assert_int_eq(cJSON_GetArraySize(hits), 5);
    for (int i = 0; i < 5; i++)
        ck_assert_double_eq(cJSON_GetArrayItem(hits, i)->valuedouble, (double)g_hits[i]);
    /* no GPU: kernel is null */
    ck_assert(cJSON_IsNull(jitem(j, "kernel", NULL)));
    cJSON_Delete(j);
    free(txt);
}
END_TEST

START_TEST(json_loading_and_gpu)
{
    struct moed_stats s;
    memset(&s, 0, sizeof s);
    s.version = "0.1.0";
    s.start_ns = 5 * NS;
    s.model_path = "/m";
    s.backend = "cuda";
    s.load_done = 250;
    s.load_total = 1000;
    s.heartbeat = 12345;
    s.heartbeat_age_ms = 3;
    char *txt = moed_status_json(&s, 4 * NS); /* clock before start: uptime 0 */
    ck_assert_ptr_nonnull(txt);
    cJSON *j = cJSON_Parse(txt);
    ck_assert_msg(j != NULL, "not JSON: %s", txt);
    ck_assert_double_eq(jget(j, "uptime_s"), 0);
    ck_assert_str_eq(cJSON_GetStringValue(jitem(j, "model", "path")), "/m");
    ck_assert(cJSON_IsNull(jitem(j, "model", "family")));
    ck_assert(cJSON_IsNull(jitem(j, "model", "n_experts")));
    ck_assert(cJSON_IsNull(jitem(j, "model", "n_moe_layers")));
    ck_assert(cJSON_IsFalse(jitem(j, "load", "loaded")));
    ck_assert_double_eq(jget(j, "load.fraction"), 0.25);
    ck_assert_int_eq(cJSON_GetArraySize(jitem(j, "requests", "errors")), 0);
    ck_assert_int_eq(cJSON_GetArraySize(jitem(j, "experts", "hits")), 0);
    ck_assert_double_eq(jget(j, "latency_us.p50"), 0);
    ck_assert_double_eq(jget(j, "latency_us.mean"), 0);
    ck_assert_double_eq(jget(j, "batches.mean_tokens"), 0);
    ck_assert_double_eq(jget(j, "busy_fraction"), 0);
    ck_assert_double_eq(jget(j, "kernel.heartbeat"), 12345);
    ck_assert_double_eq(jget(j, "kernel.heartbeat_age_ms"), 3);
    cJSON_Delete(j);
    free(txt);

    /* a NULL version and backend still render as valid JSON */
    s.version = NULL;
    s.backend = NULL;
    s.heartbeat = 0;
    txt = moed_status_json(&s, 6 * NS);
    j = cJSON_Parse(txt);
    ck_assert_msg(j != NULL, "not JSON: %s", txt);
    ck_assert(cJSON_IsNull(jitem(j, "version", NULL)));
    ck_assert_str_eq(cJSON_GetStringValue(jitem(j, "backend", "name")), "");
    ck_assert(cJSON_IsNull(jitem(j, "kernel", NULL)));
    cJSON_Delete(j);
    free(txt);
}
END_TEST

/* ------------------------------------------------------------ histogram */

static double ref_upper(int i) /* the documented scheme, written out again */
{
    return pow(2.0, i / 3.0);
}

START_TEST(bucket_bounds)
{
    struct moed_stats s;
    struct {
        double us;
        int bucket;
    } cases[] = {
        {0.0, 0},      {0.5, 0},        {1.0, 0},   {1.0000001, 1}, {2.0, 3},
        {2.0000001, 4}, {1024.0, 30},   {1000.0, 30}, {-5.0, 0},    {NAN, 0},
        {1e12, 63},    {3e6, 63},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        memset(&s, 0, sizeof s);
        moed_stats_record_latency(&s, cases[k].us);
        ck_assert_int_eq(s.lat_count, 1);
        for (int i = 0; i < MOED_LAT_BUCKETS; i++)
            ck_assert_msg(s.lat_hist[i] == (i == cases[k].bucket),
                          "%g us: bucket %d holds %llu, expected bucket %d", cases[k].us, i,
                          (unsigned long long)s.lat_hist[i], cases[k].bucket);
    }
    /* every interior bucket: its own upper bound lands in it, a hair more in the next */
    for (int i = 1; i < MOED_LAT_BUCKETS - 1; i++) {
        memset(&s, 0, sizeof s);
        moed_stats_record_latency(&s, ref_upper(i));
        moed_stats_record_latency(&s, ref_upper(i) * (1 + 1e-9));
        ck_assert_msg(s.lat_hist[i] == 1 && s.lat_hist[i + 1] == 1, "bound of bucket %d", i);
    }
}
END_TEST

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

START_TEST(percentiles_within_one_bucket)
{
    enum { N = 5000 };
    static double v[N];
    struct moed_stats s;
    memset(&s, 0, sizeof s);
    srand(1234);
    for (int i = 0; i < N; i++) { /* log-uniform 2 us .. 200 ms */
        v[i] = exp2(1.0 + 16.6 * rand() / (double)RAND_MAX);
        moed_stats_record_latency(&s, v[i]);
    }
    qsort(v, N, sizeof v[0], cmp_dbl);
    const double ps[] = {0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        size_t rank = (size_t)ceil(ps[k] * N);
        if (rank < 1)
            rank = 1;
        double exact = v[rank - 1];
        double got = moed_stats_latency_pct(&s, ps[k]);
        /* the bucket's upper bound: not below the exact value, less than one
         * bucket width (x 2^(1/3)) above it */
        ck_assert_msg(got >= exact && got < exact * cbrt(2.0) * (1 + 1e-12),
                      "p%g: got %g us, exact %g us", ps[k] * 100, got, exact);
    }
    /* uniform 1..1000 us: the familiar numbers */
    memset(&s, 0, sizeof s);
    for (int i = 1; i <= 1000; i++)
        moed_stats_record_latency(&s, i);
    const struct {
        double p, exact;
    } u[] = {{0.5, 500}, {0.99, 990}, {0.999, 999}};
    for (size_t k = 0; k < 3; k++) {
        double got = moed_stats_latency_pct(&s, u[k].p);
        ck_assert_msg(got >= u[k].exact && got < u[k].exact * cbrt(2.0), "p%g: %g", u[k].p,
                      got);
    }
    ck_assert_double_eq_tol(s.lat_sum_us, 500500.0, 1e-6);
    /* empty histogram and overflow */
    memset(&s, 0, sizeof s);
    ck_assert_double_eq(moed_stats_latency_pct(&s, 0.5), 0.0);
    moed_stats_record_latency(&s, 1e10);
    ck_assert_double_eq_tol(moed_stats_latency_pct(&s, 0.5), ref_upper(62), 1e-6);
}
END_TEST

/* ---------------------------------------------------------- Prometheus */

static regex_t re_sample, re_help, re_type;

static void compile_regexes(void)
{
    const char *lname = "[a-zA-Z_][a-zA-Z0-9_]*";
    const char *lval = "\"([^\"\\\\\n]|\\\\[\\\\\"n])*\"";
    char pat[1024];
    snprintf(pat, sizeof pat,
             "^([a-zA-Z_:][a-zA-Z0-9_:]*)(\\{%s=%s(,%s=%s)*\\})? "
             "(\\+Inf|-Inf|NaN|-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?)$",
             lname, lval, lname, lval);
    ck_assert_int_eq(regcomp(&re_sample, pat, REG_EXTENDED), 0);
    ck_assert_int_eq(regcomp(&re_help, "^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) [^\n]+$", REG_EXTENDED),
                     0);
    ck_assert_int_eq(regcomp(&re_type,
                             "^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram)$",
                             REG_EXTENDED),
                     0);
}

struct family {
    char name[96];
    char type[16];
    int help;
};

/* Check every line of a Prometheus text against the grammar and the
 * HELP/TYPE-before-samples rule; checks each histogram's buckets. */
static void check_exposition(const char *txt)
{
    static struct family fam[128];
    int nfam = 0;
    size_t n = strlen(txt);
    ck_assert_msg(n > 0 && txt[n - 1] == '\n', "text does not end with a newline");
    char *copy = strdup(txt);
    double last_le = -1, last_cum = -1, inf_cum = -1;
    int lineno = 0;
    for (char *save = NULL, *line = strtok_r(copy, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        lineno++;
        regmatch_t m[4];
        char name[96];
        if (line[0] == '#') {
            int is_help = regexec(&re_help, line, 2, m, 0) == 0;
            int is_type = !is_help && regexec(&re_type, line, 3, m, 0) == 0;
            ck_assert_msg(is_help || is_type, "line %d: bad comment: %s", lineno, line);
            snprintf(name, sizeof name, "%.*s", (int)(m[1].rm_eo - m[1].rm_so), line + m[1].rm_so);
            int f;
            for (f = 0; f < nfam && strcmp(fam[f].name, name); f++)
                ;
            if (f == nfam) {
                ck_assert(nfam < 128);
                memset(&fam[nfam], 0, sizeof fam[nfam]);
                snprintf(fam[nfam].name, sizeof fam[nfam].name, "%s", name);
                nfam++;
            }
            if (is_help) {
                fam[f].help = 1;
            } else {
                ck_assert_msg(fam[f].help, "line %d: TYPE before HELP for %s", lineno, name);
                snprintf(fam[f].type, sizeof fam[f].type, "%.*s", (int)(m[2].rm_eo - m[2].rm_so),
                         line + m[2].rm_so);
                if (!strcmp(fam[f].type, "counter"))
                    ck_assert_msg(strlen(name) > 6 && !strcmp(name + strlen(name) - 6, "_total"),
                                  "counter %s does not end in _total", name);
            }
            continue;
        }
        ck_assert_msg(regexec(&re_sample, line, 2, m, 0) == 0, "line %d: not a sample: %s",
                      lineno, line);
        snprintf(name, sizeof name, "%.*s", (int)(m[1].rm_eo - m[1].rm_so), line + m[1].rm_so);
        /* the family: the name itself, or a histogram's base name */
        int f;
        for (f = 0; f < nfam && strcmp(fam[f].name, name); f++)
            ;
        const char *suffix = NULL;
        if (f == nfam) {
            static const char *const sfx[] = {"_bucket", "_sum", "_count"};
            for (size_t k = 0; k < 3 && f == nfam; k++) {
                size_t ln = strlen(name), ls = strlen(sfx[k]);
                if (ln > ls && !strcmp(name + ln - ls, sfx[k]))
                    for (f = 0; f < nfam; f++)
                        if (strlen(fam[f].name) == ln - ls && !strncmp(fam[f].name, name, ln - ls) &&
                            !strcmp(fam[f].type, "histogram")) {
                            suffix = sfx[k];
                            break;
                        }
            }
        }
        ck_assert_msg(f < nfam && fam[f].type[0], "line %d: sample %s before its HELP/TYPE",
                      lineno, name);
        ck_assert_msg(strcmp(fam[f].type, "histogram") || suffix,
                      "line %d: bare histogram sample %s", lineno, name);
        double val = strtod(strrchr(line, ' ') + 1, NULL);
        if (suffix && !strcmp(suffix, "_bucket")) {
            const char *le = strstr(line, "le=\"");
            ck_assert_ptr_nonnull(le);
            double lev = strncmp(le + 4, "+Inf", 4) ? strtod(le + 4, NULL) : INFINITY;
            ck_assert_msg(lev > last_le, "line %d: le not increasing", lineno);
            ck_assert_msg(val >= last_cum, "line %d: bucket counts not cumulative", lineno);
            last_le = lev;
            last_cum = val;
            if (isinf(lev))
                inf_cum = val;
        } else if (suffix && !strcmp(suffix, "_count")) {
            ck_assert_msg(inf_cum >= 0, "histogram %s has no +Inf bucket", fam[f].name);
            ck_assert_msg(val == inf_cum, "_count %g != +Inf bucket %g", val, inf_cum);
            last_le = last_cum = inf_cum = -1;
        }
    }
    free(copy);
}

/* The value of the sample line that starts with `prefix` + ' ', or NAN. */
static double sample(const char *txt, const char *prefix)
{
    size_t n = strlen(prefix);
    for (const char *p = txt; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, prefix, n) && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return NAN;
}

START_TEST(prometheus_grammar_and_values)
{
    compile_regexes();
    struct moed_stats s;
    fill(&s);
    s.model_path = "/m/\"q\"\\x\ny"; /* every escape in a label value */
    char *t = moed_status_prometheus(&s, 11 * NS);
    ck_assert_ptr_nonnull(t);
    check_exposition(t);
    ck_assert_ptr_nonnull(strstr(t, "path=\"/m/\\\"q\\\"\\\\x\\ny\""));
    ck_assert_double_eq(sample(t, "moed_requests_total"), 500);
    ck_assert_double_eq(sample(t, "moed_tokens_total"), 4000);
    ck_assert_double_eq(sample(t, "moed_requests_in_flight"), 4);
    ck_assert_double_eq(sample(t, "moed_clients"), 3);
    ck_assert_double_eq(sample(t, "moed_clients_accepted_total"), 10);
    ck_assert_double_eq(sample(t, "moed_clients_refused_total"), 2);
    ck_assert_double_eq(sample(t, "moed_loaded"), 1);
    ck_assert_double_eq(sample(t, "moed_healthy"), 1);
    ck_assert_double_eq(sample(t, "moed_batches_total"), 100);
    ck_assert_double_eq(sample(t, "moed_batch_tokens_total"), 3000);
    ck_assert_double_eq_tol(sample(t, "moed_busy_fraction"), 0.25, 1e-9);
    ck_assert_double_eq_tol(sample(t, "moed_loop_spin_seconds_total"), 1.5, 1e-9);
    ck_assert_double_eq_tol(sample(t, "moed_busy_seconds_total"), 2.5, 1e-9);
    ck_assert_double_eq_tol(sample(t, "moed_uptime_seconds"), 10, 1e-9);
    ck_assert_double_eq(sample(t, "moed_errors_total{code=\"inval\"}"), 7);
    ck_assert_double_eq(sample(t, "moed_errors_total{code=\"busy\"}"), 2);
    ck_assert_double_eq(sample(t, "moed_errors_total{code=\"timeout\"}"), 0);
    ck_assert(isnan(sample(t, "moed_errors_total{code=\"ok\"}")));
    ck_assert_double_eq(sample(t, "moed_expert_hits_total{layer=\"0\",expert=\"2\"}"), 9);
    ck_assert_double_eq(sample(t, "moed_expert_hits_total{layer=\"0\",expert=\"4\"}"), 40);
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_count"), 4);
    ck_assert_double_eq_tol(sample(t, "moed_request_latency_seconds_sum"), 2110e-6, 1e-12);
    /* 10 us <= 16 us, 100 us <= 128 us, both 1000 us <= 1024 us */
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_bucket{le=\"8e-06\"}"), 0);
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_bucket{le=\"1.6e-05\"}"), 1);
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_bucket{le=\"0.000128\"}"), 2);
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_bucket{le=\"0.001024\"}"), 4);
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_bucket{le=\"+Inf\"}"), 4);
    ck_assert(isnan(sample(t, "moed_kernel_heartbeats_total"))); /* no GPU */
    free(t);

    /* still loading, with a GPU: no model info, kernel gauges present */
    memset(&s, 0, sizeof s);
    s.version = "0.1.0";
    s.backend = "cuda";
    s.heartbeat = 77;
    s.heartbeat_age_ms = 1500;
    s.load_done = 5;
    s.load_total = 10;
    moed_stats_record_latency(&s, 5e9); /* overflow bucket: only in +Inf */
    t = moed_status_prometheus(&s, 0);
    ck_assert_ptr_nonnull(t);
    check_exposition(t);
    ck_assert_ptr_null(strstr(t, "moed_model_info"));
    ck_assert_ptr_null(strstr(t, "moed_expert_hits_total"));
    ck_assert_double_eq(sample(t, "moed_loaded"), 0);
    ck_assert_double_eq(sample(t, "moed_load_done_bytes"), 5);
    ck_assert_double_eq(sample(t, "moed_load_total_bytes"), 10);
    ck_assert_double_eq(sample(t, "moed_kernel_heartbeats_total"), 77);
    ck_assert_double_eq_tol(sample(t, "moed_kernel_heartbeat_age_seconds"), 1.5, 1e-12);
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_bucket{le=\"1.048576\"}"), 0);
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_bucket{le=\"+Inf\"}"), 1);
    ck_assert_double_eq(sample(t, "moed_request_latency_seconds_count"), 1);
    free(t);
    regfree(&re_sample);
    regfree(&re_help);
    regfree(&re_type);
}
END_TEST

/* The STATUS frame cache: a flood that changes nothing is served the same
 * body; a visible counter moving, or the age passing, renders anew, and the
 * new body says so. */
START_TEST(status_cache)
{
    static struct moed_stats s;
    fill(&s);
    struct moed_status_cache sc = {0};
    const uint64_t age = 100 * 1000000ull;
    size_t len = 0, len2 = 0;
    const char *a = moed_status_json_cached(&sc, &s, 11 * NS, age, &len);
    ck_assert_ptr_nonnull(a);
    ck_assert_uint_eq(len, strlen(a));
    char *first = strdup(a);
    /* nothing visible changed, 50 ms later: the same rendering */
    ck_assert_ptr_eq(moed_status_json_cached(&sc, &s, 11 * NS + age / 2, age, &len2), a);
    ck_assert_uint_eq(len2, len);
    /* a request served: rendered again, with the new count */
    s.requests = 7;
    const char *b = moed_status_json_cached(&sc, &s, 11 * NS + age / 2, age, &len2);
    ck_assert_ptr_nonnull(b);
    ck_assert_str_ne(b, first);
    cJSON *j = cJSON_Parse(b);
    ck_assert_double_eq(cJSON_GetObjectItemCaseSensitive(
                            cJSON_GetObjectItemCaseSensitive(j, "requests"), "served")->valuedouble,
                        7);
    cJSON_Delete(j);
    char *second = strdup(b);
    /* an error counted, then a client refused: each renders again */
    s.errors[1]++;
    ck_assert_str_ne(moed_status_json_cached(&sc, &s, 11 * NS + age / 2, age, &len2), second);
    free(second);
    second = strdup(sc.body);
    s.clients_refused++;
    ck_assert_str_ne(moed_status_json_cached(&sc, &s, 11 * NS + age / 2, age, &len2), second);
    /* only the clock moved, past the age: rendered anew (uptime differs) */
    free(second);
    second = strdup(sc.body);
    ck_assert_str_ne(moed_status_json_cached(&sc, &s, 13 * NS, age, &len2), second);
    free(second);
    free(first);
    moed_status_cache_free(&sc);
    ck_assert_ptr_null(sc.body);
}
END_TEST

int main(void)
{
    Suite *su = suite_create("status");
    TCase *tc = tcase_create("status");
    tcase_add_test(tc, json_loaded);
    tcase_add_test(tc, json_loading_and_gpu);
    tcase_add_test(tc, bucket_bounds);
    tcase_add_test(tc, percentiles_within_one_bucket);
    tcase_add_test(tc, prometheus_grammar_and_values);
    tcase_add_test(tc, status_cache);
    suite_add_tcase(su, tc);
    return moed_check_run(su);
}
