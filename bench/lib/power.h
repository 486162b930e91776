/* power.h - energy and clock of the GPU while the benchmark runs (issue 12:
 * joules per GB moved per T, the SM clock under the board's power cap).
 *
 * NVML is loaded at run time (libnvidia-ml.so.1 comes with the driver, so the
 * bench builds where no driver is installed): bench_power_open fails with a
 * message, and the bench prints no energy column, where it is missing.
 *
 * A window: bench_power_start reads the board's energy counter and starts a
 * sampler thread (power draw and SM clock at once, then every 10 ms);
 * bench_power_stop
 * joins it and reads the counter again. The energy is the counter's
 * difference (millijoules since the driver loaded), not an integral of the
 * samples; the samples give the clock's spread, the instantaneous draw, the
 * GPU's temperature and why the clock is held below its maximum (NVML's
 * clock event reasons: the power cap, a thermal slowdown). The temperature
 * and the reasons are optional entry points: where NVML lacks them, their
 * fields are -1.
 */
#ifndef MOED_BENCH_POWER_H
#define MOED_BENCH_POWER_H

#include <stddef.h>

struct bench_power;

struct bench_power_window {
    double seconds;     /* wall time of the window */
    double joules;      /* the energy counter's difference */
    double watts;       /* joules / seconds */
    double limit_w;     /* the enforced power limit */
    double sm_mhz_p50;  /* SM clock over the samples: median, least, most */
    double sm_mhz_min, sm_mhz_max;
    double draw_w_p50;  /* instantaneous power draw over the samples: median */
    double temp_c_p50;  /* GPU temperature over the samples, deg C: median, most */
    double temp_c_max;
    double capped_share;  /* share of samples with the clock held by the power cap */
    double thermal_share; /* ... by a thermal slowdown (software or hardware) */
    unsigned long long reasons_any; /* every clock event reason any sample saw (OR) */
    unsigned samples;
};

/* NVML (the library at `lib`, NULL: the driver's libnvidia-ml.so.1) for the
 * GPU at pci_bus_id ("0000:19:00.0", cudaDeviceGetPCIBusId's form); NULL
 * with err set when NVML or the GPU's energy counter is unavailable */
struct bench_power *bench_power_open(const char *pci_bus_id, const char *lib, char *err,
                                     size_t errlen);
/* 0, or -1 with err set (a window already open, the counter unreadable) */
int bench_power_start(struct bench_power *pw, char *err, size_t errlen);
int bench_power_stop(struct bench_power *pw, struct bench_power_window *out, char *err,
                     size_t errlen);
void bench_power_close(struct bench_power *pw);

#endif
