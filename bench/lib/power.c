/* power.c - the GPU's energy counter and SM clock through NVML, loaded at
 * run time (power.h). The few NVML entry points used are declared here by
 * their documented signatures (NVML's header is not part of the CUDA
 * toolkit on the build machine). */
#include "power.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct nvml_device *nvml_device_t; /* nvmlDevice_t: an opaque handle */
enum { NVML_OK = 0, NVML_CLOCK_SM = 1, NVML_TEMPERATURE_GPU = 0 };
/* nvmlClocksEventReasons bits (NVML's clock event reasons, once "throttle
 * reasons"): the software power cap; software and hardware thermal slowdown */
#define REASON_SW_POWER_CAP 0x4ULL
#define REASON_THERMAL (0x20ULL | 0x40ULL)

/* every 10 ms: 60 s of samples at most, then the window keeps its first ones */
#define SAMPLE_NS 10000000L
#define MAX_SAMPLES 6000

struct bench_power {
    void *lib;
    nvml_device_t dev;
    int (*shutdown)(void);
    int (*energy)(nvml_device_t, unsigned long long *);     /* mJ */
    int (*clock)(nvml_device_t, int, unsigned *);           /* MHz */
    int (*power)(nvml_device_t, unsigned *);                /* mW */
    int (*limit)(nvml_device_t, unsigned *);                /* mW */
    const char *(*errstr)(int);
    int (*temp)(nvml_device_t, int, unsigned *);             /* deg C; optional */
    int (*reasons)(nvml_device_t, unsigned long long *);     /* optional */
    /* the open window */
    int open_window;
    pthread_t thr;
    atomic_int stop;
    unsigned long long e0;
    struct timespec t0;
    unsigned n;
    unsigned mhz[MAX_SAMPLES];
    unsigned mw[MAX_SAMPLES];
    unsigned n_temp, n_reasons, n_capped, n_thermal;
    unsigned long long reasons_any;
    unsigned temp_c[MAX_SAMPLES];
};

static const char *nv_err(const struct bench_power *pw, int r)
{
    const char *s = pw->errstr ? pw->errstr(r) : NULL;
    return s ? s : "unknown NVML error";
}

struct bench_power *bench_power_open(const char *pci_bus_id, const char *lib, char *err,
                                     size_t errlen)
{
    if (!lib)
        lib = "libnvidia-ml.so.1";
    struct bench_power *pw = calloc(1, sizeof *pw);
    if (!pw) {
        snprintf(err, errlen, "power: out of memory");
        return NULL;
    }
    pw->lib = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!pw->lib) {
        snprintf(err, errlen, "power: NVML not loaded (%s)", dlerror());
        free(pw);
        return NULL;
    }
    int (*init)(void) = (int (*)(void))dlsym(pw->lib, "nvmlInit_v2");
    int (*by_pci)(const char *, nvml_device_t *) =
        (int (*)(const char *, nvml_device_t *))dlsym(pw->lib, "nvmlDeviceGetHandleByPciBusId_v2");
    pw->shutdown = (int (*)(void))dlsym(pw->lib, "nvmlShutdown");
    pw->energy = (int (*)(nvml_device_t, unsigned long long *))dlsym(
        pw->lib, "nvmlDeviceGetTotalEnergyConsumption");
    pw->clock = (int (*)(nvml_device_t, int, unsigned *))dlsym(pw->lib, "nvmlDeviceGetClockInfo");
    pw->power = (int (*)(nvml_device_t, unsigned *))dlsym(pw->lib, "nvmlDeviceGetPowerUsage");
    pw->limit = (int (*)(nvml_device_t, unsigned *))dlsym(pw->lib, "nvmlDeviceGetEnforcedPowerLimit");
    pw->errstr = (const char *(*)(int))dlsym(pw->lib, "nvmlErrorString");
    pw->temp = (int (*)(nvml_device_t, int, unsigned *))dlsym(pw->lib, "nvmlDeviceGetTemperature");
    /* the reasons' entry point under its name since R535, else its older one */
    pw->reasons = (int (*)(nvml_device_t, unsigned long long *))dlsym(
        pw->lib, "nvmlDeviceGetCurrentClocksEventReasons");
    if (!pw->reasons)
        pw->reasons = (int (*)(nvml_device_t, unsigned long long *))dlsym(
            pw->lib, "nvmlDeviceGetCurrentClocksThrottleReasons");
    if (!init || !by_pci || !pw->shutdown || !pw->energy || !pw->clock || !pw->power ||
        !pw->limit) {
        snprintf(err, errlen, "power: %s lacks an entry point this bench uses", lib);
        goto fail;
    }
    int r = init();
    if (r != NVML_OK) {
        snprintf(err, errlen, "power: nvmlInit: %s", nv_err(pw, r));
        goto fail;
    }
    unsigned long long e;
    if ((r = by_pci(pci_bus_id, &pw->dev)) != NVML_OK ||
        (r = pw->energy(pw->dev, &e)) != NVML_OK) {
        snprintf(err, errlen, "power: GPU %s: %s", pci_bus_id, nv_err(pw, r));
        pw->shutdown();
        goto fail;
    }
    return pw;
