/* test_engine_stages.c - the per-request stage timing the engine and server
 * record (moed_stats_record_stages) and its rendering in /status and
 * /metrics.
 *
 * References are computed here from the documented definitions: each stage
 * is the span between two consecutive timestamps (0 when out of order),
 * "total" runs from the first to the last, "added" is total - backend;
 * "kernel" is the batch's kernel time and "added_kernel" total - kernel, both
 * sampled only for requests with a known kernel time (their own count);
 * percentiles are the exact order statistic of rank ceil(p * n) over the
 * stage's last min(samples, MOED_STAGE_WINDOW) samples; means are over every
 * sample.
 */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "stats.h"
#include "check_main.h"

static const char *const names[MOED_STAGE__COUNT] = {
    "recv", "submit", "backend", "reply", "write", "total", "added", "kernel", "added_kernel"};

static struct moed_stats *new_stats(void)
{
    struct moed_stats *s = calloc(1, sizeof *s);
    ck_assert_ptr_nonnull(s);
    s->version = "0.1.0";
    s->backend = "cpu";
    return s;
}

/* One request with stages of the given lengths (ns), starting at t0, whose
 * batch's kernel time was `kernel` (0: not known). */
static void record_k(struct moed_stats *s, uint64_t t0, uint64_t recv, uint64_t submit,
                     uint64_t backend, uint64_t reply, uint64_t write, uint64_t kernel)
{
    struct moed_req_times t;
    t.rx_ns = t0;
    t.complete_ns = t.rx_ns + recv;
    t.submit_ns = t.complete_ns + submit;
    t.done_ns = t.submit_ns + backend;
    t.reply_ns = t.done_ns + reply;
    t.kernel_ns = kernel;
    moed_stats_record_stages(s, &t, t.reply_ns + write);
}

static void record(struct moed_stats *s, uint64_t t0, uint64_t recv, uint64_t submit,
                   uint64_t backend, uint64_t reply, uint64_t write)
{
    record_k(s, t0, recv, submit, backend, reply, write, 0);
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
        if (i >= MOED_STAGE_KERNEL) { /* their own sample count */
            ck_assert_double_eq(jnum(st, names[i], "count"), 0);
            ck_assert_double_eq(jnum(st, names[i], "window"), 0);
        }
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
        "# TYPE moed_request_stage_seconds histogram\n",
        /* recv: 1 us and 3 us */
        "moed_request_stage_seconds_bucket{stage=\"recv\",le=\"1e-06\"} 1\n",
        "moed_request_stage_seconds_bucket{stage=\"recv\",le=\"3.1748021e-06\"} 2\n",
        "moed_request_stage_seconds_bucket{stage=\"recv\",le=\"+Inf\"} 2\n",
        "moed_request_stage_seconds_count{stage=\"recv\"} 2\n",
        "moed_request_stage_seconds_sum{stage=\"backend\"} 0.0004\n",
        "moed_request_stage_seconds_sum{stage=\"added\"} 2.6e-05\n",
        /* total: 110 us and 316 us */
        "moed_request_stage_seconds_bucket{stage=\"total\",le=\"0.000101593667\"} 0\n",
        "moed_request_stage_seconds_bucket{stage=\"total\",le=\"0.000128\"} 1\n",
        "moed_request_stage_seconds_bucket{stage=\"total\",le=\"0.000256\"} 1\n",
        "moed_request_stage_seconds_bucket{stage=\"total\",le=\"0.000322539789\"} 2\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        ck_assert_msg(strstr(txt, want[i]) != NULL, "metrics lack %s in\n%s", want[i], txt);
    ck_assert_ptr_null(strstr(txt, "_p50_seconds")); /* histograms, not percentile gauges */
    for (int i = 0; i < MOED_STAGE__COUNT; i++) {
        char line[128];
        snprintf(line, sizeof line, "moed_request_stage_seconds_count{stage=\"%s\"} ", names[i]);
        ck_assert_msg(strstr(txt, line) != NULL, "metrics lack %s", line);
    }
    free(txt);
    free(s);
}
END_TEST

/* The kernel stages get a sample only from requests with a known kernel
 * time: the others leave their sums, windows and count alone. */
