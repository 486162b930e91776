/* test_power.c - bench/lib/power.h against a fake NVML (tests/unit/
 * fake_nvml.c, built beside this test; the CI machine has no driver): a
 * library that is not there, one without the energy counter, a failing
 * init, an unknown GPU and a failing counter each give their error; a
 * window's joules are the counter's difference, its watts joules over its
 * seconds, its samples the clock, draw, temperature and clock event reasons
 * the library reports (-1 where an older library lacks the temperature, the
 * reasons found under their older name); stop without start and a second
 * start are refused; closing with a window open joins the sampler. */
#include <check.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "power.h"
#include "check_main.h"

static char fake[PATH_MAX], partial[PATH_MAX], old[PATH_MAX];
static const char GPU[] = "0000:01:00.0";

static void find_fakes(void)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    ck_assert(n > 0);
    exe[n] = 0;
    const char *dir = dirname(exe);
    snprintf(fake, sizeof fake, "%s/libfake_nvml.so", dir);
    snprintf(partial, sizeof partial, "%s/libfake_nvml_partial.so", dir);
    snprintf(old, sizeof old, "%s/libfake_nvml_old.so", dir);
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

START_TEST(test_open_errors)
{
    find_fakes();
    char err[256] = "";
    ck_assert_ptr_null(bench_power_open(GPU, "/nonexistent/libnvidia-ml.so.1", err, sizeof err));
    ck_assert_msg(strstr(err, "power: NVML not loaded (") == err, "%s", err);
    ck_assert_ptr_null(bench_power_open(GPU, partial, err, sizeof err));
    char want[PATH_MAX + 64];
    snprintf(want, sizeof want, "power: %s lacks an entry point this bench uses", partial);
    ck_assert_str_eq(err, want);
    ck_assert_ptr_null(bench_power_open("0000:09:00.0", fake, err, sizeof err));
    ck_assert_str_eq(err, "power: GPU 0000:09:00.0: Not Found");
    setenv("FAKE_NVML_INIT_FAIL", "1", 1);
    ck_assert_ptr_null(bench_power_open(GPU, fake, err, sizeof err));
    ck_assert_str_eq(err, "power: nvmlInit: fake init failure");
    unsetenv("FAKE_NVML_INIT_FAIL");
    setenv("FAKE_NVML_ENERGY_FAIL", "1", 1);
    ck_assert_ptr_null(bench_power_open(GPU, fake, err, sizeof err));
    ck_assert_str_eq(err, "power: GPU 0000:01:00.0: fake energy failure");
    unsetenv("FAKE_NVML_ENERGY_FAIL");
}
END_TEST

/* one window of pw while the fake reports the clock event reasons `reasons` */
static void window_with_reasons(struct bench_power *pw, const char *reasons,
                                struct bench_power_window *w)
{
    char err[256] = "";
    setenv("FAKE_NVML_REASONS", reasons, 1);
    ck_assert_int_eq(bench_power_start(pw, err, sizeof err), 0);
    ck_assert_msg(bench_power_stop(pw, w, err, sizeof err) == 0, "%s", err);
    unsetenv("FAKE_NVML_REASONS");
}