fail:
    dlclose(pw->lib);
    free(pw);
    return NULL;
}

static void *sampler(void *arg)
{
    struct bench_power *pw = arg;
    do { /* a first sample at once: a short window has one too */
        unsigned mhz, mw;
        if (pw->n < MAX_SAMPLES && pw->clock(pw->dev, NVML_CLOCK_SM, &mhz) == NVML_OK &&
            pw->power(pw->dev, &mw) == NVML_OK) {
            pw->mhz[pw->n] = mhz;
            pw->mw[pw->n] = mw;
            pw->n++;
            unsigned t;
            if (pw->temp && pw->temp(pw->dev, NVML_TEMPERATURE_GPU, &t) == NVML_OK)
                pw->temp_c[pw->n_temp++] = t;
            unsigned long long r;
            if (pw->reasons && pw->reasons(pw->dev, &r) == NVML_OK) {
                pw->n_reasons++;
                pw->reasons_any |= r;
                pw->n_capped += (r & REASON_SW_POWER_CAP) != 0;
                pw->n_thermal += (r & REASON_THERMAL) != 0;
            }
        }
        struct timespec ts = {0, SAMPLE_NS};
        while (nanosleep(&ts, &ts) && errno == EINTR)
            ;
    } while (!atomic_load(&pw->stop));
    return NULL;
}

int bench_power_start(struct bench_power *pw, char *err, size_t errlen)
{
    if (pw->open_window) {
        snprintf(err, errlen, "power: a window is already open");
        return -1;
    }
    int r = pw->energy(pw->dev, &pw->e0);
    if (r != NVML_OK) {
        snprintf(err, errlen, "power: energy counter: %s", nv_err(pw, r));
        return -1;
    }
    clock_gettime(CLOCK_MONOTONIC, &pw->t0);
    pw->n = pw->n_temp = pw->n_reasons = pw->n_capped = pw->n_thermal = 0;
    pw->reasons_any = 0;
    atomic_store(&pw->stop, 0);
    if (pthread_create(&pw->thr, NULL, sampler, pw)) {
        snprintf(err, errlen, "power: cannot start the sampler thread");
        return -1;
    }
    pw->open_window = 1;
    return 0;
}

static int cmp_u(const void *a, const void *b)
{
    unsigned x = *(const unsigned *)a, y = *(const unsigned *)b;
    return x < y ? -1 : x > y;
}

int bench_power_stop(struct bench_power *pw, struct bench_power_window *out, char *err,
                     size_t errlen)
{
    if (!pw->open_window) {
        snprintf(err, errlen, "power: no window is open");
        return -1;
    }
    unsigned long long e1;
    int r = pw->energy(pw->dev, &e1);
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    atomic_store(&pw->stop, 1);
    pthread_join(pw->thr, NULL);
    pw->open_window = 0;
    if (r != NVML_OK) {
        snprintf(err, errlen, "power: energy counter: %s", nv_err(pw, r));
        return -1;
    }
    memset(out, 0, sizeof *out);
    out->seconds = (double)(t1.tv_sec - pw->t0.tv_sec) + (double)(t1.tv_nsec - pw->t0.tv_nsec) * 1e-9;
    out->joules = (double)(e1 - pw->e0) * 1e-3;
    out->watts = out->seconds > 0 ? out->joules / out->seconds : 0;
    unsigned lim;
    out->limit_w = pw->limit(pw->dev, &lim) == NVML_OK ? lim * 1e-3 : 0;
    out->samples = pw->n;
    if (pw->n) {
        qsort(pw->mhz, pw->n, sizeof pw->mhz[0], cmp_u);
        qsort(pw->mw, pw->n, sizeof pw->mw[0], cmp_u);
        out->sm_mhz_p50 = pw->mhz[pw->n / 2];
        out->sm_mhz_min = pw->mhz[0];
        out->sm_mhz_max = pw->mhz[pw->n - 1];
        out->draw_w_p50 = pw->mw[pw->n / 2] * 1e-3;
    }
    out->temp_c_p50 = out->temp_c_max = -1;
    if (pw->n_temp) {
        qsort(pw->temp_c, pw->n_temp, sizeof pw->temp_c[0], cmp_u);
        out->temp_c_p50 = pw->temp_c[pw->n_temp / 2];
        out->temp_c_max = pw->temp_c[pw->n_temp - 1];
    }
    out->capped_share = out->thermal_share = -1;
    if (pw->n_reasons) {
        out->capped_share = (double)pw->n_capped / pw->n_reasons;
        out->thermal_share = (double)pw->n_thermal / pw->n_reasons;
        out->reasons_any = pw->reasons_any;
    }
    return 0;
}

void bench_power_close(struct bench_power *pw)
{
    if (!pw)
        return;
    if (pw->open_window) {
        atomic_store(&pw->stop, 1);
        pthread_join(pw->thr, NULL);
    }
    pw->shutdown();
    dlclose(pw->lib);
    free(pw);
}
