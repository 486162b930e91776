/* test_engine_stages.c - the per-request stage timing the engine and server
 * record (moed_stats_record_stages) and its rendering in /status and
 * /metrics.
 *
 * References are computed here from the documented definitions: each stage
 * is the span between two consecutive timestamps (0 when out of order),
 * "total" runs from the first to the last, "added" is total - backend;
 * percentiles are the exact order statistic of rank ceil(p * n) over the last
 * min(count, MOED_STAGE_WINDOW) requests; means are over every request.
 */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "stats.h"

static const char *const names[MOED_STAGE__COUNT] = {"recv",  "submit", "backend", "reply",
                                                     "write", "total",  "added"};

static struct moed_stats *new_stats(void)
{
    struct moed_stats *s = calloc(1, sizeof *s);
    ck_assert_ptr_nonnull(s);
    s->version = "0.1.0";
    s->backend = "cpu";
    return s;
}

/* One request with stages of the given lengths (ns), starting at t0. */
static void record(struct moed_stats *s, uint64_t t0, uint64_t recv, uint64_t submit,
                   uint64_t backend, uint64_t reply, uint64_t write)
{
    struct moed_req_times t;
    t.rx_ns = t0;
    t.complete_ns = t.rx_ns + recv;
    t.submit_ns = t.complete_ns + submit;
    t.done_ns = t.submit_ns + backend;
    t.reply_ns = t.done_ns + reply;
    moed_stats_record_stages(s, &t, t.reply_ns + write);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Reference percentile (us) of v[0..n) in ns. */
static double ref_pct(const uint64_t *v, size_t n, double p)
{
    uint64_t *c = malloc(n * sizeof *c);
    ck_assert_ptr_nonnull(c);
    memcpy(c, v, n * sizeof *c);
    qsort(c, n, sizeof *c, cmp_u64);
    size_t rank = (size_t)ceil(p * (double)n);
    if (rank < 1)
        rank = 1;
    double r = (double)c[rank - 1] / 1000.0;
    free(c);
    return r;
}

START_TEST(spans_and_derived_stages)
{
    struct moed_stats *s = new_stats();
    record(s, 1000000, 2000, 3000, 50000, 4000, 6000);
    ck_assert_uint_eq(s->stage_count, 1);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_RECV], 2000);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_SUBMIT], 3000);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_BACKEND], 50000);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_REPLY], 4000);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_WRITE], 6000);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_TOTAL], 65000);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_ADDED], 15000);
    ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_ADDED, 0.5), 15.0, 1e-9);
    ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_BACKEND, 0.99), 50.0, 1e-9);
    for (int i = 0; i < MOED_STAGE__COUNT; i++)
        ck_assert_str_eq(moed_stage_name((enum moed_stage)i), names[i]);
    free(s);
}
END_TEST

START_TEST(out_of_order_is_zero_and_saturates)
{
    struct moed_stats *s = new_stats();
    struct moed_req_times t = {.rx_ns = 100, .complete_ns = 50, .submit_ns = 60, .done_ns = 40,
                               .reply_ns = 70};
    moed_stats_record_stages(s, &t, 65);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_RECV], 0);    /* 50 < 100 */
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_SUBMIT], 10);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_BACKEND], 0); /* 40 < 60 */
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_REPLY], 30);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_WRITE], 0);   /* 65 < 70 */
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_TOTAL], 0);   /* 65 < 100 */
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_ADDED], 0);
    /* A 5 s backend: the sum is exact, the window sample saturates at 2^32-1 ns. */
    record(s, 1000, 0, 0, 5000000000ull, 0, 0);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_BACKEND], 5000000000ull);
    ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_BACKEND, 1.0),
                            (double)UINT32_MAX / 1000.0, 1e-6);
    free(s);
}
END_TEST