START_TEST(test_window)
{
    find_fakes();
    char err[256] = "";
    struct bench_power *pw = bench_power_open(GPU, fake, err, sizeof err);
    ck_assert_msg(pw != NULL, "%s", err);
    struct bench_power_window w;
    ck_assert_int_eq(bench_power_stop(pw, &w, err, sizeof err), -1);
    ck_assert_str_eq(err, "power: no window is open");
    for (int round = 0; round < 2; round++) { /* a window, and one after it */
        ck_assert_int_eq(bench_power_start(pw, err, sizeof err), 0);
        ck_assert_int_eq(bench_power_start(pw, err, sizeof err), -1);
        ck_assert_str_eq(err, "power: a window is already open");
        sleep_ms(30);
        ck_assert_int_eq(bench_power_stop(pw, &w, err, sizeof err), 0);
        /* one counter read at each end: 1000 mJ apart */
        ck_assert_double_eq(w.joules, 1.0);
        ck_assert(w.seconds > 0);
        ck_assert_double_eq_tol(w.watts * w.seconds, w.joules, 1e-9);
        ck_assert_double_eq(w.limit_w, 700.0);
        ck_assert_uint_ge(w.samples, 1);
        ck_assert_double_eq(w.sm_mhz_p50, 1755.0);
        ck_assert_double_eq(w.sm_mhz_min, 1755.0);
        ck_assert_double_eq(w.sm_mhz_max, 1755.0);
        ck_assert_double_eq(w.draw_w_p50, 250.0);
        ck_assert_double_eq(w.temp_c_p50, 61.0);
        ck_assert_double_eq(w.temp_c_max, 61.0);
        ck_assert_double_eq(w.capped_share, 1.0); /* the fake's default: 0x4 */
        ck_assert_double_eq(w.thermal_share, 0.0);
        ck_assert_uint_eq(w.reasons_any, 0x4);
    }
    /* a hardware thermal slowdown (0x40), no power cap; then an idle GPU */
    window_with_reasons(pw, "0x40", &w);
    ck_assert_double_eq(w.capped_share, 0.0);
    ck_assert_double_eq(w.thermal_share, 1.0);
    ck_assert_uint_eq(w.reasons_any, 0x40);
    window_with_reasons(pw, "0x1", &w);
    ck_assert_double_eq(w.capped_share, 0.0);
    ck_assert_double_eq(w.thermal_share, 0.0);
    ck_assert_uint_eq(w.reasons_any, 0x1);
    /* a counter that fails at a window's start or end */
    setenv("FAKE_NVML_ENERGY_FAIL", "1", 1);
    ck_assert_int_eq(bench_power_start(pw, err, sizeof err), -1);
    ck_assert_str_eq(err, "power: energy counter: fake energy failure");
    unsetenv("FAKE_NVML_ENERGY_FAIL");
    ck_assert_int_eq(bench_power_start(pw, err, sizeof err), 0);
    setenv("FAKE_NVML_ENERGY_FAIL", "1", 1);
    ck_assert_int_eq(bench_power_stop(pw, &w, err, sizeof err), -1);
    ck_assert_str_eq(err, "power: energy counter: fake energy failure");
    unsetenv("FAKE_NVML_ENERGY_FAIL");
    /* the failed stop closed the window: a new one opens */
    ck_assert_int_eq(bench_power_start(pw, err, sizeof err), 0);
    bench_power_close(pw); /* with the window open: the sampler is joined */
}
END_TEST

/* an older driver's NVML: no temperature, the reasons under their old name */
START_TEST(test_old_library)
{
    find_fakes();
    char err[256] = "";
    struct bench_power *pw = bench_power_open(GPU, old, err, sizeof err);
    ck_assert_msg(pw != NULL, "%s", err);
    struct bench_power_window w;
    window_with_reasons(pw, "0x24", &w); /* the power cap and a software thermal slowdown */
    ck_assert_uint_ge(w.samples, 1);
    ck_assert_double_eq(w.sm_mhz_p50, 1755.0);
    ck_assert_double_eq(w.temp_c_p50, -1.0);
    ck_assert_double_eq(w.temp_c_max, -1.0);
    ck_assert_double_eq(w.capped_share, 1.0);
    ck_assert_double_eq(w.thermal_share, 1.0);
    ck_assert_uint_eq(w.reasons_any, 0x24);
    bench_power_close(pw);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("power");
    TCase *tc = tcase_create("power");
    tcase_add_test(tc, test_open_errors);
    tcase_add_test(tc, test_window);
    tcase_add_test(tc, test_old_library);
    suite_add_tcase(s, tc);
    return moed_check_run(s);
}