START_TEST(kernel_stages_only_with_kernel_time)
{
    struct moed_stats *s = new_stats();
    record(s, 1000, 1000, 2000, 100000, 3000, 4000);                  /* total 110 us */
    ck_assert_uint_eq(s->stage_count, 1);
    ck_assert_uint_eq(s->stage_kernel_count, 0);
    ck_assert_uint_eq(moed_stats_stage_samples(s, MOED_STAGE_TOTAL), 1);
    ck_assert_uint_eq(moed_stats_stage_samples(s, MOED_STAGE_KERNEL), 0);
    ck_assert_uint_eq(moed_stats_stage_samples(s, MOED_STAGE_ADDED_KERNEL), 0);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_KERNEL], 0);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_ADDED_KERNEL], 0);
    ck_assert_double_eq(moed_stats_stage_pct(s, MOED_STAGE_KERNEL, 0.5), 0.0);
    ck_assert_double_eq(moed_stats_stage_pct(s, MOED_STAGE_ADDED_KERNEL, 0.99), 0.0);

    record_k(s, 2000000, 3000, 2000, 300000, 5000, 6000, 250000);     /* total 316 us */
    record_k(s, 5000000, 1000, 1000, 50000, 1000, 1000, 20000);       /* total 54 us */
    ck_assert_uint_eq(s->stage_count, 3);
    ck_assert_uint_eq(s->stage_kernel_count, 2);
    ck_assert_uint_eq(moed_stats_stage_samples(s, MOED_STAGE_ADDED), 3);
    ck_assert_uint_eq(moed_stats_stage_samples(s, MOED_STAGE_ADDED_KERNEL), 2);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_KERNEL], 270000);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_ADDED_KERNEL], 66000 + 34000);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_BACKEND], 450000); /* every request */
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_TOTAL], 480000);
    /* ranks over the 2 kernel samples, not the 3 requests */
    ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_KERNEL, 0.5), 20.0, 1e-9);
    ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_KERNEL, 0.99), 250.0, 1e-9);
    ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_ADDED_KERNEL, 0.5), 34.0, 1e-9);
    ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_ADDED_KERNEL, 0.99), 66.0, 1e-9);
    ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_TOTAL, 0.5), 110.0, 1e-9);

    /* a kernel time over the total (clocks of two devices): added_kernel 0 */
    record_k(s, 9000000, 0, 0, 10000, 0, 0, 20000);
    ck_assert_uint_eq(s->stage_kernel_count, 3);
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_ADDED_KERNEL], 100000);
    ck_assert_double_eq(moed_stats_stage_pct(s, MOED_STAGE_ADDED_KERNEL, 0.0), 0.0);

    /* /status: the kernel stages say how many samples they hold */
    s->start_ns = 1;
    char *txt = moed_status_json(s, 1000000001ull);
    ck_assert_ptr_nonnull(txt);
    cJSON *j = cJSON_Parse(txt);
    ck_assert_ptr_nonnull(j);
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(j, "stages_us");
    ck_assert_double_eq(jnum(st, "count", NULL), 4);
    ck_assert_double_eq(jnum(st, "window", NULL), 4);
    ck_assert_double_eq(jnum(st, "kernel", "count"), 3);
    ck_assert_double_eq(jnum(st, "kernel", "window"), 3);
    ck_assert_double_eq_tol(jnum(st, "kernel", "p50"), 20.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "kernel", "p99"), 250.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "kernel", "mean"), 290.0 / 3, 1e-9);
    ck_assert_double_eq(jnum(st, "added_kernel", "count"), 3);
    ck_assert_double_eq_tol(jnum(st, "added_kernel", "p50"), 34.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "added_kernel", "p99"), 66.0, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "added_kernel", "mean"), 100.0 / 3, 1e-9);
    ck_assert_double_eq_tol(jnum(st, "backend", "mean"), 460.0 / 4, 1e-9);
    /* the other stages keep their shape */
    ck_assert_ptr_null(cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(st, "backend"), "count"));
    cJSON_Delete(j);
    free(txt);

    txt = moed_status_prometheus(s, 1000000001ull);
    ck_assert_ptr_nonnull(txt);
    const char *want[] = {
        "moed_request_stage_seconds_count{stage=\"total\"} 4\n",
        "moed_request_stage_seconds_count{stage=\"kernel\"} 3\n",
        "moed_request_stage_seconds_sum{stage=\"kernel\"} 0.00029\n",
        "moed_request_stage_seconds_sum{stage=\"added_kernel\"} 0.0001\n",
        /* kernel: 20, 20, 250 us; added_kernel: 66, 34, 0 us */
        "moed_request_stage_seconds_bucket{stage=\"kernel\",le=\"2.01587368e-05\"} 2\n",
        "moed_request_stage_seconds_bucket{stage=\"kernel\",le=\"0.000256\"} 3\n",
        "moed_request_stage_seconds_bucket{stage=\"added_kernel\",le=\"1e-06\"} 1\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        ck_assert_msg(strstr(txt, want[i]) != NULL, "metrics lack %s in\n%s", want[i], txt);
    free(txt);
    free(s);
}
END_TEST

/* The kernel stages' ring advances with their own samples: after more than a
 * window of requests, some without a kernel time, the percentiles are over
 * the last MOED_STAGE_WINDOW kernel samples. */
START_TEST(kernel_window_keeps_the_last_samples)
{
    struct moed_stats *s = new_stats();
    enum { N = 2 * MOED_STAGE_WINDOW + 300 };
    static uint64_t kern[N], added[N];
    size_t nk = 0;
    uint64_t lcg = 11;
    for (size_t i = 0; i < N; i++) {
        lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t b = 1000000 + (lcg >> 20) % 100000, k = i % 3 ? b - (lcg >> 40) % 50000 : 0;
        record_k(s, 1000000000ull + i * 10000000ull, 7, 10, b, 20, 30, k);
        if (k) {
            kern[nk] = k;
            added[nk++] = 7 + 10 + b + 20 + 30 - k;
        }
    }
    ck_assert_uint_eq(s->stage_count, N);
    ck_assert_uint_eq(s->stage_kernel_count, nk);
    ck_assert_uint_gt(nk, MOED_STAGE_WINDOW);
    const double ps[] = {0.0, 0.01, 0.5, 0.99, 1.0};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_KERNEL, ps[k]),
                                ref_pct(kern + nk - MOED_STAGE_WINDOW, MOED_STAGE_WINDOW, ps[k]),
                                1e-9);
        ck_assert_double_eq_tol(moed_stats_stage_pct(s, MOED_STAGE_ADDED_KERNEL, ps[k]),
                                ref_pct(added + nk - MOED_STAGE_WINDOW, MOED_STAGE_WINDOW, ps[k]),
                                1e-9);
    }
    uint64_t sum = 0;
    for (size_t i = 0; i < nk; i++)
        sum += kern[i];
    ck_assert_uint_eq(s->stage_sum_ns[MOED_STAGE_KERNEL], sum);
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
    tcase_add_test(tc, kernel_stages_only_with_kernel_time);
    tcase_add_test(tc, kernel_window_keeps_the_last_samples);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return moed_check_run(suite());
}