START_TEST(window_keeps_the_last_requests)
{
    struct moed_stats *s = new_stats();
    ck_assert_double_eq(moed_stats_stage_pct(s, MOED_STAGE_TOTAL, 0.5), 0.0);
    enum { N = MOED_STAGE_WINDOW + 700 };
    static uint64_t recv[N], total[N];
    uint64_t lcg = 7;
    for (size_t i = 0; i < N; i++) {
        lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t r = (lcg >> 40) % 500000, b = 1000000 + (lcg >> 20) % 1000;
        recv[i] = r;
        total[i] = r + 10 + b + 20 + 30;
        record(s, 1000000000ull + i * 10000000ull, r, 10, b, 20, 30);
    }
    ck_assert_uint_eq(s->stage_count, N);
    const uint64_t *last_recv = recv + (N - MOED_STAGE_WINDOW);
    const uint64_t *last_total = total + (N - MOED_STAGE_WINDOW);
    const double ps[] = {0.0, 0.01, 0.5, 0.99, 1.0};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_RECV, ps[k]),
                                ref_pct(last_recv, MOED_STAGE_WINDOW, ps[k]), 1e-9);
        ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_TOTAL, ps[k]),
                                ref_pct(last_total, MOED_STAGE_WINDOW, ps[k]), 1e-9);
    }
    uint64_t sum = 0;
    for (size_t i = 0; i < N; i++)
        sum += recv[i];
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_RECV], sum);
    free(s);
}
END_TEST

static double jnum(const cJSON *o, const char *a, const char *b)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, a);
    ck_assert_msg(x != NULL, "JSON has no %s", a);
    if (b) {
        x = cJSON_GetObjectItemCaseSensitive(x, b);
        ck_assert_msg(x != NULL, "JSON has no %s.%s", a, b);
    }
    ck_assert(cJSON_IsNumber(x));
    return x->valuedouble;
}

START_TEST(json_and_metrics)
{
    struct moed_stats *s = new_stats();
    s->start_ns = 1;
    /* empty: every stage present, zeros */
    char *txt = moed_status_json(s, 1000000001ull);
    ck_assert_ptr_nonnull(txt);
    cJSON *j = cJSON_Parse(txt);
    ck_assert_ptr_nonnull(j);
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(j, "stages_us");
    ck_assert(cJSON_IsObject(st));
    ck_assert_double_eq(jnum(st, "count", NULL), 0);
    ck_assert_double_eq(jnum(st, "window", NULL), 0);
    for (int i = 0; i < MOED_STAGE__COUNT; i++) {
        ck_assert_double_eq(jnum(st, names[i], "p50"), 0);
        ck_assert_double_eq(jnum(st, names[i], "p99"), 0);
        ck_assert_double_eq(jnum(st, names[i], "mean"), 0);
    }
    cJSON_Delete(j);
    free(txt);

    record(s, 1000, 1000, 2000, 100000, 3000, 4000);
    record(s, 2000000, 3000, 2000, 300000, 5000, 6000);
    txt = moed_status_json(s, 1000000001ull);
    j = cJSON_Parse(txt);
    ck_assert_ptr_nonnull(j);
    st = cJSON_GetObjectItemCaseSensitive(j, "stages_us");
    ck_assert_double_eq(jnum(st, "count", NULL), 2);
    ck_assert_double_eq(jnum(st, "window", NULL), 2);
    ck_assert_double_eq_tol(jnum(st, "recv", "p50"), 1.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "recv", "p99"), 3.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "recv", "mean"), 2.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "backend", "mean"), 200.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "total", "p99"), 316.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "added", "p50"), 10.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "added", "mean"), 13.0, 1e-9);
    cJSON_Delete(j);
    free(txt);

    txt = moed_status_prometheus(s, 1000000001ull);
    ck_assert_ptr_nonnull(txt);
    const char *want[] = {
        "# TYPE moed_request_stage_samples_total counter\nmoed_request_stage_samples_total 2\n",
        "# TYPE moed_request_stage_seconds_total counter\n",
        "moed_request_stage_seconds_total{stage=\"backend\"} 0.0004\n",
        "moed_request_stage_seconds_total{stage=\"added\"} 2.6e-05\n",
        "# TYPE moed_request_stage_p50_seconds gauge\n",
        "moed_request_stage_p50_seconds{stage=\"recv\"} 1e-06\n",
        "# TYPE moed_request_stage_p99_seconds gauge\n",
        "moed_request_stage_p99_seconds{stage=\"total\"} 0.000316\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        ck_assert_msg(strstr(txt, want[i]) != NULL, "metrics lack %s in\n%s", want[i], txt);
    for (int i = 0; i < MOED_STAGE__COUNT; i++) {
        char line[128];
        snprintf(line, sizeof line, "moed_request_stage_p99_seconds{stage=\"%s\"} ", names[i]);
        ck_assert_msg(strstr(txt, line) != NULL, "metrics lack %s", line);
    }
    free(txt);
    free(s);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("engine_stages");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, spans_and_derived_stages);
    tcase_add_test(tc, out_of_order_is_zero_and_saturates);
    tcase_add_test(tc, window_keeps_the_last_requests);
    tcase_add_test(tc, json_and_metrics);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
